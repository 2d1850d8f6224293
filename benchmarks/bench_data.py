"""Data pipeline throughput on this machine's CPU: the loader and `prepare`.

    PYTHONPATH=src python benchmarks/bench_data.py [--tokens 20000000] [--batch 16] [--seq-len 1024]

Loader: tokens/s of TokenLoader for ram vs memmap x random vs sequential, next to a naive batcher that
slices one row at a time in a Python loop (what nanoGPT's get_batch does). Prepare: input MB/s of
`prepare_files` (GPT-2 tokenizer) with 1..N worker processes, including process start-up. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gpt2train.data.loader import TokenLoader
from gpt2train.data.prepare import prepare_files, shakespeare_text
from gpt2train.data.shards import open_shard, write_shard


def make_shards(folder: Path, n_tokens: int, n_shards: int = 4) -> None:
    rng = np.random.default_rng(0)
    per = n_tokens // n_shards
    names = []
    for k in range(n_shards):
        write_shard(folder / f"train_{k:06d}.bin", rng.integers(0, 50257, per), 50257)
        names.append(f"train_{k:06d}.bin")
    meta = {"tokenizer": {"kind": "gpt2"}, "vocab_size": 50257, "eot_id": 50256, "shards": {"train": names, "val": []},
            "tokens": {"train": per * n_shards, "val": 0}}
    (folder / "meta.json").write_text(json.dumps(meta))


def naive_batches(folder: Path, B: int, T: int, steps: int) -> None:
    """One Python-level slice per row: pick a shard, pick a start, copy, stack."""
    shards = [open_shard(p) for p in sorted(folder.glob("train_*.bin"))]
    rng = np.random.default_rng(0)
    for _ in range(steps):
        rows = []
        for _ in range(B):
            tokens = shards[rng.integers(len(shards))]
            start = int(rng.integers(len(tokens) - T))
            rows.append(torch.from_numpy(tokens[start:start + T + 1].astype(np.int64)))
        buf = torch.stack(rows)
        buf[:, :-1].contiguous(), buf[:, 1:].contiguous()  # the x, y that TokenLoader.next_batch returns


def time_loader(make, B: int, T: int, steps: int, repeats: int = 3) -> float:
    """Tokens per second (x, y tensors on the CPU), best of `repeats` runs after one warm-up batch: the
    machine may be shared, and the best run is the one least disturbed."""
    run = make()
    run(1)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run(steps)
        best = min(best, time.perf_counter() - start)
    return B * T * steps / best


def bench_loader(folder: Path, B: int, T: int, steps: int) -> list[tuple[str, str, float]]:
    rows = []
    for mode in ("ram", "memmap"):
        for order in ("random", "sequential"):
            def make(mode=mode, order=order):
                loader = TokenLoader(folder, "train", B, T, order=order, mode=mode, seed=0)
                return lambda n: [loader.next_batch() for _ in range(n)]
            rows.append((mode, order, time_loader(make, B, T, steps)))
    naive = time_loader(lambda: lambda n: naive_batches(folder, B, T, n), B, T, steps)
    rows.append(("memmap", "naive Python loop", naive))
    return rows


def bench_gather(folder: Path, shapes, steps: int) -> list[tuple[int, int, float, float]]:
    """The gather alone (numpy, random order, RAM): TokenLoader's strided-view index vs a loop per row."""
    rows = []
    for B, T in shapes:
        loader = TokenLoader(folder, "train", B, T, order="random", mode="ram", seed=0)

        def per_row(n, loader=loader, B=B, T=T):
            for _ in range(n):
                ids = loader._window_ids()
                shard_of = np.searchsorted(loader.cum_starts, ids, side="right")
                start = ids - loader.first_id[shard_of]
                out = np.empty((B, T + 1), dtype=np.int64)
                for i in range(B):
                    out[i] = loader.shards[shard_of[i]][start[i]:start[i] + T + 1]

        def vectorized_run(n, loader=loader):
            for _ in range(n):
                loader.next_batch_numpy()

        vectorized = time_loader(lambda: vectorized_run, B, T, steps)
        rows.append((B, T, vectorized, time_loader(lambda: per_row, B, T, steps)))
    return rows


def bench_prepare(work: Path, copies: int, max_workers: int) -> list[tuple[int, float, float]]:
    text = shakespeare_text()
    inputs = work / "corpus"
    inputs.mkdir()
    paragraphs = text.split("\n\n")
    k = 0
    for _ in range(copies):  # ~1 MB per copy, as documents of 20 paragraphs (~3 KB)
        for i in range(0, len(paragraphs), 20):
            (inputs / f"{k:07d}.txt").write_text("\n\n".join(paragraphs[i:i + 20]))
            k += 1
    megabytes = sum(p.stat().st_size for p in inputs.iterdir()) / 1e6
    prepare_files([inputs], work / "warm", workers=1, progress=False)  # tokenizer files loaded and cached
    rows = []
    for workers in range(1, max_workers + 1):
        start = time.perf_counter()
        meta = prepare_files([inputs], work / f"out{workers}", workers=workers, progress=False)
        seconds = time.perf_counter() - start
        rows.append((workers, megabytes / seconds, sum(meta["tokens"].values()) / seconds))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=20_000_000, help="tokens of synthetic shards for the loader")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--copies", type=int, default=4, help="copies of Tiny Shakespeare (1.1 MB each) to prepare")
    parser.add_argument("--max-workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "shards").mkdir()
        make_shards(work / "shards", args.tokens)
        print(f"\nLoader: B={args.batch}, T={args.seq_len}, {args.steps} batches, {args.tokens:,} tokens in 4 shards\n")
        print("| storage | order | tokens/s |\n|---|---|---:|")
        for mode, order, rate in bench_loader(work / "shards", args.batch, args.seq_len, args.steps):
            print(f"| {mode} | {order} | {rate:,.0f} |")
        print("\nGather only (numpy int64 batch, random order, RAM)\n")
        print("| B | T | strided-view gather tokens/s | Python loop per row tokens/s |\n|---:|---:|---:|---:|")
        for B, T, fast, slow in bench_gather(work / "shards", [(16, 1024), (64, 1024), (512, 64)], args.steps // 4):
            print(f"| {B} | {T} | {fast:,.0f} | {slow:,.0f} |")
        print(f"\nPrepare: GPT-2 tokenizer, {args.copies} x Tiny Shakespeare as ~3 KB documents\n")
        print("| workers | input MB/s | tokens/s |\n|---:|---:|---:|")
        for workers, mb_s, tok_s in bench_prepare(work, args.copies, args.max_workers):
            print(f"| {workers} | {mb_s:.2f} | {tok_s:,.0f} |")


if __name__ == "__main__":
    main()
