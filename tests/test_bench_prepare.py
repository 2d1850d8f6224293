"""gpt2train bench prepare: ours and the plain fineweb.py loop on the same parquet files, side by side."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import run_cli
from gpt2train.bench.prepare import (
    LONG_FILES,
    min_synthetic_chars,
    plain_loop,
    write_long_document_corpus,
    write_synthetic_corpus,
)
from gpt2train.data.prepare import SplitRule, prepare_files
from gpt2train.data.shards import open_shard
from gpt2train.tokenizer import GPT2Tokenizer


def test_the_plain_loop_writes_the_tokens_prepare_writes(tmp_path):
    """Both sides of the comparison do the same work: the same documents, each as [eot] + its tokens."""
    paths = write_synthetic_corpus(tmp_path / "corpus", 40_000, files=2)
    texts = [t for p in paths for t in pq.read_table(p).column("text").to_pylist()]
    assert 40_000 <= sum(map(len, texts)) < 40_000 + 2 * 6000 and all(200 <= len(t) < 6000 for t in texts)
    total = plain_loop(paths, tmp_path / "plain", workers=2, shard_tokens=5_000)
    plain = np.concatenate([np.load(p) for p in sorted((tmp_path / "plain").glob("*.npy"),
                                                         key=lambda p: p.name.split("_")[1])])
    tok = GPT2Tokenizer()
    expected = [i for t in texts for i in [tok.eot_id, *tok.encode(t)]]
    assert total == len(expected) and plain.tolist() == expected
    meta = prepare_files(paths, tmp_path / "ours", val_fraction=0, workers=2, progress=False)
    ours = np.concatenate([open_shard(tmp_path / "ours" / n) for n in meta["shards"]["train"]])
    assert ours.tolist() == expected


@pytest.mark.slow
def test_bench_prepare_reports_both_on_short_and_long_documents(tmp_path):
    out = tmp_path / "bench.json"
    r = run_cli("bench", "prepare", "--chars", "60000", "--long-chars", "120000", "--workers", "2", "--repeats", "2",
                "--out", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    runs = result["runs"]  # per corpus: 2 timed runs each, alternating, then one each for memory
    assert [(x["corpus"], x["impl"], x["peak_mib"] is None) for x in runs] == [
        (corpus, impl, timed) for corpus in ("synthetic 60,000 chars", "long documents 120,000 chars")
        for timed in (True, True, False) for impl in ("plain loop", "gpt2train")]
    assert len({x["tokens"] for x in runs[:6]}) == 1 and runs[0]["tokens"] < runs[6]["tokens"]
    assert all(x["wall_s"] > 0 and (x["peak_mib"] is None or x["peak_mib"] > 10) for x in runs)
    small = result["summary"]["synthetic 60,000 chars"]
    assert small["gpt2train"]["walls_s"] == [runs[1]["wall_s"], runs[3]["wall_s"]]
    assert small["speed_ratio"] == small["plain loop"]["wall_s"] / small["gpt2train"]["wall_s"]
    assert small["memory_ratio"] == runs[5]["peak_mib"] / runs[4]["peak_mib"]
    assert "gpt2train" in r.stdout and "x the plain loop's speed at" in r.stdout and result["workers"] == 2


def test_the_long_document_corpus_has_few_long_documents_per_file_in_one_row_group(tmp_path):
    paths = write_long_document_corpus(tmp_path / "long", 2_000_000)
    texts = [pq.read_table(p).column("text").to_pylist() for p in paths]
    sizes = [len(t) for file in texts for t in file]
    assert len(paths) == LONG_FILES and all(pq.read_metadata(p).num_row_groups == 1 for p in paths)
    assert 2_000_000 <= sum(sizes) < 2_000_000 + 100_000 and min(sizes) >= 1_000 and max(sizes) <= 100_000
    assert max(sizes) > 20 * min(sizes) and max(len(file) for file in texts) < 40  # a spread of sizes, few to a file
    assert len(sizes) >= SplitRule(None, None).documents_for_val()
    assert write_long_document_corpus(tmp_path / "again", 2_000_000) and all(  # the same corpus from the same seed
        pq.read_table(a).equals(pq.read_table(b)) for a, b in zip(paths, sorted((tmp_path / "again").glob("*"))))


@pytest.mark.slow
def test_bench_prepare_on_files_that_are_not_parquet_is_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    r = run_cli("bench", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "b.json"))
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"error: bench prepare compares on .parquet files, the plain loop's input; found {tmp_path / 'a.txt'}"]
    r = run_cli("bench", "prepare", "--chars", "12e6,5")
    assert r.returncode == 2 and f"at least {min_synthetic_chars()} characters" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_cli("bench", "prepare", "--long-chars", "5000")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "0 (no long-document corpus)" in r.stderr


def test_the_smallest_synthetic_corpus_accepted_can_be_split(tmp_path):
    """--chars 1e4 was accepted, then `prepare files` failed on its 6 documents ('leave the val split empty with
    --val-fraction 0.1', an option bench prepare does not have): the smallest size now always holds enough."""
    needed = SplitRule(None, None).documents_for_val()
    for seed in range(20):
        paths = write_synthetic_corpus(tmp_path / str(seed), min_synthetic_chars(), seed=seed)
        assert sum(pq.read_metadata(p).num_rows for p in paths) >= needed
    r = run_cli("bench", "prepare", "--chars", "1e4", "--out", str(tmp_path / "b.json"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "b.json").exists()
