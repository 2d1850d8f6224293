"""Resuming: bit-identical continuation on CPU, what may change on resume, SIGTERM, falling back past a
damaged checkpoint, never starting over a run already in the run directory, and a resume of a finished run."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import MUON_RECIPE, REPO, one_line, run_cli, tiny_config
from gpt2train import cli
from gpt2train.checkpoint import CheckpointError, newest_checkpoint
from gpt2train.config import ConfigError, dump_toml
from gpt2train.runlog import load_metrics
from gpt2train.training.checkpointing import RunExists
from gpt2train.training.loop import Trainer, train
from gpt2train.training.signals import StopSignal


def stop_with_sigterm_at(trainer: Trainer, stop_step: int):
    """Make the trainer receive a real SIGTERM right after step `stop_step`, as a cluster scheduler would send."""
    original = trainer.train_step

    def step_then_signal():
        out = original()
        if trainer.state.step == stop_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.train_step = step_then_signal


def train_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in load_metrics(run_dir) if r["kind"] == "train"}


def records(run_dir, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def optimizer_moments(state_pt) -> dict:
    """The optimizer's per-parameter state of a checkpoint; Muon + AdamW keeps one dict per optimizer."""
    saved = torch.load(state_pt, weights_only=True)["optimizer"]
    parts = [saved["muon"], saved["adamw"]] if "muon" in saved else [saved]
    return {(i, k): v for i, part in enumerate(parts) for k, v in part["state"].items()}


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{"optimizer": "adamw"}, {"optimizer": "muon"}, MUON_RECIPE],
                         ids=["adamw", "muon", "muon-recipe"])
def test_resumed_run_is_bit_identical_to_uninterrupted(char_data, tmp_path, settings):
    cfg = tiny_config(char_data, max_steps=12, **settings)
    straight = train(cfg, tmp_path / "straight")
    assert straight["step"] == 12

    cfg = tiny_config(char_data, max_steps=12, **settings)
    trainer = Trainer(cfg, tmp_path / "resumed")
    stop_with_sigterm_at(trainer, 6)
    first = trainer.fit()
    assert first == {**first, "step": 6, "reason": "signal"}
    assert (tmp_path / "resumed" / "checkpoints" / "step_00000006").is_dir()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the run put the default handler back

    second = train(tiny_config(char_data, max_steps=12, **settings), tmp_path / "resumed", resume="auto")
    assert second["step"] == 12 and second["reason"] == "done"

    losses_a, losses_b = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert sorted(losses_b) == list(range(1, 13))
    assert losses_a == losses_b  # exact floats
    final_a = tmp_path / "straight" / "checkpoints" / "step_00000012"
    final_b = tmp_path / "resumed" / "checkpoints" / "step_00000012"
    assert_same_tensors(load_file(final_a / "model.safetensors"), load_file(final_b / "model.safetensors"))
    opt_a, opt_b = optimizer_moments(final_a / "state.pt"), optimizer_moments(final_b / "state.pt")
    assert opt_a.keys() == opt_b.keys() and len(opt_a) == len(load_file(final_a / "model.safetensors"))
    for i in opt_a:
        assert_same_tensors(opt_a[i], opt_b[i])
    assert any("second_moment" in moments for moments in opt_a.values()) == settings.get("muon_normalize", False)
    assert second["best_val_loss"] == straight["best_val_loss"]

    starts = records(tmp_path / "resumed", "run_start")
    assert [s["step"] for s in starts] == [1, 7]  # the first step of each launch
    assert starts[1]["resumed_from"].endswith("step_00000006")


@pytest.mark.gpu
def test_gpu_bf16_resume_matches_within_bf16_noise(char_data, tmp_path):
    """On a GPU kernels may be non-deterministic, so a resumed bf16 run equals an uninterrupted one only
    within bf16 noise; compiled, as GPU runs are."""
    def gpu_config():
        return tiny_config(char_data, max_steps=12, device="cuda", dtype="bfloat16", compile=True)

    straight = train(gpu_config(), tmp_path / "straight")
    trainer = Trainer(gpu_config(), tmp_path / "resumed")
    stop_with_sigterm_at(trainer, 6)
    assert trainer.fit()["step"] == 6
    resumed = train(gpu_config(), tmp_path / "resumed", resume="auto")
    assert straight["step"] == resumed["step"] == 12
    losses_a, losses_b = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert sorted(losses_b) == list(range(1, 13))
    for step in range(7, 13):
        assert losses_b[step] == pytest.approx(losses_a[step], rel=2e-2), step


