"""The pinned loss trajectory: the first 20 training losses of a tiny CPU run, against values stored here.

Like llm.c's test against its reference, this catches any refactor or speed-up that changes the numbers:
the step's order (LR, zero-grad, accumulation, clip, optimizer), the data order, the init or the model.
The run covers warmup and cosine decay, 2-way gradient accumulation and an active clip (norms > 1).

Runs of the same code differ by at most 5e-7 here (1 or 2 threads, AVX2 or AVX-512 kernels); a real change
moves the losses by 1e-4 or more from the first steps on, so the tolerance sits between the two.
"""

from __future__ import annotations

import json

import numpy as np

from conftest import tiny_config
from gpt2train.training.loop import train

# Recorded on main at a4da79d + d6824dd (before the step was pulled out of the Trainer), fp32, 1 thread.
PINNED_LOSSES = [
    4.1983352, 4.1912498, 4.1824217, 4.1519251, 4.1100292, 4.0714197, 4.0356402, 4.004221, 3.9661121, 3.9606156,
    3.9522204, 3.9137044, 3.9057388, 3.9126232, 3.9331961, 3.8950605, 3.8544774, 3.8908186, 3.8570483, 3.8686008,
]
TOLERANCE = 1e-5


def trajectory_config(char_data):
    cfg = tiny_config(char_data, max_steps=20, warmup_steps=5, micro_batch=4, total_batch_tokens=2 * 4 * 32,
                      grad_clip=1.0)
    cfg.eval.interval = 0  # validation only at the end: it does not touch the training losses
    cfg.checkpoint.every_steps = 0
    return cfg


def test_first_20_losses_match_the_pinned_trajectory(char_data, tmp_path, one_thread):
    train(trajectory_config(char_data), tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == len(PINNED_LOSSES)
    np.testing.assert_allclose(losses, PINNED_LOSSES, rtol=0, atol=TOLERANCE)


def test_the_pin_catches_a_real_change(char_data, tmp_path, one_thread):
    """The same run without clipping leaves the tolerance: the test above can fail."""
    cfg = trajectory_config(char_data)
    cfg.train.grad_clip = 0.0
    train(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = np.array([r["loss"] for r in records if r["kind"] == "train"])
    assert np.abs(losses - PINNED_LOSSES).max() > 10 * TOLERANCE
