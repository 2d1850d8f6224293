"""The run lock: a second training into a live run's directory is refused in one line and touches nothing;
a lock left by a killed run does not block; a clean run's directory resumes as before; a launch that fails at
its start takes back the run directory it made, and nothing that was there before."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import filelock
import pytest

from conftest import REPO, one_line, run_cli, tiny_config
from gpt2train import cli
from gpt2train.checkpoint import CheckpointError
from gpt2train.config import dump_toml
from gpt2train.training import runlock
from gpt2train.training.loop import Trainer, train
from gpt2train.training.step import TrainStep

HOLD = ("import sys, time, filelock; from gpt2train.training import runlock; "
        "filelock.FileLock = filelock.SoftFileLock if sys.argv[2] == 'soft' else filelock.FileLock; "
        "runlock.acquire(sys.argv[1]); print('locked', flush=True); time.sleep(600)")


def hold_lock_in_another_process(run_dir, kind: str = "native") -> subprocess.Popen:
    """A process holding the run lock; kind "soft": filelock's soft lock, as where the OS has no flock."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), kind], env=env, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def snapshot(folder) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


@pytest.mark.slow
def test_a_live_run_dir_is_refused_and_a_killed_holder_does_not_block(char_data, tmp_path):
    run, config = tmp_path / "run", tmp_path / "tiny.toml"
    config.write_text(dump_toml(tiny_config(char_data, max_steps=2)))
    holder = hold_lock_in_another_process(run)
    try:
        before = snapshot(run)
        r = run_cli("train", "--config", str(config), "--out", str(run))
        assert r.returncode == 1  # found while working: the run directory is busy
        assert r.stderr.strip().splitlines() == [
            f"error: {run} is in use by a running training (pid {holder.pid} on {socket.gethostname()}); "
            "wait for it or pass another --out"]
        assert snapshot(run) == before  # nothing written, nothing recovered or moved
    finally:
        holder.send_signal(signal.SIGKILL)  # as kill -9: no cleanup runs, the kernel drops the lock
        holder.wait()
    assert (run / runlock.HOLDER_NAME).read_text().split()[0] == str(holder.pid)  # the stale pid stays behind
    assert train(tiny_config(char_data, max_steps=2), run)["step"] == 2


def test_where_there_is_no_flock_a_soft_lock_refuses_a_live_run_and_a_killed_ones_does_not_block(char_data, tmp_path,
                                                                                                monkeypatch):
    """filelock's soft lock (a file whose existence is the lock), which FileLock uses where the OS has no flock:
    the same refusal, and the lock of a holder killed on this host is reclaimed."""
    monkeypatch.setattr(filelock, "FileLock", filelock.SoftFileLock)
    run = tmp_path / "run"
    holder = hold_lock_in_another_process(run, "soft")
    try:
        message = one_line(runlock.RunDirInUse, train, tiny_config(char_data, max_steps=2), run)
        assert f"(pid {holder.pid} on {socket.gethostname()})" in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    trainer = Trainer(tiny_config(char_data, max_steps=2), run)  # the dead holder's lock is taken over
    try:
        assert type(runlock._held[trainer.lock].lock) is filelock.SoftFileLock
        assert trainer.fit()["step"] == 2
    finally:
        trainer.close()


def test_a_lock_held_through_another_open_file_is_refused(char_data, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / runlock.HOLDER_NAME).write_text("4242 elsewhere\n")
    with filelock.FileLock(run / runlock.LOCK_NAME):  # a lock of its own open file: it blocks our Trainer too
        message = one_line(runlock.RunDirInUse, Trainer, tiny_config(char_data), run)
    assert "(pid 4242 on elsewhere)" in message
    assert {p.name for p in run.iterdir()} <= {runlock.LOCK_NAME, runlock.HOLDER_NAME}  # nothing else made
    assert (run / runlock.HOLDER_NAME).read_text() == "4242 elsewhere\n"  # the holder's, untouched


@pytest.mark.slow
def test_clean_runs_give_the_lock_back_and_resume_auto_works(char_data, tmp_path):
    run = tmp_path / "run"
    assert train(tiny_config(char_data, max_steps=5), run)["step"] == 5
    lock = (run / runlock.LOCK_NAME).resolve()
    assert lock not in runlock._held  # train() gave it back (other tests' Trainers may still hold theirs)
    out = train(tiny_config(char_data, max_steps=7), run, resume="auto")
    assert out["step"] == 7 and out["reason"] == "done"

    with pytest.raises(CheckpointError):  # a Trainer failing while it builds gives the lock back too
        Trainer(tiny_config(char_data), run, resume=str(tmp_path / "nowhere"))
    assert lock not in runlock._held
    holder = hold_lock_in_another_process(run)  # another process may lock it now
    holder.kill()
    holder.wait()


def test_a_failed_start_leaves_no_directory_it_made(char_data, tmp_path, capsys):
    """Bug: a train.init_from that does not exist left an empty run directory holding a lock file. A start that
    fails before the directory holds a run (a checkpoint, a logged step) removes the folders it made, parents
    included; a folder that was there before stays, with what it held."""
    cfg = tiny_config(char_data, max_steps=2)
    cfg.train.init_from = str(tmp_path / "no-such-run")
    config = tmp_path / "ft.toml"
    config.write_text(dump_toml(cfg))
    assert cli.main(["train", "--config", str(config), "--out", str(tmp_path / "new" / "run")]) == 1
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'no-such-run'} is not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ft.toml"]  # no new/, no new/run/.lock

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not a folder"):
        train(cfg, mine)
    assert (mine / "notes.txt").read_text() == "mine"
    assert not any((folder / runlock.LOCK_NAME).resolve() in runlock._held for folder in (tmp_path / "new" / "run", mine))


@pytest.mark.parametrize("fail_at_step, kept", [(1, False), (2, True)])
def test_a_launch_that_fails_in_its_first_step_takes_back_its_directory(char_data, tmp_path, monkeypatch, fail_at_step,
                                                                      kept):
    """The first step may fail too (out of memory, say): nothing was trained, so the new directory goes; once a
    step is logged the directory holds a run, and it stays for a look and a resume."""
    calls = []
    original = TrainStep.__call__

    def fails_at(self, **step):
        calls.append(1)
        if len(calls) == fail_at_step:
            raise RuntimeError("out of memory (injected)")
        return original(self, **step)

    monkeypatch.setattr(TrainStep, "__call__", fails_at)
    with pytest.raises(RuntimeError, match="injected"):
        train(tiny_config(char_data, max_steps=3), tmp_path / "run")
    assert (tmp_path / "run").exists() == kept
