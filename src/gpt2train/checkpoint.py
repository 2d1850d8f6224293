"""Checkpoints that hold everything a resumed run needs, written atomically.

Layout of a run directory:
  RUN_DIR/checkpoints/step_00000500/   model.safetensors  (weights, no wrapper prefixes, lm_head tied)
                                       state.pt           (optimizer, scaler, RNG and loader of every rank)
                                       meta.json          (step, tokens, best val loss, config, tokenizer)
  RUN_DIR/checkpoints/latest           name of the newest complete checkpoint (moved last)
  RUN_DIR/checkpoints/best/            the best by validation loss

A checkpoint is written into a hidden temporary folder, fsynced, then renamed into place, and only then
does `latest` move: a crash at any instant leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import gpt2train
from gpt2train.config import Config, config_from_resolved
from gpt2train.model import GPT

TIED_KEYS = ("lm_head.weight",)  # stored once, as transformer.wte.weight


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says what is wrong."""


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights of the plain model: no `_orig_mod.`/`module.` prefixes, tied lm_head left out."""
    from gpt2train.train.distributed import unwrap

    state = unwrap(model).state_dict()
    return {k: v.detach().cpu().contiguous() for k, v in state.items() if k not in TIED_KEYS}


def load_model_state(model: GPT, state: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in TIED_KEYS]
    if missing or unexpected:
        raise CheckpointError(f"weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(ckpt_root: Path, name: str, weights: dict, state: dict, meta: dict) -> Path:
    """Write one checkpoint folder atomically and return its path (does not move `latest`)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(weights, str(tmp / "model.safetensors"))
    torch.save(state, tmp / "state.pt")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists():
        old = ckpt_root / f".old-{name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(ckpt_root)
    return final


def point_latest(ckpt_root: Path, name: str) -> None:
    tmp = ckpt_root / ".latest.tmp"
    tmp.write_text(name + "\n")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, ckpt_root / "latest")
    _fsync_dir(ckpt_root)


def save_checkpoint(run_dir: Path, step: int, weights: dict, state: dict, meta: dict, *,
                    keep_last: int = 3, is_best: bool = False) -> Path:
    """Save step `step`, move `latest` to it, copy it to best/ when it is the best, prune the ring."""
    root = Path(run_dir) / "checkpoints"
    meta = {**meta, "step": step, "version": gpt2train.__version__, "saved_at": time.time()}
    name = f"step_{step:08d}"
    path = write_checkpoint(root, name, weights, state, meta)
    point_latest(root, name)
    if is_best:
        write_checkpoint(root, "best", weights, state, meta)
    ring = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in ring[: max(0, len(ring) - max(1, keep_last))]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a run directory (its latest), a checkpoints/ folder or a checkpoint itself."""
    path = Path(path)
    if (path / "meta.json").is_file() and (path / "model.safetensors").is_file():
        return path
    for root in (path / "checkpoints", path):
        latest = root / "latest"
        if latest.is_file():
            candidate = root / latest.read_text().strip()
            if candidate.is_dir():
                return candidate
    raise CheckpointError(f"no checkpoint found at {path}; pass a run directory or a checkpoints/step_* folder")


def read_meta(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt}/meta.json is unreadable ({e}); the checkpoint is corrupt") from None


def load_checkpoint(path: str | Path, with_state: bool = True) -> tuple[dict, dict | None, dict]:
    """(weights, state or None, meta) of a checkpoint; raises CheckpointError if it is damaged."""
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    try:
        weights = load_file(str(ckpt / "model.safetensors"))
        state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False) if with_state else None
    except Exception as e:  # truncated or overwritten files
        raise CheckpointError(f"{ckpt} is damaged ({type(e).__name__}: {e}); resume from an earlier checkpoint") from None
    return weights, state, meta


def load_model(path: str | Path, device="cpu") -> tuple[GPT, Config, dict]:
    """A ready-to-use model (eval mode) from a run directory or checkpoint, with its config and meta."""
    weights, _, meta = load_checkpoint(path, with_state=False)
    cfg = config_from_resolved(meta["config"])
    model = GPT(cfg.model)
    load_model_state(model, weights)
    return model.to(device).eval(), cfg, meta
