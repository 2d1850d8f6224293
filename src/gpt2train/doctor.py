"""Diagnose a run from its RUN_DIR/metrics.jsonl: each symptom found, with the steps and values that
show it and the fix to try. A healthy run says so.

The flow is read (runlog.load_metrics, which merges resumes) -> one small check per symptom -> print.
Every check is a function of the records and the config that returns a Finding or nothing, and every
threshold is a named constant below with the reason for its value. The rules are listed with their
fixes in docs/plan-and-doctor.md.

Exit status of `gpt2train doctor`: 0 healthy, 1 warnings only, 2 a serious finding (non-finite values,
divergence). Bad input (no metrics file) also exits 2, with a one-line error.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from gpt2train.bench_results import newest_journey, read_final_mfu
from gpt2train.config import Config, ConfigError, config_from_resolved, load_config
from gpt2train.devices import ASSUMED_GPU_MFU
from gpt2train.runlog import find_spikes, is_finite, load_metrics, object_field
from gpt2train.spikes import LOSS_SPIKE_RULE

# Loss spikes: runlog.find_spikes, by spikes.py's rule (the one `report` and the guard use too)
GRAD_LEAD_RECORDS = 2  # a grad-norm spike at most 2 logged steps before a loss spike likely caused it
# Clipping
CLIP_MOST_FRACTION = 0.5  # clipped on over half the steps after warmup: the clip, not the LR, sets the step size
CLIP_MIN_RECORDS = 10  # fewer logged steps after warmup say too little
# Early plateau
PLATEAU_MIN_RECORDS = 10  # a plateau spans at least 10 logged steps...
PLATEAU_WINDOW_FRACTION = 0.10  # ...and 10% of the run: shorter flat stretches are noise
PLATEAU_EARLY_FRACTION = 0.5  # it starts in the first half: flattening late is how every loss curve ends
PLATEAU_MAX_CHANGE = 0.01  # under 1% change between the medians of the window's first and last quarter
PLATEAU_MIN_LR_FRACTION = 0.1  # mean LR at least 10% of the peak: with a tiny LR a flat loss is expected
PLATEAU_LATER_DROP = 0.10  # flagged when the run later gets 10% lower (the stall cost time)...
PLATEAU_STUCK = 0.05  # ...or the stall sits within 5% of the first logged loss (nothing learned yet)
# Overfitting
OVERFIT_RISE = 0.02  # val loss 2% above its best: beyond evaluation noise of a few batches
OVERFIT_MIN_EVALS = 2  # on the last two evaluations at least, so one noisy eval is not a trend
# Resume
RESUME_JUMP = 0.10  # loss after a resume 10% above the loss before: the state was not fully restored
RESUME_SETTLE_RECORDS = 5  # spikes this soon after a flagged resume belong to the resume, not to training
# Throughput
THROUGHPUT_DROP = 0.20  # last quartile's median 20% below the first's: more than run-to-run jitter...
THROUGHPUT_NOISE_MADS = 3.0  # ...and more than 3 MADs of the first quartile's speeds: one logged step is timed
# alone, and on a CPU that shares its cores single steps vary by tens of percent; such noise is no fall
THROUGHPUT_MIN_RECORDS = 8  # quartiles of fewer logged steps are single points
# MFU
LOW_MFU_FRACTION = 0.5  # under half of that: something is starving the GPU
# Divergence
DIVERGE_WINDOW = 10  # rolling median over 10 logged losses, so one spike is not a divergence
DIVERGE_RATIO = 1.3  # the run ends 30% above its best rolling median: training has come apart

MAX_LISTED = 5  # steps listed in one line of evidence
MIN_TRAIN_RECORDS = 8  # fewer logged steps than this: "healthy" would be a guess


@dataclass
class Finding:
    rule: str  # short id: nonfinite, divergence, loss_spikes, ...
    severity: str  # "warning" or "serious"
    title: str  # the symptom in one line
    evidence: list[str]  # the steps and values that show it
    fix: str
    steps: list[int] = field(default_factory=list)  # where it shows (first step first)


@dataclass
class Diagnosis:
    run_dir: str
    last_step: int | None
    train_records: int
    launches: int
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)
    device: str | None = None  # what the latest launch trained on ("cpu", "cuda:0"); None in older logs
    suite: dict | None = None  # the last suite record's step, tokens, centered_mean and tasks (eval.tasks); None without

    @property
    def exit_status(self) -> int:
        if any(f.severity == "serious" for f in self.findings):
            return 2
        return 1 if self.findings else 0

    @property
    def healthy(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "healthy": self.healthy, "exit_status": self.exit_status}


def diagnose(run_dir: str | Path) -> Diagnosis:
    """Read a run directory and check it for every symptom below."""
    records = load_metrics(run_dir)  # RunLogError (one line) when missing, empty or unreadable
    cfg, notes = run_config(run_dir, records)
    train = _of(records, "train")
    expected = expected_mfu(Path(run_dir).parent, records)
    suite, suite_notes = last_suite(records, cfg)
    return Diagnosis(run_dir=str(run_dir), last_step=train[-1]["step"] if train else None, train_records=len(train),
                     launches=len(_of(records, "run_start")), findings=check_records(records, cfg, expected),
                     notes=notes + suite_notes, device=run_device(records), suite=suite)


def last_suite(records: list[dict], cfg: Config) -> tuple[dict | None, list[str]]:
    """The last suite record's numbers (step, tokens, centered_mean, tasks: how many), and a note when eval.tasks
    is set, the run went past a step where the suite was due, and no suite record was written: it was skipped."""
    scored = [r for r in _of(records, "suite") if is_finite(r.get("centered_mean"))]
    if scored:
        last = scored[-1]
        tasks = last.get("tasks") if isinstance(last.get("tasks"), dict) else {}
        return {"step": last["step"], "tokens": last.get("tokens"), "centered_mean": last["centered_mean"],
                "tasks": len(tasks)}, []
    if not cfg.eval.tasks or _of(records, "suite"):
        return None, []
    train = _of(records, "train")
    every = cfg.eval.tasks_interval or cfg.eval.interval
    ended = any(r.get("reason") == "done" for r in _of(records, "run_end"))
    if not (ended or (train and every and train[-1]["step"] > every)):
        return None, []  # not yet due
    return None, [f"eval.tasks = {cfg.eval.tasks!r} is set but the run wrote no suite record: the suite was skipped; "
                  "the run's console says why (a tokenizer that cannot encode any text, such as char, or the "
                  "suite's files missing)"]


def expected_mfu(runs_dir: Path, records: list[dict]) -> tuple[float | None, str]:
    """The MFU the run's device should reach: the all-techniques stage of the newest `gpt2train bench
    journey` beside the run (runs/bench-*/journey.json) measured on the same device, else a tuned GPT-2 run's.
    None on a CPU: its MFU is over its own measured matmul ceiling, and a GPU's typical figure says nothing of it."""
    starts = _of(records, "run_start")
    hardware = object_field(starts[-1], "hardware") if starts else {}
    if str(hardware.get("device", "")).startswith("cpu"):
        return None, "a CPU run: no typical MFU to expect"
    device = hardware.get("device_name")
    found = newest_journey(runs_dir)
    if device and found is not None:
        try:
            mfu, bench_device = read_final_mfu(found)
            if bench_device == device:
                return mfu, f"this device's gpt2train bench figure ({found})"
        except ValueError:
            pass  # an unreadable bench file: fall back to the typical figure
    return ASSUMED_GPU_MFU, "a tuned GPT-2 run's typical figure"


def run_config(run_dir: str | Path, records: list[dict]) -> tuple[Config, list[str]]:
    """RUN_DIR/config.toml; else the config of the last run_start; else the defaults (said in a note)."""
    path = Path(run_dir) / "config.toml"
    if path.is_file():
        return load_config(path), []
    starts = [r for r in _of(records, "run_start") if isinstance(r.get("config"), dict)]
    default = "judged against the default config (grad_clip, warmup)"
    if not starts:
        return Config(), [f"{path} not found: {default}"]
    try:
        return config_from_resolved(starts[-1]["config"]), [f"{path} not found: used the config in metrics.jsonl"]
    except ConfigError as e:  # a damaged log: its symptoms can still be judged
        return Config(), [f"{path} not found and the config in metrics.jsonl is unusable ({e}): {default}"]


def check_records(records: list[dict], cfg: Config,
                  expected: tuple[float | None, str] = (ASSUMED_GPU_MFU, "a tuned GPT-2 run's typical figure")) -> list[Finding]:
    """Every finding, serious ones first. `expected`: the MFU the device should reach, and where it comes from."""
    divergence = check_divergence(records)
    resume = check_resume_gap(records)
    explained = _steps_explained(records, divergence, resume)  # spikes these already account for
    found = [
        check_nonfinite(records),
        divergence,
        check_loss_spikes(records, explained),
        check_clipping(records, cfg),
        check_early_plateau(records),
        check_overfitting(records),
        resume,
        check_throughput(records),
        check_mfu(records, *expected),
    ]
    found = [f for f in found if f is not None]
    return sorted(found, key=lambda f: f.severity != "serious")


# ----------------------------------------------------------------------------------------------
# Serious


def check_nonfinite(records: list[dict]) -> Finding | None:
    bad = [r for r in _of(records, "train") if not (is_finite(r.get("loss")) and _finite_or_absent(r.get("grad_norm")))]
    bad_val = [r for r in _of(records, "val") if not is_finite(r.get("val_loss"))]
    skipped = [r for r in _of(records, "guard") if r.get("action") == "skip"]
    if not (bad or bad_val or skipped):
        return None
    evidence = []
    if bad:
        evidence.append(f"{len(bad)} logged train step(s) non-finite: "
                        + _list(f"step {r['step']} loss={r.get('loss')} grad_norm={r.get('grad_norm')}" for r in bad))
    if bad_val:
        evidence.append(f"{len(bad_val)} val loss(es) non-finite: " + _list(f"step {r['step']}" for r in bad_val))
    if skipped:
        evidence.append(f"the guard skipped {len(skipped)} step(s): " + _list(f"step {r.get('step')}" for r in skipped))
    steps = sorted({r["step"] for r in bad + bad_val} | {r["step"] for r in skipped if _is_int(r.get("step"))})
    return Finding("nonfinite", "serious", "non-finite loss or gradient norm", evidence,
                   "lower train.lr or lengthen train.warmup_steps; prefer bfloat16 to float16; "
                   "keep guard.enabled = true "
                   "so such steps are skipped and rolled back; check the data around these steps", steps)


def check_divergence(records: list[dict]) -> Finding | None:
    """The loss ends far above the best it reached, and stays there."""
    steps, losses = _series(_of(records, "train"), "loss")
    if len(losses) < 2 * DIVERGE_WINDOW:
        return None
    medians = [statistics.median(losses[i - DIVERGE_WINDOW + 1: i + 1]) for i in range(DIVERGE_WINDOW - 1, len(losses))]
    best = min(range(len(medians)), key=medians.__getitem__)
    if medians[-1] <= DIVERGE_RATIO * medians[best]:
        return None
    best_step = steps[best + DIVERGE_WINDOW - 1]
    evidence = [f"median loss {medians[best]:.3f} over the {DIVERGE_WINDOW} logged steps to step {best_step} "
                f"(its best), "
                f"{medians[-1]:.3f} over the last {DIVERGE_WINDOW} to step {steps[-1]} "
                f"({medians[-1] / medians[best]:.2f}x)"]
    return Finding("divergence", "serious", f"loss diverged after step {best_step}", evidence,
                   "resume from a checkpoint before the rise with a lower train.lr (try half) or a tighter "
                   "train.grad_clip; keep guard.enabled = true so spikes roll back", [best_step])


# ----------------------------------------------------------------------------------------------
# Warnings


def check_loss_spikes(records: list[dict], explained: set[int] = frozenset()) -> Finding | None:
    train = _of(records, "train")
    losses = [r.get("loss") for r in train]
    spikes = [i for i in find_spikes(losses, LOSS_SPIKE_RULE) if train[i]["step"] not in explained]
    if not spikes:
        return None
    grad_spikes = set(find_spikes([r.get("grad_norm") for r in train]))
    evidence, led_by_grad = [], 0
    for i in spikes:
        lead = next((k for k in range(GRAD_LEAD_RECORDS + 1) if i - k in grad_spikes), None)
        if lead is None:
            grad = "no grad-norm spike before it"
        else:
            led_by_grad += 1
            g = train[i - lead]
            grad = (f"grad_norm spiked to {g['grad_norm']:.3g} at step {g['step']}"
                    + (f" ({lead} logged step{'s' if lead > 1 else ''} before)" if lead else " (same step)"))
        median = LOSS_SPIKE_RULE.baseline(x for x in losses[:i] if is_finite(x)).median  # what find_spikes judged it by
        evidence.append(f"step {train[i]['step']}: loss {losses[i]:.3f} vs median {median:.3f}; {grad}")
    if len(evidence) > MAX_LISTED:
        evidence = evidence[:MAX_LISTED] + [f"... and {len(evidence) - MAX_LISTED} more"]
    if led_by_grad:
        fix = ("the gradient norm rose first: lower train.lr or lengthen warmup, keep train.grad_clip on; "
               "guard.spike_factor rolls such steps back")
    else:
        fix = "no gradient warning came first: inspect the batches at these steps (corrupt or repeated documents)"
    return Finding("loss_spikes", "warning", f"{len(spikes)} loss spike(s)", evidence, fix,
                   [train[i]["step"] for i in spikes])


def check_clipping(records: list[dict], cfg: Config) -> Finding | None:
    clip = cfg.train.grad_clip
    if clip <= 0:
        return None
    after_warmup = [r for r in _of(records, "train")
                    if r["step"] > cfg.train.warmup_steps and is_finite(r.get("grad_norm"))]
    if len(after_warmup) < CLIP_MIN_RECORDS:
        return None
    clipped = [r for r in after_warmup if r["grad_norm"] > clip]
    if len(clipped) <= CLIP_MOST_FRACTION * len(after_warmup):
        return None
    median = statistics.median(r["grad_norm"] for r in after_warmup)
    evidence = [f"grad_norm > train.grad_clip = {clip:g} on {len(clipped)} of {len(after_warmup)} logged steps after "
                f"warmup (median {median:.3g}), from step {clipped[0]['step']}"]
    return Finding("clipped", "warning", "gradient clipped on most steps: LR likely too high", evidence,
                   f"lower train.lr (now {cfg.train.lr:g}; try half) or lengthen train.warmup_steps; when every step "
                   "is clipped the clip, not the LR, sets the update size", [r["step"] for r in clipped[:1]])


def check_early_plateau(records: list[dict]) -> Finding | None:
    train = [r for r in _of(records, "train") if is_finite(r.get("loss"))]
    n = len(train)
    if n < 2 * PLATEAU_MIN_RECORDS:
        return None
    losses = [r["loss"] for r in train]
    lrs = [r["lr"] for r in train if is_finite(r.get("lr"))]
    peak_lr = max(lrs, default=0.0)
    width = max(PLATEAU_MIN_RECORDS, math.ceil(PLATEAU_WINDOW_FRACTION * n))
    for start in range(0, int(PLATEAU_EARLY_FRACTION * n) + 1):
        end = start + width
        if end > n:
            break
        if not _flat(losses[start:end]):
            continue
        window_lrs = [r["lr"] for r in train[start:end] if is_finite(r.get("lr"))]
        if not window_lrs or statistics.fmean(window_lrs) < PLATEAU_MIN_LR_FRACTION * peak_lr:
            continue
        while end < n and _flat(losses[start:end + 1]):  # how long it lasted
            end += 1
        level = statistics.median(losses[start:end])
        later = min(losses[end:], default=level)
        stuck = level >= (1 - PLATEAU_STUCK) * losses[0]
        if later >= (1 - PLATEAU_LATER_DROP) * level and not stuck:
            continue
        evidence = [f"loss stayed near {level:.3f} from step {train[start]['step']} to step {train[end - 1]['step']} "
                    f"({end - start} logged steps) with mean lr {statistics.fmean(window_lrs):.2e} "
                    f"(peak {peak_lr:.2e})",
                    f"first logged loss {losses[0]:.3f}; best after the plateau {later:.3f}"]
        return Finding("plateau", "warning", f"loss flat early, from step {train[start]['step']}", evidence,
                       "LR too low (raise train.lr), or the data repeats: check the prepared shards and that the "
                       "loader does not replay the same windows (data.order)", [train[start]["step"]])
    return None


def check_overfitting(records: list[dict]) -> Finding | None:
    val = [r for r in _of(records, "val") if is_finite(r.get("val_loss"))]
    if len(val) < OVERFIT_MIN_EVALS + 1:
        return None
    best = min(range(len(val)), key=lambda i: val[i]["val_loss"])
    after = val[best + 1:]
    threshold = (1 + OVERFIT_RISE) * val[best]["val_loss"]
    if len(after) < OVERFIT_MIN_EVALS or not all(r["val_loss"] > threshold for r in after[-OVERFIT_MIN_EVALS:]):
        return None
    train_at_best = _train_loss_near(records, val[best]["step"])
    train_at_end = _train_loss_near(records, val[-1]["step"])
    if train_at_best is None or train_at_end is None or train_at_end >= train_at_best:
        return None  # train rose too: that is divergence, not overfitting
    began = val[best]["step"]
    evidence = [f"val loss {val[best]['val_loss']:.3f} at step {began} (its best), {val[-1]['val_loss']:.3f} at step "
                f"{val[-1]['step']}; train loss fell from {train_at_best:.3f} to {train_at_end:.3f} meanwhile"]
    return Finding("overfitting", "warning", f"val loss rising while train falls: overfitting began after step {began}",
                   evidence, "use more data or fewer epochs (gpt2train plan shows the epochs), raise model.dropout or "
                   "train.weight_decay; the best checkpoint (checkpoint.save_best) holds the model before it", [began])


def check_resume_gap(records: list[dict]) -> Finding | None:
    gaps, last, pending = [], None, None
    for r in records:
        if r["kind"] == "run_start" and _is_int(r.get("step")) and r["step"] > 0 and last is not None:
            pending = (r["step"], last)
        elif r["kind"] == "train" and is_finite(r.get("loss")):
            if pending is not None:
                resumed_at, before = pending
                if r["loss"] > (1 + RESUME_JUMP) * before["loss"]:
                    gaps.append((resumed_at, before, r))
                pending = None
            last = r
    if not gaps:
        return None
    evidence = [f"resumed at step {at}: loss {b['loss']:.3f} at step {b['step']} before, {a['loss']:.3f} at step "
                f"{a['step']} after (+{100 * (a['loss'] / b['loss'] - 1):.0f}%)" for at, b, a in gaps]
    return Finding("resume_gap", "warning", "loss jumped after a resume", evidence,
                   "the resume did not restore the run's state: check that it loaded the newest checkpoint (optimizer, "
                   "LR step and data position included) and that config.toml did not change between launches",
                   [a["step"] for _, _, a in gaps])


# Where to look when tokens/s fell, by the device the run used (run_start's hardware.device).
THROUGHPUT_FIXES = {
    "cuda": "check the input pipeline (data.loader = \"ram\" when the data fits, a faster disk) and the GPU "
            "(thermal or power throttling: nvidia-smi -q -d PERFORMANCE; other jobs on it: nvidia-smi)",
    "cpu": "a CPU run shares its cores with everything else on the machine: look for other processes using them "
           "(top; a load average in uptime above the core count), and for frequency scaling or thermal throttling "
           "(a laptop on battery or hot, a busy VM host); then the input pipeline (data.loader = \"ram\" when "
           "the data fits)",
    "mps": "check what else uses the Mac's GPU (Activity Monitor) and whether it throttles when hot or on "
           "battery; then the input pipeline (data.loader = \"ram\" when the data fits)",
}
THROUGHPUT_FIX_UNKNOWN_DEVICE = ("check the input pipeline (data.loader = \"ram\" when the data fits, a faster disk) "
                                 "and what else ran on the device (other jobs, thermal or power throttling)")


def check_throughput(records: list[dict]) -> Finding | None:
    timed = [r for r in _steady_train(records) if is_finite(r.get("tokens_per_s"))]
    if len(timed) < THROUGHPUT_MIN_RECORDS:
        return None
    q = len(timed) // 4
    first, last = timed[:q], timed[-q:]
    first_speeds = [r["tokens_per_s"] for r in first]
    before = statistics.median(first_speeds)
    after = statistics.median(r["tokens_per_s"] for r in last)
    spread = statistics.median(abs(x - before) for x in first_speeds)  # the MAD: how much single steps vary
    if after >= (1 - THROUGHPUT_DROP) * before or before - after <= THROUGHPUT_NOISE_MADS * spread:
        return None
    device = run_device(records)
    evidence = [f"median tokens/s {before:,.0f} (half the steps within {spread:,.0f} of it) over steps "
                f"{first[0]['step']}-{first[-1]['step']}, {after:,.0f} over steps {last[0]['step']}-{last[-1]['step']} "
                f"({100 * (after / before - 1):.0f}%)" + (f", on {device}" if device else "")]
    fix = THROUGHPUT_FIXES.get(device_type(device), THROUGHPUT_FIX_UNKNOWN_DEVICE)
    return Finding("throughput_drop", "warning", "tokens/s fell during the run", evidence, fix, [last[0]["step"]])


def run_device(records: list[dict]) -> str | None:
    """The device the run's latest launch trained on, as its run_start recorded it ("cpu", "cuda:0"), if it did."""
    starts = _of(records, "run_start")
    device = object_field(starts[-1], "hardware").get("device") if starts else None
    return device if isinstance(device, str) and device else None


def device_type(device: str | None) -> str | None:
    """"cuda:0" -> "cuda"; None stays None."""
    return device.split(":")[0] if device else None


def check_mfu(records: list[dict], expected: float | None = ASSUMED_GPU_MFU,
              source: str = "a tuned GPT-2 run's typical figure") -> Finding | None:
    timed = [r for r in _steady_train(records) if is_finite(r.get("mfu"))]
    if not timed or expected is None:
        return None  # the device's peak is unknown, or no figure to expect (a CPU): nothing to compare with
    mean = statistics.fmean(r["mfu"] for r in timed)
    if mean >= LOW_MFU_FRACTION * expected:
        return None
    starts = _of(records, "run_start")
    device = (object_field(starts[-1], "hardware").get("device_name") if starts else None) or "the device"
    evidence = [f"mean MFU {mean:.3f} over {len(timed)} logged steps on {device}; expected ~{expected:.2f} "
                f"({source})"]
    return Finding("low_mfu", "warning", "MFU far below what the device can do", evidence,
                   "raise train.micro_batch (gpt2train plan checks memory), keep train.compile on, use bfloat16 and "
                   "model.attention = \"sdpa\"; if tokens/s also varies, the data loader is starving the GPU",
                   [timed[0]["step"]])


# ----------------------------------------------------------------------------------------------
# Printing


def format_diagnosis(d: Diagnosis) -> str:
    launches = f"{d.launches} launch{'es' if d.launches != 1 else ''}"
    on = f", on {d.device}" if d.device else ""
    steps = f"{d.train_records} logged train steps to step {d.last_step}" if d.last_step is not None else \
        "no train step logged yet"
    lines = [f"doctor {d.run_dir}: {steps}, {launches}{on}"]
    if d.suite is not None:
        tokens = f", {d.suite['tokens']:,} tokens" if _is_int(d.suite["tokens"]) else ""
        lines.append(f"suite: centered mean {d.suite['centered_mean']:.4f} over {d.suite['tasks']} task"
                     f"{'s' if d.suite['tasks'] != 1 else ''} at step {d.suite['step']:,}{tokens} (the last suite record)")
    lines += [f"note: {n}" for n in d.notes]
    if d.healthy and d.train_records < MIN_TRAIN_RECORDS:
        lines.append(f"no symptom found, but only {d.train_records} logged train steps: too few to judge most rules "
                     f"(they need {MIN_TRAIN_RECORDS}+); run longer or lower log.interval")
    elif d.healthy:
        lines.append("healthy: no symptom found")
    for f in d.findings:
        lines.append(f"{f.severity.upper():8} {f.title}")
        lines += [f"  evidence  {e}" for e in f.evidence]
        lines.append(f"  fix       {f.fix}")
    serious = sum(f.severity == "serious" for f in d.findings)
    lines.append(f"result: {serious} serious, {len(d.findings) - serious} warning(s); exit status {d.exit_status}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Helpers


def _of(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["kind"] == kind]


def _finite_or_absent(x) -> bool:
    return x is None or is_finite(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if is_finite(r.get(key))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _list(items) -> str:
    items = list(items)
    more = f", ... ({len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else ""
    return ", ".join(items[:MAX_LISTED]) + more


def _flat(losses: list[float]) -> bool:
    q = max(1, len(losses) // 4)
    a, b = statistics.median(losses[:q]), statistics.median(losses[-q:])
    return abs(b - a) < PLATEAU_MAX_CHANGE * abs(a)


def _train_loss_near(records: list[dict], step: int) -> float | None:
    """Median of the DIVERGE_WINDOW logged train losses up to a step: a noise-free train loss there."""
    _, losses = _series([r for r in _of(records, "train") if r["step"] <= step], "loss")
    return statistics.median(losses[-DIVERGE_WINDOW:]) if losses else None


def _steady_train(records: list[dict]) -> list[dict]:
    """Train records whose speed is the run's: not the first compiled step (it includes compilation),
    nor the first logged step of a launch (cold caches and allocator)."""
    steady, first_of_launch = [], True
    for r in records:
        if r["kind"] == "run_start":
            first_of_launch = True
        elif r["kind"] == "train":
            if not first_of_launch and not r.get("compile_ms"):
                steady.append(r)
            first_of_launch = False
    return steady


def _steps_explained(records: list[dict], divergence: Finding | None, resume: Finding | None) -> set[int]:
    """Steps whose loss spikes another finding already explains: all after a divergence began, and the
    first few logged steps after a resume that jumped."""
    steps = [r["step"] for r in _of(records, "train")]
    explained: set[int] = set()
    if divergence is not None:
        explained |= {s for s in steps if s > divergence.steps[0]}
    if resume is not None:
        for first in resume.steps:
            after = [s for s in steps if s >= first]
            explained |= set(after[:RESUME_SETTLE_RECORDS])
    return explained
