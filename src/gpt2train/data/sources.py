"""Where documents come from: text files, folders, JSON lines, Parquet, saved Hugging Face datasets, or a
Hugging Face dataset streamed by name (hf_rows: its rows, which `prepare hf` and `prepare chat --hf` share).

One document is one .txt file, one JSON line or one Parquet/Arrow row. Documents come out as `str`, in a
fixed order (folders are walked recursively in sorted order), so a corpus always tokenizes the same way.
Bytes that are not valid UTF-8, and lone surrogates (from JSON escapes), become U+FFFD and are counted in
`DocumentReader.replacements`.
`DedupReader` drops exact duplicates from any of these readers.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

UTF8_BOM = b"\xef\xbb\xbf"  # a mark some editors put at the start of a file (Notepad, PowerShell): not text
FOLDER_SUFFIXES = {".txt", ".jsonl", ".parquet"}  # what a plain folder contributes (besides HF dataset folders)


class SourceError(ValueError):
    """An input that cannot be read as documents; the message says which file and what to do."""


def decode_utf8(data: bytes) -> tuple[str, int]:
    """Text and the number of invalid UTF-8 sequences replaced by U+FFFD."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        genuine = data.decode("utf-8", errors="ignore").count("\ufffd")  # U+FFFD already in the file
        return text, text.count("\ufffd") - genuine


# A file whose invalid UTF-8 sequences pass this share of its bytes is not text with a few bad bytes (those are
# replaced and counted) but another format: random bytes give about two in five, Latin-1 prose a few in a hundred.
MAX_UNDECODABLE_SHARE = 0.25


def check_mostly_text(path: Path, replaced: int, size: int) -> None:
    """SourceError naming the file and its share when more than MAX_UNDECODABLE_SHARE of its bytes were invalid
    UTF-8; below that, the replacements stand and are counted."""
    if size and replaced > MAX_UNDECODABLE_SHARE * size:
        raise SourceError(f"{path} is not UTF-8 text: {replaced:,} invalid UTF-8 sequences in its {size:,} bytes "
                          f"({replaced / size:.0%}; more than {MAX_UNDECODABLE_SHARE:.0%} is refused, fewer are "
                          f"replaced by U+FFFD); leave it out, or re-encode it as UTF-8")


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def replace_lone_surrogates(text: str) -> tuple[str, int]:
    """Text with each lone surrogate replaced by U+FFFD, and their number. A JSON escape such as "\\ud800"
    (broken text that JavaScript and scrapers write) parses to one; it has no UTF-8 form, so no tokenizer
    takes it: it is invalid text as invalid UTF-8 bytes are, and is replaced and counted the same way."""
    if text.isascii():  # O(1) in CPython: the common case costs nothing
        return text, 0
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        return LONE_SURROGATE.subn("\ufffd", text)


def is_hf_dataset_folder(path: Path) -> bool:
    """`datasets.Dataset.save_to_disk` writes state.json + dataset_info.json next to *.arrow files."""
    return path.is_dir() and (path / "state.json").is_file() and any(path.glob("*.arrow"))


