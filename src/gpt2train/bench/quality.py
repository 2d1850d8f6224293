"""The quality journey: how much sooner, in tokens and in training time, the modern recipe reaches GPT-2's loss.

Two configs: the base (GPT-2's choices) and the recipe. The recipe's changes are named groups of config
keys (CHANGES). Each row of the journey adds one more change to the base (cumulative), so its last row is
the whole recipe; `--ablate` trains the whole recipe, then the recipe minus one change at a time.

Every row runs the real trainer (training.loop.train) into its own run directory, once per seed, and is read
back from its metrics.jsonl. The target of a seed is the GPT-2 row's final validation loss with that seed
(or, with target "suite", its final score on the multiple-choice suite, run at every evaluation); a row
reaches it where its curve first comes down to the loss (up to the score), interpolated linearly between the
two evaluations around the crossing (reach()). Time counts the training steps alone (step_ms of every step:
data, forward, backward, optimizer), not the evaluations; the first step of each run counts at the median
of the others, since it carries one-off costs (compilation where on, allocator and kernel choice).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpt2train import runlog
from gpt2train.bench.recipe import Row, plan_rows, recipe_changes
from gpt2train.bench.runs import run_hardware, train_logged
from gpt2train.config import Config, load_config, validate
from gpt2train.data.prepared import load_meta
from gpt2train.files import write_json_atomic, write_text_atomic
from gpt2train.ranges import UsageError
from gpt2train.units import format_count, format_duration, format_utc

FLOPS_TARGET, TIME_TARGET = 0.2, 0.3  # issue 45: the recipe's share of GPT-2's training FLOPs and time
# What a row must reach: GPT-2's final validation loss, or its final suite score (the centered mean over the
# tasks of eval.tasks, ["core"] where the config names none).
TARGETS = {"val": "GPT-2's loss", "suite": "GPT-2's suite score"}


@dataclass
class QualityOptions:
    config: str = "shakespeare-cpu"  # the GPT-2 row: a file or a preset
    modern: str = "shakespeare-modern"  # the recipe
    ablate: bool = False
    recipe_only: bool = False  # two rows: GPT-2 and the full recipe (the target, over several seeds, for less)
    seeds: list[int] | None = None  # None: the base config's train.seed
    steps: int = 0  # train.max_steps of every row; 0: the base config's
    eval_interval: int = 25
    val_batches: int | None = None  # None: the base config's eval.val_batches
    overrides: list[str] = field(default_factory=list)  # --set, applied to every row
    device: str = ""  # "": the config's train.device
    target: str = "val"  # a key of TARGETS

    def __post_init__(self):
        """The checks of how the options go together, and of the target; each option's own range is checked by
        its type in cli/bench.py (the seeds: distinct and in range)."""
        if self.ablate and self.recipe_only:
            raise UsageError("--ablate and --recipe-only choose different rows: pass one of them")
        if self.target not in TARGETS:
            raise UsageError(f"target {self.target!r} is not one of {', '.join(TARGETS)}")


@dataclass
class SeedRun:
    """One row trained with one seed; the curves are taken at the evaluations."""

    seed: int
    run_dir: str
    status: str = "ok"  # ok | failed
    reason: str = ""
    steps: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    suite_score: list[float] = field(default_factory=list)  # the suite's centered mean at each evaluation, if it ran
    train_s: list[float] = field(default_factory=list)  # training-step seconds up to each evaluation
    final_val_loss: float | None = None
    final_suite_score: float | None = None
    total_tokens: int | None = None
    total_train_s: float | None = None
    wall_s: float | None = None  # the whole run: build, steps, evaluations
    target: float | None = None  # the GPT-2 row's final val loss (or suite score) with this seed
    reach_tokens: float | None = None
    reach_s: float | None = None
    tokens_ratio: float | None = None  # of the GPT-2 row's total tokens
    flops_per_token: float | None = None  # the run's, as its run_start record gives it
    flops_ratio: float | None = None  # the reach's training FLOPs, of the GPT-2 row's total
    time_ratio: float | None = None  # of the GPT-2 row's total training time


@dataclass
class RowResult:
    name: str
    slug: str
    changes: dict
    runs: list[SeedRun]
    summary: dict = field(default_factory=dict)  # per measure: mean, min, max over the seeds that have it


def load_pair(options: QualityOptions) -> tuple[Config, Config]:
    """The base and the recipe, each with --set and the bench's shared settings applied."""
    return (shared_settings(load_config(options.config, options.overrides), options),
            shared_settings(load_config(options.modern, options.overrides), options))


