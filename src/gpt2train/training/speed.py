"""The speed a run trains at, in tokens/s of all its ranks, for train.time_budget (the size dial turns it into
tokens): a GPU of the device table by its peak in the run's precision x MFU (a `gpt2train bench` figure, else
the assumed one) / FLOPs per token; a CPU by timing the run's own TrainStep here on a few steps.

    resolve_measuring(config, overrides, env) -> RunConfig   (`gpt2train train`, plan, config show)
    as_run_measuring(cfg, env) -> RunConfig                  (the library's train(): the same, from Python)

runconfig.resolve_run raises SpeedNeeded where a budget needs a speed that neither the environment nor a
resumed checkpoint gives; these measure it and resolve again. plan.py estimates a run's time from the same peak
and MFU.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

from gpt2train import devices, runtime
from gpt2train.bench_results import newest_journey, read_final_mfu
from gpt2train.config import Config, ConfigError
from gpt2train.counting import flops_per_token
from gpt2train.devices import ASSUMED_GPU_MFU, Device
from gpt2train.model import GPT
from gpt2train.runconfig import Environment, RunConfig, as_run, prepared_meta, resolve_run
from gpt2train.runtime import resolve_runtime
from gpt2train.sizing import SpeedNeeded
from gpt2train.tokenizer import GPT2_VOCAB_SIZE
from gpt2train.training.optim import make_optimizer
from gpt2train.training.step import TrainStep

CPU_FLOPS_FLOOR = 2e10  # FLOP/s: a slow CPU, to decide whether timing a step here is quick
CPU_TIMING_LIMIT_S = 30  # time steps here only when all of them should take less than this


def resolve_measuring(config, overrides=(), env: Environment | None = None, device: Device | None = None,
                      mfu: float | None = None, tokens_per_s: float | None = None,
                      runs_dir: str | Path = "runs") -> RunConfig:
    """runconfig.resolve_run, and where train.time_budget needs the run's speed and none is known, that speed
    (measure_speed for env's ranks on `device`), then resolved again with it: train, plan and config show."""
    env = env or Environment.of_launch()
    try:
        return resolve_run(config, overrides, env)
    except SpeedNeeded as need:
        rate, source = measure_speed(need.shaped, device, env.world_size, mfu, tokens_per_s, runs_dir)
        return resolve_run(config, overrides, env.with_speed(rate, source))


def as_run_measuring(cfg: Config | RunConfig, env: Environment) -> RunConfig:
    """runconfig.as_run (a RunConfig as it is, a Config resolved), measuring this machine's speed where
    train.time_budget needs one, as resolve_measuring does for `gpt2train train`: the library's train()."""
    try:
        return as_run(cfg, env)
    except SpeedNeeded as need:
        rate, source = measure_speed(need.shaped, gpus=env.world_size)
        return as_run(cfg, env.with_speed(rate, source))


def measure_speed(shaped: Config, device: Device | None = None, gpus: int = 1, mfu: float | None = None,
                  tokens_per_s: float | None = None, runs_dir: str | Path = "runs") -> tuple[float, str]:
    """The run's tokens/s on `gpus` x device, all of them, and where the figure comes from, for the size dial's
    train.time_budget; `shaped`: the config with its model shape set. device None: the config's train.device on
    this machine. tokens_per_s (per device, plan's --tokens-per-s) wins; else a GPU of the table: peak x MFU
    (given, else as `plan` chooses it) / FLOPs per token; a CPU: a few steps timed here, on one process only
    (ranks would each time their own)."""
    if tokens_per_s:  # plan's --tokens-per-s, a positive figure
        return tokens_per_s * gpus, "given with --tokens-per-s"
    target = device or device_of_this_machine(shaped.train.device)
    notes: list[str] = []
    shaped = config_as_trained(shaped, gpus, prepared_meta(shaped), target)
    peak = peak_flops_for(target, shaped)
    if peak is not None:
        used, source = (mfu, "given with --mfu") if mfu is not None else benched_or_assumed_mfu(target, runs_dir, notes)
        per_token = flops_per_token(shaped.model, shaped.train.seq_len)
        return (peak * used * gpus / per_token,
                f"{gpus} x {target.name}: {peak / 1e12:,.0f} TFLOP/s peak x MFU {used:.2f} ({source}) / "
                f"{per_token:,} FLOPs per token")
    if target.is_gpu or gpus > 1:
        raise ConfigError(f"train.time_budget: the speed of {gpus} x {target.name} cannot be measured here; "
                          f"set train.tokens_per_s")
    rate, source = measure_cpu_speed(shaped, notes)
    if rate is None:
        raise ConfigError(f"train.time_budget: {notes[-1]}; set train.tokens_per_s")
    return rate, source


def device_of_this_machine(name: str) -> Device:
    """train.device on this machine as the device table describes it: a CUDA GPU with its real memory (auto: the
    CPU without CUDA), or the CPU. MPS has no entry: its speed is the config's to give."""
    from gpt2train.distributed import resolve_device

    device = resolve_device(name)
    if device.type not in ("cuda", "cpu"):
        raise ConfigError(f"train.time_budget: the speed of {device.type} cannot be measured here; set "
                          "train.tokens_per_s")
    return devices.describe(device)


def peak_flops_for(device: Device, cfg: Config) -> float | None:
    """Dense peak FLOP/s of the device in the run's precision (bf16 autocast on GPUs unless told otherwise)."""
    return devices.peak_flops(device, gpu_dtype(cfg), cfg.train.tf32)


def gpu_dtype(cfg: Config) -> torch.dtype:
    """The dtype of the run's matmuls on a GPU of the table: train.dtype's, bf16 for auto."""
    return runtime.DTYPES.get(cfg.train.dtype, torch.bfloat16)


def config_as_trained(cfg: Config, gpus: int, meta: dict | None, device: Device) -> Config:
    """A copy of a resolved config with what the trainer decides on the device made concrete: the vocabulary
    of data not prepared yet (GPT-2's), one micro-batch per rank for total_batch_tokens 0, the dtype."""
    cfg = copy.deepcopy(cfg)
    if cfg.model.vocab_size <= 0:
        cfg.model.vocab_size = int(meta["vocab_size"]) if meta else GPT2_VOCAB_SIZE
    if cfg.train.seq_len <= 0:
        cfg.train.seq_len = cfg.model.block_size
    if cfg.train.total_batch_tokens <= 0:  # the trainer's meaning of 0: one micro-batch on every rank
        cfg.train.total_batch_tokens = cfg.train.micro_batch * cfg.train.seq_len * gpus
    # The dtype the trainer picks on that device (a GPU of the table has bf16).
    dtype = runtime.resolve_dtype(cfg.train.dtype, "cuda" if device.is_gpu else "cpu", bf16_supported=True)
    cfg.train.dtype = {v: k for k, v in runtime.DTYPES.items()}[dtype]
    return cfg


def bench_mfu(path: str | Path, device: Device) -> tuple[float | None, str]:
    """(MFU, why) from a bench journey.json: its final, tuned stage. None with the reason when the file holds
    none or was measured on another device."""
    try:
        mfu, bench_device = read_final_mfu(path)
    except ValueError as e:
        return None, str(e)
    if device.match and devices.normalized_name(device.match) not in devices.normalized_name(bench_device):
        return None, f"{path} was measured on {bench_device}, not {device.name}"
    return mfu, f"measured by gpt2train bench ({path})"


def benched_or_assumed_mfu(device: Device, runs_dir: str | Path, notes: list[str]) -> tuple[float, str]:
    """(MFU, why): the newest `gpt2train bench` journey's in runs_dir, measured on this device, else the assumed
    one (a note says why a journey found was not used)."""
    found = newest_journey(runs_dir)
    if found is not None:
        measured, why = bench_mfu(found, device)
        if measured is not None:
            return measured, why
        notes.append(f"bench figure not used: {why}")
    return ASSUMED_GPU_MFU, "assumed (typical for a tuned GPU run; --mfu or gpt2train bench to refine)"


def measure_cpu_speed(cfg: Config, notes: list[str], steps: int = 2) -> tuple[float | None, str]:
    """Tokens/s of the config's training step on this machine's CPU, as `gpt2train train` would run it there
    (the same TrainStep and runtime, one micro-batch of random tokens): one warm-up step, then `steps` timed.
    None, with a note, when the step is too big to time in seconds."""
    B, T = cfg.train.micro_batch, cfg.train.seq_len
    flops = flops_per_token(cfg.model, T) * B * T * (1 + steps)
    if flops / CPU_FLOPS_FLOOR > CPU_TIMING_LIMIT_S:
        # The fact only: each caller names its own remedy (plan's --tokens-per-s, the config's train.tokens_per_s).
        notes.append(f"a step is too big to time here quickly (~{flops / CPU_FLOPS_FLOOR / (1 + steps):,.0f} s at "
                     f"{CPU_FLOPS_FLOOR / 1e9:.0f} GFLOP/s)")
        return None, ""
    cpu_runtime = dataclasses.replace(resolve_runtime(cfg, "cpu"), grad_accum=1)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    x = torch.randint(0, cfg.model.vocab_size, (B, T))
    step = TrainStep(torch.compile(model) if cpu_runtime.compile else model, make_optimizer(model, cfg.train, "cpu"),
                     lambda: (x, x), cpu_runtime, clip_params=model.parameters(), grad_clip=cfg.train.grad_clip, timed=True)
    step()  # warm-up (and compilation, when the config compiles)
    elapsed = sum(step().seconds for _ in range(steps))
    speed = B * T * steps / elapsed
    return speed, f"measured here over {steps} steps of micro_batch {B} on {torch.get_num_threads()} CPU threads"
