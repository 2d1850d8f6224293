"""data.sources: rows drawn from several prepared folders in proportion to their weights (data/mixture.py), the
same rows for the same seed, exact resume (also under another micro-batch or world size), disjoint ranks, and
one-line refusals of bad entries, mixed tokenizers and a checkpoint of another data layout."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, one_line, run_cli, tiny_config
from gpt2train.checkpoint import newest_checkpoint
from gpt2train.config import ConfigError, DataConfig, dump_toml, load_config
from gpt2train.data.loader import DataError, TokenLoader
from gpt2train.data.mixture import MixtureLoader, data_meta
from gpt2train.data.prepare import prepare_files
from gpt2train.eval.val import mixture_validation, validation_loss
from gpt2train.model import GPT, GPTConfig
from gpt2train.runlog import load_metrics
from gpt2train.tokenizer import train_bpe
from gpt2train.training.loop import Trainer, train
from test_resume import stop_with_sigterm_at, train_losses

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
T = 8


def write_corpus(folder, docs: list[str]):
    folder.mkdir(parents=True)
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return folder / "docs.jsonl"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """Three GPT-2-tokenized folders whose texts share no token but the end-of-text one: words, digits and
    punctuation, so every row says which source it came from."""
    root = tmp_path_factory.mktemp("mixture")
    pick = np.random.default_rng(0).integers  # random texts: no two windows alike
    texts = {
        "words": [" ".join(WORDS[k] for k in pick(0, len(WORDS), 60)) for _ in range(20)],
        "digits": [" ".join(str(k) for k in pick(0, 10, 80)) for _ in range(20)],
        "marks": [" ".join("!?;:"[k] * (1 + k % 3) for k in pick(0, 4, 80)) for _ in range(20)],
    }
    out = {}
    for name, docs in texts.items():
        corpus = write_corpus(root / f"{name}-text", docs)
        prepare_files([corpus], root / name, tokenizer="gpt2", val_fraction=0.2, workers=1, progress=False)
        out[name] = str(root / name)
    return out


def token_sets(folders: dict[str, str]) -> dict[str, set[int]]:
    """Each source's train token ids, less the ones another source has too (the end-of-text token)."""
    ids = {}
    for name, folder in folders.items():
        loader = TokenLoader(folder, "train", 1, T)
        ids[name] = set(np.concatenate([np.asarray(s) for s in loader.shards]).tolist())
    return {name: own - set().union(*(o for n, o in ids.items() if n != name)) for name, own in ids.items()}


def source_of_rows(batch: np.ndarray, own: dict[str, set[int]]) -> list[str]:
    """The one source whose tokens each row holds."""
    names = []
    for row in batch.tolist():
        found = [name for name, ids in own.items() if ids & set(row)]
        assert len(found) == 1, (row, found)
        names.append(found[0])
    return names


def mixture(folders: dict[str, str], weights: dict[str, float], B: int = 4, **kw) -> MixtureLoader:
    return MixtureLoader([(folders[n], w) for n, w in weights.items()], "train", B, T, seed=kw.pop("seed", 5), **kw)


def test_rows_come_from_each_source_in_proportion_to_its_weight(sources):
    weights = {"words": 3.0, "digits": 1.0, "marks": 0.5}
    share = {n: w / sum(weights.values()) for n, w in weights.items()}
    own = token_sets(sources)
    loader = mixture(sources, weights, B=5)
    counts = dict.fromkeys(weights, 0)
    for step in range(1, 201):
        for name in source_of_rows(loader.next_batch_numpy(), own):
            counts[name] += 1
        rows = 5 * step
        for name in weights:  # after every step each source has had its share of the rows within one row
            assert abs(counts[name] - share[name] * rows) < 1, (step, counts)
    assert loader.state_dict()["taken"] == [counts[n] for n in weights]  # what a resume carries


def test_one_source_reads_like_its_token_loader(sources):
    """A mixture of one folder takes the rows a TokenLoader of that folder takes, in the same order."""
    alone = TokenLoader(sources["digits"], "train", 4, T, seed=5)
    mixed = mixture(sources, {"digits": 2.0})
    for _ in range(30):
        assert np.array_equal(alone.next_batch_numpy(), mixed.next_batch_numpy())


