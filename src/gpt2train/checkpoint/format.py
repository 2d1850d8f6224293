"""The on-disk format of checkpoints: staged, published and verified atomically, found again (latest, the
ring, best/), recovered after a crash, and the weights saved and loaded. A crash at any instant loses at most
the steps since the previous save. (What a training state holds: state.py; what `ckpt inspect` prints:
inspect.py.)

Layout of a run directory:

  RUN_DIR/checkpoints/
    step_00000500/   model.safetensors  weights of the plain model (no wrapper prefixes; lm_head is tied, left out)
                     state.pt           GradScaler, guard, the RNG and train-loader state of every rank, and the
                                        optimizer (plain runs)
                     dcp/               FSDP runs only: sharded model + optimizer (torch.distributed.checkpoint)
                     meta.json          step, tokens, val losses, times, resolved config, tokenizer, the size
                                        and CRC-32 of every other file
    step_00001000/   ...                the ring: the last `checkpoint.keep_last` regular saves
    latest           name of the newest checkpoint, moved last
    best/            the best by validation loss, kept apart from the ring

How a save stays atomic: everything is written into a hidden `.tmp-NAME/` folder; meta.json goes in last and
records the size and CRC-32 of every other file; all files and folders are fsynced; one rename publishes the
folder; only then does `latest` move (files.py's atomic write: a temporary file renamed over the old one). Readers look only at
folders named `step_*` or `best`, which exist only complete, and check the recorded sizes and checksums, so a
truncated file or a changed byte is caught before it is loaded.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

import gpt2train
from gpt2train.config import ConfigError, config_from_resolved
from gpt2train.data.prepared import is_prepared_data
from gpt2train.files import fsync_path, leftover_temp_files, write_text_atomic
from gpt2train.model import GPT

LAYOUT_KEYS = ("tokens_per_step", "seq_len", "micro_batch", "grad_accum", "world_size")  # meta.json's `batch`
TIED_KEYS = ("lm_head.weight",)  # stored once, as transformer.wte.weight (when the head is tied)
STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says what is wrong."""


class CheckpointSaveError(OSError):
    """A save that failed (a full disk, say); the checkpoints saved before it are untouched."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.errno = code  # ENOSPC for a full disk; str(self) stays the bare one-line message


# --- what goes in -------------------------------------------------------------------------------------
def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights of the plain model: no `_orig_mod.`/`module.` prefixes, tied lm_head left out."""
    from gpt2train.distributed import unwrap

    state = unwrap(model).state_dict()
    return {k: v.detach().cpu().contiguous() for k, v in state.items() if k not in tied_keys(model)}


def tied_keys(model: torch.nn.Module) -> tuple[str, ...]:
    """The state-dict keys that repeat another tensor, and are stored only once."""
    from gpt2train.distributed import unwrap

    config = getattr(unwrap(model), "config", None)
    return TIED_KEYS if getattr(config, "tied_head", True) else ()


def weights_mismatch(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> str | None:
    """What keeps `weights` from loading into `model` (missing, unexpected or wrongly shaped tensors), or None.
    Checked before loading: torch's own error is a multi-line RuntimeError."""
    tied = tied_keys(model)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in tied}
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected and k not in tied]
    wrong = [f"{k} is {tuple(weights[k].shape)}, the model needs {shape}"
             for k, shape in expected.items() if k in weights and tuple(weights[k].shape) != shape]
    problems = ([f"missing {missing[:3]}"] if missing else []) + ([f"unexpected {unexpected[:3]}"] if unexpected
                                                                  else []) + wrong[:2]
    return "; ".join(problems) or None


def load_model_state(model: GPT, state: dict[str, torch.Tensor], source: str | Path = "checkpoint") -> None:
    problem = weights_mismatch(model, state)
    if problem:
        raise CheckpointError(f"{source}: the weights do not match the model of its config ({problem}); the files "
                              f"come from different models: use a checkpoint saved whole, or an earlier one")
    model.load_state_dict(state, strict=False)


# --- writing ------------------------------------------------------------------------------------------
def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_tree(folder: Path):
    for path in sorted(folder.rglob("*"), reverse=True):  # files before the folders that hold them
        fsync_path(path)
    fsync_path(folder)


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, leaving the file as readable as any file created under the umask. safetensors
    (0.8) writes through a temporary file it creates 0600 and renames that into place; the chmod after it only
    widens the mode to what a plain open() would have given, so no moment is more open than that.
    A failed write (a full disk, a read-only folder) is raised as the OSError it is: safetensors raises its own
    SafetensorError, which no handler of failed writes catches."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))  # "I/O error: No space left on device (os error 28)"
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None
    os.chmod(path, 0o666 & ~process_umask())


