"""The trainer: builds a run from its config and runs it to max_steps, one optimizer step at a time.

Each concern is a component with a small interface: the step itself (step.py), checkpoints (checkpointing.py:
resume, periodic and best saves, rollback), the console and run log (console.py), stop signals (signals.py),
the loss guard (guard.py) and the evaluations during training (eval/periodic.py). fit() only orders them.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import numpy as np
import torch

from gpt2train import distributed as D
from gpt2train.checkpoint import ProcessRNG, batch_layout, newest_checkpoint, run_on_disk
from gpt2train.config import Config, save_config
from gpt2train.counting import flops_per_token, parameter_count
from gpt2train.data.mixture import data_meta, open_loader
from gpt2train.eval.periodic import PeriodicEvals
from gpt2train.eval.val import open_val_loader
from gpt2train.mfu_basis import mfu_basis
from gpt2train.model import GPT
from gpt2train.runconfig import Environment, RunConfig
from gpt2train.runtime import resolve_runtime, use_expandable_segments
from gpt2train.training import init_from, runlock
from gpt2train.training.averaging import WeightAverage
from gpt2train.training.checkpointing import Checkpointer, RunState, refuse_to_start_over
from gpt2train.training.console import Console, LogContinuity, say_already_finished
from gpt2train.training.guard import TrainingGuard, finite_or_none
from gpt2train.training.optim import make_optimizer, set_lr
from gpt2train.training.signals import StopSignal, agreed_signal, signal_name
from gpt2train.training.speed import as_run_measuring
from gpt2train.training.step import TrainStep, attention_window_at


def seed_everything(seed: int):
    """Seed Python, NumPy and torch (the CPU generator and every CUDA device's)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: Config | RunConfig, run_dir: str | Path | None, resume: str | None = None):
        self.run_dir = Path(run_dir) if run_dir else None
        # The inputs first (a bad config or missing data stops before the run directory is made): the config
        # resolved once (runconfig.py; a time budget's speed measured here, speed.py; a RunConfig is already),
        # then the data it reads.
        run = as_run_measuring(cfg, Environment.of_launch(self.run_dir, resume))
        self.data_meta = data_meta(run.config.data)  # data.dir's, or the sources' (one tokenizer)
        use_expandable_segments()  # before init_distributed, whose device choice may start CUDA
        self.dist = D.init_distributed(run.config.train.device, run.config.train.collective_timeout_s)
        self.device, self.is_main = self.dist.device, self.dist.is_main
        # One live run per run directory, locked before it is read or written (close() unlocks); no new run over an old.
        self.lock = None
        if self.run_dir:
            def refuse_an_old_run(run_dir: Path) -> None:
                refuse_to_start_over(run_dir, resume)

            self.lock = runlock.acquire_on_rank0(self.run_dir, self.is_main, refuse_an_old_run)
        try:
            self._build(run, resume)
        except BaseException:
            self.close(failed=True)
            raise

    def _build(self, run: RunConfig, resume: str | None):
        # The weights of train.init_from (its shape is the config's already); then what the config means here.
        cfg = run.config
        self.run, self.cfg = run, cfg
        init_weights, self.init_source = init_from.weights_to_start_from(run, self.data_meta["tokenizer"])
        runtime = resolve_runtime(cfg, self.device, self.dist.world_size)
        self.runtime = runtime
        runtime.apply()  # TF32
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=runtime.uses_grad_scaler)

        # Model: built plain and seeded identically on every rank (DDP also broadcasts rank 0's weights),
        # then wrapped (DDP / FSDP2) and compiled from outside. raw_model stays the plain, uncompiled GPT
        # (sharded in place under FSDP): evaluation and sampling call it, so they never trigger a recompile.
        seed_everything(cfg.train.seed)
        self.raw_model = GPT(cfg.model).to(self.device)
        if init_weights is not None:  # the full weights into the plain model, before DDP/FSDP wraps it
            init_from.load_into(self.raw_model, init_weights, cfg.train.init_from)
            del init_weights
        model = D.wrap_model(self.raw_model, self.dist, cfg.train.distributed, runtime.dtype)
        self.model = torch.compile(model) if runtime.compile else model
        self.optimizer = make_optimizer(self.raw_model, cfg.train, self.device.type)
        seed_everything(cfg.train.seed + self.dist.rank)  # from here on each rank draws its own numbers

        # Data streams: the same seed on every rank, each rank taking its own slice of every draw.
        loader_args = dict(rank=self.dist.rank, world_size=self.dist.world_size, mode=cfg.data.loader, device=self.device,
                           vocab_size=cfg.model.vocab_size)
        self.train_loader = open_loader(cfg.data, "train", cfg.train.micro_batch, cfg.train.seq_len,
                                        seed=cfg.train.seed, order=cfg.data.order, **loader_args)
        self.val_loader = open_val_loader(cfg, cfg.train.seq_len, **loader_args)  # the windows `eval` reads too

        # The step, and the components around it.
        self.step_fn = TrainStep(self.model, self.optimizer, self.train_loader.next_batch, runtime,
                                 clip_params=self.raw_model.parameters(), grad_clip=cfg.train.grad_clip,
                                 scaler=self.scaler, skip_nonfinite=cfg.guard.enabled, timed=True)
        self.state = RunState()
        self.guard = TrainingGuard(cfg.guard)
        self.logs = LogContinuity()
        self.average = WeightAverage(self.raw_model, cfg.train.average_last, cfg.train.average_blend, cfg.train.max_steps)
        self.checkpointer = self._make_checkpointer()
        ckpt = self.checkpointer.resume(resume) if resume else None
        self.state.resumed_from = str(ckpt) if ckpt else None
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)
        self.mfu_basis = mfu_basis(self.device, runtime.dtype, cfg.train.tf32, self.run_dir and self.run_dir.parent)
        # Both stay None for a run resumed at its end: it logs no launch, opens no logger.
        self.console = None
        self.evals = None
        if self.state.step >= cfg.train.max_steps:
            return
        # After the resume: the loggers learn where this launch starts and which W&B run it continues.
        self.console = Console(cfg, self.run_dir, self.is_main, self.device, self.state.step + 1, self.logs)
        self.evals = PeriodicEvals(cfg, self.raw_model, self.val_loader, self.data_meta["tokenizer"], runtime.autocast,
                                   self.console.log, self.console.print, self.is_main)

    def _make_checkpointer(self) -> Checkpointer:
        """The checkpointer, given what a checkpoint holds (each component has state_dict/load_state_dict) and
        what every checkpoint records of the run besides."""
        components = {"model": self.raw_model, "optimizer": self.optimizer, "scaler": self.scaler, "guard": self.guard,
                      "rng": ProcessRNG(), "loader": self.train_loader, "position": self.state.position,
                      "run": self.state, "logger": self.logs, "average": self.average}
        facts = {"tokenizer": self.data_meta["tokenizer"], "params": parameter_count(self.cfg.model),
                 "runtime": self.runtime.record()}
        return Checkpointer(self.cfg, self.run_dir, self.dist, batch_layout(self.runtime), components, facts)

    def train_step(self) -> dict:
        """One optimizer step at the LRs of its step number (AdamW's is logged); the counters move on."""
        step = self.state.step + 1
        lr = set_lr(self.optimizer, step, self.cfg.train)
        window = attention_window_at(step, self.cfg)  # grown over train.window_warmup_steps
        micro_batches = self.runtime.schedule.accum(step)  # train.batch_schedule may grow the batch
        result = self.step_fn(window=window, micro_batches=micro_batches)
        self.state.step = step
        self.state.tokens += self.runtime.schedule.tokens_at(step)
        return {"loss": result.loss.item(), "lr": lr, "grad_norm": result.grad_norm.item(),
                "skipped": result.skipped, "seconds": result.seconds}

    def evaluate(self) -> float:
        return self.evals.validate()[0]

    def fit(self) -> dict:
        cfg, state, console = self.cfg, self.state, self.console
        if console is None:  # resumed at its end: nothing to train
            return say_already_finished(self.run_dir, state, cfg.train.max_steps, self.is_main)
        if self.is_main and self.run_dir is not None:
            save_config(cfg, self.run_dir / "config.toml")
        console.start(state.step, self.runtime, self.flops_per_token, self.mfu_basis, state.resumed_from, self.init_source)
        now = time.time()
        state.launch_start = now
        self.checkpointer.last_save = now
        first_step = state.step + 1
        val_loss = None  # this launch's latest validation loss
        stop = None  # the stop signal all ranks agreed on
        with StopSignal() as stop_signal:
            while state.step < cfg.train.max_steps:
                out = self.train_step()
                step = state.step
                last = step == cfg.train.max_steps
                loss, stop, minutes_due = self._agree(out["loss"], stop_signal.received, self.checkpointer.minutes_due())
                verdict = self.guard.observe(loss, out["grad_norm"], norm_may_overflow=self.scaler.is_enabled())
                if verdict is not None and verdict.action == "rollback":
                    self._rollback(verdict.reason, out, loss)
                    if stop:  # the state is a saved checkpoint's already
                        break
                    continue
                if out["skipped"]:
                    console.log("guard", step=step, action="skip", reason="non-finite loss or grad norm",
                                loss=finite_or_none(out["loss"]), grad_norm=finite_or_none(out["grad_norm"]))
                if step % cfg.log.interval == 0 or step == first_step or last:
                    self._log_train(out, first_compiled=self.runtime.compile and step == first_step)
                console.advance(step)
                if self.average.after_step(step):  # after the last step: the final evaluation and checkpoint see it
                    console.averaged(step, self.average.count, self.average.blend)

                is_best = False
                new_val = self.evals.after_step(step, state.tokens, last, state.best_val)
                if new_val is not None:
                    val_loss = new_val
                    state.val_loss = new_val
                    is_best = new_val < state.best_val
                    state.best_val = min(state.best_val, new_val)
                self._save_if_due(step, last, minutes_due, stop is not None, is_best)
                if stop:
                    console.print(f"stop signal received ({signal_name(stop)}): saved step {step}, exiting")
                    break
        reason = "signal" if stop else "done"
        console.end(state.step, state.tokens, reason)
        return {"step": state.step, "tokens": state.tokens, "val_loss": val_loss, "best_val_loss": state.best_val,
                "reason": reason, "signal": stop}  # the stop signal's number (None: the run was not stopped)

    def _save_if_due(self, step: int, last: bool, minutes_due: bool, stopping: bool, is_best: bool):
        """A regular save goes into the ring; a new best alone is written to best/ only."""
        regular = self.checkpointer.regular_due(step, last, minutes_due, stopping)
        best = is_best and self.cfg.checkpoint.save_best
        if regular:
            self.guard.after_checkpoint()  # a new checkpoint: the run got past what made it roll back
        if regular or best:
            path = self.checkpointer.save(ring=regular, best=best)
            self.console.log("checkpoint", step=step, path=str(path), best=best)

    def _agree(self, loss: float, signum: int | None, save_due_by_time: bool) -> tuple[float, int | None, bool]:
        """What every rank must decide alike: the rank-averaged loss (for the guard), the stop signal (any rank's;
        signals.agreed_signal), and whether the wall-clock save is due (clocks differ between hosts). One all-reduce."""
        if not self.dist.enabled:
            return loss, signum, save_due_by_time
        decisions = torch.tensor([loss, signum is not None, signum == signal.SIGTERM, save_due_by_time],
                                 device=self.device, dtype=torch.float64)
        mean_loss, any_signal, any_sigterm, any_save_due = D.all_reduce_mean(decisions).tolist()
        return mean_loss, agreed_signal(any_signal > 0, any_sigterm > 0), any_save_due > 0

    def _rollback(self, reason: str, out: dict, loss: float):
        step = self.state.step

        def before_load(to_step: int) -> None:  # the guard may refuse a rollback that loops
            self.guard.before_rollback(to_step, step)

        to_step = self.checkpointer.rollback(f"{reason} at step {step}", before_load)
        self.console.redo_from(to_step + 1)  # before the guard record, so that the mirrors keep it
        self.console.log("guard", step=step, action="rollback", reason=reason, loss=finite_or_none(loss),
                         grad_norm=finite_or_none(out["grad_norm"]), to_step=to_step)
        self.console.print(f"guard: {reason} at step {step}; rolled back to step {to_step}")
        self.console.advance(to_step)

    def _log_train(self, out: dict, first_compiled: bool):
        loss = float(D.all_reduce_mean(torch.tensor(out["loss"], device=self.device)))
        step_tokens = self.runtime.schedule.tokens_at(self.state.step)
        tok_s = step_tokens / out["seconds"]
        mfu = None
        if self.mfu_basis.flop_s:  # over the peak of every rank's device
            mfu = tok_s * self.flops_per_token / (self.mfu_basis.flop_s * self.dist.world_size)
        self.console.train_line(self.state.step, self.state.tokens, loss, out["lr"], out["grad_norm"], out["seconds"],
                                step_tokens, mfu, first_compiled, getattr(self.train_loader, "targets_seen", None))

    def close(self, failed: bool = False):
        """Give the run directory back to the next run; a failed launch takes back a directory it made, holding no run."""
        runlock.release(self.lock, discard_made=failed and self.lock is not None and run_on_disk(self.run_dir) is None)
        self.lock = None

    def peer_lost(self, error: BaseException) -> D.PeerLost | None:
        """What this rank says when a collective failed because another rank died or hung (None for any other
        error): the last step it finished, and the checkpoint that a resume starts from."""
        reason = D.peer_gone(error)
        if reason is None:
            return None
        ckpt = newest_checkpoint(self.run_dir, warn=False) if self.run_dir is not None else None
        return D.PeerLost(f"rank {self.dist.rank}: lost contact with another rank after step {self.state.step} "
                          f"({reason}); the last checkpoint ({ckpt or 'none'}) is intact; resume with --resume auto")

    def log_failure(self, error: BaseException):
        """A `run_end` record for a launch that ended in an exception (the checkpoints before it stand)."""
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        reason = "signal" if isinstance(error, KeyboardInterrupt) else "error"  # a second Ctrl-C / SIGTERM
        if self.console is not None:
            self.console.end(self.state.step, self.state.tokens, reason, error=message)


