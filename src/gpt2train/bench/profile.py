"""Where a training step's time goes: torch.profiler over a few steps of each config, kernel time by category.

Each config trains as `gpt2train train` trains it (the Trainer: its model, compile, optimizer and TrainStep) on
a prepared folder or on random GPT-2 ids: `warmup` steps first (compilation happens there), then `steps` steps
timed without the profiler (step time, tokens/s and MFU, as the trainer's step lines compute them), then `steps`
more under torch.profiler.

Kernel time is each device kernel's own time on a GPU, or on a CPU each operator's self CPU time (the CPU
profiler sees no kernels below the operators). Every kernel goes to exactly one category (categorize()), by its
name and by the operators it ran under, so the categories sum to the total. Matmuls that an optimizer step
launches (Muon's orthogonalization) count as optimizer time, not as matmul time.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.autograd import DeviceType

from gpt2train.bench.journey import write_synthetic_data
from gpt2train.bench.quality import release
from gpt2train.config import Config, load_config
from gpt2train.files import write_json_atomic, write_text_atomic
from gpt2train.training.loop import Trainer
from gpt2train.units import format_utc

# (category, what its name matches), first match wins: a fused kernel named after several ops goes to the first
# (triton's "fused__log_softmax_..._nll_loss" to softmax/cross-entropy, "fused_add_native_layer_norm" to
# normalization). Names are matched lower-cased; the short op names only as whole words, so that "addmm" is no
# "add" and "MmBackward0" (autograd's bookkeeping around the matmul) no "mm".
RULES: list[tuple[str, re.Pattern]] = [
    ("communication", re.compile(r"nccl|c10d|gloo|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all")),
    ("memcpy", re.compile(r"memcpy|memset")),
    # the step's other update work: the foreach kernels of clipping, the scaler's unscale, fused AdamW
    ("optimizer", re.compile(r"adam|muon|zeropower|newton_?schulz|foreach|multi_tensor_apply|lpnorm|clip_grad|"
                             r"unscale")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|scaled_dot_product")),
    ("softmax/cross-entropy", re.compile(r"softmax|cross_entropy|nll_loss|logsumexp|classifier")),
    ("normalization", re.compile(r"layer_?norm|rms_?norm|batch_?norm|group_?norm")),
    ("matmul", re.compile(r"gemm|cublas|cutlass|xmma|nvjet|(?<![a-z])(mm|addmm|bmm|baddbmm|matmul|linear|dot)(?![a-z])")),
    ("elementwise", re.compile(r"elementwise|pointwise|vectorized|unrolled|triton_poi|gelu|relu|silu|tanh|sigmoid|"
                               r"addcmul|addcdiv|lerp|"
                               r"(?<![a-z])(add|sub|mul|div|neg|pow|exp|sqrt|rsqrt|copy|to|fill|zero|clamp|where|cat|"
                               r"clone|cos|sin|abs|masked_fill|dropout)_?(?![a-z])")),
]
OTHER = "other"
CATEGORIES = [name for name, _ in RULES] + [OTHER]
LABELS = {"matmul": "matmul (GEMM)", "attention": "attention (flash/SDPA)", "elementwise": "elementwise/activation",
          "optimizer": "optimizer (AdamW, Muon, clipping)"}
TABLE_ORDER = ["matmul", "attention", "elementwise", "normalization", "softmax/cross-entropy", "optimizer",
               "communication", "memcpy", OTHER]
OPTIMIZER_STEP = re.compile(r"^optimizer\.(step|zero_grad)")  # torch's record_function around an optimizer's step


def categorize(name: str, context: Sequence[str] = ()) -> str:
    """The category of a kernel named `name`, launched under the operators `context` (outermost last)."""
    if any(OPTIMIZER_STEP.match(outer.lower()) for outer in context):
        return "optimizer"
    low = name.lower()
    return next((category for category, pattern in RULES if pattern.search(low)), OTHER)


@dataclass
class ProfileOptions:
    configs: list[str] = field(default_factory=lambda: ["gpt2", "gpt2-modern"])  # files or presets
    data: str = ""  # a prepared folder; "": random GPT-2 ids in a temporary folder
    warmup: int = 3  # untimed steps first, compilation included
    steps: int = 3  # timed steps without the profiler, then as many under it
    overrides: list[str] = field(default_factory=list)  # --set, applied to every config
    device: str = ""  # "": the config's train.device


@dataclass
class Kernel:
    name: str
    category: str
    us: float  # its own time, summed over the profiled steps


@dataclass
class ConfigProfile:
    config: str
    device: str
    dtype: str
    compile: bool
    tokens_per_step: int
    grad_accum: int
    step_ms: float  # median of the timed steps, without the profiler
    profiled_step_ms: float  # median of the profiled steps (the profiler slows the host, on a CPU the ops too)
    tokens_per_s: float
    mfu: float | None
    mfu_basis: str
    kernel_ms: float  # per step, all categories
    categories: dict[str, float]  # category -> kernel ms per step
    kernel_source: str  # what a kernel's time is on this device
    top: list[dict] = field(default_factory=list)  # the largest kernels: name, category, ms per step


# --- reading a profile ----------------------------------------------------------------------------------------
def kernels_of(events) -> tuple[list[Kernel], str]:
    """Each kernel of a profile (torch.profiler's events()) with its category, and what its time is: device
    kernels where there are any (a GPU: torch hangs each on the host call that launched it, whose operators are
    its context), else the operators' self CPU time."""
    launched = [(e, k) for e in events if e.device_type == DeviceType.CPU for k in e.kernels]
    if launched:
        return ([Kernel(k.name, categorize(k.name, ancestors(e)), k.duration) for e, k in launched],
                "device kernels' own time (CUPTI)")
    ops = [e for e in events if not e.is_async and not e.is_user_annotation]
    return ([Kernel(e.name, categorize(e.name, ancestors(e)), e.self_cpu_time_total) for e in ops],
            "operators' self CPU time (the CPU profiler sees no kernels below them)")


def ancestors(event) -> list[str]:
    """The names of the operators and annotations an event ran under, innermost first."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def by_category(kernels: list[Kernel]) -> dict[str, float]:
    """Microseconds per category, every category present (0 where none ran)."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for k in kernels:
        totals[k.category] += k.us
    return totals


def largest(kernels: list[Kernel], n: int = 10) -> list[tuple[str, str, float]]:
    """(name, category, microseconds) of the n kernels with the most time, each name summed over its calls."""
    sums: dict[tuple[str, str], float] = defaultdict(float)
    for k in kernels:
        sums[k.name, k.category] += k.us
    return [(name, cat, us) for (name, cat), us in sorted(sums.items(), key=lambda kv: -kv[1])[:n]]


# --- one config --------------------------------------------------------------------------------------------------
def profile_config(name: str, cfg: Config, options: ProfileOptions) -> ConfigProfile:
    """Build the config's Trainer, profile it, and let the next config start clean."""
    trainer = Trainer(cfg, None)
    try:
        return measure(trainer, name, options)
    finally:
        trainer.close()
        trainer = None  # its model and optimizer state, freed before the caches are emptied
        release(cfg)


def measure(trainer: Trainer, name: str, options: ProfileOptions) -> ConfigProfile:
    """Warm up, time `steps` steps, then profile `steps` more."""
    for _ in range(options.warmup):
        trainer.train_step()
    seconds = [trainer.train_step()["seconds"] for _ in range(options.steps)]  # synchronized on a GPU
    activities = [torch.profiler.ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        profiled = [trainer.train_step()["seconds"] for _ in range(options.steps)]
    kernels, source = kernels_of(prof.events())
    runtime, basis = trainer.runtime, trainer.mfu_basis
    step_s = statistics.median(seconds)
    tokens_per_s = runtime.tokens_per_step / step_s
    per_step = {cat: us / 1000 / options.steps for cat, us in by_category(kernels).items()}
    return ConfigProfile(
        config=name, device=device_label(trainer.device), dtype=str(runtime.dtype).removeprefix("torch."),
        compile=runtime.compile, tokens_per_step=runtime.tokens_per_step, grad_accum=runtime.grad_accum,
        step_ms=step_s * 1000, profiled_step_ms=statistics.median(profiled) * 1000, tokens_per_s=tokens_per_s,
        mfu=tokens_per_s * trainer.flops_per_token / basis.flop_s if basis.flop_s else None,
        mfu_basis=basis.source, kernel_ms=sum(per_step.values()), categories=per_step, kernel_source=source,
        top=[{"name": n, "category": c, "ms": us / 1000 / options.steps} for n, c, us in largest(kernels)])


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} (torch threads: {torch.get_num_threads()})"


# --- the bench ---------------------------------------------------------------------------------------------------
def run_profile(options: ProfileOptions, out_dir: str | Path) -> dict:
    """Profile every config; write profile.json and profile.md to out_dir. Returns the JSON's content."""
    configs = [load_config(name, options.overrides) for name in options.configs]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpt2train-profile-") as tmp:
        data = options.data or str(synthetic_data_for(configs, tmp))
        profiles = []
        for name, cfg in zip(options.configs, configs):
            cfg.data.dir, cfg.data.sources = data, []
            if options.device:
                cfg.train.device = options.device
            profiles.append(profile_config(name, cfg, options))
    result = {"date": format_utc(time.time()), "torch": torch.__version__, "options": dataclasses.asdict(options),
              "data": options.data or "random GPT-2 ids (synthetic)", "categories": CATEGORIES,
              "configs": [dataclasses.asdict(p) for p in profiles]}
    result["markdown"] = profile_markdown(result)
    write_json_atomic(out / "profile.json", result)
    write_text_atomic(out / "profile.md", result["markdown"])
    return result


def synthetic_data_for(configs: list[Config], folder: str) -> Path:
    """Random GPT-2 ids, enough windows of every config's micro-batch and sequence length for both splits."""
    window = max((c.train.micro_batch or 64) * ((c.train.seq_len or c.model.block_size) + 1) for c in configs)
    return write_synthetic_data(folder, max(2**20, 4 * window), val_tokens=2 * window)


def profile_markdown(result: dict) -> str:
    profiles = result["configs"]
    o = result["options"]
    lines = [f"# Where a step's time goes: {', '.join(p['config'] for p in profiles)}", "",
             f"- date: {result['date']}; torch {result['torch']}; data: {result['data']}",
             f"- {o['warmup']} warm-up steps (compilation there), {o['steps']} timed without the profiler (step time: "
             f"their median), then {o['steps']} under torch.profiler (kernel time per step: their mean)"]
    lines += [f"- {p['config']}: {p['device']}, {p['dtype']}, compile {'on' if p['compile'] else 'off'}, "
              f"{p['tokens_per_step']:,} tokens per step ({p['grad_accum']} micro-batches); kernel time: "
              f"{p['kernel_source']}; MFU over {p['mfu_basis']}" for p in profiles]
    lines += ["", "| | " + " | ".join(p["config"] for p in profiles) + " |",
              "| --- |" + " ---: |" * len(profiles)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("step time (ms)", [f"{p['step_ms']:,.1f}" for p in profiles])
    row("tokens/s", [f"{p['tokens_per_s']:,.0f}" for p in profiles])
    row("MFU", [f"{100 * p['mfu']:.1f}%" if p["mfu"] is not None else "n/a" for p in profiles])
    row("profiled step time (ms)", [f"{p['profiled_step_ms']:,.1f}" for p in profiles])
    row("kernel time per step (ms)", [f"{p['kernel_ms']:,.1f} ({share(p['kernel_ms'], p['profiled_step_ms'])} of a "
                                      "profiled step)" for p in profiles])
    for cat in TABLE_ORDER:
        row(LABELS.get(cat, cat), [f"{p['categories'][cat]:,.1f} ({share(p['categories'][cat], p['kernel_ms'])})"
                                   for p in profiles])
    for p in profiles:
        lines += ["", f"Largest kernels of {p['config']} (ms per step):", ""]
        lines += [f"- {k['ms']:,.2f} {k['category']}: `{k['name'][:100]}`" for k in p["top"]]
    return "\n".join(lines) + "\n"


def share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "n/a"