@pytest.mark.slow
def test_resume_may_change_schedule_and_intervals_not_shape(char_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(char_data, max_steps=6), run)

    cfg = tiny_config(char_data, max_steps=9)
    cfg.eval.interval, cfg.log.interval, cfg.checkpoint.every_steps = 2, 3, 4
    out = train(cfg, run, resume="auto")
    assert out["step"] == 9 and out["reason"] == "done"
    assert [r["step"] for r in records(run, "val")][-2:] == [8, 9]

    cfg = tiny_config(char_data, max_steps=12)
    cfg.model.n_layer = 3
    with pytest.raises(ConfigError, match="model settings changed.*n_layer: 2 -> 3"):
        Trainer(cfg, run, resume="auto")

    # As a user sees it: one line, exit 2.
    cfg.model.vocab_size = 66
    (tmp_path / "bigger.toml").write_text(dump_toml(cfg))
    r = run_cli("train", "--config", str(tmp_path / "bigger.toml"), "--out", str(run), "--resume", "auto")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "n_layer: 2 -> 3" in r.stderr


@pytest.mark.slow
def test_resume_from_path_and_auto_without_checkpoint(char_data, tmp_path):
    train(tiny_config(char_data, max_steps=10), tmp_path / "a")
    out = train(tiny_config(char_data, max_steps=12), tmp_path / "b",
                resume=str(tmp_path / "a" / "checkpoints" / "step_00000005"))
    assert out["step"] == 12
    assert records(tmp_path / "b", "run_start")[0]["step"] == 6

    fresh = Trainer(tiny_config(char_data), tmp_path / "empty", resume="auto")
    assert fresh.state.step == 0 and fresh.state.resumed_from is None
    with pytest.raises(CheckpointError, match="does not exist"):
        Trainer(tiny_config(char_data), tmp_path / "c", resume=str(tmp_path / "nowhere"))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "changed byte"])
