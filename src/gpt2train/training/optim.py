"""The optimizer and the learning-rate schedule as a plain function of the step.

train.optimizer = "adamw": AdamW with GPT-2's parameter groups for every parameter. "muon": torch.optim.Muon
for the weight matrices inside the transformer blocks (attention and MLP), whose update it orthogonalizes,
and AdamW as above for the rest (embeddings, an untied head, LayerNorm gains, biases), the two stepped as
one optimizer (MuonAdamW). The schedule scales both: each group gets lr_at(step) of its own peak, train.lr
for AdamW's groups and train.muon_lr for Muon's.

torch's Muon orthogonalizes in bf16. A CPU without native bf16 emulates it, many times slower than fp32:
there MuonAdamW runs the same iteration in fp32 (newton_schulz), which makes the modern recipe's step
much faster on such a CPU (docs/benchmarks.md, "Measured: the preset as it ships, on a CPU without native
bf16").
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re

import torch

from gpt2train.config import TrainConfig
from gpt2train.model import GPTConfig
from gpt2train.runtime import cpu_has_native_bf16

_torch_muon = getattr(torch.optim, "_muon", None)  # where torch.optim.Muon looks up its orthogonalization
TORCH_NEWTON_SCHULZ = getattr(_torch_muon, "_zeropower_via_newtonschulz", None)

BLOCK_PARAM = re.compile(r"(^|\.)transformer\.h\.\d+\.")  # after any wrapper prefix (module., _orig_mod.)


def is_muon_param(name: str, param: torch.Tensor) -> bool:
    """A weight matrix inside a transformer block; embeddings, the head, gains and biases are not."""
    return param.dim() == 2 and BLOCK_PARAM.search(name) is not None


def muon_parameter_count(cfg: GPTConfig) -> int:
    """Parameters Muon manages: each block's c_attn (3C x C), attn.c_proj (C x C), c_fc (4C x C), mlp.c_proj."""
    return cfg.n_layer * 12 * cfg.n_embd * cfg.n_embd


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device_type: str,
                   fused: bool | None = None) -> torch.optim.AdamW | MuonAdamW:
    """AdamW (see make_adamw) for every parameter, or with cfg.optimizer "muon" Muon for the blocks' weight
    matrices and AdamW for the rest. The split goes by parameter name, so a wrapped model splits alike."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied weights appear once
    if cfg.optimizer == "adamw":
        return make_adamw([p for _, p in named], cfg, device_type, fused)
    muon = torch.optim.Muon([p for n, p in named if is_muon_param(n, p)], lr=cfg.muon_lr,
                            weight_decay=cfg.muon_weight_decay, momentum=cfg.muon_momentum)
    adamw = make_adamw([p for n, p in named if not is_muon_param(n, p)], cfg, device_type, fused)
    emulated_bf16 = device_type == "cpu" and not cpu_has_native_bf16()
    return MuonAdamW(muon, adamw, orthogonalize_in=torch.float32 if emulated_bf16 else None)


def make_adamw(params: list[torch.Tensor], cfg: TrainConfig, device_type: str,
               fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW that decays only 2-D+ weights (matmuls, embeddings); biases and LayerNorm gains are left alone.

    fused None (the trainer's choice): the fused CUDA kernel, which updates every parameter in one launch,
    on CUDA, and the foreach path, which batches them, elsewhere. fused True / False force the fused kernel
    / one small kernel chain per tensor (the journey's naive stage).
    """
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


class MuonAdamW:
    """Muon and AdamW stepped as one optimizer, with what the rest of gpt2train uses of one: param_groups
    (Muon's, then AdamW's; GradScaler and the LR go through them), state, step, zero_grad, and a state dict
    that keeps the two apart (so that an AdamW checkpoint does not load into it, nor it into AdamW)."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW, orthogonalize_in: torch.dtype | None = None):
        self.muon, self.adamw = muon, adamw
        self.optimizers = [muon, adamw]
        self.orthogonalize_in = orthogonalize_in  # None: torch's own (bf16); else newton_schulz in this dtype

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]  # fresh: load_state_dict replaces groups

    @property
    def state(self) -> dict:
        return {**self.muon.state, **self.adamw.state}  # read-only view: each parameter is in one of them

    def step(self):
        with orthogonalization_in(self.orthogonalize_in):
            self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict):
        if not isinstance(state_dict, dict) or state_dict.keys() != {"muon", "adamw"}:
            raise ValueError("not a Muon + AdamW optimizer state")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])


def newton_schulz(dtype: torch.dtype):
    """Muon's orthogonalization as torch.optim.Muon computes it (the quintic Newton-Schulz iteration on the
    wide orientation, after scaling to Frobenius norm 1), in `dtype` instead of bf16; the signature of
    torch.optim._muon._zeropower_via_newtonschulz, for which it stands in. Plain tensor ops, so that an
    FSDP-sharded matrix (a DTensor) goes through it as through torch's."""

    def orthogonalize(grad: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
        a, b, c = coefficients
        tall = grad.size(0) > grad.size(1)
        x = grad.to(dtype).T if tall else grad.to(dtype)
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return (x.T if tall else x).to(grad.dtype)

    return orthogonalize


@contextlib.contextmanager
def orthogonalization_in(dtype: torch.dtype | None):
    """While torch's Muon steps: its orthogonalization in `dtype` (None: torch's own). Only torch's own is
    replaced: an orthogonalization someone else put there (a test's float64 one) stays."""
    if dtype is None or TORCH_NEWTON_SCHULZ is None or _torch_muon._zeropower_via_newtonschulz is not TORCH_NEWTON_SCHULZ:
        yield
        return
    _torch_muon._zeropower_via_newtonschulz = newton_schulz(dtype)
    try:
        yield
    finally:
        _torch_muon._zeropower_via_newtonschulz = TORCH_NEWTON_SCHULZ


def set_lr(optimizer: torch.optim.Optimizer | MuonAdamW, step: int, cfg: TrainConfig) -> float:
    """Give every param group its LR for optimizer step `step`: lr_at's schedule with the group's own peak
    (cfg.muon_lr for Muon's groups, cfg.lr for the rest). Returns AdamW's LR, the one logs report."""
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if isinstance(optimizer, MuonAdamW):
        for group in optimizer.muon.param_groups:
            group["lr"] = lr_at(step, cfg, peak=cfg.muon_lr)
    return lr


def lr_at(step: int, cfg: TrainConfig, peak: float | None = None) -> float:
    """Learning rate for optimizer step `step` (counted from 1), peaking at `peak` (default cfg.lr).

    Linear warmup to the peak over warmup_steps, then
      cosine: half a cosine down to peak * min_lr_ratio at max_steps;
      constant: flat;
      wsd: flat, then a linear decay to peak * min_lr_ratio over the last decay_fraction of the steps.
    """
    max_lr = cfg.lr if peak is None else peak
    min_lr = max_lr * cfg.min_lr_ratio
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
