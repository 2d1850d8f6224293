"""train.batch_schedule: each step's multiplier, micro-batches and tokens against hand-written lists; the size
dial's steps for a token budget; a scheduled run reads the concatenation of a plain loop's micro-batches, a stage
of twice the batch trains as a plain run of twice the batch, and a run stopped mid-schedule resumes bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import one_line, tiny_config
from gpt2train.batch_schedule import BatchSchedule, steps_for_tokens
from gpt2train.config import ConfigError, batch_stages, dump_toml, load_config
from gpt2train.data.loader import TokenLoader
from gpt2train.runconfig import Environment, resolve_run
from gpt2train.training.loop import Trainer, train
from test_resume import assert_same_tensors, records, stop_with_sigterm_at, train_losses

# --- the schedule ---------------------------------------------------------------------------------------

def test_each_steps_batch_is_the_hand_written_list():
    s = BatchSchedule.of([(0.3, 2), (0.6, 3)], max_steps=10, base_tokens=128, base_accum=2)
    assert [s.multiplier(n) for n in range(1, 11)] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert [s.accum(n) for n in range(1, 11)] == [2, 2, 2, 4, 4, 4, 6, 6, 6, 6]
    assert [s.tokens_at(n) for n in range(1, 11)] == [128, 128, 128, 256, 256, 256, 384, 384, 384, 384]
    assert [s.tokens_through(n) for n in range(11)] == [0, 128, 256, 384, 640, 896, 1152, 1536, 1920, 2304, 2688]
    assert s.tokens_through(12) == 2688 + 2 * 384  # past max_steps: the last stage goes on
    assert s.describe() == "1x from step 1, 2x from step 4, 3x from step 7" and s.staged

    # A stage at 0 replaces the base from the first step; 0.5 of 5 steps rounds half up (after 3 steps).
    assert [BatchSchedule.of([(0.0, 2)], 4, 10).tokens_at(n) for n in range(1, 5)] == [20] * 4
    assert [BatchSchedule.of([(0.5, 2)], 5, 1).multiplier(n) for n in range(1, 6)] == [1, 1, 1, 2, 2]
    # Stages that rounding starts on the same step: the later one wins, the empty one is not described.
    tight = BatchSchedule.of([(0.2, 2), (0.4, 3)], 3, 1)  # both start after round(0.6) = round(1.2) = 1 step
    assert [tight.multiplier(n) for n in range(1, 4)] == [1, 3, 3] and tight.describe() == "1x from step 1, 3x from step 2"
    plain = BatchSchedule.of([], 7, 64, 3)
    assert [plain.accum(n) for n in range(1, 8)] == [3] * 7 and plain.tokens_through(7) == 7 * 64 and not plain.staged


@pytest.mark.parametrize("stages", [[], [(0.0, 2)], [(0.33, 2), (0.67, 3)], [(0.1, 1), (0.5, 4), (0.9, 4)]])
def test_the_steps_for_a_token_budget_are_the_fewest_that_reach_it(stages):
    for tokens in [1, 7, 100, 999, 12_345]:
        steps = steps_for_tokens(stages, tokens, 7)

        def through(n):
            return sum(BatchSchedule.of(stages, n, 7).tokens_at(k) for k in range(1, n + 1))  # step by step
        assert through(steps) >= tokens and (steps == 1 or through(steps - 1) < tokens), (tokens, steps)


def test_the_config_key_is_checked_in_one_line_and_round_trips(tmp_path):
    cfg = load_config(None, ["train.batch_schedule=[[0.33, 2], [0.67, 3]]"])
    assert batch_stages(cfg.train) == [(0.33, 2), (0.67, 3)]
    (tmp_path / "run.toml").write_text(dump_toml(cfg))  # as a run directory's config.toml holds it
    assert load_config(tmp_path / "run.toml").train.batch_schedule == [[0.33, 2], [0.67, 3]]
    for value, says in [("[[0.5, 2.5]]", "whole multiplier"), ("[[1, 2]]", "fraction in [0, 1)"), ("[[0.5]]", "[0.5]"),
                        ("[[0.5, 2], [0.4, 3]]", "rising fraction"), ("[[0.2, 3], [0.5, 2]]", "each multiplier at least"),
                        ("[[0.5, 0]]", "whole multiplier >= 1"), ('["0.5=2"]', "a list of lists of numbers")]:
        message = one_line(ConfigError, load_config, None, [f"train.batch_schedule={value}"])
        assert message.startswith("train.batch_schedule") and says in message, message


def test_the_size_dial_counts_the_scheduled_tokens():
    plain = resolve_run(None, ["model.depth=12"], Environment(world_size=1)).config.train
    run = resolve_run(None, ["model.depth=12", "train.batch_schedule=[[0.33, 2], [0.67, 3]]"], Environment(world_size=1))
    t, tokens = run.config.train, 20 * 85_056_000  # test_scaling: depth 12's budget and batch
    assert t.total_batch_tokens == plain.total_batch_tokens == 2 ** 18  # the base batch is the rule's
    schedule = BatchSchedule.of(batch_stages(t), t.max_steps, t.total_batch_tokens)
    assert schedule.tokens_through(t.max_steps) >= tokens
    shorter = BatchSchedule.of(batch_stages(t), t.max_steps - 1, t.total_batch_tokens)
    assert shorter.tokens_through(t.max_steps - 1) < tokens
    assert t.max_steps < plain.max_steps / 1.9  # about half the steps: the mean multiplier is 2
    assert "batch_schedule" in {d.key: d for d in run.dial}["train.max_steps"].rule


# --- the trainer ----------------------------------------------------------------------------------------

def scheduled_config(char_data, **train):
    cfg = tiny_config(char_data, **train)
    cfg.eval.interval = 0
    cfg.checkpoint.save_best = False
    return cfg


def test_a_scheduled_run_reads_a_plain_loops_micro_batches_in_order(char_data, tmp_path):
    cfg = scheduled_config(char_data, max_steps=5, batch_schedule=[[0.4, 2], [0.8, 3]])
    trainer = Trainer(cfg, tmp_path / "run")
    read, next_batch = [], trainer.train_loader.next_batch

    def recorded():
        x, y = next_batch()
        read.append((trainer.state.step + 1, x.clone()))
        return x, y

    trainer.step_fn.batches = recorded
    assert trainer.fit()["tokens"] == 128 * (1 + 1 + 2 + 2 + 3)
    assert [step for step, _ in read] == [1, 2, 3, 3, 4, 4, 5, 5, 5]  # the hand-written list of micro-batches
    plain = TokenLoader(char_data, "train", 4, 32, seed=cfg.train.seed, order=cfg.data.order)
    for _, x in read:
        assert torch.equal(x, plain.next_batch()[0])
    assert [r["tokens"] for r in records(tmp_path / "run", "train")] == [128, 256, 512, 768, 1152]


def test_a_stage_of_twice_the_batch_trains_as_a_plain_run_of_twice_the_batch(char_data, tmp_path):
    staged = train(scheduled_config(char_data, max_steps=4, batch_schedule=[[0.0, 2]]), tmp_path / "staged")
    doubled = train(scheduled_config(char_data, max_steps=4, total_batch_tokens=2 * 4 * 32), tmp_path / "doubled")
    assert staged["tokens"] == doubled["tokens"] == 4 * 256
    assert train_losses(tmp_path / "staged") == train_losses(tmp_path / "doubled")  # exact floats
    final = "checkpoints/step_00000004/model.safetensors"
    assert_same_tensors(load_file(tmp_path / "staged" / final), load_file(tmp_path / "doubled" / final))


def test_a_run_stopped_mid_schedule_resumes_bit_for_bit(char_data, tmp_path):
    def config():
        return scheduled_config(char_data, max_steps=6, batch_schedule=[[0.33, 2], [0.67, 3]])  # 1, 1, 2, 2, 3, 3

    straight = train(config(), tmp_path / "straight")
    trainer = Trainer(config(), tmp_path / "resumed")
    stop_with_sigterm_at(trainer, 3)  # inside the 2x stage
    assert trainer.fit()["step"] == 3
    resumed = train(config(), tmp_path / "resumed", resume="auto")
    assert resumed["tokens"] == straight["tokens"] == 128 * 12
    assert train_losses(tmp_path / "resumed") == train_losses(tmp_path / "straight")
    final = "checkpoints/step_00000006/model.safetensors"
    assert_same_tensors(load_file(tmp_path / "resumed" / final), load_file(tmp_path / "straight" / final))