def process_umask() -> int:
    """This process's umask, read without setting it (os.umask reads it only by changing it, which would race
    with other threads creating files): from /proc on Linux, else from the mode a new file gets."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder) / "probe"
        probe.touch(mode=0o777)
        return 0o777 & ~probe.stat().st_mode


def stage(root: Path, name: str) -> Path:
    """A fresh, empty hidden folder that becomes checkpoint `name` when published."""
    root.mkdir(parents=True, exist_ok=True)
    staged = root / f".tmp-{name}"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    return staged


def _files(folder: Path) -> dict[str, Path]:
    """Every file under `folder` (DCP shards included), by its path relative to it."""
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}


def file_crc32(path: Path, chunk: int = 1 << 20) -> int:
    """CRC-32 of a file's bytes, read a chunk at a time (a checkpoint's files may not fit in memory twice)."""
    crc = 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def publish(root: Path, name: str, staged: Path, weights: dict | None, state: dict, meta: dict) -> Path:
    """Write the files into `staged` (which may already hold DCP shards), make them durable, rename into place."""
    if weights is not None:
        save_safetensors(weights, staged / "model.safetensors")
    torch.save(state, staged / "state.pt")
    files = _files(staged)
    # Sizes let readers catch a truncated file at once; checksums a changed byte, which loads without an error.
    meta = {**meta, "files": {rel: path.stat().st_size for rel, path in files.items()},
            "files_crc32": {rel: file_crc32(path) for rel, path in files.items()}}
    (staged / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    _fsync_tree(staged)
    return _swap_into_place(root, name, staged)


def _swap_into_place(root: Path, name: str, staged: Path) -> Path:
    final = root / name
    if final.exists():  # re-saving a step (after resuming from an older checkpoint) or a new best
        old = root / f".old-{name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)  # a crash right here is undone by recover()
        os.replace(staged, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, final)
    fsync_path(root)
    return final


def _link_copy(src: Path, root: Path, name: str) -> Path:
    """Publish a copy of checkpoint `src` as `name`; hard links cost no space (saved files never change)."""
    staged = stage(root, name)
    for path in sorted(src.rglob("*")):
        target = staged / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        try:
            os.link(path, target)
        except OSError:  # a filesystem without hard links
            shutil.copy2(path, target)
    _fsync_tree(staged)
    return _swap_into_place(root, name, staged)


def point_latest(root: Path, name: str) -> None:
    write_text_atomic(root / "latest", name + "\n")


def recover(root: Path) -> None:
    """Finish or undo what a crash interrupted: put back a checkpoint caught between the two renames of a
    swap, and delete half-written temporary folders."""
    if not root.is_dir():
        return
    for old in root.glob(".old-*"):
        final = root / old.name[len(".old-"):]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)
    for tmp in root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    for tmp in leftover_temp_files(root / "latest"):
        tmp.unlink(missing_ok=True)


def set_aside_newer(root: Path, step: int, why: str = "damaged") -> list[str]:
    """Move step checkpoints newer than `step` out of the ring, to hidden `.{why}-step_*` folders kept for a
    look (why: "damaged", found so when resuming, or "abandoned", of the timeline an older resume leaves);
    returns their names."""
    moved = []
    for newer_step, path in ring_entries(root):
        if newer_step > step:
            aside = root / f".{why}-{path.name}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(path, aside)
            moved.append(path.name)
    return moved


def prune_ring(root: Path, keep_last: int, current_step: int) -> None:
    """Keep the newest `keep_last` step checkpoints up to the current step. Newer ones come from a timeline
    abandoned by resuming from an older checkpoint, and go."""
    entries = ring_entries(root)  # newest first
    for step, path in entries:
        if step > current_step:
            shutil.rmtree(path, ignore_errors=True)
    kept = [path for step, path in entries if step <= current_step]
    for path in kept[max(1, keep_last):]:
        shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(run_dir: Path, step: int, weights: dict | None, state: dict, meta: dict, *, keep_last: int = 3,
                    ring: bool = True, best: bool = False, staged: Path | None = None,
                    again: str = "rerun with --resume auto") -> Path:
    """Save step `step` into the ring (moving `latest`) and/or as best/, then prune the ring.

    A new best that is not also a regular save is written to best/ only: it takes no ring slot. `staged` is a
    folder from stage() that already holds sharded files (FSDP). Raises CheckpointSaveError, with the
    checkpoints saved before left as they were, when the disk is full or unwritable; its message ends with
    what to do, then `again` (how the caller's command goes on).
    """
    root = Path(run_dir) / "checkpoints"
    name = checkpoint_name(step) if ring else "best"
    meta = {**meta, "step": step, "version": gpt2train.__version__, "saved_at": time.time()}
    try:
        if staged is None:
            recover(root)
            staged = stage(root, name)
        path = publish(root, name, staged, weights, state, meta)
        if ring:
            point_latest(root, name)
            if best:
                _link_copy(path, root, "best")
            prune_ring(root, keep_last, step)
        return path
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        shutil.rmtree(root / f".tmp-{name}", ignore_errors=True)
        shutil.rmtree(root / ".tmp-best", ignore_errors=True)
        previous = newest_checkpoint(run_dir, warn=False)
        kept = f"{previous.name} is intact" if previous is not None else "no earlier checkpoint exists"
        code = getattr(e, "errno", None)
        why = os.strerror(code) if code else short_reason(e)
        raise CheckpointSaveError(f"could not save checkpoint {name} in {root}: {why}; "
                                  f"{kept}; {save_remedy(code, root)} and {again}", code) from None


def save_remedy(code: int | None, folder: Path) -> str:
    """What a failed save asks of the user: write access where that was refused, else room on the disk."""
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"make {folder} writable (or save elsewhere)"
    return "free space"


# --- reading ------------------------------------------------------------------------------------------
def ring_entries(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step checkpoint under `root`, newest first."""
    entries = []
    if root.is_dir():
        for path in root.iterdir():
            match = STEP_DIR.match(path.name)
            if match and path.is_dir():
                entries.append((int(match.group(1)), path))
    return sorted(entries, reverse=True)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number_or_null(x) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))


