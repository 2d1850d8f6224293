"""The run lock: a second training into a live run's directory is refused in one line and touches nothing;
a lock left by a killed run does not block; a clean run's directory resumes as before."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import REPO, one_line, run_cli, tiny_config
from gpt2train.checkpoint import CheckpointError
from gpt2train.config import dump_toml
from gpt2train.train import runlock
from gpt2train.train.loop import Trainer, train

HOLD = ("import sys, time; from gpt2train.train import runlock; runlock.acquire(sys.argv[1]); "
        "print('locked', flush=True); time.sleep(600)")


def hold_lock_in_another_process(run_dir) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def snapshot(folder) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


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
    assert (run / ".lock").read_text().split()[0] == str(holder.pid)  # the stale pid stays in the file
    assert train(tiny_config(char_data, max_steps=2), run)["step"] == 2


def test_a_lock_held_through_another_open_file_is_refused(char_data, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".lock", "w") as fh:  # flock locks belong to the open file: this one blocks our own Trainer
        fh.write("4242 elsewhere\n")
        fh.flush()
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        message = one_line(runlock.RunDirInUse, Trainer, tiny_config(char_data), run)
    assert "(pid 4242 on elsewhere)" in message
    assert sorted(p.name for p in run.iterdir()) == [".lock"]


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
