"""Validation loss, perplexity and bits per byte: the mean next-token cross-entropy over a data folder's
val shards, and the same sum in bits divided by the UTF-8 bytes of the predicted text, which compares
models with different tokenizers (a bigger vocabulary has fewer, longer tokens and a higher loss per token).

The training loop validates on its val stream (open_val_loader): eval.val_batches batches of non-overlapping
windows of seq_len + 1 tokens, drawn in a permutation seeded by train.seed + 1. `gpt2train eval` reads the
same windows by default (validation_windows gives their ids), so that it prints the number the run logged.
From another data folder the windows are every non-overlapping window, in file order, or a number of them
spread evenly over the split. The same checkpoint therefore gets the same number on every run, whatever the
batch size or the number of ranks (up to float rounding). A chat folder's (`prepare chat`'s) windows are its
conversations, one per row as training reads them, and only the assistant's tokens count (ValConversations).

Logits are cut to the tokenizer's vocabulary before the softmax. A trained model learns to give its
padding ids (50257..50303 for GPT-2) no probability, but weights imported from elsewhere may hold zeros
there, which would take real probability mass and inflate the loss.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from gpt2train.config import Config
from gpt2train.data.chat_loader import ChatLoader, is_chat_data
from gpt2train.data.loader import DataError, TokenLoader
from gpt2train.data.mixture import MixtureLoader, open_loader
from gpt2train.data.prepared import load_meta, open_split, split_paths
from gpt2train.data.shards import check_ids_below
from gpt2train.eval import idle_forward, rank_and_world, rank_batches, sum_across_ranks
from gpt2train.progress import show_progress


def open_val_loader(cfg: Config, seq_len: int, **loader_args) -> TokenLoader | MixtureLoader:
    """The run's validation stream (loader_args: TokenLoader's keywords): train.micro_batch non-overlapping
    windows per rank and batch, each pass over the split a permutation seeded by train.seed + 1, so every
    validation of a run reads the same windows."""
    return open_loader(cfg.data, "val", cfg.train.micro_batch, seq_len, seed=cfg.train.seed + 1, order="sequential",
                       fit=True, **loader_args)


def batches_to_read(loader: TokenLoader, batches: int) -> int:
    """`batches`, at most one pass over the split (every window once, less the last partial batch); 0: one pass."""
    return min(batches, loader.batches_per_pass()) if batches else loader.batches_per_pass()


def validation_windows(loader: TokenLoader, batches: int) -> np.ndarray:
    """The ids of the windows validation_loss(model, loader, batches) reads, every rank's, in the order drawn;
    in ValWindows' numbering (the same non-overlapping windows, numbered in file order)."""
    loader.reset()
    return np.concatenate([loader.take_ids(loader.B * loader.world_size) for _ in range(batches_to_read(loader, batches))])


