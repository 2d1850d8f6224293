"""`gpt2train prepare chat`: conversations (JSON lines of {"messages": [...]}, or a Hugging Face dataset with a
column of such lists) rendered with the chat template into shards of token ids, with the loss mask and the
conversations' starts beside each shard.

Per shard NAME.bin (llm.c tokens, shards.py) the folder holds NAME.mask.bin (one uint8 per token, 1 where the
token is a target the loss counts; the same header with the mask's magic) and NAME.starts.bin (uint32, where
each conversation starts in the shard; a conversation ends where the next starts, the last at the shard's end).
A conversation never spans two shards. meta.json is prepare's, with "chat" saying it is chat data, the CRC-32
of every mask and starts file, and the conversations per split.

Bad input is one line naming the file and line (a dataset's row), as `prepare files` says of a line that is not
JSON: a line that is not JSON, an unknown role, a message without text content, a conversation without an
assistant turn.
How long a conversation may be is the trainer's to say (it skips those longer than its rows: chat_loader.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gpt2train.chat import ConversationError, check_conversation, render
from gpt2train.data.prepare import SplitRule
from gpt2train.data.shards import MASK_DTYPE, ShardWriter
from gpt2train.data.sources import (
    UTF8_BOM,
    SourceError,
    check_mostly_text,
    decode_utf8,
    expand_inputs,
    hf_rows,
    hf_source_name,
    replace_lone_surrogates,
)
from gpt2train.files import write_json_atomic
from gpt2train.ranges import UsageError
from gpt2train.tokenizer import tokenizer_from_name, with_chat_tokens

STARTS_LIMIT = 2**32  # starts are stored as uint32: a shard holds fewer tokens than this


def mask_name(shard: str) -> str:
    return shard.removesuffix(".bin") + ".mask.bin"


def starts_name(shard: str) -> str:
    return shard.removesuffix(".bin") + ".starts.bin"


def checked(row, where: str, kind: str) -> tuple[list[dict], int]:
    """The messages of one input row, checked (a SourceError naming `where`, the `kind` of thing to fix), and
    the lone surrogates replaced in their contents."""
    try:
        messages = check_conversation(row)
    except ConversationError as e:
        raise SourceError(f"{where} {e}; fix or remove that {kind}") from None
    replaced = 0
    for m in messages:
        m["content"], bad = replace_lone_surrogates(m["content"])
        replaced += bad
    return messages, replaced


def read_conversations(paths) -> tuple[list[list[dict]], int]:
    """Every conversation of the JSONL inputs, in order, checked; and the invalid UTF-8 sequences replaced."""
    files = expand_inputs(paths)
    if not files:
        raise SourceError(f"no .jsonl files found in {' '.join(map(str, paths))}")
    conversations, replaced = [], 0
    for path in files:
        if path.suffix.lower() not in (".jsonl", ".ndjson"):
            raise SourceError(f"{path} is not a .jsonl file; `prepare chat` reads JSON lines of {{\"messages\": [...]}} "
                              "(Parquet files and saved datasets: --hf PATH)")
        file_replaced = 0
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                raw = raw.removeprefix(UTF8_BOM) if lineno == 1 else raw
                if not raw.strip():
                    continue
                line, bad = decode_utf8(raw)
                file_replaced += bad
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SourceError(f"{path}:{lineno} is not valid JSON ({e.msg}); fix or remove that line") from None
                messages, surrogates = checked(row, f"{path}:{lineno}", "line")
                replaced += bad + surrogates
                conversations.append(messages)
        check_mostly_text(path, file_replaced, path.stat().st_size)
    return conversations, replaced


def read_hf_conversations(name: str, config: str | None = None, split: str = "train",
                          column: str = "messages") -> tuple[list[list[dict]], int]:
    """Every conversation of a Hugging Face dataset's `column` (read as `prepare hf` reads: sources.hf_rows), in
    order, checked; and the lone surrogates replaced."""
    conversations, replaced = [], 0
    for i, row in enumerate(hf_rows(name, config, split)):
        if column not in row:
            raise SourceError(f"{name} row {i} has no {column!r} column (found {sorted(row)}); pass --column NAME")
        if not isinstance(row[column], list):
            raise SourceError(f"{name} row {i}: column {column!r} holds {type(row[column]).__name__}, not a list of "
                              "messages; pass the --column that holds them")
        messages, bad = checked({"messages": row[column]}, f"{name} row {i}", "row")
        replaced += bad
        conversations.append(messages)
    return conversations, replaced


class ChatShardWriter:
    """One split's shards of tokens, masks and starts, a new shard begun once one holds shard_tokens."""

    def __init__(self, out: Path, split: str, vocab_size: int, shard_tokens: int):
        self.out, self.split, self.vocab_size = out, split, vocab_size
        self.shard_tokens = min(shard_tokens, STARTS_LIMIT - 1)
        self.record = {key: [] for key in ("shards", "shard_tokens", "max_token_id", "shard_crc32", "mask_crc32",
                                           "starts_crc32", "conversations")}
        self.tokens = self.mask = None

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        if self.tokens is not None and self.tokens.count + len(ids) > self.shard_tokens:
            self.finish()
        if self.tokens is None:
            name = f"{self.split}_{len(self.record['shards']):06d}.bin"
            self.name, self.starts = name, []
            self.tokens = ShardWriter(self.out / name, self.vocab_size)
            self.mask = ShardWriter(self.out / mask_name(name), 2, MASK_DTYPE)
        self.starts.append(self.tokens.count)
        self.tokens.append(ids)
        self.mask.append(mask)

    def finish(self) -> None:
        if self.tokens is None:
            return
        starts = ShardWriter(self.out / starts_name(self.name), STARTS_LIMIT, np.dtype("<u4"))
        starts.append(np.asarray(self.starts, dtype=np.int64))
        r = self.record
        r["shards"].append(self.name)
        r["shard_tokens"].append(self.tokens.count)
        r["max_token_id"].append(self.tokens.max_id)
        r["shard_crc32"].append(self.tokens.close())
        r["mask_crc32"].append(self.mask.close())
        r["starts_crc32"].append(starts.close())
        r["conversations"].append(len(self.starts))
        self.tokens = self.mask = None


