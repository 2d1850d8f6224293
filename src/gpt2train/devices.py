"""The accelerators we know: one table of name, memory, dense peak FLOP/s and memory bandwidth, and its lookups.

MFU (the trainer's, the bench's) divides by a peak from here, and decoding's bandwidth utilization
(`gpt2train bench generate`) by a bandwidth from here; `gpt2train plan` takes a device's memory
and peak from here, and assumes ASSUMED_GPU_MFU when nothing measured is at hand. This module knows
nothing else of gpt2train: it imports torch only.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

GiB = 2**30

# What a well-tuned GPT-2 run reaches on one modern GPU: llm.c and nanoGPT report 0.35-0.50 for the 124M
# model on A100/H100 (bf16, compiled, flash attention). Used where no measured figure exists.
ASSUMED_GPU_MFU = 0.40


class Peaks(NamedTuple):
    """Dense peak FLOP/s by precision, from the vendors' data sheets (no sparsity)."""

    bf16: float
    tf32: float
    fp32: float


@dataclass(frozen=True)
class Device:
    name: str  # as printed, e.g. "H100 80GB"
    match: str | None  # a substring of torch.cuda.get_device_name() that identifies it; None: not a GPU
    memory_bytes: int | None  # per device (the marketed capacity); None: not in the table, plan cannot use it
    peaks: Peaks | None  # None: no peak known (a CPU, an unknown GPU)
    aliases: tuple[str, ...] = ()  # other names `plan --device` accepts (compared without case, spaces or dashes)
    bandwidth: float | None = None  # peak memory bandwidth in bytes/s (data sheet); None: unknown (a CPU)

    @property
    def is_gpu(self) -> bool:
        return self.name != "CPU"


# The rows with a memory size are the ones `plan --device` offers (the first A100/H100 alias is the
# family's default model). The others are known by their peak only, for MFU on whatever GPU a run gets.
# Bandwidths (bytes/s) are the NVIDIA data sheets' figures: A100 (40GB SXM 1,555 GB/s, 80GB SXM 2,039 GB/s),
# H100 (SXM 3.35 TB/s, PCIe 2.0 TB/s, NVL 3.9 TB/s), H200 (4.8 TB/s), L4 (300 GB/s), L40/L40S (864 GB/s),
# A10/A10G (600 GB/s), V100 SXM2 (900 GB/s), T4 (320 GB/s); GeForce RTX 4090 (1,008 GB/s) and 3090 (936 GB/s)
# from NVIDIA's GeForce specifications.
DEVICES: tuple[Device, ...] = (
    Device("A100 40GB", "A100", 40 * GiB, Peaks(312e12, 156e12, 19.5e12),
           ("a100-40gb", "a100-sxm4-40gb", "a100-pcie-40gb"), bandwidth=1555e9),
    Device("A100 80GB", "A100", 80 * GiB, Peaks(312e12, 156e12, 19.5e12),
           ("a100", "a100-sxm4-80gb", "a100-pcie-80gb"), bandwidth=2039e9),
    Device("H100 80GB", "H100", 80 * GiB, Peaks(989e12, 494e12, 67e12), ("h100", "h100-sxm", "h100-80gb-hbm3"),
           bandwidth=3.35e12),
    Device("H200 141GB", "H200", 141 * GiB, Peaks(989e12, 494e12, 67e12), ("h200",), bandwidth=4.8e12),
    Device("L4 24GB", "L4", 24 * GiB, Peaks(121e12, 60e12, 30.3e12), ("l4",), bandwidth=300e9),
    Device("RTX 4090 24GB", "RTX 4090", 24 * GiB, Peaks(165e12, 82.6e12, 82.6e12),
           ("rtx4090", "4090", "geforce-rtx-4090"), bandwidth=1008e9),
    Device("H100 PCIe", "H100 PCIe", None, Peaks(756e12, 378e12, 51e12), bandwidth=2.0e12),
    Device("H100 NVL", "H100 NVL", None, Peaks(835e12, 418e12, 60e12), bandwidth=3.9e12),
    Device("L40S", "L40S", None, Peaks(362e12, 183e12, 91.6e12), bandwidth=864e9),
    Device("L40", "L40", None, Peaks(181e12, 90.5e12, 90.5e12), bandwidth=864e9),
    Device("A10G", "A10G", None, Peaks(70e12, 35e12, 31.2e12), bandwidth=600e9),
    Device("A10", "A10", None, Peaks(125e12, 62.5e12, 31.2e12), bandwidth=600e9),
    Device("RTX 3090", "RTX 3090", None, Peaks(71e12, 35.6e12, 35.6e12), bandwidth=936e9),
    Device("V100", "V100", None, Peaks(125e12, 15.7e12, 15.7e12), bandwidth=900e9),  # no bf16: the fp16 tensor-core peak
    Device("T4", "T4", None, Peaks(65e12, 8.1e12, 8.1e12), bandwidth=320e9),  # likewise fp16
)


def system_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_device() -> Device:
    return Device("CPU", None, system_ram_bytes(), None, ("cpu",))


def cpu_name() -> str:
    """This machine's CPU model ("Intel(R) Xeon(R) Platinum 8488C"): /proc/cpuinfo's model name on Linux (where
    platform.processor() says "x86_64" or nothing), else what platform reports. A CPU's matmul ceiling measured
    by a bench journey is taken for a run on the CPU of this name only."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def normalized_name(name: str) -> str:
    """A name as compared: lower case, letters and digits only ("RTX-4090" == "rtx 4090")."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def find_device(name: str) -> Device | None:
    """The table's device (with a memory size) or the CPU by name or alias ("H100", "a100-40gb", "cpu")."""
    key = normalized_name(name)
    for device in (*plannable(), cpu_device()):
        if key in {normalized_name(n) for n in (device.name, *device.aliases)}:
            return device
    return None


def plannable() -> list[Device]:
    """The table's devices with a memory size, in table order."""
    return [d for d in DEVICES if d.memory_bytes is not None]


def match_gpu(gpu_name: str) -> Device | None:
    """The table's row for a CUDA device name ("NVIDIA H100 80GB HBM3"): the longest match key found in it,
    so that "H100 PCIe" wins over "H100" and "L40S" over "L40" and "L4"."""
    found = [d for d in DEVICES if d.match and d.match.lower() in gpu_name.lower()]
    return max(found, key=lambda d: len(d.match)) if found else None


def describe(device: torch.device) -> Device:
    """A torch device as a table entry: a GPU under its CUDA name with its real memory, else the CPU."""
    if device.type != "cuda":
        return cpu_device()
    gpu_name = torch.cuda.get_device_name(device)
    row = match_gpu(gpu_name)
    memory = torch.cuda.get_device_properties(device).total_memory
    return Device(gpu_name, gpu_name, memory, row.peaks if row else None,
                  bandwidth=row.bandwidth if row else None)


def precision(dtype: torch.dtype, tf32: bool) -> str:
    """Which peak a run's matmuls reach: bf16 (fp16 alike) under autocast, else TF32 or plain fp32."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return "tf32" if tf32 else "fp32"


def peak_flops(device: torch.device | str | Device, dtype: torch.dtype = torch.bfloat16,
               tf32: bool = True) -> float | None:
    """Dense peak FLOP/s of a device (a torch device, a CUDA device name, or a table entry) for a run in
    dtype with tf32 on or off; None when unknown (a CPU, a GPU not in the table)."""
    if isinstance(device, torch.device):
        device = match_gpu(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    elif isinstance(device, str):
        device = match_gpu(device)
    if device is None or device.peaks is None:
        return None
    return getattr(device.peaks, precision(dtype, tf32))
