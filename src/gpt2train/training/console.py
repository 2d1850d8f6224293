"""What a run tells the person watching and the run log: the start banner, one line per logged step
(loss, LR, grad norm, tokens/s, MFU where its basis is known, ETA), a progress bar on a terminal, and the
metrics.jsonl records.

Only rank 0 prints and writes; on the other ranks every call is a no-op.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import gpt2train
from gpt2train.config import Config, to_dict
from gpt2train.counting import parameter_count
from gpt2train.mfu_basis import MfuBasis
from gpt2train.progress import on_terminal, terminal_bar
from gpt2train.runlog import MetricsLogger
from gpt2train.runtime import Runtime
from gpt2train.training.optim import schedule_warning
from gpt2train.units import format_count, format_duration


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


ALREADY_FINISHED = "already finished"  # the reason train() returns for a run resumed at its end


def say_already_finished(run_dir: Path | None, state, max_steps: int, is_main: bool) -> dict:
    """A resume of a run that has reached train.max_steps: one line saying so and what to raise, and the result
    of a launch that trained nothing (it logs no launch: nothing in the run directory changes)."""
    if is_main:
        print(f"{run_dir or 'the run'} is already finished at step {state.step} (train.max_steps = {max_steps}); "
              f"to train further, raise train.max_steps, e.g. --set train.max_steps={2 * state.step}", flush=True)
    return {"step": state.step, "tokens": state.tokens, "val_loss": state.val_loss, "best_val_loss": state.best_val,
            "reason": ALREADY_FINISHED}


@dataclass
class LogContinuity:
    """What the loggers of a later launch continue, saved with every checkpoint: the run's one W&B run."""

    wandb_run_id: str | None = None

    def state_dict(self) -> dict:
        return {"wandb_run_id": self.wandb_run_id}

    def load_state_dict(self, state: dict) -> None:
        self.wandb_run_id = state.get("wandb_run_id")