def expand_inputs(paths: Iterable[str | Path]) -> list[Path]:
    """Files and HF dataset folders to read, in order; plain folders are expanded recursively, sorted."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise SourceError(f"{path} does not exist; pass .txt/.jsonl/.parquet files or folders")
        if path.is_file() or is_hf_dataset_folder(path):
            out.append(path)
        elif (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            example = path / (splits or ["train"])[0]
            raise SourceError(f"{path} is a saved DatasetDict; pass one split folder, e.g. {example}")
        else:
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FOLDER_SUFFIXES
                           and not any(is_hf_dataset_folder(parent) for parent in p.parents))
            hf = sorted(p for p in path.rglob("state.json") if is_hf_dataset_folder(p.parent))
            out.extend(sorted(found + [p.parent for p in hf]))
    return out


class DocumentReader:
    """Iterate the documents of local inputs; counts invalid UTF-8 replacements as it goes."""

    rereadable = True  # a second pass over the first documents costs a few file reads

    def __init__(self, paths: Iterable[str | Path], text_field: str = "text"):
        paths = list(paths)
        self.files = expand_inputs(paths)
        if not self.files:  # said here, not later as "no text": a folder of .md or .csv files holds no input at all
            raise SourceError(f"no .txt/.jsonl/.parquet files or dataset folders found in "
                              f"{' '.join(map(str, paths))}; the corpus is empty")
        self.text_field = text_field
        self.replacements = 0

    def __iter__(self) -> Iterator[str]:
        self.replacements = 0
        for path in self.files:
            if path.is_dir():
                yield from self._columnar(self._arrow_folder(path), path)
            elif path.suffix.lower() in (".jsonl", ".ndjson"):
                yield from self._jsonl(path)
            elif path.suffix.lower() == ".parquet":
                yield from self._columnar(self._parquet(path), path)
            elif path.suffix.lower() == ".arrow":
                yield from self._columnar(self._arrow_file(path), path)
            else:  # any other file is text: one file, one document
                data = path.read_bytes().removeprefix(UTF8_BOM)
                text, bad = decode_utf8(data)
                check_mostly_text(path, bad, len(data))
                self.replacements += bad
                yield text

    @staticmethod
    def _columnar(documents: Iterator[str], path: Path) -> Iterator[str]:
        """Parquet/Arrow documents; a corrupt file, found anywhere in it, is reported as bad input."""
        import pyarrow as pa

        try:
            yield from documents
        except (pa.ArrowException, OSError) as e:
            raise SourceError(f"{path} is not a readable Parquet/Arrow file ({str(e).splitlines()[0][:120]}); "
                              f"remove or re-export it") from None

    def input_fingerprint(self) -> list:
        """Names, sizes and modification times of every input file, to tell a re-run from new data."""
        files = []
        for path in self.files:
            for f in ([path] if path.is_file() else sorted(path.glob("*.arrow"))):
                st = f.stat()
                files.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
        return files

    def _jsonl(self, path: Path) -> Iterator[str]:
        replaced = 0
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if lineno == 1:
                    raw = raw.removeprefix(UTF8_BOM)  # json.loads refuses it, though the line is valid JSON
                if not raw.strip():
                    continue
                line, bad = decode_utf8(raw)
                replaced += bad
                self.replacements += bad
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SourceError(f"{path}:{lineno} is not valid JSON ({e.msg}); fix or remove that line") from None
                yield self._field(row, path, lineno)
        check_mostly_text(path, replaced, path.stat().st_size)  # before prepare installs anything it read

    def _field(self, row, path: Path, where) -> str:
        if not isinstance(row, dict) or self.text_field not in row:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise SourceError(f"{path}:{where} has no {self.text_field!r} field (found {keys}); "
                              f"pass --text-field NAME")
        text = row[self.text_field]
        if text is None:
            return ""
        if not isinstance(text, str):
            raise SourceError(f"{path}:{where}: field {self.text_field!r} is {type(text).__name__}, not text; "
                              f"pass the --text-field that holds the text")
        text, bad = replace_lone_surrogates(text)
        self.replacements += bad
        return text

    def _check_column(self, schema_names, path: Path) -> None:
        if self.text_field not in schema_names:
            raise SourceError(f"{path} has no {self.text_field!r} column (found {list(schema_names)}); "
                              f"pass --text-field NAME")

    def _column_texts(self, batches, schema_names, path: Path) -> Iterator[str]:
        self._check_column(schema_names, path)
        for batch in batches:
            column = batch.column(batch.schema.get_field_index(self.text_field))
            for text in column.to_pylist():
                if text is not None and not isinstance(text, str):
                    raise SourceError(f"{path}: column {self.text_field!r} holds {type(text).__name__}, not text; "
                                      f"pass the --text-field that holds the text")
                yield text or ""

    def _parquet(self, path: Path) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise SourceError(f"{path} is not a readable Parquet file ({str(e).splitlines()[0][:120]})") from None
        self._check_column(pf.schema_arrow.names, path)
        batches = pf.iter_batches(columns=[self.text_field], batch_size=1024)  # read only the text column
        yield from self._column_texts(batches, pf.schema_arrow.names, path)

    def _arrow_file(self, path: Path) -> Iterator[str]:
        """An Arrow IPC file: `datasets` writes the stream format; the random-access file format also works."""
        import pyarrow as pa

        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            try:
                reader = pa.ipc.open_file(source)
            except pa.ArrowInvalid as e:
                raise SourceError(f"{path} is not an Arrow IPC file ({str(e).splitlines()[0][:120]})") from None
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            yield from self._column_texts(batches, reader.schema.names, path)
            return
        yield from self._column_texts(reader, reader.schema.names, path)

    def _arrow_folder(self, path: Path) -> Iterator[str]:
        """A `save_to_disk` folder: state.json lists the Arrow files in order."""
        try:
            state = json.loads((path / "state.json").read_text())
            names = [f["filename"] for f in state["_data_files"]]
        except (ValueError, KeyError, TypeError):
            names = sorted(p.name for p in path.glob("*.arrow"))
        for name in names:
            yield from self._arrow_file(path / name)


# A single data file on disk is read by the `datasets` builder of its kind (load_dataset takes folders, not files)
DATA_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}


def hf_source_name(name: str, config: str | None, split: str) -> str:
    """How meta.json's `source` names a Hugging Face dataset: hf:NAME:CONFIG[SPLIT]."""
    return f"hf:{name}" + (f":{config}" if config else "") + f"[{split}]"


