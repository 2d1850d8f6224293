"""`prepare hf` through the real `datasets` library, offline: a dataset folder on disk is passed as NAME, so
`datasets.load_dataset(NAME, split=..., streaming=True)` streams it exactly as it streams a Hub dataset
(the same call in HFStreamReader; only where the files come from differs). The result must be the shards
`prepare files` writes from the same rows, also after an interruption and a resume."""

from __future__ import annotations

import contextlib
import json
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gpt2train.data.prepare as prepare_module
from conftest import chat_conversations, missing, one_line, run_cli, write_jsonl
from gpt2train.cli import main
from gpt2train.data.conversations import prepare_chat_hf
from gpt2train.data.prepare import shakespeare_text

OPTIONS = ["--shard-tokens", "4000", "--val-fraction", "0.1"]  # several shards, so a run can stop between them


def datasets_library():
    try:
        import datasets
    except ImportError:
        missing("`prepare hf` needs the datasets package", "`make setup-dev` installs it (or pip install datasets)")
    return datasets


def write_corpus(folder, fmt: str) -> list[str]:
    """60 Shakespeare passages (one with non-ASCII text) as rows of two files, the layout of a Hub dataset repo."""
    paragraphs = shakespeare_text().split("\n\n")[:600]
    texts = ["\n\n".join(paragraphs[i:i + 10]) for i in range(0, 600, 10)]
    texts[3] += " — naïve 🙂 日本語"
    folder.mkdir()
    for part, rows in enumerate((texts[:35], texts[35:])):  # sorted names: datasets and prepare files agree
        path = folder / f"part-{part:05d}.{fmt}"
        if fmt == "parquet":
            pq.write_table(pa.table({"id": list(range(len(rows))), "text": rows}), path, row_group_size=16)
        else:
            path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(rows)))
    return texts


def offline_env(tmp_path) -> dict:
    """Nothing may reach the network, and the datasets cache (lock files) stays in the test's folder."""
    return {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}


