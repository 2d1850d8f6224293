"""The first hour after the quickstart, replayed as a new user types it (issue 30), on tiny settings.

Each step runs the real command in a fresh folder, without a terminal (as in a log or CI), and checks what a
user should see: nothing on disk lost, tokenizers kept through export, defaults said, output fit for a log,
hints that are right. A change that breaks the walk breaks this file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

# The quickstart's config at a size that trains in seconds; everything else as a user gets it.
TINY = ["--set", "model.n_layer=1", "--set", "model.n_head=2", "--set", "model.n_embd=32", "--set", "model.block_size=64",
        "--set", "train.seq_len=64", "--set", "train.micro_batch=4", "--set", "train.max_steps=8",
        "--set", "train.warmup_steps=2", "--set", "eval.interval=4", "--set", "eval.val_batches=2",
        "--set", "eval.sample_interval=0", "--set", "checkpoint.every_steps=4", "--set", "log.interval=2"]


class User:
    """Types commands in one folder. Output is read as bytes, so a carriage return (a redrawn bar) is seen."""

    def __init__(self, home: Path):
        self.home = home

    def run(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        result = subprocess.run([sys.executable, "-m", "gpt2train", *args], cwd=self.home, env=env,
                                capture_output=True, timeout=600)
        result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
        if ok:
            assert result.returncode == 0, f"{args}: {result.stderr}"
        assert "\r" not in result.stderr, f"{args}: a progress bar redrew into a log: {result.stderr!r}"
        assert "Traceback" not in result.stderr and "Warning:" not in result.stderr, f"{args}: {result.stderr}"
        return result

    def files(self, folder: str) -> dict[str, bytes]:
        """Every file of a run and its bytes, but the lock (each launch writes its process id there)."""
        root = self.home / folder
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file() and p.name != ".lock"}


@pytest.fixture
def user(tmp_path):
    old = os.umask(0o022)  # a common umask: every file written below must be readable by the group and others
    try:
        yield User(tmp_path)
    finally:
        os.umask(old)


def one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.slow
def test_the_first_hour_after_the_quickstart(user):
    # The quickstart, tiny.
    prepared = user.run("prepare", "shakespeare", "--out", "data/shakespeare")
    assert prepared.stdout.startswith("wrote data/shakespeare: 301,967 train and 36,060 val tokens")
    trained = user.run("train", "--config", "shakespeare-cpu", *TINY, "--out", "runs/shakespeare", "--resume", "auto")
    assert "finished at step 8" in trained.stdout and trained.stdout.endswith("\n")
    run_before = user.files("runs/shakespeare")
    assert {"checkpoints/step_00000004/model.safetensors", "checkpoints/best/meta.json",
            "metrics.jsonl"} <= run_before.keys()
    modes = {oct(p.stat().st_mode & 0o777) for p in (user.home / "runs").rglob("*") if p.is_file()}
    assert modes == {"0o644"}, modes  # weights included

    # Training into the same folder without --resume: refused in one line, the run untouched.
    again = user.run("train", "--config", "shakespeare-cpu", *TINY, "--out", "runs/shakespeare", ok=False)
    line = one_error_line(again)
    assert again.returncode == 2 and "--resume auto" in line and "--out" in line, line
    assert user.files("runs/shakespeare") == run_before
    # Resuming a finished run: says what to raise; no launch is counted, nothing is written.
    finished = user.run("train", "--config", "shakespeare-cpu", *TINY, "--out", "runs/shakespeare", "--resume", "auto")
    assert "train.max_steps" in finished.stdout + finished.stderr
    assert user.files("runs/shakespeare") == run_before

    # Sample: defaults said in --help; the text ends its line; the speed on stderr.
    helped = user.run("sample", "--help").stdout
    for default in ("(default 200)", "(default 0.8)", "(default 1337)"):
        assert default in helped, helped
    sampled = user.run("sample", "--ckpt", "runs/shakespeare", "--prompt", "ROMEO:", "--max-new-tokens", "16")
    assert sampled.stdout.startswith("ROMEO:") and sampled.stdout.endswith("\n")
    assert "tok/s" in sampled.stderr
    # A prompt longer than the context (64 tokens here): one warning line in our words, then the sample.
    cropped = user.run("sample", "--ckpt", "runs/shakespeare", "--prompt", "ROMEO: " * 40, "--max-new-tokens", "4")
    warnings = [line for line in cropped.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "cropped to its last" in warnings[0], cropped.stderr

    # Eval, report, inspect, doctor, plan, memory: what ran, not what was asked; no GPU advice for a CPU run.
    evaluated = user.run("eval", "--ckpt", "runs/shakespeare", "--tasks", "val", "--limit", "4").stdout
    eval_json = Path(evaluated.strip().splitlines()[-1].removeprefix("wrote "))
    assert eval_json.name == "eval.json" and "val" in json.loads((user.home / eval_json).read_text())["tasks"]
    user.run("report", "runs/shakespeare")
    assert (user.home / "runs/shakespeare/report/report.html").is_file()
    inspected = user.run("ckpt", "inspect", "runs/shakespeare").stdout
    assert "ran " in inspected and "(asked: auto)" in inspected, inspected
    doctor = user.run("doctor", "runs/shakespeare", ok=False)
    assert doctor.returncode in (0, 1) and "nvidia-smi" not in doctor.stdout, doctor.stdout
    plan = user.run("plan", "--config", "shakespeare-cpu", "--device", "L4").stdout
    assert "tokens/param" in plan and " 0.0 tokens/param" not in plan, plan
    user.run("memory", "--config", "shakespeare-cpu")
    assert "gpt2-tiny" in user.run("bench", "generate", "--help").stdout

    # A fine-tune from the run says which weights it starts from.
    tuned = user.run("train", "--config", "shakespeare-cpu", *TINY, "--set", "train.init_from=runs/shakespeare",
                     "--out", "runs/finetune")
    assert "runs/shakespeare" in tuned.stdout.split("step 1")[0], tuned.stdout

    # No --config: the first line says what that trains; a failed start leaves no folder behind.
    bare = user.run("train", "--set", "data.dir=no/such/data", "--out", "runs/bare", ok=False)
    assert bare.stdout.startswith("no --config: training the built-in defaults, a GPT-2 of 124"), bare.stdout
    assert bare.returncode in (1, 2) and one_error_line(bare)
    assert not (user.home / "runs/bare").exists()


@pytest.mark.slow
def test_own_data_with_an_own_tokenizer_through_export_and_import(user):
    corpus = user.home / "corpus"
    corpus.mkdir()
    for i in range(40):  # 40 small documents of made-up text
        (corpus / f"doc{i:02d}.txt").write_text(f"Document {i}: the quick brown fox {i % 7} jumps over the lazy dog.\n"
                                                 * (3 + i % 5))
    tok = user.run("tokenizer", "train", "corpus", "--vocab-size", "32768", "--out", "tok.json")
    assert "(asked 32,768" in tok.stdout, tok.stdout
    # Too small a corpus for the val split: refused before tokenizing, naming a value that works.
    few = user.home / "few"
    few.mkdir()
    for i in range(3):
        (few / f"{i}.txt").write_text(f"document {i}\n")
    small = user.run("prepare", "files", "few", "--tokenizer", "bpe:tok.json", "--out", "data/few", ok=False)
    assert "use --val-fraction 0.4" in one_error_line(small) and not (user.home / "data/few").exists()
    user.run("prepare", "files", "corpus", "--tokenizer", "bpe:tok.json", "--out", "data/mine", "--workers", "1")
    user.run("train", "--config", "shakespeare-cpu", *TINY, "--set", "data.dir=data/mine", "--out", "runs/mine")

    exported = user.run("export-hf", "--ckpt", "runs/mine", "--out", "hf/mine")
    assert (user.home / "hf/mine/tokenizer.json").is_file(), exported.stdout
    imported = user.run("import-hf", "hf/mine", "--out", "runs/mine-imported")
    assert imported.stderr == "" or "warning" not in imported.stderr.lower(), imported.stderr
    assert "bpe" in user.run("ckpt", "inspect", "runs/mine-imported").stdout
    sample = ["--prompt", "the quick", "--max-new-tokens", "12", "--seed", "7", "--dtype", "float32"]
    original = user.run("sample", "--ckpt", "runs/mine", *sample).stdout
    round_trip = user.run("sample", "--ckpt", "runs/mine-imported", *sample).stdout
    assert original == round_trip and original.startswith("the quick")

    # The char tokenizer has no Hugging Face form: refused before anything is written.
    user.run("prepare", "shakespeare", "--tokenizer", "char", "--out", "data/chars")
    user.run("train", "--config", "shakespeare-cpu", *TINY, "--set", "data.dir=data/chars", "--out", "runs/chars")
    refused = user.run("export-hf", "--ckpt", "runs/chars", "--out", "hf/chars", ok=False)
    assert "char tokenizer" in one_error_line(refused) and not (user.home / "hf/chars").exists()


@pytest.mark.slow
def test_the_python_example_run_twice_does_not_start_over(user):
    """The README's example trains into runs/demo; run again as written, it must not append a second history to
    metrics.jsonl nor replace the checkpoints."""
    user.run("prepare", "shakespeare", "--tokenizer", "char", "--out", "data/shakespeare")
    code = ("from gpt2train import load_config, train\n"
            "cfg = load_config('shakespeare-cpu', ['train.max_steps=4', 'data.dir=data/shakespeare', 'model.n_layer=1',"
            " 'model.n_embd=32', 'model.n_head=2', 'eval.interval=2', 'eval.val_batches=1', 'eval.sample_interval=0'])\n"
            "train(cfg, 'runs/demo')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    first = subprocess.run([sys.executable, "-c", code], cwd=user.home, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    before = user.files("runs/demo")
    second = subprocess.run([sys.executable, "-c", code], cwd=user.home, env=env, capture_output=True, text=True)
    assert second.returncode != 0 and "resume" in second.stderr.strip().splitlines()[-1], second.stderr
    assert user.files("runs/demo") == before
