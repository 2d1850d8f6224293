"""The run log, RUN_DIR/metrics.jsonl, and nothing else: its schema, its writer and its reader.

The trainer writes through MetricsLogger; report and doctor read through load_run / load_metrics and
share the numbers derived from the records (summarize; find_spikes, by spikes.py's rule). The schema, with
what each field means and when each kind is written, is docs/metrics.md; the constants below name the same
things.

Reading is forgiving (a run in progress, a line cut short by a crash, kinds from a newer version),
because the log is most wanted exactly when a run went wrong. This module sits low: the trainer
imports it, so it imports nothing from training/, report, doctor, plan or bench.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from gpt2train.spikes import SPIKE_RULE, SpikeRule

# ----------------------------------------------------------------------------------------------
# Schema (docs/metrics.md)

METRICS_FILE = "metrics.jsonl"

RUN_START = "run_start"
TRAIN = "train"
VAL = "val"
HELLASWAG = "hellaswag"
SUITE = "suite"
SAMPLE = "sample"
GUARD = "guard"
CHECKPOINT = "checkpoint"
AVERAGE = "average"
RUN_END = "run_end"
KNOWN_KINDS = (RUN_START, TRAIN, VAL, HELLASWAG, SUITE, SAMPLE, GUARD, CHECKPOINT, AVERAGE, RUN_END)
# Kinds that describe the state of training at a step. A resume or a rollback re-does steps, and
# the re-done records replace these. The other kinds are events (a launch, a guard action, a save):
# they stay, since they are the history a reader lists.
SERIES_KINDS = (TRAIN, VAL, HELLASWAG, SUITE, SAMPLE)

COMMON_FIELDS = ("kind", "time")  # on every record; time is Unix seconds
# The other fields of each kind. Some are null or only sometimes there (docs/metrics.md says when).
FIELDS: dict[str, tuple[str, ...]] = {
    RUN_START: ("step", "config", "runtime", "hardware", "git", "version", "params", "params_non_embedding",
                "flops_per_token", "peak_flops", "mfu_basis", "resumed_from"),
    TRAIN: ("step", "tokens", "loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "mfu", "peak_mem_mb",
            "compile_ms", "assistant_tokens"),
    VAL: ("step", "tokens", "val_loss", "val_ppl", "val_bpb", "sources"),
    HELLASWAG: ("step", "acc", "acc_norm", "n", "source"),
    SUITE: ("step", "tokens", "centered_mean", "tasks"),
    SAMPLE: ("step", "prompt", "text"),
    GUARD: ("step", "action", "reason", "loss", "grad_norm", "to_step"),
    CHECKPOINT: ("step", "path", "best"),
    AVERAGE: ("step", "steps", "blend"),
    RUN_END: ("step", "tokens", "wall_s", "reason", "error"),
}
SUITE_TASK_FIELDS = ("acc", "centered", "n")  # each task's, under a suite record's "tasks"
# Fields that hold {name: {field: number}}: the mirrors get each number as KIND/PREFIXNAME/FIELD.
NESTED_SCALARS = {"sources": "sources/", "tasks": ""}  # val/sources/FOLDER/val_loss, suite/TASK/acc
HARDWARE_FIELDS = ("device", "device_name", "torch", "world_size", "cuda")  # run_start's "hardware"
# run_start's "runtime" (also in each checkpoint's meta.json): what the config's "auto"s resolved to. Absent
# from logs written before it was recorded.
RUNTIME_FIELDS = ("dtype", "compile", "device")

TRAIN_HINT = "train first with `gpt2train train ...`"


class RunLogError(ValueError):
    """A run log that cannot be read; the message is one line saying what to fix."""


# ----------------------------------------------------------------------------------------------
# Writing


class MetricsLogger:
    """Writes records to RUN_DIR/metrics.jsonl (one flushed line each) and mirrors scalars to TensorBoard
    and W&B when enabled. Only rank 0 builds an active logger.

    A launch that resumes re-does the steps from `start_step` on, as does a rollback (redo_from). The
    JSONL file keeps every line and its reader merges them; the mirrors are told instead: TensorBoard
    hides its events from the re-done step on (purge_step), and W&B, whose history only moves forward,
    is sent no step below the highest it has (docs/metrics.md, "Across resume and rollback")."""

    def __init__(self, run_dir: Path | None, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str = "gpt2train", wandb_mode: str = "offline", config: dict | None = None,
                 start_step: int = 1, wandb_run_id: str | None = None):
        self.active = run_dir is not None
        self.file = self.tb = self.wandb = None
        self.wandb_run_id = wandb_run_id  # kept for the checkpoints even when W&B is off in this launch
        if not self.active:
            return
        self.run_dir = Path(run_dir)
        # Line-buffered: each record reaches the file as it is logged, so a run in progress can be read.
        self.file = open(self.run_dir / METRICS_FILE, "a", buffering=1)
        if tensorboard:
            self._open_tensorboard(start_step)
            if config is not None:
                # At the launch's first step, so that a relaunch from the same step replaces it.
                self.tb.add_text("config", _as_markdown_code(json.dumps(config, indent=2)), start_step)
        if wandb and wandb_mode != "disabled":
            self._open_wandb(wandb_project, wandb_mode, config)

    def _open_tensorboard(self, purge_step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError("log.tensorboard = true needs TensorBoard: pip install tensorboard") from None
        # purge_step writes a restart marker: TensorBoard then hides the events of earlier writers at
        # that step and after, so re-done steps are shown once, with the values of the redo.
        self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)

    def _open_wandb(self, project: str, mode: str, config: dict | None):
        try:
            import wandb as wandb_lib
        except ImportError:
            raise ImportError("log.wandb = true needs Weights & Biases: pip install wandb") from None
        # One W&B run per run directory: the id is made once, saved in every checkpoint, and a resumed
        # launch passes it back, so W&B continues that run instead of starting another.
        self.wandb_run_id = self.wandb_run_id or secrets.token_hex(8)
        self.wandb = wandb_lib.init(project=project, mode=mode, dir=str(self.run_dir), name=self.run_dir.name,
                                    id=self.wandb_run_id, resume="allow")
        if config is not None:
            self.wandb.config.update(config, allow_val_change=True)  # a resume may change e.g. micro_batch
        self._wandb_step = self.wandb.step  # online, after a resume: the last step W&B already holds
        self._wandb_samples: list[list] = []

    def log(self, kind: str, **fields):
        if not self.active:
            return
        record = {"kind": kind, "time": time.time(), **fields}
        self.file.write(json.dumps(record) + "\n")
        step = fields.get("step")
        if step is None:
            return
        scalars = {f"{kind}/{k}": v for k, v in fields.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        for key, prefix in NESTED_SCALARS.items():
            for name, each in (fields.get(key) or {}).items():
                scalars.update({f"{kind}/{prefix}{name}/{k}": v for k, v in each.items()
                                if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            if kind == SAMPLE:
                self.tb.add_text(f"sample/{_tag(fields.get('prompt', ''))}",
                                 _as_markdown_code(f"{fields.get('prompt', '')}{fields.get('text', '')}"), step)
        if self.wandb is not None:
            self._log_wandb(kind, step, scalars, fields)

    def _log_wandb(self, kind: str, step: int, scalars: dict, fields: dict):
        # W&B refuses a step below its last one (with a warning each time); a re-done step keeps the
        # values W&B got first. metrics.jsonl and TensorBoard hold the redo's.
        if step < self._wandb_step:
            return
        self._wandb_step = step
        if kind == SAMPLE:
            import wandb as wandb_lib

            # A table is logged whole: each sample step logs all the samples so far.
            self._wandb_samples.append([step, fields.get("prompt"), fields.get("text")])
            scalars = {**scalars, "samples": wandb_lib.Table(columns=["step", "prompt", "text"],
                                                             data=list(self._wandb_samples))}
        if scalars:
            self.wandb.log(scalars, step=step)

    def redo_from(self, step: int):
        """Training continues at `step` again (a guard rollback): TensorBoard hides what it holds from
        `step` on. W&B is left alone; it drops the lower steps itself (see _log_wandb)."""
        if not self.active or self.tb is None:
            return
        self.tb.close()
        self._open_tensorboard(step)

    def close(self):
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


def _as_markdown_code(text: str) -> str:
    """TensorBoard renders text as Markdown: indented, it shows as written (line breaks and all)."""
    return "\n".join("    " + line for line in text.splitlines())


def _tag(text: str) -> str:
    """A short TensorBoard tag from a sample's prompt: word characters only."""
    return re.sub(r"\W+", "_", text).strip("_")[:40] or "empty"


