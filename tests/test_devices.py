"""The device table: peaks by CUDA name and precision, names `plan --device` accepts, this machine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from gpt2train import devices
from gpt2train.devices import peak_flops

SRC = Path(devices.__file__).parent


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA H100 80GB HBM3", 989e12),  # SXM
    ("NVIDIA H100 PCIe", 756e12),  # the longer key wins over "H100"
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA L40S", 362e12),  # ... and "L40S" over "L40" and "L4"
    ("NVIDIA L40", 181e12),
    ("NVIDIA GeForce RTX 4090", 165e12),
    ("NVIDIA A10G", 70e12),
    ("NVIDIA A10", 125e12),
    ("Tesla V100-SXM2-16GB", 125e12),
    ("Tesla T4", 65e12),
])
def test_peak_table_matches_device_names(name, peak):
    assert peak_flops(name, torch.bfloat16, tf32=True) == peak
    assert peak_flops(name, torch.float16, tf32=True) == peak


def test_peak_depends_on_precision_and_unknown_devices_have_none():
    assert peak_flops("NVIDIA A100-SXM4-40GB", torch.float32, tf32=True) == 156e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", torch.float32, tf32=False) == 19.5e12
    assert peak_flops("Some Future Accelerator", torch.bfloat16, tf32=True) is None
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops(devices.cpu_device()) is None
    assert peak_flops(devices.find_device("h100"), torch.float32, tf32=False) == 67e12


def test_names_and_aliases_plan_accepts():
    assert [d.name for d in devices.plannable()] == ["A100 40GB", "A100 80GB", "H100 80GB", "H200 141GB", "L4 24GB",
                                                      "RTX 4090 24GB"]
    assert devices.find_device("a100_80gb").name == "A100 80GB"
    assert devices.find_device("Geforce-RTX-4090").name == "RTX 4090 24GB"
    assert devices.find_device("cpu").name == "CPU" and not devices.find_device("cpu").is_gpu
    assert devices.find_device("L40S") is None  # known by its peak only: no memory size to plan with
    assert devices.find_device("TPU") is None


def test_every_row_has_a_peak_and_plannable_rows_a_memory_size():
    for d in devices.DEVICES:
        assert d.peaks is not None and d.match and d.is_gpu
        assert d.peaks.bf16 >= d.peaks.tf32 >= d.peaks.fp32
    assert all(d.memory_bytes > 0 for d in devices.plannable())


def test_describe_this_machines_devices():
    """describe (what plan and the benches ask about the device a run uses): a CPU is the CPU row with this
    machine's RAM; a CUDA device is a GPU under its own name, with its real memory and its row's peaks."""
    assert devices.describe(torch.device("cpu")) == devices.cpu_device()
    assert devices.cpu_device().memory_bytes == devices.system_ram_bytes()
    if torch.cuda.is_available():
        gpu = devices.describe(torch.device("cuda"))
        assert gpu.is_gpu and gpu.name == torch.cuda.get_device_name()
        assert gpu.memory_bytes == torch.cuda.get_device_properties(0).total_memory
        row = devices.match_gpu(gpu.name)
        assert gpu.peaks == (row.peaks if row else None) and gpu.bandwidth == (row.bandwidth if row else None)


def test_assumed_gpu_mfu():
    assert devices.ASSUMED_GPU_MFU == 0.40


@pytest.mark.parametrize("module", ["devices.py", "units.py"])
def test_leaf_modules_import_nothing_from_gpt2train(module):
    tree = ast.parse((SRC / module).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("gpt2train")]