@pytest.mark.parametrize("order", ["random", "sequential"])
def test_same_seed_same_batches_and_another_seed_others(sources, order):
    weights = {"words": 1.0, "digits": 1.0}
    a, b = mixture(sources, weights, order=order), mixture(sources, weights, order=order)
    c = mixture(sources, weights, order=order, seed=6)
    batches_a = [a.next_batch_numpy() for _ in range(20)]
    assert all(np.array_equal(x, b.next_batch_numpy()) for x in batches_a)
    assert not all(np.array_equal(x, c.next_batch_numpy()) for x in batches_a)


def saved(state: dict) -> dict:
    """A state as a checkpoint gives it back: through JSON and a fresh object."""
    return json.loads(json.dumps(copy.deepcopy(state)))


@pytest.mark.parametrize("order", ["random", "sequential"])
def test_resumed_loader_continues_exactly_under_any_micro_batch_and_world_size(sources, order):
    """A straight run of 4 rows a step against one stopped after 5 steps and resumed as 1 rank of 4 rows,
    2 ranks of 2 rows (their rows side by side) and 1 rank of 2 rows over 2 micro-steps: the same rows."""
    weights = {"words": 2.0, "digits": 1.0, "marks": 1.0}
    straight = mixture(sources, weights, order=order)
    expected = [straight.next_batch_numpy() for _ in range(40)]
    first = mixture(sources, weights, order=order)
    for i in range(5):
        assert np.array_equal(first.next_batch_numpy(), expected[i])
    state = saved(first.state_dict())
    for B, world, micro_steps in [(4, 1, 1), (2, 2, 1), (2, 1, 2)]:
        ranks = [mixture(sources, weights, B=B, order=order, rank=r, world_size=world, seed=99) for r in range(world)]
        for loader in ranks:
            loader.load_state_dict(state)  # the seed comes from the state, like TokenLoader's
        for i in range(5, 40):
            got = np.concatenate([loader.next_batch_numpy() for _ in range(micro_steps) for loader in ranks])
            assert np.array_equal(got, expected[i]), (B, world, i)


def test_ranks_read_disjoint_rows_that_together_are_one_rank_of_twice_the_batch(sources):
    weights = {"words": 1.0, "digits": 3.0}
    one = mixture(sources, weights, B=8, order="sequential")
    ranks = [mixture(sources, weights, B=4, order="sequential", rank=r, world_size=2) for r in range(2)]
    seen = set()
    for _ in range(10):  # within the first epoch of every source: no window twice
        rows = [loader.next_batch_numpy() for loader in ranks]
        assert np.array_equal(np.concatenate(rows), one.next_batch_numpy())
        windows = [tuple(r) for batch in rows for r in batch.tolist()]
        assert len(set(windows)) == len(windows) and not seen & set(windows)
        seen |= set(windows)
        assert ranks[0].state_dict() == ranks[1].state_dict()  # same stream position on every rank


@pytest.mark.slow
def test_bad_sources_are_refused_in_one_line():
    """Weights of 1e308 each made every share weight / inf = 0: all rows came from the first source, then
    validation divided by zero (an internal error); they are refused when the config loads."""
    bad = {'["data/a"]': "DIR=WEIGHT", '["data/a=0"]': "positive weight", '["data/a=-2"]': "positive weight",
           '["data/a=x"]': "positive weight", '["=1"]': "DIR=WEIGHT", '["data/a=1", "data/./a=2"]': "twice",
           '"data/a=1"': "list of strings", '["data/a=1e308", "data/b=1e308"]': "only their ratios matter"}
    for value, says in bad.items():
        assert says in one_line(ConfigError, load_config, None, [f"data.sources={value}"])
    cfg = load_config(None, ['data.sources=["data/web=3", "data/code=0.5"]'])
    assert cfg.data.sources == ["data/web=3", "data/code=0.5"]
    r = run_cli("train", "--set", "data.sources=[\"data/a=0\"]")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: data.sources entry 'data/a=0'")


