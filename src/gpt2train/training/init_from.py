"""train.init_from: start a run from existing weights (a Hugging Face GPT-2 or a checkpoint of ours).

Weights only: the run still starts at step 0 with a fresh optimizer and schedule. The model's shape comes
from the source (source_shape; runconfig.py adopts it), so an explicit conflicting [model] setting is an error;
settings that do not change the weights (dropout, attention, grad_checkpointing, loss_chunk,
pad_vocab_multiple) are the run's own. The data
must be tokenized as the source was: a HF folder without a tokenizer has GPT-2's, as import-hf assumes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gpt2train.checkpoint import load_checkpoint, read_meta, resolve_checkpoint, weights_mismatch
from gpt2train.config import ConfigError, config_from_resolved
from gpt2train.hf import (
    check_vocab_fits_tokenizer,
    gpt_config_from_hf,
    gpt_state_from_hf,
    hf_tokenizer_spec,
    read_hf_weights,
    resolve_hf_folder,
)
from gpt2train.loading import grown
from gpt2train.model import PRESETS, GPTConfig
from gpt2train.tokenizer import GPT2_VOCAB_SIZE, prepare_option, tokenizer_difference

SOURCE_SHAPE = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias")
GPT2_HUB_SHAPES = {name: PRESETS[name] for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}


def is_scratch(init_from: str) -> bool:
    return init_from.strip() in ("", "scratch")


def is_ours(path: Path) -> bool:
    """A run directory, its checkpoints/ folder, or one checkpoint folder of ours (not a HF folder)."""
    return (path / "meta.json").is_file() or (path / "checkpoints").is_dir() or path.name == "checkpoints"


def source_shape(init_from: str) -> tuple[GPTConfig, dict]:
    """The source's model shape and tokenizer spec, read without its weights: a run of ours from its checkpoint's
    meta.json, a Hugging Face folder from its config.json, GPT-2's own Hub names from their known shapes (no
    download, so a plan or `config show` works offline); another Hub name is fetched (config and tokenizer only)."""
    path = Path(init_from)
    if path.is_dir() and is_ours(path):
        meta = read_meta(resolve_checkpoint(path))
        return config_from_resolved(meta["config"]).model, meta.get("tokenizer") or {"kind": "gpt2"}
    if not path.exists() and init_from in GPT2_HUB_SHAPES:
        return (GPTConfig(**GPT2_HUB_SHAPES[init_from], vocab_size=GPT2_VOCAB_SIZE, bias=True, pad_vocab_multiple=1),
                {"kind": "gpt2"})
    folder = resolve_hf_folder(init_from, weights=False)
    shape, tokenizer = read_hf_shape(folder, init_from), hf_tokenizer_spec(folder)
    check_vocab_fits_tokenizer(shape.vocab_size, tokenizer, init_from)  # none: GPT-2's, for its vocabulary only
    return shape, tokenizer or {"kind": "gpt2"}


def read_hf_shape(folder: Path, init_from: str) -> GPTConfig:
    try:
        return gpt_config_from_hf(json.loads((folder / "config.json").read_text()), pad_vocab_multiple=1)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"train.init_from = {init_from!r}: {folder}/config.json is missing or unreadable "
                          f"({type(e).__name__})") from None


def load_source(init_from: str, data_tokenizer: dict, data_name: str) -> tuple[GPTConfig, dict[str, torch.Tensor], str]:
    """The source's model shape, its weights in our layout, with the token embedding cut to vocab_size rows
    (the source may have been padded to another multiple than this run's), and which weights those are: the
    checkpoint folder of a run of ours, or the Hugging Face folder (and the Hub name it came from). A source of
    another tokenizer than the data's is refused before its weights are read."""
    path = Path(init_from)
    if path.is_dir() and is_ours(path):
        ckpt = resolve_checkpoint(path)
        meta = read_meta(ckpt)
        shape = config_from_resolved(meta["config"]).model
        check_tokenizer(data_tokenizer, data_name, meta.get("tokenizer") or {"kind": "gpt2"}, init_from)
        weights, _, _ = load_checkpoint(ckpt, with_state=False)
        loaded = str(ckpt)
    else:  # a HF folder or a Hub name; resolve_hf_folder fails in one line offline
        folder = resolve_hf_folder(init_from)
        loaded = f"{folder} (Hugging Face GPT-2)" if path.is_dir() else f"{init_from} (Hugging Face GPT-2, {folder})"
        shape = read_hf_shape(folder, init_from)
        tokenizer = hf_tokenizer_spec(folder)
        check_vocab_fits_tokenizer(shape.vocab_size, tokenizer, init_from)  # none: GPT-2's, for its vocabulary only
        check_tokenizer(data_tokenizer, data_name, tokenizer or {"kind": "gpt2"}, init_from)
        weights = gpt_state_from_hf(read_hf_weights(folder), shape)  # a multiple of 1 pads nothing
    weights["transformer.wte.weight"] = weights["transformer.wte.weight"][:shape.vocab_size]
    return shape, weights, loaded


def data_name(data) -> str:
    """The run's data as a tokenizer refusal names it."""
    return "data.sources" if data.sources else f"data.dir {data.dir}"


def check_tokenizer(data_tokenizer: dict, data_name: str, source_tokenizer: dict, source: str) -> None:
    """The weights' ids must mean the data's text: a GPT-2 trained on char ids would learn another model."""
    difference = tokenizer_difference(data_tokenizer, source_tokenizer)
    if difference:
        raise ConfigError(f"{data_name} and train.init_from = {source!r} have different tokenizers ({difference}); "
                          f"prepare the data with the weights' tokenizer ({prepare_option(source_tokenizer)}) "
                          "or train from scratch")


def load_into(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy the source's weights into the plain model, padding the embedding to this model's rows. Ids the
    model has and the source had not (chat data's turn tokens on a model pretrained without them) start at the
    mean of the source's embedding rows (an untied head's too): a row the model can move from, where zeros or
    the padding's random rows would give the new tokens an arbitrary start."""
    wte = weights["transformer.wte.weight"]
    rows = model.transformer.wte.weight.size(0)
    weights = {**weights, "transformer.wte.weight": grown(wte, rows, model.config.vocab_size, wte.size(0))}
    head = weights.get("lm_head.weight")
    if head is not None and not model.config.tied_head:
        weights["lm_head.weight"] = grown(head[:wte.size(0)], model.lm_head.weight.size(0), model.config.vocab_size,
                                          wte.size(0))
    problem = weights_mismatch(model, weights)
    if problem:
        raise ConfigError(f"train.init_from = {source!r}: weights do not match the model ({problem})")
    model.load_state_dict(weights, strict=False)


def weights_to_start_from(run, data_tokenizer: dict) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """The weights a new run of train.init_from starts from and which they are (the start banner names them), or
    (None, None): training from scratch, or a resume, which continues its checkpoint instead. `run`: the
    resolved RunConfig; `data_tokenizer`: the data's spec, which the source's must equal."""
    cfg = run.config
    if is_scratch(cfg.train.init_from) or run.resumed is not None:
        return None, None
    _, weights, loaded = load_source(cfg.train.init_from, data_tokenizer, data_name(cfg.data))
    return weights, loaded
