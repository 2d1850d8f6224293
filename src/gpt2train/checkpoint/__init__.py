"""Checkpoints, by job: format.py the files on disk (atomic saves, verify, recover, latest, the ring, best/,
the weights), state.py the training state of a live run (plain and DCP) and every resume check, inspect.py
what a checkpoint or a run directory holds, in words (`ckpt inspect`, run_on_disk). This package's names are
the ones callers use; a model built for inference from a checkpoint is gpt2train.loading's."""

from gpt2train.checkpoint.format import (
    CheckpointError,
    CheckpointSaveError,
    checkpoint_name,
    load_checkpoint,
    load_model_state,
    model_state,
    newest_checkpoint,
    point_latest,
    read_meta,
    recover,
    resolve_checkpoint,
    resolve_verified,
    ring_entries,
    save_checkpoint,
    save_safetensors,
    set_aside_newer,
    verify,
    weights_mismatch,
)
from gpt2train.checkpoint.inspect import describe_checkpoint, run_on_disk
from gpt2train.checkpoint.state import (
    ProcessRNG,
    batch_layout,
    check_resume,
    check_same_shape,
    load_optimizer_state,
    load_training_checkpoint,
    save_training_checkpoint,
    saved_layout,
)

__all__ = [
    "CheckpointError", "CheckpointSaveError", "ProcessRNG", "batch_layout", "check_resume",
    "check_same_shape", "checkpoint_name", "describe_checkpoint", "load_checkpoint", "load_model_state",
    "load_optimizer_state", "load_training_checkpoint", "model_state", "newest_checkpoint", "point_latest", "read_meta",
    "recover", "resolve_checkpoint", "resolve_verified", "ring_entries", "run_on_disk", "save_checkpoint", "save_safetensors",
    "save_training_checkpoint", "saved_layout", "set_aside_newer", "verify", "weights_mismatch",
]
