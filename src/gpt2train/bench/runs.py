"""A benchmark's training run: trained with its console in RUN/console.log (a stop signal ends the bench as it ends
the trainer), and the device it ran on, read back from its log. bench quality, scaling (and multiplier through it)
and chat train their runs through here."""

from __future__ import annotations

import contextlib
from pathlib import Path

from gpt2train import runlog
from gpt2train.training.loop import train
from gpt2train.training.signals import Interrupted


def train_logged(cfg, run_dir: Path, resume: str | None = None) -> dict:
    """train(cfg, run_dir, resume=resume), its console into run_dir/console.log (appended to when it resumes: a
    relaunch's lines after the last one's); Interrupted when a stop signal ended it, so that the command exits 130
    or 143 as the trainer does."""
    with open(run_dir / "console.log", "a" if resume else "w") as console, contextlib.redirect_stdout(console):
        out = train(cfg, run_dir, resume=resume)
    if out["reason"] == "signal":  # Ctrl-C or SIGTERM: the trainer stopped cleanly, and so does the bench
        raise Interrupted(out["signal"])
    return out


def run_hardware(run_dir: str | Path) -> dict:
    """The device a run trained on, from its latest run_start record ({} before any)."""
    starts = runlog.load_run(run_dir).of(runlog.RUN_START)
    return (starts[-1].get("hardware") or {}) if starts else {}