@contextlib.contextmanager
def offline_in_process(datasets, tmp_path, monkeypatch):
    """offline_env for this process, where `datasets` may already have read its settings, and no connection."""
    for key, value in offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_home" / "datasets")

    def no_network(self, address):
        raise AssertionError(f"prepare hf tried to connect to {address}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    yield


@contextlib.contextmanager
def ctrl_c_after_shards(count: int, monkeypatch):
    """prepare gets a Ctrl-C right after it has recorded its `count`-th shard."""
    record = prepare_module.save_state

    def save_state(path, writers, next_doc, rule):
        record(path, writers, next_doc, rule)
        if sum(len(w.shards) for w in writers.values()) >= count:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(prepare_module, "save_state", save_state)
        yield


def shard_bytes(folder, meta: dict) -> dict[str, bytes]:
    return {n: (folder / n).read_bytes() for names in meta["shards"].values() for n in names}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_prepare_hf_streams_a_dataset_on_disk_like_prepare_files_and_resumes(fmt, tmp_path, monkeypatch):
    datasets = datasets_library()
    corpus = tmp_path / "corpus"
    texts = write_corpus(corpus, fmt)

    r = run_cli("prepare", "files", str(corpus), "--out", str(tmp_path / "files"), "--workers", "1", *OPTIONS)
    assert r.returncode == 0, r.stderr
    r = run_cli("prepare", "hf", str(corpus), "--out", str(tmp_path / "hf"), "--workers", "2", *OPTIONS,
                env=offline_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert f"{len(texts)} documents" in r.stdout
    files_meta = json.loads((tmp_path / "files" / "meta.json").read_text())
    hf_meta = json.loads((tmp_path / "hf" / "meta.json").read_text())
    assert hf_meta["source"] == f"hf:{corpus}[train]"
    different = {"source", "fingerprint"}  # the inputs are named differently; everything else is the same
    assert {k: v for k, v in hf_meta.items() if k not in different} == \
        {k: v for k, v in files_meta.items() if k not in different}
    assert shard_bytes(tmp_path / "hf", hf_meta) == shard_bytes(tmp_path / "files", files_meta)
    assert len(hf_meta["shards"]["train"]) >= 4

    out = tmp_path / "resumed"
    with offline_in_process(datasets, tmp_path, monkeypatch), ctrl_c_after_shards(2, monkeypatch):
        monkeypatch.setattr(prepare_module, "CHUNK_DOCS", 4)  # small chunks: the Ctrl-C comes mid-corpus
        assert main(["prepare", "hf", str(corpus), "--out", str(out), "--workers", "1", *OPTIONS]) == 130
    assert not (out / "meta.json").exists()  # an interrupted run is not a dataset
    staged = len(list(out.glob(".prepare-*/*.bin")))
    assert 2 <= staged < sum(map(len, hf_meta["shards"].values()))
    r = run_cli("prepare", "hf", str(corpus), "--out", str(out), "--workers", "2", *OPTIONS, env=offline_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert f"resuming: {staged} shards already written" in r.stderr
    assert json.loads((out / "meta.json").read_text()) == hf_meta
    assert shard_bytes(out, hf_meta) == shard_bytes(tmp_path / "hf", hf_meta)
    assert not list(out.glob(".prepare-*"))


def test_prepare_hf_dedup_drops_what_prepare_files_dedup_drops(tmp_path, monkeypatch):
    datasets = datasets_library()
    texts = ["first", "second", "first", "third", "second", "fourth " * 50] * 3
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    pq.write_table(pa.table({"text": texts}), corpus / "part-00000.parquet", row_group_size=4)
    kwargs = {"workers": 1, "val_fraction": 0.25, "dedup": True, "progress": False}
    local = prepare_module.prepare_files([corpus], tmp_path / "files", **kwargs)
    with offline_in_process(datasets, tmp_path, monkeypatch):
        hub = prepare_module.prepare_hf(str(corpus), tmp_path / "hf", **kwargs)
    assert hub["dedup"] == local["dedup"] == {"documents_dropped": len(texts) - 4, "hash": "blake2b-128"}
    assert sum(hub["documents"].values()) == 4
    assert shard_bytes(tmp_path / "hf", hub) == shard_bytes(tmp_path / "files", local)


# --- prepare chat --hf: the same loading (sources.hf_rows), a column of messages -----------------------------

def write_chat_dataset(datasets, folder, fmt: str, rows: list[dict]):
    """The conversations as a dataset on disk, and what --hf names: a folder save_to_disk wrote (of a Dataset, or
    of a DatasetDict whose split "sft" holds them), a folder of Parquet files, or one Parquet file."""
    dataset = datasets.Dataset.from_list(rows)
    if fmt == "saved":
        dataset.save_to_disk(str(folder))
    elif fmt == "saved-dict":
        datasets.DatasetDict({"sft": dataset, "other": dataset.select([0])}).save_to_disk(str(folder))
    else:
        folder.mkdir()
        dataset.to_parquet(str(folder / "part-00000.parquet"))
        return folder / "part-00000.parquet" if fmt == "parquet-file" else folder
    return folder


@pytest.mark.parametrize("fmt", ["saved", "saved-dict", "parquet", "parquet-file"])
def test_prepare_chat_reads_a_hf_dataset_as_it_reads_the_same_jsonl(fmt, tmp_path, monkeypatch, capsys):
    datasets = datasets_library()
    rows = chat_conversations(40, seed=3)
    rows[5]["messages"][-1]["content"] += " — naïve 🙂"
    data = write_chat_dataset(datasets, tmp_path / "data", fmt, [{"id": i, "chat": r["messages"]}
                                                                   for i, r in enumerate(rows)])
    jsonl = write_jsonl(tmp_path / "chats.jsonl", rows)
    options = ["--shard-tokens", "300", "--val-fraction", "0.1"]  # several shards
    split = "sft" if fmt == "saved-dict" else "train"
    with offline_in_process(datasets, tmp_path, monkeypatch):
        assert main(["prepare", "chat", str(jsonl), "--out", str(tmp_path / "jsonl"), *options]) == 0
        assert main(["prepare", "chat", "--hf", str(data), "--column", "chat", "--split", split, "--out",
                     str(tmp_path / "hf"), *options]) == 0
    assert "36 train and 4 val conversations" in capsys.readouterr().out
    hf_meta = json.loads((tmp_path / "hf" / "meta.json").read_text())
    jsonl_meta = json.loads((tmp_path / "jsonl" / "meta.json").read_text())
    assert hf_meta["source"] == f"hf:{data}[{split}]"
    assert {k: v for k, v in hf_meta.items() if k != "source"} == {k: v for k, v in jsonl_meta.items() if k != "source"}
    assert len(hf_meta["shards"]["train"]) >= 3
    names = [n for shard in hf_meta["shards"]["train"] + hf_meta["shards"]["val"]
             for n in (shard, shard.replace(".bin", ".mask.bin"), shard.replace(".bin", ".starts.bin"))]
    assert {n: (tmp_path / "hf" / n).read_bytes() for n in names} == \
        {n: (tmp_path / "jsonl" / n).read_bytes() for n in names}


def test_prepare_chat_names_the_bad_row_of_a_hf_dataset(tmp_path, monkeypatch, capsys):
    datasets = datasets_library()
    rows = chat_conversations(4)
    rows[2] = {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}
    data = write_chat_dataset(datasets, tmp_path / "data", "saved", rows)
    with offline_in_process(datasets, tmp_path, monkeypatch):
        message = one_line(ValueError, prepare_chat_hf, str(data), tmp_path / "out")
        assert message == f"{data} row 2 message 0 has role 'robot'; use one of system, user, assistant; fix or remove that row"
        assert "--column NAME" in one_line(ValueError, prepare_chat_hf, str(data), tmp_path / "out", column="chat")
        both = write_chat_dataset(datasets, tmp_path / "dict", "saved-dict", chat_conversations(2))
        assert one_line(ValueError, prepare_chat_hf, str(both), tmp_path / "out", split="train") == \
            f"{both} has no split 'train' (it has other, sft); pass --split"
        capsys.readouterr()  # datasets' progress bars
        assert main(["prepare", "chat", "--hf", str(data), "--out", str(tmp_path / "out")]) == 1
        assert main(["prepare", "chat", "--split", "test", "--out", str(tmp_path / "out")]) == 2
        assert main(["prepare", "chat", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {message}", "error: --split is read only with --hf; add --hf NAME_OR_PATH, or leave it out",
                   "error: give .jsonl files or folders, --hf NAME_OR_PATH, or --demo NAME (one of the three)"]
    assert not (tmp_path / "out" / "meta.json").exists()
