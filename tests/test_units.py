"""units.py: one style for durations, byte sizes and counts, at its boundaries."""

from __future__ import annotations

import pytest

from gpt2train.units import format_bytes, format_count, format_duration, format_significant


@pytest.mark.parametrize("seconds, text", [
    (0, "0 s"), (-3, "0 s"), (45, "45 s"), (59, "59 s"), (59.4, "59 s"),
    (59.6, "1m 00s"), (60, "1m 00s"), (245, "4m 05s"), (3599, "59m 59s"),
    (3600, "1h 00m"), (3659, "1h 00m"), (7380, "2h 03m"), (86400, "24h 00m"), (2 * 86400 - 1, "47h 59m"),
    (2 * 86400, "2.0 days"), (3.2 * 86400, "3.2 days"), (400 * 86400, "400.0 days"),
    (0.28, "0.28 s"), (0.0003, "0.00030 s"), (0.5, "0.50 s"), (0.996, "1.0 s"), (1, "1 s"),  # not "0 s"
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (2**20 - 1, "1024.00 KiB"),
    (2**20, "1.00 MiB"), (823 * 2**20, "823.00 MiB"), (2**30, "1.00 GiB"), (10.75 * 2**30, "10.75 GiB"),
    (2048 * 2**30, "2048.00 GiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("n, text", [
    (0, "0"), (999, "999"), (1000, "1.00K"), (124_475_904, "124.48M"), (9_999_745_024, "10.00B"),
    (2_489_518_080, "2.49B"), (3.1e12, "3.10T"),
])
def test_format_count(n, text):
    assert format_count(n) == text


@pytest.mark.parametrize("x, text", [
    (0, "0"), (0.0424, "0.042"), (7.8e-5, "0.000078"), (0.0996, "0.10"), (0.5, "0.50"), (1.5, "1.5"),
    (9.96, "10"), (80.3, "80"), (1234.5, "1,234"), (-0.0424, "-0.042"), (float("nan"), "nan"),
])
def test_format_significant(x, text):
    assert format_significant(x) == text


def test_moments_read_in_utc_one_way():
    from gpt2train.units import format_utc, name_stamp

    assert format_utc(1_795_000_000) == "2026-11-18 11:06:40 UTC"  # `date -u -d @1795000000`
    stamp = name_stamp("bench", ".json")
    assert stamp.startswith("bench-20") and stamp.endswith(".json") and len(stamp) == len("bench-20261125-123613.json")