# ----------------------------------------------------------------------------------------------
# Reading


@dataclass
class Run:
    """One run directory's records, merged across its launches."""

    name: str  # label in legends and tables
    path: Path
    records: list[dict]  # after merging relaunches, in file order
    launches: list[list[dict]]  # raw records grouped by run_start, before merging: for wall time
    malformed_lines: int = 0  # unreadable lines in the middle of the file, skipped
    truncated_last_line: bool = False  # the last line did not parse: a crash cut it short, or a write in progress

    def of(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["kind"] == kind]


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The known records of RUN_DIR/metrics.jsonl, with re-done steps replacing the earlier ones.

    Raises RunLogError when the directory or file is missing, empty, or holds no readable record.
    """
    return load_run(run_dir).records


def load_run(run_dir: str | Path, name: str | None = None) -> Run:
    """Read RUN_DIR/metrics.jsonl into a Run; RunLogError (one line) when there is nothing to read."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not run_dir.exists():
        raise RunLogError(f"run directory {run_dir} does not exist: pass a folder written by `gpt2train train`")
    if not run_dir.is_dir():
        raise RunLogError(f"{run_dir} is a file, not a run directory: pass the folder that holds {METRICS_FILE}")
    if not path.is_file():
        raise RunLogError(f"{path} not found: is {run_dir} a run directory? {TRAIN_HINT}")
    text = path.read_bytes().decode("utf-8", errors="replace")  # a crash can cut a character in two
    if not text.strip():
        raise RunLogError(f"{path} is empty: {TRAIN_HINT}")
    return read_run(text, run_dir, name)


