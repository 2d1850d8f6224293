"""`prepare pydocs`: which docstrings come out of a few small Python files, in which order, the same for any number
of workers; the whole command on them, read back as the trainer reads a prepared folder; its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from gpt2train.cli import main
from gpt2train.data.prepare import SplitRule
from gpt2train.data.prepared import load_meta, open_split, split_paths
from gpt2train.data.pydocs import (
    PACKAGES,
    folder_source,
    package_source,
    prepare_pydocs,
    read_corpus,
    stdlib_source,
    train_tokenizer,
    val_prefix,
)
from gpt2train.data.sources import SourceError
from gpt2train.tokenizer import tokenizer_from_spec

MIN = 40  # --min-chars of these tests: their docstrings are a sentence or two

MODULE = "The alpha module: it holds a widget that spins and a helper that repeats this sentence."
WIDGET = "A widget spins around its axis, as fast as the caller asks, until it is told to stop."
SPIN = "Spin the widget once.\n\nThe speed is in turns per second; a negative one spins it backwards."
INNER = "An inner helper that a method defines: its docstring comes after the method's own one."
FETCH = "Fetch the next value from the queue, waiting as long as it takes for one to arrive."
DEEP = "A function in a subfolder: its file sorts after a.py and after broken.py beside it."
BETA = "The beta root's only function, whose docstring is long enough to be kept as a document."
VAL_ONLY = "qjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqjqj"

ALPHA_A = f'''"""{MODULE}"""


class Widget:
    """{WIDGET}"""

    def spin(self, speed):
        """{SPIN.splitlines()[0]}

        {SPIN.splitlines()[2]}
        """

        def inner():
            """{INNER}"""


async def fetch(queue):
    """{FETCH}"""


def short():
    """Too short to keep."""


def again():
    """{MODULE}"""


def not_a_docstring():
    x = 1
    """A string after the first statement is no docstring, however long it is, so it is not collected."""
'''


@pytest.fixture
def roots(tmp_path) -> list[tuple[str, Path]]:
    """Two roots of Python files: a module, class, method, nested and async function docstring in order, a short
    one, a duplicate within the root and one in the next root, a file that does not parse, a tests folder."""
    alpha, beta = tmp_path / "alpha", tmp_path / "beta"
    (alpha / "sub").mkdir(parents=True)
    (alpha / "tests").mkdir()
    beta.mkdir()
    (alpha / "a.py").write_text(ALPHA_A)
    (alpha / "sub" / "broken.py").write_text('"""A module of Python 2, which must be skipped: it does not parse."""\n'
                                             'print "hello"\n')
    (alpha / "sub" / "deep.py").write_text(f'def deep():\n    """{DEEP}"""\n')
    (alpha / "tests" / "test_a.py").write_text('def test_it():\n    """A test\'s docstring says what it checks, '
                                               'not how the code works: skipped."""\n')
    (alpha / "notes.txt").write_text('"""Not a .py file, so never read, whatever it holds in its lines."""\n')
    (beta / "b.py").write_text(f'def b():\n    """{BETA}"""\n\n\ndef dup():\n    """{WIDGET}"""\n')
    return [("alpha", alpha), ("beta", beta)]


EXPECTED = [MODULE, WIDGET, SPIN, INNER, FETCH, DEEP, BETA]


def test_collects_each_docstring_once_in_source_file_and_position_order(roots):
    sources = [folder_source(name, folder) for name, folder in roots]
    corpus = read_corpus(sources, MIN)
    assert corpus.documents == EXPECTED
    alpha, beta = (source.describe() for source in sources)
    assert alpha == {"name": "alpha", "version": None, "license": None, "files": 3, "documents": 6,
                     "chars": sum(map(len, EXPECTED[:6])), "short_dropped": 1, "duplicates_dropped": 1,
                     "files_not_parsed": 1}
    assert sources[0].unparsed == [str(roots[0][1] / "sub" / "broken.py")]
    assert (beta["documents"], beta["duplicates_dropped"]) == (1, 1)  # WIDGET came first in alpha
    assert corpus.chars == sum(map(len, EXPECTED))


def test_the_same_documents_from_one_worker_or_two(roots):
    one = read_corpus([folder_source(n, f) for n, f in roots], MIN, workers=1)
    two = read_corpus([folder_source(n, f) for n, f in roots], MIN, workers=2)
    assert two.documents == one.documents == EXPECTED
    assert two.describe() == one.describe()


def test_min_chars_keeps_the_short_ones_when_lowered(roots):
    corpus = read_corpus([folder_source(n, f) for n, f in roots], 5)
    assert "Too short to keep." in corpus.documents
    with pytest.raises(ValueError, match="--min-chars 0"):
        read_corpus([], 0)


