"""process_memory.py: the one reader of how much memory processes hold (the journey's CPU peak, bench prepare's
PSS), in bytes; where the OS does not say, 0 or False, never an error."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpt2train import process_memory as M

linux = pytest.mark.skipif(not M.can_read_pss(), reason="needs Linux's /proc/PID/smaps_rollup")


@linux
def test_this_process_and_a_childs_memory_are_read_in_bytes():
    assert M.current_rss() > 2**20 and M.peak_rss() >= M.current_rss() // 2  # MiBs, not KiBs
    child = subprocess.Popen([sys.executable, "-c", "import sys; x = bytearray(64 * 2**20); sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        for _ in range(200):  # until the child has touched its 64 MiB
            if M.tree_pss(child.pid) > 48 * 2**20:
                break
            time.sleep(0.05)
        assert M.tree_pss(child.pid) > 48 * 2**20
        assert child.pid in M.process_tree(os.getpid())
    finally:
        child.communicate(b"")
    assert M.children_peak_rss() > 48 * 2**20


def test_what_is_not_there_reads_as_nothing(tmp_path):
    assert M.proc_kib("no-such-process/status", "VmRSS") == 0
    assert M.tree_pss(2**22 + 1) == 0  # above Linux's largest pid: no such process
    assert M.rusage_bytes(3) in (3, 3 * 1024)


def test_a_process_that_ends_while_its_tree_is_read_has_no_children(monkeypatch):
    """bench prepare's memory sampler died with FileNotFoundError: /proc/PID/task was there when the walk started
    and gone when it was listed, as the run exited. A process gone mid-walk now counts as having no children."""
    def vanished(real):
        def listing(path="."):
            if str(path).startswith(f"/proc/{os.getpid()}/task"):
                raise FileNotFoundError(2, "No such file or directory", str(path))
            return real(path)
        return listing

    for name in ("listdir", "scandir"):  # either way of listing a folder finds it gone
        monkeypatch.setattr(os, name, vanished(getattr(os, name)))
    assert M.process_tree(os.getpid()) == [os.getpid()]
    assert M.tree_pss(2**22 + 1) == 0
