"""The end-of-training weight average (train.average_last, train.average_blend): a float32 running mean of the
model's weights after each of the run's last steps, blended into the weights after the last step, so that the
final evaluation and the final checkpoint are the averaged model's.

A component like the others: its state (the mean so far, how many steps it holds, where its window starts) goes
into every checkpoint, so that a run resumed inside the window averages exactly the steps an uninterrupted run
averages, and a rollback rewinds it with the weights. Under DDP every rank holds the same weights and so the same
mean. Under FSDP2 the parameters are DTensors and the mean is made of them: each rank averages its own shards,
with no communication; a checkpoint holds the full mean (gathered, like the full weights), which each rank cuts
into its shards again on load, at any world size.
"""

from __future__ import annotations

import math

import torch


class WeightAverage:
    def __init__(self, model: torch.nn.Module, average_last: float, blend: float, max_steps: int):
        """model: the plain model (sharded in place under FSDP); average_last: the fraction of the steps, at the
        end, whose weights are averaged (0: off; at least one step otherwise); blend: how much of the mean the
        final weights take (1: the mean replaces them)."""
        self.params = dict(model.named_parameters())  # a tied matrix is one parameter, named once
        window = max(1, math.floor(average_last * max_steps + 0.5)) if average_last > 0 else 0
        self.first = max_steps - window + 1 if window else None  # the first step whose weights count
        self.last, self.blend = max_steps, blend
        self.count, self.mean = 0, {}

    def after_step(self, step: int) -> bool:
        """Take the weights after step `step` into the mean when it is in the window; after the last step, blend
        the mean into the weights. Returns whether it blended (the caller says so in the log)."""
        if self.first is None or not self.first <= step <= self.last:
            return False
        with torch.no_grad():
            for name, p in self.params.items():
                if self.count == 0:
                    self.mean[name] = p.detach().float().clone()
                else:  # mean += (p - mean) / n: never a sum that outgrows the weights' precision
                    self.mean[name].lerp_(p.detach().float(), 1 / (self.count + 1))
        self.count += 1
        if step < self.last:
            return False
        with torch.no_grad():
            for name, p in self.params.items():
                p.lerp_(self.mean[name].to(p.dtype), self.blend)  # lerp is exact at 1: then the mean itself
        return True

    def state_dict(self) -> dict:
        """A collective under FSDP (every rank calls it, as every rank saves): the mean's shards are gathered."""
        return {"first": self.first, "count": self.count, "mean": {name: full(t).cpu() for name, t in self.mean.items()}}

    def load_state_dict(self, state: dict) -> None:
        """A resume with another window (max_steps or train.average_last changed) starts the mean again: it
        holds the steps of the new window from here on, as many as the final log line says."""
        if state.get("first") != self.first:
            self.count, self.mean = 0, {}
            return
        self.count = int(state["count"])
        self.mean = {name: like(self.params[name], t) for name, t in state["mean"].items()}


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a DTensor: gathered from every rank), else t."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def like(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole` in float32 on param's device, and under FSDP2 cut into param's shards (a DTensor of its placements)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    whole = whole.to(param.device, torch.float32)
    return distribute_tensor(whole, param.device_mesh, param.placements) if isinstance(param, DTensor) else whole
