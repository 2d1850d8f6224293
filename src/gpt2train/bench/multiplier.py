"""The compute multiplier: how much less training compute a candidate recipe needs than a base recipe to reach
the same loss (or suite score), measured on a ladder of sizes rather than at one.

Each recipe (a config) trains a ladder of `model.depth` rungs at their compute-optimal budgets, with bench
scaling's rungs and rules (the dial sets each rung's shape, learning rate, batch and steps), once per seed.
The target is the base's loss on its largest rung, L*; the base spends that rung's compute C_base on it; the
candidate needs C_cand, read off its own rungs (straight lines between them in log-log) and, beside it, off its
fitted law L(C) = E + A C^-alpha (bench scaling's fit; a ladder that misses its fit by over 1% rms is said not to
follow it). The multiplier is C_base / C_cand: above 1, the candidate reaches the base's loss with less compute. The time
multiplier is the same with each rung's training seconds in place of its FLOPs, so a change that saves FLOPs
but costs time says so. Seeds pair up (the base's seed s against the candidate's seed s): the spread of the
per-seed multipliers is the seeds' spread.

The target may instead be the base's score on the multiple-choice suite (target "suite": eval.tasks, run at
each rung's validation, which the ladder presets hold once, at the end): each rung's score is its final
centered mean, and the candidate's compute for the base's top score is read off its rungs alone, straight lines
between them in (log compute, score), rising to it: no power law is fitted to scores. A base whose scores do not
rise from rung to rung, by more than their noise over the ladder (tiny models all at chance), sets no target,
and a candidate whose rungs never head up to it has no multiplier: each says why in one line. Its time counts
each rung's seconds without the suite's own. With the loss as the target the rows run no suite at all.

Three forms, as in bench quality (bench/recipe.py makes the rows):
  pair     the base and the candidate;
  ablate   the candidate, and the candidate minus each change: a change's multiplier is the full candidate's
           over the candidate without it;
  journey  the base, then one more change per row: each row's multiplier over the row before.

A row's rungs live in OUT/<row>-<hash of its config>/seed<S>/depth<d>/ (bench scaling's layout under it), so
an interrupted bench resumes, and a row already trained by another form in the same OUT (the candidate of a
pair is the full recipe of an ablation) is read rather than trained again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gpt2train import runlog
from gpt2train.bench.recipe import Row, flat, plan_rows
from gpt2train.bench.scaling import (
    Fit,
    Rung,
    check_floor,
    check_fresh_data,
    describe_rung,
    finished_rung,
    fit_floor,
    fit_power_law,
    ladder_rung,
    train_rung,
)
from gpt2train.config import Config, load_config
from gpt2train.data.prepared import load_meta
from gpt2train.eval.suite import TASKS, check_tokenizer, load_suite, resolve_tasks
from gpt2train.files import write_json_atomic, write_text_atomic
from gpt2train.ranges import UsageError
from gpt2train.runconfig import RunConfig
from gpt2train.units import format_duration, format_utc

FORMS = ("pair", "ablate", "journey")
LAW_RMS, LAW_HELD_OUT = 0.01, 0.02  # issue 45: rungs further than these from the fitted law do not follow it
TARGETS = {"val": "the base's validation loss on its largest rung",
           "suite": "the base's suite score (centered mean) on its largest rung"}
SUITE_LIMIT = 200  # examples of each suite task per rung: a CPU ladder's suite in minutes, not hours
NOISE = 2.0  # standard errors the base's scores must rise by over its ladder to set a target
SAME_SCORE = 1e-9  # scores are means of ratios of counts: closer than this they are equal, whatever the rounding


@dataclass
class MultiplierOptions:
    base: str = "ladder-2024"  # a file or a preset
    candidate: str = "ladder-modern"
    form: str = "pair"
    depths: list[int] = field(default_factory=lambda: [3, 4, 5])
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    floor: float | None = None  # as bench scaling's --floor
    overrides: list[str] = field(default_factory=list)  # --set, applied to every row
    target: str = "val"  # a key of TARGETS
    suite_tasks: str = ""  # comma-separated suite tasks for the suite target; "": the base's eval.tasks, else the core
    suite_limit: int = SUITE_LIMIT  # examples of each task, 0: all of them

    def __post_init__(self):
        """The one check of how the options go together; each depth's and seed's own range is checked by its
        type in cli/bench.py."""
        if self.form not in FORMS:
            raise UsageError(f"form {self.form!r}: use one of {', '.join(FORMS)}")
        if self.target not in TARGETS:
            raise UsageError(f"target {self.target!r} is not one of {', '.join(TARGETS)}")
        if self.suite_tasks:
            if self.target != "suite":
                raise UsageError("--suite-tasks names the suite's tasks for --target suite: pass that too, or leave "
                                 "--suite-tasks out")
            resolve_tasks(self.suite_tasks)  # an unknown task fails here, before any rung trains
        if len(set(self.depths)) < 3:
            raise UsageError(f"--depths {self.depths}: give at least three distinct depths of 1 or more")
        if not self.seeds:
            raise UsageError("--seeds: give at least one seed (two or more measure the seeds' spread)")


@dataclass
class Comparison:
    """The candidate's multiplier over the reference for one seed."""

    reference: str
    candidate: str
    seed: int
    target_loss: float  # the reference's loss on its largest rung
    reference_flops: float
    candidate_flops: float | None  # None: the candidate's fit never comes down to target_loss
    flops_multiplier: float | None
    interpolated: bool  # candidate_flops lies within the candidate's rungs (not an extrapolation)
    reference_s: float | None = None
    candidate_s: float | None = None
    time_multiplier: float | None = None
    # The same read off the candidate's rungs themselves (straight lines between them in log-log), not its fit:
    # where the fit misses its own rungs by more than the gaps between recipes, this is the one to read.
    between_flops: float | None = None
    between_multiplier: float | None = None
    between_time_multiplier: float | None = None
    between_rungs: bool = False  # target_loss lies between the candidate's rungs (else its end segment extended)


