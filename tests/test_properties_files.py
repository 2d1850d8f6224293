"""Property-based tests (hypothesis): generated malformed files thrown at `prepare` and at the readers of
prepared data and checkpoints. Each call either succeeds or fails in one line (`error: ...` and status 1 for
the CLI, a one-line ValueError/OSError for the library), never with a traceback; prepare writes nothing
outside its output folder and leaves a dataset already there untouched when it fails.

Examples are derandomized (the same ones on every run) and few enough for seconds on 2 cores;
GPT2TRAIN_PROPERTY_EXAMPLES=2000 runs a longer hunt.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import gpt2train.checkpoint as C
from conftest import run_here
from gpt2train.config import Config, to_dict
from gpt2train.data.loader import TokenLoader
from gpt2train.data.prepare import prepare_files
from gpt2train.data.prepared import load_meta
from gpt2train.data.shards import open_shard
from gpt2train.eval.val import ValWindows
from gpt2train.loading import load_for_inference
from gpt2train.model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")
EXAMPLES = int(os.environ.get("GPT2TRAIN_PROPERTY_EXAMPLES", 200))  # raise it for a longer hunt
BOUNDED = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
GOOD_TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 20


# --- generated input files ------------------------------------------------------------------------------
def parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


texts = st.text(max_size=200)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3), max_leaves=6)
json_rows = st.one_of(
    st.fixed_dictionaries({"text": texts}),  # well formed
    st.fixed_dictionaries({"body": texts}),  # no text field
    st.fixed_dictionaries({"text": json_values}),  # a field that may not be a string
    json_values,  # not an object
)


@st.composite
def jsonl_file(draw) -> bytes:
    rows = draw(st.lists(json_rows, max_size=5))
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]  # cut anywhere, even inside a line
    return data


@st.composite
def text_file(draw) -> bytes:
    text = draw(texts)
    data = text.encode(draw(st.sampled_from(["utf-8", "latin-1", "utf-16", "utf-16-le"])), errors="replace")
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]  # truncated mid-character
    return data


@st.composite
def parquet_file(draw) -> bytes:
    n = draw(st.integers(0, 4))
    column = draw(st.sampled_from(["text", "content"]))
    values = draw(st.sampled_from([
        lambda: pa.array([draw(texts) for _ in range(n)], pa.string()),
        lambda: pa.array(list(range(n)), pa.int64()),
        lambda: pa.array([None] * n, pa.string()),
        lambda: pa.array([[1, 2]] * n, pa.list_(pa.int64())),
    ]))()
    data = parquet_bytes(pa.table({column: values}))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return data


input_file = st.one_of(
    st.tuples(st.just(".txt"), st.just(GOOD_TEXT.encode())),  # so that some examples do prepare
    st.tuples(st.sampled_from([".txt", ".jsonl", ".parquet"]), st.binary(max_size=300)),  # random bytes
    st.tuples(st.sampled_from([".txt", ".jsonl", ".parquet"]), st.just(b"")),  # empty
    st.tuples(st.just(".txt"), text_file()),
    st.tuples(st.just(".jsonl"), jsonl_file()),
    st.tuples(st.just(".parquet"), parquet_file()),
)


# --- what must hold -------------------------------------------------------------------------------------
def tree_hashes(root: Path, skip: Path | None = None) -> dict[str, str]:
    """sha256 of every file under root (apart from `skip`), and the folders, by relative path."""
    out = {}
    for path in sorted(root.rglob("*")):
        if skip is not None and (path == skip or skip in path.parents):
            continue
        rel = path.relative_to(root).as_posix()
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


def run_main(argv: list[str]) -> tuple[int, str]:
    """cli.main in this process: (status, stderr). An exception escaping main fails the test as it is."""
    r = run_here(*argv)
    return r.returncode, r.stderr


def assert_one_error_line(status: int, stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    if status == 0:
        return
    # 1: a failure found while working; 2: a bad argument (a generated --val-fraction out of its range)
    assert status == 1 or (status == 2 and "error: argument " in stderr), (status, stderr)
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr  # tqdm's bar may come before it


def assert_one_line_or_none(fn, *args, **kwargs):
    """fn succeeds, or raises a ValueError/OSError whose message is one line."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, OSError) as e:
        assert str(e) and len(str(e).splitlines()) == 1, repr(e)
        return None


@pytest.fixture(scope="module")
def existing_dataset(tmp_path_factory) -> Path:
    """A small prepared dataset, copied into the output folder of every example before prepare runs."""
    root = tmp_path_factory.mktemp("existing")
    for k in range(4):
        (root / f"{k}.txt").write_text(GOOD_TEXT[k * 40:])
    prepare_files([root], root / "out", tokenizer="char", val_fraction=0.25, workers=1, progress=False)
    return root / "out"


@pytest.mark.slow
@BOUNDED
@given(files=st.lists(input_file, min_size=1, max_size=3), tokenizer=st.sampled_from(["gpt2", "char"]),
       val_fraction=st.sampled_from(["0", "0.5"]))
