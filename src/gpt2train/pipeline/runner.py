"""Running a pipeline, stage by stage, resumably. Before a stage runs, it is asked whether it is done already: its
record (OUT/.pipeline/STAGE.json) says it finished, from the same fingerprint (its command, the preset or file of
its config, the fingerprints of the stages it reads, the size and time of any file of the user's it reads), and
its output is there. Then it is skipped, and said so. Otherwise:
  - a record of the same fingerprint that never finished: the stage was interrupted; it runs again, and a train
    stage (always --resume auto) continues from its last checkpoint;
  - no record, or another fingerprint (a setting changed, or an input): what it wrote before is moved aside to
    OUT/.pipeline/replaced/ (never reused, never deleted) and it runs afresh; the stages after it then differ in
    fingerprint too, and run again.
A stage runs its command in this process, as `gpt2train COMMAND ...` would. Under torchrun every rank runs the
pipeline: train and eval stages on every rank (they are torchrun's), any other on rank 0 while the others wait
for its record.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpt2train.files import write_json_atomic
from gpt2train.pipeline.definition import Pipeline, Stage, inside
from gpt2train.training.signals import exit_status
from gpt2train.units import format_duration

STATE_DIR = ".pipeline"
DISTRIBUTED_COMMANDS = ("train", "eval")  # run on every rank under torchrun
STOPPED_BY_SIGNAL = tuple(exit_status(s) for s in (signal.SIGINT, signal.SIGTERM))  # a train stage saved first
WAIT_POLL_S = 1.0
CLOCK_SKEW_S = 5.0  # between the ranks' clocks: rank 0's record of this run may seem that much older


@dataclass
class StageRecord:
    """What OUT/.pipeline/STAGE.json holds: whether the stage finished, from which fingerprint, in how long, and
    what it measured (the report card's numbers)."""

    fingerprint: str
    status: str  # "running" (or killed while it ran), "done", "stopped" (by a signal) or "failed"
    started: float  # time.time() when it began
    seconds: float | None = None
    measured: dict = field(default_factory=dict)


@dataclass
class Outcome:
    stage: Stage
    record: StageRecord
    skipped: bool  # done before, from the same fingerprint


def record_path(pipeline: Pipeline, stage: Stage) -> Path:
    return pipeline.out / STATE_DIR / f"{stage.name}.json"


def read_record(path: Path) -> StageRecord | None:
    try:
        return StageRecord(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # none yet, or unreadable: the stage runs
        return None


def write_record(path: Path, record: StageRecord) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, asdict(record))


def fingerprint(stage: Stage, earlier: dict[str, str], out: Path) -> str:
    """What makes a stage's output what it is: its command, its config's text (a train stage's preset or file),
    the fingerprints of the stages whose outputs it reads, and the size and time of each file of the user's it
    reads (outside the pipeline's folder)."""
    parts: dict = {"argv": stage.argv, "after": {name: earlier[name] for name in stage.after}}
    if stage.argv[0] == "train" and stage.args.config:
        from gpt2train.config import read_config_text

        parts["config"] = read_config_text(stage.args.config)[1]
    parts["files"] = [signature(read) for read in stage.reads if not inside(read, out)]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def signature(path: Path) -> list:
    """A path's files as (name, size, modification time): a changed file changes it."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files if p.exists()]


def is_done(stage: Stage, record: StageRecord | None, fp: str) -> bool:
    """Finished, from this fingerprint, its output still there."""
    if record is None or record.status != "done" or record.fingerprint != fp:
        return False
    made = stage.writes if stage.writes is not None else Path(record.measured.get("eval_json", ""))
    return made.exists()


@dataclass
class Runner:
    """Runs a pipeline's stages: run_command(argv) -> exit status (the CLI's main); say(line) prints."""

    pipeline: Pipeline
    run_command: Callable[[list[str]], int]
    say: Callable[[str], None] = print
    rank: int = 0
    continue_command: str = "gpt2train pipeline"
    outcomes: list[Outcome] = field(default_factory=list)
    since: float = field(default_factory=time.time)  # this run's start: an older record is an earlier run's

    def run(self) -> int:
        """Every stage in order; the first that fails (or is stopped) ends the pipeline with its exit status."""
        fingerprints: dict[str, str] = {}
        for stage in self.pipeline.stages:
            fp = fingerprints[stage.name] = fingerprint(stage, fingerprints, self.pipeline.out)
            try:
                status = self.run_stage(stage, fp)
            except KeyboardInterrupt:
                status = 130
            if status:
                self.say(f"pipeline stopped at stage {stage.name} (exit status {status}); finished stages are kept: "
                         f"continue with {self.continue_command}")
                return status
        return 0

    def run_stage(self, stage: Stage, fp: str) -> int:
        path = record_path(self.pipeline, stage)
        record = read_record(path)
        if is_done(stage, record, fp):
            self.say(f"stage {stage.name}: done ({format_duration(record.seconds or 0)}), skipped: its settings and "
                     "inputs are unchanged")
            self.outcomes.append(Outcome(stage, record, skipped=True))
            return 0
        mine = self.rank == 0 or stage.argv[0] in DISTRIBUTED_COMMANDS
        began = time.time()
        if self.rank == 0:
            self.prepare_to_run(stage, record, fp)
            write_record(path, StageRecord(fp, "running", began))
        self.say(f"stage {stage.name}: {stage.line}")
        started = time.monotonic()
        status = self.run_command(list(stage.argv)) if mine else self.wait_for_rank_0(path, fp)
        if self.rank != 0:
            return status
        if status:
            ended = "stopped" if status in STOPPED_BY_SIGNAL else "failed"
            write_record(path, StageRecord(fp, ended, began, time.monotonic() - started))
            return status
        from gpt2train.pipeline.measure import measure

        seconds = time.monotonic() - started  # the command's own time, not the measuring after it
        done = StageRecord(fp, "done", began, seconds, measure(stage))
        write_record(path, done)
        self.outcomes.append(Outcome(stage, done, skipped=False))
        return 0

    def prepare_to_run(self, stage: Stage, record: StageRecord | None, fp: str) -> None:
        """Interrupted (same fingerprint): run it again, as it is. Otherwise what it wrote before is set aside."""
        if record is not None and record.fingerprint == fp and record.status != "done":
            why = {"running": "was interrupted", "stopped": "was stopped"}.get(record.status, "failed")
            self.say(f"stage {stage.name}: it {why}; running it again (a train stage resumes from its last "
                     "checkpoint)")
            return
        if stage.writes is None or not stage.writes.exists():
            return
        aside = self.pipeline.out / STATE_DIR / "replaced" / f"{stage.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(stage.writes), str(aside))
        why = "it has no record of the pipeline's" if record is None else "its settings or inputs changed"
        self.say(f"stage {stage.name}: {stage.writes} was made otherwise ({why}): moved to {aside}; making it again")

    def wait_for_rank_0(self, path: Path, fp: str) -> int:
        """Another rank's turn at a stage rank 0 alone runs: wait for its record to say done (0) or failed (1)."""
        while True:
            record = read_record(path)
            ended = record is not None and record.status in ("done", "failed", "stopped")
            if ended and record.fingerprint == fp and record.started >= self.since - CLOCK_SKEW_S:
                return 0 if record.status == "done" else 1
            time.sleep(WAIT_POLL_S)