def logs_a_trained_step(run_dir: str | Path) -> bool:
    """Whether RUN_DIR/metrics.jsonl records a trained step (a `train` record; a launch logs its first step
    always). Read up to the first one; a missing file, or launches that failed before their first step, say no."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if _is_record(rec) and rec["kind"] == TRAIN:
                return True
    return False


def read_run(text: str, run_dir: str | Path, name: str | None = None) -> Run:
    """A Run from the text of RUN_DIR's metrics.jsonl (load_run without the file checks)."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    raw, malformed, truncated = _parse_lines(text)
    if not raw:
        raise RunLogError(
            f"{path} has no readable records: it is not a gpt2train metrics file, or every line is damaged"
        )
    if malformed:
        # a warning, so that the CLI prints it as its other warnings (`warning: ...`, one line)
        warnings.warn(f"{path}: skipped {malformed} malformed line{'' if malformed == 1 else 's'}", stacklevel=2)
    return Run(
        name=name or run_dir.resolve().name,
        path=run_dir,
        records=merge_relaunches(raw),
        launches=_split_launches(raw),
        malformed_lines=malformed,
        truncated_last_line=truncated,
    )


def _parse_lines(text: str) -> tuple[list[dict], int, bool]:
    """(records of known kinds, malformed lines before the last, whether the last line failed)."""
    lines = [line for line in text.splitlines() if line.strip()]
    records, malformed, truncated = [], 0, False
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if not _is_record(rec):
            if i == len(lines) - 1:
                truncated = True  # expected after a crash: not worth a warning
            else:
                malformed += 1
            continue
        if rec["kind"] in KNOWN_KINDS:  # kinds from a newer version are skipped, as the schema asks
            records.append(rec)
    return records, malformed, truncated


def _is_record(rec) -> bool:
    if not isinstance(rec, dict) or not isinstance(rec.get("kind"), str):
        return False
    # A series record is only usable at a step; an event may lack one.
    return rec["kind"] not in SERIES_KINDS or is_int(rec.get("step"))