@dataclass
class SuiteScore:
    """A rung's suite score at its last step, as its metrics.jsonl holds it."""

    centered_mean: float
    stderr: float  # of centered_mean: each task's accuracy a binomial over its examples
    seconds: float  # the suite's own time in the rung's run, left out of its training time
    tasks: dict  # {name: {"acc", "centered", "n"}}


@dataclass
class ScoreComparison:
    """The candidate's multiplier over the reference for one seed, on the suite's score: read off the
    candidate's rungs alone, since no law is fitted to scores."""

    reference: str
    candidate: str
    seed: int
    target_score: float  # the reference's score on its largest rung
    reference_flops: float
    reference_s: float | None = None  # that rung's training seconds, the suite's left out
    between_flops: float | None = None  # None: no multiplier, and `reason` says why
    between_multiplier: float | None = None
    between_time_multiplier: float | None = None
    between_rungs: bool = False  # the target lies between two of the candidate's rungs (else an end segment extended)
    reason: str = ""


def row_dir_name(row: Row) -> str:
    """The row's slug and a hash of its config (the keys that differ from the defaults, so that a key added to
    gpt2train later leaves the name as it was): a row with other settings never reads these rungs."""
    defaults = flat(Config())
    settings = json.dumps({k: v for k, v in flat(row.cfg).items() if v != defaults[k]}, sort_keys=True, default=str)
    return f"{row.slug}-{hashlib.sha256(settings.encode()).hexdigest()[:8]}"


def config_slug(name: str) -> str:
    stem = Path(name).stem if name.endswith(".toml") else name
    return re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-") or "config"


def plan(options: MultiplierOptions) -> tuple[list[Row], list[tuple[int, int]], list[str]]:
    """The rows to train, the comparisons (reference row index, candidate row index) and notes."""
    base = load_config(options.base, options.overrides)
    candidate = load_config(options.candidate, options.overrides)
    suite_settings(base, candidate, options)
    base_slug, candidate_slug = config_slug(options.base), config_slug(options.candidate)
    rows, notes = plan_rows(base, candidate, ablate=options.form == "ablate", recipe_only=options.form == "pair",
                            base_name=options.base, base_slug=base_slug)
    for row in rows:
        if row.name == "full recipe":
            row.name, row.slug = options.candidate, candidate_slug
        elif row.slug.startswith("recipe-minus-"):
            row.slug = f"{candidate_slug}-minus-{row.slug.removeprefix('recipe-minus-')}"
        elif row.name.startswith("+ "):
            row.slug = f"{base_slug}-plus-{row.slug}"
    if options.form == "pair":
        return rows, [(0, 1)], notes
    if options.form == "ablate":  # rows: base, full, minus each change; the base trains only in the pair form
        return rows[1:], [(i, 0) for i in range(1, len(rows) - 1)], notes
    return rows, [(i - 1, i) for i in range(1, len(rows))], notes