class ValWindows:
    """Every non-overlapping window of seq_len + 1 tokens in a split's shards (inputs and targets)."""

    def __init__(self, data_dir: str | Path, seq_len: int, split: str = "val", vocab_size: int | None = None):
        meta = load_meta(data_dir)
        self.paths = split_paths(data_dir, meta, split)
        if not self.paths:
            raise DataError(f"{data_dir}: no {split} shards in meta.json")
        self.seq_len = seq_len
        self.shards = open_split(self.paths, meta, split, vocab_size)
        self.vocab_size = vocab_size  # and each window as it is read: shards of other tools are not scanned
        # A window starting at k * seq_len needs seq_len + 1 tokens: (len - 1) // seq_len of them fit.
        counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self.shard_of = np.repeat(np.arange(len(counts)), counts)
        self.start = np.concatenate([np.arange(c, dtype=np.int64) * seq_len for c in counts])
        if len(self.start) == 0:
            total = sum(len(s) for s in self.shards)
            raise DataError(f"{data_dir}: the {split} split has {total} tokens, fewer than one window of "
                            f"{seq_len + 1}; evaluate with a shorter sequence length or prepare more data")

    def __len__(self) -> int:
        return len(self.start)

    def spread(self, n: int) -> np.ndarray:
        """Ids of n windows spread evenly over the split (all of them when n is 0 or too large)."""
        if n <= 0 or n >= len(self):
            return np.arange(len(self))
        return np.linspace(0, len(self) - 1, n).round().astype(np.int64)  # steps >= 1: no duplicates

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """(len(ids), seq_len + 1) int64 tokens."""
        span = np.arange(self.seq_len + 1)
        windows = [self.shards[self.shard_of[i]][self.start[i] + span].astype(np.int64) for i in ids]
        if self.vocab_size is not None:
            for i, window in zip(ids, windows):
                check_ids_below(window, self.vocab_size, self.paths[self.shard_of[i]])
        return np.stack(windows)

    def inputs_targets(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x, y: (len(ids), seq_len) int64, every target counted."""
        buf = self.gather(ids)
        return buf[:, :-1], buf[:, 1:]


class ValConversations:
    """A chat folder's val conversations as ValWindows serves windows: the rows training validates on (ChatLoader's:
    one conversation per row, padded; targets -1 but for the assistant's tokens), numbered as ChatLoader numbers
    them, so that validation_windows' ids of a ChatLoader are ids here."""

    def __init__(self, data_dir: str | Path, seq_len: int, vocab_size: int | None = None):
        self.loader = ChatLoader(data_dir, "val", 1, seq_len, vocab_size=vocab_size)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.loader.begin)

    spread = ValWindows.spread

    def inputs_targets(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tokens, mask = self.loader.rows(ids)
        return tokens[:, :-1], np.where(mask[:, 1:], tokens[:, 1:], -1)


def val_data(data_dir: str | Path, seq_len: int, vocab_size: int | None = None) -> ValWindows | ValConversations:
    """The folder's val split as numbered rows: windows of text, or a chat folder's conversations."""
    if is_chat_data(load_meta(data_dir)):
        return ValConversations(data_dir, seq_len, vocab_size)
    return ValWindows(data_dir, seq_len, vocab_size=vocab_size)


def summed_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast=None) -> torch.Tensor:
    """Sum over all positions of -log p(y | x), those whose target is -1 (chat data's context) left out. The
    model's own loss: logits cut to the real vocabulary, and never materialized whole when the model's loss
    is chunked."""
    with autocast or nullcontext():
        _, loss = model(x, y)  # the mean over the B * T positions' targets, in fp32
    return loss.double() * (y != -1).sum()


def mixture_validation(model: torch.nn.Module, source: MixtureLoader, batches: int = 0, autocast=None, *,
                       progress: bool = False, token_bytes: np.ndarray | None = None) -> dict:
    """validation_loss over each source of a mixture (`batches` batches of each), and overall: the mixture's
    loss, each source's weighted by its share, and its bits per byte, the expected bits of a token over its
    expected bytes (sum_s share_s * bits_s / sum_s share_s * bytes_s, per token). Returns validation_loss's
    keys (the overall numbers; tokens, bytes and windows summed) and "sources": {folder: its own}."""
    per = {name: validation_loss(model, loader, batches, autocast, progress=progress, token_bytes=token_bytes)
           for name, loader in zip(source.names, source.loaders)}
    return combine_sources(per, dict(zip(source.names, source.share.tolist())))


