"""Batches drawn from several prepared folders at once, each in proportion to its weight (`data.sources`).

Each source keeps its own TokenLoader (its own seeded window stream, order and position); the mixture only
decides which rows of a step come from which source. The rows of all steps form one numbered stream, and row k
goes to the source furthest behind its share:

    source of row k = argmax_s ( share_s * (k + 1) - rows_s )      (ties: the source listed first)

where rows_s counts the rows source s has had before row k. After any k rows every source has had its share
of them within one row, whatever the batch size, so even small batches keep the proportions. The rule needs no
random numbers: the randomness is each source's own window stream, the one a run of that folder alone draws
(same seed), taken at the source's own pace.

A step takes B * world_size rows of the stream, every rank the same ones (the same state on every rank), and
rank r keeps rows r*B .. r*B + B - 1: ranks never share a row, and each gets the mixture's proportions. Since
the stream is numbered by row and each source's loader keeps drawing in its saved unit (TokenLoader.take_ids),
a run resumed with another micro-batch or world size continues with the same rows in the same order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gpt2train.config import ConfigError, DataConfig, data_sources
from gpt2train.data.chat_loader import ChatLoader, is_chat_data
from gpt2train.data.loader import DataError, TokenLoader
from gpt2train.data.prepared import load_meta
from gpt2train.tokenizer import prepare_option, tokenizer_difference


def data_meta(data: DataConfig) -> dict:
    """meta.json of the run's data: data.dir's, or the sources' shared one. Sources prepared with different
    tokenizers are refused: the same id would mean different text."""
    pairs = data_sources(data)
    metas = [load_meta(folder) for folder, _ in pairs]
    first_dir, first = pairs[0][0], metas[0]
    for (folder, _), meta in zip(pairs[1:], metas[1:]):
        difference = tokenizer_difference(first["tokenizer"], meta["tokenizer"])
        if difference:  # the user's choice of folders: a config error, as train.init_from's mismatch is
            raise ConfigError(f"data.sources {first_dir} and {folder} have different tokenizers ({difference}); "
                              f"prepare {folder} again with {prepare_option(first['tokenizer'])}")
    return {**first, "vocab_size": max(int(m["vocab_size"]) for m in metas)}


def open_loader(data: DataConfig, split: str, batch_size: int, seq_len: int, *, seed: int, order: str,
                **loader_args) -> TokenLoader | MixtureLoader | ChatLoader:
    """data.dir's TokenLoader (a ChatLoader for `prepare chat`'s folders), or a MixtureLoader over data.sources
    (loader_args: TokenLoader's keywords)."""
    if not data.sources:
        kind = ChatLoader if is_chat_data(load_meta(data.dir)) else TokenLoader
        return kind(data.dir, split, batch_size, seq_len, seed=seed, order=order, **loader_args)
    if any(is_chat_data(load_meta(folder)) for folder, _ in data_sources(data)):
        raise ConfigError("data.sources cannot mix chat data (prepare chat's folders); point data.dir at one chat folder")
    return MixtureLoader(data_sources(data), split, batch_size, seq_len, seed=seed, order=order, **loader_args)


def assign_rows(share: np.ndarray, taken: np.ndarray, n: int) -> np.ndarray:
    """The sources of the stream's next n rows (the rule above); `taken` (rows per source so far) moves on."""
    share_of, rows, sources = share.tolist(), taken.tolist(), range(len(share))  # Python floats: a few sources
    done, out = sum(rows), []                                                   # are faster than numpy calls
    for k in range(done + 1, done + n + 1):
        s = max(sources, key=lambda j: share_of[j] * k - rows[j])  # the first of equals, as argmax
        out.append(s)
        rows[s] += 1
    taken[:] = rows
    return np.array(out, dtype=np.int64)


class MixtureLoader:
    def __init__(self, sources: list[tuple[str, float]], split: str, batch_size: int, seq_len: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, order: str = "random", mode: str = "auto", device="cpu",
                 vocab_size: int | None = None, fit: bool = False):
        """sources: (folder, weight) pairs, folders distinct, weights positive (config.data_sources checks).
        fit: each source's loader fits its own split (TokenLoader's fit), for validation, which reads each
        source on its own (eval/val.py's mixture_validation); next_batch then needs every source's batch alike."""
        self.names = [str(folder) for folder, _ in sources]
        self.weights = [float(w) for _, w in sources]
        self.share = np.array(self.weights) / sum(self.weights)
        self.loaders = []
        for folder, _ in sources:
            try:
                self.loaders.append(TokenLoader(folder, split, batch_size, seq_len, rank=rank, world_size=world_size,
                                                seed=seed, order=order, mode=mode, device=device, vocab_size=vocab_size,
                                                fit=fit))
            except DataError as e:  # say which source, when the message does not
                raise (e if str(folder) in str(e) else DataError(f"data.sources {folder}: {e}")) from None
        self.B, self.T = batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.order, self.device = order, torch.device(device)
        self.reset()

    # --- state -------------------------------------------------------------------------------------
    def reset(self):
        for loader in self.loaders:
            loader.reset()
        self.taken = np.zeros(len(self.loaders), dtype=np.int64)  # rows each source has had

    def state_dict(self) -> dict:
        return {"sources": self.names, "weights": self.weights, "taken": self.taken.tolist(),
                "loaders": [loader.state_dict() for loader in self.loaders]}

    def load_state_dict(self, state: dict):
        """Continue a saved mixture: the same sources and weights (each source's loader checks the rest)."""
        if "sources" not in state:
            raise DataError("loader state was saved by a run of one data.dir; resume with data.sources = [] and "
                            "that data.dir")
        saved = [f"{name}={weight:g}" for name, weight in zip(state["sources"], state["weights"])]
        if [Path(n).resolve() for n in state["sources"]] != [Path(n).resolve() for n in self.names] or \
                state["weights"] != self.weights:
            raise DataError(f"loader state was saved for data.sources = {saved}; resume with those sources and weights")
        for loader, loader_state in zip(self.loaders, state["loaders"]):
            loader.load_state_dict(loader_state)
        self.taken = np.asarray(state["taken"], dtype=np.int64)

    # --- batches -----------------------------------------------------------------------------------
    def next_batch_numpy(self) -> np.ndarray:
        """(B, T + 1) int64 windows for this rank."""
        n = self.B * self.world_size
        source = assign_rows(self.share, self.taken, n)
        ids = np.empty(n, dtype=np.int64)
        for s, loader in enumerate(self.loaders):  # in source order on every rank: the same stream positions
            rows = source == s
            if rows.any():
                ids[rows] = loader.take_ids(int(rows.sum()))
        mine = slice(self.rank * self.B, (self.rank + 1) * self.B)
        source, ids = source[mine], ids[mine]
        out = np.empty((self.B, self.T + 1), dtype=np.int64)
        for s in np.unique(source):
            rows = np.nonzero(source == s)[0]
            out[rows] = self.loaders[s].gather_ids(ids[rows], np.empty((len(rows), self.T + 1), dtype=np.int64))
        return out

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: (B, T) int64 on the loader's device."""
        buf = torch.from_numpy(self.next_batch_numpy())
        if self.device.type == "cuda":  # page-locked, so the copy to the GPU is asynchronous
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        else:
            buf = buf.to(self.device)
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()