def suite_settings(base: Config, candidate: Config, options: MultiplierOptions) -> None:
    """For the suite target, every row runs the same tasks at each validation (the ladder presets validate once,
    at the end), options.suite_limit examples of each; for the loss, no row runs the suite (the GPT-2 presets
    turn it on). The tasks are written out by name, so that a row's folder names what it ran."""
    tasks = resolve_tasks(options.suite_tasks or base.eval.tasks or ["core"]) if options.target == "suite" else []
    for cfg in (base, candidate):
        cfg.eval.tasks = list(tasks)
        if tasks:
            cfg.eval.tasks_interval, cfg.eval.tasks_limit = 0, options.suite_limit  # 0: at each validation


def read_suite(run_dir: Path, step: int) -> SuiteScore:
    """The rung's suite score at `step`, its last; the suite's seconds are each suite record's time after the
    validation record of its step (the suite runs right after validation)."""
    run = runlog.load_run(run_dir)
    validated = {r["step"]: r["time"] for r in run.of(runlog.VAL)}
    suites = [r for r in run.of(runlog.SUITE) if runlog.is_finite(r.get("centered_mean"))]
    last = [r for r in suites if r["step"] == step]
    if not last:
        raise ValueError(f"{run_dir} holds no suite score at step {step}: the suite was skipped (a warning said why "
                         "when the rung trained); remove the folder to train it again")
    seconds = sum(r["time"] - validated[r["step"]] for r in suites if r["step"] in validated)
    tasks = last[-1]["tasks"]
    return SuiteScore(float(last[-1]["centered_mean"]), suite_stderr(tasks), max(0.0, seconds), tasks)


def suite_stderr(tasks: dict) -> float:
    """The standard error of the centered mean: each task's accuracy over its n examples, a binomial, scaled
    as centering scales it, and the tasks independent."""
    variance = sum(t["acc"] * (1 - t["acc"]) / t["n"] / (1 - TASKS[name].chance) ** 2
                   for name, t in tasks.items() if t["n"])
    return math.sqrt(variance) / len(tasks)


def compute_to_reach(fit: Fit, loss: float) -> float | None:
    """The x where the fitted law comes down to `loss`; None where it never does (loss at or below E)."""
    if loss <= fit.E:
        return None
    return (fit.A / (loss - fit.E)) ** (1 / fit.alpha)


def between_rungs(xs: list[float], losses: list[float], loss: float) -> tuple[float, bool]:
    """Where the curve through the rungs (x, loss), straight between neighbours in log-log, comes down to `loss`:
    (x, True) between two rungs; else the nearest end segment extended, (x, False)."""
    lx, ly, target = np.log(xs), np.log(losses), math.log(loss)
    order = np.argsort(lx)
    lx, ly = lx[order], ly[order]
    inside = [i for i in range(len(lx) - 1) if min(ly[i], ly[i + 1]) <= target <= max(ly[i], ly[i + 1])]
    i = inside[0] if inside else (len(lx) - 2 if target < ly[-1] else 0)
    t = (target - ly[i]) / (ly[i + 1] - ly[i])
    return float(np.exp(lx[i] + t * (lx[i + 1] - lx[i]))), bool(inside)


def compare(reference: dict, candidate: dict, seed: int) -> Comparison:
    """reference, candidate: {"name", "rungs": [Rung...], "fit", "time_fit"} of one seed."""
    top = max(reference["rungs"], key=lambda r: r.flops)
    flops = compute_to_reach(candidate["fit"], top.val_loss)
    xs = [r.flops for r in candidate["rungs"]]
    out = Comparison(reference["name"], candidate["name"], seed, top.val_loss, top.flops, flops,
                     top.flops / flops if flops else None,
                     flops is not None and min(xs) <= flops <= max(xs))
    losses = [r.val_loss for r in candidate["rungs"]]
    out.between_flops, out.between_rungs = between_rungs(xs, losses, top.val_loss)
    out.between_multiplier = top.flops / out.between_flops
    if candidate.get("time_fit") and top.wall_s:
        seconds = compute_to_reach(candidate["time_fit"], top.val_loss)
        out.reference_s, out.candidate_s = top.wall_s, seconds
        out.time_multiplier = top.wall_s / seconds if seconds else None
        if all(r.wall_s for r in candidate["rungs"]):
            out.between_time_multiplier = top.wall_s / between_rungs([r.wall_s for r in candidate["rungs"]], losses,
                                                                     top.val_loss)[0]
    return out


