"""Plan a run before paying for it: size, compute, time and memory of a config on a named device.

The flow is resolve the config (seq_len, vocab, batch) -> count (parameters, FLOPs per token, tokens)
-> time (peak FLOP/s x MFU, measured or assumed) -> memory (does it fit; if not, what would). Nothing
here touches a GPU: the counts are arithmetic on the config (gpt2train.model), the device's memory and peak
come from gpt2train.devices. The formulas and the device table are in docs/plan-and-doctor.md.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from gpt2train import devices
from gpt2train.batch_schedule import BatchSchedule, steps_for_tokens
from gpt2train.config import Config, ConfigError, batch_stages
from gpt2train.counting import flops_per_token, parameter_count
from gpt2train.devices import Device
from gpt2train.memory import estimate_memory
from gpt2train.runconfig import Environment, RunConfig, as_run
from gpt2train.runtime import accumulation_steps
from gpt2train.sizing import Derived, format_derived
from gpt2train.training.speed import (
    bench_mfu,
    benched_or_assumed_mfu,
    config_as_trained,
    gpu_dtype,
    measure_cpu_speed,
    peak_flops_for,
)
from gpt2train.units import format_bytes, format_count, format_duration, format_significant

CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: compute-optimal training sees ~20 tokens per parameter
MEMORY_HEADROOM = 0.90  # share of a device's memory a run may plan on: CUDA context, allocator fragmentation
SUGGESTED_LOSS_CHUNK = 1024  # rows per cross-entropy chunk: (1024, 50304) fp32 logits are ~200 MB


# More epochs than this over one source of a mixture gets a warning: past about 4 repeats, more of the same text
# helps little (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models").
MAX_EPOCHS = 4


@dataclass
class SourceEpochs:
    """One source of a mixture (data.sources): its share of the run's tokens and its train tokens."""
    folder: str
    share: float
    train_tokens: int | None  # None: not prepared yet

    def epochs(self, budget_tokens: int) -> float | None:
        return self.share * budget_tokens / self.train_tokens if self.train_tokens else None


class PlanError(ValueError):
    """Input a plan cannot be made from; the message is one line saying what to fix."""


# ----------------------------------------------------------------------------------------------
# Devices


def target_device(name: str) -> Device:
    """The device a plan is for: one of gpt2train.devices' table by name or alias ("H100", "a100-40gb",
    "RTX 4090", "cpu"), or this machine's accelerator with its real memory for "auto" / "cuda" / "cuda:N" (auto
    falls back to the CPU without CUDA; cuda raises without it)."""
    from gpt2train.distributed import resolve_device

    key = devices.normalized_name(name)
    if key in ("auto", "cuda") or key.startswith("cuda"):
        return devices.describe(resolve_device(name.strip().lower()))
    device = devices.find_device(name)
    if device is None:
        known = ", ".join(d.name for d in devices.plannable())
        raise PlanError(f"unknown device {name!r}; use one of: {known}, CPU, or auto (this machine)")
    return device


# ----------------------------------------------------------------------------------------------
# Counting


def accumulation(cfg: Config, gpus: int) -> int:
    return accumulation_steps(cfg, gpus)  # the trainer's own resolution and one-line error


def wall_seconds(tokens: float, flops_per_tok: float, peak: float, mfu: float, gpus: int) -> float:
    """time = tokens x FLOPs/token / (peak x MFU x GPUs)."""
    return tokens * flops_per_tok / (peak * mfu * gpus)


# ----------------------------------------------------------------------------------------------
# Memory


def estimate_memory_bytes(cfg: Config, world_size: int) -> tuple[int, dict[str, int], str]:
    """(bytes per device, breakdown, which estimator) from the memory estimator of `gpt2train memory`."""
    est = estimate_memory(cfg, world_size)
    return int(est.total_bytes), dict(est.breakdown), "gpt2train.memory"


@dataclass
class MemoryOption:
    """One configuration tried for memory: what it changes and what it costs per device."""

    label: str
    overrides: dict[str, object]  # config keys to --set
    total_bytes: int
    micro_batch: int
    grad_accum: int


