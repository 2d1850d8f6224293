"""The run lock: a run directory belongs to one live training process at a time.

Rank 0 holds an OS advisory lock (flock) on RUN_DIR/.lock for the life of the run. The kernel releases it
when the process ends, however it ends (kill -9 included), so a stale lock never blocks the next start; the
pid and host written into the file only make the refusal message useful. The lock also remembers whether
taking it made the run directory, so that a launch that fails at its start can take that folder back.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

from gpt2train import distributed as D

LOCK_NAME = ".lock"
_held: dict[Path, list] = {}  # this process's locks: path -> [fd, holders, the first folder it made or None]


class RunDirInUse(ValueError):
    """Another live process is training into the run directory."""


def acquire(run_dir: str | Path) -> Path:
    """Lock run_dir for this process, or raise RunDirInUse naming the holder.

    A process that already holds the lock may take it again (two Trainers of one process, one after the
    other, as tests and notebooks do): flock would refuse a second open file of the same process."""
    path = (Path(run_dir) / LOCK_NAME).resolve()
    if path in _held:
        _held[path][1] += 1
        return path
    made = _first_missing(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # no truncation: the holder's pid stays readable
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").split() or ["?", "?"]
        os.close(fd)
        pid, host = (holder + ["?"])[:2]
        raise RunDirInUse(f"{run_dir} is in use by a running training (pid {pid} on {host}); "
                          "wait for it or pass another --out") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    _held[path] = [fd, 1, made]
    return path


def _first_missing(folder: Path) -> Path | None:
    """The outermost folder of the path that does not exist yet (None: the folder exists)."""
    missing = None
    while not folder.exists():
        missing, folder = folder, folder.parent
    return missing


def release(path: Path | None, discard_made: bool = False):
    """Give up one hold of the lock; the last one closes the file, which unlocks it (the file stays).
    `discard_made`: a start that failed takes back the run directory, if this lock made it, and the empty
    parents it made with it; a folder that existed before is never removed."""
    if path is None or path not in _held:
        return
    _held[path][1] -= 1
    if _held[path][1] == 0:
        fd, _, made = _held.pop(path)
        if discard_made and made is not None:
            _remove_made(path.parent, made)
        os.close(fd)


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
        except (ValueError, OSError) as e:  # RunDirInUse, the check's refusal, an unreadable folder
            release(path)
            refusal = e
    refusal = D.all_gather_objects(refusal)[0]
    if refusal is not None:
        raise refusal
    return path