def reach_score(xs: list[float], scores: list[float], score: float) -> tuple[float | None, bool]:
    """Where the curve through the rungs (x, score), straight between neighbours in (log x, score), first rises
    to `score`: (x, True) between two rungs; else the end segment toward it extended, (x, False), where that
    segment rises; (None, False) where it does not (flat or falling, it never heads for `score`)."""
    order = np.argsort(xs)
    lx, ys = np.log(np.asarray(xs, dtype=float))[order], np.asarray(scores, dtype=float)[order]
    first = next((i for i, y in enumerate(ys) if y >= score), None)
    if first is not None and first > 0:  # between the last rung below the score and the first at or above it
        i, inside = first - 1, True
    elif first == 0 and ys[0] == score:
        return float(np.exp(lx[0])), True
    else:  # below the score on every rung: the last segment extended up; above it on the first: the first, back
        i, inside = (len(ys) - 2 if first is None else 0), False
        if ys[i + 1] - ys[i] <= SAME_SCORE:
            return None, False
    t = (score - ys[i]) / (ys[i + 1] - ys[i])
    return float(np.exp(lx[i] + t * (lx[i + 1] - lx[i]))), inside


def scores_text(scores: list[float]) -> str:
    return ", ".join(f"{s:.4f}" for s in scores)


def rise_problem(name: str, scores: list[SuiteScore]) -> str:
    """Why a reference's scores (smallest rung first) set no target, or "" when they rise from each rung to the
    next and, over the ladder, by more than NOISE standard errors of its end rungs' scores."""
    values = [s.centered_mean for s in scores]
    if any(b - a <= SAME_SCORE for a, b in zip(values, values[1:])):
        return f"{name}'s suite scores do not rise with compute ({scores_text(values)}, smallest rung first)"
    noise = NOISE * math.hypot(scores[0].stderr, scores[-1].stderr)
    if values[-1] - values[0] <= noise:
        return (f"{name}'s suite scores rise by {values[-1] - values[0]:.4f} over its rungs ({scores_text(values)}), "
                f"within {NOISE:g} standard errors ({noise:.4f}) of their noise")
    return ""


def training_seconds(rung: Rung, suite: SuiteScore) -> float | None:
    """The rung's seconds without its suite's; None where they are not known."""
    seconds = (rung.wall_s or 0.0) - suite.seconds
    return seconds if seconds > 0 else None


def compare_scores(reference: dict, candidate: dict, seed: int) -> ScoreComparison:
    """reference, candidate: {"name", "rungs": [Rung...], "suite": [SuiteScore...], one per rung} of one seed."""
    ranked = sorted(zip(reference["rungs"], reference["suite"]), key=lambda pair: pair[0].flops)
    top, top_score = ranked[-1]
    target = top_score.centered_mean
    out = ScoreComparison(reference["name"], candidate["name"], seed, target, top.flops,
                          training_seconds(top, top_score))
    out.reason = rise_problem(reference["name"], [score for _, score in ranked])
    if out.reason:
        out.reason += ": no target to read a multiplier at"
        return out
    scores = [s.centered_mean for s in candidate["suite"]]
    out.between_flops, out.between_rungs = reach_score([r.flops for r in candidate["rungs"]], scores, target)
    if out.between_flops is None:
        ranked_scores = [s for _, s in sorted(zip([r.flops for r in candidate["rungs"]], scores))]
        where = ("stay below the target and do not rise at its largest rung" if max(scores) < target else
                 "are above the target at its smallest rung and do not rise from there")
        out.reason = (f"{candidate['name']}'s suite scores ({scores_text(ranked_scores)}, smallest rung first) {where}: "
                      f"where it reaches {target:.4f} is not measured")
        return out
    out.between_multiplier = top.flops / out.between_flops
    seconds = [training_seconds(r, s) for r, s in zip(candidate["rungs"], candidate["suite"])]
    if out.reference_s and all(seconds):
        at = reach_score(seconds, scores, target)[0]
        out.between_time_multiplier = out.reference_s / at if at else None
    return out