def test_prepare_files_succeeds_or_fails_in_one_line_and_touches_nothing_else(existing_dataset, files, tokenizer,
                                                                               val_fraction):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "cwd").mkdir()
        inputs = root / "in"
        inputs.mkdir()
        for k, (suffix, data) in enumerate(files):
            (inputs / f"doc{k}{suffix}").write_bytes(data)
        out = root / "out"
        shutil.copytree(existing_dataset, out)
        before, before_out = tree_hashes(root, skip=out), tree_hashes(out)
        cwd = os.getcwd()
        os.chdir(root / "cwd")  # a stray relative write would land here
        try:
            status, stderr = run_main(["prepare", "files", str(inputs), "--out", str(out), "--workers", "1",
                                       "--tokenizer", tokenizer, "--val-fraction", val_fraction])
        finally:
            os.chdir(cwd)
        assert_one_error_line(status, stderr)
        event("prepared" if status == 0 else "refused")  # both kinds occur: --hypothesis-show-statistics
        assert tree_hashes(root, skip=out) == before  # inputs, cwd and the rest unchanged
        if status == 0:
            meta = load_meta(out)
            assert not list(out.glob(".prepare-*"))
            for names in meta["shards"].values():
                for name in names:
                    assert open_shard(out / name).max() < meta["vocab_size"]
        else:
            assert tree_hashes(out) == before_out  # the dataset already there, byte for byte


# --- readers of prepared data ---------------------------------------------------------------------------
header_ints = st.integers(-(2**31), 2**31 - 1) | st.sampled_from([20240520, 20240801, 1, 7, 0])


@st.composite
def damaged_shard(draw, good: bytes) -> bytes:
    kind = draw(st.sampled_from(["random", "truncated", "header", "body", "appended"]))
    if kind == "random":
        return draw(st.binary(max_size=2000))
    if kind == "truncated":
        return good[: draw(st.integers(0, len(good) - 1))]
    if kind == "header":  # one of magic, version, count replaced
        data = bytearray(good)
        slot = draw(st.integers(0, 2))
        data[slot * 4:slot * 4 + 4] = np.int32(draw(header_ints)).tobytes()
        return bytes(data)
    if kind == "body":  # ids beyond the vocabulary, the recorded largest id now stale
        data = bytearray(good)
        at = draw(st.integers(1024, len(good) - 2)) & ~1
        data[at:at + 2] = np.uint16(draw(st.integers(0, 2**16 - 1))).tobytes()
        return bytes(data)
    return good + draw(st.binary(min_size=1, max_size=10))


@BOUNDED
@given(data=st.data(), split=st.sampled_from(["train", "val"]))
def test_damaged_shards_are_read_or_refused_in_one_line(existing_dataset, data, split):
    meta = load_meta(existing_dataset)
    name = meta["shards"][split][0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "data"
        shutil.copytree(existing_dataset, folder)
        (folder / name).write_bytes(data.draw(damaged_shard((existing_dataset / name).read_bytes())))
        vocab = meta["vocab_size"]
        loader = assert_one_line_or_none(TokenLoader, folder, split, 2, 8, vocab_size=vocab, mode="memmap")
        event("opened" if loader is not None else "refused")
        if loader is not None:
            for _ in range(3):
                batch = assert_one_line_or_none(loader.next_batch)
                if batch is not None:
                    assert int(batch[0].max()) < vocab  # never an index error in the embedding
        windows = assert_one_line_or_none(ValWindows, folder, 8, split, vocab_size=vocab)
        if windows is not None:
            assert_one_line_or_none(windows.gather, np.arange(len(windows)))


@BOUNDED
@given(content=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_a_damaged_meta_json_is_read_or_refused_in_one_line(existing_dataset, content):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "data"
        shutil.copytree(existing_dataset, folder)
        (folder / "meta.json").write_bytes(content)
        assert_one_line_or_none(TokenLoader, folder, "train", 2, 8, vocab_size=100)


# --- readers of checkpoints -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real, tiny plain checkpoint: weights, optimizer state after one step, scaler, ranks, meta."""
    cfg = Config()
    cfg.model = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    model = GPT(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.zeros(1, 8, dtype=torch.long)
    model(x, x)[1].backward()
    optimizer.step()
    state = {"optimizer": optimizer.state_dict(), "scaler": {}, "ranks": [], "guard": {}}
    run = tmp_path_factory.mktemp("ckpt") / "run"
    return C.save_checkpoint(run, 1, C.model_state(model), state, {"tokens": 8, "config": to_dict(cfg)})


@st.composite
def damaged_file(draw, good: bytes) -> bytes:
    kind = draw(st.sampled_from(["random", "truncated", "flipped", "empty"]))
    if kind == "random":
        return draw(st.binary(max_size=500))
    if kind == "truncated":
        return good[: draw(st.integers(0, len(good) - 1))]
    if kind == "flipped":
        data = bytearray(good)
        at = draw(st.integers(0, len(good) - 1))
        data[at] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    return b""


@pytest.mark.slow
@BOUNDED
@given(data=st.data(), target=st.sampled_from(["model.safetensors", "state.pt", "meta.json"]),
       sizes_fixed=st.booleans())
def test_damaged_checkpoints_load_or_are_refused_in_one_line(checkpoint, data, target, sizes_fixed):
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "step_00000001"
        shutil.copytree(checkpoint, ckpt)
        (ckpt / target).write_bytes(data.draw(damaged_file((checkpoint / target).read_bytes())))
        if sizes_fixed and target != "meta.json":  # past the size and checksum checks, into the parsers
            meta = json.loads((ckpt / "meta.json").read_text())
            meta["files"][target] = (ckpt / target).stat().st_size
            meta["files_crc32"][target] = zlib.crc32((ckpt / target).read_bytes())
            (ckpt / "meta.json").write_text(json.dumps(meta))
        loaded = assert_one_line_or_none(load_for_inference, ckpt)
        event("loaded" if loaded is not None else "refused")
        if loaded is not None:
            model = GPT(loaded[0].config)
            assert_one_line_or_none(C.load_training_checkpoint, ckpt, model, torch.optim.AdamW(model.parameters()),
                                    sharded=False)
        assert_one_line_or_none(C.describe_checkpoint, ckpt)