@dataclass
class MemoryFit:
    total_bytes: int
    breakdown: dict[str, int]
    usable_bytes: int  # the device's memory x MEMORY_HEADROOM
    fits: bool
    estimator: str
    suggestion: MemoryOption | None = None  # the first option that fits, when the config does not


def memory_fit(cfg: Config, device: Device, gpus: int) -> MemoryFit:
    """Does the resolved config fit one device? If not, the first of: smaller micro-batches, then
    activation checkpointing, then chunked loss, then FSDP over the GPUs, each kept once added."""
    usable = int(device.memory_bytes * MEMORY_HEADROOM)
    total, breakdown, source = estimate_memory_bytes(cfg, gpus)
    fit = MemoryFit(total, breakdown, usable, total <= usable, source)
    if not fit.fits:
        fit.suggestion = first_fitting_option(cfg, gpus, usable)
    return fit


def first_fitting_option(cfg: Config, gpus: int, usable_bytes: int) -> MemoryOption | None:
    steps: list[tuple[str, dict]] = [("smaller micro-batch", {})]
    if not cfg.model.grad_checkpointing:
        steps.append(("activation checkpointing", {"model.grad_checkpointing": True}))
    if cfg.model.loss_chunk <= 0:
        steps.append(("chunked loss", {"model.loss_chunk": SUGGESTED_LOSS_CHUNK}))
    if gpus > 1 and cfg.train.distributed != "fsdp":
        steps.append((f"FSDP over {gpus} GPUs", {"train.distributed": "fsdp"}))

    overrides: dict[str, object] = {}
    labels: list[str] = []
    for label, added in steps:
        overrides = {**overrides, **added}
        labels = labels + [label] if added else labels
        for micro_batch in _halvings(cfg, gpus):
            trial = _with_overrides(cfg, {**overrides, "train.micro_batch": micro_batch})
            total = estimate_memory_bytes(trial, gpus)[0]
            if total <= usable_bytes:
                changes = dict(overrides)
                what = list(labels)
                if micro_batch != cfg.train.micro_batch:
                    changes["train.micro_batch"] = micro_batch
                    changes["train.total_batch_tokens"] = cfg.train.total_batch_tokens
                    what.insert(0, f"micro-batch {micro_batch}")
                return MemoryOption(" + ".join(what), changes, total, micro_batch, accumulation(trial, gpus))
    return None


def _halvings(cfg: Config, gpus: int) -> list[int]:
    """The micro-batch and its halvings that still divide the step's tokens evenly (accumulation
    rises to keep total_batch_tokens)."""
    sizes, mb = [], cfg.train.micro_batch
    while mb >= 1 and cfg.train.total_batch_tokens % (mb * cfg.train.seq_len * gpus) == 0:
        sizes.append(mb)
        if mb % 2:
            break
        mb //= 2
    return sizes


def _with_overrides(cfg: Config, overrides: dict[str, object]) -> Config:
    cfg = copy.deepcopy(cfg)
    for name, value in overrides.items():
        section, key = name.split(".")
        setattr(getattr(cfg, section), key, value)
    return cfg


def set_flags(overrides: dict[str, object]) -> str:
    def toml(v):
        return str(v).lower() if isinstance(v, bool) else (f'"{v}"' if isinstance(v, str) else str(v))

    return " ".join(f"--set {k}={toml(v)}" for k, v in overrides.items())


# ----------------------------------------------------------------------------------------------
# The plan