# What meta.json's fields that readers use must be, where present (older checkpoints lack some of them): a
# meta.json edited by hand into another type is a corrupt checkpoint, not a crash in whatever reads it.
META_TYPES = {
    "tokens": (_integer, "an integer"),
    "world_size": (_integer, "an integer"),
    "params": (_integer, "an integer"),
    "val_loss": (_number_or_null, "a number or null"),
    "best_val_loss": (_number_or_null, "a number or null"),
    "train_wall_s": (_number_or_null, "a number or null"),
    "saved_at": (_number_or_null, "a number or null"),
    "sharded": (lambda x: isinstance(x, bool), "true or false"),
    "tokenizer": (lambda x: isinstance(x, dict), "an object"),
    "runtime": (lambda x: x is None or isinstance(x, dict), "an object or null"),
    "batch": (lambda x: isinstance(x, dict) and all(_integer(x.get(k)) for k in LAYOUT_KEYS),
              f"an object of integers {', '.join(LAYOUT_KEYS)}"),
    "files": (lambda x: isinstance(x, dict), "an object of file names"),
    "files_crc32": (lambda x: isinstance(x, dict), "an object of file names"),
}


def read_meta(ckpt: Path) -> dict:
    """A checkpoint's meta.json, its fields of the types readers expect (its config a valid one, its step the
    folder's); else CheckpointError, so that a hand-edited file is a corrupt checkpoint in one line."""
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{ckpt}/meta.json is unreadable ({short_reason(e)}); the checkpoint is corrupt") from None
    if not isinstance(meta, dict) or not _integer(meta.get("step")) or not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{ckpt}/meta.json lacks step or config; the checkpoint is corrupt")
    problem = meta_problem(ckpt, meta)
    if problem:
        raise CheckpointError(f"{ckpt}/meta.json: {problem}; the checkpoint is corrupt")
    return meta


def meta_problem(ckpt: Path, meta: dict) -> str | None:
    """What in a parsed meta.json no reader can use, or None."""
    for key, (ok, what) in META_TYPES.items():
        if key in meta and not ok(meta[key]):
            shown = json.dumps(meta[key])
            return f"{key} is {shown}, not {what}" if len(shown) <= 40 else f"{key} is not {what}"
    named = STEP_DIR.match(ckpt.name)  # a ring folder's name is its step: set_aside_newer and rollbacks go by it
    if named and int(named.group(1)) != meta["step"]:
        return f"step is {meta['step']} in the folder of step {int(named.group(1))}"
    config = meta["config"]
    if not isinstance(config.get("model"), dict) or not all(isinstance(v, dict) for v in config.values()):
        return "config is not an object of sections with a model section"
    try:
        config_from_resolved(config)
    except ConfigError as e:
        return f"config: {e}"
    return None


