"""Reading the result files of `gpt2train bench journey` (RUNS/bench-*/journey.json) for the commands that use them.

plan and doctor take the MFU of a journey's last stage and the device it was measured on; the trainer takes the
CPU matmul ceiling a journey measured (mfu_basis.py). They read it here, below all of them, so that no part of the
library imports the benchmarks (bench/ is a layer above the library: tests/test_structure.py). bench/journey.py
writes the file under the names defined here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

JOURNEY_FILE = "journey.json"
JOURNEY_GLOB = f"bench-*/{JOURNEY_FILE}"  # where `gpt2train bench journey` writes by default, under runs/
CEILING_KEY = "matmul_ceiling"  # in a CPU journey's environment: the ceiling its MFU column divides by


@dataclass(frozen=True)
class MatmulCeiling:
    """The best FLOP/s of an n x n x n matmul measured on a CPU, in `dtype` (torch's name: "bfloat16") with
    `threads` torch threads. A journey on a CPU records it (as a dict under CEILING_KEY) as its MFU's basis."""

    flop_s: float
    dtype: str
    threads: int
    n: int

    def describe(self) -> str:
        return f"{self.dtype} {self.n}x{self.n}x{self.n}, {self.threads} threads"


def journeys_newest_first(runs_dir: str | Path) -> list[Path]:
    """The journey.json files under runs_dir/bench-*/, the most recently modified first."""
    found = [p for p in Path(runs_dir).glob(JOURNEY_GLOB) if p.is_file()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def newest_journey(runs_dir: str | Path) -> Path | None:
    """The most recently modified journey.json under runs_dir/bench-*/, or None."""
    found = journeys_newest_first(runs_dir)
    return found[0] if found else None


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


def read_cpu_ceiling(path: str | Path) -> tuple[MatmulCeiling, str] | None:
    """(the CPU matmul ceiling a journey measured, the CPU's name), or None: a GPU's journey, a file from before
    the ceiling was recorded, or one that cannot be read. A journey cut short holds it too (it is measured first)."""
    try:
        environment = json.loads(Path(path).read_text())["environment"]
        if environment.get("device") != "cpu":
            return None
        ceiling = MatmulCeiling(**environment[CEILING_KEY])
        if not (isinstance(ceiling.flop_s, (int, float)) and math.isfinite(ceiling.flop_s) and ceiling.flop_s > 0):
            return None
        return ceiling, str(environment["device_name"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
