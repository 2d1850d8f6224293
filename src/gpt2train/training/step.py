"""One optimizer step: the only place in gpt2train that calls backward.

The Trainer, every stage of `gpt2train bench journey`, plan's CPU timing and memory's batch search all run
this same step, so what they measure is what `gpt2train train` does:

    lr = lr_at(step)                       set by the caller, never here: an explicit function of the step
                                           (the trainer's set_lr gives Muon's groups their own peak)
    window = attention_window_at(step)     the same, for a sliding attention window that grows (model.window)
    zero_grad(set_to_none)
    for each micro-batch:                  gradient accumulation (how many: the caller's batch schedule)
        loss = model(x, y) / n_micro       autocast (bf16 / fp16 / fp32); DDP/FSDP sync on the last one only
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)             before the clip, so the clip sees true gradients
    norm = clip_grad_norm_(clip)           the pre-clip norm is reported
    scaler.step(optimizer); scaler.update()
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from gpt2train import distributed as D
from gpt2train.config import Config
from gpt2train.runtime import Runtime

Batches = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # () -> (inputs, targets), each (B, T)


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over the step's micro-batches on this rank (0-dim, on the device)
    grad_norm: torch.Tensor  # the gradient norm before clipping
    skipped: bool  # a non-finite loss or norm left the weights as they were
    seconds: float | None  # wall time of the step with its device work done (None when not timed)


def attention_window_at(step: int, cfg: Config) -> int:
    """The attention window optimizer step `step` (1-based) trains with: model.attention_window from step
    train.window_warmup_steps on; before, the largest of the window / 2, / 4, / 8 at or below the straight
    ramp from 0 to the window at that step, else the window / 16 (never below 1 token). A function of the
    step alone, so a resumed run gets the windows it would have had; five sizes at most, so a compiled model
    compiles at most five times. 0 (no window) stays 0."""
    window, warmup_steps = cfg.model.attention_window, cfg.train.window_warmup_steps
    halvings = 0
    while halvings < 4 and step << halvings < warmup_steps:  # window >> halvings is above the ramp
        halvings += 1
    return max(1, window >> halvings) if window > 0 else 0


class TrainStep:
    """A callable optimizer step over a model, its optimizer and a batch source.

    model: what runs forward (wrapped in DDP/FSDP, compiled or plain); clip_params: the parameters the clip
    and the optimizer see (the plain model's). skip_nonfinite reads loss and norm on the host (a device
    sync) to leave the weights untouched when either is not finite; timed synchronizes to time the step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, runtime: Runtime,
                 *, clip_params=None, grad_clip: float = 1.0, scaler: torch.amp.GradScaler | None = None,
                 skip_nonfinite: bool = False, timed: bool = False):
        self.model, self.optimizer, self.batches, self.runtime = model, optimizer, batches, runtime
        self.params = list(clip_params if clip_params is not None else model.parameters())
        self.grad_clip = grad_clip if grad_clip > 0 else math.inf  # 0: no clip, but the norm is still computed
        self.scaler = scaler or torch.amp.GradScaler(runtime.device.type, enabled=runtime.uses_grad_scaler)
        self.skip_nonfinite = skip_nonfinite
        self.timed = timed
        self.grad_accum = runtime.grad_accum

    def __call__(self, window: int | None = None, micro_batches: int | None = None) -> StepResult:
        """One step at the optimizer's learning rates (the caller's set_lr sets them) and attention window
        `window` (None: as the model has it); micro_batches: this step's accumulation (train.batch_schedule's,
        from the caller; None: the runtime's)."""
        start = time.perf_counter()
        n_micro = micro_batches or self.grad_accum
        if window is not None:
            D.unwrap(self.model).window = window  # the plain GPT's: compiled, it recompiles for a new size
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.runtime.device)
        for micro in range(n_micro):
            x, y = self.batches()
            # Backward inside the no-sync window too: FSDP2 reduce-scatters in its backward hooks.
            with D.gradient_sync(self.model, sync=micro == n_micro - 1):
                with self.runtime.autocast():
                    _, loss = self.model(x, y)
                    loss = loss / n_micro  # the sum over micro-batches is the mean over the full batch
                loss_sum += loss.detach()
                self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        skipped = self.skip_nonfinite and not (math.isfinite(loss_sum.item()) and math.isfinite(grad_norm.item()))
        if not (skipped and not self.scaler.is_enabled()):  # a non-finite update would poison the weights
            self.scaler.step(self.optimizer)  # with fp16 the scaler itself skips non-finite steps
        self.scaler.update()
        seconds = None
        if self.timed:
            if self.runtime.device.type == "cuda":
                torch.cuda.synchronize(self.runtime.device)
            seconds = time.perf_counter() - start
        return StepResult(loss_sum, grad_norm, skipped, seconds)
