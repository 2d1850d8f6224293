"""How numbers with units read in everything gpt2train prints: durations, byte sizes, large counts, ratios,
moments in time.

One style each, so that a plan, a checkpoint summary and a benchmark table agree. Nothing here knows
about gpt2train.
"""

from __future__ import annotations

import math
import time

MINUTE, HOUR, DAY = 60, 3600, 86400


def format_duration(seconds: float) -> str:
    """A duration at the precision it is worth reading, rounded to whole seconds first:

    under a minute "45 s"; under an hour "4m 05s"; under two days "2h 03m" (seconds dropped, up to
    "47h 59m"); from two days on "3.2 days". Negative durations read as 0 s; under a second, two
    significant digits ("0.28 s"), so that a short time never reads as none.
    """
    if 0 < seconds < 1:
        return f"{format_significant(seconds)} s"
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


def format_significant(x: float, digits: int = 2) -> str:
    """A ratio or a small amount with at least `digits` significant digits and no exponent: "0.042",
    "0.000078", "1.5", "80", "1,234". Rounding never turns a number that is not zero into "0"."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    if abs(x) >= 10 ** (digits - 1):  # whole digits enough
        return f"{x:,.0f}"
    x = float(f"{x:.{digits}g}")  # rounded first: 0.0996 reads "0.10", not "0.100"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"


def format_utc(seconds_since_epoch: float) -> str:
    """A moment as every log, report and benchmark prints it: "2026-11-25 12:36:13 UTC"."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds_since_epoch))


def name_stamp(prefix: str, suffix: str = "") -> str:
    """A file or folder name that sorts by when it was made, in UTC: "bench-20261125-123613"."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}{suffix}"
