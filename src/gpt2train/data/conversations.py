"""`gpt2train prepare chat`: conversations (JSON lines of {"messages": [...]}) rendered with the chat template
into shards of token ids, with the loss mask and the conversations' starts beside each shard.

Per shard NAME.bin (llm.c tokens, shards.py) the folder holds NAME.mask.bin (one uint8 per token, 1 where the
token is a target the loss counts; the same header with the mask's magic) and NAME.starts.bin (uint32, where
each conversation starts in the shard; a conversation ends where the next starts, the last at the shard's end).
A conversation never spans two shards. meta.json is prepare's, with "chat" saying it is chat data, the CRC-32
of every mask and starts file, and the conversations per split.

Bad input is one line naming the file and line, as `prepare files` says of a line that is not JSON: a line that
is not JSON, an unknown role, a message without text content, a conversation without an assistant turn.
How long a conversation may be is the trainer's to say (it skips those longer than its rows: chat_loader.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gpt2train.chat import ConversationError, check_conversation, render
from gpt2train.data.prepare import SplitRule
from gpt2train.data.shards import MASK_DTYPE, ShardWriter
from gpt2train.data.sources import UTF8_BOM, SourceError, decode_utf8, expand_inputs, replace_lone_surrogates
from gpt2train.files import write_json_atomic
from gpt2train.ranges import UsageError
from gpt2train.tokenizer import tokenizer_from_name, with_chat_tokens

STARTS_LIMIT = 2**32  # starts are stored as uint32: a shard holds fewer tokens than this


def mask_name(shard: str) -> str:
    return shard.removesuffix(".bin") + ".mask.bin"


def starts_name(shard: str) -> str:
    return shard.removesuffix(".bin") + ".starts.bin"


def read_conversations(paths) -> tuple[list[list[dict]], int]:
    """Every conversation of the JSONL inputs, in order, checked; and the invalid UTF-8 sequences replaced."""
    files = expand_inputs(paths)
    if not files:
        raise SourceError(f"no .jsonl files found in {' '.join(map(str, paths))}")
    conversations, replaced = [], 0
    for path in files:
        if path.suffix.lower() not in (".jsonl", ".ndjson"):
            raise SourceError(f"{path} is not a .jsonl file; `prepare chat` reads JSON lines of {{\"messages\": [...]}}")
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                raw = raw.removeprefix(UTF8_BOM) if lineno == 1 else raw
                if not raw.strip():
                    continue
                line, bad = decode_utf8(raw)
                try:
                    messages = check_conversation(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SourceError(f"{path}:{lineno} is not valid JSON ({e.msg}); fix or remove that line") from None
                except ConversationError as e:
                    raise SourceError(f"{path}:{lineno} {e}; fix or remove that line") from None
                for m in messages:
                    m["content"], surrogates = replace_lone_surrogates(m["content"])
                    bad += surrogates
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
    """Render every conversation of the inputs with the chat template into OUT's shards; returns meta.json's
    dict. Every (1/F)-th conversation goes to val (F = val_fraction, default 0.1)."""
    if tokenizer == "char":
        raise UsageError("prepare chat takes --tokenizer gpt2 or bpe:PATH/TO/tokenizer.json, not char (its alphabet "
                         "comes from a corpus)")
    conversations, replaced = read_conversations(paths)
    if not conversations:
        raise SourceError(f"{' '.join(map(str, paths))} hold no conversations")
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
    meta = {"format": "llmc", "source": " ".join(str(p) for p in paths), "tokenizer": tok.spec(),
            "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "chat": {"template": "chatml", "mask": "uint8"},
            "split": {"by": "conversations", "val_fraction": str(rule.fraction)}, "invalid_utf8_replacements": replaced}
    for key in writers["train"].record:
        meta[key] = {split: w.record[key] for split, w in writers.items()}
    meta["tokens"] = {split: sum(w.record["shard_tokens"]) for split, w in writers.items()}
    meta["documents"] = {split: sum(w.record["conversations"]) for split, w in writers.items()}
    meta["assistant_tokens"] = assistant
    write_json_atomic(out / "meta.json", meta)  # last: a folder without it is no dataset
    return meta