@dataclass
class Plan:
    cfg: Config  # resolved: concrete vocab, seq_len, total_batch_tokens, dtype
    device: Device
    gpus: int
    params: int
    params_non_embedding: int
    flops_per_token: int
    tokens_per_step: int
    grad_accum: int
    budget_tokens: int  # the tokens of max_steps steps (train.batch_schedule's, else max_steps x tokens per step)
    chinchilla_tokens: int  # 20 x params
    data_dir: str
    train_tokens: int | None  # from the prepared data's meta.json
    peak_flops: float | None
    mfu: float
    mfu_source: str
    memory: MemoryFit
    notes: list[str] = field(default_factory=list)
    tokens_per_s: float | None = None  # per device, where no peak is known (a CPU): given or measured here
    tokens_per_s_source: str = ""
    sources: list[SourceEpochs] = field(default_factory=list)  # a mixture's (then train_tokens is None)
    derived: list[Derived] = field(default_factory=list)  # what the size dial set, and the rules the config beat
    run: RunConfig | None = None  # the resolved config the plan was made for (cfg adds the device's choices)

    @property
    def steps_per_epoch(self) -> float | None:
        return self.train_tokens / self.tokens_per_step if self.train_tokens else None

    @property
    def epochs(self) -> float | None:
        return self.budget_tokens / self.train_tokens if self.train_tokens else None

    def wall_s(self, tokens: int) -> float | None:
        if self.peak_flops is None:
            return tokens / (self.tokens_per_s * self.gpus) if self.tokens_per_s else None
        return wall_seconds(tokens, self.flops_per_token, self.peak_flops, self.mfu, self.gpus)


def make_plan(cfg: Config | RunConfig, device: Device, gpus: int = 1, mfu: float | None = None, data_dir: str | None = None,
              bench_json: str | Path | None = None, runs_dir: str | Path = "runs", tokens_per_s: float | None = None,
              measure_cpu: bool = True) -> Plan:
    """Everything `gpt2train plan` prints. mfu (0..1) wins over a bench figure, which wins over the default.
    Without a known peak (a CPU), the time comes from tokens_per_s, else from timing a few steps here. A Config
    is resolved for `gpus` ranks first (runconfig.resolve_run)."""
    if gpus < 1:
        raise PlanError(f"--gpus {gpus}: need at least one device")
    try:
        run = as_run(cfg, Environment(world_size=gpus))
    except ConfigError as e:
        raise PlanError(str(e)) from None
    cfg = run.config
    if mfu is not None and not 0 < mfu <= 1:
        raise PlanError(f"--mfu {mfu}: give model FLOPs utilization as a fraction in (0, 1], e.g. 0.4")
    notes: list[str] = []
    sources = [] if data_dir else _read_sources(cfg, notes)
    if sources:
        data_dir, meta = ", ".join(s.folder for s, _ in sources), next((m for _, m in sources if m), None)
    else:
        data_dir = data_dir or cfg.data.dir
        meta = _read_meta(data_dir, required=data_dir != cfg.data.dir, notes=notes)
    if cfg.model.vocab_size <= 0:
        notes.append("vocab from the GPT-2 default: model.vocab_size is 0 in the config and the data is not prepared")
    derived = list(run.dial)
    cfg = config_as_trained(cfg, gpus, meta, device)

    params, params_non_embedding = parameter_count(cfg.model), parameter_count(cfg.model, non_embedding=True)
    per_token = flops_per_token(cfg.model, cfg.train.seq_len)
    accum = accumulation(cfg, gpus)
    tokens_per_step = cfg.train.micro_batch * cfg.train.seq_len * gpus * accum
    mfu, mfu_source = _choose_mfu(mfu, device, bench_json, runs_dir, notes)
    peak = peak_flops_for(device, cfg)
    speed, speed_source = None, ""
    if tokens_per_s is not None:
        if tokens_per_s <= 0:
            raise PlanError(f"--tokens-per-s {tokens_per_s}: must be positive")
        speed, speed_source = tokens_per_s, "given with --tokens-per-s"
    elif peak is None and cfg.train.tokens_per_s > 0:  # the size dial's figure, for a time budget
        speed, speed_source = cfg.train.tokens_per_s / gpus, "train.tokens_per_s"
    elif peak is None and measure_cpu and not device.is_gpu:
        speed, speed_source = measure_cpu_speed(cfg, notes)
    if peak is None and speed is None:
        notes.append(f"no peak FLOP/s known for {device.name}: wall time not estimated; pass --tokens-per-s or "
                     "plan for a GPU with --device")
    return Plan(cfg=cfg, device=device, gpus=gpus, params=params, params_non_embedding=params_non_embedding,
                flops_per_token=per_token, tokens_per_step=tokens_per_step, grad_accum=accum,
                budget_tokens=BatchSchedule.of(batch_stages(cfg.train), cfg.train.max_steps,
                                               tokens_per_step).tokens_through(cfg.train.max_steps),
                chinchilla_tokens=CHINCHILLA_TOKENS_PER_PARAM * params, data_dir=str(data_dir),
                train_tokens=int(meta["tokens"]["train"]) if meta and not sources else None, peak_flops=peak, mfu=mfu,
                mfu_source=mfu_source, memory=memory_fit(cfg, device, gpus), notes=notes, tokens_per_s=speed,
                tokens_per_s_source=speed_source, sources=[s for s, _ in sources], derived=derived,
                run=run)


