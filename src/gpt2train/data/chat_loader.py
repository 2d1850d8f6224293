"""Batches of chat data (`prepare chat`'s folders): one conversation per row, so that no conversation's
tokens ever train on another's.

A row is seq_len + 1 tokens: the conversation, then end-of-text tokens as padding. x is its first seq_len
tokens, y the seq_len after each, with y = -1 (ignored by the loss, plain and fused alike) wherever the mask
says the token is not a target: the system and user turns, role headers, and the padding. Conversations longer
than a row are skipped (counted, said once on stderr); the rest are read in a permutation per epoch seeded by
(seed, epoch), B * world_size of them per step, rank r keeping ids[r::world_size]. The state is the epoch and
the position in it, so a resumed run reads the rows it would have read.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from gpt2train.data.conversations import mask_name, starts_name
from gpt2train.data.loader import DataError, check_batch_shape, choose_mode
from gpt2train.data.prepared import load_meta, open_split, recorded, split_paths
from gpt2train.data.shards import ShardError, open_tokens, tokens_crc32


def is_chat_data(meta: dict) -> bool:
    return isinstance(meta.get("chat"), dict)


def open_beside(paths: list[Path], meta: dict, split: str, name_of, key: str, in_memory: bool) -> list[np.ndarray]:
    """Each shard's mask or starts file, its CRC-32 checked against the one meta.json records."""
    out = []
    for path, crc in zip(paths, recorded(meta, key, split, len(paths)) or [None] * len(paths)):
        beside = path.with_name(name_of(path.name))
        if not beside.is_file():
            raise FileNotFoundError(f"{beside} is missing: chat data needs it beside {path.name}; re-run "
                                    f"`gpt2train prepare chat`")
        data = open_tokens(beside, in_memory=in_memory)
        if crc is not None and tokens_crc32(data) != crc:
            raise ShardError(f"{beside} changed after `gpt2train prepare chat` wrote it; re-run it for this folder")
        out.append(data)
    return out


