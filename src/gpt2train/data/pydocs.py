"""A corpus of real English text that a machine without internet makes itself: the docstrings of the Python code
installed on it (`gpt2train prepare pydocs`).

Why: the scaling ladder needs prose with meaning beyond a few characters, and every machine that runs gpt2train
holds millions of characters of it (17.9M where docs/data.md measured it): the documentation written into the
standard library and the packages `make setup` installs. The files are parsed with `ast`, never imported. Each
module, class and function docstring of at least `min_chars` characters (cleaned as `inspect.cleandoc` does) is
one document; exact duplicates are dropped, the first kept. Documents come in a fixed order: source (the
standard library, then PACKAGES in their order), file path, position in the file; files are parsed in parallel
and taken back in that order, so the corpus is the same whatever the number of workers. A byte-level BPE is
trained on the train documents alone, then the documents go through prepare.py like any other. The corpus
depends on the Python and package versions installed: meta.json records them.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import platform
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np

from gpt2train.data.prepare import SplitRule, ordered_map, prepare_documents, too_few_documents
from gpt2train.data.sources import SourceError, replace_lone_surrogates
from gpt2train.files import write_json_atomic, write_text_atomic
from gpt2train.progress import show_progress
from gpt2train.tokenizer import BPETokenizer, train_bpe

# The distributions read after the standard library, in this (alphabetical) order: those `make setup` installs
# (torch, matplotlib and what they pull in) that document their code in English prose. Whichever are installed
# are read; the others are recorded as not installed.
PACKAGES = ("contourpy", "filelock", "fonttools", "fsspec", "huggingface_hub", "jinja2", "markupsafe", "matplotlib",
            "mpmath", "networkx", "numpy", "packaging", "pillow", "pyarrow", "pyparsing", "python-dateutil",
            "requests", "sympy", "torch", "tqdm", "typing_extensions", "urllib3")
STDLIB = "stdlib"  # the standard library's name as a source
TEST_FOLDERS = {"test", "tests"}  # test code: its docstrings say what a test checks, not how the code works
# The standard library's other folders that are no documentation of it: IDLE's, and installed packages' where an
# interpreter keeps them inside its library folder.
STDLIB_SKIPPED = TEST_FOLDERS | {"idlelib", "site-packages", "dist-packages"}
STDLIB_LICENSE = "PSF-2.0"
DEFAULT_MIN_CHARS = 200
DEFAULT_VOCAB_SIZE = 1024
TOKENIZER_FILE = "tokenizer.json"
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass
class Source:
    """One place docstrings come from: the standard library, an installed distribution, or a folder. `files` are
    its .py files, sorted by their path relative to the source."""

    name: str
    version: str | None
    license: str | None
    files: list[Path]
    # what reading found (filled by read_corpus)
    documents: int = 0
    chars: int = 0
    short: int = 0
    duplicates: int = 0
    unparsed: list[str] = field(default_factory=list)

    def describe(self) -> dict:
        """For meta.json."""
        return {"name": self.name, "version": self.version, "license": self.license, "files": len(self.files),
                "documents": self.documents, "chars": self.chars, "short_dropped": self.short,
                "duplicates_dropped": self.duplicates, "files_not_parsed": len(self.unparsed)}


def python_files(root: Path, skipped: set[str]) -> list[Path]:
    """The .py files under root, sorted by relative path, outside any folder named in `skipped`."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in skipped and name != "__pycache__"]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def stdlib_source() -> Source:
    version = platform.python_version()
    return Source(STDLIB, version, STDLIB_LICENSE, python_files(Path(sysconfig.get_paths()["stdlib"]), STDLIB_SKIPPED))


def package_source(name: str) -> Source | None:
    """An installed distribution's .py files, as its own record of installed files lists them; None when it is not
    installed, or installed without that record (some system packagers leave it out)."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    if dist.files is None:
        return None
    listed = sorted((path for path in dist.files if path.suffix == ".py" and ".." not in path.parts
                     and not TEST_FOLDERS & set(path.parts[:-1])), key=lambda path: path.as_posix())
    files = [Path(dist.locate_file(path)) for path in listed]
    return Source(dist.metadata["Name"], dist.version, license_of(dist), [f for f in files if f.is_file()])


def license_of(dist) -> str | None:
    """What a distribution's metadata says of its license, short: the SPDX expression, else the license
    classifiers, else the License field's first line (some hold the whole license text)."""
    meta = dist.metadata
    if meta.get("License-Expression"):
        return meta["License-Expression"]
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return " / ".join(classifiers)
    text = (meta.get("License") or "").strip()
    return text.splitlines()[0][:100] if text else None


