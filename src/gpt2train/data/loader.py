"""Batches of (x, y) windows from token shards, vectorized, seeded, rank-aware and resumable.

A window is T + 1 consecutive tokens of one shard: x is its first T tokens, y the T tokens after each.
Windows are numbered globally over all shards of a split (`cum_starts`), and each step draws
B * world_size window ids:
  random:     ids drawn uniformly from a seeded generator, distinct within a step (windows of different
              steps may repeat, and windows with nearby starts overlap).
  sequential: non-overlapping windows (start = k * T); each epoch is a permutation of all of them seeded
              by (seed, epoch), so every window is seen exactly once per epoch.
Every rank draws the same ids for a step (same seed, same state) and keeps ids[rank::world_size], so
ranks never read the same window in a step and the loader state is identical on all ranks.
The ids form one stream, drawn `draw` ids at a time (B * world_size of the run that started it). A run resumed
with another micro-batch or world size keeps drawing in the saved unit and cuts the stream into its own
batches, so an optimizer step of the same tokens takes the same windows as it would have (load_state_dict). A batch is
gathered with one index per shard into a (n_starts, T + 1) strided view of the shard, so numpy copies whole
rows with no Python loop per row. (At GPT-2 shapes a loop of B contiguous row copies is about as fast; the
view wins for many short rows, and both far outrun a GPU's appetite: benchmarks/bench_data.py.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from gpt2train.data.prepared import load_meta, open_split, split_paths
from gpt2train.data.shards import check_ids_below

RAM_FRACTION = 4  # auto mode loads shards into RAM when all ranks together need under 1/4 of what is free


class DataError(ValueError):
    """Data that cannot feed the requested batches; the message says what to change."""


def available_ram_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0


def choose_mode(paths: list[Path], world_size: int) -> str:
    """ram when every rank's copy of the shards fits comfortably in free memory, else memmap."""
    on_disk = sum(p.stat().st_size for p in paths)
    return "ram" if on_disk * max(1, world_size) < available_ram_bytes() // RAM_FRACTION else "memmap"


def windows_in(n_tokens: int, seq_len: int, order: str) -> int:
    """How many windows of seq_len + 1 tokens a shard of n_tokens holds."""
    if n_tokens <= seq_len:
        return 0
    if order == "sequential":
        return (n_tokens - 1) // seq_len  # starts 0, T, 2T, ... with start + T + 1 <= n_tokens
    return n_tokens - seq_len  # every start with start + T + 1 <= n_tokens