def split_conversations(data_dir: str | Path, split: str = "val",
                        vocab_size: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every conversation of a chat folder's split, in file order: its ids (int64) and mask (uint8), as
    chat.render gave them."""
    meta = load_meta(data_dir)
    if not is_chat_data(meta):
        raise DataError(f"{data_dir} is not chat data (its meta.json has no \"chat\"); prepare it with "
                        "`gpt2train prepare chat`")
    paths = split_paths(data_dir, meta, split)
    shards = open_split(paths, meta, split, vocab_size, in_memory=True)
    masks = open_beside(paths, meta, split, mask_name, "mask_crc32", True)
    out = []
    for tokens, mask, starts in zip(shards, masks, open_beside(paths, meta, split, starts_name, "starts_crc32", True)):
        bounds = [*starts.astype(np.int64).tolist(), len(tokens)]
        out += [(tokens[b:e].astype(np.int64), mask[b:e].astype(np.uint8)) for b, e in zip(bounds, bounds[1:])]
    return out


class ChatLoader:
    """Rows of whole conversations with their targets masked; state_dict/load_state_dict for an exact resume."""

    def __init__(self, data_dir: str | Path, split: str, batch_size: int, seq_len: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, order: str = "random", mode: str = "auto", device="cpu",
                 vocab_size: int | None = None, fit: bool = False):
        """TokenLoader's arguments; order is not used (conversations are always read in a seeded permutation
        per epoch); fit: a split of fewer conversations than one batch gives fewer rows (validation)."""
        check_batch_shape(batch_size, seq_len, rank, world_size)
        meta = load_meta(data_dir)
        self.paths = split_paths(data_dir, meta, split)
        if not self.paths:
            raise DataError(f"{data_dir}: no {split} shards in meta.json; prepare chat with --val-fraction > 0"
                            if split == "val" else f"{data_dir}: no train shards in meta.json")
        in_memory = (choose_mode(self.paths, world_size) if mode == "auto" else mode) == "ram"
        self.shards = open_split(self.paths, meta, split, vocab_size, in_memory=in_memory)
        self.masks = open_beside(self.paths, meta, split, mask_name, "mask_crc32", in_memory)
        starts = open_beside(self.paths, meta, split, starts_name, "starts_crc32", True)
        self.pad_id = int(meta["eot_id"])
        self.B, self.T = batch_size, seq_len
        self.requested = (batch_size, seq_len)
        self.rank, self.world_size, self.seed, self.order = rank, world_size, seed, order
        self.device = torch.device(device)
        # every conversation as (shard, start, end); those that fit in a row are the ones read
        shard, begin, end = [], [], []
        for i, (s, tokens) in enumerate(zip(starts, self.shards)):
            s = s.astype(np.int64)
            shard.append(np.full(len(s), i))
            begin.append(s)
            end.append(np.append(s[1:], len(tokens)))
        shard, begin, end = (np.concatenate(a) for a in (shard, begin, end))
        fits = end - begin <= self.T + 1
        self.skipped = int((~fits).sum())
        self.shard_of, self.begin, self.end = shard[fits], begin[fits], end[fits]
        # the targets each conversation trains (its first token, end-of-text, is never one)
        self.targets = np.array([int(self.masks[s][b:e].sum()) for s, b, e in zip(self.shard_of, self.begin, self.end)],
                                dtype=np.int64)
        if self.skipped:
            print(f"note: {self.skipped:,} of {len(fits):,} {split} conversations are longer than a row of "
                  f"{self.T + 1} tokens and are skipped; raise train.seq_len to train on them", file=sys.stderr)
        if fit and world_size <= len(self.begin) < self.B * world_size:  # a small val split: fewer rows
            self.B = len(self.begin) // world_size
        if len(self.begin) < self.B * world_size:
            raise DataError(f"{split} split has {len(self.begin)} conversations of at most {self.T + 1} tokens, fewer "
                            f"than one batch needs ({self.B} x {world_size} ranks); lower train.micro_batch, raise "
                            f"train.seq_len or prepare more conversations")
        self.reset()

    def batches_per_pass(self) -> int:
        return max(1, len(self.begin) // (self.B * self.world_size))

    # --- state -------------------------------------------------------------------------------------
    def reset(self):
        self.epoch, self.position, self._permutation = 0, 0, None
        self.targets_seen = 0  # the targets of every rank's rows so far: the assistant tokens trained on

    def state_dict(self) -> dict:
        return {"chat": True, "seed": self.seed, "epoch": self.epoch, "position": self.position,
                "batch": [self.B, self.T, self.world_size], "conversations": len(self.begin),
                "targets_seen": self.targets_seen}

    def load_state_dict(self, state: dict):
        """Continue a saved stream: the same seq_len, data and batch of all ranks (B x world size)."""
        if not state.get("chat"):
            raise DataError("loader state was saved by a run on pretraining data; resume with the same data.dir")
        saved_b, saved_t, saved_ranks = state["batch"]
        if saved_t != self.T or state["conversations"] != len(self.begin):
            raise DataError(f"loader state was saved with seq_len {saved_t} over {state['conversations']} "
                            f"conversations; resume with train.seq_len = {saved_t} and the same data.dir")
        if saved_b * saved_ranks != self.B * self.world_size:
            raise DataError(f"loader state was saved with {saved_b * saved_ranks} rows per step; chat data resumes "
                            f"with the same train.micro_batch x ranks")
        self.seed, self.epoch, self.position = state["seed"], int(state["epoch"]), int(state["position"])
        self.targets_seen, self._permutation = int(state["targets_seen"]), None

    # --- batches -----------------------------------------------------------------------------------
    def take_ids(self, n: int) -> np.ndarray:
        """The next n conversation ids of the stream, every rank's; an epoch's last partial draw is dropped."""
        total = len(self.begin)
        if self.position + n > total:
            self.epoch, self.position, self._permutation = self.epoch + 1, 0, None
        if self._permutation is None:
            self._permutation = np.random.default_rng([self.seed, self.epoch]).permutation(total)
        ids = self._permutation[self.position : self.position + n]
        self.position += n
        self.targets_seen += int(self.targets[ids].sum())
        return ids

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, mask) of these conversations: (len(ids), T + 1) int64 and bool, padded past each end."""
        tokens = np.full((len(ids), self.T + 1), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(ids), self.T + 1), dtype=bool)
        for row, i in enumerate(ids):
            s, b, e = self.shard_of[i], self.begin[i], self.end[i]
            tokens[row, : e - b] = self.shards[s][b:e]
            mask[row, : e - b] = self.masks[s][b:e]
        return tokens, mask

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: (B, T) int64 on the loader's device; y is -1 where the position does not train."""
        ids = self.take_ids(self.B * self.world_size)[self.rank :: self.world_size]
        tokens, mask = self.rows(ids)
        y = np.where(mask[:, 1:], tokens[:, 1:], -1)
        return (torch.from_numpy(tokens[:, :-1].copy()).to(self.device), torch.from_numpy(y).to(self.device))
