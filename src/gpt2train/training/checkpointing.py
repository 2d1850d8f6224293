"""The trainer's checkpoint management: resume, periodic and best saves, and rollback after a guard verdict.

The files and their atomicity are checkpoint/format.py's, the training state and the resume checks
checkpoint/state.py's; this component decides when to save, and collects what goes in from the components it
is handed (name -> an object with state_dict / load_state_dict: the model, the optimizer, the scaler, the
guard, the run's counters, every rank's RNG and train-loader position, the loggers' continuity, the weight
average), so that a resumed run continues exactly as if never stopped. It knows where each one's state lies in
a checkpoint (the tables below), none of their fields.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from gpt2train import distributed as D
from gpt2train.checkpoint import (
    CheckpointError,
    check_resume,
    load_training_checkpoint,
    newest_checkpoint,
    point_latest,
    read_meta,
    recover,
    resolve_verified,
    ring_entries,
    run_on_disk,
    save_training_checkpoint,
    set_aside_newer,
)
from gpt2train.config import Config, to_dict
from gpt2train.ranges import UsageError
from gpt2train.training.guard import GuardError


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


# Where each component's state lies in a checkpoint: the layout checkpoints have always had, so older ones load.
WEIGHTS = ("model", "optimizer")  # the on-disk format's own: safetensors + state.pt["optimizer"], or DCP shards
IN_META = ("position", "run", "logger")  # plain values at meta.json's top level, readable without torch
PER_RANK = ("rng", "loader")  # state.pt["ranks"][rank][name], every rank's own; the rest: state.pt[name], rank 0's
SAME_ON_EVERY_RANK = ("loader",)  # so a rank the checkpoint did not have takes rank 0's (its RNG stays seeded)
REWOUND = ("model", "optimizer", "scaler", "position", "average")  # what a rollback reloads; the rest moves forward


@dataclass
class RunState:
    """The run's counters. Its state dict is what meta.json records of them; its `position` (step and tokens)
    is a component of its own, the part a rollback rewinds with the weights."""

    step: int = 0  # optimizer steps done
    tokens: int = 0
    best_val: float = math.inf
    val_loss: float | None = None  # the latest validation loss
    wall_before: float = 0.0  # training wall seconds of earlier launches
    launch_start: float = field(default_factory=time.time)
    resumed_from: str | None = None

    def wall_seconds(self) -> float:
        return self.wall_before + (time.time() - self.launch_start)

    def state_dict(self) -> dict:
        return {"val_loss": self.val_loss, "best_val_loss": None if math.isinf(self.best_val) else self.best_val,
                "train_wall_s": self.wall_seconds()}

    def load_state_dict(self, state: dict) -> None:
        self.val_loss = state.get("val_loss")
        self.best_val = float(state.get("best_val_loss") or math.inf)
        self.wall_before = float(state.get("train_wall_s") or 0.0)

    @property
    def position(self) -> RunPosition:
        return RunPosition(self)


@dataclass
class RunPosition:
    """Where the run is (optimizer steps done, tokens seen), as a component: a view of its RunState."""

    run: RunState

    def state_dict(self) -> dict:
        return {"step": self.run.step, "tokens": self.run.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.run.step, self.run.tokens = int(state["step"]), int(state["tokens"])


class RunExists(UsageError):
    """The run directory already holds a run, and the launch did not ask to resume it."""


def check_resume_argument(resume, none_ok: bool = False) -> None:
    """resume=True from Python would fail inside pathlib: say what it takes."""
    if not (isinstance(resume, (str, os.PathLike)) or none_ok and resume is None):
        raise TypeError(f"resume is 'auto' or a checkpoint path, not {resume!r}")


def refuse_to_start_over(run_dir: Path, resume: str | None) -> None:
    """The one rule for every launch, CLI and Python: a launch that does not resume the run in its directory
    (no resume, or another run's checkpoint) never starts over it: its checkpoints, best/ and log would be
    replaced or mixed with a second history."""
    check_resume_argument(resume, none_ok=True)  # the first look at it; a refusal takes back a folder just made
    if resume == "auto" or (resume and Path(resume).resolve().is_relative_to(run_dir.resolve())):
        return  # the run itself goes on
    if resume and not Path(resume).exists():
        return  # nothing to mix: the resume itself fails, naming the missing path
    held = run_on_disk(run_dir)
    if held and resume:  # another run's checkpoint would write a second history into this one
        raise RunExists(f"{run_dir} already holds a run ({held}); resuming {resume} there would mix two runs: pass "
                        "another --out to branch from it, or --resume auto to continue the run already there")
    if held:
        raise RunExists(f"{run_dir} already holds a run ({held}); continue it with --resume auto (resume='auto' in "
                        "Python), or pass another --out to start a new run")


class Checkpointer:
    def __init__(self, cfg: Config, run_dir: Path | None, dist: D.DistInfo, batch: dict,
                 components: dict[str, Stateful], facts: dict):
        """`batch`: this launch's batch_layout; `components`: what a checkpoint holds, named as the tables above place them;
        `facts`: what every checkpoint records of the run besides (tokenizer, parameter count, runtime)."""
        self.cfg, self.run_dir, self.dist, self.batch = cfg, run_dir, dist, batch
        self.components, self.facts = components, facts
        self.sharded = cfg.train.distributed == "fsdp" and dist.enabled  # DCP checkpoints
        self.last_save = time.time()

    # --- when ------------------------------------------------------------------------------------
    def minutes_due(self) -> bool:
        minutes = self.cfg.checkpoint.every_minutes
        return bool(minutes and time.time() - self.last_save >= 60 * minutes)

    def regular_due(self, step: int, last: bool, minutes_due: bool, stop: bool) -> bool:
        """A save into the ring: every every_steps, every every_minutes, at the end, or before a stop."""
        every = self.cfg.checkpoint.every_steps
        return bool(every and step % every == 0) or minutes_due or (last and self.cfg.checkpoint.save_final) or stop

    # --- resume ----------------------------------------------------------------------------------
    def resume(self, resume: str) -> Path | None:
        """`auto`: the newest good checkpoint of the run directory, or a fresh start when there is none;
        otherwise a run directory (its newest good checkpoint) or a checkpoint folder. Returns the checkpoint."""
        check_resume_argument(resume)
        if resume == "auto":
            if self.run_dir is None:
                return None
            if self.dist.is_main:
                recover(self.run_dir / "checkpoints")  # undo what a crash mid-save left behind
            D.barrier()
            ckpt = newest_checkpoint(self.run_dir, warn=self.dist.is_main)
            if ckpt is None:
                if ring_entries(self.run_dir / "checkpoints"):  # never silently start over a damaged run
                    raise CheckpointError(f"every checkpoint in {self.run_dir / 'checkpoints'} is damaged; move them "
                                          "away to start fresh, or resume from a copy with --resume PATH")
                return None
            if self.dist.is_main:
                # Damaged newer checkpoints leave the ring, and `latest` names the one resumed from (a crash
                # between publishing a checkpoint and moving `latest` leaves it behind).
                for name in set_aside_newer(ckpt.parent, int(read_meta(ckpt)["step"])):
                    print(f"warning: moved damaged {name} aside to .damaged-{name}", file=sys.stderr)
                point_latest(ckpt.parent, ckpt.name)
            D.barrier()
        else:
            ckpt, _ = resolve_verified(resume)
            if self.run_dir is not None and ckpt.parent.resolve() == (self.run_dir / "checkpoints").resolve():
                self.abandon_newer(ckpt)
        self.load(ckpt, restore_data=True, verified=True)
        return ckpt

    def abandon_newer(self, ckpt: Path) -> None:
        """Resumed from an older checkpoint of this run: its newer ones leave the ring now, kept aside, and
        `latest` names the resumed one, so that a crash before the first save resumes this timeline again
        (`--resume auto` took the newest, of the timeline left)."""
        if self.dist.is_main:
            for name in set_aside_newer(ckpt.parent, int(read_meta(ckpt)["step"]), why="abandoned"):
                print(f"note: {name} is of the timeline this resume leaves; moved aside to "
                      f"{ckpt.parent / ('.abandoned-' + name)} (delete it to free the space)", file=sys.stderr)
            point_latest(ckpt.parent, ckpt.name)
        D.barrier()

    def load(self, ckpt: Path, restore_data: bool, verified: bool = False) -> dict:
        """Load a checkpoint into the live run. `restore_data` (resume): every component; a rollback reloads only
        the REWOUND ones and leaves the rest (the data, the guard's counters) moving forward, so that the bad
        batches are not replayed; a component with a `rewind(state)` takes back the part that belongs to the
        weights (the guard: the losses it judges against). `verified`: the caller has just checked its files (not
        again: a read of each)."""
        meta = read_meta(ckpt)
        note = check_resume(ckpt, meta, to_dict(self.cfg), self.batch if restore_data else None)
        if note and self.dist.is_main:
            print(note, file=sys.stderr)
        saved, meta = load_training_checkpoint(ckpt, self.components["model"], self.components["optimizer"],
                                               sharded=self.sharded, verified_meta=meta if verified else None)
        for name, component in self.components.items():
            rewinds = not restore_data and name not in REWOUND and hasattr(component, "rewind")  # the guard's window
            if name not in WEIGHTS and (restore_data or name in REWOUND or rewinds):
                state = self._saved_state(name, component, saved, meta)
                if state is not None:  # absent from older checkpoints: the component keeps its fresh state
                    component.rewind(state) if rewinds else component.load_state_dict(state)
        return meta

    def _saved_state(self, name: str, component: Stateful, saved: dict, meta: dict) -> dict | None:
        """Component `name`'s state in a checkpoint (the tables above). Every rank's loader holds the same stream
        position (ranks slice each draw), so under another world size any saved rank's will do, and the loader
        maps it onto this run's micro-batch (TokenLoader.load_state_dict)."""
        if name in IN_META:
            return {key: meta.get(key) for key in component.state_dict()}
        if name in PER_RANK:
            ranks, rank = saved["ranks"], self.dist.rank
            mine = ranks[rank] if rank < len(ranks) else ranks[0] if name in SAME_ON_EVERY_RANK else None
            return None if mine is None else mine[name]
        return saved.get(name)

    # --- save ------------------------------------------------------------------------------------
    def save(self, ring: bool = True, best: bool = False) -> Path | None:
        """Save a checkpoint: into the ring (`ring`), and/or as best/ (`best`). Every rank contributes its own
        state; rank 0 writes (every rank writes its own shards under FSDP)."""
        if self.run_dir is None:
            return None
        states = {name: c.state_dict() for name, c in self.components.items() if name not in WEIGHTS}
        saved = {name: state for name, state in states.items() if name not in IN_META + PER_RANK}
        saved["ranks"] = D.all_gather_objects({name: states[name] for name in PER_RANK if name in states})
        meta = {key: value for name in IN_META if name in states for key, value in states[name].items()}
        meta.update({"config": to_dict(self.cfg), "world_size": self.dist.world_size, "batch": self.batch,
                     "torch": torch.__version__, **self.facts})
        path = save_training_checkpoint(self.run_dir, meta["step"], self.components["model"],
                                        self.components["optimizer"], saved, meta, is_main=self.dist.is_main,
                                        sharded=self.sharded, keep_last=self.cfg.checkpoint.keep_last, ring=ring,
                                        best=best)
        if ring:
            self.last_save = time.time()
        return path

    # --- rollback --------------------------------------------------------------------------------
    def rollback(self, why: str, before_load: Callable[[int], None] = lambda to_step: None) -> int:
        """Reload the newest good checkpoint's REWOUND components (not the data); returns its step. `why`: what
        went wrong at which step; `before_load(to_step)` may refuse the rollback (the guard, when rollbacks loop).
        Only a checkpoint at or before the current step will do: newer ones belong to a timeline this run left by
        resuming from an older checkpoint."""
        now = self.components["position"].state_dict()["step"]
        ckpt = newest_checkpoint(self.run_dir, warn=self.dist.is_main, up_to=now) if self.run_dir is not None else None
        if ckpt is None:
            raise GuardError(f"guard: {why} and no checkpoint to roll back to; "
                             "lower train.lr, check the data, or save earlier (checkpoint.every_steps)")
        before_load(int(ckpt.name.split("_")[-1]))
        return int(self.load(ckpt, restore_data=False, verified=True)["step"])