def shared_settings(cfg: Config, options: QualityOptions) -> Config:
    """What every row shares: steps, device, validation; the suite at each validation for a suite target, else
    none; no samples, HellaSwag or checkpoints (the bench reads the log only); every step logged, since the reach
    time sums every step's time."""
    if options.steps:
        cfg.train.max_steps = options.steps
    if options.device:
        cfg.train.device = options.device
    cfg.eval.interval = options.eval_interval
    if options.val_batches is not None:
        cfg.eval.val_batches = options.val_batches
    cfg.eval.sample_interval = cfg.eval.hellaswag_interval = 0
    if options.target == "suite":
        cfg.eval.tasks, cfg.eval.tasks_interval = cfg.eval.tasks or ["core"], 0  # 0: at each validation
    else:
        cfg.eval.tasks = []
    cfg.checkpoint.every_steps, cfg.checkpoint.every_minutes = 0, 0.0
    cfg.checkpoint.save_best = cfg.checkpoint.save_final = False
    cfg.log.interval, cfg.log.progress = 1, "lines"
    cfg.log.tensorboard = cfg.log.wandb = False
    return validate(cfg, between_keys=False)  # each row is resolved when it trains


# --- reading a run ---------------------------------------------------------------------------------------
def reach(xs: list[float], losses: list[float], target: float) -> float | None:
    """Where the curve (xs[i], losses[i]) first comes down to `target`: x interpolated linearly between the
    last point above it and the first at or below it; the first x when already there at the first point;
    None when never reached."""
    for i, loss in enumerate(losses):
        if loss <= target:
            if i == 0:
                return float(xs[0])
            above = losses[i - 1]
            return xs[i - 1] + (xs[i] - xs[i - 1]) * (above - target) / (above - loss)
    return None


def step_seconds(train_records: list[dict]) -> dict[int, float]:
    """Seconds of each logged training step; the first step counts at the median of the others."""
    seconds = {r["step"]: r["step_ms"] / 1000 for r in train_records if runlog.is_finite(r.get("step_ms"))}
    if len(seconds) > 1:
        first = min(seconds)
        seconds[first] = statistics.median(s for step, s in seconds.items() if step != first)
    return seconds


def read_seed_run(run_dir: Path, seed: int, target: str = "val") -> SeedRun:
    """The validation curve of a finished run, its suite scores where the suite ran (at every evaluation for a
    suite target), and its training time at each evaluation."""
    run = runlog.load_run(run_dir)
    vals = sorted((r for r in run.of(runlog.VAL) if runlog.is_finite(r.get("val_loss"))), key=lambda r: r["step"])
    if not vals:
        raise ValueError(f"{run_dir} holds no validation loss")
    seconds = step_seconds(run.of(runlog.TRAIN))
    out = SeedRun(seed, str(run_dir), steps=[r["step"] for r in vals], tokens=[r["tokens"] for r in vals],
                  val_loss=[r["val_loss"] for r in vals])
    out.train_s = [sum(s for step, s in seconds.items() if step <= at) for at in out.steps]
    starts = [r["flops_per_token"] for r in run.of(runlog.RUN_START) if runlog.is_finite(r.get("flops_per_token"))]
    out.flops_per_token = float(starts[-1]) if starts else None
    out.final_val_loss, out.total_tokens, out.total_train_s = out.val_loss[-1], out.tokens[-1], out.train_s[-1]
    scores = {r["step"]: r["centered_mean"] for r in run.of(runlog.SUITE) if runlog.is_finite(r.get("centered_mean"))}
    if target == "suite":
        missing = [step for step in out.steps if step not in scores]
        if missing:
            raise ValueError(f"{run_dir} holds no suite score at step {missing[0]}: the suite was skipped "
                             f"(its console.log says why)")
    if all(step in scores for step in out.steps):
        out.suite_score = [scores[step] for step in out.steps]
        out.final_suite_score = out.suite_score[-1]
    return out


