"""What a checkpoint or a run directory holds, in words a person reads: what `gpt2train ckpt inspect` prints of a
checkpoint (where, step, tokens, losses, when, model, tokenizer, the config in short, what ran, the format, and
the ring around it), and the few words naming the run a folder holds that refuse a launch, an import or an
export over it (run_on_disk)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from gpt2train.checkpoint.format import resolve_verified, ring_entries
from gpt2train.runlog import METRICS_FILE, RUNTIME_FIELDS, logs_a_trained_step, ran_and_asked, setting_text
from gpt2train.units import format_bytes, format_count, format_duration, format_utc


def describe_checkpoint(path: str | Path) -> str:
    """A few lines a person reads: where, step, tokens, losses, when, model, tokenizer, config summary.
    Raises CheckpointError (one line) for a damaged checkpoint."""
    ckpt, meta = resolve_verified(path)
    cfg = meta["config"]
    model, train, data = cfg.get("model", {}), cfg.get("train", {}), cfg.get("data", {})
    tok = meta.get("tokenizer") or {}
    val, best = meta.get("val_loss"), meta.get("best_val_loss")
    saved = meta.get("saved_at")
    when = format_utc(saved) if isinstance(saved, (int, float)) else "?"
    params = f", {format_count(meta['params'])} parameters" if isinstance(meta.get("params"), int) else ""
    wall = meta.get("train_wall_s")
    size = sum((meta.get("files") or {}).values())
    lines = [
        f"checkpoint  {ckpt}",
        f"step        {meta['step']:,} of {train.get('max_steps', '?'):,}" if isinstance(train.get("max_steps"), int)
        else f"step        {meta['step']:,}",
        f"tokens      {meta.get('tokens', 0):,}",
        f"val loss    {_loss(val)} (best {_loss(best)})",
        f"saved       {when} by gpt2train {meta.get('version', '?')}"
        + (f", after {format_duration(wall)} of training" if isinstance(wall, (int, float)) else ""),
        f"model       {model.get('n_layer')} layers, {model.get('n_head')} heads, {model.get('n_embd')} wide, "
        f"block {model.get('block_size')}, vocab {model.get('vocab_size')}{params}",
        f"tokenizer   {tok.get('kind', '?')}" + (f" (vocab {len(tok['chars'])} chars)" if "chars" in tok else ""),
        f"config      data {data.get('dir')}; lr {train.get('lr')} {train.get('schedule')}, "
        f"{train.get('micro_batch')} x {train.get('seq_len')} tokens per micro-batch, "
        f"{train.get('total_batch_tokens') or 'one micro-batch'} per step, seed {train.get('seed')}",
        f"ran         {_ran(meta.get('runtime'), train, meta.get('imported_from'))}",
        f"format      {'sharded (DCP, ' if meta.get('sharded') else 'plain (safetensors + state.pt, '}"
        f"world size {meta.get('world_size', '?')}), {format_bytes(size)}",
    ]
    root = ckpt.parent
    ring = [p.name for _, p in ring_entries(root)]
    if ring:
        latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
        names = [f"{n} (latest)" if n == latest else n for n in reversed(ring)]
        best_meta = (root / "best" / "meta.json")
        best_text = ""
        if best_meta.is_file():
            try:
                b = json.loads(best_meta.read_text())
                best_text = f"; best/ is step {b.get('step')} (val loss {_loss(b.get('val_loss'))})"
            except (OSError, json.JSONDecodeError):
                best_text = "; best/ is unreadable"
        lines.append(f"ring        {', '.join(names)}{best_text}")
    return "\n".join(lines)


def _ran(runtime, train: dict, imported_from) -> str:
    """The dtype, compile and device the run trained with, beside what its config asked."""
    if imported_from is not None:
        return f"not trained here: imported from {imported_from}"
    if not isinstance(runtime, dict):
        asked = ", ".join(f"{key} {setting_text(train.get(key))}" for key in RUNTIME_FIELDS)
        return f"not recorded (saved before gpt2train recorded it); asked: {asked}"
    return ", ".join(f"{key} {ran_and_asked(runtime.get(key), train.get(key))}" for key in RUNTIME_FIELDS)


def _loss(x) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def run_on_disk(run_dir: Path) -> str | None:
    """What of a run `run_dir` holds, in a few words: checkpoints (damaged ones too), or a metrics.jsonl that
    logged a trained step. None for a missing or empty folder, or one holding only other files."""
    root = run_dir / "checkpoints"
    ring = ring_entries(root)
    if ring:
        return f"checkpoints up to {ring[0][1].name}"
    if (root / "best").is_dir():
        return "a best/ checkpoint"
    if logs_a_trained_step(run_dir):
        return f"trained steps in {METRICS_FILE}"
    return None
