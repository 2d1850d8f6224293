"""The scaling ladder: train small rungs of the size dial at their compute-optimal budgets, fit loss against
compute, predict a bigger rung's loss, then train that rung and put the measurement beside the prediction.

Each rung is `model.depth = d` on the config's data, so the dial's rules (sizing.py) set its shape, learning
rate, batch and steps; the config may not set those keys itself. Every rung is a real run of the trainer in
OUT/seed<S>/depth<d>/, finished when its rung.json is written: an interrupted ladder run again with the same
--out skips finished rungs and resumes an unfinished one from its newest checkpoint.

The fit is Hoffmann et al.'s (Chinchilla) form in one variable, L(x) = E + A * x^-alpha, for x = compute C
(training FLOPs, counting.flops_per_token x tokens), parameters N and tokens D; the prediction uses C. E, the
loss no size reaches below, is kept at or above what is known to bound any model's loss: the Markov corpus's
own entropy (meta.json's loss_floor), or --floor; on text with no known bound, 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gpt2train import runlog
from gpt2train.batch_schedule import BatchSchedule
from gpt2train.config import Config, batch_stages, load_config
from gpt2train.counting import flops_per_token
from gpt2train.data.prepared import load_meta
from gpt2train.files import write_json_atomic, write_text_atomic
from gpt2train.ranges import UsageError
from gpt2train.runconfig import RunConfig, resolve_run
from gpt2train.sizing import scaling_parameters
from gpt2train.units import format_count, format_duration, format_utc

TARGET_ERROR = 0.02  # issue 34: the held-out rung within 2% of its prediction
LADDER_KEYS = ("model.n_layer", "model.n_embd", "model.n_head", "train.total_batch_tokens", "train.max_steps",
               "train.warmup_steps")  # what the dial must set per rung


@dataclass
class ScalingOptions:
    config: str = "scaling-cpu"
    depths: list[int] = field(default_factory=lambda: [3, 4, 5])
    predict: int | None = 6
    seeds: list[int] | None = None  # None: the config's train.seed
    floor: float | None = None  # a known lower bound on the loss; None: the data's (meta.json loss_floor) or 0
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self):
        """The one check of how the depths and the prediction go together; each depth's and seed's own range is
        checked by its type in cli/bench.py."""
        depths = sorted(set(self.depths))
        if len(depths) < 3:
            raise UsageError(f"--depths {self.depths}: give at least three distinct depths of 1 or more")
        if self.predict is not None and self.predict <= depths[-1]:
            raise UsageError(f"--predict {self.predict}: predict a rung deeper than the ladder's last, {depths[-1]}")


@dataclass
class Rung:
    depth: int
    seed: int
    width: int
    heads: int
    params: int  # N: non-embedding (sizing.scaling_parameters)
    tokens: int  # D: steps x batch
    batch_tokens: int
    steps: int
    lr: float
    flops: float  # C
    val_loss: float | None = None
    wall_s: float | None = None
    run_dir: str = ""


@dataclass
class Fit:
    variable: str  # "compute", "params" or "tokens"
    E: float
    A: float
    alpha: float
    rms_log_error: float  # of the fitted points, in log-loss

    def __call__(self, x: float) -> float:
        return self.E + self.A * x ** -self.alpha


def fit_power_law(xs, ys, variable: str = "compute", floor: float = 0.0) -> Fit:
    """Least squares in log-loss of L = E + A x^-alpha over floor <= E < min(L): for each E the rest is a
    straight line in log-log, so E is searched (a grid, then a narrowing one) and A, alpha solved exactly.
    floor: a known lower bound on any model's loss (the data's entropy, where known), which E cannot go below."""
    x, y = np.log(np.asarray(xs, dtype=float)), np.asarray(ys, dtype=float)
    if len(x) < 3:
        raise UsageError("a fit of E + A x^-alpha needs at least three rungs")
    if not 0 <= floor < y.min():
        raise UsageError(f"loss floor {floor:g} must be at least 0 and below the rungs' lowest loss, {y.min():.4f}")

    def solve(E):
        slope, intercept = np.polyfit(x, np.log(y - E), 1)
        error = np.log(E + np.exp(intercept + slope * x)) - np.log(y)
        return float(np.sqrt(np.mean(error ** 2))), float(np.exp(intercept)), float(-slope)

    low, high = floor, float(y.min())
    for _ in range(6):
        grid = np.linspace(low, high, 201)[:-1]
        scores = [solve(E)[0] for E in grid]
        best = int(np.argmin(scores))
        step = grid[1] - grid[0]
        low, high = max(floor, grid[best] - step), min(float(y.min()) * (1 - 1e-9), grid[best] + step)
    E = grid[best]
    rms, A, alpha = solve(E)
    return Fit(variable, float(E), A, alpha, rms)


def rung_config(options: ScalingOptions, depth: int, seed: int) -> RunConfig:
    return ladder_rung(options.config, options.overrides, depth, seed)


def ladder_rung(config: str | Config, overrides: list[str], depth: int, seed: int, name: str = "") -> RunConfig:
    """The run config (a file, a preset or a Config) with model.depth = depth and train.seed = seed; refused in
    one line where the config itself sets a key the ladder derives per rung."""
    run = resolve_run(config, [*overrides, f"model.depth={depth}", f"train.seed={seed}"])
    fixed = [d.key for d in run.dial if d.explicit and d.key in LADDER_KEYS]
    if fixed:
        raise UsageError(f"{name or config} sets {', '.join(fixed)}, which the ladder derives for each rung from "
                         "model.depth: remove {} from the config".format("it" if len(fixed) == 1 else "them"))
    return run


def describe_rung(run: RunConfig, seed: int) -> Rung:
    """The rung as the trainer will run it: its compute counts the head at the data's vocabulary (padded)."""
    m, t = run.config.model, run.config.train
    tokens = BatchSchedule.of(batch_stages(t), t.max_steps, t.total_batch_tokens).tokens_through(t.max_steps)
    per_token = flops_per_token(m, t.seq_len)
    return Rung(depth=m.depth, seed=seed, width=m.n_embd, heads=m.n_head, params=scaling_parameters(m),
                tokens=tokens, batch_tokens=t.total_batch_tokens, steps=t.max_steps, lr=t.lr,
                flops=float(per_token * tokens))


