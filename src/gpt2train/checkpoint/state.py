"""The training state in a checkpoint: saved from and loaded into a live run, plain (weights in safetensors,
the optimizer in state.pt) or sharded (DCP, FSDP runs); every process's RNG as a component; and every check
of a checkpoint against the run that resumes it, in one place (the data loader checks its own position).
The files themselves are format.py's.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from gpt2train.checkpoint.format import (
    LAYOUT_KEYS,
    CheckpointError,
    CheckpointSaveError,
    checkpoint_name,
    load_model_state,
    model_state,
    recover,
    save_checkpoint,
    save_remedy,
    short_reason,
    stage,
    tied_keys,
    verify,
)
from gpt2train.config import ConfigError
from gpt2train.model import GPTConfig
from gpt2train.runtime import Runtime

# The model settings a resumed run must keep: its shape, and what its weights mean.
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "pad_vocab_multiple", "bias",
              "position", "rope_base", "qk_norm", "mlp", "tied_head", "logit_softcap", "value_embeddings", "unet_skips",
              "attention_window", "mtp_weight")


class ProcessRNG:
    """This process's random generators (Python, NumPy, torch's CPU and CUDA ones) as a component with a state
    dict of plain Python values and tensors (loadable with weights_only)."""

    def state_dict(self) -> dict:
        name, key, pos, has_gauss, gauss = np.random.get_state()
        state = {"python": random.getstate(), "numpy": (name, key.tolist(), pos, has_gauss, gauss),
                 "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        name, key, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.array(key, dtype=np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


# --- the training state of a live run (model, optimizer, sharded or not) ---------------------------------
def save_training_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             state: dict, meta: dict, *, is_main: bool, sharded: bool, keep_last: int,
                             ring: bool, best: bool) -> Path:
    """Save from every rank at once. Plain runs: rank 0 writes weights and optimizer. FSDP runs (`sharded`):
    every rank writes its shards of model and optimizer with DCP into the staging folder, and rank 0 adds the
    full weights (for sampling and export), the rest of the state and meta.json. Rank 0's outcome is shared,
    so a failed save raises CheckpointSaveError on every rank."""
    from gpt2train import distributed as D

    root = Path(run_dir) / "checkpoints"
    name = checkpoint_name(step) if ring else "best"
    staged, weights, error = None, None, None
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

        if is_main:
            recover(root)
            stage(root, name)
        D.barrier()
        staged = root / f".tmp-{name}"
        model_sd, optim_sd = get_state_dict(model, dcp_optimizers(optimizer))
        try:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(staged / "dcp"))
        except Exception as e:  # DCP reports a failed write on every rank
            code = getattr(e, "errno", None)
            error = (f"could not save checkpoint {name} in {root}: {short_reason(e)}; {save_remedy(code, root)} and "
                     "rerun with --resume auto", code)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        weights = {k: v.contiguous() for k, v in full.items() if k not in tied_keys(model)}
        meta = {**meta, "sharded": True}
    else:
        state = {**state, "optimizer": optimizer.state_dict()} if is_main else state
        meta = {**meta, "sharded": False}
    path = None
    if is_main and error is None:
        try:
            weights = weights if sharded else model_state(model)
            path = save_checkpoint(run_dir, step, weights, state, meta, keep_last=keep_last, ring=ring, best=best,
                                   staged=staged)
        except CheckpointSaveError as e:
            error = (str(e), e.errno)
    error = D.all_gather_objects(error)[0]  # rank 0's outcome decides for all
    if error is not None:
        raise CheckpointSaveError(*error)
    return path or root / name


def dcp_optimizers(optimizer):
    """What DCP's get/set_state_dict take: torch optimizers, so Muon + AdamW as the list of the two."""
    return getattr(optimizer, "optimizers", optimizer)