def test_installed_sources_come_from_the_distributions_records():
    stdlib = stdlib_source()
    parts = {part for path in stdlib.files for part in path.parts}
    assert {"test", "tests", "idlelib", "site-packages"}.isdisjoint(parts)
    assert any(path.parts[-2:] == ("json", "decoder.py") for path in stdlib.files)
    numpy_source = package_source("numpy")
    assert numpy_source.version == np.__version__ and numpy_source.license
    assert all(path.suffix == ".py" and "tests" not in path.parts for path in numpy_source.files)
    assert any(path.parts[-2:] == ("numpy", "__init__.py") for path in numpy_source.files)
    assert package_source("no-such-distribution-here") is None
    assert list(PACKAGES) == sorted(PACKAGES)


def test_the_tokenizer_learns_from_train_documents_only(tmp_path):
    # --val-fraction 0.5 sends every second document (1, 3, ...) to val; only val holds "qj"
    docs = [f"train document {i}: the quick brown fox jumps over the lazy dog." for i in range(6)]
    docs[1] = docs[3] = VAL_ONLY
    tok, learned = train_tokenizer(docs, 300, SplitRule(0.5, None), tmp_path / "tokenizer.json")
    assert learned == 3 and not (tmp_path / "tokenizer.json").exists()  # kept in memory until the dataset exists
    assert not any("qj" in token for token in json.loads(tok.json_str)["model"]["vocab"])
    # --val-tokens: the first documents; the BPE learns from after a prefix at least as long as val
    docs = [VAL_ONLY] * 3 + [f"train text number {i}, plain English words for the merges." for i in range(20)]
    tok, learned = train_tokenizer(docs, 300, SplitRule(None, 30), tmp_path / "tokenizer.json")
    assert val_prefix(docs, 30, tok) <= len(docs) - learned
    assert not any("qj" in token for token in json.loads(tok.json_str)["model"]["vocab"])


def test_the_command_writes_shards_and_a_tokenizer_the_trainer_reads(roots, tmp_path, capsys):
    out = tmp_path / "pydocs"
    argv = ["prepare", "pydocs", "--out", str(out), "--roots", *(f"{n}={f}" for n, f in roots), "--min-chars",
            str(MIN), "--vocab-size", "300", "--val-fraction", "0.3", "--workers", "2"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {out}: 7 documents, {sum(map(len, EXPECTED)):,} characters from 2 source(s);")
    assert "byte-level BPE vocab" in line and "characters per token" in line and "\n" not in line

    meta = load_meta(out)  # what the trainer reads
    assert meta["tokenizer"]["path"] == str((out / "tokenizer.json").resolve())
    assert (out / "tokenizer.json").read_text(encoding="utf-8") == meta["tokenizer"]["json"]
    assert [s["name"] for s in meta["pydocs"]["sources"]] == ["alpha", "beta"]
    assert meta["pydocs"]["python"] and meta["pydocs"]["documents"] == 7
    tok = tokenizer_from_spec(meta["tokenizer"])
    is_val = SplitRule(0.3, None).assign(0, np.zeros(len(EXPECTED), dtype=np.int64))
    for split in ("train", "val"):
        tokens = np.concatenate(open_split(split_paths(out, meta, split), meta, split, meta["vocab_size"]))
        starts = np.flatnonzero(tokens == tok.eot_id)
        documents = [tok.decode(tokens[a + 1:b]) for a, b in zip(starts, [*starts[1:], len(tokens)])]
        wanted = [text for text, val in zip(EXPECTED, is_val) if val == (split == "val")]
        assert documents == wanted

    # again: nothing to do, the same folder
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(argv) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.slow
def test_an_empty_corpus_is_one_line_and_writes_nothing(roots, tmp_path):
    out = tmp_path / "empty"
    r = run_cli("prepare", "pydocs", "--out", str(out), "--roots", f"alpha={roots[0][1]}", "--min-chars", "100000")
    assert r.returncode == 1 and r.stdout == ""
    error = r.stderr.splitlines()[-1]  # after the progress line
    assert error.startswith("error: no docstring of at least 100000 characters in alpha")
    assert not out.exists()


def test_a_bad_out_or_root_is_refused_before_any_work(roots, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    r = run_cli("prepare", "pydocs", "--out", str(a_file), "--roots", f"alpha={roots[0][1]}")
    assert r.returncode == 2 and "is a file" in r.stderr and r.stderr.count("\n") == 1
    assert a_file.read_text() == "keep me"
    with pytest.raises(SourceError, match="is a file"):
        prepare_pydocs(a_file, roots=roots, min_chars=MIN, progress=False)
    r = run_cli("prepare", "pydocs", "--out", str(tmp_path / "o"), "--roots", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "NAME=FOLDER" in r.stderr and not (tmp_path / "o").exists()


def test_a_split_that_leaves_train_empty_writes_nothing(roots, tmp_path):
    out = tmp_path / "o"
    with pytest.raises(SourceError, match="train"):
        prepare_pydocs(out, 300, MIN, roots=roots, val_tokens=10**6, progress=False)
    assert not out.exists()
