"""Faults a long run meets: NaN losses and loss spikes (the guard), SIGKILL at any moment (inside checkpoint
writes too), and a full disk during a save."""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import gpt2train.checkpoint as C
import gpt2train.checkpoint.format as checkpoint_format  # where the files are written: faults go in there
from conftest import REPO, tiny_config
from gpt2train import cli
from gpt2train.config import GuardConfig, dump_toml
from gpt2train.model import GPT
from gpt2train.runlog import find_spikes
from gpt2train.spikes import LOSS_SPIKE_RULE
from gpt2train.training.guard import GuardError, TrainingGuard
from gpt2train.training.loop import train

sys.path.insert(0, str(REPO / "scripts"))
import fault_trials  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def inject_loss_faults(monkeypatch, faults: dict[int, float]):
    """Multiply the training loss of the n-th training forward pass (counted over the whole test, so the
    n-th batch drawn) by faults[n]: nan for a NaN loss, a large factor for a spike. Evaluation is untouched."""
    original, calls = GPT.forward, [0]

    def forward(self, idx, targets=None, kv_cache=None):
        logits, loss = original(self, idx, targets, kv_cache)
        if self.training and targets is not None:
            calls[0] += 1
            if calls[0] in faults:
                loss = loss * faults[calls[0]]
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)


