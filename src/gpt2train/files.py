"""Files written whole or not at all: a crash, a full disk or a power cut mid-write leaves the file as it was,
never half of the new one under its name (a config, meta.json, a result a later run reads back, checkpoints'
`latest`, a shard, a GGUF file, a download).

AtomicFile is the one way every writer does it: the bytes go to a temporary file beside the target (the same
folder, so the same filesystem and an atomic rename), which is flushed to disk and renamed over the target,
the folder synced after; a failure deletes the temporary file and leaves the target untouched. Checkpoints,
many files at once, stage a whole folder the same way (checkpoint/format.py).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import uuid
from pathlib import Path
from typing import IO

TEMP_SUFFIX = ".tmp"
TEMP_ID_DIGITS = 12  # hex digits of the random part of a temporary file's name


class AtomicFile:
    """`path` written whole or not at all. Write to `file` (opened in `mode`, "wb" by default; mode=None opens
    none, for a writer that opens `temp` by its name itself), then commit() to put it in place, or discard() to
    drop it. As a context manager (`with AtomicFile(path, "w", encoding="utf-8") as out: out.file.write(text)`)
    the block's end commits and an exception discards. The temporary file, `.NAME.<random>.tmp` beside `path`
    (its folder made), is this writer's alone, and has the mode a plain open() gives under the umask
    (mkstemp's would be 0600)."""

    def __init__(self, path: str | Path, mode: str | None = "wb", encoding: str | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.temp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:TEMP_ID_DIGITS]}{TEMP_SUFFIX}")
        fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self.finished = False
        try:
            self.file: IO | None = None if mode is None else os.fdopen(fd, mode, encoding=encoding)
        except BaseException:
            os.close(fd)
            self.temp.unlink()
            raise
        if mode is None:
            os.close(fd)

    def commit(self) -> Path:
        """Flush and fsync the temporary file, rename it over `path`, sync the folder; returns `path`. On any
        failure the temporary file goes and the error is raised: `path` is as it was."""
        try:
            if self.file is not None:
                self.file.flush()
                os.fsync(self.file.fileno())  # on disk before the rename: a power cut must not leave an empty file
                self.file.close()
            else:
                fsync_path(self.temp)
            os.replace(self.temp, self.path)
        except BaseException:
            self.discard()
            raise
        self.finished = True
        fsync_folder(self.path.parent)  # the rename itself survives a power cut
        return self.path

    def discard(self) -> None:
        """Drop what was written (nothing happens after commit, or a second time)."""
        if self.finished:
            return
        self.finished = True
        if self.file is not None:
            with contextlib.suppress(OSError):  # a full disk may fail the close's flush: the file goes anyway
                self.file.close()
        self.temp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder (its entries: a rename or a new file in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(path: str | Path) -> None:
    """fsync_path() a folder where the OS lets one be opened (POSIX; Windows opens no folder)."""
    if os.name == "posix":
        fsync_path(path)


def leftover_temp_files(path: str | Path) -> list[Path]:
    """The temporary files of writers of `path` that never finished (killed before commit or discard)."""
    path = Path(path)
    return sorted(path.parent.glob(f".{glob.escape(path.name)}.{'[0-9a-f]' * TEMP_ID_DIGITS}{TEMP_SUFFIX}"))


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path`, its folder made: all of it, or nothing changed."""
    with AtomicFile(path, "w", encoding="utf-8") as out:
        out.file.write(text)
    return out.path


def write_json_atomic(path: str | Path, obj) -> Path:
    """`obj` as indented JSON, atomically (write_text_atomic)."""
    return write_text_atomic(path, json.dumps(obj, indent=2) + "\n")