def test_auto_falls_back_past_a_damaged_latest(char_data, tmp_path, capsys, damage):
    run = tmp_path / "run"
    train(tiny_config(char_data, max_steps=10), run)
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert latest.name == "step_00000010"
    state = latest / "state.pt"
    data = bytearray(state.read_bytes())
    if damage == "truncated":  # as by a failing disk
        del data[len(data) // 2:]
    else:  # the size intact, as by a bad copy: only the checksum sees it
        data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    capsys.readouterr()

    trainer = Trainer(tiny_config(char_data, max_steps=12), run, resume="auto")
    assert trainer.state.step == 5
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert len(warnings) == 2 and "step_00000010" in warnings[0] and "state.pt" in warnings[0]
    assert "moved damaged step_00000010 aside" in warnings[1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        ".damaged-step_00000010", "best", "latest", "step_00000005"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000005"

    (run / "checkpoints" / "step_00000005" / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="every checkpoint .* is damaged"):
        Trainer(tiny_config(char_data, max_steps=12), run, resume="auto")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_saves_the_current_step_exits_by_it_and_the_printed_command_resumes(char_data, tmp_path, signum):
    """Ctrl-C or a scheduler's SIGTERM once training has started: the step is saved, the command exits 128 + the
    signal's number (130, 143), so `train ... && export-hf ...` stops there, and its last line is the command that
    resumes the run. Bug: it exited 0, and the next command of a script went on with the interrupted run."""
    run, config = tmp_path / "run", tmp_path / "cfg.toml"
    cfg = tiny_config(char_data, max_steps=10_000)
    cfg.checkpoint.every_steps = 0  # only the signal saves
    cfg.eval.interval = 0
    config.write_text(dump_toml(cfg))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gpt2train", "train", "--config", str(config), "--out", str(run)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not any(r.get("step", 0) >= 3 for r in _read_if_there(run)):
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else ""
            time.sleep(0.1)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, stderr
    end = records(run, "run_end")[-1]
    assert end["reason"] == "signal"
    stopped = end["step"]
    ckpt = run / "checkpoints" / f"step_{stopped:08d}"
    assert ckpt.is_dir() and newest_checkpoint(run) == ckpt
    assert json.loads((ckpt / "meta.json").read_text())["step"] == stopped
    command = shlex.join(["gpt2train", "train", "--config", str(config), "--out", str(run), "--resume", "auto"])
    assert stdout.splitlines()[-1] == (f"stopped by {signum.name} at step {stopped} (saved); best val loss n/a (no "
                                       f"validation yet); exit status {128 + signum}; resume with: {command}")

    # The printed command, as it is (`gpt2train` is `python -m gpt2train`), with a nearer end.
    r = run_cli(*shlex.split(command)[1:], "--set", f"train.max_steps={stopped + 2}")
    assert r.returncode == 0, r.stderr
    assert f"resumed from {ckpt} at step {stopped}" in r.stdout
    assert records(run, "run_end")[-1]["step"] == stopped + 2


def test_a_second_stop_signal_stops_at_once_with_its_own_exit_status(monkeypatch):
    """The first signal asks for a save; a second one stops in the middle (Interrupted), and the command exits
    by the second signal's status: 143 for a SIGTERM after a Ctrl-C, as a scheduler's kill reads."""
    with StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt) as second:
            os.kill(os.getpid(), signal.SIGTERM)
    assert second.value.signum == signal.SIGTERM

    def stopped_twice(args):
        raise second.value

    monkeypatch.setattr(cli.train, "cmd_train", stopped_twice)
    assert cli.main(["train"]) == 143


def _read_if_there(run) -> list[dict]:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return [r for r in out if r.get("kind") == "train"]


# --- never starting over a run ------------------------------------------------------------------------------------


def tree_digest(folder) -> dict[str, str]:
    """Every file under folder -> a hash of its bytes (the lock file aside: a refused launch held it)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.slow
def test_train_into_a_run_without_resume_is_refused_in_one_line_and_changes_nothing(char_data, tmp_path):
    """Bug: a second `train` into a run directory started again from step 1 over the run's checkpoints, its
    best/ and its metrics.jsonl. Python's train() and the CLI both refuse now (exit 2), naming both ways on."""
    run = tmp_path / "run"
    train(tiny_config(char_data, max_steps=5), run)
    before = tree_digest(run)
    assert {"metrics.jsonl", "checkpoints/best/meta.json", "checkpoints/step_00000005/meta.json"} <= before.keys()

    message = one_line(RunExists, train, tiny_config(char_data, max_steps=5), run)
    assert message.startswith(f"{run} already holds a run (checkpoints up to step_00000005)")
    assert "--resume auto" in message and "another --out" in message
    assert tree_digest(run) == before

    config = tmp_path / "tiny.toml"
    config.write_text(dump_toml(tiny_config(char_data, max_steps=5)))
    r = run_cli("train", "--config", str(config), "--out", str(run))
    assert r.returncode == 2, r.stderr  # a usage error: the arguments asked for a new run where one is
    assert r.stderr.strip().splitlines() == [f"error: {message}"]
    assert tree_digest(run) == before
    assert train(tiny_config(char_data, max_steps=6), run, resume="auto")["step"] == 6  # the way on it names


def test_a_run_whose_only_trace_is_its_log_is_refused_too(char_data, tmp_path):
    """No checkpoint (never saved), but metrics.jsonl logged trained steps: a new run would append a second
    history from step 1. A log of launches that never trained a step holds nothing to lose."""
    cfg = tiny_config(char_data, max_steps=2)
    cfg.checkpoint.every_steps, cfg.checkpoint.save_final, cfg.checkpoint.save_best = 0, False, False
    train(cfg, tmp_path / "logged")
    assert not (tmp_path / "logged" / "checkpoints").exists()
    assert "(trained steps in metrics.jsonl)" in one_line(RunExists, train, cfg, tmp_path / "logged")

    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "metrics.jsonl").write_text('{"kind": "run_start", "time": 1.0, "step": 1}\n'
                                          '{"kind": "run_end", "time": 2.0, "step": 0, "reason": "error"}\n')
    assert train(cfg, failed)["step"] == 2