def hf_rows(name: str, config: str | None = None, split: str = "train") -> Iterator[dict]:
    """The rows of a Hugging Face dataset, read with the `datasets` library (an optional dependency): a Hub
    dataset or a local folder of its data files, streamed as load_dataset streams them (no download of the
    whole dataset first); a single data file by the builder of its kind; a folder `save_to_disk` wrote,
    memory-mapped (a DatasetDict's --split; a Dataset is one split already). `prepare hf` and `prepare chat
    --hf` both read through here."""
    try:
        import datasets
    except ImportError:
        raise ImportError("reading a Hugging Face dataset needs the datasets library: pip install 'gpt2train[data]' "
                          "(or pip install datasets)") from None
    path = Path(name)
    if is_hf_dataset_folder(path) or (path / "dataset_dict.json").is_file():
        if config:
            raise SourceError(f"{name} is a saved dataset, which has no configurations; leave out --config")
        saved = datasets.load_from_disk(str(path))
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise SourceError(f"{name} has no split {split!r} (it has {', '.join(sorted(saved))}); pass --split")
            saved = saved[split]
        yield from saved
    elif path.is_file() and path.suffix.lower() in DATA_FILE_BUILDERS:
        builder = DATA_FILE_BUILDERS[path.suffix.lower()]
        yield from datasets.load_dataset(builder, data_files={split: str(path)}, split=split, streaming=True)
    else:
        yield from datasets.load_dataset(name, config, split=split, streaming=True)


class HFStreamReader:
    """A Hugging Face dataset's text column, streamed with the `datasets` library (hf_rows: the Hub needs network)."""

    rereadable = False  # a second pass would open the stream from the Hub again

    def __init__(self, name: str, config: str | None = None, split: str = "train", text_field: str = "text"):
        self.name, self.config, self.split, self.text_field = name, config, split, text_field
        self.replacements = 0
        self.files = []

    def __iter__(self) -> Iterator[str]:
        self.replacements = 0
        for i, row in enumerate(hf_rows(self.name, self.config, self.split)):
            if self.text_field not in row:
                raise SourceError(f"{self.name} row {i} has no text field {self.text_field!r} "
                                  f"(found {sorted(row)}); pass --text-field NAME")
            text = row[self.text_field]
            if not isinstance(text, (str, type(None))):
                raise SourceError(f"{self.name} row {i}: field {self.text_field!r} holds {type(text).__name__}, "
                                  f"not text; pass --text-field with a text column")
            text, bad = replace_lone_surrogates(text or "")
            self.replacements += bad
            yield text

    def input_fingerprint(self) -> list:
        return [["hf", self.name, self.config, self.split, self.text_field]]


DEDUP_HASH = "blake2b-128"  # of the document's UTF-8; recorded in meta.json and the prepare fingerprint


class DedupReader:
    """Another reader's documents without exact duplicates: a document whose text was seen before is dropped,
    the first occurrence kept. Deciding in the reading order, before documents are split into work, makes the
    result independent of the number of workers; every pass starts an empty set, so a resume, which reads
    the documents before its restart point again, drops the same ones. Memory: a 16-byte digest per distinct
    document in a Python set, about 80 bytes each (83 MB measured for a million)."""

    def __init__(self, reader):
        self.reader = reader
        self.dropped = 0

    @property
    def rereadable(self) -> bool:
        return self.reader.rereadable

    @property
    def files(self) -> list:
        return self.reader.files

    @property
    def text_field(self) -> str:
        return self.reader.text_field

    @property
    def replacements(self) -> int:
        return self.reader.replacements

    def __iter__(self) -> Iterator[str]:
        self.dropped = 0
        seen: set[bytes] = set()
        documents = iter(self.reader)
        try:
            for text in documents:
                # surrogatepass: a lone surrogate from a JSON escape still hashes as itself
                digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
                if digest in seen:
                    self.dropped += 1
                    continue
                seen.add(digest)
                yield text
        finally:
            if hasattr(documents, "close"):
                documents.close()  # a file the inner reader holds open is closed now, not when collected

    def input_fingerprint(self) -> list:
        """The inner reader's, plus the dedup rule: a prepare with and one without dedup never resume each other."""
        return [*self.reader.input_fingerprint(), ["dedup", DEDUP_HASH]]

    def describe(self) -> dict:
        """For meta.json."""
        return {"documents_dropped": self.dropped, "hash": DEDUP_HASH}