def spread(values: list[float | None]) -> dict | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return {"mean": statistics.fmean(known), "min": min(known), "max": max(known), "n": len(known), "of": len(values)}


def run_multiplier(options: MultiplierOptions, out_dir: str | Path, progress: bool = True) -> dict:
    """Train (or read) every row's ladders, fit them, compare; writes multiplier.{json,md,png} to out_dir."""
    rows, pairs, notes = plan(options)
    depths, seeds = sorted(set(options.depths)), list(dict.fromkeys(options.seeds))
    data_dir = rows[0].cfg.data.dir
    suite = options.target == "suite"
    meta = ladder_data(rows[0].cfg, suite, options.suite_limit)
    floor = fit_floor(options, meta, data_dir)
    check_floor(floor, int(meta["vocab_size"]))
    configs = {(i, d, s): ladder_rung(row.cfg, [], d, s, row.name)
               for i, row in enumerate(rows) for d in depths for s in seeds}
    planned = {key: describe_rung(run, key[2]) for key, run in configs.items()}
    train_tokens = check_fresh_data(list(planned.values()), rows[0].cfg, meta)
    out = Path(out_dir)
    dirs = [row_dir_name(row) for row in rows]  # a hash of each row's settings, taken once

    ladders: dict[tuple[int, int], dict] = {}
    for i, row in enumerate(rows):
        for seed in seeds:
            runs = {depth: (configs[i, depth, seed], planned[i, depth, seed]) for depth in depths}
            ladders[i, seed] = train_ladder(row.name, seed, runs, out / dirs[i] / f"seed{seed}", floor["value"],
                                            suite, progress)

    comparisons = []
    for ref, cand in pairs:
        if suite:
            per_seed = [compare_scores(ladders[ref, s], ladders[cand, s], s) for s in seeds]
            comparisons.append(score_comparison(rows[ref].name, rows[cand].name, per_seed))
        else:
            per_seed = [compare(ladders[ref, s], ladders[cand, s], s) for s in seeds]
            comparisons.append(loss_comparison(rows[ref].name, rows[cand].name, per_seed))

    result = {"options": dataclasses.asdict(options), "date": format_utc(time.time()), "torch": torch.__version__,
              "cpu_threads": torch.get_num_threads(), "data": data_dir, "train_tokens": train_tokens,
              "floor": floor, "notes": notes, "target": target_description(options, rows[0].cfg.eval.tasks),
              "rows": [row_result(row, dirs[i], [ladders[i, s] for s in seeds], seeds, suite)
                       for i, row in enumerate(rows)],
              "comparisons": comparisons}
    result["law"] = law_check(result, len(depths))
    result["markdown"] = multiplier_markdown(result)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "multiplier.json", result)
    write_text_atomic(out / "multiplier.md", result["markdown"])
    plot(result, out / "multiplier.png")
    return result


def ladder_data(cfg: Config, suite: bool, suite_limit: int) -> dict:
    """The meta.json of the ladders' prepared data (cfg.data.dir). UsageError, before any rung trains, when there is
    none, or (suite: the target is the suite's score) when the suite cannot run on it."""
    data_dir = cfg.data.dir
    if not (Path(data_dir) / "meta.json").is_file():
        raise UsageError(f"{data_dir} holds no prepared data; make the ladder's corpus first (docs/benchmarks.md, "
                         "\"The compute multiplier\"): gpt2train prepare pydocs --out data/pydocs")
    meta = load_meta(data_dir)
    if suite:  # what would stop the suite is found before any rung trains
        try:
            check_tokenizer(meta["tokenizer"])
        except UsageError:
            raise UsageError(f"--target suite needs data whose tokenizer encodes any text (gpt2, or a byte-level bpe); "
                             f"{data_dir} uses {meta['tokenizer'].get('kind')!r}") from None
        load_suite(cfg.eval.tasks, suite_limit)
    return meta