def records(run_dir, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def guarded_config(char_data, **guard):
    cfg = tiny_config(char_data, max_steps=12)
    cfg.guard = GuardConfig(**{"spike_window": 3, **guard})
    return cfg


# --- the guard's decisions ----------------------------------------------------------------------------
def test_guard_decisions():
    guard = TrainingGuard(GuardConfig(spike_factor=2.0, spike_window=3, max_nonfinite=2, max_rollbacks=1))
    assert guard.observe(100.0, 1.0) is None  # no spike judged before the window is full
    assert [guard.observe(x, 1.0) for x in (4.0, 4.0)] == [None, None]
    assert guard.observe(200.0, 1.0).action == "rollback"
    assert guard.observe(math.nan, 1.0).action == "skip"
    assert guard.observe(3.0, math.inf).action == "rollback"  # the second non-finite step in a row
    assert guard.observe(3.0, math.inf, norm_may_overflow=True) is None  # fp16: the GradScaler handles it
    guard.before_rollback(to_step=5, at_step=9)
    with pytest.raises(GuardError, match="1 rollbacks in a row to step 5"):
        guard.before_rollback(to_step=5, at_step=9)
    guard.after_checkpoint()
    guard.before_rollback(to_step=10, at_step=12)
    restored = TrainingGuard(guard.cfg)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()
    assert TrainingGuard(GuardConfig(enabled=False)).observe(math.nan, math.nan) is None


def fast_fall(floor: float, jumps: dict[int, float]) -> list[float]:
    """Losses that fall fast to `floor`, then wobble; jumps {index: value} replace single values."""
    losses = [floor + 8.0 * math.exp(-i / 10) + floor / 60 * math.sin(1.7 * i) for i in range(80)]
    return [jumps.get(i, loss) for i, loss in enumerate(losses)]


@pytest.mark.parametrize("losses, spikes", [
    (fast_fall(3.0, {}), []),
    (fast_fall(3.0, {60: 6.0}), [60]),  # 2x: the guard's old rule, 3x the mean of the last 50, let it stand
    # a fine-tune near zero: jumps of many times the median, but of hundredths of a nat, are no spikes (the guard
    # rolled a chat fine-tune back on them until it gave up); a jump to half a nat is one
    (fast_fall(0.0014, {50: 0.03, 55: 0.05, 70: 0.08}), []),
    (fast_fall(0.0014, {50: 0.03, 60: 0.5}), [60]),
])
def test_the_guard_and_the_logs_readers_agree_on_spikes(losses, spikes):
    """One spike rule for losses: the steps the guard rolls back are the ones `doctor` (find_spikes with the loss
    rule) would call spikes on a log of every step."""
    guard = TrainingGuard(GuardConfig())
    rolled_back = [i for i, loss in enumerate(losses) if (v := guard.observe(loss, 1.0)) and v.action == "rollback"]
    assert rolled_back == find_spikes(losses, LOSS_SPIKE_RULE) == spikes


def test_a_nan_step_is_skipped(char_data, tmp_path, monkeypatch):
    inject_loss_faults(monkeypatch, {3: math.nan})
    out = train(guarded_config(char_data), tmp_path)
    assert out["step"] == 12 and out["reason"] == "done"
    (skip,) = records(tmp_path, "guard")
    assert skip == {**skip, "step": 3, "action": "skip", "loss": None}
    weights = load_file(tmp_path / "checkpoints" / "step_00000012" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_nan_steps_in_a_row_roll_back_and_skip_the_bad_data(char_data, tmp_path, monkeypatch):
    inject_loss_faults(monkeypatch, {7: math.nan, 8: math.nan, 9: math.nan})  # batches 7-9 are poison
    out = train(guarded_config(char_data, max_nonfinite=3), tmp_path)
    assert out["step"] == 12 and out["reason"] == "done"
    actions = [(r["step"], r["action"], r.get("to_step")) for r in records(tmp_path, "guard")]
    assert actions == [(7, "skip", None), (8, "skip", None), (9, "rollback", 5)]
    rollback = records(tmp_path, "guard")[-1]
    assert rollback["reason"] == "3 non-finite steps in a row" and rollback["loss"] is None
    # Steps 6-12 were done again on fresh batches (10 on), not on the poisoned ones.
    steps = [r["step"] for r in records(tmp_path, "train")]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 6, 7, 8, 9, 10, 11, 12]


def test_a_loss_spike_rolls_back(char_data, tmp_path, monkeypatch):
    inject_loss_faults(monkeypatch, {8: 20.0})
    out = train(guarded_config(char_data, spike_factor=3.0), tmp_path)
    assert out["step"] == 12
    (rollback,) = records(tmp_path, "guard")
    assert rollback == {**rollback, "step": 8, "action": "rollback", "to_step": 5}
    assert rollback["reason"].startswith("loss spike") and rollback["loss"] > 3 * 4 and rollback["grad_norm"] > 0


def test_a_rollback_judges_the_reloaded_weights_losses_against_their_own_not_the_timeline_it_left(char_data, tmp_path,
                                                                                                  monkeypatch):
    """A spike at step 9 rolls back to step 5. The losses after step 5 are judged against those before it: the
    window of steps 6-8 (here made much lower than any real loss) called every loss after the rollback a spike
    again, and the run stopped on its rollback limit (a chat fine-tune whose loss fell fast did)."""
    inject_loss_faults(monkeypatch, {6: 0.01, 7: 0.01, 8: 0.01, 9: 20.0})
    out = train(guarded_config(char_data, spike_factor=3.0, max_rollbacks=2), tmp_path)
    assert out["step"] == 12
    (rollback,) = records(tmp_path, "guard")
    assert rollback == {**rollback, "step": 9, "action": "rollback", "to_step": 5}


def test_a_rollback_after_resuming_an_older_checkpoint_never_goes_forward(char_data, tmp_path, monkeypatch):
    """Resumed from step 5 of a run saved up to step 12, a spike at step 8 rolls back to step 5: once it
    "rolled back" to step 12 of the timeline the resume left, and the run ended there without training 9-12."""
    cfg = guarded_config(char_data, spike_factor=3.0)
    train(cfg, tmp_path)  # checkpoints 5, 10, 12
    inject_loss_faults(monkeypatch, {3: 20.0})  # the resumed run's third step, step 8
    out = train(cfg, tmp_path, resume=str(tmp_path / "checkpoints" / "step_00000005"))
    (rollback,) = records(tmp_path, "guard")
    assert rollback == {**rollback, "step": 8, "action": "rollback", "to_step": 5}
    resumed = [r["step"] for r in records(tmp_path, "train")][12:]
    assert out["step"] == 12 and resumed == [6, 7, 6, 7, 8, 9, 10, 11, 12]


class Crash(BaseException):
    """Stands for SIGKILL: nothing after it runs, no save."""


def test_resuming_an_older_checkpoint_sets_the_newer_aside_so_a_crash_resumes_the_chosen_timeline(
        char_data, tmp_path, monkeypatch, capsys):
    """Resumed from step 5 of a run saved up to step 12 and killed before its first save, `--resume auto`
    took step 12, of the timeline the user had left (the newer checkpoints went only at the first save)."""
    cfg = tiny_config(char_data, max_steps=12)
    train(cfg, tmp_path)  # checkpoints 5, 10, 12
    ring = tmp_path / "checkpoints"

    def killed(self, idx, targets=None, kv_cache=None):
        raise Crash

    monkeypatch.setattr(GPT, "forward", killed)
    with pytest.raises(Crash):
        train(cfg, tmp_path, resume=str(ring / "step_00000005"))
    monkeypatch.undo()
    assert sorted(p.name for p in ring.glob("*step_*")) == [".abandoned-step_00000010", ".abandoned-step_00000012",
                                                           "step_00000005"]  # kept aside, not deleted
    assert (ring / "latest").read_text().strip() == "step_00000005"
    assert "step_00000012 is of the timeline this resume leaves" in capsys.readouterr().err
    assert C.newest_checkpoint(tmp_path).name == "step_00000005"
    out = train(cfg, tmp_path, resume="auto")
    assert out["step"] == 12 and [r["step"] for r in records(tmp_path, "train")][12:] == list(range(6, 13))


def test_rollbacks_that_loop_stop_the_run_with_a_clear_error(char_data, tmp_path, monkeypatch):
    inject_loss_faults(monkeypatch, {n: 20.0 for n in range(8, 100)})  # every batch from the 8th on spikes
    with pytest.raises(GuardError, match="2 rollbacks in a row to step 5") as e:
        train(guarded_config(char_data, spike_factor=3.0, max_rollbacks=2), tmp_path)
    assert "\n" not in str(e.value)
    assert [r["action"] for r in records(tmp_path, "guard")] == ["rollback", "rollback"]
    assert records(tmp_path, "run_end")[-1]["reason"] == "error"
    assert C.newest_checkpoint(tmp_path).name == "step_00000005"


# --- a full disk -------------------------------------------------------------------------------------------
def fill_disk_on_save(monkeypatch, nth: int):
    """The nth weights file written runs out of space halfway, as on a full disk."""
    original, calls = checkpoint_format.save_file, [0]

    def save_file(tensors, path, metadata=None):
        calls[0] += 1
        if calls[0] == nth:
            original(tensors, path, metadata=metadata)
            with open(path, "r+b") as f:
                f.truncate(f.seek(0, 2) // 2)
            raise OSError(errno.ENOSPC, "No space left on device")
        original(tensors, path, metadata=metadata)

    monkeypatch.setattr(checkpoint_format, "save_file", save_file)


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(char_data, tmp_path, monkeypatch, capsys):
    fill_disk_on_save(monkeypatch, nth=2)  # the save at step 10
    with pytest.raises(C.CheckpointSaveError) as e:
        train(tiny_config(char_data, max_steps=12), tmp_path / "run")
    message = str(e.value)
    assert e.value.errno == errno.ENOSPC and "\n" not in message
    assert "step_00000010" in message and "No space left on device" in message and "step_00000005 is intact" in message
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000005"
    assert C.load_checkpoint(root / "step_00000005")[2]["step"] == 5
    assert sorted(p.name for p in root.iterdir()) == ["best", "latest", "step_00000005"]  # no half-written folder
    assert records(tmp_path / "run", "run_end")[-1]["reason"] == "error"

    # From the command line: one line, exit 1 (a failure while working).
    monkeypatch.undo()
    fill_disk_on_save(monkeypatch, nth=1)
    config = tmp_path / "cfg.toml"
    config.write_text(dump_toml(tiny_config(char_data, max_steps=6)))
    capsys.readouterr()
    assert cli.main(["train", "--config", str(config), "--out", str(tmp_path / "cli")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: could not save checkpoint step_00000005")
    assert "no earlier checkpoint exists" in err[0]


@pytest.mark.slow
def test_a_real_failed_write_of_the_weights_is_a_checkpoint_save_error_too(char_data, tmp_path):
    """safetensors raises its own SafetensorError when a write fails, not the OSError faked above: a full disk
    ended training as `SafetensorError: ... (os error 28) (an internal error ...)`, past the handler that keeps
    the previous checkpoint and says so. Here the write fails for real: a file size limit (RLIMIT_FSIZE, so
    EFBIG) stands in for the full disk, below the weights' size and above the logs'."""
    config = tmp_path / "cfg.toml"
    config.write_text(dump_toml(tiny_config(char_data, max_steps=2)))
    limited = ("import resource, sys\nfrom gpt2train import cli\n"
               "resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))\nsys.exit(cli.main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", limited, "train", "--config", str(config), "--out", str(tmp_path / "run")],
                       env={**os.environ, "PYTHONPATH": str(REPO / "src")}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.endswith(
        f"error: could not save checkpoint step_00000002 in {tmp_path / 'run' / 'checkpoints'}: File too large; no "
        "earlier checkpoint exists; free space and rerun with --resume auto\n"), r.stderr
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []  # no half-written folder


# --- SIGKILL at any moment ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigkill_anywhere_then_resume_ends_with_the_same_losses_and_weights(char_data, tmp_path):
    """20 trials of up to 2 kills each (scripts/fault_trials.py): in start-up, inside a checkpoint write, after a
    checkpoint is published but before `latest` moves, and between saves. Every launch after a kill must start
    one step past the newest complete checkpoint, and every trial must end having logged the uninterrupted run's
    train and val losses at every step, bit for bit (fp32 on CPU), and with its weights."""
    seed, trials, kills, steps = 0, 20, 2, 8
    done = fault_trials.run_trials(tmp_path, char_data, trials, kills, steps, seed, sleep_in_save=0.1, say=lambda _: None)
    assert not any(t.problems for t in done), fault_trials.replay_hint(done, seed, trials, kills, steps)
    every_trial = "\n".join(t.line() for t in done)  # what each kill hit, for a failure below
    fired = [kind for t in done for kind in t.fired]
    assert set(fired) == set(fault_trials.KINDS), every_trial  # the seed's plans hit every kind of moment
    assert sum("(inside a save)" in note for t in done for note in t.notes) >= 3, every_trial


@pytest.mark.slow
def test_sigkill_anywhere_in_a_run_of_the_record_recipe_then_resume_ends_the_same(char_data, tmp_path):
    """The same trials (fewer) over a run that uses every change of issue 45's recipe: NorMuon's second moment,
    Polar Express, cautious decay, the value tables, the skips, multi-token prediction, the window's warmup."""
    seed, trials, kills, steps = 1, 6, 2, 8
    done = fault_trials.run_trials(tmp_path, char_data, trials, kills, steps, seed, sleep_in_save=0.1,
                                   say=lambda _: None, recipe=fault_trials.RECIPE)
    assert not any(t.problems for t in done), fault_trials.replay_hint(done, seed, trials, kills, steps)
    saved = (tmp_path / "config.toml").read_text()
    assert 'muon_orthogonalizer = "polar_express"' in saved and "value_embeddings = 1" in saved


def test_an_unreadable_exit_status_is_taken_from_what_the_trainer_wrote(tmp_path):
    """multiprocessing's forkserver reports 255 when it cannot read a child's status back; the trainer's own
    status, written beside its log, then decides. Without it, and for any other status, the exit code stands."""
    out = tmp_path / "trial0"

    class Child:
        exitcode = 255

    assert fault_trials.exit_status(Child(), out) == 255  # nothing written: a crash before the end
    status = tmp_path / "trial0.log.status"
    status.write_text("0")
    assert fault_trials.exit_status(Child(), out) == 0
    status.write_text("1")
    assert fault_trials.exit_status(Child(), out) == 1
    Child.exitcode = -9  # killed: the file (of an earlier launch) does not speak for it
    assert fault_trials.exit_status(Child(), out) == -9