def train(cfg: Config | RunConfig, run_dir: str | Path | None, resume: str | Path | None = None) -> dict:
    """Build a Trainer, run it to max_steps (or a signal), and shut the process group down: after a failure always
    (every rank must be able to exit), after a run only one it joined (a group there before, a pipeline's, stays
    for its next stage). A Config is resolved for this launch (speed.as_run_measuring: a time budget's speed
    measured here); a RunConfig as it is."""
    use_expandable_segments()  # nothing on the CLI path has touched CUDA yet
    owns_group = not D.in_process_group()
    trainer = None
    try:
        trainer = Trainer(cfg, run_dir, resume)
        out = trainer.fit()
    except BaseException as e:
        # Leave with a first SIGTERM held off: torchrun sends one to every rank as soon as any rank has failed,
        # and a rank that lost its peer must still get its one line out.
        with StopSignal():
            lost = trainer.peer_lost(e) if trainer is not None else None
            if trainer is not None:
                trainer.log_failure(lost or e)  # a run_end record with reason "error"
                trainer.close(failed=True)
            D.shutdown_distributed(clean=False)  # no barrier: the other ranks may never reach it
        if lost is not None:
            raise lost from e  # one line instead of gloo's traceback; the CLI exits 1
        raise
    trainer.close()
    if owns_group:
        with StopSignal():  # torchrun's SIGTERM to the ranks still leaving, once one stopped rank exited 130/143, waits
            D.shutdown_distributed(clean=True)
    return out
