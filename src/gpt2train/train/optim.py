"""AdamW with GPT-2's parameter groups, and the learning-rate schedule as a plain function of the step."""

from __future__ import annotations

import inspect
import math

import torch

from gpt2train.config import TrainConfig


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device_type: str,
                   fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW that decays only 2-D+ weights (matmuls, embeddings); biases and LayerNorm gains are left alone.

    fused None (the trainer's choice): the fused CUDA kernel, which updates every parameter in one launch,
    on CUDA, and the foreach path, which batches them, elsewhere. fused True / False force the fused kernel
    / one small kernel chain per tensor (the journey's naive stage).
    """
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    if fused is None:
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        kwargs["fused" if fused else "foreach"] = True
    else:
        kwargs.update(fused=fused, foreach=None if fused else False)
    return torch.optim.AdamW(groups, **kwargs)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (counted from 1).

    Linear warmup to cfg.lr over warmup_steps, then
      cosine: half a cosine down to lr * min_lr_ratio at max_steps;
      constant: flat;
      wsd: flat, then a linear decay to lr * min_lr_ratio over the last decay_fraction of the steps.
    """
    max_lr, min_lr = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step <= cfg.warmup_steps:
        return max_lr * step / max(1, cfg.warmup_steps)
    if cfg.schedule == "constant":
        return max_lr
    if step >= cfg.max_steps:
        return min_lr
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)
    # wsd
    decay_start = cfg.max_steps - int(cfg.decay_fraction * cfg.max_steps)
    if step <= decay_start:
        return max_lr
    progress = (step - decay_start) / max(1, cfg.max_steps - decay_start)
    return max_lr - progress * (max_lr - min_lr)
