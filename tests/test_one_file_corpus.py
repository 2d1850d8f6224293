"""One file is a corpus (issue 46): `prepare files my.txt` splits a single document into train and val by its
tokens, and validation on a val split too small for the training batch reads what it holds (fewer rows, then
shorter ones, said once) instead of refusing to train."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import one_line, run_cli
from gpt2train.data.loader import DataError, TokenLoader, fitting_batch
from gpt2train.data.prepare import prepare_files, shakespeare_text
from gpt2train.data.prepared import load_meta
from gpt2train.data.shards import open_tokens
from gpt2train.eval.periodic import small_val_notes
from gpt2train.eval.val import validation_loss
from gpt2train.model import GPT, GPTConfig
from gpt2train.tokenizer import tokenizer_from_name


def split_tokens(folder) -> tuple[np.ndarray, np.ndarray]:
    meta = load_meta(folder)
    return tuple(np.concatenate([open_tokens(folder / name) for name in meta["shards"][s]]) for s in ("train", "val"))


def test_prepare_files_splits_one_document_by_its_tokens(tmp_path):
    """Bug: one text file was refused ("1 document cannot be split into train and val")."""
    text = shakespeare_text()[:20_000]
    (tmp_path / "my.txt").write_text(text)
    r = run_cli("prepare", "files", "my.txt", "--out", "data/mine", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    train, val = split_tokens(tmp_path / "data" / "mine")
    tok = tokenizer_from_name("gpt2")
    whole = [tok.eot_id, *tok.encode(text)]
    assert np.concatenate([train, val]).tolist() == whole  # the document's tokens, in order, cut once
    cut = len(whole) * 9 // 10  # the default --val-fraction 0.1: the last tenth to val
    assert (len(train), len(val)) == (cut, len(whole) - cut)
    assert r.stdout.splitlines() == [
        f"wrote data/mine: {cut:,} train tokens in 1 shard(s), {len(whole) - cut:,} val tokens in 1 shard(s), "
        f"1 document, split by tokens: its last 10% to val (gpt2 tokenizer, vocab 50,257)"]

    r = run_cli("prepare", "files", "my.txt", "--out", "data/n", "--val-tokens", "500", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert load_meta(tmp_path / "data" / "n")["tokens"] == {"train": len(whole) - 500, "val": 500}
    assert "1 document, split by tokens: its last 500 tokens to val" in r.stdout


def test_one_document_too_short_for_the_split_asked_is_one_line(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a few words")
    message = one_line(ValueError, prepare_files, [one], tmp_path / "out", val_tokens=100, workers=1, progress=False)
    assert message == ("1 document of 4 tokens leaves the train split empty with --val-tokens 100; use a "
                       "--val-tokens below 4, or add text")
    assert not (tmp_path / "out").exists()
    meta = prepare_files([one], tmp_path / "out", workers=1, progress=False)  # a tenth of 4 tokens: the last one
    assert meta["tokens"] == {"train": 3, "val": 1} and meta["split"] == {"val_fraction": "1/10", "by": "tokens"}


def test_a_batch_too_large_for_the_split_becomes_fewer_rows_then_shorter_ones():
    assert fitting_batch([1000], 8, 32, 1, "sequential") == (8, 32)  # 31 windows: the batch asked for
    assert fitting_batch([100], 8, 32, 1, "sequential") == (3, 32)  # 3 windows: 3 rows
    assert fitting_batch([100], 8, 32, 2, "sequential") == (1, 32)  # 3 windows over 2 ranks: a row each
    assert fitting_batch([20], 8, 32, 1, "sequential") == (1, 19)  # under one window: one row of what there is
    assert fitting_batch([20], 8, 32, 2, "sequential") == (1, 9)  # and one for each rank
    assert fitting_batch([1], 8, 32, 1, "sequential") == (8, 32)  # nothing to read: the loader says so


@pytest.fixture
def small_val(tmp_path):
    """One document of 1,000 characters, char-tokenized: 101 val tokens, 3 windows of 33."""
    text = shakespeare_text()[:1000]
    (tmp_path / "my.txt").write_text(text)
    prepare_files([tmp_path / "my.txt"], tmp_path / "data", tokenizer="char", workers=1, progress=False)
    return tmp_path / "data"


def test_validation_reads_a_small_val_split_once(small_val):
    with pytest.raises(DataError, match="fewer than one batch needs"):  # the batch a training step takes
        TokenLoader(small_val, "val", 8, 32, order="sequential")
    loader = TokenLoader(small_val, "val", 8, 32, order="sequential", fit=True)
    assert (loader.B, loader.T, loader.requested, loader.batches_per_pass()) == (3, 32, (8, 32), 1)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=32, vocab_size=load_meta(small_val)["vocab_size"]))
    model.eval()
    out = validation_loss(model, loader, batches=20)
    assert (out["windows"], out["tokens"]) == (3, 96)  # each window once, not 20 batches of them again
    assert small_val_notes(loader, 20) == [
        f"the val split of {small_val} holds 101 tokens, less than eval.val_batches = 20 batches of 8 x 32; "
        "validation reads what it holds, no window twice: 1 batch of 3 x 32"]
    short = TokenLoader(small_val, "val", 8, 128, order="sequential", fit=True)
    assert small_val_notes(short, 0) == [
        f"the val split of {small_val} holds 101 tokens, less than one batch of 8 x 128; validation reads what it "
        "holds, no window twice: 1 batch of 1 x 100 (shorter rows than train.seq_len = 128: less context, a higher loss)"]
    enough = TokenLoader(small_val, "train", 8, 32, order="sequential", fit=True)  # 900 tokens: 3 batches
    assert small_val_notes(enough, 3) == small_val_notes(enough, 0) == []


@pytest.mark.slow
def test_one_text_file_prepared_trained_and_sampled(tmp_path):
    """The README's "train on your own text" with the quickstart's preset, shrunk: a val split of 251 tokens
    holds 7 windows, fewer than the 8 rows of a batch, which the trainer refused."""
    (tmp_path / "my.txt").write_text(shakespeare_text()[:2500])
    r = run_cli("prepare", "files", "my.txt", "--out", "data/mine", "--tokenizer", "char", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert load_meta(tmp_path / "data" / "mine")["tokens"]["val"] == 251
    r = run_cli("train", "--config", "shakespeare-cpu", "--set", "data.dir=data/mine", "--out", "runs/mine",
                "--set", "model.depth=1", "--set", "model.block_size=32", "--set", "train.seq_len=32",
                "--set", "train.max_steps=4", "--set", "eval.interval=2", "--set", "eval.sample_interval=0",
                "--set", "train.device=cpu", "--set", "train.dtype=float32", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: the val split")]
    assert notes == ["note: the val split of data/mine holds 251 tokens, less than eval.val_batches = 20 batches of "
                     "8 x 32; validation reads what it holds, no window twice: 1 batch of 7 x 32"]
    assert r.stdout.count(": val loss ") == 2 and "finished at step 4" in r.stdout
    r = run_cli("sample", "--ckpt", "runs/mine", "--prompt", "RO", "--max-new-tokens", "5", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
