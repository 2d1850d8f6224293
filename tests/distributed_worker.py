"""Run under torchrun by tests/test_distributed.py: a few optimizer steps of the tiny model, then rank 0
writes the losses, the val loss and the full (gathered) weights to OUT with torch.save.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed_worker.py \
        DATA_DIR OUT --strategy fsdp --micro-batch 2 --accum 2 --steps 3 [--optimizer muon [--muon-recipe]]
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch.distributed as dist

from conftest import MUON_RECIPE, WELL_CONDITIONED_EPS, tiny_config  # this script's folder (tests/) is first on sys.path
from gpt2train import distributed as D
from gpt2train.training.loop import Trainer


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with every FSDP2 shard gathered into a full tensor (on CPU).

    A collective under FSDP: call it on every rank. Under DDP or a single process it is a plain copy.
    """
    from torch.distributed.tensor import DTensor

    state = D.unwrap(model).state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("data_dir")
    p.add_argument("out")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--ns-float64", action="store_true", help="Muon's Newton-Schulz in float64 (see below)")
    p.add_argument("--muon-recipe", action="store_true", help="conftest.MUON_RECIPE's Muon")
    args = p.parse_args()
    trainer = None
    try:
        cfg = worker_config(args.data_dir, args.strategy, args.micro_batch, args.accum, args.steps, world_size=2)
        cfg.train.dtype, cfg.train.optimizer = args.dtype, args.optimizer
        if args.muon_recipe:
            for key, value in MUON_RECIPE.items():
                setattr(cfg.train, key, value)
        trainer = Trainer(cfg, None)
        if args.ns_float64:
            # Muon orthogonalizes in bf16, where a rounding difference in one gradient element can move an update
            # by 1e-3; in float64 runs that sum in another order agree to 1e-7, so a comparison sees the
            # distributed arithmetic (a DTensor's matmuls across FSDP shards) itself.
            trainer.optimizer.muon.orthogonalize_in = torch.float64
        reductions = count_gradient_reductions()
        seen_dtypes = record_weight_dtype_in_forward(trainer.raw_model.transformer.h[0].attn.c_attn)
        losses, per_step = [], []
        for _ in range(args.steps):
            reductions.clear()
            loss = trainer.train_step()["loss"]
            per_step.append(reductions["reduce_scatter_single"])
            losses.append(float(D.all_reduce_mean(torch.tensor(loss))))
        val_loss = trainer.evaluate()
        weights = full_state_dict(trainer.model)  # a collective under FSDP: every rank calls it
        if trainer.is_main:
            master = trainer.raw_model.transformer.h[0].attn.c_attn.weight  # the sharded master weight
            torch.save({"losses": losses, "val_loss": val_loss, "weights": weights,
                        "model_type": type(D.unwrap(trainer.model)).__name__, "reduce_scatters": per_step,
                        "forward_weight_dtypes": sorted(seen_dtypes), "master_dtype": str(master.dtype),
                        "optimizer_dtypes": sorted({str(v.dtype) for state in trainer.optimizer.state.values()
                                                    for v in state.values() if v.dim() > 0})}, args.out)
    finally:
        D.shutdown_distributed(clean=trainer is not None)


def count_gradient_reductions() -> collections.Counter:
    """Count FSDP2's reduce-scatters (its gradient reductions go through dist.reduce_scatter_single)."""
    counts = collections.Counter()
    original = dist.reduce_scatter_single

    def counted(*args, **kwargs):
        counts["reduce_scatter_single"] += 1
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counted
    return counts


def record_weight_dtype_in_forward(linear: torch.nn.Linear) -> set:
    """The dtypes a Linear's weight has while its forward runs (FSDP2 gathers it in param_dtype)."""
    seen = set()
    linear.register_forward_pre_hook(lambda module, inputs: seen.add(str(module.weight.dtype)))
    return seen


def worker_config(data_dir, strategy: str, micro_batch: int, accum: int, steps: int, world_size: int):
    """The tiny config with checkpoints off, the same for the torchrun workers and the reference run."""
    cfg = tiny_config(data_dir, micro_batch=micro_batch, max_steps=steps)
    cfg.train.total_batch_tokens = micro_batch * cfg.train.seq_len * world_size * accum
    cfg.train.distributed = strategy
    cfg.train.eps = WELL_CONDITIONED_EPS  # weights are compared with one process's (conftest says why)
    cfg.checkpoint.every_steps = 0
    cfg.checkpoint.save_final = cfg.checkpoint.save_best = False
    return cfg


if __name__ == "__main__":
    main()