def load_training_checkpoint(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                             sharded: bool, verified_meta: dict | None = None) -> tuple[dict, dict]:
    """Load weights and optimizer state into a live model (wrapped or not) and return (state, meta).
    `verified_meta`: the checkpoint's meta when the caller has just verified it (verify reads every file).

    A sharded (FSDP) checkpoint loads into any world size, FSDP or not, through DCP's resharding; a plain one
    cannot be loaded into an FSDP run."""
    meta = verified_meta if verified_meta is not None else verify(ckpt)
    try:
        state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{ckpt} is damaged ({short_reason(e)}); resume from an earlier checkpoint") from None
    check_training_state(ckpt, state, meta)
    if meta.get("sharded"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, dcp_optimizers(optimizer))
        both = {"model": model_sd, "optim": optim_sd}
        with warnings.catch_warnings():  # loading a sharded checkpoint into one process is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(both, checkpoint_id=str(ckpt / "dcp"))
        set_state_dict(model, dcp_optimizers(optimizer), model_state_dict=both["model"], optim_state_dict=both["optim"])
        return state, meta
    if sharded:
        raise CheckpointError(f"{ckpt} was saved without FSDP; resume it with train.distributed = \"ddp\" "
                              "(or one process), or start a new run directory")
    try:
        weights = load_file(str(ckpt / "model.safetensors"))
    except Exception as e:
        raise CheckpointError(f"{ckpt} is damaged ({short_reason(e)}); resume from an earlier checkpoint") from None
    from gpt2train.distributed import unwrap

    if "optimizer" not in state:
        raise CheckpointError(weights_only_message(ckpt))
    load_model_state(unwrap(model), weights, ckpt / "model.safetensors")
    load_optimizer_state(optimizer, state["optimizer"], ckpt)
    return state, meta


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict, ckpt: Path) -> None:
    """The optimizer's state, whose moments must have the shapes of the parameters they belong to (or 1 along a
    dimension they average over: NorMuon's per-neuron second moment): torch loads mismatched ones silently and
    fails at the next step."""
    fix = "resume from a checkpoint of this model, or start a new run directory"
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{ckpt}/state.pt: the optimizer state does not fit this model ({short_reason(e)}); "
                              f"{fix}") from None
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value) and value.dim() and (value.dim() != param.dim() or any(
                        n not in (1, size) for n, size in zip(value.shape, param.shape))):
                    raise CheckpointError(f"{ckpt}/state.pt: optimizer {name} has shape {tuple(value.shape)} for a "
                                          f"parameter of shape {tuple(param.shape)}; {fix}")


# --- may this checkpoint be resumed by this run? -------------------------------------------------------
def check_resume(ckpt: Path, meta: dict, config: dict, batch: dict | None) -> str | None:
    """The checks of checkpoint `ckpt` against the run about to load it (`config`: the run's, as to_dict gives
    it), made before any tensor is loaded so that a refused resume changes nothing: not weights only, the same
    model shape and optimizer, and with `batch` (a resume, which continues the data; None for a rollback) the
    same tokens per step. Returns a note to print when only the split into micro-batches, accumulation and
    ranks changed. What state.pt must hold is checked as it is read (check_training_state)."""
    if "imported_from" in meta:  # weights only: no optimizer, scaler or data position to continue from
        raise CheckpointError(weights_only_message(ckpt))
    check_same_shape(meta["config"]["model"], config["model"])
    check_same_optimizer(ckpt, meta["config"].get("train", {}), config["train"])
    if batch is None:
        return None
    saved = saved_layout(meta)
    if not check_same_batch(saved, batch):
        return None
    return (f"note: resuming {describe_layout(saved)} as {describe_layout(batch)}: the same "
            f"{batch['tokens_per_step']:,} tokens per step, the data continues where it stopped")


def check_same_shape(saved_model: dict, model: dict) -> None:
    """Refuse to resume into a model of another shape (other training settings may change)."""
    gpt2 = dataclasses.asdict(GPTConfig())  # a checkpoint older than a key was made with its default
    saved_model = {k: saved_model.get(k, gpt2.get(k)) for k in SHAPE_KEYS}
    changed = [k for k in SHAPE_KEYS if saved_model[k] != model.get(k)]
    if changed:
        diff = ", ".join(f"{k}: {saved_model[k]} -> {model.get(k)}" for k in changed)
        raise ConfigError(f"cannot resume: model settings changed ({diff}); resume with the checkpoint's model "
                          "settings or start a new run directory")