def merge_relaunches(records: list[dict]) -> list[dict]:
    """Drop series records that a later launch or rollback re-did; the later record for a step wins.

    A `run_start` at step s (a resume) re-does steps s and on; a guard rollback to step t re-does t+1
    and on. Series records from those steps, written before, describe training that was thrown away.
    """
    kept: list[dict] = []
    for rec in records:
        redo_from = None
        if rec["kind"] == RUN_START and is_int(rec.get("step")):
            redo_from = rec["step"]
        elif rec["kind"] == GUARD and rec.get("action") == "rollback" and is_int(rec.get("to_step")):
            redo_from = rec["to_step"] + 1
        if redo_from is not None:
            kept = [r for r in kept if not (r["kind"] in SERIES_KINDS and r["step"] >= redo_from)]
        kept.append(rec)

    # Two records of one kind at one step without a relaunch between them (a val at the last step
    # that is also an eval step, say): the later one wins.
    last = {(r["kind"], r["step"]): i for i, r in enumerate(kept) if r["kind"] in SERIES_KINDS}
    return [r for i, r in enumerate(kept) if r["kind"] not in SERIES_KINDS or last[(r["kind"], r["step"])] == i]


def _split_launches(records: list[dict]) -> list[list[dict]]:
    launches: list[list[dict]] = []
    for rec in records:
        if rec["kind"] == RUN_START or not launches:
            launches.append([])
        launches[-1].append(rec)
    return launches


# Field values come from JSON written by any version, so readers check a value's type before use.


def is_int(x) -> bool:
    """An integer field (a step), not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_finite(x) -> bool:
    """A number that can be plotted or averaged: not a bool, NaN or infinity (a diverged loss is NaN)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def object_field(rec: dict, key: str) -> dict:
    """rec[key] where it is a JSON object (a run_start's config, hardware, runtime), else {}: absent from an older
    log, or of another type in a damaged one."""
    value = rec.get(key)
    return value if isinstance(value, dict) else {}


def config_value(config: dict, section: str, key: str):
    """config[section][key] of a run_start's config, or None where either is absent."""
    sub = config.get(section)
    return sub.get(key) if isinstance(sub, dict) else None


def ran_and_asked(ran, asked) -> str:
    """A setting the trainer resolves (dtype, compile, device), as the report and `ckpt inspect` show it: what
    ran, with what the config asked beside it where they differ ("bfloat16 (asked: auto)"); where the run did
    not record what ran (a log or checkpoint from before the record), what was asked, said so."""
    if ran is None:
        return f"{setting_text(asked)} (asked; what ran is not recorded)"
    ran, asked = setting_text(ran), setting_text(asked)
    return ran if ran == asked else f"{ran} (asked: {asked})"


def setting_text(value) -> str:
    """A setting as printed: on/off for a bool (compile), ? where absent, else as it is."""
    if value is None:
        return "?"
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


# ----------------------------------------------------------------------------------------------
# Derived numbers (report and doctor)


