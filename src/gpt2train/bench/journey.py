"""The optimization journey: a short measured training segment per stage, from naive to fast.

Each stage turns on one more technique than the one before (cumulative), and every stage is built from
the library's real pieces: GPT and GPTConfig, TokenLoader, AdamW with make_optimizer's parameter groups,
autocast, torch.compile. `--ablate` measures the other way round: everything on, minus one technique.

A stage runs `warmup` untimed steps first (compilation happens there and is reported apart), then
`steps` timed ones: CUDA events around each step on a GPU, time.perf_counter on a CPU. The data is a
synthetic prepared dataset (random GPT-2 token ids in an llm.c shard), so nothing is downloaded; random
tokens cost the same FLOPs as real text.

A technique that cannot apply on the device is shown as skipped with the reason, never faked.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import math
import platform
import random
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt2train.bench_results import CEILING_KEY, JOURNEY_FILE, MatmulCeiling
from gpt2train.config import Config, TrainConfig
from gpt2train.counting import flops_per_token
from gpt2train.data.loader import TokenLoader
from gpt2train.data.shards import open_shard, write_shard
from gpt2train.devices import cpu_name
from gpt2train.devices import peak_flops as device_peak_flops
from gpt2train.distributed import resolve_device
from gpt2train.files import write_json_atomic, write_text_atomic
from gpt2train.mfu_basis import probe_cpu_ceiling
from gpt2train.model import GPT, preset_config
from gpt2train.process_memory import current_rss, peak_rss, reset_peak_rss
from gpt2train.progress import show_progress
from gpt2train.ranges import UsageError
from gpt2train.runtime import Runtime, cpu_has_native_bf16, keep_freed_cpu_memory, resolve_runtime
from gpt2train.tokenizer import GPT2_VOCAB_SIZE
from gpt2train.training.optim import make_optimizer
from gpt2train.training.step import TrainStep
from gpt2train.units import format_bytes, format_utc


# --- what a stage turns on -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    ram_loader: bool = False  # TokenLoader(mode="ram"), vectorized; else a Python loop over a memmap
    tf32: bool = False
    bf16: bool = False
    compile: bool = False
    sdpa: bool = False  # flash attention through scaled_dot_product_attention; else the naive (T, T) scores
    pad_vocab: bool = False  # 50257 -> 50304
    fused_adamw: bool = False  # else AdamW(foreach=False, fused=False): one small kernel chain per tensor
    chunked_loss: bool = False  # GPTConfig.loss_chunk: the fused classifier, never the full (B*T, V) logits
    cpu_allocator: bool = False  # CPU: glibc keeps freed memory (runtime.keep_freed_cpu_memory); else its default


# Journey order: (Setup field, stage label). Cheap, always-right changes first, as one would apply them.
TECHNIQUES: list[tuple[str, str]] = [
    ("ram_loader", "+ RAM preload, vectorized batches"),
    ("tf32", "+ TF32 matmuls"),
    ("bf16", "+ bf16 autocast"),
    ("compile", "+ torch.compile"),
    ("sdpa", "+ flash attention (SDPA)"),
    ("pad_vocab", "+ vocab 50304"),
    ("fused_adamw", "+ fused AdamW"),
    ("chunked_loss", "+ fused classifier (chunked loss)"),
    ("cpu_allocator", "+ CPU allocator keeps freed memory"),
]
SHORT_NAMES = {"ram_loader": "RAM loader", "tf32": "TF32", "bf16": "bf16 autocast", "compile": "torch.compile",
               "sdpa": "flash attention", "pad_vocab": "vocab 50304", "fused_adamw": "fused AdamW",
               "chunked_loss": "fused classifier", "cpu_allocator": "CPU allocator"}


@dataclass
class JourneyOptions:
    model: str = "gpt2-tiny"
    device: str = "auto"
    micro_batch: int = 8
    seq_len: int = 0  # 0: the preset's block_size
    steps: int = 10
    warmup: int = 3
    ablate: bool = False
    loss_chunk: int = 0  # rows per cross-entropy chunk; 0: a quarter of the micro-batch's tokens
    threads: int = 0  # CPU threads for torch; 0: torch's default
    data_tokens: int = 4_000_000  # size of the synthetic dataset
    techniques: list[str] | None = None  # journey stages to run after "naive" (default: all, in order)
    skip: list[str] = field(default_factory=list)  # techniques left off everywhere, shown as skipped

    def __post_init__(self):
        """UsageError, in one line, before any work, for what the arguments' types cannot see: the technique
        names, and a seq_len beyond the preset's block_size (0: the block_size). Each number's own range is
        checked once, by its type in cli/bench.py."""
        journey_stages(self)  # unknown technique names
        block = preset_config(self.model).block_size
        if self.seq_len > block:
            raise UsageError(f"--seq-len {self.seq_len} must be between 1 and the preset's block_size {block}")


@dataclass
class StageResult:
    name: str
    setup: dict
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    step_ms: float | None = None  # median of the timed steps
    step_ms_all: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_mem_bytes: int | None = None
    warmup_s: float | None = None  # the untimed steps, compilation included
    final_loss: float | None = None
    speedup_vs_first: float | None = None
    speedup_vs_previous: float | None = None


@dataclass
class JourneyResult:
    options: dict
    environment: dict
    stages: list[StageResult]
    ablation: list[StageResult]
    markdown: str = ""


# --- data ----------------------------------------------------------------------------------------------
def write_synthetic_data(out_dir: str | Path, tokens: int, vocab_size: int = GPT2_VOCAB_SIZE, seed: int = 0,
                         val_tokens: int = 0) -> Path:
    """A prepared dataset of uniformly random token ids: one train shard, one val shard of val_tokens if any (the
    trainer wants one, the journey does not), and meta.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sizes = {"train": tokens, "val": val_tokens} if val_tokens else {"train": tokens}
    for split, n in sizes.items():
        write_shard(out / f"{split}_000000.bin", rng.integers(0, vocab_size, size=n, dtype=np.int64), vocab_size)
    meta = {"source": "synthetic (uniform random ids)", "tokenizer": {"kind": "gpt2"}, "vocab_size": vocab_size,
            "eot_id": vocab_size - 1, "shards": {s: [f"{s}_000000.bin"] for s in sizes}, "tokens": sizes}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