def train_ladder(name: str, seed: int, runs: dict[int, tuple[RunConfig, Rung]], seed_dir: Path, floor: float,
                 suite: bool, progress: bool) -> dict:
    """One row's ladder for one seed: each depth's rung (its config and its plan) read back where it finished,
    else trained, in seed_dir/depth<d>; then its loss fitted against compute and against seconds (E >= floor),
    and, with suite, each rung's suite score."""
    rungs, scores = [], []
    for depth, (run, planned) in runs.items():
        run_dir = seed_dir / f"depth{depth}"
        rung = finished_rung(run_dir, planned)
        if rung is None:
            if progress:
                print(f"{name}, seed {seed}, depth {depth}: {planned.params:,} params, {planned.tokens:,} tokens, "
                      f"{planned.steps:,} steps ...", flush=True)
            rung = train_rung(run, planned, run_dir)
        if suite:
            scores.append(read_suite(run_dir, rung.steps))
        if progress:
            score = f", suite score {scores[-1].centered_mean:.4f}" if suite else ""
            print(f"{name}, seed {seed}, depth {depth}: val loss {rung.val_loss:.4f}{score} "
                  f"({format_duration(rung.wall_s)})", flush=True)
        rungs.append(rung)
    return {"name": name, "rungs": rungs, "suite": scores,
            "fit": fit_power_law([r.flops for r in rungs], [r.val_loss for r in rungs], "compute", floor),
            "time_fit": fit_power_law([r.wall_s for r in rungs], [r.val_loss for r in rungs], "seconds", floor)}


def loss_comparison(reference: str, candidate: str, per_seed: list[Comparison]) -> dict:
    """One comparison on the loss over the seeds: the spread of each multiplier, read off the fits and off the
    rungs, in compute and in time."""
    return {"reference": reference, "candidate": candidate, "seeds": [dataclasses.asdict(c) for c in per_seed],
            "flops_multiplier": spread([c.flops_multiplier for c in per_seed]),
            "time_multiplier": spread([c.time_multiplier for c in per_seed]),
            "interpolated": all(c.interpolated for c in per_seed),
            "between_multiplier": spread([c.between_multiplier for c in per_seed]),
            "between_time_multiplier": spread([c.between_time_multiplier for c in per_seed]),
            "between_rungs": all(c.between_rungs for c in per_seed)}


def row_result(row: Row, row_dir: str, ladders: list[dict], seeds: list[int], suite: bool) -> dict:
    """A row of multiplier.json: its settings and, per seed, its rungs and fits (and suite scores)."""
    return {"name": row.name, "dir": row_dir, "changes": row.changes,
            "ladders": [{"seed": s, "rungs": [dataclasses.asdict(r) for r in ladder["rungs"]],
                         "fit": dataclasses.asdict(ladder["fit"]),
                         "time_fit": dataclasses.asdict(ladder["time_fit"]),
                         **({"suite": [dataclasses.asdict(x) for x in ladder["suite"]]} if suite else {})}
                        for s, ladder in zip(seeds, ladders)]}


def score_comparison(reference: str, candidate: str, per_seed: list[ScoreComparison]) -> dict:
    """One comparison on the suite's score over the seeds: the multipliers' spread, and each distinct reason
    some seed has none."""
    read = [c.between_rungs for c in per_seed if c.between_flops is not None]
    return {"reference": reference, "candidate": candidate, "seeds": [dataclasses.asdict(c) for c in per_seed],
            "between_multiplier": spread([c.between_multiplier for c in per_seed]),
            "between_time_multiplier": spread([c.between_time_multiplier for c in per_seed]),
            "between_rungs": bool(read) and all(read),
            "reasons": list(dict.fromkeys(f"seed {c.seed}: {c.reason}" for c in per_seed if c.reason))}


def target_description(options: MultiplierOptions, tasks: list[str]) -> dict:
    """What the ladders were compared on, for the result's JSON and text."""
    out = {"name": options.target, "measure": TARGETS[options.target]}
    if options.target == "suite":
        out |= {"tasks": list(tasks), "limit": options.suite_limit,
                "read": "off the candidate's rungs only, straight lines in (log compute, score): no law is fitted "
                        "to scores"}
    return out


