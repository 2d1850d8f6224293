"""`gpt2train memory --find-batch`: the largest micro-batch whose training step fits, measured on the CUDA device.

It tries the trainer's own steps (TrainStep, eager) at growing micro-batches and reads the CUDA allocator's
peak; without CUDA it says so and falls back to the estimate (gpt2train.memory). A measurement on the device,
as the other benchmarks are, so it lives here above the library, beside them; the estimate it falls back to is
library code that `plan` uses too.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from gpt2train.config import Config
from gpt2train.memory import accumulation_for, resolve_model, suggest_micro_batch
from gpt2train.model import GPT
from gpt2train.runtime import Runtime, resolve_runtime
from gpt2train.training.optim import make_optimizer
from gpt2train.training.step import TrainStep
from gpt2train.units import format_bytes


@dataclass
class BatchSearch:
    micro_batch: int  # largest that fits with the headroom (and divides total_batch_tokens)
    grad_accum: int
    largest_fitting: int  # before rounding to divide total_batch_tokens
    trials: list[tuple[int, bool, int | None]]  # (micro_batch, fits, peak bytes or None on OOM)
    device_bytes: int
    headroom: float


def find_micro_batch(cfg: Config, headroom: float = 0.1, limit: int = 1024, progress=None) -> BatchSearch:
    """Largest micro_batch whose training step fits in (1 - headroom) of the CUDA device's memory.

    Each trial runs two eager forward/backward/optimizer steps (so the optimizer states exist) on
    random tokens and reads torch.cuda.max_memory_allocated; an OutOfMemoryError counts as too big.
    The search doubles from 1, then bisects.
    """
    if not torch.cuda.is_available():
        raise ValueError("--find-batch measures on a CUDA device and none is available")
    if not 0 <= headroom < 1:
        raise ValueError(f"--headroom {headroom} must be in [0, 1)")
    device = torch.device(cfg.train.device if cfg.train.device.startswith("cuda") else "cuda")
    m, _ = resolve_model(cfg)
    resolved = copy.deepcopy(cfg)
    resolved.model = m
    # The trainer's runtime, eager (compiling each trial size would take minutes), accumulating over two
    # micro-batches so that the second runs with the gradients held.
    runtime = dataclasses.replace(resolve_runtime(resolved, device), compile=False, grad_accum=2)
    runtime.apply()
    total_memory = torch.cuda.get_device_properties(device).total_memory
    budget = (1 - headroom) * total_memory
    model = GPT(m).to(device)
    optimizer = make_optimizer(model, cfg.train, "cuda")
    trials: list[tuple[int, bool, int | None]] = []

    def fits(b: int) -> bool:
        peak = measured_peak(model, optimizer, dataclasses.replace(runtime, micro_batch=b), m.vocab_size,
                             cfg.train.grad_clip, device)
        ok = peak is not None and peak <= budget
        trials.append((b, ok, peak))
        if progress is not None:
            progress(b, ok, peak)
        return ok

    best = largest_that_fits(fits, limit)
    if best == 0:
        raise ValueError(f"not even micro_batch 1 fits in {format_bytes(budget)}; enable model.grad_checkpointing, "
                         "set model.loss_chunk, or shard with FSDP")
    b, accum = accumulation_for(cfg, best)
    return BatchSearch(b, accum, best, trials, total_memory, headroom)


def measured_peak(model: GPT, optimizer, runtime: Runtime, vocab_size: int, grad_clip: float,
                  device: torch.device) -> int | None:
    """The CUDA allocator's peak over two training steps at runtime.micro_batch on random tokens (the second has
    the optimizer states), or None when they run out of memory. The gradients and the cache are freed after."""
    B, T = runtime.micro_batch, runtime.seq_len

    def random_batch():
        x = torch.randint(0, vocab_size, (B, T), device=device)
        return x, x

    step = TrainStep(model, optimizer, random_batch, runtime, grad_clip=grad_clip)
    peak = None
    try:
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(2):  # the second step has the optimizer states
            step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    except torch.cuda.OutOfMemoryError:
        pass
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    return peak


def largest_that_fits(fits, limit: int) -> int:
    """The largest b in [1, limit] with fits(b) (fits is monotone: a larger micro-batch never fits where a smaller
    does not), or 0: doubling from 1, then bisecting between the last that fit and the first that did not."""
    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1 and lo > 0:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def find_batch_report(cfg: Config, headroom: float = 0.1, world_size: int = 1, gpu_memory_gib: float = 80.0,
                      echo=print) -> str:
    """`gpt2train memory --find-batch`: measure on CUDA, or explain and fall back to the estimate."""
    T = cfg.train.seq_len or cfg.model.block_size
    if not torch.cuda.is_available():
        budget = int((1 - headroom) * gpu_memory_gib * 2**30)
        b = suggest_micro_batch(cfg, budget, world_size)
        lines = ["--find-batch measures by running training steps on a CUDA device, and there is none here.",
                 f"Estimate-based suggestion instead, for a GPU of {gpu_memory_gib:g} GiB with {headroom:.0%} "
                 f"headroom (--gpu-memory-gib to change):"]
        if b == 0:
            lines.append("  not even micro_batch 1 fits; enable model.grad_checkpointing or model.loss_chunk, "
                         "or shard with FSDP")
            return "\n".join(lines)
        fit, accum = accumulation_for(cfg, b, world_size)
        lines.append(f"  largest micro_batch by the estimate: {b}")
        lines.append(_accumulation_line(cfg, fit, accum, T, world_size))
        return "\n".join(lines)

    def progress(b, ok, peak):
        used = format_bytes(peak) if peak is not None else "out of memory"
        echo(f"  micro_batch {b:>4}: {used} -> {'fits' if ok else 'too big'}")

    echo(f"searching on {torch.cuda.get_device_name()} with {headroom:.0%} headroom (eager steps):")
    found = find_micro_batch(cfg, headroom, progress=progress)
    lines = [f"largest micro_batch that fits: {found.largest_fitting} "
             f"(device memory {format_bytes(found.device_bytes)})",
             _accumulation_line(cfg, found.micro_batch, found.grad_accum, T, 1)]
    if world_size > 1:
        lines.append(f"  (measured on one device; with {world_size} ranks the accumulation divides by {world_size}: "
                     f"see train.total_batch_tokens)")
    return "\n".join(lines)


def _accumulation_line(cfg: Config, micro_batch: int, accum: int, T: int, world_size: int) -> str:
    if cfg.train.total_batch_tokens <= 0:
        return f"  set train.micro_batch = {micro_batch} (train.total_batch_tokens is 0: no accumulation)"
    return (f"  for train.total_batch_tokens = {cfg.train.total_batch_tokens:,}: micro_batch {micro_batch} x seq_len {T} "
            f"x {world_size} rank(s) x {accum} accumulation steps")
