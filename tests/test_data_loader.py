"""TokenLoader: batches equal plain slicing, orders are seeded and cover the data, ranks are disjoint,
resume is exact, other projects' layouts are read, and bad data fails with one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import gpt2train.data.loader as loader_module
import gpt2train.data.prepared as prepared_module
from conftest import one_line, run_cli
from gpt2train.data.loader import DataError, TokenLoader
from gpt2train.data.prepare import prepare_shakespeare
from gpt2train.data.prepared import load_meta
from gpt2train.data.shards import ShardError, write_shard
from gpt2train.eval.val import ValWindows

T = 8
SHARD_LENGTHS = (4 * T + 1, 50, 9, 3 * T + 1)  # varied, one shard barely longer than a window


def make_dataset(folder, lengths=SHARD_LENGTHS, val_lengths=(40,), vocab=1000):
    """Shards whose token at global position p is p % vocab, so every window says where it came from."""
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer": {"kind": "char", "chars": "x"}, "vocab_size": vocab, "eot_id": 0, "shards": {}, "tokens": {}}
    position = 0
    for split, sizes in (("train", lengths), ("val", val_lengths)):
        meta["shards"][split] = []
        for k, n in enumerate(sizes):
            name = f"{split}_{k:06d}.bin"
            write_shard(folder / name, np.arange(position, position + n) % vocab, vocab)
            meta["shards"][split].append(name)
            position += n
        meta["tokens"][split] = sum(sizes)
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.fixture
def data(tmp_path):
    return make_dataset(tmp_path / "d")


def reference_batch(shards: list[np.ndarray], ids, order: str) -> np.ndarray:
    """The loader's batch rebuilt with plain Python: walk the shards to find each window id, then slice."""
    rows = []
    for i in ids:
        for tokens in shards:
            n = len(tokens) - T if order == "random" else (len(tokens) - 1) // T
            n = max(n, 0)
            if i < n:
                start = i if order == "random" else i * T
                rows.append(list(tokens[start:start + T + 1]))
                break
            i -= n
    return np.array(rows)


@pytest.mark.parametrize("order", ["random", "sequential"])
@pytest.mark.parametrize("mode", ["ram", "memmap"])
def test_vectorized_batch_equals_python_slicing(data, order, mode):
    loader = TokenLoader(data, "train", 5, T, order=order, mode=mode, seed=3)
    shards = [np.asarray(s) for s in loader.shards]
    for _ in range(7):
        probe = TokenLoader(data, "train", 5, T, order=order, mode=mode)
        probe.load_state_dict(loader.state_dict())
        ids = probe._window_ids()
        expected = reference_batch(shards, ids, order)
        assert np.array_equal(loader.next_batch_numpy(), expected)


def test_x_y_are_shifted_windows(data):
    loader = TokenLoader(data, "train", 4, T, seed=0)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, T) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y - x, torch.ones_like(x))  # consecutive positions in make_dataset's shards


def test_sequential_covers_every_window_once_per_epoch(data):
    # a shard of k*T + 1 tokens holds k windows; one of T + 1 tokens exactly one; 9 tokens one (T = 8)
    loader = TokenLoader(data, "train", 1, T, order="sequential", seed=5)
    assert loader.starts_per_shard.tolist() == [4, 6, 1, 3]
    total = int(loader.cum_starts[-1])
    for epoch in range(2):
        seen = [tuple(loader.next_batch_numpy()[0, :2]) for _ in range(total)]
        assert len(set(seen)) == total  # each window once
        assert loader.epoch == epoch + 1 and loader.position == 0