def fitting_batch(shard_tokens: list[int], batch_size: int, seq_len: int, world_size: int, order: str) -> tuple[int, int]:
    """(rows, seq_len) of a batch that shards of these lengths fill on every rank: the batch asked for where they
    hold it, else fewer rows of seq_len, else one row of the longest length they hold one of per rank. Where not
    even that fits, the batch asked for (the loader's error says what is missing)."""
    def windows(length: int) -> int:
        return sum(windows_in(n, length, order) for n in shard_tokens)

    if windows(seq_len) >= world_size:
        return min(batch_size, windows(seq_len) // world_size), seq_len
    shorter = next((t for t in range(seq_len - 1, 0, -1) if windows(t) >= world_size), None)
    return (1, shorter) if shorter else (batch_size, seq_len)


def check_batch_shape(batch_size: int, seq_len: int, rank: int, world_size: int) -> None:
    """DataError unless a loader's rows and rank can be: every loader checks its arguments so."""
    if batch_size < 1 or seq_len < 1 or not 0 <= rank < world_size:
        raise DataError(f"batch_size {batch_size}, seq_len {seq_len}, rank {rank} of {world_size}: "
                        f"batch size and sequence length must be positive and rank < world size")


class TokenLoader:
    def __init__(self, data_dir: str | Path, split: str, batch_size: int, seq_len: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, order: str = "random", mode: str = "auto", device="cpu",
                 vocab_size: int | None = None, fit: bool = False):
        """vocab_size: the model's; every token id must be below it (checked on open where prepare recorded the
        largest ids, and in every batch: a max over B x (T + 1) ids, microseconds). None skips the check.
        fit: a split too small for one batch gives fewer rows, then shorter ones (fitting_batch), instead of
        refusing; `requested` keeps the batch asked for (validation: a small val split is read as it is)."""
        if order not in ("random", "sequential"):
            raise DataError(f"data.order {order!r} is not one of random, sequential")
        if mode not in ("auto", "ram", "memmap"):
            raise DataError(f"data.loader {mode!r} is not one of auto, ram, memmap")
        check_batch_shape(batch_size, seq_len, rank, world_size)
        meta = load_meta(data_dir)
        self.paths = split_paths(data_dir, meta, split)
        if not self.paths:
            hint = "prepare with --val-fraction > 0 or --val-tokens > 0" if split == "val" else "prepare more data"
            raise DataError(f"{data_dir}: no {split} shards in meta.json; {hint}")
        self.mode = choose_mode(self.paths, world_size) if mode == "auto" else mode
        self.shards = open_split(self.paths, meta, split, vocab_size, in_memory=(self.mode == "ram"))
        self.vocab_size = vocab_size
        self.rank, self.world_size = rank, world_size
        self.order, self.seed = order, seed
        self.requested = (batch_size, seq_len)
        self.B, self.T = fitting_batch([len(s) for s in self.shards], batch_size, seq_len, world_size, order) \
            if fit else self.requested
        self.device = torch.device(device)
        # windows[i][start] is the (T + 1,) window at `start` of shard i: a view, no copy
        self.windows = [sliding_window_view(s, self.T + 1) if len(s) > self.T else None for s in self.shards]
        self.starts_per_shard = np.array([self.windows_in(len(s)) for s in self.shards], dtype=np.int64)
        self.cum_starts = np.cumsum(self.starts_per_shard)  # window ids of shard i: cum_starts[i-1] .. cum_starts[i]-1
        self.first_id = self.cum_starts - self.starts_per_shard
        short = [p.name for p, n in zip(self.paths, self.starts_per_shard) if n == 0]
        needed = self.B * self.world_size
        if self.cum_starts[-1] < needed:
            total = sum(len(s) for s in self.shards)
            fix = ("prepare with a larger --val-fraction/--val-tokens, or lower train.micro_batch/train.seq_len"
                   if split == "val" else "lower train.micro_batch or train.seq_len, or prepare more data")
            raise DataError(f"{split} split has {total:,} tokens: {int(self.cum_starts[-1])} {order} windows of "
                            f"{self.T + 1} tokens, fewer than one batch needs ({needed} = batch {self.B} x "
                            f"{self.world_size} ranks); {fix}")
        if short:
            print(f"note: {len(short)} {split} shard(s) shorter than {self.T + 1} tokens are skipped "
                  f"(e.g. {short[0]})", file=sys.stderr)
        self.reset()

    def windows_in(self, n_tokens: int) -> int:
        """How many windows of T + 1 tokens fit in a shard of n_tokens."""
        return windows_in(n_tokens, self.T, self.order)

    def batches_per_pass(self) -> int:
        """Batches of every rank in one pass over the split's windows (at least one)."""
        return max(1, int(self.cum_starts[-1]) // (self.B * self.world_size))

    # --- state -------------------------------------------------------------------------------------
    def reset(self):
        self.rng = np.random.default_rng(self.seed)
        self.epoch, self.position = 0, 0
        self._permutation = None
        self.draw = self.B * self.world_size  # ids taken from the stream at a time
        self._pending = np.empty(0, dtype=np.int64)  # drawn, not yet handed out (empty at step boundaries)

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "epoch": self.epoch, "position": self.position,
                "order": self.order, "seed": self.seed, "batch": [self.B, self.T, self.world_size],
                "windows": int(self.cum_starts[-1]), "draw": self.draw, "pending": self._pending.tolist()}

    def load_state_dict(self, state: dict):
        """Continue a saved stream. Another micro-batch or world size is fine (the stream is drawn in the saved
        unit); another seq_len or order is not: windows would mean other tokens."""
        if "sources" in state:
            raise DataError("loader state was saved by a mixture of data.sources; resume with the same data.sources")
        saved_b, saved_t, saved_ranks = state["batch"]
        if saved_t != self.T or state["order"] != self.order:
            raise DataError(f"loader state was saved with seq_len {saved_t} and order {state['order']}; resume "
                            f"with train.seq_len = {saved_t} and data.order = {state['order']!r}")
        if state.get("windows", int(self.cum_starts[-1])) != int(self.cum_starts[-1]):
            raise DataError(f"loader state was saved for {state['windows']} windows but this data has "
                            f"{int(self.cum_starts[-1])}; resume with the same data.dir")
        self.seed = state["seed"]
        self.rng = np.random.default_rng(self.seed)
        self.rng.bit_generator.state = state["rng"]
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._permutation = None
        self.draw = int(state.get("draw", saved_b * saved_ranks))  # older states: the saved batch was the unit
        self._pending = np.asarray(state.get("pending", []), dtype=np.int64)

    # --- batches -----------------------------------------------------------------------------------
    def _window_ids(self) -> np.ndarray:
        """Global window ids for this step, all ranks together (B * world_size of them)."""
        return self.take_ids(self.B * self.world_size)

    def take_ids(self, n: int) -> np.ndarray:
        """The stream's next n window ids (a mixture takes a varying number per step: data/mixture.py)."""
        if n == self.draw and not len(self._pending):
            return self._draw()  # the stream's unit is this run's batch: the usual case
        while len(self._pending) < n:
            self._pending = np.concatenate([self._pending, self._draw()])
        ids, self._pending = self._pending[:n], self._pending[n:]
        return ids

    def _draw(self) -> np.ndarray:
        """The stream's next `draw` ids."""
        n, total = self.draw, int(self.cum_starts[-1])
        if self.order == "random":
            return self.rng.choice(total, size=n, replace=False)  # Floyd's sampling: O(n), not O(total)
        if self._permutation is None:  # each epoch a fresh permutation, derived from seed and epoch
            self._permutation = np.random.default_rng([self.seed, self.epoch]).permutation(total)
        ids = self._permutation[self.position : self.position + n]
        self.position += n
        if self.position + n > total:  # the epoch's last partial draw is dropped: a draw never mixes two
            self.epoch, self.position, self._permutation = self.epoch + 1, 0, None  # epochs, so no window twice
        return ids

    def _gather(self, out: np.ndarray) -> np.ndarray:
        """Fill out (B, T + 1) with this rank's windows for the next step."""
        return self.gather_ids(self._window_ids()[self.rank :: self.world_size], out)

    def gather_ids(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill out (len(ids), T + 1) with the windows of these ids."""
        shard_of = np.searchsorted(self.cum_starts, ids, side="right")
        start = ids - self.first_id[shard_of]
        if self.order == "sequential":
            start = start * self.T
        for s in np.unique(shard_of):
            rows = np.nonzero(shard_of == s)[0]
            out[rows] = self.windows[s][start[rows]]  # one gather of whole rows for all rows of a shard
            if self.vocab_size is not None:  # shards of other tools, or a file changed since prepare
                check_ids_below(out[rows], self.vocab_size, self.paths[s])
        return out

    def next_batch_numpy(self) -> np.ndarray:
        """(B, T + 1) int64 windows for this rank."""
        return self._gather(np.empty((self.B, self.T + 1), dtype=np.int64))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: (B, T) int64 on the loader's device."""
        if self.device.type == "cuda":
            # gather straight into page-locked memory so the copy to the GPU is asynchronous; the caching host
            # allocator reuses the buffer only after that copy has finished
            buf = torch.empty((self.B, self.T + 1), dtype=torch.int64, pin_memory=True)
            self._gather(buf.numpy())
            buf = buf.to(self.device, non_blocking=True)
        else:
            buf = torch.from_numpy(self.next_batch_numpy()).to(self.device)
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()