def _read_sources(cfg: Config, notes: list[str]) -> list[tuple[SourceEpochs, dict | None]]:
    """data.sources with each one's meta.json (None, with a note, where not prepared yet); [] without sources.
    Sources of different tokenizers are refused here as the trainer refuses them."""
    from gpt2train.config import data_sources
    from gpt2train.data.mixture import data_meta

    pairs = data_sources(cfg.data) if cfg.data.sources else []
    total = sum(weight for _, weight in pairs)
    out = []
    for folder, weight in pairs:
        meta = _read_meta(folder, required=False, notes=notes)
        out.append((SourceEpochs(folder, weight / total, int(meta["tokens"]["train"]) if meta else None), meta))
    if out and all(meta for _, meta in out):
        shared = data_meta(cfg.data)  # one tokenizer; the largest vocabulary
        out[0] = (out[0][0], shared)
    return out


def _read_meta(data_dir: str, required: bool, notes: list[str]) -> dict | None:
    from gpt2train.data.prepared import load_meta

    try:
        return load_meta(data_dir)
    except FileNotFoundError:
        if required:
            raise
        notes.append(f"no prepared data at {data_dir}: steps per epoch unknown (pass --data DIR)")
        return None


def _choose_mfu(mfu: float | None, device: Device, bench_json, runs_dir, notes: list[str]) -> tuple[float, str]:
    if mfu is not None:
        return mfu, "given with --mfu"
    if bench_json is not None:
        if not Path(bench_json).is_file():
            raise PlanError(f"--bench-json {bench_json} does not exist: run `gpt2train bench` or drop the option")
        measured, why = bench_mfu(bench_json, device)
        if measured is None:
            raise PlanError(f"--bench-json: {why}")
        return measured, why
    return benched_or_assumed_mfu(device, runs_dir, notes)


# ----------------------------------------------------------------------------------------------
# Printing


