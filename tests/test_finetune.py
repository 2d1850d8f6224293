"""train.init_from: fine-tuning from a Hugging Face GPT-2 or a run of ours (weights only, step 0, fresh optimizer),
resume winning over init_from, and the one-line errors around it. Tiny random models, offline, on a CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, one_line, run_cli, tiny_config
from gpt2train import cli
from gpt2train.checkpoint import CheckpointError
from gpt2train.config import ConfigError, dump_toml
from gpt2train.hf import HFConversionError, import_hf_to_run
from gpt2train.loading import load_for_inference
from gpt2train.training.loop import Trainer, train

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402 -- after the importorskip

transformers.logging.set_verbosity_error()


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny HF GPT-2 saved the way save_pretrained does: 2 layers, 32 wide, GPT-2's vocabulary."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=50257))
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def finetune_config(data, source, **train):
    cfg = tiny_config(data, **{"max_steps": 8, "lr": 3e-3, "warmup_steps": 0, "schedule": "constant", **train})
    cfg.train.init_from = str(source)
    cfg.eval.interval, cfg.eval.val_batches = 4, 0  # the whole val split: the same windows as `gpt2train eval`
    return cfg


def val_losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in records if r["kind"] == "val"]


def assert_same_weights(source, model):
    """Equal weights, the embedding's padded rows aside (never read; the run pads with zeros)."""
    vocab = source.config.vocab_size
    for (name, a), (_, b) in zip(source.state_dict().items(), model.state_dict().items()):
        if name in ("transformer.wte.weight", "lm_head.weight"):
            a, b = a[:vocab], b[:vocab]
        assert torch.equal(a, b), name


@pytest.fixture(scope="module")
def gpt2_data_short_val(tmp_path_factory):
    """Tiny Shakespeare in GPT-2 tokens with a val split of 2.1% (7,576 tokens) rather than 10%: the whole split
    is evaluated four times below, each window through a 50257-wide softmax. Its 236 windows of 32 are whole
    batches of 4, so the trainer (which reads whole batches) and `gpt2train eval` read the very same windows."""
    from gpt2train.data.prepare import prepare_shakespeare
    from gpt2train.eval.val import ValWindows

    out = tmp_path_factory.mktemp("gpt2_data_short_val")
    prepare_shakespeare(out, tokenizer="gpt2", val_fraction=0.021)
    assert len(ValWindows(out, 32)) % 4 == 0
    return out


@pytest.mark.slow
def test_finetune_from_hf_starts_at_the_imported_loss_and_falls(gpt2_data_short_val, hf_dir, tmp_path, capsys):
    gpt2_data = gpt2_data_short_val
    import_hf_to_run(hf_dir, tmp_path / "imported")
    status = cli.main(["eval", "--ckpt", str(tmp_path / "imported"), "--tasks", "val", "--data", str(gpt2_data),
                       "--device", "cpu", "--dtype", "float32", "--batch-size", "4"])
    assert status == 0, capsys.readouterr().err
    imported_val = json.loads((tmp_path / "imported" / "checkpoints" / "step_00000000" / "eval.json")
                              .read_text())["tasks"]["val"]["loss"]

    trainer = Trainer(finetune_config(gpt2_data, hf_dir), tmp_path / "run")
    try:
        assert trainer.state.step == 0 and trainer.optimizer.state_dict()["state"] == {}  # fresh optimizer
        assert trainer.cfg.model.n_layer == 2 and trainer.cfg.model.vocab_size == 50257
        first = trainer.evaluate()
        assert abs(first - imported_val) < 1e-4, (first, imported_val)
        out = trainer.fit()
    finally:
        trainer.close()
    logged = val_losses(tmp_path / "run")
    assert out["step"] == 8 and len(logged) == 2
    assert logged[0] < first and logged[-1] < logged[0], (first, logged)


