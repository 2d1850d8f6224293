"""Ready-to-use models for inference: a model (eval mode) built from a run directory or a checkpoint
(load_for_inference: `sample`, `serve`, `eval`, the exports), or from a Hugging Face GPT-2 folder or Hub name as
well (the library's load_model), and the tokenizer that goes with it (load_tokenizer); and a model grown by
ids it lacks (with_vocabulary: chat's turn tokens, as train.init_from starts them). Reading and checking the
checkpoint's files is checkpoint/format.py's; converting Hugging Face's weights, hf.py's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

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


def grown(matrix: torch.Tensor, rows: int, vocab_size: int, source_rows: int) -> torch.Tensor:
    """matrix (source_rows real ids) as `rows` rows: the ids source_rows .. vocab_size - 1 at the mean of the
    source's rows, the padding past vocab_size zero."""
    new = max(0, min(vocab_size, rows) - source_rows)
    mean = matrix.float().mean(0, keepdim=True).to(matrix.dtype).expand(new, -1)
    return torch.cat([matrix, mean, matrix.new_zeros(rows - source_rows - new, matrix.size(1))])


def with_vocabulary(model: GPT, vocab_size: int) -> GPT:
    """The model with vocab_size ids (eval mode), the ids past its own starting at the mean of its embedding rows
    (an untied head's too), as train.init_from starts chat's turn tokens on a model pretrained without them: what
    a fine-tune of it begins from. A model with that many ids already is returned as it is."""
    old = model.config.vocab_size
    if vocab_size <= old:
        return model
    param = next(model.parameters())
    bigger = GPT(replace(model.config, vocab_size=vocab_size)).to(device=param.device, dtype=param.dtype)
    weights = dict(model.state_dict())
    keys = ["transformer.wte.weight"] + ([] if model.config.tied_head else ["lm_head.weight"])
    for key in keys:
        weights[key] = grown(weights[key][:old], bigger.state_dict()[key].size(0), vocab_size, old)
    if model.config.tied_head:
        weights["lm_head.weight"] = weights["transformer.wte.weight"]
    bigger.load_state_dict(weights)
    return bigger.eval()