def test_an_empty_folder_or_one_of_other_files_is_trained_into(char_data, tmp_path):
    (tmp_path / "empty").mkdir()
    assert train(tiny_config(char_data, max_steps=2), tmp_path / "empty")["step"] == 2
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)  # an empty checkpoints/ holds no run either
    (other / "notes.txt").write_text("mine")
    assert train(tiny_config(char_data, max_steps=2), other)["step"] == 2
    assert (other / "notes.txt").read_text() == "mine"


def test_resume_auto_of_a_finished_run_says_what_to_raise_and_logs_no_launch(char_data, tmp_path, capsys):
    """Bug: it printed "finished at step 4" and logged a launch (run_start, run_end) that trained nothing. Now one
    line says the run is already finished and how to train further; exit 0 (nothing failed); nothing on disk
    changes."""
    run, config = tmp_path / "run", tmp_path / "tiny.toml"
    config.write_text(dump_toml(tiny_config(char_data, max_steps=4)))
    assert cli.main(["train", "--config", str(config), "--out", str(run)]) == 0
    before = tree_digest(run)
    capsys.readouterr()

    assert cli.main(["train", "--config", str(config), "--out", str(run), "--resume", "auto"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{run} is already finished at step 4 (train.max_steps = 4); to train further, raise train.max_steps, "
        "e.g. --set train.max_steps=8"]
    assert tree_digest(run) == before  # no run_start or run_end record, config.toml as it was
    assert len(records(run, "run_start")) == 1

    out = train(tiny_config(char_data, max_steps=3), run, resume="auto")  # lowered below the step reached
    assert out["step"] == 4 and out["reason"] == "already finished"
    assert tree_digest(run) == before


def test_resuming_another_runs_checkpoint_into_a_run_is_refused(char_data, tmp_path):
    """Bug: `--resume PATH` naming another run's checkpoint, with an --out that already held a run, trained on
    into that run: its checkpoints and metrics.jsonl took a second history. Resuming the run's own checkpoint,
    or another run's into a new folder (a branch), still works."""
    train(tiny_config(char_data, max_steps=6), tmp_path / "a")
    train(tiny_config(char_data, max_steps=4), tmp_path / "b")
    before = tree_digest(tmp_path / "b")
    other = tmp_path / "a" / "checkpoints" / "step_00000005"

    message = one_line(RunExists, train, tiny_config(char_data, max_steps=8), tmp_path / "b", resume=str(other))
    assert message.startswith(f"{tmp_path / 'b'} already holds a run (checkpoints up to step_00000004)")
    assert str(other) in message and "another --out" in message
    assert tree_digest(tmp_path / "b") == before

    own = tmp_path / "b" / "checkpoints" / "step_00000004"
    assert train(tiny_config(char_data, max_steps=5), tmp_path / "b", resume=str(own))["step"] == 5
    assert train(tiny_config(char_data, max_steps=5), tmp_path / "b", resume=str(tmp_path / "b"))["step"] == 5
    assert train(tiny_config(char_data, max_steps=8), tmp_path / "branch", resume=str(other))["step"] == 8


def test_a_resume_reads_the_checkpoints_files_for_their_checksums_once(char_data, tmp_path, monkeypatch):
    """--resume auto verified the checkpoint when choosing it and again when loading it: every file read twice
    for its CRC-32, seconds for a large model. A rollback chose and loaded the same way."""
    import gpt2train.checkpoint.format as checkpoint_format
    import gpt2train.checkpoint.state as checkpoint_state

    cfg = tiny_config(char_data, max_steps=6)
    train(cfg, tmp_path)
    checked = []
    original = checkpoint_format.verify

    def counting(ckpt):
        checked.append(ckpt.name)
        return original(ckpt)

    monkeypatch.setattr(checkpoint_format, "verify", counting)
    monkeypatch.setattr(checkpoint_state, "verify", counting)
    cfg.train.max_steps = 7
    train(cfg, tmp_path, resume="auto")
    assert checked.count("step_00000006") == 1
    # Named: a run directory (its newest good checkpoint is chosen by verifying) or the checkpoint folder itself.
    for i, named in enumerate([tmp_path, tmp_path / "checkpoints" / "step_00000007"]):
        checked.clear()
        cfg.train.max_steps = 8
        train(cfg, tmp_path / f"branch{i}", resume=str(named))
        assert checked.count("step_00000007") == 1, (named, checked)
