"""Reading a prepared folder: meta.json and its shards, checked. A folder `gpt2train prepare` wrote (its
meta.json lists the shards, their token counts, checksums and largest ids), or one of llm.c's, nanoGPT's or
build-nanogpt's shards without a meta.json, read as if it had one. What is wrong says so in one line: a damaged
meta.json, a missing or changed shard, ids beyond the model's vocabulary. (Writing one: prepare.py.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from gpt2train.data.shards import ShardError, open_tokens, out_of_vocab, read_header, tokens_crc32
from gpt2train.tokenizer import GPT2_EOT_ID, GPT2_VOCAB_SIZE

SPLITS = ("train", "val")

_noted: set[str] = set()  # the folders without meta.json already noted on stderr


def load_meta(data_dir: str | Path) -> dict:
    """meta.json of a prepared folder; without one, a meta synthesized from shards made by other tools."""
    path = Path(data_dir) / "meta.json"
    if path.is_file():
        try:
            meta = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); re-run `gpt2train prepare` for this folder") from None
        check_meta(meta, path)
        return meta
    meta = detect_layout(Path(data_dir))
    if meta is None:
        raise FileNotFoundError(f"{path} not found and no llm.c/nanoGPT/.npy shards in {data_dir}; prepare the data "
                                f"first, e.g. `gpt2train prepare shakespeare --out {data_dir}`")
    if str(path) not in _noted:
        _noted.add(str(path))
        print(f"note: {data_dir} has no meta.json; reading {meta['source']} and assuming the GPT-2 tokenizer "
              f"(vocab {GPT2_VOCAB_SIZE})", file=sys.stderr)
    return meta


def is_prepared_data(folder: Path) -> bool:
    """`gpt2train prepare`'s folder: its meta.json lists shards, and a checkpoint's has a step instead."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "shards" in meta and "step" not in meta


def check_meta(meta, path: Path) -> None:
    """The keys readers rely on, with the right types: a damaged or hand-edited meta.json is one line, not a
    KeyError in the trainer."""
    def names_ok(shards) -> bool:
        return isinstance(shards, list) and all(isinstance(n, str) and n and Path(n).name == n for n in shards)

    problem = None
    if not isinstance(meta, dict):
        problem = f"holds a {type(meta).__name__}, not an object"
    elif not isinstance(meta.get("shards"), dict) or not all(names_ok(v) for v in meta["shards"].values()):
        problem = "has no \"shards\" object of file-name lists"
    elif type(meta.get("vocab_size")) is not int or meta["vocab_size"] < 1:
        problem = "has no positive integer \"vocab_size\""
    elif not isinstance(meta.get("tokenizer"), dict):
        problem = "has no \"tokenizer\" object"
    if problem:
        raise ValueError(f"{path} {problem}; it is damaged: re-run `gpt2train prepare` for this folder")


def split_paths(data_dir: str | Path, meta: dict, split: str) -> list[Path]:
    """The split's shard files, each of which must exist."""
    paths = [Path(data_dir) / name for name in meta["shards"].get(split) or []]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in meta.json but missing; copy the whole folder or re-run "
                                    f"`gpt2train prepare`")
    return paths


def open_split(paths: list[Path], meta: dict, split: str, vocab_size: int | None = None,
               in_memory: bool = False) -> list[np.ndarray]:
    """The tokens of each shard. Each header is checked (magic, version, size); its token count must equal the
    count meta.json recorded, its checksum the one recorded (one read of every shard: a file changed after
    prepare fails here, not at the batch that happens to read the change), and the largest id recorded at
    prepare time must be below vocab_size, so that a model too small for the data fails before training starts.
    Shards without recorded checksums or ids (other tools, older prepares) are only structurally checked;
    readers check every batch's ids as they read it (check_ids_below)."""
    fmt = meta.get("format", "llmc")
    shards = [open_tokens(p, fmt, in_memory=in_memory) for p in paths]
    for path, tokens, count in zip(paths, shards, recorded(meta, "shard_tokens", split, len(shards))):
        if len(tokens) != count:
            raise ShardError(f"{path} holds {len(tokens):,} tokens but meta.json records {count:,}: the folder "
                             f"mixes files of two prepares; re-run `gpt2train prepare` into an empty folder")
    for path, tokens, crc in zip(paths, shards, recorded(meta, "shard_crc32", split, len(shards))):
        if tokens_crc32(tokens) != crc:
            raise ShardError(f"{path} changed after `gpt2train prepare` wrote it (its checksum is not the one "
                             f"meta.json records): re-run `gpt2train prepare` for this folder, or restore the file")
    for path, highest in zip(paths, recorded(meta, "max_token_id", split, len(shards)) if vocab_size is not None else ()):
        if highest >= vocab_size:
            raise out_of_vocab(path, highest, vocab_size)
    return shards


def recorded(meta: dict, key: str, split: str, shards: int) -> list:
    """What prepare recorded per shard of the split under `key`; empty where it recorded none (other tools,
    older prepares) or not one value per shard."""
    values = (meta.get(key) or {}).get(split)
    return values if isinstance(values, list) and len(values) == shards else []


def detect_layout(folder: Path) -> dict | None:
    """Shards written by llm.c (`*train*.bin` with a header), nanoGPT (`train.bin` raw uint16) or
    build-nanogpt (`*_train_*.npy`), as a meta dict; None when the folder holds none of them."""
    if not folder.is_dir():
        return None
    found = None
    bins = {s: sorted(p.name for p in folder.glob(f"*{s}*.bin")) for s in SPLITS}
    if bins["train"]:
        try:
            read_header(folder / bins["train"][0])
            found = ("llmc", "llm.c shards", bins)
        except ShardError:
            if bins["train"] != ["train.bin"]:
                raise  # looks like llm.c shards but the header is wrong: say so
            found = ("nanogpt", "nanoGPT raw uint16 train.bin/val.bin",
                     {s: [f"{s}.bin"] if (folder / f"{s}.bin").is_file() else [] for s in SPLITS})
    if found is None:
        npys = {s: sorted(p.name for p in folder.glob(f"*_{s}_*.npy")) for s in SPLITS}
        if npys["train"]:
            found = ("npy", "build-nanogpt .npy shards", npys)
    if found is None:
        return None
    fmt, source, shards = found
    shards["train"] = [n for n in shards["train"] if n not in shards["val"]]
    counts = {s: [len(open_tokens(folder / n, fmt)) for n in names] for s, names in shards.items()}
    return {"format": fmt, "source": f"{source} in {folder}", "tokenizer": {"kind": "gpt2"},
            "vocab_size": GPT2_VOCAB_SIZE, "eot_id": GPT2_EOT_ID, "shards": shards, "shard_tokens": counts,
            "tokens": {s: sum(c) for s, c in counts.items()}}

