"""Run under torchrun by tests/test_distributed.py: a few optimizer steps of the tiny model, then rank 0
writes the losses, the val loss and the full (gathered) weights to OUT with torch.save.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed_worker.py \
        DATA_DIR OUT --strategy fsdp --micro-batch 2 --accum 2 --steps 3
"""

from __future__ import annotations

import argparse

import torch

from conftest import tiny_config  # this script's folder (tests/) is first on sys.path
from gpt2train import distributed as D
from gpt2train.train.loop import Trainer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("data_dir")
    p.add_argument("out")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    trainer = None
    try:
        cfg = worker_config(args.data_dir, args.strategy, args.micro_batch, args.accum, args.steps, world_size=2)
        trainer = Trainer(cfg, None)
        losses = [float(D.all_reduce_mean(torch.tensor(trainer.train_step()["loss"]))) for _ in range(args.steps)]
        val_loss = trainer.evaluate()
        weights = D.full_state_dict(trainer.model)  # a collective under FSDP: every rank calls it
        if trainer.is_main:
            torch.save({"losses": losses, "val_loss": val_loss, "weights": weights,
                        "model_type": type(D.unwrap(trainer.model)).__name__}, args.out)
    finally:
        D.shutdown_distributed(clean=trainer is not None)


def worker_config(data_dir, strategy: str, micro_batch: int, accum: int, steps: int, world_size: int):
    """The tiny config with checkpoints off, the same for the torchrun workers and the reference run."""
    cfg = tiny_config(data_dir, micro_batch=micro_batch, max_steps=steps)
    cfg.train.total_batch_tokens = micro_batch * cfg.train.seq_len * world_size * accum
    cfg.train.distributed = strategy
    cfg.checkpoint.every_steps = 0
    cfg.checkpoint.save_final = cfg.checkpoint.save_best = False
    return cfg


if __name__ == "__main__":
    main()