class Console:
    def __init__(self, cfg: Config, run_dir: Path | None, is_main: bool, device: torch.device, start_step: int = 1,
                 continuity: LogContinuity | None = None):
        """`start_step`: the first step this launch trains (after a resume, the checkpoint's step + 1);
        `continuity`: the W&B run a resumed launch continues (from the checkpoint), filled in on a first launch."""
        self.cfg, self.is_main, self.device = cfg, is_main, device
        if is_main and run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
        continuity = continuity if continuity is not None else LogContinuity()
        self.logger = MetricsLogger(run_dir if is_main else None, cfg.log.tensorboard, cfg.log.wandb,
                                    cfg.log.wandb_project, cfg.log.wandb_mode, to_dict(cfg),
                                    start_step=start_step, wandb_run_id=continuity.wandb_run_id)
        continuity.wandb_run_id = self.logger.wandb_run_id  # made by the logger on a first W&B launch
        self.bar = None
        self.launch_start = time.time()
        self.first_step = 1  # of this launch
        self.pace_from = None  # (step, time) the ETA counts from: after the first step, which may compile

    def log(self, kind: str, **fields):
        self.logger.log(kind, **fields)

    def print(self, text: str):
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    # --- a launch --------------------------------------------------------------------------------
    def start(self, step: int, runtime: Runtime, flops_per_token: float, basis: MfuBasis,
              resumed_from: str | None = None, init_source: str | None = None):
        """The run_start record and the banner: device, model, batch, what MFU divides by (or, once, why no MFU
        is shown), and where the weights came from (`resumed_from` a checkpoint, or `init_source` for
        train.init_from)."""
        device, model = self.device, self.cfg.model
        params, params_non_embedding = parameter_count(model), parameter_count(model, non_embedding=True)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        hardware = {"device": str(device), "device_name": name, "torch": torch.__version__,
                    "world_size": runtime.world_size, "cuda": torch.version.cuda}
        self.log("run_start", step=step + 1, config=to_dict(self.cfg), runtime=runtime.record(), hardware=hardware,
                 git=git_revision(), version=gpt2train.__version__, params=params,
                 params_non_embedding=params_non_embedding, flops_per_token=flops_per_token, peak_flops=basis.flop_s,
                 mfu_basis=basis.source, resumed_from=resumed_from)
        self.launch_start, self.first_step, self.pace_from = time.time(), step + 1, None
        if not self.is_main:
            return
        print(f"device: {name} ({device}), world size {runtime.world_size}, dtype {str(runtime.dtype).split('.')[-1]}, "
              f"compile {'on' if runtime.compile else 'off'}")
        print(f"model: {format_count(params)} parameters ({format_count(params_non_embedding)} without embeddings)")
        print(f"batch: {runtime.tokens_per_step:,} tokens/step = {runtime.micro_batch} x {runtime.seq_len} "
              f"x {runtime.world_size} ranks x {runtime.grad_accum} micro-steps")
        if runtime.schedule.staged:  # train.batch_schedule: more micro-steps, the same shapes
            print(f"batch schedule: {runtime.schedule.describe()} ({runtime.schedule.tokens_through(self.cfg.train.max_steps):,} "
                  f"tokens in {self.cfg.train.max_steps:,} steps)")
        warning = schedule_warning(self.cfg.train)
        if warning:  # a schedule that cannot run its course: said before the run spends its steps
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        if basis.flop_s is None:  # said once here; the step lines then leave MFU out
            print(f"mfu: not shown: {basis.source}; the step lines report tokens/s only")
        elif device.type == "cpu":  # a measured ceiling, said with where it comes from: GFLOP/s, not TFLOP/s
            print(f"mfu: against {basis.flop_s / 1e9:,.1f} GFLOP/s per process, {basis.source}; "
                  f"{flops_per_token / 1e6:.1f} MFLOP per token")
        else:
            print(f"mfu: against {basis.flop_s / 1e12:.0f} TFLOP/s per device, {flops_per_token / 1e6:.1f} MFLOP per token")
        if resumed_from:
            print(f"resumed from {resumed_from} at step {step}")
        elif init_source:
            print(f"weights from {init_source} (train.init_from); starting at step 0 with a fresh optimizer")
        self.open_bar(step)

    def open_bar(self, step: int):
        """On a terminal (or with log.progress = "bar") a bar; otherwise the step lines are the progress."""
        mode = self.cfg.log.progress
        if self.is_main and (mode == "bar" or (mode == "auto" and on_terminal())):
            self.bar = terminal_bar(total=self.cfg.train.max_steps, initial=step, desc="train", unit="step")

    def redo_from(self, step: int):
        """Training goes back to redo `step` and on (a rollback): the TensorBoard mirror hides those steps."""
        self.logger.redo_from(step)

    def advance(self, step: int):
        """Move the bar to `step` (one forward after a step, back after a rollback)."""
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def end(self, step: int, tokens: int, reason: str, error: str | None = None):
        """The run_end record; closes the bar and the log (also after an error)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if not self.logger.active or self.logger.file.closed:
            return
        fields = {"error": error} if error is not None else {}
        self.log("run_end", step=step, tokens=tokens, wall_s=time.time() - self.launch_start, reason=reason, **fields)
        self.logger.close()

    # --- a step ----------------------------------------------------------------------------------
    def train_line(self, step: int, tokens: int, loss: float, lr: float, grad_norm: float, seconds: float,
                   tokens_per_step: int, mfu: float | None, first_compiled: bool, assistant_tokens: int | None = None):
        """The `train` record and the console line (or the bar's postfix when the bar is on); assistant_tokens:
        chat data's targets trained on so far (None on pretraining data)."""
        tok_s = tokens_per_step / seconds
        peak_mem = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None
        record = dict(step=step, tokens=tokens, loss=loss, lr=lr, grad_norm=grad_norm, step_ms=seconds * 1000,
                      tokens_per_s=tok_s, mfu=mfu, peak_mem_mb=peak_mem)
        if first_compiled:
            record["compile_ms"] = seconds * 1000  # the first compiled step includes compilation
        if assistant_tokens is not None:
            record["assistant_tokens"] = assistant_tokens
        self.log("train", **record)
        mfu_text = f" | mfu {100 * mfu:.1f}%" if mfu is not None else ""  # unknown: the banner said why, once
        line = (f"step {step:>6}/{self.cfg.train.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                f"norm {grad_norm:.2f} | {tok_s:,.0f} tok/s{mfu_text} | {seconds * 1000:.0f} ms | "
                f"eta {self.eta(step)}")
        if first_compiled:
            line += " (includes compilation)"
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f} | {tok_s:,.0f} tok/s{mfu_text}", refresh=False)
            if self.cfg.log.progress == "bar":
                return
        self.print(line)

    def averaged(self, step: int, steps: int, blend: float):
        """The weight average went into the model (train.average_last): what the final evaluation measures."""
        self.log("average", step=step, steps=steps, blend=blend)
        into = "replaced the weights" if blend == 1 else f"blended into the weights at {blend:g}"
        self.print(f"step {step}: the average of the last {steps} steps' weights {into}; the final evaluation and "
                   "checkpoint are the averaged model's")

    def eta(self, step: int) -> str:
        """Time to max_steps at this launch's pace after its first step (evaluations and saves included);
        "?" until there is a pace: the first step's time may be mostly compilation."""
        now = time.time()
        if self.pace_from is None:
            self.pace_from = (step, now)
            return "?"
        done = step - self.pace_from[0]
        if done <= 0:
            return "?"
        return format_duration((now - self.pace_from[1]) / done * (self.cfg.train.max_steps - step))
