"""Prepare speed and memory: `gpt2train prepare files` against the plain loop people write by hand.

The plain loop is build-nanogpt's fineweb.py, written here from its description: a
`multiprocessing.Pool(workers).imap(tokenize, documents, chunksize=16)` where `tokenize` returns
`[eot] + encode_ordinary(text)` as uint16, copied into a preallocated shard buffer that is saved with
np.save when full (the first shard is val). Both run on the same parquet files with the same number of
processes, one after the other, each in a fresh Python process (the CLI for ours), and are timed from
start to exit; the median of the timed runs is reported. Peak memory comes from one more run of each: the
largest sum over its processes (the parent and its workers) of their proportional set size (PSS: a page
shared by n processes counts 1/n to each), sampled every 20 ms from /proc, which slows the run and so is
never timed; where there is no /proc, the largest single process's peak RSS instead (said in the result).

The default corpora are synthetic, made from Tiny Shakespeare. Short documents: 200 to 6,000 characters cut at
random places, in row groups of 1,024, at two sizes ten times apart, so that growth of memory with the corpus
shows. Long documents: 1 KB to 6 MB each (Tiny Shakespeare repeated past its end), log-uniform, a few to a file
and one row group per file, as a corpus of source files and manuals is: a worker then gets one document at a
time, and what its threads share shows (what it showed: docs/benchmarks.md).
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from gpt2train.files import write_json_atomic
from gpt2train.process_memory import can_read_pss, children_peak_rss, tree_pss
from gpt2train.units import format_utc

SYNTHETIC_FILES = 4
DOC_CHARS = (200, 6000)  # a synthetic document's length in characters: at least, and below
ROW_GROUP_ROWS = 1024  # a few MB of text per row group at any corpus size, as in published parquet datasets
LONG_DOC_CHARS = (1_000, 6_000_000)  # a long document's length in characters: at least, and at most
LONG_FILES = 8
MIN_LONG_CHARS = 20_000  # a long-document corpus this small still holds the documents a val split needs
PLAIN_SHARD_TOKENS = 100_000_000  # fineweb.py's shard size


@dataclass
class PrepareBenchOptions:
    inputs: list[str] = field(default_factory=list)  # the user's files or folders; empty: synthetic corpora
    chars: list[int] = field(default_factory=lambda: [12_000_000, 120_000_000])  # short-document corpus sizes
    long_chars: int = 120_000_000  # the long-document corpus's size; 0: none
    workers: int = 0  # processes for both (0: this machine's CPU count)
    repeats: int = 3  # timed runs of each


@dataclass
class Run:
    impl: str  # "gpt2train" or "plain loop"
    corpus: str
    tokens: int
    wall_s: float
    peak_mib: float | None  # None: a timed run (not sampled)


# --- the plain loop (runs in its own process: python -m gpt2train.bench.prepare INPUT... --out DIR) -------
_encoding = None


def _plain_tokenize(text: str) -> np.ndarray:
    tokens = [_encoding.eot_token]
    tokens.extend(_encoding.encode_ordinary(text))
    return np.array(tokens).astype(np.uint16)


def _plain_init():
    global _encoding
    from gpt2train.tokenizer import gpt2_encoding

    _encoding = gpt2_encoding()


def _parquet_texts(paths: list[Path]):
    import pyarrow.parquet as pq

    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(columns=["text"]):
            yield from batch.column(0).to_pylist()


def plain_loop(paths: list[Path], out_dir: Path, workers: int, shard_tokens: int = PLAIN_SHARD_TOKENS) -> int:
    """fineweb.py's loop over parquet files; returns the number of tokens written."""
    import multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    buffer = np.empty(shard_tokens, dtype=np.uint16)
    shard, count, total = 0, 0, 0

    def save(n: int):
        np.save(out_dir / f"{'val' if shard == 0 else 'train'}_{shard:06d}.npy", buffer[:n])

    with mp.get_context("fork").Pool(workers, initializer=_plain_init) as pool:
        for tokens in pool.imap(_plain_tokenize, _parquet_texts(paths), chunksize=16):
            total += tokens.size
            while tokens.size:
                take = min(tokens.size, shard_tokens - count)
                buffer[count:count + take] = tokens[:take]
                count, tokens = count + take, tokens[take:]
                if count == shard_tokens:
                    save(count)
                    shard, count = shard + 1, 0
    if count:
        save(count)
    return total


