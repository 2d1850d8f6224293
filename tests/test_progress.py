"""Progress for a log: without a terminal, a plain line at most every few seconds and a last one, never a
carriage return; on a terminal, tqdm's bar. The same for every command (gpt2train.progress)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from time import monotonic

import pytest
from tqdm import tqdm

from conftest import REPO, tiny_config
from gpt2train import progress
from gpt2train.progress import LINE_EVERY_S, LogLines, show_progress


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_without_a_terminal_a_line_at_most_every_few_seconds_and_a_last_one(monkeypatch, capsys):
    clock = FakeClock()
    monkeypatch.setattr(progress, "monotonic", clock)
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    bar = show_progress(range(100), desc="val", unit="batch")
    assert isinstance(bar, LogLines)
    for _ in bar:  # 100 updates over 12 simulated seconds: lines at 5 s and 10 s, then the last one
        clock.now += 0.12
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3, lines
    assert [line.split(" [")[0] for line in lines] == ["val:  42% 42/100", "val:  84% 84/100", "val: 100% 100/100"]
    assert "batch/s" in lines[-1]


def test_a_with_block_ends_with_its_last_line_also_on_an_error(monkeypatch, capsys):
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    try:
        with show_progress(desc="tokenizing", unit=" docs") as bar:
            bar.update(3)
            bar.set_postfix_str("12 tok/s", refresh=False)
            raise OSError("disk full")
    except OSError:
        pass
    err = capsys.readouterr().err
    assert err.startswith("tokenizing: 3") and err.endswith(", 12 tok/s]\n") and err.count("\n") == 1


def test_on_a_terminal_a_tqdm_bar_and_nothing_when_disabled(monkeypatch, capsys):
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    bar = show_progress(total=4, desc="hellaswag")
    assert isinstance(bar, tqdm) and not bar.disable
    bar.close()
    quiet = show_progress([1, 2], enabled=False)
    assert list(quiet) == [1, 2]
    capsys.readouterr()
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    assert list(show_progress([1, 2], enabled=False)) == [1, 2] and capsys.readouterr().err == ""


def run_cli_raw(*args: str) -> subprocess.CompletedProcess:
    """`python -m gpt2train ARGS` with stdout and stderr as bytes: text mode would read each \\r as a newline."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "gpt2train", *args], env=env, capture_output=True, timeout=600)


def progress_lines(err: bytes, desc: str) -> list[str]:
    return [line for line in err.decode().split("\n") if line.startswith(f"{desc}:")]


def test_prepare_without_a_terminal_writes_plain_progress_lines(tmp_path):
    """Found walking the first hour: with stderr in a log, every tqdm redraw was written, each after a \\r."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "document {i} of the corpus"}}\n' for i in range(1000)))  # 4 chunks
    start = monotonic()
    r = run_cli_raw("prepare", "files", str(corpus), "--out", str(tmp_path / "data"), "--tokenizer", "char",
                "--workers", "1")
    elapsed = monotonic() - start
    assert r.returncode == 0, r.stderr
    assert b"\r" not in r.stderr
    lines = progress_lines(r.stderr, "tokenizing")
    assert 1 <= len(lines) <= 1 + elapsed / LINE_EVERY_S, r.stderr  # the last line, and at most one per 5 s before
    assert lines[-1].startswith("tokenizing: 1.00k docs"), lines
    r = run_cli_raw("prepare", "shakespeare", "--out", str(tmp_path / "shakespeare"), "--tokenizer", "char")
    assert r.returncode == 0 and b"\r" not in r.stderr, r.stderr


@pytest.mark.slow
def test_eval_without_a_terminal_writes_plain_progress_lines(char_data, tmp_path):
    from gpt2train.training.loop import train

    train(tiny_config(char_data, max_steps=1), tmp_path / "run")
    start = monotonic()
    r = run_cli_raw("eval", "--ckpt", str(tmp_path / "run"), "--tasks", "val", "--limit", "40", "--batch-size", "2",
                "--device", "cpu")
    elapsed = monotonic() - start
    assert r.returncode == 0, r.stderr
    assert b"\r" not in r.stderr and r.stdout.endswith(b"\n")
    lines = progress_lines(r.stderr, "val")
    assert 1 <= len(lines) <= 1 + elapsed / LINE_EVERY_S, r.stderr
    assert re.match(r"val: 100% (\d+)/\1 ", lines[-1]), lines  # the windows the run validates on, all read