def summarize(run: Run) -> dict:
    """The per-run numbers of the report's table (and of its metrics.json)."""
    train, val = run.of(TRAIN), run.of(VAL)
    starts = run.of(RUN_START)
    start = starts[-1] if starts else {}  # the latest launch has the config now in force
    cfg, hw, ran = object_field(start, "config"), object_field(start, "hardware"), object_field(start, "runtime")

    best = min((r for r in val if is_finite(r.get("val_loss"))), key=lambda r: r["val_loss"], default=None)
    suite = [r for r in run.of(SUITE) if is_finite(r.get("centered_mean"))]
    # The first compiled step includes compilation: its speed says nothing about the run's.
    timed = [r for r in train if not r.get("compile_ms")]
    series = [r for r in run.records if r["kind"] in SERIES_KINDS]
    with_tokens = [r for r in series if is_int(r.get("tokens"))]
    seq_len = config_value(cfg, "train", "seq_len") or config_value(cfg, "model", "block_size")

    return {
        "run": run.name,
        "path": str(run.path),
        "status": _status(run),
        "steps": series[-1]["step"] if series else None,
        "tokens": with_tokens[-1]["tokens"] if with_tokens else None,
        "wall_s": _wall_seconds(run),
        "best_val_loss": best["val_loss"] if best else None,
        "best_val_bpb": best.get("val_bpb") if best else None,  # absent from runs logged before it existed
        "best_val_sources": _sources_at(best),
        "best_val_step": best["step"] if best else None,
        "last_train_loss": train[-1].get("loss") if train else None,
        "suite_centered_mean": suite[-1]["centered_mean"] if suite else None,  # the last suite record's (eval.tasks)
        "suite_step": suite[-1]["step"] if suite else None,
        "mean_tokens_per_s": _mean(r.get("tokens_per_s") for r in timed),
        "mean_mfu": _mean(r.get("mfu") for r in timed),
        "peak_mem_mb": max((r["peak_mem_mb"] for r in train if is_finite(r.get("peak_mem_mb"))), default=None),
        "params": start.get("params"),
        "n_layer": config_value(cfg, "model", "n_layer"),
        "n_head": config_value(cfg, "model", "n_head"),
        "n_embd": config_value(cfg, "model", "n_embd"),
        "micro_batch": config_value(cfg, "train", "micro_batch"),
        "seq_len": seq_len,
        "lr": config_value(cfg, "train", "lr"),
        "schedule": config_value(cfg, "train", "schedule"),
        "dtype": config_value(cfg, "train", "dtype"),  # as asked ("auto"); what ran is dtype_ran
        "dtype_ran": ran.get("dtype"),  # None in logs from before run_start recorded it
        "compile": config_value(cfg, "train", "compile"),
        "compile_ran": ran.get("compile"),
        "device_name": hw.get("device_name") or hw.get("device"),  # what ran
        "device_asked": config_value(cfg, "train", "device"),
        "torch": hw.get("torch"),
        "world_size": hw.get("world_size"),
        "git": start.get("git"),
        "launches": len(starts),
        "guard_events": len(run.of(GUARD)),
        "malformed_lines": run.malformed_lines,
    }


def _status(run: Run) -> str:
    last = run.launches[-1]
    ends = [r for r in last if r["kind"] == RUN_END]
    if not ends:
        return "in progress (or stopped without a run_end record)"
    return str(ends[-1].get("reason", "ended"))


def _wall_seconds(run: Run) -> float | None:
    """Wall time summed over launches; a launch without run_end counts up to its last record."""
    total, known = 0.0, False
    for launch in run.launches:
        ends = [r for r in launch if r["kind"] == RUN_END and is_finite(r.get("wall_s"))]
        times = [r["time"] for r in launch if is_finite(r.get("time"))]
        if ends:
            total += ends[-1]["wall_s"]
        elif len(times) >= 2:
            total += max(0.0, max(times) - times[0])  # clocks can step back; time spent cannot
        else:
            continue
        known = True
    return total if known else None


def _sources_at(val: dict | None) -> dict | None:
    """A mixture's {folder: {"val_loss", "val_bpb"}} of a val record (non-finite values as None); None without."""
    sources = val.get("sources") if val else None
    if not isinstance(sources, dict):
        return None
    return {str(name): {key: (each.get(key) if is_finite(each.get(key)) else None) for key in ("val_loss", "val_bpb")}
            for name, each in sources.items() if isinstance(each, dict)}


def _mean(values) -> float | None:
    vals = [v for v in values if is_finite(v)]
    return sum(vals) / len(vals) if vals else None


def find_spikes(values: list, rule: SpikeRule = SPIKE_RULE) -> list[int]:
    """Indices of the spikes in a logged series by spikes.py's rule (LOSS_SPIKE_RULE for losses, the guard's
    too), each value judged against
    the finite values logged before it. Non-finite values and nulls are not spikes here: the guard reports
    those. A spike stays among the values the next ones are judged against: a logged step stood (the record of
    a step the guard rolled back is replaced by its redo)."""
    spikes, before = [], deque(maxlen=rule.window)
    for i, v in enumerate(values):
        if not is_finite(v):
            continue
        if rule.is_spike(v, before):
            spikes.append(i)
        before.append(v)
    return spikes
