"""Batches of (x, y) windows from token shards, vectorized, seeded, rank-aware and resumable.

Every rank draws the same windows for a step (same seed, same state) and keeps its own slice of them,
so ranks never read the same window and the loader state is identical on all ranks. A batch is
gathered with one fancy index per shard instead of a Python loop per row.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from gpt2train.data.prepare import load_meta
from gpt2train.data.shards import open_shard


class DataError(ValueError):
    """Data that cannot feed the requested batches; the message says what to change."""


def available_ram_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0


class TokenLoader:
    def __init__(self, data_dir: str | Path, split: str, batch_size: int, seq_len: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, order: str = "random", mode: str = "auto", device="cpu"):
        meta = load_meta(data_dir)
        names = meta["shards"].get(split) or []
        if not names:
            raise DataError(f"{data_dir}: no {split} shards in meta.json")
        self.paths = [Path(data_dir) / n for n in names]
        if mode == "auto":
            on_disk = sum(p.stat().st_size for p in self.paths)
            mode = "ram" if on_disk < available_ram_bytes() // 4 else "memmap"
        self.mode = mode
        self.shards = [open_shard(p, in_memory=(mode == "ram")) for p in self.paths]
        self.B, self.T = batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.order, self.seed = order, seed
        self.device = torch.device(device)
        # Windows of T + 1 tokens (inputs and the next-token targets). A shard holds len - T starts.
        self.starts_per_shard = np.array([max(0, len(s) - self.T) for s in self.shards], dtype=np.int64)
        if self.order == "sequential":
            self.starts_per_shard //= self.T  # non-overlapping windows: start = k * T
        self.cum_starts = np.cumsum(self.starts_per_shard)
        needed = self.B * self.world_size
        if self.cum_starts[-1] < needed:
            total = sum(len(s) for s in self.shards)
            raise DataError(f"{split} split has {total} tokens, too few for {needed} windows of {self.T + 1} tokens; "
                            f"lower train.micro_batch or train.seq_len, or prepare more data")
        self.reset()

    # --- state -------------------------------------------------------------------------------------
    def reset(self):
        self.rng = np.random.default_rng(self.seed)
        self.epoch, self.position = 0, 0
        self._permutation = None

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "epoch": self.epoch, "position": self.position,
                "order": self.order, "seed": self.seed, "batch": [self.B, self.T, self.world_size]}

    def load_state_dict(self, state: dict):
        if state["batch"] != [self.B, self.T, self.world_size] or state["order"] != self.order:
            raise DataError("loader state was saved with another batch shape, world size or order; "
                            "resume with the same train.micro_batch, seq_len, world size and data.order")
        self.seed = state["seed"]
        self.rng = np.random.default_rng(self.seed)
        self.rng.bit_generator.state = state["rng"]
        self.epoch, self.position = state["epoch"], state["position"]
        self._permutation = None

    # --- batches -----------------------------------------------------------------------------------
    def _window_ids(self) -> np.ndarray:
        """Global window ids for this step, all ranks together (B * world_size of them)."""
        n = self.B * self.world_size
        total = int(self.cum_starts[-1])
        if self.order == "random":
            return self.rng.integers(0, total, size=n)
        ids = []
        while n:
            if self._permutation is None:  # each epoch a fresh permutation, derived from seed and epoch
                self._permutation = np.random.default_rng([self.seed, self.epoch]).permutation(total)
            take = self._permutation[self.position : self.position + n]
            ids.append(take)
            n -= take.size
            self.position += take.size
            if self.position >= total:
                self.epoch, self.position, self._permutation = self.epoch + 1, 0, None
        return np.concatenate(ids)

    def next_batch_numpy(self) -> np.ndarray:
        """(B, T + 1) int64 windows for this rank."""
        ids = self._window_ids()[self.rank :: self.world_size]
        shard_of = np.searchsorted(self.cum_starts, ids, side="right")
        offset = ids - np.concatenate(([0], self.cum_starts[:-1]))[shard_of]
        if self.order == "sequential":
            offset = offset * self.T
        out = np.empty((self.B, self.T + 1), dtype=np.int64)
        span = np.arange(self.T + 1)
        for s in np.unique(shard_of):
            rows = np.nonzero(shard_of == s)[0]
            out[rows] = self.shards[s][offset[rows, None] + span]  # one gather for all rows of a shard
        return out

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.from_numpy(self.next_batch_numpy())
        if self.device.type == "cuda":
            buf = buf.pin_memory().to(self.device, non_blocking=True)  # the copy overlaps compute
        else:
            buf = buf.to(self.device)
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()