def score(run: SeedRun, gpt2: SeedRun | None, target: str = "val") -> None:
    """Fill in the reach of GPT-2's final loss or suite score (same seed) and the ratios to the GPT-2 row's
    totals."""
    if run.status != "ok" or gpt2 is None or gpt2.status != "ok":
        return
    if target == "suite":  # a score rises to its target: its negative comes down to the target's
        run.target = gpt2.final_suite_score
        curve, goal = [-v for v in run.suite_score], -run.target
    else:
        run.target = gpt2.final_val_loss
        curve, goal = run.val_loss, run.target
    run.reach_tokens = reach(run.tokens, curve, goal)
    run.reach_s = reach(run.train_s, curve, goal)
    if run.reach_tokens is not None:
        run.tokens_ratio = run.reach_tokens / gpt2.total_tokens
        if run.flops_per_token and gpt2.flops_per_token:  # the recipes may spend other FLOPs per token
            run.flops_ratio = run.tokens_ratio * run.flops_per_token / gpt2.flops_per_token
        run.time_ratio = run.reach_s / gpt2.total_train_s if gpt2.total_train_s else None


MEASURES = ("final_val_loss", "final_suite_score", "reach_tokens", "tokens_ratio", "flops_ratio", "reach_s", "time_ratio",
            "wall_s")


