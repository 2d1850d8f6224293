"""Evaluation: validation loss (val.py), HellaSwag (hellaswag.py), the multiple-choice suite (suite.py, over
likelihood.py's scorer), lm-evaluation-harness (harness.py), the exact match of a chat model's replies
(chat.py), the `gpt2train eval` command (run.py) and the evaluations that run during training (periodic.py).

Every evaluation shards its items across ranks and sums its counts with an all-reduce, so a torchrun of
N processes reports what one process would. The two helpers below are what they share.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_batches(n_items: int, batch_size: int) -> list[np.ndarray]:
    """This rank's items (every world_size-th, from its rank on), in batches of at most batch_size.

    Every rank gets the same number of batches, some possibly empty: a sharded model (FSDP) gathers its
    weights inside forward, so all ranks must run the same number of forwards or the job hangs.
    """
    rank, world = rank_and_world()
    mine = np.arange(rank, n_items, world)
    n_batches = math.ceil(math.ceil(n_items / world) / batch_size)
    return [mine[i * batch_size : (i + 1) * batch_size] for i in range(n_batches)]


def sum_across_ranks(values: list[float], device) -> list[float]:
    """Element-wise sum of `values` over all ranks (float64, so token counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl" and t.device.type != "cuda":
            t = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().tolist()


@torch.no_grad()
def idle_forward(model: torch.nn.Module, device) -> None:
    """A one-token forward whose output is thrown away: this rank's turn in a sharded model's gathers
    when it has no items left in a batch."""
    model(torch.zeros((1, 1), dtype=torch.long, device=device))