def format_plan(plan: Plan) -> str:
    cfg, m = plan.cfg, plan.cfg.model
    stages = batch_stages(cfg.train)
    schedule = BatchSchedule.of(stages, cfg.train.max_steps, plan.tokens_per_step)
    lines = [
        f"model       {m.n_layer} layers x {m.n_embd} wide, {m.n_head} heads, vocab {m.vocab_size:,} "
        f"(padded {m.padded_vocab_size:,}), seq_len {cfg.train.seq_len}",
        f"parameters  {plan.params:,} ({format_count(plan.params)}); {plan.params_non_embedding:,} without embeddings",
        f"FLOPs/token {plan.flops_per_token:,} (6N + 12*L*C*T, training)",
        f"batch       {plan.tokens_per_step:,} tokens/step = {cfg.train.micro_batch} x {cfg.train.seq_len} "
        f"x {plan.gpus} device{'s' if plan.gpus > 1 else ''} x {plan.grad_accum} accumulation"
        + (f"; train.batch_schedule: {schedule.describe()}" if schedule.staged else ""),
        f"budget      {plan.budget_tokens:,} tokens ({format_count(plan.budget_tokens)}) = {cfg.train.max_steps:,} steps; "
        f"{_figure(plan.budget_tokens / plan.params, 1)} tokens/param",
        f"chinchilla  {plan.chinchilla_tokens:,} tokens ({format_count(plan.chinchilla_tokens)}) = 20 x params "
        f"= {steps_for_tokens(stages, plan.chinchilla_tokens, plan.tokens_per_step):,} steps; budget is "
        f"{_figure(plan.budget_tokens / plan.chinchilla_tokens, 2)}x of it",
    ]
    if plan.derived:
        lines.append(f"size dial   model.depth = {m.depth} (rules: docs/training.md, \"One size dial\")")
        lines += [f"  {line}" for line in format_derived(plan.derived)]
    lines += _source_lines(plan)
    if plan.train_tokens:
        lines.append(f"data        {plan.data_dir}: {plan.train_tokens:,} train tokens = {_figure(plan.steps_per_epoch, 1)} "
                     f"steps/epoch; the budget is {_figure(plan.epochs, 2)} epochs")
    precision = devices.precision(gpu_dtype(cfg), cfg.train.tf32)
    peak = f"{plan.peak_flops / 1e12:,.0f} TFLOP/s peak ({precision})" if plan.peak_flops else "peak unknown"
    lines.append(f"device      {plan.gpus} x {plan.device.name}: {peak}, "
                 f"{format_bytes(plan.device.memory_bytes)} each")
    budget_s, chinchilla_s = plan.wall_s(plan.budget_tokens), plan.wall_s(plan.chinchilla_tokens)
    if budget_s is not None and plan.peak_flops is None:
        lines.append(f"speed       {_figure(plan.tokens_per_s, 0)} tokens/s per device, {plan.tokens_per_s_source}")
        lines.append(f"time        budget: {format_duration(budget_s)}; chinchilla: {format_duration(chinchilla_s)} "
                     "(steps only: evaluation and checkpoints add to it)")
    elif budget_s is not None:
        lines.append(f"MFU         {_figure(plan.mfu, 2)}, {plan.mfu_source}")
        lines.append(f"time        budget: {format_duration(budget_s)}, {_gpu_hours(budget_s, plan.gpus)}; "
                     f"chinchilla: {format_duration(chinchilla_s)}, {_gpu_hours(chinchilla_s, plan.gpus)}")
    lines += _memory_lines(plan)
    lines += [f"note        {n}" for n in plan.notes]
    return "\n".join(lines)


def _source_lines(plan: Plan) -> list[str]:
    """A mixture's sources: each one's share, train tokens and the epochs the budget makes over it; a warning
    past MAX_EPOCHS."""
    lines = []
    for s in plan.sources:
        epochs = s.epochs(plan.budget_tokens)
        size = (f"{s.train_tokens:,} train tokens; the budget is {_figure(epochs, 2)} epochs of it" if epochs is not None
                else "not prepared: epochs unknown")
        lines.append(f"data        {s.folder} ({_figure(100 * s.share, 1)}% of the tokens): {size}")
        if epochs is not None and epochs > MAX_EPOCHS:
            lines.append(f"warning     {_figure(epochs, 1)} epochs over {s.folder}, more than {MAX_EPOCHS}: repeated "
                         f"text helps little; lower its weight or train.max_steps, or prepare more of it")
    return lines


def _memory_lines(plan: Plan) -> list[str]:
    mem = plan.memory
    verdict = "fits" if mem.fits else "does NOT fit"
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in mem.breakdown.items())
    lines = [f"memory      {format_bytes(mem.total_bytes)} per device of {format_bytes(mem.usable_bytes)} usable: "
             f"{verdict} ({mem.estimator}; {parts})"]
    if not mem.fits:
        s = mem.suggestion
        if s is None:
            lines.append("suggest     nothing tried fits: use a smaller model or seq_len, a larger device, "
                         "or more GPUs")
        else:
            lines.append(f"suggest     {s.label}: {format_bytes(s.total_bytes)}, micro_batch {s.micro_batch} "
                         f"x {s.grad_accum} accumulation: {set_flags(s.overrides)}")
    return lines


def _gpu_hours(seconds: float, gpus: int) -> str:
    hours = seconds * gpus / 3600
    return f"{_figure(hours, 1)} GPU-hours"


def _figure(x: float, decimals: int) -> str:
    """x with `decimals` decimals; below 1 with two significant digits instead, so that a small figure
    (0.042 tokens/param on a short run) does not print as 0.0."""
    return f"{x:,.{decimals}f}" if abs(x) >= 1 else format_significant(x)