def aggregate(runs: list[SeedRun]) -> dict:
    """Per measure, over the seeds that have it: mean, min, max, n (of len(runs) seeds)."""
    out = {}
    for measure in MEASURES:
        values = [getattr(r, measure) for r in runs if getattr(r, measure) is not None]
        out[measure] = ({"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}
                        if values else None)
    return out


# --- the bench -----------------------------------------------------------------------------------------------
@dataclass
class QualityResult:
    options: dict
    environment: dict
    notes: list[str]
    rows: list[RowResult]
    target: dict  # the full recipe's ratios against issue 20's targets
    recipe: dict  # recipe_changes()
    command: str = ""
    markdown: str = ""
    table: str = ""


def run_quality(options: QualityOptions, out_dir: str | Path, progress: bool = True) -> QualityResult:
    """Train every row once per seed into OUT/runs/, score them; write quality.{md,json,png} to OUT."""
    base, modern = load_pair(options)
    rows, notes = plan_rows(base, modern, options.ablate, options.recipe_only)
    seeds = options.seeds or [base.train.seed]
    out = Path(out_dir)
    if (out / "runs").exists():
        raise UsageError(f"{out / 'runs'} exists already (runs of an earlier bench): pass a new --out")
    load_meta(base.data.dir)  # missing data fails once, before any row
    environment = {"date": format_utc(time.time()), "torch": torch.__version__,
                   "cpu_threads": torch.get_num_threads()}
    results: list[RowResult] = []
    for i, row in enumerate(rows):
        runs = []
        for seed in seeds:
            run = train_row(row, seed, out / "runs" / f"{row.slug}-seed{seed}", options.target)
            if run.status == "ok" and "hardware" not in environment:
                environment["hardware"] = run_hardware(run.run_dir)
            gpt2 = {r.seed: r for r in results[0].runs}.get(seed) if results else run  # row 0 is its own target
            score(run, gpt2, options.target)
            runs.append(run)
            if progress:
                print(f"[{i + 1}/{len(rows)}] {row.name}, seed {seed}: {describe_run(run, options.target)}", flush=True)
        results.append(RowResult(row.name, row.slug, row.changes, runs, aggregate(runs)))
    full = results[-1] if not options.ablate else results[1]
    result = QualityResult(dataclasses.asdict(options), environment, notes, results,
                           target_summary(full, options.target), recipe_changes(base, modern), command_line(options, out))
    result.table = table(result)
    result.markdown = to_markdown(result)
    write_text_atomic(out / "quality.md", result.markdown)
    write_json_atomic(out / "quality.json", dataclasses.asdict(result) | {"markdown": None, "table": None})
    plot_quality(result, out / "quality.png")
    return result


def train_row(row: Row, seed: int, run_dir: Path, target: str = "val") -> SeedRun:
    """Train one row with one seed; its console goes to run_dir/console.log. A run that raises (a guard that
    gives up, out of memory) is reported as failed with the error, not hidden."""
    cfg = copy.deepcopy(row.cfg)
    cfg.train.seed = seed
    run_dir.mkdir(parents=True)
    start = time.perf_counter()
    try:
        train_logged(cfg, run_dir)
        run = read_seed_run(run_dir, seed, target)
    except Exception as e:  # noqa: BLE001 - the other rows still tell something
        message = str(e).splitlines()[0] if str(e) else ""
        run = SeedRun(seed, str(run_dir), status="failed", reason=f"{type(e).__name__}: {message}")
    finally:
        release(cfg)
    run.wall_s = time.perf_counter() - start
    return run


def release(cfg: Config) -> None:
    """Let the next row start clean: compiled graphs dropped (dynamo's cache would fill up over many rows)."""
    if cfg.train.compile is not False:
        torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()




def describe_run(run: SeedRun, target: str = "val") -> str:
    if run.status != "ok":
        return f"failed ({run.reason})"
    if run.target is None:
        where = "no target (the GPT-2 row failed)"
    elif run.reach_tokens is None:
        where = f"does not reach {run.target:.4f}"
    else:
        where = f"reaches {run.target:.4f} at {format_count(run.reach_tokens)} tokens"
    suite = f", suite score {run.final_suite_score:.4f}" if run.final_suite_score is not None else ""
    return (f"val loss {run.final_val_loss:.4f}{suite} after {format_count(run.total_tokens)} tokens, {where}; "
            f"{seconds(run.wall_s)} (console: {run.run_dir}/console.log)")


def target_summary(full: RowResult, target: str = "val") -> dict:
    tokens, flops, times = (full.summary.get(k) for k in ("tokens_ratio", "flops_ratio", "time_ratio"))
    return {"row": full.name, "reaches": TARGETS[target], "tokens_ratio": tokens["mean"] if tokens else None,
            "flops_ratio": flops["mean"] if flops else None, "flops_target": FLOPS_TARGET,
            "time_ratio": times["mean"] if times else None, "time_target": TIME_TARGET}


def target_line(target: dict) -> str:
    """Where the full recipe stands against issue 20's targets."""
    what = target.get("reaches", TARGETS["val"])
    if target["tokens_ratio"] is None:
        return f"full recipe does not reach {what}"
    time_part = f"{target['time_ratio']:.2f}x" if target["time_ratio"] is not None else "n/a"
    flops_part = f"{target['flops_ratio']:.2f}x" if target.get("flops_ratio") is not None else "n/a"
    return (f"full recipe reaches {what} in {target['tokens_ratio']:.2f}x of the tokens, {flops_part} of the "
            f"training FLOPs (target <= {target['flops_target']}) and {time_part} of the time "
            f"(target <= {target['time_target']})")


def command_line(options: QualityOptions, out: Path) -> str:
    """The command that repeats this bench."""
    parts = ["gpt2train bench quality", f"--config {options.config}", f"--modern {options.modern}"]
    parts += ["--ablate"] if options.ablate else []
    parts += ["--recipe-only"] if options.recipe_only else []
    parts += [f"--seeds {','.join(map(str, options.seeds))}"] if options.seeds else []
    parts += [f"--steps {options.steps}"] if options.steps else []
    parts += [f"--eval-interval {options.eval_interval}"]
    parts += [f"--val-batches {options.val_batches}"] if options.val_batches is not None else []
    parts += [f"--set {item}" for item in options.overrides]
    parts += [f"--device {options.device}"] if options.device else []
    parts += [f"--target {options.target}"] if options.target != "val" else []
    return " ".join(parts + [f"--out {out}"])


# --- reporting ------------------------------------------------------------------------------------------------
def seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else format_duration(s)


def cell(stats: dict | None, fmt, seeds: int) -> str:
    """Mean over the seeds, then min..max where they differ; "k/n seeds" where some lack the measure."""
    if stats is None:  # a finished row lacks only the reach measures
        return "not reached"
    text = fmt(stats["mean"])
    if stats["n"] > 1 and fmt(stats["min"]) != fmt(stats["max"]):
        text += f" ({fmt(stats['min'])}..{fmt(stats['max'])})"
    if stats["n"] < seeds:
        text += f", {stats['n']}/{seeds} seeds"
    return text


def table(result: QualityResult) -> str:
    suite = result.options.get("target") == "suite"
    score_head = "final suite score | " if suite else ""  # the target's own column, beside the loss
    lines = [f"| row | final val loss | {score_head}tokens to {TARGETS[result.options.get('target', 'val')]} | "
             "x GPT-2 tokens | x GPT-2 FLOPs | time to it | x GPT-2 time | row wall time |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if suite else "")]
    for row in result.rows:
        s, n = row.summary, len(row.runs)
        failed = [r for r in row.runs if r.status != "ok"]
        if len(failed) == n:
            lines.append(f"| {row.name} | failed | | | | | |{' |' if suite else ''} {cell(s['wall_s'], seconds, n)} |")
            continue
        score_cell = [cell(s["final_suite_score"], lambda v: f"{v:.4f}", n)] if suite else []
        lines.append("| " + " | ".join([
            row.name, cell(s["final_val_loss"], lambda v: f"{v:.4f}", n), *score_cell,
            cell(s["reach_tokens"], format_count, n), cell(s["tokens_ratio"], lambda v: f"{v:.2f}x", n),
            cell(s["flops_ratio"], lambda v: f"{v:.2f}x", n),
            cell(s["reach_s"], seconds, n), cell(s["time_ratio"], lambda v: f"{v:.2f}x", n),
            cell(s["wall_s"], seconds, n)]) + " |")
    return "\n".join(lines)


def to_markdown(result: QualityResult) -> str:
    o, env = result.options, result.environment
    hw = env.get("hardware") or {}
    seeds = o["seeds"] or [result.rows[0].runs[0].seed]
    lines = [
        f"# Quality journey: {o['config']} (GPT-2) to {o['modern']} (the recipe)"
        + (", ablation" if o["ablate"] else ""),
        "",
        f"- date: {env['date']}; torch {env['torch']}; device {device_text(hw)}, torch threads: {env['cpu_threads']}",
        f"- command: `{result.command}`",
        f"- seeds: {', '.join(map(str, seeds))}; each cell is the mean over the seeds, with min..max where there "
        "are several",
        ("- target: the GPT-2 row's final suite score (the centered mean over eval.tasks, run at each evaluation) "
         if o.get("target") == "suite" else "- target: the GPT-2 row's final validation loss ")
        + "with the same seed; tokens and time to it are interpolated linearly between the evaluations around the "
        "crossing",
        "- time: training steps only (data, forward, backward, optimizer; not evaluation), the first step of "
        "each run counted at the median of the others; row wall time: the whole run, evaluations included",
        "",
        result.table,
        "",
        target_line(result.target),
    ]
    lines += ["", "The changes (GPT-2's value -> the recipe's):", ""]
    lines += [f"- {name}: " + ", ".join(f"{key} {json.dumps(a)} -> {json.dumps(b)}" for key, (a, b) in keys.items())
              for name, keys in result.recipe.items()]
    failures = [(row.name, r) for row in result.rows for r in row.runs if r.status != "ok"]
    notes = result.notes + [f"{name}, seed {r.seed}: failed: {r.reason}" for name, r in failures]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def device_text(hardware: dict) -> str:
    device, name = hardware.get("device", "n/a"), hardware.get("device_name")
    return f"{device} ({name})" if name and name != device else device


def mean_curve(runs: list[SeedRun], key: str = "val_loss") -> tuple[list[int], list[float]]:
    """Validation loss (or suite score) against tokens, averaged over the seeds at the evaluations they all have."""
    ok = [r for r in runs if r.status == "ok"]
    if not ok:
        return [], []
    n = min(len(r.tokens) for r in ok)
    return ok[0].tokens[:n], [statistics.fmean(getattr(r, key)[i] for r in ok) for i in range(n)]


def plot_quality(result: QualityResult, path: Path):
    """The target's curve against tokens for every row (mean over seeds), GPT-2's final value dashed: validation
    loss, or the suite score for a suite target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suite = result.options.get("target") == "suite"
    key, final_key, what = ("suite_score", "final_suite_score", "suite score") if suite else \
        ("val_loss", "final_val_loss", "loss")
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in result.rows:
        tokens, values = mean_curve(row.runs, key)
        if tokens:
            ax.plot(tokens, values, marker=".", label=row.name)
    final = result.rows[0].summary[final_key]
    if final is not None:
        ax.axhline(final["mean"], color="black", linestyle="--", linewidth=1, label=f"GPT-2 final {what}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("suite score (centered mean)" if suite else "validation loss")
    ax.set_title(f"{result.options['config']} -> {result.options['modern']}", fontsize=10)
    if ax.lines:  # every row failed: an empty figure, no legend
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
