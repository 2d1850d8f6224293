"""Reading the result files of `gpt2train bench journey` (RUNS/bench-*/journey.json) for the commands that use them.

plan and doctor take the MFU of a journey's last stage and the device it was measured on. They read it here,
below both, so that no part of the library imports the benchmarks (bench/ is a layer above the library:
tests/test_structure.py). bench/journey.py writes the file under the name defined here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

JOURNEY_FILE = "journey.json"
JOURNEY_GLOB = f"bench-*/{JOURNEY_FILE}"  # where `gpt2train bench journey` writes by default, under runs/


def newest_journey(runs_dir: str | Path) -> Path | None:
    """The most recently modified journey.json under runs_dir/bench-*/, or None."""
    found = [p for p in Path(runs_dir).glob(JOURNEY_GLOB) if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def read_final_mfu(path: str | Path) -> tuple[float, str]:
    """(MFU, device name) of the last measured cumulative stage (every technique on) of a saved journey.json;
    the ablation rows, each with one technique off, do not count. ValueError, in one line, when unreadable."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        mfus = [s["mfu"] for s in data["stages"] if isinstance(s.get("mfu"), (int, float))
                and math.isfinite(s["mfu"]) and 0 < s["mfu"] <= 1]
        device_name = str(data["environment"]["device_name"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} unreadable ({type(e).__name__})") from None
    if data.get("finished") is False:  # its last row is not every technique on (files before the flag are whole)
        raise ValueError(f"{path} is of a journey that stopped before its last stage")
    if not mfus:
        raise ValueError(f"{path} holds no MFU figure")
    return mfus[-1], device_name