# --- measuring a run ----------------------------------------------------------------------------------
def measure(cmd: list[str], env: dict, memory: bool) -> tuple[float, float, str]:
    """(wall seconds, peak MiB, stderr) of a command run to its end; ChildProcessError with its last line when
    it fails. Sampling memory slows the run (reading a process's PSS walks its page tables), so a run measures
    its wall time or its memory: `memory` False gives a peak of 0."""
    peak = [0]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    done = threading.Event()

    def sample():
        while not done.wait(0.02):
            peak[0] = max(peak[0], tree_pss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    if memory and can_read_pss():
        sampler.start()
    _, stderr = proc.communicate()
    wall = time.perf_counter() - start
    done.set()
    if sampler.is_alive():
        sampler.join()
    if proc.returncode != 0:
        last = stderr.strip().splitlines()[-1].removeprefix("error: ") if stderr.strip() else f"exit {proc.returncode}"
        raise ChildProcessError(f"{' '.join(cmd[1:5])} ...: {last}")
    if memory and not can_read_pss():  # the largest single child's peak RSS
        peak[0] = children_peak_rss()
    return wall, peak[0] / 2**20, stderr


def run_ours(paths: list[Path], out: Path, workers: int, env: dict, memory: bool) -> tuple[int, float, float]:
    cmd = [sys.executable, "-m", "gpt2train", "prepare", "files", *map(str, paths), "--out", str(out),
           "--workers", str(workers)]
    wall, peak, _ = measure(cmd, env, memory)
    meta = json.loads((out / "meta.json").read_text())
    return sum(meta["tokens"].values()), wall, peak


def run_plain(paths: list[Path], out: Path, workers: int, env: dict, memory: bool) -> tuple[int, float, float]:
    cmd = [sys.executable, "-m", "gpt2train.bench.prepare", *map(str, paths), "--out", str(out),
           "--workers", str(workers)]
    wall, peak, stderr = measure(cmd, env, memory)
    return int(stderr.strip().splitlines()[-1].split()[0]), wall, peak


# --- the corpus ---------------------------------------------------------------------------------------
def parquet_files(inputs: list[str]) -> list[Path]:
    """The user's corpus: parquet files alone, the plain loop's input (SourceError in one line otherwise)."""
    from gpt2train.data.sources import SourceError, expand_inputs

    paths = expand_inputs(inputs)
    other = [p for p in paths if p.suffix.lower() != ".parquet"]
    if not paths or other:
        raise SourceError(f"bench prepare compares on .parquet files, the plain loop's input; "
                          f"{'found ' + str(other[0]) if other else 'found none in ' + ' '.join(inputs)}")
    return paths


def write_synthetic_corpus(out_dir: str | Path, chars: int, files: int = SYNTHETIC_FILES, seed: int = 0) -> list[Path]:
    """Parquet files of about `chars` characters in all: documents of 200-6,000 characters cut at random
    places from Tiny Shakespeare, in row groups of ROW_GROUP_ROWS documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpt2train.data.prepare import shakespeare_text

    text, rng = shakespeare_text(), np.random.default_rng(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        docs, size = [], 0
        while size < chars // files:
            length = int(rng.integers(*DOC_CHARS))
            start = int(rng.integers(0, len(text) - length))
            docs.append(text[start:start + length])
            size += length
        paths.append(out_dir / f"part_{f:03d}.parquet")
        pq.write_table(pa.table({"text": docs}), paths[-1], row_group_size=ROW_GROUP_ROWS)
    return paths


def write_long_document_corpus(out_dir: str | Path, chars: int, files: int = LONG_FILES, seed: int = 0) -> list[Path]:
    """Parquet files of about `chars` characters in all, one row group each: documents of LONG_DOC_CHARS characters
    (at most a twentieth of the corpus, so that a small one still has documents enough for a val split),
    log-uniform, taken from a random place in Tiny Shakespeare repeated end to end."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpt2train.data.prepare import shakespeare_text

    text, rng = shakespeare_text(), np.random.default_rng(seed)
    low, high = LONG_DOC_CHARS[0], max(LONG_DOC_CHARS[0] + 1, min(LONG_DOC_CHARS[1], chars // 20))
    docs, size = [], 0
    while size < chars:
        length = int(np.exp(rng.uniform(np.log(low), np.log(high))))
        start = int(rng.integers(0, len(text)))
        repeated = text * (1 + (start + length) // len(text))
        docs.append(repeated[start:start + length])
        size += length
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        part = docs[f::files]
        paths.append(out_dir / f"long_{f:03d}.parquet")
        pq.write_table(pa.table({"text": part}), paths[-1], row_group_size=max(1, len(part)))
    return paths


def min_synthetic_chars() -> int:
    """The smallest synthetic corpus `prepare files` can split by its default --val-fraction: each file holds
    documents until it reaches its share of the characters, so a share above (k - 1) of the longest documents
    gives it k of them, and the corpus at least the documents val needs."""
    from gpt2train.data.prepare import SplitRule

    per_file = math.ceil(SplitRule(None, None).documents_for_val() / SYNTHETIC_FILES)
    return SYNTHETIC_FILES * ((per_file - 1) * (DOC_CHARS[1] - 1) + 1)


# --- the benchmark ------------------------------------------------------------------------------------
def run_prepare_bench(options: PrepareBenchOptions, out_path: str | Path) -> dict:
    workers = options.workers or os.cpu_count() or 1
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                     os.environ.get("PYTHONPATH")]))}
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        if options.inputs:
            corpora = [(" ".join(options.inputs), parquet_files(options.inputs))]
        else:
            corpora = [(f"synthetic {chars:,} chars", write_synthetic_corpus(Path(tmp) / f"corpus-{chars}", chars))
                       for chars in options.chars]
            if options.long_chars:
                corpora.append((f"long documents {options.long_chars:,} chars",
                                write_long_document_corpus(Path(tmp) / "long", options.long_chars)))
        for name, paths in corpora:
            # timed runs alternating, so drift in the machine's speed hits both; then one run each for memory
            for memory in [False] * options.repeats + [True]:
                for impl, run in (("plain loop", run_plain), ("gpt2train", run_ours)):
                    out = Path(tmp) / "out"
                    tokens, wall, peak = run(paths, out, workers, env, memory)
                    shutil.rmtree(out)
                    runs.append(Run(impl, name, tokens, wall, peak if memory else None))
                    what = f"peak {peak:,.0f} MiB" if memory else f"{tokens / wall:,.0f} tokens/s, {wall:.2f} s"
                    print(f"  {name}: {impl} {what}", file=sys.stderr, flush=True)
    result = {"workers": workers, "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "memory": "PSS summed over the run's processes" if can_read_pss() else "largest process's peak RSS",
              "repeats": options.repeats, "date": format_utc(time.time()), "runs": [asdict(r) for r in runs],
              "summary": summary(runs)}
    result["markdown"] = to_markdown(result)
    write_json_atomic(out_path, result)
    return result


