"""`gpt2train eval`: load a checkpoint, run the asked tasks, print a table, write eval.json beside it.

Works under torchrun too: each rank loads the model, takes its share of every task, and the counts are
summed across ranks, so the numbers match a single process.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from gpt2train import distributed as D
from gpt2train.checkpoint import load_model, resolve_checkpoint
from gpt2train.data.prepare import load_meta
from gpt2train.runtime import autocast_for, resolve_dtype
from gpt2train.tokenizer import tokenizer_from_spec

TASKS = ("val", "hellaswag")


def parse_tasks(text: str | list[str]) -> list[str]:
    tasks = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    tasks = [t for t in tasks if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown task {unknown[0] if unknown else '(none)'!r}; choose from {', '.join(TASKS)} "
                         "(comma-separated)")
    return tasks


def evaluate_checkpoint(ckpt: str | Path, tasks="val,hellaswag", *, limit: int = 0, batch_size: int = 16,
                        data_dir: str | None = None, hellaswag: str | None = None, device: str = "auto",
                        dtype: str = "auto", progress: bool = True) -> dict:
    """Run `tasks` on a checkpoint (run dir or checkpoint folder) and write CKPT/eval.json on rank 0.

    limit caps HellaSwag examples and val windows (spread evenly over the split); 0 means all.
    batch_size counts sequences per forward: val windows, or 4 HellaSwag rows per example.
    Returns {"checkpoint", "step", "tasks": {task: results}, ...}; eval.json keeps earlier tasks' results.
    """
    tasks = parse_tasks(tasks)
    if batch_size < 1 or limit < 0:
        raise ValueError("--batch-size must be >= 1 and --limit >= 0")
    ckpt_dir = resolve_checkpoint(ckpt)
    owns_group = not (dist.is_available() and dist.is_initialized())
    info = D.init_distributed(device)
    try:
        model, cfg, meta = load_model(ckpt_dir, device=info.device)
        resolved = resolve_dtype(dtype, info.device.type)  # the trainer's own resolution of --dtype auto
        autocast = autocast_for(info.device.type, resolved)
        # Check every task's inputs before running any, so a bad file fails in seconds, not after val.
        jobs = {}
        if "val" in tasks:
            jobs["val"] = _val_job(model, cfg, meta, data_dir, limit, batch_size, autocast, progress)
        if "hellaswag" in tasks:
            jobs["hellaswag"] = _hellaswag_job(model, meta, hellaswag, limit, batch_size, autocast, progress)
        if progress and info.rank == 0:
            print(f"device: {info.device} x {info.world_size} rank(s), {str(resolved).removeprefix('torch.')}",
                  file=sys.stderr)
        results = {}
        for task in tasks:
            start = time.time()
            results[task] = jobs[task]()
            results[task]["wall_s"] = time.time() - start
        record = {"checkpoint": str(ckpt_dir), "step": meta.get("step"), "world_size": info.world_size,
                  "device": str(info.device), "dtype": str(resolved).removeprefix("torch."), "time": time.time(),
                  "tasks": results}
        if info.is_main:
            write_eval_json(ckpt_dir / "eval.json", record)
        return record
    finally:
        if owns_group:
            D.shutdown_distributed()


def _val_job(model, cfg, meta, data_dir, limit, batch_size, autocast, progress):
    from gpt2train.eval.val import validation_loss

    data_dir = data_dir or cfg.data.dir
    if not (Path(data_dir) / "meta.json").is_file():
        raise FileNotFoundError(f"val data {data_dir} (from {'--data' if data_dir != cfg.data.dir else 'the checkpoint config'}) "
                                "has no meta.json; pass --data DIR with prepared data")
    data_tokenizer = load_meta(data_dir)["tokenizer"]
    if data_tokenizer != meta["tokenizer"]:
        raise ValueError(f"{data_dir} was tokenized with {data_tokenizer.get('kind')!r} but the checkpoint uses "
                         f"{meta['tokenizer'].get('kind')!r}; pass --data with data prepared by the same tokenizer")
    seq_len = min(cfg.train.seq_len or cfg.model.block_size, cfg.model.block_size)
    token_bytes = tokenizer_from_spec(meta["tokenizer"]).token_bytes()

    def run() -> dict:
        out = validation_loss(model, data_dir, batch_size=batch_size, seq_len=seq_len, windows=limit,
                              progress=progress, autocast=autocast, token_bytes=token_bytes)
        return {**out, "data": str(data_dir)}
    return run


def _hellaswag_job(model, meta, source, limit, batch_size, autocast, progress):
    from gpt2train.eval.hellaswag import default_source, evaluate_hellaswag, load_examples

    kind = meta["tokenizer"].get("kind")
    if kind != "gpt2":
        raise ValueError(f"hellaswag needs a model with the GPT-2 tokenizer, this checkpoint uses {kind!r}; "
                         "run with --tasks val")
    source = source or default_source()
    examples = load_examples(source, limit)
    tokenizer = tokenizer_from_spec(meta["tokenizer"])

    def run() -> dict:
        out = evaluate_hellaswag(model, tokenizer, examples, max(1, batch_size // 4), autocast, progress)
        return {**out, "source": str(source)}
    return run


def write_eval_json(path: Path, record: dict) -> None:
    """Write record, keeping results of tasks that this run did not redo."""
    earlier = {}
    if path.is_file():
        try:
            earlier = json.loads(path.read_text()).get("tasks", {})
        except (json.JSONDecodeError, AttributeError):
            earlier = {}
    merged = {**record, "tasks": {**earlier, **record["tasks"]}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(merged, indent=2) + "\n")
    tmp.replace(path)


def format_table(record: dict) -> str:
    step = f" (step {record['step']})" if record.get("step") is not None else ""
    lines = [f"checkpoint {record['checkpoint']}{step}, {record['world_size']} rank(s), {record['device']}, {record['dtype']}",
             f"{'task':<10} {'metric':<9} {'value':>10}  over"]
    for task, r in record["tasks"].items():
        if task == "val":
            over = f"{r['windows']} windows x {r['seq_len']} tokens of {r['data']}"
            rows = [("loss", f"{r['loss']:.4f}"), ("ppl", f"{r['ppl']:.2f}")]
            if r.get("bpb") is not None:
                rows.append(("bits/byte", f"{r['bpb']:.4f}"))
        else:
            over = f"{r['n']} examples of {Path(r['source']).name}"
            rows = [("acc", f"{r['acc']:.4f}"), ("acc_norm", f"{r['acc_norm']:.4f}")]
        for i, (metric, value) in enumerate(rows):
            lines.append(f"{task:<10} {metric:<9} {value:>10}  {over if i == 0 else ''}".rstrip())
    return "\n".join(lines)