@pytest.mark.slow
def test_a_conflicting_model_setting_is_one_line(gpt2_data, hf_dir, tmp_path):
    cfg = finetune_config(gpt2_data, hf_dir)
    cfg.model.n_layer = 3
    message = one_line(ConfigError, train, cfg, tmp_path / "run")
    assert "model.n_layer = 3" in message and "n_layer = 2" in message
    cfg = finetune_config(gpt2_data, hf_dir)
    cfg.model.dropout, cfg.model.attention = 0.1, "naive"  # not the weights' shape: the run's own
    cfg.train.max_steps = 1
    assert train(cfg, tmp_path / "run2")["step"] == 1


def test_init_from_a_run_of_ours_then_resume_auto_continues_the_finetune(char_data, tmp_path):
    base = tiny_config(char_data, max_steps=5)
    base.model.pad_vocab_multiple = 64  # the fine-tune pads to 8: the embedding is cut and padded again
    train(base, tmp_path / "base")
    source, _, _ = load_for_inference(tmp_path / "base")

    cfg = finetune_config(char_data, tmp_path / "base", max_steps=3)
    cfg.model.pad_vocab_multiple = 8
    cfg.eval.val_batches = 2
    trainer = Trainer(cfg, tmp_path / "ft")
    try:
        assert trainer.state.step == 0 and trainer.optimizer.state_dict()["state"] == {}
        assert_same_weights(source, trainer.raw_model)
        trainer.fit()
    finally:
        trainer.close()
    finetuned, _, _ = load_for_inference(tmp_path / "ft")

    # Resume wins: the fine-tune continues from its own step 3, not from the base run's weights again (the
    # source is not even read: it is gone).
    shutil.rmtree(tmp_path / "base")
    cfg.train.max_steps = 4
    trainer = Trainer(cfg, tmp_path / "ft", resume="auto")
    try:
        assert trainer.state.step == 3
        for (name, a), (_, b) in zip(finetuned.state_dict().items(), trainer.raw_model.state_dict().items()):
            assert torch.equal(a, b), name
    finally:
        trainer.close()


def test_weights_of_another_tokenizer_than_the_datas_are_refused_before_training(char_data, gpt2_data, other_char_data,
                                                                                hf_dir, tmp_path, capsys):
    """Bug: train.init_from never compared the weights' tokenizer with the data's, so GPT-2's weights trained on char
    ids (and a char run on another alphabet's) into a model that samples nothing. Refused in one line that names
    both tokenizers and the `prepare` option of the weights' one, before the run directory is made."""
    train(tiny_config(char_data, max_steps=1), tmp_path / "char_run")
    import_hf_to_run(hf_dir, tmp_path / "imported")
    cases = [(char_data, hf_dir, "(char and gpt2)", "--tokenizer gpt2"),  # no tokenizer files: GPT-2's, as import-hf
             (char_data, tmp_path / "imported", "(char and gpt2)", "--tokenizer gpt2"),
             (gpt2_data, tmp_path / "char_run", "(gpt2 and char)", "--tokenizer char"),
             (other_char_data, tmp_path / "char_run", "(char tokenizers whose alphabets differ, of 27 and 65 characters)",
              "--tokenizer char")]
    for data, source, difference, option in cases:
        message = one_line(ConfigError, train, finetune_config(data, source), tmp_path / "run")
        assert message.startswith(f"data.dir {data} and train.init_from = '{source}' have different tokenizers "
                                  f"{difference}; prepare the data with the weights' tokenizer ({option}"), message
        assert not (tmp_path / "run").exists()

    config = tmp_path / "ft.toml"
    config.write_text(dump_toml(finetune_config(char_data, hf_dir)))
    capsys.readouterr()  # the char run's lines (its 2 warmup steps of 1: a warning)
    assert cli.main(["train", "--config", str(config), "--out", str(tmp_path / "run")]) == 2  # the user's to fix
    err = capsys.readouterr().err
    assert err.startswith("error: data.dir") and err.count("\n") == 1, err


def test_a_hf_folder_without_a_tokenizer_and_not_gpt2s_vocabulary_is_refused_as_import_hf_refuses_it(char_data, tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=66)).save_pretrained(
        tmp_path / "hf")
    message = one_line(HFConversionError, train, finetune_config(char_data, tmp_path / "hf"), tmp_path / "run")
    assert "holds no tokenizer" in message and "vocab_size 66 is not GPT-2's" in message


