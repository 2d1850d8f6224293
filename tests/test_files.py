"""files.py: a small file is written whole or not at all."""

from __future__ import annotations

import json
import os

import pytest

from gpt2train.files import write_json_atomic, write_text_atomic


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
