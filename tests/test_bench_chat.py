"""`gpt2train bench chat`: every demo task prepared, fine-tuned from a base run and scored on its held-out
conversations, end to end at a tiny size; and the options it refuses."""

from __future__ import annotations

import json
import math

import pytest

from conftest import random_checkpoint, run_here
from gpt2train.bench.chat import ChatBenchOptions
from gpt2train.data.chat_demo import DEMOS
from gpt2train.ranges import UsageError


@pytest.mark.slow
def test_bench_chat_fine_tunes_each_task_and_scores_its_held_out_replies(tmp_path):
    base = random_checkpoint(tmp_path / "base", 50257, {"kind": "gpt2"}, block_size=96)
    out = tmp_path / "bench"
    r = run_here("bench", "chat", "--base", str(base), "--conversations", "40", "--steps", "3", "--limit", "3",
                 "--set", "train.micro_batch=4", "--set", "train.dtype=float32", "--device", "cpu", "--out", str(out))
    assert r.returncode == 0, r.stderr
    record = json.loads((out / "chat.json").read_text())
    assert [t["task"] for t in record["tasks"]] == list(DEMOS)
    for t in record["tasks"]:
        assert t["status"] == "ok", t["reason"]
        assert t["steps"] == 3 and t["held_out"] == 3 and 0 <= t["correct"] <= 3
        assert t["exact_match"] == t["correct"] / 3
        assert math.isfinite(t["loss"]) and 0 < t["loss"] < 20  # a random model: about ln(50259) = 10.8
        assert t["loss_conversations"] == 3  # --limit caps the conversations scored, loss and replies alike
        assert t["train_s"] > 0 and t["eval_s"] > 0
        assert (out / t["task"] / "data" / f"{t['task']}.jsonl").is_file()
        assert (out / t["task"] / "run" / "checkpoints" / "step_00000003").is_dir()
    lines = (out / "chat.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith(("| task", "| ---"))]
    assert [row.split(" | ")[0] for row in rows] == [f"| {task}" for task in DEMOS]
    assert all(row.count("|") == 8 for row in rows)
    assert "--steps 3" in record["command"] and f"of {len(DEMOS)} tasks reach 0.8" in r.stdout
    again = run_here("bench", "chat", "--base", str(base), "--tasks", "pick", "--out", str(out))
    assert again.returncode == 2 and "exists already" in again.stderr  # a bench never writes over another's runs


@pytest.mark.parametrize("options,problem", [
    (dict(tasks=["pick", "pick"]), "each once"),
    (dict(tasks=["sort"]), "give demo tasks"),
    (dict(conversations=10), "conversations must be 20 to"),
    (dict(conversations=6000), "conversations must be 20 to 5,518"),  # recall makes at most 5,518
])
def test_bench_chat_refuses_options_that_cannot_run(options, problem):
    with pytest.raises(UsageError, match=problem):
        ChatBenchOptions(**options)


def test_bench_chat_tasks_flag_names_only_demo_tasks():
    r = run_here("bench", "chat", "--tasks", "pick,sort")
    assert r.returncode == 2 and "give demo tasks (recall, pick, count)" in r.stderr
