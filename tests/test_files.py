"""files.py: a file is written whole or not at all, by every writer (text, streamed binary, by name)."""

from __future__ import annotations

import json
import os

import pytest

from gpt2train.files import AtomicFile, leftover_temp_files, write_json_atomic, write_text_atomic


def test_a_write_lands_whole_and_makes_its_folder(tmp_path):
    path = write_json_atomic(tmp_path / "new" / "meta.json", {"tokens": 3})
    assert json.loads(path.read_text()) == {"tokens": 3}
    assert write_text_atomic(path, "é\n").read_text(encoding="utf-8") == "é\n"  # replaces, in UTF-8
    assert sorted(p.name for p in path.parent.iterdir()) == ["meta.json"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    """A full disk surfaces at flush or fsync: the file keeps its old text (a plain write_text would have
    truncated it first), and the error reaches the caller."""
    path = write_text_atomic(tmp_path / "config.toml", "old = 1\n")

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(path, "new = 2\n" * 1000)
    assert path.read_text() == "old = 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]


def test_a_written_file_has_the_mode_a_plain_write_gives(tmp_path):
    """Bug: the temporary file's 0600 (mkstemp's) stayed on the file, so a run's config.toml and meta.json were
    unreadable to the rest of a team sharing the machine."""
    (tmp_path / "plain.txt").write_text("x")
    atomic = write_text_atomic(tmp_path / "atomic.txt", "x")
    assert atomic.stat().st_mode == (tmp_path / "plain.txt").stat().st_mode


class Interrupted(Exception):
    """Stands for anything that stops a writer midway."""


def test_a_streamed_binary_write_lands_whole_and_an_exception_drops_it(tmp_path):
    """A shard's writer: bytes arrive over time, the header is rewritten last (a seek back), and the file has
    its name only once committed; an exception inside the block leaves the old file and no temporary one."""
    path = tmp_path / "shard.bin"
    with AtomicFile(path) as out:
        out.file.write(b"....body")
        assert not path.exists()  # not under its name before the commit
        out.file.seek(0)
        out.file.write(b"HEAD")
    assert path.read_bytes() == b"HEADbody"
    with pytest.raises(Interrupted), AtomicFile(path) as out:
        out.file.write(b"half")
        raise Interrupted
    assert path.read_bytes() == b"HEADbody" and sorted(p.name for p in tmp_path.iterdir()) == ["shard.bin"]


def test_a_writer_that_opens_the_file_by_its_name_commits_it_too(tmp_path):
    """GGUF's writer opens its file itself: the temporary file is handed over by name (mode=None)."""
    out = AtomicFile(tmp_path / "model.gguf", mode=None)
    out.temp.write_bytes(b"GGUF")
    assert out.commit().read_bytes() == b"GGUF"
    out.discard()  # after a commit: nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_a_killed_writers_temporary_file_is_found_by_its_target(tmp_path):
    """A writer killed before commit or discard leaves its temporary file; leftover_temp_files names it (and only
    the target's: checkpoints' recover and a rerun of prepare delete them)."""
    killed, other = AtomicFile(tmp_path / "latest"), AtomicFile(tmp_path / "latest2")
    assert leftover_temp_files(tmp_path / "latest") == [killed.temp]
    killed.discard()
    other.discard()
    assert leftover_temp_files(tmp_path / "latest") == [] and list(tmp_path.iterdir()) == []
