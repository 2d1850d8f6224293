"""Resuming under another batch layout: the same tokens per step split into other micro-batches continues
the run (same data, same losses); other tokens per step or another seq_len stop in one line."""

from __future__ import annotations

import json

import pytest

from conftest import one_line, run_cli, tiny_config
from gpt2train.checkpoint import saved_layout
from gpt2train.config import ConfigError, dump_toml
from gpt2train.runlog import load_metrics
from gpt2train.training.loop import Trainer, train

pytestmark = pytest.mark.usefixtures("one_thread")
TOKENS = 4 * 32 * 2  # micro_batch 4 x seq_len 32 x 2 micro-steps


def layout(data, micro_batch: int, order: str = "random", total: int = TOKENS, **train_kw):
    cfg = tiny_config(data, micro_batch=micro_batch, total_batch_tokens=total, max_steps=12, **train_kw)
    cfg.data.order = order
    cfg.checkpoint.every_steps = 6
    return cfg


def train_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in load_metrics(run_dir) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def straight(char_data, tmp_path_factory):
    """Uninterrupted 12-step runs with 4 sequences x 2 micro-steps, one per data order."""
    runs = {}
    for order in ("random", "sequential"):
        runs[order] = tmp_path_factory.mktemp(order) / "run"
        train(layout(char_data, 4, order), runs[order])
    return runs


@pytest.mark.parametrize("order,micro_batch", [("random", 2), ("sequential", 2), ("random", 8)])
def test_same_tokens_per_step_in_another_split_continues_the_run(char_data, straight, tmp_path, capsys, order,
                                                                 micro_batch):
    capsys.readouterr()
    resumed = tmp_path / "resumed"
    out = train(layout(char_data, micro_batch, order), resumed,
                resume=str(straight[order] / "checkpoints" / "step_00000006"))
    assert out["step"] == 12
    note = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: resuming")]
    assert note == [f"note: resuming 1 rank(s) x 4 sequences x 2 micro-step(s) as 1 rank(s) x {micro_batch} sequences "
                    f"x {TOKENS // (32 * micro_batch)} micro-step(s): the same {TOKENS} tokens per step, the data "
                    "continues where it stopped"]
    before, after = train_losses(straight[order]), train_losses(resumed)
    assert sorted(after) == list(range(7, 13))
    for step in after:  # the same windows in each step: only the order of float sums differs
        assert after[step] == pytest.approx(before[step], abs=1e-5), step


@pytest.mark.slow
def test_other_tokens_per_step_or_seq_len_stop_in_one_line(char_data, straight, tmp_path):
    run = straight["random"]
    latest = json.loads((run / "checkpoints" / "step_00000012" / "meta.json").read_text())
    assert latest["batch"] == {"tokens_per_step": TOKENS, "seq_len": 32, "micro_batch": 4, "grad_accum": 2,
                               "world_size": 1}
    del latest["batch"]  # a checkpoint from before the layout was recorded: read from its config
    assert saved_layout(latest)["tokens_per_step"] == TOKENS

    message = one_line(ConfigError, Trainer, layout(char_data, 4, total=TOKENS // 2), run, resume="auto")
    assert message == (f"cannot resume: tokens per step changed ({TOKENS} -> {TOKENS // 2}); set "
                       f"train.total_batch_tokens = {TOKENS} (accumulation makes up a smaller micro_batch or world size)")
    message = one_line(ConfigError, Trainer, layout(char_data, 8, seq_len=16), run, resume="auto")
    assert "train.seq_len changed (32 -> 16)" in message and "set train.seq_len = 32" in message

    # As a user sees it: one line, exit 2, and the run directory's checkpoints as they were.
    config = tmp_path / "half.toml"
    config.write_text(dump_toml(layout(char_data, 4, total=TOKENS // 2)))
    ring = sorted(p.name for p in (run / "checkpoints").iterdir())
    r = run_cli("train", "--config", str(config), "--out", str(run), "--resume", "auto")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "tokens per step changed" in r.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ring
