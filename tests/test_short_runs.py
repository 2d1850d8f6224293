"""Short runs that make sense (issue 46): warmup as a share of train.max_steps where no one set it in steps, the
presets' full-length schedules as before, a one-line warning for a schedule that cannot run its course, and the
CPU fine-tune preset (finetune-cpu) on a tiny stand-in of the quickstart's run."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import run_cli, run_here
from gpt2train.config import TrainConfig, load_config, preset_files
from gpt2train.runconfig import Environment, resolve_run
from gpt2train.training.optim import lr_at, schedule_warning

# Each preset's (max_steps, warmup_steps) as resolved before warmup became a share of the steps (main at
# d438163): their full-length runs, and what docs/benchmarks.md measured with them, keep these schedules.
FULL_LENGTH = {
    "finetune-shakespeare": (300, 20), "gpt2": (19073, 715), "gpt2-large": (19073, 715),
    "gpt2-medium": (19073, 715), "gpt2-modern": (19073, 715), "gpt2-xl": (19073, 715), "ladder-2024": (1000, 100),
    "ladder-gpt2": (1000, 100), "ladder-modern": (1000, 100), "scaling-cpu": (1000, 100),
    "shakespeare-cpu": (300, 30), "shakespeare-modern": (300, 9),  # 30 until issue 45's tuning pass
}


def resolved(preset: str, *overrides: str):
    return resolve_run(preset, list(overrides), Environment()).config.train


@pytest.mark.parametrize("preset", sorted(FULL_LENGTH))
def test_every_preset_keeps_its_full_length_schedule(preset):
    train = resolved(preset)
    assert (train.max_steps, train.warmup_steps) == FULL_LENGTH[preset]


def test_a_shortened_preset_warms_up_for_its_share_of_the_steps():
    """Bug: `--set train.max_steps=40` on shakespeare-cpu warmed up for 30 of the 40 steps to the from-scratch
    peak, and the cosine had 10 steps to come down."""
    run = resolve_run("shakespeare-cpu", ["train.max_steps=40"], Environment())
    train = run.config.train
    assert train.warmup_steps == 4
    assert run.origin("train.warmup_steps") == "the size dial (train.warmup_fraction 0.1 of the steps)"
    assert lr_at(4, train) == train.lr and lr_at(40, train) == pytest.approx(train.lr * train.min_lr_ratio)
    assert resolved("gpt2", "train.max_steps=2000").warmup_steps == 75  # not 715 of 2,000
    assert resolved(None, "train.max_steps=50").warmup_steps == 5  # the defaults: 10%, 100 of 1,000 as before


def test_warmup_set_in_steps_wins_over_the_share():
    run = resolve_run("shakespeare-cpu", ["train.max_steps=40", "train.warmup_steps=7"], Environment())
    assert run.config.train.warmup_steps == 7 and run.origin("train.warmup_steps") == "set by you"
    assert resolved(None, "train.max_steps=50", "train.warmup_fraction=0.5").warmup_steps == 25


def test_the_size_dial_keeps_its_rule_unless_the_config_states_a_share():
    dial = resolved("scaling-cpu", "model.depth=3")
    assert dial.warmup_steps == round(0.05 * dial.max_steps)
    dial = resolved("scaling-cpu", "model.depth=3", "train.warmup_fraction=0.2")
    assert dial.warmup_steps == round(0.2 * dial.max_steps)


def shrunk(data) -> list[str]:
    """A preset as a user runs it, shrunk to a tiny model on the CPU (its schedule keys left alone)."""
    return ["--set", f"data.dir={data}", "--set", "model.depth=1", "--set", "model.block_size=32",
            "--set", "train.seq_len=32", "--set", "train.micro_batch=2", "--set", "train.device=cpu",
            "--set", "train.compile=false", "--set", "train.dtype=float32", "--set", "eval.val_batches=1",
            "--set", "eval.interval=0", "--set", "eval.sample_interval=0", "--set", "log.interval=1",
            "--set", "checkpoint.every_steps=0"]


def logged_lrs(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["lr"] for r in records if r["kind"] == "train"]


@pytest.mark.slow
def test_a_30_step_mixture_run_decays_to_its_minimum(char_data, tmp_path):
    """Bug: a 30-step run of shakespeare-modern (WSD) over a mixture warmed up for all 30 steps and ended at
    the peak learning rate, never decaying."""
    copy = tmp_path / "copy"
    shutil.copytree(char_data, copy)
    run = tmp_path / "run"
    r = run_here("train", "--config", "shakespeare-modern", "--out", str(run), *shrunk(char_data), "--set", "model.depth=2",
                 "--set", f'data.sources=["{char_data}=1", "{copy}=1"]', "--set", "train.max_steps=30")
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr
    lrs, peak = logged_lrs(run), load_config("shakespeare-modern").train.lr  # AdamW's, the one logged
    assert len(lrs) == 30 and lrs[2] == pytest.approx(peak)  # warmed up by step 3 (3% of 30 steps)
    assert lrs[17] == pytest.approx(peak) and lrs[18] < peak  # the decay: the last 0.4 of the steps
    assert lrs[-1] == pytest.approx(peak * 0.1)


def test_a_schedule_that_cannot_run_its_course_is_one_warning_line():
    def train(**keys) -> TrainConfig:
        return TrainConfig(**{"max_steps": 30, "warmup_steps": 3, "schedule": "wsd", "decay_fraction": 0.4, **keys})

    assert schedule_warning(train()) is None
    assert schedule_warning(train(warmup_steps=30)) == (
        "train.warmup_steps = 30 reaches train.max_steps = 30: the learning rate is still warming up at the last "
        "step and never decays; lower train.warmup_steps, or leave it unset (train.warmup_fraction x train.max_steps)")
    assert "warming up at the last step;" in schedule_warning(train(warmup_steps=40, schedule="constant"))
    assert schedule_warning(train(warmup_steps=20)).startswith(
        "train.warmup_steps = 20 runs into the decay, which starts after step 18 (the last 0.4 of train.max_steps "
        "= 30): the learning rate never holds its peak")
    assert schedule_warning(train(warmup_steps=20, schedule="cosine")) is None  # cosine decays after any warmup


@pytest.mark.slow
def test_training_says_the_warning_once_before_the_steps(char_data, tmp_path):
    """The quickstart's preset shortened to 3 steps with its old warmup of 30 steps set explicitly."""
    r = run_cli("train", "--config", "shakespeare-cpu", "--out", str(tmp_path / "run"), *shrunk(char_data),
                "--set", "train.max_steps=3", "--set", "train.warmup_steps=30")
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: train.warmup_steps = 30 reaches train.max_steps = 3: the learning rate is still "
                        "warming up at the last step and never decays; lower train.warmup_steps, or leave it unset "
                        "(train.warmup_fraction x train.max_steps)"]