def test_the_banner_names_the_weights_a_finetune_starts_from(char_data, gpt2_data, hf_dir, tmp_path, capsys):
    """Bug: a fine-tune's start said nothing of its source. The banner names the checkpoint of a run of ours
    (a run directory resolves to its newest checkpoint) or the Hugging Face folder; a resume names its own."""
    def one_step(data, source, max_steps=1):
        cfg = finetune_config(data, source, max_steps=max_steps)
        cfg.eval.interval, cfg.eval.val_batches = 0, 1  # one val batch at the end: only the banner is looked at
        return cfg

    train(tiny_config(char_data, max_steps=2), tmp_path / "base")
    train(one_step(char_data, tmp_path / "base"), tmp_path / "ft")
    started = tmp_path / "base" / "checkpoints" / "step_00000002"
    assert (f"weights from {started} (train.init_from); starting at step 0 with a fresh optimizer"
            in capsys.readouterr().out.splitlines())
    train(one_step(char_data, tmp_path / "base", max_steps=2), tmp_path / "ft", resume="auto")
    out = capsys.readouterr().out
    assert "weights from" not in out and f"resumed from {tmp_path / 'ft' / 'checkpoints' / 'step_00000001'}" in out

    train(one_step(gpt2_data, hf_dir), tmp_path / "ft-hf")
    assert f"weights from {hf_dir} (Hugging Face GPT-2) (train.init_from)" in capsys.readouterr().out


@pytest.mark.slow
def test_resume_from_an_import_hf_checkpoint_says_to_use_init_from(gpt2_data, hf_dir, tmp_path):
    import_hf_to_run(hf_dir, tmp_path / "imported")
    cfg = tiny_config(gpt2_data, max_steps=2)
    cfg.model.vocab_size = 50257
    message = one_line(CheckpointError, train, cfg, tmp_path / "run", resume=str(tmp_path / "imported"))
    assert "--set train.init_from=" in message
    r = run_cli("train", "--config", "configs/shakespeare-cpu.toml", "--out", str(tmp_path / "cli"), "--resume",
                str(tmp_path / "imported"), "--set", f"data.dir={gpt2_data}", "--set", "train.device=cpu")
    assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "train.init_from" in r.stderr


@pytest.mark.slow
def test_a_hub_name_offline_without_a_cache_is_one_line(gpt2_data, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(dump_toml(tiny_config(gpt2_data, max_steps=1)))
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    r = run_cli("train", "--config", str(config), "--out", str(tmp_path / "run"), "--set",
                "train.init_from=someone/not-cached", env=offline)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: someone/not-cached is not a local folder"), r.stderr


@pytest.mark.slow
def test_fsdp_two_ranks_start_from_the_full_source_weights(char_data, tmp_path):
    """Under FSDP each rank holds a shard: the source must be loaded into the plain model before wrapping.
    With lr 0 the saved (gathered) weights after one step are exactly the source's."""
    train(tiny_config(char_data, max_steps=2), tmp_path / "base")
    cfg = tiny_config(char_data, max_steps=1, micro_batch=2, lr=0.0, warmup_steps=0, schedule="constant")
    cfg.train.init_from, cfg.train.distributed = str(tmp_path / "base"), "fsdp"
    cfg.eval.interval = 0
    config = tmp_path / "ft.toml"
    config.write_text(dump_toml(cfg))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                        "gpt2train", "train", "--config", str(config), "--out", str(tmp_path / "ft")],
                       env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "fully_shard" in r.stderr and "cpu" in r.stderr.lower():
        pytest.skip("FSDP2 does not support CPU/gloo in this torch")
    assert r.returncode == 0, r.stderr[-3000:]
    source, _, _ = load_for_inference(tmp_path / "base")
    finetuned, _, meta = load_for_inference(tmp_path / "ft")
    assert meta["step"] == 1 and meta["sharded"]
    assert_same_weights(source, finetuned)