def check_fresh_data(rungs: list[Rung], cfg: Config, meta: dict) -> int:
    """The data's train tokens; UsageError if any rung would read more than that (it would repeat data)."""
    have = int(meta["tokens"]["train"])
    worst = max(rungs, key=lambda r: r.tokens)
    if worst.tokens > have:
        raise UsageError(f"rung depth {worst.depth} needs {worst.tokens:,} training tokens "
                         f"({cfg.train.tokens_per_param:g} per parameter x {worst.params:,} parameters, in whole "
                         f"batches) and {cfg.data.dir} holds {have:,}: it would repeat data; prepare more text or "
                         f"leave depth {worst.depth} out")
    return have


def train_rung(run: RunConfig, rung: Rung, run_dir: Path) -> Rung:
    """Train one rung into run_dir (resuming its newest checkpoint if it has one), read its final validation
    loss and write rung.json, which marks it finished."""
    from gpt2train.bench.runs import train_logged

    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train_logged(run, run_dir, resume="auto")
    vals = [r for r in runlog.load_run(run_dir).of(runlog.VAL)
            if r["step"] == run.config.train.max_steps and runlog.is_finite(r.get("val_loss"))]
    if not vals:
        raise UsageError(f"rung depth {rung.depth} ended without a validation loss at step {run.config.train.max_steps}; "
                         f"see {run_dir}/console.log")
    rung.val_loss, rung.wall_s, rung.run_dir = float(vals[-1]["val_loss"]), time.perf_counter() - start, str(run_dir)
    write_json_atomic(run_dir / "rung.json", dataclasses.asdict(rung))  # it marks the rung finished
    return rung


def finished_rung(run_dir: Path, planned: Rung) -> Rung | None:
    """The rung run_dir finished earlier, or None; UsageError if it was trained with other settings (a ladder
    of another config or dial rule in the same --out)."""
    path = run_dir / "rung.json"
    if not path.is_file():
        return None
    done = Rung(**json.loads(path.read_text()))
    plan = dataclasses.asdict(planned)
    changed = [k for k, v in dataclasses.asdict(done).items()
               if k not in ("val_loss", "wall_s", "run_dir") and not math.isclose(v, plan[k], rel_tol=1e-9)]
    if changed:
        what = ", ".join(f"{k} {getattr(done, k):g}, now {plan[k]:g}" for k in changed)
        raise UsageError(f"{path} was trained with other settings ({what}); pass a new --out for this ladder")
    return done


