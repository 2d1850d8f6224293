"""The memory processes hold, as the OS counts it, in bytes: this process's resident set now and its high-water
mark (which Linux lets us reset), the largest finished child's high-water mark, and the proportional set
of a process and its descendants (Linux's /proc; shared pages split among the processes sharing them).
Where the OS does not say (no /proc), the readers return 0 or False, never raise.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

KIB = 1024


def current_rss() -> int:
    """This process's resident set now (/proc/self/status's VmRSS); 0 where there is no /proc."""
    return proc_kib("self/status", "VmRSS") * KIB


def peak_rss() -> int:
    """This process's resident set high-water mark (getrusage), since it started or since reset_peak_rss."""
    return rusage_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def reset_peak_rss() -> bool:
    """Reset peak_rss's high-water mark to the resident set now (Linux: 5 written to /proc/self/clear_refs);
    False where the OS refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def children_peak_rss() -> int:
    """The high-water mark of the largest of this process's finished (waited-for) children."""
    return rusage_bytes(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)


def rusage_bytes(maxrss: int) -> int:
    """getrusage's ru_maxrss in bytes: Linux counts KiB, macOS bytes."""
    return maxrss if sys.platform == "darwin" else maxrss * KIB


def can_read_pss() -> bool:
    """Whether tree_pss can measure here (Linux 4.14+: /proc/PID/smaps_rollup)."""
    return Path(f"/proc/{os.getpid()}/smaps_rollup").is_file()


def tree_pss(pid: int) -> int:
    """The proportional set of process `pid` and all its descendants, summed: memory shared by n of them
    counts 1/n to each, so the sum is what the tree holds. Reading it walks each process's page tables, which
    takes time: sample it, never inside a timed run. 0 for processes gone or unreadable."""
    return sum(proc_kib(f"{p}/smaps_rollup", "Pss") for p in process_tree(pid)) * KIB


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc's children lists (every thread's). A process may end while it is
    read (bench prepare samples a run up to its exit): what is gone has no children."""
    pids, i = [pid], 0
    while i < len(pids):
        try:
            tasks = os.listdir(f"/proc/{pids[i]}/task")
        except OSError:
            tasks = []
        for task in tasks:
            try:
                pids += [int(c) for c in Path(f"/proc/{pids[i]}/task/{task}/children").read_text().split()]
            except (OSError, ValueError):
                pass
        i += 1
    return pids


def proc_kib(name: str, field: str) -> int:
    """A `Field:   123 kB` line's number in /proc/NAME; 0 where the file or the line is not there."""
    try:
        for line in Path(f"/proc/{name}").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0