@pytest.mark.slow
def test_sources_of_another_tokenizer_are_refused_in_one_line(sources, char_data, tmp_path):
    chars = write_corpus(tmp_path / "chars-text", [" ".join(WORDS)] * 10)
    prepare_files([chars], tmp_path / "chars", tokenizer="char", val_fraction=0.2, workers=1, progress=False)
    message = one_line(ConfigError, data_meta, DataConfig(sources=[f"{sources['words']}=1", f"{tmp_path / 'chars'}=1"]))
    assert "different tokenizers (gpt2 and char)" in message and "--tokenizer gpt2" in message
    # both char, but of other texts: another alphabet
    message = one_line(ConfigError, data_meta, DataConfig(sources=[f"{char_data}=1", f"{tmp_path / 'chars'}=1"]))
    assert "char tokenizers whose alphabets differ" in message
    cfg = tiny_config(char_data)
    cfg.data.sources = [f"{char_data}=1", f"{tmp_path / 'chars'}=1"]
    with pytest.raises(ConfigError, match="different tokenizers"):
        Trainer(cfg, tmp_path / "run")
    # the user's choice of folders: a usage error (exit 2), as train.init_from's mismatch is
    r = run_cli("train", "--set", f"data.dir={char_data}", "--set", f'data.sources=["{char_data}=1", '
                f'"{tmp_path / "chars"}=1"]', "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "different tokenizers" in r.stderr.strip().splitlines()[-1], r.stderr
    assert not (tmp_path / "run").exists()


def test_sources_of_one_bpe_read_from_two_paths_are_one_tokenizer(tmp_path):
    """A BPE's spec records the path it was read from; the same tokenizer.json copied elsewhere is the same one."""
    train_bpe([" ".join(WORDS)] * 20, 300, tmp_path / "tokenizer.json")
    shutil.copy(tmp_path / "tokenizer.json", tmp_path / "copy.json")
    folders = []
    for name, tokenizer in (("a", "tokenizer.json"), ("b", "copy.json")):
        corpus = write_corpus(tmp_path / f"{name}-text", [" ".join(WORDS)] * 10)
        prepare_files([corpus], tmp_path / name, tokenizer=f"bpe:{tmp_path / tokenizer}", val_fraction=0.2, workers=1,
                      progress=False)
        folders.append(f"{tmp_path / name}=1")
    assert data_meta(DataConfig(sources=folders))["tokenizer"]["kind"] == "bpe"


def test_a_model_vocabulary_too_small_for_a_source_is_refused(char_data, tmp_path):
    copy_dir = tmp_path / "copy"
    shutil.copytree(char_data, copy_dir)
    cfg = tiny_config(char_data)
    cfg.data.sources = [f"{char_data}=1", f"{copy_dir}=1"]
    cfg.model.vocab_size = 10
    assert "smaller than the data's vocabulary" in one_line(ConfigError, Trainer, cfg, tmp_path / "run")


def test_validation_per_source_and_overall(sources):
    """Overall: the share-weighted loss of the sources, and their expected bits over expected bytes per token."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=T, vocab_size=50257)).eval()
    weights = {"words": 3.0, "digits": 1.0}
    val = MixtureLoader([(sources[n], w) for n, w in weights.items()], "val", 2, T, seed=1, order="sequential")
    from gpt2train.tokenizer import tokenizer_from_spec

    token_bytes = tokenizer_from_spec(data_meta(DataConfig(dir=sources["words"]))["tokenizer"]).token_bytes()
    out = mixture_validation(model, val, 3, token_bytes=token_bytes)
    for name, loader in zip(val.names, val.loaders):  # each source as a run of that folder alone evaluates it
        alone = validation_loss(model, TokenLoader(loader.paths[0].parent, "val", 2, T, seed=1, order="sequential"),
                                3, token_bytes=token_bytes)
        assert out["sources"][name] == alone
    words, digits = (out["sources"][sources[n]] for n in weights)
    assert out["loss"] == pytest.approx(0.75 * words["loss"] + 0.25 * digits["loss"], rel=1e-12)
    bits = 0.75 * words["loss"] + 0.25 * digits["loss"]
    per_token_bytes = 0.75 * words["bytes"] / words["tokens"] + 0.25 * digits["bytes"] / digits["tokens"]
    assert out["bpb"] == pytest.approx(bits / np.log(2) / per_token_bytes, rel=1e-12)
    assert out["tokens"] == words["tokens"] + digits["tokens"] == 2 * 3 * 2 * T


@pytest.mark.slow
def test_a_mixture_run_stopped_and_resumed_is_bit_identical(char_data, tmp_path):
    """Through the Trainer: SIGTERM after step 6 of 12, --resume auto; the losses and final weights equal an
    uninterrupted run's, and val records carry each source's loss beside the overall one."""
    second = tmp_path / "second-source"
    shutil.copytree(char_data, second)

    def config():
        cfg = tiny_config(char_data, max_steps=12)
        cfg.data.sources = [f"{char_data}=3", f"{second}=1"]
        return cfg

    train(config(), tmp_path / "straight")
    trainer = Trainer(config(), tmp_path / "resumed")
    stop_with_sigterm_at(trainer, 6)
    assert trainer.fit()["step"] == 6
    assert train(config(), tmp_path / "resumed", resume="auto")["step"] == 12
    assert train_losses(tmp_path / "straight") == train_losses(tmp_path / "resumed")  # exact floats
    final = "checkpoints/step_00000012/model.safetensors"
    a, b = load_file(tmp_path / "straight" / final), load_file(tmp_path / "resumed" / final)
    assert all(torch.equal(a[k], b[k]) for k in a)
    vals = [r for r in load_metrics(tmp_path / "resumed") if r["kind"] == "val"]
    assert [v["step"] for v in vals] == [5, 10, 12]
    for v in vals:
        assert set(v["sources"]) == {str(char_data), str(second)}
        assert v["val_loss"] == pytest.approx(0.75 * v["sources"][str(char_data)]["val_loss"]
                                              + 0.25 * v["sources"][str(second)]["val_loss"], rel=1e-12)


def test_resume_into_another_data_layout_is_refused_in_one_line(char_data, tmp_path):
    second = tmp_path / "second-source"
    shutil.copytree(char_data, second)
    train(tiny_config(char_data, max_steps=5), tmp_path / "plain")
    cfg = tiny_config(char_data, max_steps=8)
    cfg.data.sources = [f"{char_data}=1", f"{second}=1"]
    assert "resume with data.sources = []" in one_line(DataError, train, cfg, tmp_path / "plain", resume="auto")
    train(cfg, tmp_path / "mixed")
    cfg.train.max_steps = 12
    cfg.data.sources = [f"{char_data}=1", f"{second}=2"]
    assert "resume with those sources and weights" in one_line(DataError, train, cfg, tmp_path / "mixed", resume="auto")
    plain = tiny_config(char_data, max_steps=12)
    assert "resume with the same data.sources" in one_line(DataError, train, plain, tmp_path / "mixed", resume="auto")


@pytest.mark.slow
def test_eval_and_report_show_each_source_and_the_mixture(char_data, tmp_path):
    """`gpt2train eval` of a mixture's checkpoint: eval.json's val is the mixture, with each source under
    sources; the report's metrics.json has each source's val loss at the best val step."""
    second = tmp_path / "second-source"
    shutil.copytree(char_data, second)
    cfg = tiny_config(char_data, max_steps=5)
    cfg.data.sources = [f"{char_data}=3", f"{second}=1"]
    train(cfg, tmp_path / "run")
    r = run_cli("eval", "--ckpt", str(tmp_path / "run"), "--tasks", "val", "--limit", "4", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert f"loss {second}" in r.stdout
    val = json.loads((tmp_path / "run" / "checkpoints" / "step_00000005" / "eval.json").read_text())["tasks"]["val"]
    each = val["sources"]
    assert set(each) == {str(char_data), str(second)} and all(e["windows"] == 4 for e in each.values())
    assert val["loss"] == pytest.approx(0.75 * each[str(char_data)]["loss"] + 0.25 * each[str(second)]["loss"], rel=1e-12)
    assert val["windows"] == 8 and val["bpb"] is not None
    r = run_cli("report", str(tmp_path / "run"), "--out", str(tmp_path / "report"))
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "report" / "metrics.json").read_text())["runs"][0]
    last_val = [v for v in load_metrics(tmp_path / "run") if v["kind"] == "val"][-1]
    assert summary["best_val_sources"] == last_val["sources"]
    assert "val loss per source at best val" in (tmp_path / "report" / "report.html").read_text()


def test_plan_shows_epochs_per_source_and_warns_past_four(char_data, tmp_path):
    """Each source's share of the budget over its train tokens; one past MAX_EPOCHS gets a warning line."""
    from gpt2train import plan as P

    second = tmp_path / "second-source"
    shutil.copytree(char_data, second)
    cfg = tiny_config(char_data, max_steps=40_000)  # 128 tokens a step: 5.12M tokens
    cfg.data.sources = [f"{char_data}=9", f"{second}=1"]
    plan = P.make_plan(cfg, P.target_device("H100"), runs_dir=tmp_path)
    train_tokens = json.loads((char_data / "meta.json").read_text())["tokens"]["train"]
    assert [(s.folder, s.share, s.train_tokens) for s in plan.sources] == [
        (str(char_data), 0.9, train_tokens), (str(second), 0.1, train_tokens)]
    first, other = (s.epochs(plan.budget_tokens) for s in plan.sources)
    assert first == pytest.approx(0.9 * 40_000 * 128 / train_tokens) and first > P.MAX_EPOCHS > other
    text = P.format_plan(plan)
    warnings = [line for line in text.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and str(char_data) in warnings[0] and f"more than {P.MAX_EPOCHS}" in warnings[0]
    assert f"data        {second} (10.0% of the tokens)" in text


@pytest.mark.slow
def test_a_mixture_run_killed_with_sigkill_resumes_through_the_cli_to_the_same_losses_and_weights(char_data, tmp_path):
    """`gpt2train train` killed with SIGKILL (kill -9) after its checkpoint at step 4 or later, then
    `--resume auto`: every logged train and val loss, each source's val losses and the final weights equal those of
    an uninterrupted CLI run (fp32 on CPU, one thread in both)."""
    second = tmp_path / "second-source"
    shutil.copytree(char_data, second)
    # 48 steps: with 24, a loaded machine (the suite's other worker beside it) finished the run before this
    # test saw its step-4 checkpoint and killed it
    cfg = tiny_config(char_data, max_steps=48)
    cfg.data.sources = [f"{char_data}=2", f"{second}=1"]
    cfg.checkpoint.every_steps = 2
    config = tmp_path / "cfg.toml"
    config.write_text(dump_toml(cfg))
    env = {"OMP_NUM_THREADS": "1"}
    straight = run_cli("train", "--config", str(config), "--out", str(tmp_path / "straight"), env=env)
    assert straight.returncode == 0, straight.stderr

    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "gpt2train", "train", "--config", str(config), "--out", str(run)],
                            env={**os.environ, "PYTHONPATH": str(REPO / "src"), **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while (newest_checkpoint(run, warn=False) if (run / "checkpoints").is_dir() else None) is None or \
                int(newest_checkpoint(run, warn=False).name.split("_")[-1]) < 4:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else ""
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    killed_at = max(r["step"] for r in load_metrics(run) if r["kind"] == "train")
    assert proc.returncode == -signal.SIGKILL and killed_at < 48  # killed mid-run, not after it finished

    resumed = run_cli("train", "--config", str(config), "--out", str(run), "--resume", "auto", env=env)
    assert resumed.returncode == 0, resumed.stderr

    def series(folder):
        records = load_metrics(folder)
        return ({r["step"]: r["loss"] for r in records if r["kind"] == "train"},
                {r["step"]: (r["val_loss"], r["sources"]) for r in records if r["kind"] == "val"})

    assert series(run) == series(tmp_path / "straight")  # exact floats, the redone steps' records replacing the old
    final = "checkpoints/step_00000048/model.safetensors"
    a, b = load_file(tmp_path / "straight" / final), load_file(run / final)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tensorboard_gets_each_sources_val_loss(tmp_path):
    pytest.importorskip("tensorboard", reason="log.tensorboard needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gpt2train.runlog import MetricsLogger

    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log("val", step=5, tokens=640, val_loss=3.0, val_ppl=20.0, val_bpb=None,
               sources={"data/web": {"val_loss": 2.5, "val_bpb": None}, "data/code": {"val_loss": 4.5, "val_bpb": 1.5}})
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("val/sources/data/web/val_loss")] == [(5, 2.5)]
    assert [(e.step, e.value) for e in acc.Scalars("val/sources/data/code/val_bpb")] == [(5, 1.5)]
    assert "val/sources/data/web/val_bpb" not in acc.Tags()["scalars"]


@pytest.mark.parametrize("weights", [[3, 1, 0.5], [1, 1, 1], [0.7, 0.3], [5]])
def test_row_rule_is_the_argmax_of_each_sources_deficit(weights):
    """assign_rows (Python floats, for speed) against the rule written with numpy, row by row, in uneven steps."""
    from gpt2train.data.mixture import assign_rows

    share = np.array(weights, dtype=float) / sum(weights)
    taken, expected_taken, got, expected = np.zeros(len(share), np.int64), np.zeros(len(share), np.int64), [], []
    for n in [1, 7, 2, 64, 3, 100]:
        got += assign_rows(share, taken, n).tolist()
        for _ in range(n):
            s = int(np.argmax(share * (expected_taken.sum() + 1) - expected_taken))
            expected.append(s)
            expected_taken[s] += 1
    assert got == expected and taken.tolist() == expected_taken.tolist()