def test_two_ranks_never_share_a_window_and_together_cover_the_epoch(data):
    total = 14  # windows in the sequential order (4 + 6 + 1 + 3)
    for order in ("random", "sequential"):
        ranks = [TokenLoader(data, "train", 1, T, order=order, seed=9, rank=r, world_size=2) for r in range(2)]
        seen = []
        for _ in range(total // 2):
            a, b = (tuple(r.next_batch_numpy()[0]) for r in ranks)
            assert a != b, order
            seen += [a, b]
        if order == "sequential":
            assert len(set(seen)) == total
        assert ranks[0].state_dict() == ranks[1].state_dict()  # identical state on every rank


def test_sequential_steps_never_mix_epochs(data):
    """14 windows, 6 per step: each epoch gives 2 steps of distinct windows and drops its last 2 windows."""
    ranks = [TokenLoader(data, "train", 3, T, order="sequential", seed=0, rank=r, world_size=2) for r in range(2)]
    for step in range(9):
        rows = np.concatenate([r.next_batch_numpy() for r in ranks])
        assert len({tuple(row) for row in rows}) == 6, step
        assert (ranks[0].epoch, ranks[0].position) == ((step + 1) // 2, 6 if step % 2 == 0 else 0)


def test_random_order_has_distinct_windows_within_a_step(data):
    loader = TokenLoader(data, "train", 16, T, order="random", seed=0)
    for _ in range(20):
        starts = loader.next_batch_numpy()[:, 0]
        assert len(set(starts.tolist())) == 16


@pytest.mark.parametrize("order", ["random", "sequential"])
def test_resume_mid_epoch_gives_identical_batches(data, order):
    loader = TokenLoader(data, "train", 3, T, order=order, seed=11)
    for _ in range(3):  # into the first epoch (14 windows, 3 per step)
        loader.next_batch_numpy()
    state = json.loads(json.dumps(loader.state_dict()))  # survives serialization
    expected = [loader.next_batch_numpy() for _ in range(10)]  # crosses epoch boundaries
    resumed = TokenLoader(data, "train", 3, T, order=order, seed=0)
    resumed.load_state_dict(state)
    assert all(np.array_equal(a, resumed.next_batch_numpy()) for a in expected)


@pytest.mark.parametrize("order", ["random", "sequential"])
def test_resume_with_another_micro_batch_or_world_size_takes_the_same_windows(data, order):
    """Steps of 4 windows as 1 rank x 4, saved after 2 steps, resumed as 1 rank x 2 x 2 micro-batches and as
    2 ranks x 1 x 2 micro-batches: every step takes the same 4 windows, across epoch ends too."""
    saved = TokenLoader(data, "train", 4, T, order=order, seed=5)
    for _ in range(2):
        saved.next_batch_numpy()
    state = json.loads(json.dumps(saved.state_dict()))
    steps = [saved.next_batch_numpy() for _ in range(8)]  # 14 sequential windows: three epoch ends
    half = TokenLoader(data, "train", 2, T, order=order)
    half.load_state_dict(state)
    ranks = [TokenLoader(data, "train", 1, T, order=order, rank=r, world_size=2) for r in range(2)]
    for loader in ranks:
        loader.load_state_dict(state)
    for step in steps:
        assert np.array_equal(np.concatenate([half.next_batch_numpy() for _ in range(2)]), step)
        passes = [[loader.next_batch_numpy() for loader in ranks] for _ in range(2)]  # each pass: rank 0's, rank 1's
        assert np.array_equal(np.concatenate([rows for p in passes for rows in p]), step)
    assert half.state_dict()["pending"] == [] and half.state_dict()["draw"] == 4


def test_seed_determinism_and_reset(data):
    a = TokenLoader(data, "train", 4, T, seed=1)
    b = TokenLoader(data, "train", 4, T, seed=1)
    c = TokenLoader(data, "train", 4, T, seed=2)
    first = [a.next_batch_numpy() for _ in range(5)]
    assert all(np.array_equal(x, b.next_batch_numpy()) for x in first)
    assert not all(np.array_equal(x, c.next_batch_numpy()) for x in first)
    a.reset()
    assert np.array_equal(a.next_batch_numpy(), first[0])


def test_auto_mode_follows_free_memory(data, monkeypatch):
    assert TokenLoader(data, "train", 2, T, mode="auto").mode == "ram"
    monkeypatch.setattr(loader_module, "available_ram_bytes", lambda: 0)
    memmapped = TokenLoader(data, "train", 2, T, mode="auto")
    assert memmapped.mode == "memmap" and isinstance(memmapped.shards[0], np.memmap)
    in_ram = TokenLoader(data, "train", 2, T, mode="ram")
    assert all(np.array_equal(memmapped.next_batch_numpy(), in_ram.next_batch_numpy()) for _ in range(5))


@pytest.mark.gpu
def test_cuda_batches_match_cpu(data):
    gpu = TokenLoader(data, "train", 4, T, seed=2, device="cuda")
    cpu = TokenLoader(data, "train", 4, T, seed=2)
    for _ in range(3):
        (xg, yg), (xc, yc) = gpu.next_batch(), cpu.next_batch()
        assert xg.is_cuda and torch.equal(xg.cpu(), xc) and torch.equal(yg.cpu(), yc)


# --- other projects' layouts (no meta.json) ------------------------------------------------------------
def tokens(n, offset=0):
    return (np.arange(n) + offset) % 50257


def check_layout(folder, train: list, val, fmt, capsys):
    """load_meta synthesizes a GPT-2 meta; sequential windows come from the right shards at k*T."""
    meta = load_meta(folder)
    assert meta["format"] == fmt and meta["vocab_size"] == 50257 and meta["tokenizer"] == {"kind": "gpt2"}
    assert meta["tokens"] == {"train": sum(len(t) for t in train), "val": len(val)}
    assert "no meta.json" in capsys.readouterr().err
    loader = TokenLoader(folder, "train", 2, T, order="sequential", seed=0)
    seen = {tuple(loader.next_batch_numpy()[i]) for _ in range(3) for i in range(2)}
    windows = {tuple(t[k * T:k * T + T + 1]) for t in train for k in range((len(t) - 1) // T)}
    assert seen <= windows and len(seen) == 6
    first_val = TokenLoader(folder, "val", 1, T, order="sequential").next_batch_numpy()[0]
    assert tuple(first_val) in {tuple(val[k * T:k * T + T + 1]) for k in range((len(val) - 1) // T)}
    # validation loss reads the same layout: every window at k*T, the header-less file read as tokens
    windows = ValWindows(folder, T)
    expected = np.stack([val[k * T:k * T + T + 1] for k in range((len(val) - 1) // T)])
    np.testing.assert_array_equal(windows.gather(np.arange(len(windows))), expected)


def test_reads_nanogpt_bin(tmp_path, capsys):
    train, val = tokens(200), tokens(60, 7)
    train.astype("<u2").tofile(tmp_path / "train.bin")
    val.astype("<u2").tofile(tmp_path / "val.bin")
    check_layout(tmp_path, [train], val, "nanogpt", capsys)


def test_reads_build_nanogpt_npy(tmp_path, capsys):
    train = [tokens(100), tokens(120, 3)]
    val = tokens(50, 9)
    np.save(tmp_path / "edufineweb_val_000000.npy", val.astype(np.uint16))
    for k, t in enumerate(train, 1):
        np.save(tmp_path / f"edufineweb_train_{k:06d}.npy", t.astype(np.uint16))
    meta = load_meta(tmp_path)
    assert meta["shards"]["train"] == ["edufineweb_train_000001.npy", "edufineweb_train_000002.npy"]
    assert "no meta.json" in capsys.readouterr().err  # the note is printed once per folder
    load_meta(tmp_path)
    assert capsys.readouterr().err == ""
    prepared_module._noted.clear()
    check_layout(tmp_path, train, val, "npy", capsys)


def test_reads_llmc_shards_without_meta(tmp_path, capsys):
    train, val = tokens(150), tokens(40, 5)
    write_shard(tmp_path / "tiny_shakespeare_train.bin", train, 50257)
    write_shard(tmp_path / "tiny_shakespeare_val.bin", val, 50257)
    check_layout(tmp_path, [train], val, "llmc", capsys)


# --- bad data ----------------------------------------------------------------------------------------
def test_bad_data_is_one_line(tmp_path, data):
    assert "one batch" in one_line(DataError, TokenLoader, data, "train", 100, T)
    msg = one_line(DataError, TokenLoader, data, "val", 40, T)
    assert "val split" in msg and "--val-fraction" in msg
    assert "prepare" in one_line(FileNotFoundError, TokenLoader, tmp_path / "nothing", "train", 1, T)

    broken = make_dataset(tmp_path / "broken")
    raw = (broken / "train_000001.bin").read_bytes()
    (broken / "train_000001.bin").write_bytes(raw[:-10])
    assert "truncated" in one_line(ShardError, TokenLoader, broken, "train", 1, T)
    (broken / "train_000001.bin").write_bytes(b"\x00" * 4 + raw[4:])
    assert "magic 0" in one_line(ShardError, TokenLoader, broken, "train", 1, T)

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "web_train_000001.bin").write_bytes(b"not a shard at all" * 100)
    assert "magic" in one_line(ShardError, load_meta, legacy)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "train.bin").write_bytes(b"\x01\x02\x03")
    assert "uint16" in one_line(ShardError, load_meta, odd)
    npz = tmp_path / "npz"
    npz.mkdir()
    with open(npz / "x_train_000001.npy", "wb") as f:
        np.savez(f, tokens=np.arange(100, dtype=np.uint16))
    assert ".npz archive" in one_line(ShardError, TokenLoader, npz, "train", 1, T)

    loader = TokenLoader(data, "train", 2, T)
    state = loader.state_dict()
    assert "train.seq_len = 8" in one_line(DataError, TokenLoader(data, "train", 2, T + 1).load_state_dict, state)
    assert "data.order = 'random'" in one_line(DataError, TokenLoader(data, "train", 2, T, order="sequential")
                                               .load_state_dict, state)
    assert "one of random" in one_line(DataError, TokenLoader, data, "train", 2, T, order="shuffled")


def test_no_val_shards_is_one_line(tmp_path):
    folder = make_dataset(tmp_path / "d", val_lengths=())
    assert "--val-fraction" in one_line(DataError, TokenLoader, folder, "val", 1, T)


# --- data checked against the model when opened -----------------------------------------------------
def with_recorded_ids(folder):
    """make_dataset's folder with the per-shard counts and largest ids that prepare records."""
    meta = json.loads((folder / "meta.json").read_text())
    meta["shard_tokens"], meta["max_token_id"] = {}, {}
    for split, names in meta["shards"].items():
        shards = [np.fromfile(folder / n, dtype="<u2", offset=1024) for n in names]
        meta["shard_tokens"][split] = [len(s) for s in shards]
        meta["max_token_id"][split] = [int(s.max()) for s in shards]
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def test_ids_at_or_above_the_model_vocab_fail_on_open_when_recorded(tmp_path):
    folder = with_recorded_ids(make_dataset(tmp_path / "d"))  # train shards hold ids 0-32, 33-82, 83-91, 92-116
    TokenLoader(folder, "train", 2, T, vocab_size=117)
    msg = one_line(ShardError, TokenLoader, folder, "train", 2, T, vocab_size=50)
    assert "train_000001.bin holds token id 82" in msg and "vocabulary has 50 ids" in msg and "at least 83" in msg
    assert "50 ids" in one_line(ShardError, ValWindows, folder, T, vocab_size=50)


def test_ids_not_recorded_are_checked_on_every_batch(tmp_path):
    folder = make_dataset(tmp_path / "d", lengths=(200,), vocab=1000)  # no max_token_id: llm.c-style
    loader = TokenLoader(folder, "train", 4, T, vocab_size=100)  # opens: nothing is scanned up front
    msg = one_line(ShardError, loader.next_batch)
    assert "train_000000.bin holds token id" in msg and "vocabulary has 100 ids" in msg
    assert "100 ids" in one_line(ShardError, ValWindows(folder, T, vocab_size=100).gather, np.arange(2))
    ok = TokenLoader(folder, "train", 4, T, vocab_size=1000)
    ok.next_batch()
    # recorded ids are checked on open, and a shard changed since prepare is still caught on the batch
    recorded = with_recorded_ids(folder)
    body = np.fromfile(folder / "train_000000.bin", dtype="<u2")
    body[512:] = 999  # after the 1024-byte header: same count, ids above the recorded largest (199)
    body.tofile(folder / "train_000000.bin")
    assert "token id 999" in one_line(ShardError, TokenLoader(recorded, "train", 4, T, vocab_size=300).next_batch)


def test_negative_ids_in_an_npy_shard_are_one_line(tmp_path):
    np.save(tmp_path / "x_train_000001.npy", np.full(100, -3, dtype=np.int32))
    loader = TokenLoader(tmp_path, "train", 2, T, vocab_size=50257)
    assert "never negative" in one_line(ShardError, loader.next_batch)


def test_a_shard_whose_count_differs_from_meta_is_one_line(tmp_path):
    folder = with_recorded_ids(make_dataset(tmp_path / "d"))
    write_shard(folder / "train_000001.bin", np.arange(60), 1000)  # a valid shard from another prepare
    assert "meta.json records 50" in one_line(ShardError, TokenLoader, folder, "train", 2, T)


@pytest.mark.parametrize("mode", ["ram", "memmap"])
def test_a_shard_changed_after_prepare_fails_on_open_not_at_the_batch_that_reads_it(tmp_path, mode):
    """Same size, ids still inside the vocabulary: only the checksum prepare recorded tells the change."""
    folder = tmp_path / "d"
    prepare_shakespeare(folder, tokenizer="char")
    shard = folder / "train_000000.bin"
    TokenLoader(folder, "train", 2, T, mode=mode)  # as prepared: opens
    body = np.fromfile(shard, dtype="<u2")
    body[512 + body.size // 2] = (body[512 + body.size // 2] + 1) % 65  # one token in the middle
    body.tofile(shard)
    message = one_line(ShardError, TokenLoader, folder, "train", 2, T, mode=mode)
    assert "train_000000.bin changed after `gpt2train prepare` wrote it" in message and "re-run" in message


@pytest.mark.slow
def test_training_on_a_shard_changed_after_prepare_stops_in_one_line(tmp_path):
    folder = tmp_path / "d"
    prepare_shakespeare(folder, tokenizer="char")
    body = np.fromfile(folder / "val_000000.bin", dtype="<u2")
    body[-1] = (body[-1] + 1) % 65  # the last val token: no training batch would read it
    body.tofile(folder / "val_000000.bin")
    result = run_cli("train", "--config", "shakespeare-cpu", "--set", f"data.dir={folder}", "--set", "train.max_steps=1",
                     "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2",
                     "--out", str(tmp_path / "run"))
    assert result.returncode == 1 and result.stderr.strip().startswith("error: "), result.stderr
    assert "val_000000.bin changed after `gpt2train prepare`" in result.stderr and len(result.stderr.splitlines()) == 1


def test_a_missing_shard_is_one_line(tmp_path):
    folder = make_dataset(tmp_path / "d")
    (folder / "train_000002.bin").unlink()
    msg = one_line(FileNotFoundError, TokenLoader, folder, "train", 2, T)
    assert "train_000002.bin is listed in meta.json but missing" in msg


@pytest.mark.parametrize("meta", [[], {"shards": 3}, {"shards": {"train": ["../escape.bin"]}, "vocab_size": 10,
                                                           "tokenizer": {}},
                                  {"shards": {"train": []}, "vocab_size": "big", "tokenizer": {}},
                                  {"shards": {"train": []}, "vocab_size": 10}])
def test_a_damaged_meta_json_is_one_line(tmp_path, meta):
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert "re-run `gpt2train prepare`" in one_line(ValueError, load_meta, tmp_path)


def test_training_on_shards_of_a_larger_vocabulary_is_one_line_not_an_index_error(tmp_path):
    """llm.c shards of another tokenizer, no meta.json: the GPT-2 vocabulary is assumed, the ids are checked
    on the first batch."""
    from conftest import tiny_config
    from gpt2train.training.loop import train

    write_shard(tmp_path / "llama_train_000000.bin", np.full(400, 60_000), 128_256)
    write_shard(tmp_path / "llama_val_000000.bin", np.full(400, 60_000), 128_256)
    cfg = tiny_config(tmp_path, max_steps=1)
    msg = one_line(ShardError, train, cfg, None)
    assert "token id 60000" in msg and "vocabulary has 50257 ids" in msg and "at least 60001" in msg


def test_a_model_vocabulary_smaller_than_the_datas_is_one_line(char_data):
    from conftest import tiny_config
    from gpt2train.config import ConfigError
    from gpt2train.training.loop import train

    cfg = tiny_config(char_data, max_steps=1)
    cfg.model.vocab_size = 10
    msg = one_line(ConfigError, train, cfg, None)
    assert "model.vocab_size = 10" in msg and "(66)" in msg and "set it to 66 or 0" in msg