def combine_sources(per: dict[str, dict], share: dict[str, float]) -> dict:
    """The mixture's numbers from each source's validation_loss dict (mixture_validation says how)."""
    loss = sum(share[name] * out["loss"] for name, out in per.items())
    bpb = None
    if all(out["bytes"] for out in per.values()):
        bits = sum(share[name] * out["loss"] / math.log(2) for name, out in per.items())
        bpb = bits / sum(share[name] * out["bytes"] / out["tokens"] for name, out in per.items())
    with_bytes = all(out["bytes"] is not None for out in per.values())
    return {"loss": loss, "ppl": math.exp(loss) if loss < 700 else math.inf, "bpb": bpb,
            "tokens": sum(out["tokens"] for out in per.values()),
            "bytes": sum(out["bytes"] for out in per.values()) if with_bytes else None,
            "windows": sum(out["windows"] for out in per.values()), "seq_len": next(iter(per.values()))["seq_len"],
            "sources": per}


@torch.no_grad()
def validation_loss(model: torch.nn.Module, source: TokenLoader | str | Path, batches: int = 0, autocast=None, *,
                    batch_size: int = 8, seq_len: int = 0, windows: int = 0, ids: np.ndarray | None = None,
                    progress: bool = False, token_bytes: np.ndarray | None = None) -> dict:
    """Mean loss and perplexity of `model` (plain, unwrapped; put it in eval mode) on the val split.

    source: a data folder, whose windows are fixed (see ValWindows; a chat folder's are its conversations,
        ValConversations): those of `ids` (e.g. validation_windows'),
        else `windows` of them spread evenly over the split, else `batches` * batch_size, else all; each rank
        takes every world_size-th.
        Or a TokenLoader or ChatLoader (reset first), from which `batches` batches are drawn, at most one pass (0: one pass):
        a small split is read once, not its windows again.
    token_bytes: the tokenizer's bytes per id (its `token_bytes()`); with it the result has "bpb".
    Returns {"loss", "ppl", "bpb", "tokens", "bytes", "windows", "seq_len"}, summed over all ranks.
    """
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    n_bytes = torch.zeros((), dtype=torch.int64, device=device)
    bytes_of = torch.as_tensor(token_bytes, device=device) if token_bytes is not None else None
    n_windows, n_targets = 0, torch.zeros((), dtype=torch.int64, device=device)
    if isinstance(source, (TokenLoader, ChatLoader)):
        source.reset()
        seq_len = source.T
        for _ in show_progress(range(batches_to_read(source, batches)), desc="val", unit="batch",
                               enabled=progress and rank_and_world()[0] == 0):
            x, y = source.next_batch()
            total += summed_loss(model, x, y, autocast)
            n_bytes += (bytes_of[y.clamp(min=0)] * (y != -1)).sum() if bytes_of is not None else 0
            n_targets += (y != -1).sum()
            n_windows += x.size(0)
    else:
        seq_len = seq_len or model.config.block_size
        data = val_data(source, seq_len, vocab_size=model.config.vocab_size)
        ids = data.spread(windows or batches * batch_size) if ids is None else np.asarray(ids)
        for rows in show_progress(rank_batches(len(ids), batch_size), desc="val", unit="batch",
                                enabled=progress and rank_and_world()[0] == 0):
            if len(rows) == 0:
                idle_forward(model, device)
                continue
            x, y = (torch.from_numpy(a).to(device) for a in data.inputs_targets(ids[rows]))
            total += summed_loss(model, x, y, autocast)
            n_bytes += (bytes_of[y.clamp(min=0)] * (y != -1)).sum() if bytes_of is not None else 0
            n_targets += (y != -1).sum()
            n_windows += len(rows)
    loss_sum, n_windows, n_bytes, tokens = sum_across_ranks([float(total), n_windows, int(n_bytes), int(n_targets)],
                                                            device)
    tokens = int(tokens)  # the targets scored: every position, or chat data's assistant tokens
    loss = loss_sum / tokens
    bpb = loss_sum / (math.log(2) * n_bytes) if n_bytes > 0 else None
    return {"loss": loss, "ppl": math.exp(loss) if loss < 700 else math.inf, "bpb": bpb, "tokens": tokens,
            "bytes": int(n_bytes) if bytes_of is not None else None, "windows": int(n_windows), "seq_len": seq_len}