def verify(ckpt: Path) -> dict:
    """The meta of a checkpoint whose files are all there at their recorded sizes and checksums, and parse; else
    CheckpointError naming the damaged file. Reads every file once, for the checksums; a checkpoint saved
    before they were recorded has its sizes checked only."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    check_sizes(ckpt, meta.get("files") or {})
    check_checksums(ckpt, meta.get("files_crc32") or {})
    try:
        with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
            f.keys()
        with zipfile.ZipFile(ckpt / "state.pt") as z:  # torch.save writes a zip archive
            z.namelist()
    except Exception as e:  # truncated or overwritten files
        raise CheckpointError(f"{ckpt} is damaged ({short_reason(e)})") from None
    if meta.get("sharded") and not (ckpt / "dcp" / ".metadata").is_file():
        raise CheckpointError(f"{ckpt} is damaged: dcp/.metadata is missing")
    return meta


def check_sizes(ckpt: Path, sizes: dict[str, int]) -> None:
    """Every recorded file is there at its recorded size: a stat each, before any file is read."""
    for rel, size in sizes.items():
        path = ckpt / rel
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            what = "missing" if actual is None else f"{actual} bytes, expected {size}"
            raise CheckpointError(f"{ckpt} is damaged: {rel} is {what} (truncated or partly copied)")


def check_checksums(ckpt: Path, crcs: dict[str, int]) -> None:
    """Every file with a recorded CRC-32 still has it: a changed byte (a failing disk, a bad copy) would
    otherwise load as wrong weights or a wrong optimizer state."""
    for rel, crc in crcs.items():
        try:
            actual = file_crc32(ckpt / rel)
        except OSError as e:
            raise CheckpointError(f"{ckpt} is damaged: {rel} is unreadable ({short_reason(e)})") from None
        if actual != crc:
            raise CheckpointError(f"{ckpt} is damaged: {rel} changed after it was saved (its CRC-32 is not the one "
                                  f"meta.json records); copy it again or use an earlier checkpoint")


def newest_checkpoint(run_dir: str | Path, warn: bool = True, up_to: int | None = None) -> Path | None:
    """The newest undamaged step checkpoint of a run directory (or of its checkpoints/ folder), or None;
    `up_to`: the newest at or before that step (a run resumed from an older checkpoint still has the newer ones
    of the timeline it left until its first save prunes them).

    Damaged newer ones are skipped with a one-line warning each, so a corrupt `latest` falls back to the
    previous ring entry."""
    run_dir = Path(run_dir)
    root = run_dir if run_dir.name == "checkpoints" or (run_dir / "latest").exists() else run_dir / "checkpoints"
    for step, path in ring_entries(root):
        if up_to is not None and step > up_to:
            continue
        try:
            verify(path)
            return path
        except CheckpointError as e:
            if warn:
                print(f"warning: skipping {path.name}: {e}", file=sys.stderr)
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a run directory or checkpoints/ folder (its newest good one), or the folder itself."""
    path = Path(path)
    problem = not_a_checkpoint(path)
    if problem:
        raise CheckpointError(problem)
    if (path / "meta.json").exists() or (path / "model.safetensors").exists() or (path / "state.pt").exists():
        return path
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a run directory or a checkpoints/step_* folder")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint; pass a run directory or a checkpoints/step_* "
                              f"folder (the one holding meta.json, model.safetensors and state.pt)")
    found = newest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"no usable checkpoint found at {path}; pass a run directory or a checkpoints/step_* folder")
    return found


def not_a_checkpoint(path: Path) -> str | None:
    """What a folder passed as a checkpoint is instead, and what to pass, for the folders of other kinds people
    pass by mistake: a prepared data folder (its meta.json lists shards) and a Hugging Face model folder (its
    config.json); None for any other path."""
    if (path / "config.json").is_file() and not (path / "meta.json").exists():
        return f"{path} is a Hugging Face model folder; import it first: gpt2train import-hf {path} --out RUN_DIR"
    if is_prepared_data(path):
        return f"{path} is a prepared data folder, not a checkpoint; pass a run directory or a checkpoints/step_* folder"
    return None  # anything else, a damaged meta.json too: read_meta says which


def resolve_verified(path: str | Path) -> tuple[Path, dict]:
    """The checkpoint folder `path` names (see resolve_checkpoint) and its meta, its files verified once."""
    path = Path(path)
    ckpt = resolve_checkpoint(path)
    return ckpt, (verify(ckpt) if ckpt == path else read_meta(ckpt))  # newest_checkpoint verified what it found


def load_checkpoint(path: str | Path, with_state: bool = True) -> tuple[dict, dict | None, dict]:
    """(weights, state or None, meta) of a checkpoint; raises CheckpointError if it is damaged."""
    ckpt, meta = resolve_verified(path)
    weights, state = read_tensors(ckpt, with_state)
    return weights, state, meta


def read_tensors(ckpt: Path, with_state: bool) -> tuple[dict, dict | None]:
    """(weights, state or None) of a verified checkpoint folder; CheckpointError if they do not load."""
    try:
        weights = load_file(str(ckpt / "model.safetensors"))
        state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True) if with_state else None
    except Exception as e:  # damaged in a way the checks cannot see (a checkpoint saved without checksums)
        raise CheckpointError(f"{ckpt} is damaged ({short_reason(e)}); resume from an earlier checkpoint") from None
    return weights, state


def short_reason(e: Exception) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:200]
