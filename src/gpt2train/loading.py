"""Ready-to-use models for inference: a model (eval mode) built from a run directory or a checkpoint
(load_for_inference: `sample`, `serve`, `eval`, the exports), or from a Hugging Face GPT-2 folder or Hub name as
well (the library's load_model), and the tokenizer that goes with it (load_tokenizer). Reading and checking
the checkpoint's files is checkpoint/format.py's; converting Hugging Face's weights, hf.py's.
"""

from __future__ import annotations

from pathlib import Path

from gpt2train.checkpoint.format import load_model_state, read_meta, read_tensors, resolve_checkpoint, resolve_verified
from gpt2train.config import Config, config_from_resolved
from gpt2train.hf import hf_tokenizer_spec, import_hf, is_hf_folder, is_hub_name, resolve_hf_folder
from gpt2train.model import GPT
from gpt2train.tokenizer import tokenizer_from_spec


def load_for_inference(path: str | Path, device="cpu") -> tuple[GPT, Config, dict]:
    """A ready-to-use model (eval mode) from a run directory or checkpoint, with its config and meta."""
    ckpt, meta = resolve_verified(path)
    weights, _ = read_tensors(ckpt, with_state=False)
    cfg = config_from_resolved(meta["config"])
    model = GPT(cfg.model)
    load_model_state(model, weights, ckpt / "model.safetensors")
    return model.to(device).eval(), cfg, meta


def load_pretrained(path: str | Path, device="cpu") -> GPT:
    """`gpt2train.load_model`: a model (eval mode) from a run directory, a checkpoint, a HF GPT-2 folder or a
    Hub name ("gpt2", as transformers' from_pretrained takes)."""
    if is_hf_folder(path) or is_hub_name(path):
        model, _ = import_hf(path)
        return model.to(device)
    return load_for_inference(path, device=device)[0]


def load_pretrained_tokenizer(path: str | Path):
    """`gpt2train.load_tokenizer`: the tokenizer a run directory or checkpoint records, or the one a HF folder
    or Hub name holds (GPT-2's when it holds none)."""
    if is_hf_folder(path) or is_hub_name(path):
        return tokenizer_from_spec(hf_tokenizer_spec(resolve_hf_folder(path, weights=False)) or {"kind": "gpt2"})
    return tokenizer_from_spec(read_meta(resolve_checkpoint(path))["tokenizer"])