def folder_source(name: str, folder: str | Path) -> Source:
    """A folder of Python code read as a source (`--roots`: tests, custom corpora), test folders skipped."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SourceError(f"--roots {name}={folder}: no such folder; give NAME=FOLDER with a folder of .py files")
    return Source(name, None, None, python_files(folder, TEST_FOLDERS))


def installed_sources() -> tuple[list[Source], list[str]]:
    """The standard library and the PACKAGES installed here, in order; and the PACKAGES that are not."""
    sources, missing = [stdlib_source()], []
    for name in PACKAGES:
        source = package_source(name)
        if source is None:
            missing.append(name)
        else:
            sources.append(source)
    return sources, missing


def file_docstrings(path: Path, min_chars: int) -> tuple[list[str], int] | None:
    """The file's module, class and function docstrings of at least min_chars characters, cleaned, in the order
    they stand in the file, and how many shorter ones there were; None where the file cannot be read or parsed
    (Python 2 code, a template, a file of another Python version's syntax)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning: an invalid escape in someone's code is not ours to fix
            tree = ast.parse(Path(path).read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: null bytes, bad encoding
        return None
    found, short = [], 0
    for node in ast.walk(tree):
        if isinstance(node, DOCUMENTED):
            text = ast.get_docstring(node, clean=True)
            if not text:
                continue
            if len(text) < min_chars:
                short += 1
            else:
                where = node.body[0]  # the docstring's own place: a class's comes before its methods'
                found.append((where.lineno, where.col_offset, text))
    return [text for *_, text in sorted(found)], short


@dataclass
class Corpus:
    """The documents, in order, and the sources they came from with what each gave."""

    documents: list[str]
    sources: list[Source]
    missing: list[str]
    min_chars: int
    replacements: int = 0  # lone surrogates (a "\\udc80" escape in a docstring) replaced by U+FFFD

    @property
    def chars(self) -> int:
        return sum(source.chars for source in self.sources)

    def describe(self) -> dict:
        """meta.json's `pydocs`."""
        return {"python": platform.python_version(), "min_chars": self.min_chars, "documents": len(self.documents),
                "chars": self.chars, "sources": [source.describe() for source in self.sources],
                "not_installed": self.missing,
                "note": "made from the Python code installed where it was prepared: another Python or other "
                        "package versions give other documents"}

    def source_line(self) -> str:
        """meta.json's `source`: what the text is, in words."""
        names = ", ".join(f"{s.name} {s.version}" if s.version else s.name for s in self.sources)
        return f"docstrings of at least {self.min_chars} characters: {names}"


def read_corpus(sources: list[Source], min_chars: int = DEFAULT_MIN_CHARS, workers: int = 1, missing=(),
                progress: bool = False) -> Corpus:
    """Every source's docstrings of at least min_chars characters, exact duplicates dropped (the first kept), in
    the order of the sources, their files and the places in each file. Files are parsed by `workers` processes
    and taken back in order, so the result is the same for any number of workers."""
    if min_chars < 1:
        raise ValueError(f"--min-chars {min_chars} must be at least 1: an empty docstring is no document")
    files = [(source, path) for source in sources for path in source.files]
    parse = functools.partial(file_docstrings, min_chars=min_chars)
    documents, seen, replaced = [], set(), 0
    with show_progress(total=len(files), desc="reading docstrings", unit=" files", enabled=progress) as bar:
        for (source, path), found in zip(files, ordered_map(parse, [path for _, path in files], workers)):
            bar.update(1)
            if found is None:
                source.unparsed.append(str(path))
                continue
            texts, short = found
            source.short += short
            for text in texts:
                text, bad = replace_lone_surrogates(text)  # no UTF-8 form: no tokenizer takes one
                replaced += bad
                if text in seen:
                    source.duplicates += 1
                    continue
                seen.add(text)
                documents.append(text)
                source.documents += 1
                source.chars += len(text)
    return Corpus(documents, sources, list(missing), min_chars, replaced)


class PydocsReader:
    """The corpus's documents as a prepare reader (DocumentReader's interface), fingerprinted by their text: a
    second prepare from the same installed code finds its dataset prepared."""

    rereadable = True
    text_field = "text"

    def __init__(self, documents: list[str], replacements: int = 0):
        self.documents, self.replacements = documents, replacements

    def __iter__(self):
        yield from self.documents  # a generator, as every reader's: prepare may close it after reading a few

    def input_fingerprint(self) -> list:
        digest = hashlib.sha256()
        for text in self.documents:
            digest.update(text.encode("utf-8") + b"\0")
        return [["pydocs", len(self.documents), digest.hexdigest()]]


def val_prefix(documents: list[str], val_tokens: int, tok=None) -> int:
    """How many of the first documents --val-tokens sends to val, as SplitRule does (each document with fewer than
    val_tokens tokens before it), a document's tokens being its EOT and tok's ids; without tok, its UTF-8 bytes:
    at least its ids, so the count is at most the true one."""
    total = count = 0
    while count < len(documents) and total < val_tokens:
        text = documents[count]
        total += 1 + (len(tok.encode(text)) if tok is not None else len(text.encode("utf-8")))
        count += 1
    return count


def train_tokenizer(documents: list[str], vocab_size: int, rule: SplitRule, path: Path) -> tuple[BPETokenizer, int]:
    """A byte-level BPE (`gpt2train tokenizer train`'s) learned from documents that prepare will put in train, none
    of val; it is given `path` as its file (not written here). Returns it and how many documents it learned from.

    --val-fraction picks val by the documents' indices alone: the BPE learns from exactly the train documents.
    --val-tokens counts val in the tokens of this very BPE, so: start from a prefix no longer than val (a token
    is at least one byte), learn from the documents after it, count val's prefix with what was learned; while
    that prefix is longer, learn again from after it. The BPE finally learned from documents after a prefix at
    least as long as val, so val's documents are never among them (a few train ones at the border may be)."""
    if rule.fraction is not None:
        is_val = rule.assign(0, np.zeros(len(documents), dtype=np.int64))
        train = [text for text, val in zip(documents, is_val) if not val]
        return learn_bpe(train, vocab_size, path), len(train)
    prefix = val_prefix(documents, rule.val_tokens)
    while True:
        if prefix >= len(documents):
            raise too_few_documents(len(documents), rule, "train")
        tok = learn_bpe(documents[prefix:], vocab_size, path)
        needed = val_prefix(documents, rule.val_tokens, tok)
        if needed <= prefix:
            return tok, len(documents) - prefix
        prefix = needed


def learn_bpe(texts: list[str], vocab_size: int, path: Path) -> BPETokenizer:
    """train_bpe into a scratch folder; the tokenizer, named by `path`, is kept in memory until the dataset is in
    place (a failing prepare writes no tokenizer.json)."""
    with tempfile.TemporaryDirectory(prefix="gpt2train-pydocs-") as scratch:
        learned = train_bpe(texts, vocab_size, Path(scratch) / TOKENIZER_FILE)
    return BPETokenizer(path, json_str=learned.json_str)


def prepare_pydocs(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE, min_chars: int = DEFAULT_MIN_CHARS, *,
                   roots: list[tuple[str, str | Path]] | None = None, val_fraction: float | None = None,
                   val_tokens: int | None = None, workers: int | None = None, progress: bool = True,
                   **options) -> dict:
    """`gpt2train prepare pydocs`: the installed code's docstrings (or `roots`, (name, folder) pairs, instead),
    a BPE of vocab_size learned from their train split, and the shards, in out_dir; returns the meta dict, whose
    `pydocs` records every source (name, version, license, documents, characters) and the Python version.
    `options` go to prepare_documents (shard_tokens, dedup)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise SourceError(f"--out {out} is a file; give a folder to write into")
    rule = SplitRule(val_fraction, val_tokens)  # a bad split option fails now, not after minutes of parsing
    if not 258 <= vocab_size < 2**24:
        raise ValueError(f"--vocab-size {vocab_size} must be in [258, 2**24): 256 bytes, <|endoftext|> and a merge")
    if roots:
        sources, missing = [folder_source(name, folder) for name, folder in roots], []
    else:
        sources, missing = installed_sources()
    workers = max(1, workers or os.cpu_count() or 1)
    corpus = read_corpus(sources, min_chars, workers, missing, progress)
    if not corpus.documents:
        where = ", ".join(s.name for s in sources)
        raise SourceError(f"no docstring of at least {min_chars} characters in {where}: the corpus is empty; "
                          "lower --min-chars or give --roots folders with documented Python code")
    tok, learned_from = train_tokenizer(corpus.documents, vocab_size, rule, out / TOKENIZER_FILE)
    meta = prepare_documents(PydocsReader(corpus.documents, corpus.replacements), out, tok, source=corpus.source_line(),
                             val_fraction=val_fraction, val_tokens=val_tokens, workers=workers, progress=progress,
                             **options)
    # Written only now that the dataset is in place; meta.json names it and embeds the same JSON.
    tokenizer_file = out / TOKENIZER_FILE
    if not tokenizer_file.is_file() or tokenizer_file.read_text(encoding="utf-8") != tok.json_str:
        write_text_atomic(tokenizer_file, tok.json_str)
    meta["pydocs"] = {**corpus.describe(), "tokenizer_documents": learned_from}
    write_json_atomic(out / "meta.json", meta)
    return meta