def law_check(result: dict, rungs: int) -> str:
    """Whether the ladders follow their fitted laws. Three rungs fit E, A and alpha exactly unless E is held at
    its floor; then, and with more rungs, the rms error says."""
    worst = max((ladder["fit"]["rms_log_error"], row["name"], ladder["seed"])
                for row in result["rows"] for ladder in row["ladders"])
    if worst[0] > LAW_RMS:
        return (f"{worst[1]} (seed {worst[2]}) does not follow its fitted law: rms error {worst[0]:.2%}, over "
                f"{LAW_RMS:.0%}; read the multipliers off the rungs, and extrapolate no fit")
    if rungs <= 3 and worst[0] < 1e-6:
        return (f"{rungs} rungs fit E, A and alpha exactly: nothing checks that they follow the law (add a rung "
                f"to --depths)")
    return f"every ladder within {LAW_RMS:.0%} rms of its fitted law (worst {worst[0]:.2%}, {worst[1]} seed {worst[2]})"


def multiplier_text(stats: dict | None, missing: str = "never reached") -> str:
    if stats is None:
        return missing
    if stats["n"] == 1:
        return f"{stats['mean']:.2f}x" + ("" if stats["of"] == 1 else f" (1 of {stats['of']} seeds)")
    return f"{stats['mean']:.2f}x ({stats['min']:.2f}-{stats['max']:.2f})"