def run_ladder(options: ScalingOptions, out_dir: str | Path, progress: bool = True) -> dict:
    """Every seed's ladder, fit and prediction; writes scaling.{json,md,png} to out_dir."""
    depths = sorted(set(options.depths))
    base = load_config(options.config, options.overrides)
    seeds = options.seeds or [base.train.seed]
    every = depths + ([options.predict] if options.predict else [])
    configs = {(d, s): rung_config(options, d, s) for d in every for s in seeds}
    if not (Path(base.data.dir) / "meta.json").is_file():  # the ladder's corpus, not the general hint of load_meta
        raise UsageError(f"{base.data.dir} holds no prepared data; make the ladder's corpus first: gpt2train prepare "
                         f"markov --chars 20000000 --val-tokens 500000 --out {base.data.dir}")
    meta = load_meta(base.data.dir)
    planned = {key: describe_rung(run, key[1]) for key, run in configs.items()}
    floor = fit_floor(options, meta, base.data.dir)
    check_floor(floor, int(meta["vocab_size"]))
    train_tokens = check_fresh_data(list(planned.values()), base, meta)
    out = Path(out_dir)
    ladders = []
    for seed in seeds:
        rungs, fits = {}, None
        for depth in every:
            if depth == options.predict:  # the fit, and its prediction, before the held-out rung trains
                fits = fit_all([rungs[d] for d in depths], floor["value"])
                predicted = fits["compute"](planned[depth, seed].flops)
                if progress:
                    print(f"seed {seed}: predicted val loss of depth {depth}: {predicted:.4f}", flush=True)
            run_dir = out / f"seed{seed}" / f"depth{depth}"
            rung = finished_rung(run_dir, planned[depth, seed])
            if rung is None:
                if progress:
                    r = planned[depth, seed]
                    print(f"seed {seed}, depth {depth}: {r.params:,} params, {r.tokens:,} tokens, {r.steps:,} steps "
                          f"of {r.batch_tokens:,}, lr {r.lr:.3g} ...", flush=True)
                rung = train_rung(configs[depth, seed], planned[depth, seed], run_dir)
            elif progress:
                print(f"seed {seed}, depth {depth}: finished earlier ({run_dir}/rung.json)", flush=True)
            rungs[depth] = rung
            if progress:
                print(f"seed {seed}, depth {depth}: val loss {rung.val_loss:.4f} in {format_duration(rung.wall_s)}",
                      flush=True)
        fits = fits or fit_all([rungs[d] for d in depths], floor["value"])
        ladder = {"seed": seed, "rungs": [dataclasses.asdict(rungs[d]) for d in every],
                  "fits": {k: dataclasses.asdict(f) for k, f in fits.items()}}
        if options.predict:
            held = rungs[options.predict]
            ladder["prediction"] = {"depth": options.predict, "predicted": predicted, "measured": held.val_loss,
                                    "error": (held.val_loss - predicted) / predicted}
        ladders.append(ladder)
    result = {"options": dataclasses.asdict(options), "date": format_utc(time.time()), "torch": torch.__version__,
              "cpu_threads": torch.get_num_threads(), "data": base.data.dir, "train_tokens": train_tokens,
              "floor": floor, "target_error": TARGET_ERROR, "ladders": ladders}
    result["markdown"] = to_markdown(result)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "scaling.json", result)
    write_text_atomic(out / "scaling.md", result["markdown"])
    plot_ladders(result, out / "scaling.png")
    return result


def fit_floor(options: ScalingOptions, meta: dict, data_dir: str) -> dict:
    """The lower bound the fits keep E above: --floor, else the data's own (`prepare markov` records its
    chain's), else 0 (nothing known: real text)."""
    if options.floor is not None:
        return {"value": float(options.floor), "from": "--floor"}
    recorded = meta.get("loss_floor")
    if isinstance(recorded, (int, float)) and recorded >= 0:
        return {"value": float(recorded), "from": f"{data_dir}/meta.json"}
    return {"value": 0.0, "from": "none known"}