def summary(runs: list[Run]) -> dict:
    """Per corpus and implementation: the median wall time of the timed runs, its tokens/s, the memory run's
    peak; and per corpus, ours against the plain loop."""
    out = {}
    for corpus in dict.fromkeys(r.corpus for r in runs):
        rows = {}
        for impl in ("plain loop", "gpt2train"):
            mine = [r for r in runs if r.corpus == corpus and r.impl == impl]
            wall = float(np.median([r.wall_s for r in mine if r.peak_mib is None]))
            rows[impl] = {"tokens": mine[0].tokens, "wall_s": wall, "tokens_per_s": mine[0].tokens / wall,
                          "walls_s": [r.wall_s for r in mine if r.peak_mib is None],
                          "peak_mib": next(r.peak_mib for r in mine if r.peak_mib is not None)}
        ours, plain = rows["gpt2train"], rows["plain loop"]
        out[corpus] = {**rows, "speed_ratio": plain["wall_s"] / ours["wall_s"],
                       "memory_ratio": ours["peak_mib"] / plain["peak_mib"]}
    return out


def to_markdown(result: dict) -> str:
    lines = [f"{result['workers']} workers each (the plain loop's processes; gpt2train's threads for GPT-2's "
             f"tiktoken), {result['cpus']} CPUs; wall time: median of {result['repeats']} runs each, alternating; "
             f"memory: one more run each, {result['memory']}", "",
             "| corpus | impl | tokens | tokens/s | wall (s) | runs (s) | peak memory (MiB) |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: |"]
    for corpus, row in result["summary"].items():
        for impl in ("plain loop", "gpt2train"):
            r = row[impl]
            lines.append(f"| {corpus} | {impl} | {r['tokens']:,} | {r['tokens_per_s']:,.0f} | {r['wall_s']:.2f} | "
                         f"{', '.join(f'{w:.2f}' for w in r['walls_s'])} | {r['peak_mib']:,.0f} |")
    lines.append("")
    for corpus, row in result["summary"].items():
        lines.append(f"{corpus}: gpt2train {row['speed_ratio']:.2f}x the plain loop's speed at "
                     f"{row['memory_ratio']:.2f}x its peak memory")
    return "\n".join(lines)


def plain_loop_main(argv=None) -> int:
    """The plain loop alone, in its own process (run_plain): prints the token count last on stderr."""
    import argparse

    ap = argparse.ArgumentParser(description="fineweb.py's loop over parquet files (gpt2train bench prepare)")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    from gpt2train.data.sources import expand_inputs

    total = plain_loop(expand_inputs(args.inputs), Path(args.out), args.workers)
    print(f"{total} tokens", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(plain_loop_main())