def multiplier_markdown(result: dict) -> str:
    seeds = result["options"]["seeds"]
    depths = sorted(set(result["options"]["depths"]))
    target = result["target"]
    lines = [f"Ladders of depths {', '.join(map(str, depths))}, seeds {', '.join(map(str, seeds))}, on "
             f"{result['data']}; target: {target['measure']}; fits of L = E + A C^-alpha with E at least "
             f"{result['floor']['value']:.4f} (floor: {result['floor']['from']}). {result['law']}.", "",
             "| recipe | seed | " + " | ".join(f"depth {d}" for d in depths) + " | E | A | alpha | rms | time |",
             "|---|---:|" + "---:|" * len(depths) + "---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        for ladder in row["ladders"]:
            fit = ladder["fit"]
            losses = " | ".join(f"{r['val_loss']:.4f}" for r in ladder["rungs"])
            seconds = sum(r["wall_s"] or 0 for r in ladder["rungs"])
            lines.append(f"| {row['name']} | {ladder['seed']} | {losses} | {fit['E']:.3f} | {fit['A']:.4g} | "
                         f"{fit['alpha']:.4f} | {fit['rms_log_error']:.2%} | {format_duration(seconds)} |")
    if target["name"] == "suite":
        return "\n".join(lines + suite_markdown(result, depths)) + "\n"
    lines += ["", "| candidate | over | target loss | compute multiplier, rungs | time multiplier, rungs | "
              "compute multiplier, fit | time multiplier, fit |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for c in result["comparisons"]:
        target = statistics.fmean(s["target_loss"] for s in c["seeds"])
        rungs = "" if c["between_rungs"] else " (extended)"
        fit = "" if c["interpolated"] else " (extrapolated)"
        lines.append(f"| {c['candidate']} | {c['reference']} | {target:.4f} | "
                     f"{multiplier_text(c['between_multiplier'])}{rungs} | "
                     f"{multiplier_text(c['between_time_multiplier'])}{rungs} | "
                     f"{multiplier_text(c['flops_multiplier'])}{fit} | {multiplier_text(c['time_multiplier'])}{fit} |")
    lines += ["", "Multipliers: mean over the seeds (min-max): the reference's compute (training time) on its largest "
              "rung over what the candidate needs for the same loss, read off the candidate's rungs (straight lines "
              "between them in log-log; extended: beyond its rungs) or off its fitted law (extrapolated: beyond its "
              "rungs)."]
    return "\n".join(lines + shared_changes(result)) + "\n"


def shared_changes(result: dict) -> list[str]:
    shared = [note.split(": skipped")[0] for note in result["notes"] if ": skipped" in note]
    return [f"Changes both recipes have alike (not compared): {', '.join(shared)}."] if shared else []


def suite_markdown(result: dict, depths: list[int]) -> list[str]:
    """The suite target's tables: each rung's score, then the multipliers read off the rungs, and why any is
    missing."""
    target = result["target"]
    limit = f"at most {target['limit']:,} examples each" if target["limit"] else "every example"
    lines = ["", f"Suite scores (centered mean over {', '.join(target['tasks'])}; {limit}), with their standard "
             "errors:", "",
             "| recipe | seed | " + " | ".join(f"depth {d}" for d in depths) + " |",
             "|---|---:|" + "---:|" * len(depths)]
    for row in result["rows"]:
        for ladder in row["ladders"]:
            cells = " | ".join(f"{s['centered_mean']:.4f} ± {s['stderr']:.4f}" for s in ladder["suite"])
            lines.append(f"| {row['name']} | {ladder['seed']} | {cells} |")
    lines += ["", "| candidate | over | target score | compute multiplier, rungs | time multiplier, rungs |",
              "|---|---|---:|---:|---:|"]
    for c in result["comparisons"]:
        score = statistics.fmean(s["target_score"] for s in c["seeds"])
        rungs = "" if c["between_rungs"] or c["between_multiplier"] is None else " (extended)"
        missing = "none (below)" if c["reasons"] else "never reached"
        lines.append(f"| {c['candidate']} | {c['reference']} | {score:.4f} | "
                     f"{multiplier_text(c['between_multiplier'], missing)}{rungs} | "
                     f"{multiplier_text(c['between_time_multiplier'], missing)}{rungs} |")
    reasons = [f"- {c['candidate']} over {c['reference']}, {reason}" for c in result["comparisons"]
               for reason in c["reasons"]]
    lines += ["", "Multipliers: mean over the seeds (min-max): the reference's compute (training time, the suite's "
              "own left out) on its largest rung over what the candidate needs for the same suite score, read "
              f"{target['read']} (extended: beyond its rungs)."]
    if reasons:
        lines += ["", "No multiplier where the scores cannot give one:", "", *reasons]
        lines += [""] if shared_changes(result) else []
    return lines + shared_changes(result)


def plot(result: dict, path: Path) -> None:
    """Validation loss against compute: every row's rungs (one marker per seed) and fits; beside it, for the
    suite target, each rung's suite score and the straight lines it is read off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suite = result["target"]["name"] == "suite"
    fig, axes = plt.subplots(1, 2 if suite else 1, figsize=(13 if suite else 7.5, 4.8), squeeze=False)
    ax = axes[0][0]
    markers = "os^vD"
    for row in result["rows"]:
        color = None
        for k, ladder in enumerate(row["ladders"]):
            xs = [r["flops"] for r in ladder["rungs"]]
            grid = np.geomspace(min(xs), max(xs), 60)
            fit = Fit(**ladder["fit"])
            line, = ax.plot(grid, [fit(x) for x in grid], linewidth=1, color=color,
                            label=row["name"] if k == 0 else None)
            color = line.get_color()
            ax.plot(xs, [r["val_loss"] for r in ladder["rungs"]], markers[k % len(markers)], color=color, markersize=4)
            if suite:
                points = sorted(zip(xs, [s["centered_mean"] for s in ladder["suite"]]))
                axes[0][1].plot(*zip(*points), markers[k % len(markers)] + "-", color=color, markersize=4, linewidth=1,
                                label=row["name"] if k == 0 else None)
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("final validation loss")
    ax.set_title(f"compute multiplier ladders on {result['data']}", fontsize=10)
    ax.legend(fontsize=7)
    if suite:
        right = axes[0][1]
        right.set_xscale("log")
        right.set_xlabel("training compute C (FLOPs)")
        right.set_ylabel("final suite score (centered mean)")
        right.set_title("the suite target: read off the rungs, no fit", fontsize=10)
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def multiplier_summary(result: dict) -> str:
    """One line: each comparison's multipliers read off the rungs, and on which target."""
    what = "suite score" if result["target"]["name"] == "suite" else "loss"
    lines = []
    for c in result["comparisons"]:
        head = f"{c['candidate']} over {c['reference']} ({what}): "
        if c["between_multiplier"] is None and c.get("reasons"):
            lines.append(head + f"no multiplier, {c['reasons'][0]}")
            continue
        line = head + (f"{multiplier_text(c['between_multiplier'])} compute, "
                       f"{multiplier_text(c['between_time_multiplier'])} time (its rungs)")
        lines.append(line + (f" ({len(c['reasons'])} seed{'s' if len(c['reasons']) > 1 else ''} without: "
                             f"{c['reasons'][0]})" if c.get("reasons") else ""))
    return "; ".join(lines)
