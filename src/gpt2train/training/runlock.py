"""The run lock: a run directory belongs to one live training process at a time.

Rank 0 holds a `filelock.FileLock` on RUN_DIR/.lock for the life of the run: flock on Unix, the Windows
lock on Windows, filelock's soft lock where neither exists. The OS releases a native lock when the process
ends, however it ends (kill -9 included), and filelock reclaims a soft lock whose holder on this host has
died, so a stale lock never blocks the next start. The holder's pid and host, in RUN_DIR/.lock.holder, only
make the refusal message useful. The lock also remembers whether taking it made the run directory, so that a
launch that fails at its start can take that folder back.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import filelock

from gpt2train import distributed as D

LOCK_NAME = ".lock"
HOLDER_NAME = ".lock.holder"  # "pid host" of the live holder; a killed holder's stays behind, harmless


@dataclass
class _Hold:
    lock: filelock.FileLock  # reentrant: a process that holds it may take it again (two Trainers in a row)
    made: Path | None  # the outermost folder taking the lock made, or None


_held: dict[Path, _Hold] = {}  # this process's locks, by the lock file's path


class RunDirInUse(ValueError):
    """Another live process is training into the run directory."""


def acquire(run_dir: str | Path) -> Path:
    """Lock run_dir for this process, or raise RunDirInUse naming the holder. A process that already holds
    the lock may take it again (two Trainers of one process, one after the other, as tests and notebooks do)."""
    path = (Path(run_dir) / LOCK_NAME).resolve()
    if path in _held:
        _held[path].lock.acquire(timeout=0)  # counted by the lock: each hold is given back by release()
        return path
    made = _first_missing(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(path, thread_local=False)  # one holder per process, whichever thread closes
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        pid, host = _holder(path.parent)
        raise RunDirInUse(f"{run_dir} is in use by a running training (pid {pid} on {host}); "
                          "wait for it or pass another --out") from None
    (path.parent / HOLDER_NAME).write_text(f"{os.getpid()} {socket.gethostname()}\n")
    _held[path] = _Hold(lock, made)
    return path


def _holder(run_dir: Path) -> tuple[str, str]:
    """(pid, host) of the process that holds the lock, "?" for what its holder file does not say."""
    try:
        words = (run_dir / HOLDER_NAME).read_text(errors="replace").split()
    except OSError:
        words = []
    return tuple((words + ["?", "?"])[:2])


def _first_missing(folder: Path) -> Path | None:
    """The outermost folder of the path that does not exist yet (None: the folder exists)."""
    missing = None
    while not folder.exists():
        missing, folder = folder, folder.parent
    return missing


def release(path: Path | None, discard_made: bool = False):
    """Give up one hold of the lock; the last one removes the holder file and unlocks. `discard_made`: a start
    that failed takes back the run directory, if this lock made it, and the empty parents it made with it; a
    folder that existed before is never removed."""
    if path is None or path not in _held:
        return
    hold = _held[path]
    if hold.lock.lock_counter > 1:
        hold.lock.release()
        return
    del _held[path]
    (path.parent / HOLDER_NAME).unlink(missing_ok=True)  # before unlocking: a next holder's file stays
    if discard_made and hold.made is not None:
        _remove_made(path.parent, hold.made)
    hold.lock.release()


def _remove_made(run_dir: Path, made: Path):
    shutil.rmtree(run_dir, ignore_errors=True)
    folder = run_dir.parent
    while folder == made or made in folder.parents:
        try:
            folder.rmdir()  # only while empty: another run may have started in a parent made here
        except OSError:
            return
        folder = folder.parent


def acquire_on_rank0(run_dir: str | Path, is_main: bool, check: Callable[[Path], None] | None = None) -> Path | None:
    """Under torchrun rank 0 alone locks (the other ranks belong to its run), then `check(run_dir)` may refuse
    the directory by raising; every rank learns the outcome, so that all of them stop alike instead of waiting
    for a rank 0 that has gone (another node may not even see the run directory)."""
    path, refusal = None, None
    if is_main:
        try:
            path = acquire(run_dir)
            if check is not None:
                check(Path(run_dir))
        except (ValueError, OSError, TypeError) as e:  # RunDirInUse, the check's refusal, an unreadable folder
            release(path, discard_made=True)  # a folder the lock made is taken back; one that existed stays
            refusal = e
    refusal = D.all_gather_objects(refusal)[0]
    if refusal is not None:
        raise refusal
    return path