def check_floor(floor: dict, vocab_size: int) -> None:
    """Refuse, before any rung trains, a floor no data can have: no text over V tokens has an entropy above
    ln V (a uniform guess's loss), so a floor above it would fail the fit only after the whole ladder trained."""
    uniform = math.log(vocab_size)
    if floor["value"] > uniform:
        raise UsageError(f"loss floor {floor['value']:g} (from {floor['from']}) is above ln({vocab_size}) = "
                         f"{uniform:.4f}, a uniform guess's loss over the data's vocabulary; give one below it")


def fit_all(rungs: list[Rung], floor: float = 0.0) -> dict[str, Fit]:
    losses = [r.val_loss for r in rungs]
    return {"compute": fit_power_law([r.flops for r in rungs], losses, "compute", floor),
            "params": fit_power_law([r.params for r in rungs], losses, "params", floor),
            "tokens": fit_power_law([r.tokens for r in rungs], losses, "tokens", floor)}


def to_markdown(result: dict) -> str:
    floor = result["floor"]
    lines = [f"Fits of L = E + A x^-alpha with E at least {floor['value']:.4f} (loss floor: {floor['from']}).", ""]
    for ladder in result["ladders"]:
        lines += [f"Seed {ladder['seed']}:", "",
                  "| depth | width | heads | params N | tokens D | batch | steps | lr | compute C | val loss | time |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in ladder["rungs"]:
            lines.append(f"| {r['depth']} | {r['width']} | {r['heads']} | {format_count(r['params'])} | "
                         f"{format_count(r['tokens'])} | {r['batch_tokens']:,} | {r['steps']:,} | {r['lr']:.3g} | "
                         f"{r['flops']:.3g} | {r['val_loss']:.4f} | {format_duration(r['wall_s'])} |")
        lines.append("")
        for name, f in ladder["fits"].items():
            lines.append(f"- L({name}) = {f['E']:.4f} + {f['A']:.4g} x^-{f['alpha']:.4f} "
                         f"(rms error {f['rms_log_error']:.2%})")
        p = ladder.get("prediction")
        if p:
            ok = "within" if abs(p["error"]) <= result["target_error"] else "NOT within"
            lines.append(f"- depth {p['depth']}: predicted {p['predicted']:.4f}, measured {p['measured']:.4f}, "
                         f"error {p['error']:+.2%} ({ok} {result['target_error']:.0%})")
        lines.append("")
    return "\n".join(lines)


def plot_ladders(result: dict, path: Path) -> None:
    """Validation loss against compute: each seed's rungs, its fit, the predicted and the measured held-out rung."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ladder in result["ladders"]:
        fit = Fit(**ladder["fits"]["compute"])
        p = ladder.get("prediction")
        fitted = [r for r in ladder["rungs"] if not p or r["depth"] != p["depth"]]
        xs = np.geomspace(min(r["flops"] for r in ladder["rungs"]), max(r["flops"] for r in ladder["rungs"]), 100)
        line, = ax.plot(xs, [fit(x) for x in xs], linewidth=1, label=f"seed {ladder['seed']}: fit")
        ax.plot([r["flops"] for r in fitted], [r["val_loss"] for r in fitted], "o", color=line.get_color())
        if p:
            held = next(r for r in ladder["rungs"] if r["depth"] == p["depth"])
            ax.plot([held["flops"]], [p["predicted"]], "o", mfc="none", color=line.get_color(),
                    label=f"depth {p['depth']} predicted")
            ax.plot([held["flops"]], [p["measured"]], "*", markersize=11, color=line.get_color(),
                    label=f"depth {p['depth']} measured ({p['error']:+.1%})")
    if result["floor"]["value"] > 0:
        ax.axhline(result["floor"]["value"], color="gray", linestyle=":", linewidth=1, label="loss floor")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # labels at the powers of ten only
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("final validation loss")
    ax.set_title(f"scaling ladder: {result['options']['config']} on {result['data']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_line(result: dict) -> str:
    parts = []
    for ladder in result["ladders"]:
        p = ladder.get("prediction")
        if p:
            parts.append(f"seed {ladder['seed']}: depth {p['depth']} predicted {p['predicted']:.4f}, measured "
                         f"{p['measured']:.4f} ({p['error']:+.2%})")
    return "; ".join(parts) or "no --predict rung"