def check_same_optimizer(ckpt: Path, saved_train: dict, train: dict) -> None:
    """Refuse to resume under another train.optimizer: the checkpoint holds the state of the one it used."""
    saved, now = saved_train.get("optimizer", "adamw"), train["optimizer"]  # older checkpoints: AdamW
    if saved != now:
        raise ConfigError(f"cannot resume: train.optimizer changed ({saved} -> {now}) and {ckpt} holds {saved}'s "
                          f"state; set train.optimizer = \"{saved}\", or start a new run directory with "
                          f"--set train.init_from={ckpt} (weights only)")


def batch_layout(runtime: Runtime) -> dict:
    """How a run splits its optimizer step: recorded in meta.json, compared on resume."""
    return {key: getattr(runtime, key) for key in LAYOUT_KEYS}


def saved_layout(meta: dict) -> dict:
    """A checkpoint's batch layout; checkpoints from before it was recorded have it in their config."""
    if "batch" in meta:
        return meta["batch"]
    train, world_size = meta["config"]["train"], int(meta.get("world_size", 1))
    per_pass = train["micro_batch"] * train["seq_len"] * world_size
    accum = train["total_batch_tokens"] // per_pass if train["total_batch_tokens"] > 0 else 1
    return {"tokens_per_step": per_pass * accum, "seq_len": train["seq_len"], "micro_batch": train["micro_batch"],
            "grad_accum": accum, "world_size": world_size}


def check_same_batch(saved: dict, now: dict) -> bool:
    """Refuse a resume whose optimizer step holds other tokens (the LR schedule and the data position would
    mean another run); True when only the split into micro-batches, accumulation and ranks changed."""
    if saved["seq_len"] != now["seq_len"]:
        raise ConfigError(f"cannot resume: train.seq_len changed ({saved['seq_len']} -> {now['seq_len']}); the data "
                          f"position counts windows of seq_len tokens: set train.seq_len = {saved['seq_len']}")
    if saved["tokens_per_step"] != now["tokens_per_step"]:
        raise ConfigError(f"cannot resume: tokens per step changed ({saved['tokens_per_step']} -> "
                          f"{now['tokens_per_step']}); set train.total_batch_tokens = {saved['tokens_per_step']} "
                          "(accumulation makes up a smaller micro_batch or world size)")
    return any(saved[k] != now[k] for k in ("micro_batch", "grad_accum", "world_size"))


def describe_layout(layout: dict) -> str:
    return (f"{layout['world_size']} rank(s) x {layout['micro_batch']} sequences x {layout['grad_accum']} "
            f"micro-step(s)")


RESUME_STATE_KEYS = ("scaler", "ranks")  # besides the optimizer (absent in weights-only checkpoints: own message)


def check_training_state(ckpt: Path, state, meta: dict) -> None:
    """What a resume reads from state.pt and meta.json is there: else one line, not a KeyError mid-resume."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{ckpt}/state.pt holds a {type(state).__name__}, not a training state; resume from "
                              f"an earlier checkpoint")
    if "optimizer" not in state and not meta.get("sharded"):
        raise CheckpointError(weights_only_message(ckpt))
    missing = [k for k in RESUME_STATE_KEYS if k not in state] + [k for k in ("tokens",) if type(meta.get(k)) is not int]
    if missing:
        raise CheckpointError(f"{ckpt} lacks {', '.join(missing)}: it cannot be resumed; resume from an earlier "
                              f"checkpoint, or start a new run with --set train.init_from={ckpt} (weights only)")


def weights_only_message(ckpt: Path) -> str:
    return (f"{ckpt} holds weights only (an import-hf checkpoint: no optimizer state to resume); to fine-tune "
            f"from it, start a new run with --set train.init_from={ckpt} instead of --resume")
