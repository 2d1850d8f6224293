"""How numbers with units read in everything gpt2train prints: durations, byte sizes, large counts.

One style each, so that a plan, a checkpoint summary and a benchmark table agree. Nothing here knows
about gpt2train.
"""

from __future__ import annotations

MINUTE, HOUR, DAY = 60, 3600, 86400


def format_duration(seconds: float) -> str:
    """A duration at the precision it is worth reading, rounded to whole seconds first:

    under a minute "45 s"; under an hour "4m 05s"; under two days "2h 03m" (seconds dropped, up to
    "47h 59m"); from two days on "3.2 days". Negative durations read as 0 s.
    """
    s = max(0, round(seconds))
    if s < MINUTE:
        return f"{s} s"
    if s < HOUR:
        return f"{s // MINUTE}m {s % MINUTE:02d}s"
    if s < 2 * DAY:
        return f"{s // HOUR}h {s % HOUR // MINUTE:02d}m"
    return f"{s / DAY:.1f} days"


def format_bytes(n: float) -> str:
    """Binary units with two decimals: "512 B", "1.50 KiB", "823.00 MiB", "10.75 GiB"."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_count(n: float) -> str:
    """A large count in SI-style steps with two decimals: "124.48M", "10.00B", "2.49T"; below 1000 as is."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:g}"