class PythonLoopBatches:
    """The naive loader: a memory-mapped shard, one random window per row sliced in a Python loop."""

    def __init__(self, data_dir: Path, batch_size: int, seq_len: int, device: torch.device, seed: int = 0):
        self.tokens = open_shard(Path(data_dir) / "train_000000.bin")  # memmap: every read goes to the page cache
        self.B, self.T, self.device = batch_size, seq_len, device
        self.rng = random.Random(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = [self.rng.randrange(len(self.tokens) - self.T - 1) for _ in range(self.B)]
        x = torch.stack([torch.from_numpy(self.tokens[i : i + self.T].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(self.tokens[i + 1 : i + 1 + self.T].astype(np.int64)) for i in starts])
        return x.to(self.device), y.to(self.device)  # pageable memory: the copy blocks


# --- applicability ---------------------------------------------------------------------------------------
def not_applicable(technique: str, device: torch.device, skip: list[str] = ()) -> str | None:
    """Why a technique cannot run on this device (or was left out), or None when it runs."""
    if technique in skip:
        return "left out with --skip"
    if technique == "tf32":
        if device.type != "cuda":
            return "TF32 is an NVIDIA tensor-core mode (Ampere and newer); a CPU computes fp32 matmuls in fp32"
        if torch.cuda.get_device_capability(device)[0] < 8:
            return f"{torch.cuda.get_device_name(device)} predates Ampere: no TF32 tensor cores"
    if technique == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return f"{torch.cuda.get_device_name(device)} has no bf16"
    if technique == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        return (f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no AVX-512/AMX bf16 support: autocast "
                "would emulate bf16 matmuls, many times slower than fp32; a CPU trains in fp32")
    if technique == "cpu_allocator" and device.type != "cpu":
        return "a CPU setting (glibc's malloc); on a GPU the step's tensors live in torch's caching allocator"
    if technique == "fused_adamw":
        try:
            p = torch.nn.Parameter(torch.zeros(2, device=device))
            p.grad = torch.zeros(2, device=device)
            torch.optim.AdamW([p], fused=True).step()
        except (RuntimeError, TypeError, ValueError) as e:
            return f"torch {torch.__version__} has no fused AdamW on {device.type}: {str(e).splitlines()[0]}"
    return None


# --- one stage -----------------------------------------------------------------------------------------------
def stage_runtime(setup: Setup, options: JourneyOptions, device: torch.device) -> Runtime:
    """The runtime a stage trains under: the same resolution `gpt2train train` makes from a config."""
    cfg = Config()
    cfg.model = preset_config(options.model, vocab_size=GPT2_VOCAB_SIZE)
    cfg.train = replace(cfg.train, micro_batch=options.micro_batch, seq_len=options.seq_len, seed=0,
                        dtype="bfloat16" if setup.bf16 else "float32", tf32=setup.tf32, compile=setup.compile,
                        cpu_keep_freed_memory=setup.cpu_allocator)
    return resolve_runtime(cfg, device)


@contextmanager
def applied(runtime: Runtime):
    """The runtime's process-wide switches (TF32, deterministic kernels, the CPU allocator) for one stage, put
    back afterwards (the allocator to glibc's default thresholds)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    deterministic = torch.are_deterministic_algorithms_enabled()
    runtime.apply()
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
        torch.use_deterministic_algorithms(deterministic)
        if runtime.device.type == "cpu" and runtime.cpu_keep_freed_memory:
            keep_freed_cpu_memory(False)


class ProcessMemory:
    """Peak memory of a stage: CUDA's max_memory_allocated, or on CPU the process RSS high-water mark.

    On Linux the RSS high-water mark can be reset (write 5 to /proc/self/clear_refs; getrusage's
    ru_maxrss follows), so a stage's peak is its own: the high-water mark of its timed steps minus the
    RSS left once the stage is torn down and freed memory is handed back to the OS (malloc_trim). That
    is process memory: libraries and allocator caches blur it, so it is not comparable to CUDA's number.
    Where the reset is refused, the peak is reported as n/a.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.method = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                       else "process RSS high-water mark of the timed steps (getrusage, reset per stage) "
                            "minus the RSS after the stage is freed")

    def reset_peak(self) -> bool:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return True
        return reset_peak_rss()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return peak_rss()

    def floor(self) -> int:
        """RSS once everything of a stage is freed (CPU)."""
        _trim_heap()
        return current_rss()


def _trim_heap():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def measure_stage(name: str, setup: Setup, options: JourneyOptions, data_dir: Path, device: torch.device,
                  memory: ProcessMemory) -> StageResult:
    """Build the stage's model, optimizer and loader, warm up, and time `options.steps` training steps.

    The step is the trainer's own TrainStep (one micro-batch, no LR schedule: the optimizer's LR)."""
    result = StageResult(name=name, setup=dataclasses.asdict(setup))
    B, T = options.micro_batch, options.seq_len
    runtime = stage_runtime(setup, options, device)
    model_cfg = preset_config(options.model, vocab_size=GPT2_VOCAB_SIZE, pad_vocab_multiple=64 if setup.pad_vocab else 1,
                              attention="sdpa" if setup.sdpa else "naive",
                              loss_chunk=(options.loss_chunk or max(1, B * T // 4)) if setup.chunked_loss else 0)
    torch.manual_seed(0)
    model = GPT(model_cfg).to(device)
    model.train()
    optimizer = make_optimizer(model, TrainConfig(), device.type, fused=setup.fused_adamw)
    if setup.ram_loader:
        batches = TokenLoader(data_dir, "train", B, T, seed=0, mode="ram", device=device)
    else:
        batches = PythonLoopBatches(data_dir, B, T, device)
    train_step = TrainStep(torch.compile(model) if runtime.compile else model, optimizer, batches.next_batch, runtime,
                           clip_params=model.parameters())

    with applied(runtime):
        start = time.perf_counter()
        for _ in range(options.warmup):
            train_step()
        _synchronize(device)
        result.warmup_s = time.perf_counter() - start
        reset_ok = memory.reset_peak()
        times, loss = _timed_steps(train_step, options.steps, device)
    peak = memory.peak()
    result.step_ms_all = [t * 1000 for t in times]
    result.step_ms = statistics.median(result.step_ms_all)
    result.tokens_per_s = B * T / (result.step_ms / 1000)
    result.final_loss = float(loss)
    model = optimizer = train_step = batches = None  # free them before measuring the next stage
    _release(device, setup.compile)
    if device.type == "cuda":
        result.peak_mem_bytes = peak
    elif reset_ok:
        result.peak_mem_bytes = max(0, peak - memory.floor())
    return result


def _timed_steps(train_step, steps: int, device: torch.device) -> tuple[list[float], torch.Tensor]:
    """Seconds per step: CUDA events between consecutive steps on a GPU (no sync inside the loop)."""
    loss = None
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            loss = train_step().loss
            events[i + 1].record()
        torch.cuda.synchronize(device)
        return [events[i].elapsed_time(events[i + 1]) / 1000 for i in range(steps)], loss
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = train_step().loss
        times.append(time.perf_counter() - t0)
    return times, loss


def _synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device, compiled: bool):
    if compiled:
        torch.compiler.reset()  # drop compiled graphs, so the next stage compiles (and is measured) afresh
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- the journey and the ablation ---------------------------------------------------------------------------
def journey_stages(options: JourneyOptions) -> list[tuple[str, str]]:
    keys = options.techniques if options.techniques is not None else [k for k, _ in TECHNIQUES]
    labels = dict(TECHNIQUES)
    unknown = [k for k in [*keys, *options.skip] if k not in labels]
    if unknown:
        raise UsageError(f"unknown technique {unknown[0]!r}; techniques are {', '.join(labels)}")
    return [(k, labels[k]) for k in keys]


def run_journey(options: JourneyOptions, out_dir: str | Path, progress: bool = True) -> JourneyResult:
    """Measure the cumulative stages (and the ablation when asked); write journey.{md,json,png} to out_dir."""
    if options.device == "auto":  # the journey times CUDA and CPU steps only (MPS would need its own sync)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = resolve_device(options.device)
    if options.seq_len == 0:
        options = replace(options, seq_len=preset_config(options.model).block_size)
    if options.threads:
        torch.set_num_threads(options.threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    memory = ProcessMemory(device)
    planned = 1 + len(journey_stages(options))  # naive and the stages; then "all on" and one row per technique
    if options.ablate:
        planned += 1 + len(TECHNIQUES)
    peak, basis, ceiling = basis_of_rows(device)
    # The model's FLOPs, the same for every row (vocab 50257: padding adds work, not model FLOPs).
    model_flops = flops_per_token(preset_config(options.model, vocab_size=GPT2_VOCAB_SIZE, pad_vocab_multiple=1),
                                  options.seq_len)
    bar = show_progress(total=planned, unit="stage", enabled=progress)
    with tempfile.TemporaryDirectory(prefix="gpt2train-bench-") as tmp:
        needed = 4 * options.micro_batch * (options.seq_len + 1) * (options.steps + options.warmup)
        data_dir = write_synthetic_data(tmp, max(options.data_tokens, needed))
        rows = JourneyRows(options, device, memory, data_dir, out, bar, peak, basis, ceiling, model_flops)
        rows.measure_journey()
        if options.ablate:
            rows.measure_ablation()
    bar.close()

    result = rows.result()
    result.markdown = to_markdown(result)
    write_result(out, result, finished=True)
    plot_journey(result, out / "journey.png")
    return result


@dataclass
class JourneyRows:
    """The rows of one journey as they are measured, and what every row shares: the device, the synthetic data,
    the MFU basis. journey.json and journey.md are rewritten after each row."""
    options: JourneyOptions
    device: torch.device
    memory: ProcessMemory
    data_dir: Path
    out: Path
    bar: Any  # the progress bar: one step per row, measured or skipped
    peak: float | None  # the FLOP/s every row's MFU divides by (basis_of_rows)
    basis: str  # ... what it is
    ceiling: MatmulCeiling | None  # ... the CPU's measured matmul ceiling
    model_flops: float  # per token
    stages: list[StageResult] = field(default_factory=list)
    ablation: list[StageResult] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # technique -> why its stage failed; it stays off from then on

    def measure_journey(self):
        """naive, then each technique on top of the stages before it (the ones that ran)."""
        self.stages.append(self.measure("naive", Setup()))
        self.save_so_far()
        setup = Setup()
        for key, label in journey_stages(self.options):
            reason = not_applicable(key, self.device, self.options.skip)
            if reason:
                self.stages.append(StageResult(name=label, setup=dataclasses.asdict(setup), status="skipped",
                                               reason=reason))
                self.bar.update(1)
                continue
            self.stages.append(self.measure(label, replace(setup, **{key: True})))
            self.save_so_far()
            if self.stages[-1].status == "failed":
                self.failed[key] = self.stages[-1].reason
            else:
                setup = replace(setup, **{key: True})
        _speedups(self.stages)

    def measure_ablation(self):
        """Everything that can run ("all on"), then everything minus one technique at a time."""
        everything = Setup(**{k: self.left_out(k) is None for k, _ in TECHNIQUES})
        self.ablation.append(self.measure("all on", everything))
        self.save_so_far()
        for key, _ in TECHNIQUES:
            name = f"- {SHORT_NAMES[key]}"
            reason = self.left_out(key)
            if reason:
                self.ablation.append(StageResult(name=name, setup=dataclasses.asdict(everything), status="skipped",
                                                 reason=reason))
                self.bar.update(1)
                continue
            self.ablation.append(self.measure(name, replace(everything, **{key: False})))
            self.save_so_far()
        _ablation_ratios(self.ablation)

    def left_out(self, key: str) -> str | None:
        """Why the ablation keeps a technique off: it cannot apply here, --skip, or it failed in the journey."""
        reason = not_applicable(key, self.device, self.options.skip)
        return reason or (f"failed in the journey ({self.failed[key]})" if key in self.failed else None)

    def measure(self, name: str, setup: Setup) -> StageResult:
        self.bar.set_description(name)
        try:
            result = measure_stage(name, setup, self.options, self.data_dir, self.device, self.memory)
            if self.peak:  # one basis for every row: the column rises as tokens/s rises
                result.mfu = result.tokens_per_s * self.model_flops / self.peak
        except Exception as e:  # a stage that breaks (no compiler, out of memory) is reported, not hidden
            _release(self.device, setup.compile)
            result = StageResult(name=name, setup=dataclasses.asdict(setup), status="failed",
                                 reason=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        self.bar.update(1)
        return result

    def save_so_far(self):
        """The rows measured so far, as journey.json and journey.md with a line saying the journey is not
        finished: a journey cut short (a GPU session's time limit, Ctrl-C) keeps what it measured."""
        _speedups(self.stages)
        if self.ablation:
            _ablation_ratios(self.ablation)
        partial = self.result()
        partial.markdown = to_markdown(partial) + f"\n{UNFINISHED}\n"
        write_result(self.out, partial, finished=False)

    def result(self) -> JourneyResult:
        return JourneyResult(options=dataclasses.asdict(self.options),
                             environment=environment(self.device, self.memory, self.basis, self.ceiling),
                             stages=self.stages, ablation=self.ablation)


UNFINISHED = "(unfinished: the journey stopped before its last row; these are the rows it measured)"


def write_result(out: Path, result: JourneyResult, finished: bool) -> None:
    write_text_atomic(out / "journey.md", result.markdown)
    # read by plan, doctor and the trainer through gpt2train.bench_results
    write_json_atomic(out / JOURNEY_FILE, dataclasses.asdict(result) | {"markdown": None, "finished": finished})


def _speedups(stages: list[StageResult]):
    """Speedup in tokens/s against the first measured stage and the last measured one before each."""
    measured = [s for s in stages if s.status == "ok"]
    if not measured:
        return
    first, previous = measured[0], None
    for s in measured:
        s.speedup_vs_first = s.tokens_per_s / first.tokens_per_s
        s.speedup_vs_previous = s.tokens_per_s / previous.tokens_per_s if previous else None
        previous = s


def _ablation_ratios(rows: list[StageResult]):
    """For each "minus X" row, tokens/s relative to everything on (below 1: X was helping)."""
    base = rows[0]
    for s in rows:
        if s.status == "ok" and base.status == "ok":
            s.speedup_vs_first = s.tokens_per_s / base.tokens_per_s


def basis_of_rows(device: torch.device) -> tuple[float | None, str, MatmulCeiling | None]:
    """(FLOP/s, what it is, the CPU ceiling) that every row's MFU divides by: the GPU's dense bf16 peak from the
    device table, or on a CPU the matmul ceiling measured here (its peak is on no data sheet we hold), in bf16
    where it is native, else fp32: the dtype a CPU run takes by default. journey.json records the ceiling, and a
    training run on this CPU with the same threads and dtype takes it as its MFU's basis (gpt2train.mfu_basis)."""
    if device.type == "cuda":
        peak = device_peak_flops(device, torch.bfloat16)
        name = torch.cuda.get_device_name(device)
        if peak is None:
            return None, f"no bf16 peak known for {name}: MFU not computed", None
        return peak, f"the dense bf16 peak of {name}, {peak / 1e12:,.0f} TFLOP/s", None
    ceiling = probe_cpu_ceiling(torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    return (ceiling.flop_s, f"this CPU's matmul ceiling, measured: {ceiling.flop_s / 1e9:,.0f} GFLOP/s "
                            f"({ceiling.describe()})", ceiling)


def environment(device: torch.device, memory: ProcessMemory, mfu_basis: str = "",
                ceiling: MatmulCeiling | None = None) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    recorded = {CEILING_KEY: dataclasses.asdict(ceiling)} if ceiling is not None else {}
    return {"date": format_utc(time.time()), "torch": torch.__version__, "device": str(device),
            "device_name": name, "cpu_threads": torch.get_num_threads(), "python": platform.python_version(),
            "timing": "CUDA events per step" if device.type == "cuda" else "time.perf_counter per step",
            "memory": memory.method, "mfu_basis": mfu_basis, **recorded}


# --- reporting ------------------------------------------------------------------------------------------------
def _fmt(value, spec: str, none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


def _mem(n: int | None) -> str:
    return "n/a" if n is None else format_bytes(n)


def to_markdown(result: JourneyResult) -> str:
    o, env = result.options, result.environment
    lines = [
        f"# Optimization journey: {o['model']}, micro-batch {o['micro_batch']} x {o['seq_len']} tokens",
        "",
        f"- date: {env['date']}; torch {env['torch']}; device {env['device']} ({env['device_name']}, "
        f"{env['cpu_threads']} CPU threads)",
        f"- {o['warmup']} warm-up steps (compilation included; the warm-up column), then {o['steps']} timed "
        f"steps: ms/step is their median ({env['timing']})",
        f"- peak memory: {env['memory']}",
        f"- MFU: model FLOPs (vocab 50257) x tokens/s over {env.get('mfu_basis') or 'n/a'}, the same for every row",
        "- each stage keeps everything above it; skipped and failed stages (reasons below) stay off after them",
        "",
        "| stage | ms/step | tokens/s | MFU | peak memory | vs naive | vs previous | warm-up s | loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in result.stages:
        lines.append(_row(s, [_fmt(s.speedup_vs_first, ".2f") + "x" if s.speedup_vs_first else "",
                              _fmt(s.speedup_vs_previous, ".2f") + "x" if s.speedup_vs_previous else ""]))
    notes = [s for s in result.stages if s.status != "ok"]
    if result.ablation:
        lines += ["", "## Ablation: everything on, minus one technique", "",
                  "| configuration | ms/step | tokens/s | MFU | peak memory | vs all on | warm-up s | loss |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for s in result.ablation:
            lines.append(_row(s, [_fmt(s.speedup_vs_first, ".2f") + "x" if s.speedup_vs_first else ""]))
        notes += [s for s in result.ablation if s.status != "ok"]
    if notes:
        lines += ["", "Not measured:", ""] + [f"- {s.name}: {s.status}: {s.reason}" for s in notes]
    return "\n".join(lines) + "\n"


def _row(s: StageResult, ratios: list[str]) -> str:
    if s.status != "ok":  # name, status, then empty cells up to the header's width
        return "| " + " | ".join([s.name, s.status] + [""] * (5 + len(ratios))) + " |"
    mfu = f"{100 * s.mfu:.1f}%" if s.mfu is not None else "n/a"
    cells = [s.name, f"{s.step_ms:,.1f}", f"{s.tokens_per_s:,.0f}", mfu, _mem(s.peak_mem_bytes), *ratios,
             f"{s.warmup_s:.1f}", f"{s.final_loss:.3f}" if math.isfinite(s.final_loss) else "nan"]
    return "| " + " | ".join(cells) + " |"


def plot_journey(result: JourneyResult, path: Path):
    """Bars of tokens/s per stage (and per ablation row); skipped stages are labelled, not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("journey (cumulative)", result.stages)] + ([("ablation", result.ablation)] if result.ablation else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 + 0.45 * max(len(r) for _, r in panels)), squeeze=False)
    for ax, (title, rows) in zip(axes[:, 0], panels):
        names = [r.name for r in rows][::-1]
        values = [r.tokens_per_s or 0 for r in rows][::-1]
        bars = ax.barh(names, values, color=["#4c72b0" if r.status == "ok" else "#cccccc" for r in rows][::-1])
        for bar, r in zip(bars, rows[::-1]):
            text = f" {r.tokens_per_s:,.0f}" if r.status == "ok" else f" {r.status}"
            if r.status == "ok" and r.speedup_vs_first:
                text += f" ({r.speedup_vs_first:.2f}x)"
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=8)
        ax.set_title(f"{title}: tokens/s, {result.options['model']} on {result.environment['device_name']}",
                     fontsize=10)
        ax.set_xlim(0, max(values + [1]) * 1.35)
        ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