def prepare_chat(paths, out_dir: str | Path, tokenizer: str = "gpt2", val_fraction: float | None = None,
                 shard_tokens: int = 100_000_000) -> dict:
    """Render every conversation of the JSONL inputs with the chat template into OUT's shards; returns meta.json's
    dict. Every (1/F)-th conversation goes to val (F = val_fraction, default 0.1)."""
    check_tokenizer(tokenizer)
    conversations, replaced = read_conversations(paths)
    return write_chat(conversations, replaced, " ".join(str(p) for p in paths), out_dir, tokenizer, val_fraction,
                      shard_tokens)


def prepare_chat_hf(name: str, out_dir: str | Path, config: str | None = None, split: str = "train",
                    column: str = "messages", tokenizer: str = "gpt2", val_fraction: float | None = None,
                    shard_tokens: int = 100_000_000) -> dict:
    """prepare_chat of a Hugging Face dataset (a Hub name, a folder of its data files, a data file, a folder
    `save_to_disk` wrote) whose `column` holds each conversation's messages."""
    check_tokenizer(tokenizer)
    conversations, replaced = read_hf_conversations(name, config, split, column)
    return write_chat(conversations, replaced, hf_source_name(name, config, split), out_dir, tokenizer, val_fraction,
                      shard_tokens)


def check_tokenizer(tokenizer: str) -> None:
    if tokenizer == "char":
        raise UsageError("prepare chat takes --tokenizer gpt2 or bpe:PATH/TO/tokenizer.json, not char (its alphabet "
                         "comes from a corpus)")


def write_chat(conversations: list[list[dict]], replaced: int, source: str, out_dir: str | Path, tokenizer: str,
               val_fraction: float | None, shard_tokens: int) -> dict:
    """The shards, masks, starts and meta.json of checked conversations (read from `source`)."""
    if not conversations:
        raise SourceError(f"{source} holds no conversations")
    tok = with_chat_tokens(tokenizer_from_name(tokenizer))
    rule = SplitRule(val_fraction, None)  # prepare files' rule: every (1/F)-th conversation goes to val
    val = rule.assign(0, np.zeros(len(conversations), dtype=np.int64))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writers = {split: ChatShardWriter(out, split, tok.vocab_size, shard_tokens) for split in ("train", "val")}
    assistant = {"train": 0, "val": 0}
    for i, messages in enumerate(conversations):
        split = "val" if val[i] else "train"
        ids, mask = render(tok, messages)
        writers[split].add(ids, mask)
        assistant[split] += int(mask.sum())
    for writer in writers.values():
        writer.finish()
    meta = {"format": "llmc", "source": source, "tokenizer": tok.spec(),
            "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "chat": {"template": "chatml", "mask": "uint8"},
            "split": {"by": "conversations", "val_fraction": str(rule.fraction)}, "invalid_utf8_replacements": replaced}
    for key in writers["train"].record:
        meta[key] = {split: w.record[key] for split, w in writers.items()}
    meta["tokens"] = {split: sum(w.record["shard_tokens"]) for split, w in writers.items()}
    meta["documents"] = {split: sum(w.record["conversations"]) for split, w in writers.items()}
    meta["assistant_tokens"] = assistant
    write_json_atomic(out / "meta.json", meta)  # last: a folder without it is no dataset
    return meta
