"""What a config will do on a device: one resolution of shapes, precision, compile, batch and seed.

`gpt2train train` runs what `resolve_runtime` says, and `plan`, `memory` and `bench` ask the same function,
so a prediction is made for the run that `train` starts with the same settings:

    resolved config (runconfig.py) -> resolve_runtime (device, dtype + autocast, TF32, compile, micro-batch x
    accumulation x ranks and its schedule over the steps, seed) -> Runtime.apply() (TF32, deterministic kernels,
    the CPU allocator)

Nothing here touches a GPU unless `apply()` is called, so a plan for an H100 can be made on a laptop.
"""

from __future__ import annotations

import ctypes
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from gpt2train.batch_schedule import BatchSchedule
from gpt2train.config import Config, ConfigError, batch_stages
from gpt2train.counting import parameter_count
from gpt2train.distributed import local_world_size
from gpt2train.ranges import EXPLICIT_DTYPE_NAMES
from gpt2train.units import format_bytes

DTYPES = {name: getattr(torch, name) for name in EXPLICIT_DTYPE_NAMES}  # the names ranges.py lists


def use_expandable_segments():
    """Ask PyTorch's CUDA allocator for expandable segments (fewer fragmentation OOMs), unless the user set
    the allocator config. The allocator reads this once, when CUDA starts: it must run before any CUDA call."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:  # the older name of the same setting
        os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")


# glibc's mallopt parameters (malloc.h) and their defaults.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_GLIBC_DEFAULT_THRESHOLD = 128 * 1024


def keep_freed_cpu_memory(keep: bool = True) -> bool:
    """keep: glibc's malloc serves blocks up to 32 MiB from its heap and keeps up to 1 GiB of freed memory
    mapped; False: its default thresholds (128 KiB each). Returns whether glibc took the setting (False
    where the C library is another, e.g. on macOS).

    Why: a CPU step makes and frees the same large tensors every step (one chunk of the fused classifier's
    fp32 logits is 128 x 50,304 x 4 bytes = 25 MB). With the defaults glibc hands such blocks back to the
    OS when freed and maps fresh pages for the next one, which the kernel then faults in and zeroes: a large
    share of a CPU step (docs/benchmarks.md, "How the allocator was found"). Process-wide and cheap to set;
    the price is a few hundred MB of freed memory the process keeps."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mmap_threshold, trim_threshold = (32 << 20, 1 << 30) if keep else (_GLIBC_DEFAULT_THRESHOLD,) * 2
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def accumulation_steps(cfg: Config, world_size: int) -> int:
    """Micro-batches per optimizer step: total_batch_tokens / (micro_batch * seq_len * world_size), exactly."""
    seq_len = cfg.train.seq_len or cfg.model.block_size
    problem = batch_problem(cfg.train.total_batch_tokens, cfg.train.micro_batch, seq_len, world_size)
    if problem:
        raise ConfigError(problem)
    return max(1, cfg.train.total_batch_tokens // (cfg.train.micro_batch * seq_len * world_size))


def batch_problem(total_batch_tokens: int, micro_batch: int, seq_len: int, world_size: int) -> str | None:
    """Why a step of total_batch_tokens cannot be whole micro-batches on every rank; None when it can (0: one)."""
    per_pass = micro_batch * seq_len * world_size
    if total_batch_tokens > 0 and total_batch_tokens % per_pass:
        return (f"train.total_batch_tokens = {total_batch_tokens} is not a multiple of "
                f"micro_batch * seq_len * world_size = {per_pass}; pick a multiple of {per_pass}")
    return None


# CPU flags of the instructions that compute bf16 products in hardware (Linux's names in /proc/cpuinfo).
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them; empty where /proc/cpuinfo is not there (macOS, Windows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls in hardware (AVX-512 BF16 or AMX) and torch may use AVX-512
    here. Without it autocast would emulate bf16, many times slower than fp32. torch's own setting
    ATEN_CPU_CAPABILITY=avx2 makes a process run, and resolve `auto`, as on a CPU with AVX2 alone."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    return bool(NATIVE_BF16_FLAGS & cpu_flags())


def resolve_dtype(name: str, device_type: str, bf16_supported: bool | None = None) -> torch.dtype:
    """auto: bf16 on GPUs that have it, fp16 (with a GradScaler) on older GPUs; bf16 on a CPU that computes it
    natively (faster than fp32 there: docs/benchmarks.md, Speed targets), fp32 elsewhere. `bf16_supported` answers
    for a GPU that is not this machine's (a plan); None asks this machine's."""
    if name != "auto":
        return DTYPES[name]
    if device_type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if device_type != "cuda":
        return torch.float32
    if bf16_supported is None:
        bf16_supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16_supported else torch.float16


def autocast_for(device_type: str, dtype: torch.dtype):
    """Mixed precision for forwards in `dtype` (matmuls in bf16/fp16, reductions in fp32); fp32 runs as is."""
    return nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)


def resolve_compile(setting: bool | str, device_type: str) -> bool:
    """auto: compile on CUDA; eager elsewhere. On a CPU compile made the quickstart's steps faster, but most
    compiled runs ended at a worse validation loss than every eager run (docs/benchmarks.md, Speed targets:
    the table of validation losses at step 300), so a CPU compiles only when asked (train.compile = true)."""
    if setting != "auto":
        return setting is True
    return device_type == "cuda"


@dataclass(frozen=True)
class Runtime:
    """What one rank of a run does: the answer to every "auto" and 0 of the config."""

    device: torch.device
    dtype: torch.dtype  # the autocast dtype; float32: no autocast
    tf32: bool  # TF32 tensor cores for fp32 matmuls (CUDA only)
    compile: bool
    micro_batch: int
    seq_len: int
    world_size: int
    grad_accum: int  # micro-batches per optimizer step on each rank
    seed: int
    deterministic: bool = False  # only deterministic kernels: a rerun (or a resume) repeats bit for bit
    cpu_keep_freed_memory: bool = False  # CPU: glibc keeps freed blocks for the next step (keep_freed_cpu_memory)
    batch_stages: tuple[tuple[float, int], ...] = ()  # train.batch_schedule (config.batch_stages); () a fixed batch
    max_steps: int = 1

    def record(self) -> dict:
        """What this runtime made of the config's "auto"s, as the run log's run_start and every checkpoint's
        meta.json record it beside the config: the autocast dtype, whether the model compiled, the device."""
        return {"dtype": str(self.dtype).removeprefix("torch."), "compile": self.compile, "device": str(self.device)}

    @property
    def tokens_per_step(self) -> int:
        """The base batch: a step's tokens where train.batch_schedule is off (else `schedule` multiplies it)."""
        return self.micro_batch * self.seq_len * self.world_size * self.grad_accum

    @property
    def schedule(self) -> BatchSchedule:
        """Each step's tokens and micro-batches (batch_schedule.py): what the trainer runs and counts."""
        return BatchSchedule.of(self.batch_stages, self.max_steps, self.tokens_per_step, self.grad_accum)

    @property
    def uses_grad_scaler(self) -> bool:
        """fp16 needs loss scaling; bf16 has fp32's range and does not."""
        return self.dtype == torch.float16

    def autocast(self):
        """The context every forward of the run runs in (a fresh one each call)."""
        return autocast_for(self.device.type, self.dtype)

    def apply(self):
        """Set the process-wide switches this runtime asks for: TF32 matmuls on CUDA, deterministic kernels,
        on a CPU the allocator's thresholds."""
        if self.device.type == "cpu" and self.cpu_keep_freed_memory:
            keep_freed_cpu_memory()
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32
        if self.deterministic:
            # cuBLAS reduces in a fixed order only with a fixed workspace; read when its handle is created,
            # which happens at the first matmul, after this.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False  # autotuning may pick another kernel run to run
            torch.backends.cudnn.deterministic = True
        # Ops with no deterministic implementation raise instead of silently varying (e.g. CUDA index_add_
        # in the embedding's backward is replaced by a sorted, deterministic accumulation).
        torch.use_deterministic_algorithms(self.deterministic)


def resolve_runtime(cfg: Config, device: torch.device | str, world_size: int = 1,
                    bf16_supported: bool | None = None) -> Runtime:
    """The runtime of a resolved config (runconfig.resolve_run) on `device` with `world_size` ranks."""
    device = torch.device(device)
    if device.type == "cpu":
        check_fits_in_ram(cfg, world_size)
    seq_len = cfg.train.seq_len or cfg.model.block_size
    return Runtime(device=device, dtype=resolve_dtype(cfg.train.dtype, device.type, bf16_supported),
                   tf32=cfg.train.tf32, compile=resolve_compile(cfg.train.compile, device.type),
                   micro_batch=cfg.train.micro_batch, seq_len=seq_len, world_size=world_size,
                   grad_accum=accumulation_steps(cfg, world_size), seed=cfg.train.seed,
                   deterministic=cfg.train.deterministic,
                   cpu_keep_freed_memory=cfg.train.cpu_keep_freed_memory,
                   batch_stages=tuple(batch_stages(cfg.train)), max_steps=cfg.train.max_steps)


TRAINING_BYTES_PER_PARAMETER = 16  # fp32 weights and gradients, AdamW's two moments: the least a CPU run holds


def physical_ram_bytes() -> int:
    """This machine's memory in all; 0 where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0


def check_fits_in_ram(cfg: Config, world_size: int) -> None:
    """Refuse, before the model is built, a CPU run whose weights, gradients and optimizer moments alone exceed
    the machine's memory (the ranks on this machine together): building it ends with the OS killing the process,
    or hours of swapping, not an error. Anything that might fit is left to run (free memory varies)."""
    total = physical_ram_bytes()
    shards = world_size if cfg.train.distributed == "fsdp" else 1
    ranks_here = local_world_size()
    params = parameter_count(cfg.model)
    need = params * TRAINING_BYTES_PER_PARAMETER // shards * ranks_here
    if total and need > total:
        ranks = f" x {ranks_here} ranks" if ranks_here > 1 else ""
        raise ConfigError(f"a model of {params:,} parameters needs at least {format_bytes(need)} to train on this CPU "
                          f"(fp32 weights, gradients and AdamW's moments{ranks}) and this machine has "
                          f"{format_bytes(total)}; choose a smaller model (`gpt2train memory` estimates one)")