def test_the_cpu_fine_tune_preset_starts_from_the_quickstarts_run():
    cfg, scratch = load_config("finetune-cpu"), load_config("shakespeare-cpu")
    assert cfg.train.init_from == "runs/shakespeare" and cfg.data.dir == "data/mine"
    assert cfg.train.lr <= scratch.train.lr / 5 and cfg.train.max_steps <= 300
    assert "finetune-cpu" in preset_files()


@pytest.mark.slow
def test_the_cpu_fine_tune_preset_fine_tunes_a_tiny_stand_in(char_data, tmp_path, monkeypatch):
    """The quickstart's run made tiny (runs/shakespeare in the working folder, as `make quickstart` leaves it),
    then the preset as it ships, but for the data folder and its length: the weights come from that run."""
    monkeypatch.chdir(tmp_path)
    r = run_here("train", "--config", "shakespeare-cpu", "--out", "runs/shakespeare", *shrunk(char_data),
                 "--set", "train.max_steps=3")
    assert r.returncode == 0, r.stderr
    r = run_here("train", "--config", "finetune-cpu", "--out", "runs/mine", "--set", f"data.dir={char_data}",
                 "--set", "train.seq_len=32", "--set", "train.max_steps=20", "--set", "train.device=cpu",
                 "--set", "train.dtype=float32", "--set", "eval.val_batches=1", "--set", "eval.sample_interval=0",
                 "--set", "log.interval=1")
    assert r.returncode == 0, r.stderr
    assert "weights from runs/shakespeare/checkpoints/step_00000003 (train.init_from)" in r.stdout
    assert "finished at step 20" in r.stdout and "warning" not in r.stderr
    lrs = logged_lrs(tmp_path / "runs" / "mine")
    assert lrs[0] == pytest.approx(3e-4) and lrs[15] == pytest.approx(3e-4) and lrs[-1] == pytest.approx(3e-5)
    r = run_here("sample", "--ckpt", str(tmp_path / "runs" / "mine"), "--prompt", "RO", "--max-new-tokens", "5")
    assert r.returncode == 0, r.stderr
