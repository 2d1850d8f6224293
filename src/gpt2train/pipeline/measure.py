"""What a finished stage measured, read back from what its command wrote (a prepared folder's meta.json, a run's
metrics.jsonl, eval's eval.json, an export's files): the numbers of the report card, kept in the stage's record.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpt2train.pipeline.definition import Stage


def measure(stage: Stage) -> dict:
    command = stage.argv[0]
    if command in ("prepare", "tokenizer"):
        return prepared(stage.writes)
    if command == "train":
        return trained(stage.writes)
    if command == "eval":
        return evaluated(Path(stage.args.ckpt))
    return exported(stage)


def prepared(out: Path) -> dict:
    meta_path = out / "meta.json"
    if not meta_path.is_file():  # tokenizer train writes a tokenizer.json
        return {"bytes": folder_bytes(out)}
    meta = json.loads(meta_path.read_text())
    return {"train_tokens": meta["tokens"]["train"], "val_tokens": meta["tokens"]["val"],
            "documents": sum((meta.get("documents") or {}).values()) or None,
            "tokenizer": meta["tokenizer"]["kind"], "chat": "chat" in meta}


def trained(run_dir: Path) -> dict:
    from gpt2train.runlog import load_run, summarize

    s = summarize(load_run(run_dir))
    keys = ("steps", "tokens", "wall_s", "best_val_loss", "best_val_bpb", "best_val_step", "last_train_loss",
            "params", "n_layer", "n_embd", "device_name", "world_size", "dtype_ran", "torch", "git",
            "mean_tokens_per_s", "mean_mfu")
    return {key: s.get(key) for key in keys}


def evaluated(ckpt: Path) -> dict:
    """eval.json of the checkpoint eval read (a run directory's latest), its tasks as they are."""
    from gpt2train.checkpoint import resolve_checkpoint

    folder = resolve_checkpoint(ckpt)
    path = Path(folder) / "eval.json"
    record = json.loads(path.read_text())
    return {"eval_json": str(path), "step": record.get("step"), "tasks": record["tasks"]}


def exported(stage: Stage) -> dict:
    return {"bytes": folder_bytes(stage.writes), **agreement(stage)}


def folder_bytes(path: Path) -> int:
    """A file's size, or the sizes of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# The exports' greedy agreement: a few prompts, each continued greedily by gpt2train; the export reads the same
# tokens, and at each new position its top token is compared with ours (teacher-forced: one disagreement does not
# send the rest down another path), with the largest gap between its logits and ours.
AGREEMENT_TOKENS = 24
BASE_PROMPTS = ("Hello", "ROMEO:", "The meaning of life is")
CHAT_PROMPTS = ("My name is Viola and I live in Troy. Where do I live?", "Hello! Who are you?")


def agreement(stage: Stage) -> dict:
    """{"agreement": the share of positions where the export's top token is gpt2train's (float32), "tokens",
    "max_logit_diff"}, over a few prompts (a chat model's rendered with its template); agreement None when the
    reader (transformers, llama-cpp-python) is not installed, with why."""
    import torch

    from gpt2train.chat import has_chat_tokens, render_prompt
    from gpt2train.generation import generate
    from gpt2train.loading import load_for_inference, load_pretrained_tokenizer

    model, _, _ = load_for_inference(stage.args.ckpt)
    tokenizer = load_pretrained_tokenizer(stage.args.ckpt)
    if has_chat_tokens(tokenizer):
        prompts = [render_prompt(tokenizer, [{"role": "user", "content": text}]) for text in CHAT_PROMPTS]
    else:
        prompts = [tokenizer.encode(text) for text in BASE_PROMPTS]
    n = max(1, min(AGREEMENT_TOKENS, model.config.block_size - max(len(p) for p in prompts)))
    try:
        reader = export_reader(stage, model.config.block_size)
    except ImportError as e:
        return {"agreement": None, "why": f"{e.name} is not installed"}
    same, worst = 0, 0.0
    for ids in prompts:
        tokens = ids + generate(model, ids, n, temperature=0)[:n]
        with torch.no_grad():
            ours = model(torch.tensor([tokens[:-1]]))[0][len(ids) - 1:]
        theirs = reader(tokens[:-1])[len(ids) - 1:]
        vocab = min(ours.shape[-1], theirs.shape[-1], tokenizer.vocab_size)
        ours, theirs = ours[:, :vocab].float(), theirs[:, :vocab].float()
        same += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        worst = max(worst, float((ours - theirs).abs().max()))
    return {"agreement": same / (n * len(prompts)), "tokens": n * len(prompts), "max_logit_diff": worst}


def export_reader(stage: Stage, context: int):
    """tokens (at most `context`, the model's) -> the export's logits at each position (T, V), read by transformers
    or llama.cpp."""
    import numpy as np
    import torch

    if stage.argv[0] == "export-hf":
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # one bar per load, in the middle of the pipeline's lines
        hf = AutoModelForCausalLM.from_pretrained(stage.writes, dtype=torch.float32).eval()

        def read(tokens: list[int]) -> torch.Tensor:
            with torch.no_grad():
                return hf(torch.tensor([tokens])).logits[0]
        return read
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(stage.writes), n_ctx=context, logits_all=True,
                          n_threads=2, seed=0, verbose=False)  # loaded once; each prompt starts from an empty cache

    def read(tokens: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(tokens)
        return torch.from_numpy(np.array(llm.scores[:len(tokens)]))
    return read
