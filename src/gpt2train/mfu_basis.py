"""What a run's MFU divides by, and where that figure comes from.

On a GPU: its dense peak for the run's precision, from the data sheets in devices.py. A CPU's peak is on no
data sheet we hold, so there the basis is this machine's matmul ceiling: the best FLOP/s of a large matmul in
the run's dtype with torch's threads. It is taken from a `gpt2train bench journey` that measured it on this CPU
(same CPU name, threads and dtype; the newest such journey.json beside the run), else measured by a probe of
at most about a second when the run starts. MFU over a measured ceiling says how much of what this CPU's matmul
kernels can do the training step gets; it is not comparable with a GPU's MFU over a data-sheet peak.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2train import devices
from gpt2train.bench_results import MatmulCeiling, journeys_newest_first, read_cpu_ceiling

PROBE_N = 1024  # large enough for the kernels' full speed, small enough for milliseconds per matmul on a CPU
PROBE_REPEATS = 5  # timed matmuls; the fastest counts (the others met a busy core or a cold cache)
PROBE_BUDGET_S = 1.0  # no more timed matmuls after this much time (a slow dtype, such as emulated bf16)


@dataclass(frozen=True)
class MfuBasis:
    flop_s: float | None  # per device (per process on a CPU); None: unknown, no MFU is shown
    source: str  # what the figure is and where it came from; or why there is none


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def probe_cpu_ceiling(dtype: torch.dtype, n: int = PROBE_N) -> MatmulCeiling:
    """The best FLOP/s of an n x n x n matmul in dtype on this CPU, with torch's current thread count. Measured
    once per process for each dtype and thread count."""
    return _probe(dtype, torch.get_num_threads(), n)


@functools.cache
def _probe(dtype: torch.dtype, threads: int, n: int) -> MatmulCeiling:
    generator = torch.Generator().manual_seed(0)  # the global generator is the run's: drawing from it would change the run
    a, b = (torch.rand(n, n, generator=generator).to(dtype) for _ in range(2))
    a @ b  # warm-up: the kernel's choice, the caches
    best, start = math.inf, time.perf_counter()
    for _ in range(PROBE_REPEATS):
        began = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - began)
        if time.perf_counter() - start > PROBE_BUDGET_S:
            break
    return MatmulCeiling(flop_s=2 * n**3 / best, dtype=dtype_name(dtype), threads=threads, n=n)


def journey_cpu_ceiling(runs_dir: str | Path, dtype: torch.dtype) -> tuple[MatmulCeiling, Path] | None:
    """The ceiling the newest journey under runs_dir/bench-*/ measured on this CPU, with this process's thread
    count and in dtype (a ceiling of other threads or another dtype is another figure), and its file; else None."""
    name, threads = devices.cpu_name(), torch.get_num_threads()
    for path in journeys_newest_first(runs_dir):
        found = read_cpu_ceiling(path)
        if found is not None and found[1] == name and found[0].threads == threads and found[0].dtype == dtype_name(dtype):
            return found[0], path
    return None


def cpu_basis(dtype: torch.dtype, runs_dir: str | Path | None) -> MfuBasis:
    """This CPU's matmul ceiling in dtype: a bench journey's under runs_dir when one matches, else probed now."""
    found = journey_cpu_ceiling(runs_dir, dtype) if runs_dir is not None else None
    if found is not None:
        ceiling, path = found
        return MfuBasis(ceiling.flop_s, f"this CPU's {ceiling.dtype} matmul ceiling, measured by gpt2train bench journey "
                                        f"({path}: {ceiling.describe()})")
    ceiling = probe_cpu_ceiling(dtype)
    return MfuBasis(ceiling.flop_s, f"this CPU's {ceiling.dtype} matmul ceiling, measured at start ({ceiling.describe()})")


def mfu_basis(device: torch.device, dtype: torch.dtype, tf32: bool, runs_dir: str | Path | None = None) -> MfuBasis:
    """The FLOP/s a run on `device` in `dtype` divides its model FLOP/s by. runs_dir: where a CPU's bench
    journeys are looked for (the folder holding the run directory); None: the ceiling is probed."""
    if device.type == "cpu":
        return cpu_basis(dtype, runs_dir)
    peak = devices.peak_flops(device, dtype, tf32)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    if peak is None:
        return MfuBasis(None, f"no peak FLOP/s known for {name} (add its row to gpt2train.devices.DEVICES)")
    return MfuBasis(peak, f"the dense {devices.precision(dtype, tf32)} peak of {name} (gpt2train.devices)")
