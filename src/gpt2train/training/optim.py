"""The optimizer and the learning-rate schedule as a plain function of the step.

train.optimizer = "adamw": AdamW with GPT-2's parameter groups for every parameter. "muon": Muon (below) for the
weight matrices inside the transformer blocks (attention and MLP), whose update it orthogonalizes, and AdamW as
above for the rest (embeddings, an untied head, LayerNorm gains, biases), the two stepped as one optimizer
(MuonAdamW). The schedule scales both: each group gets lr_at(step) of its own peak, train.lr for AdamW's groups
and train.muon_lr for Muon's.

Muon is our own small optimizer: without the options below its step is torch.optim.Muon's (tests/test_muon.py
compares the two), and it loads torch's Muon state (gpt2train's checkpoints before it). It adds the modern
recipe's options: Polar Express's orthogonalization (train.muon_orthogonalizer), NorMuon's per-neuron normalization
(train.muon_normalize) and cautious weight decay (train.cautious_weight_decay).

Muon orthogonalizes in bf16, as torch's does. A CPU without native bf16 emulates it, many times slower than fp32:
there Muon runs the same iteration in fp32, which makes the modern recipe's step much faster on such a CPU
(docs/benchmarks.md, "Measured: the preset as it ships, on a CPU without native bf16").
"""

from __future__ import annotations

import inspect
import math
import re

import torch

from gpt2train.config import TrainConfig
from gpt2train.model import GPTConfig
from gpt2train.runtime import cpu_has_native_bf16

BLOCK_PARAM = re.compile(r"(^|\.)transformer\.h\.\d+\.")  # after any wrapper prefix (module., _orig_mod.)

# Each orthogonalizer: the margin its first step divides the matrix's Frobenius norm by, and one (a, b, c) per
# iteration of X <- a X + (b A + c A²) X with A = X Xᵀ, an odd quintic in X that pushes every singular value
# of X towards 1.
ORTHOGONALIZERS: dict[str, tuple[float, tuple[tuple[float, float, float], ...]]] = {
    # Jordan's quintic (torch.optim.Muon's), five times: steep at 0, so small singular values grow fast; it
    # lands them in about [0.7, 1.2] rather than at 1, which trains as well.
    "newton_schulz": (1.0, ((3.4445, -4.775, 2.0315),) * 5),
    # Polar Express (Amsel et al. 2025): a polynomial per iteration, each the best for the interval the one
    # before leaves; these are modded-nanogpt's, computed for 5 iterations with a 2% margin for bf16 rounding
    # (the margin the first step divides by).
    "polar_express": (1.02, (
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    )),
}


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
        return make_adamw(named, cfg, device_type, fused)
    emulated_bf16 = device_type == "cpu" and not cpu_has_native_bf16()
    muon = Muon([p for n, p in named if is_muon_param(n, p)], lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                weight_decay=cfg.muon_weight_decay, orthogonalizer=cfg.muon_orthogonalizer,
                normalize=cfg.muon_normalize, beta2=cfg.muon_beta2, cautious_weight_decay=cfg.cautious_weight_decay,
                orthogonalize_in=torch.float32 if emulated_bf16 else torch.bfloat16)
    adamw = make_adamw([(n, p) for n, p in named if not is_muon_param(n, p)], cfg, device_type, fused)
    return MuonAdamW(muon, adamw)


def is_token_table(name: str) -> bool:
    """An embedding the token ids index (wte, the value tables): what train.embedding_lr sets the rate of."""
    return name.endswith("wte.weight") or ".value_embeds." in name or name.startswith("value_embeds.")


def uses_fused_adamw(device_type: str) -> bool:
    """Whether make_adamw's default is the fused kernel on this device type (the memory estimator asks too)."""
    return device_type in ("cuda", "cpu") and "fused" in inspect.signature(torch.optim.AdamW).parameters


def make_adamw(named: list[tuple[str, torch.Tensor]], cfg: TrainConfig, device_type: str,
               fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW that decays only 2-D+ weights (matmuls, embeddings); biases and LayerNorm gains are left alone.
    With cfg.embedding_lr > 0 the token tables are a group of their own (marked "token_tables") at that peak.

    fused None (the trainer's choice): the fused kernel, one pass over each parameter and its state with no
    temporaries, on CUDA and on a CPU, and the foreach path, which batches the parameters, elsewhere. On a CPU
    the foreach path's temporaries (as large as the token tables) made its update about four times slower
    (docs/benchmarks.md). fused True / False force the fused kernel / one small kernel chain per tensor (the
    journey's naive stage).
    """
    tables = [p for n, p in named if cfg.embedding_lr > 0 and is_token_table(n)]
    rest = [p for n, p in named if not (cfg.embedding_lr > 0 and is_token_table(n))]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    if tables:
        groups.append({"params": tables, "weight_decay": cfg.weight_decay, "lr": cfg.embedding_lr, "token_tables": True})
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    if fused is None:
        fused = uses_fused_adamw(device_type)
        kwargs["fused" if fused else "foreach"] = True
    else:
        kwargs.update(fused=fused, foreach=None if fused else False)
    return torch.optim.AdamW(groups, **kwargs)


def orthogonalize(matrix: torch.Tensor, orthogonalizer: str = "newton_schulz", dtype: torch.dtype = torch.bfloat16,
                  eps: float = 1e-7) -> torch.Tensor:
    """About U Vᵀ for matrix = U S Vᵀ (its singular values replaced by ones), in `dtype`, by the iteration
    ORTHOGONALIZERS[orthogonalizer] names. Plain tensor ops, so that an FSDP-sharded matrix (a DTensor) is
    orthogonalized whole through DTensor's matmuls, not shard by shard."""
    margin, steps = ORTHOGONALIZERS[orthogonalizer]
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.to(dtype).T if tall else matrix.to(dtype)  # wide: X Xᵀ is the smaller Gram matrix
    x = x / (x.norm() * margin).clamp(min=eps)  # the spectral norm is at most the Frobenius norm: now <= 1
    for a, b, c in steps:
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # as torch's Muon fuses it
    return x.T if tall else x


def normalize_neurons(update: torch.Tensor, state: dict, beta2: float) -> torch.Tensor:
    """NorMuon (Li et al. 2025): each neuron's share of the orthogonalized update divided by the root of an EMA
    of its mean square (state["second_moment"], decay beta2), then the whole rescaled to the update's Frobenius
    norm, so that the LR means what it means without NorMuon. The neurons are the rows of a tall or square matrix and
    the columns of a wide one, as modded-nanogpt does: an orthogonalized wide matrix has rows of equal norm
    already, its columns are where the sizes differ (and a tall one's rows)."""
    dim = 1 if update.size(0) >= update.size(1) else 0
    mean_square = update.square().mean(dim=dim, keepdim=True)  # (rows, 1) or (1, cols)
    if "second_moment" not in state:
        state["second_moment"] = torch.zeros_like(mean_square)
    second_moment = state["second_moment"]
    second_moment.lerp_(mean_square, 1 - beta2)  # no bias correction: the rescale below cancels any scalar
    normalized = update * second_moment.clamp(min=1e-10).rsqrt()
    return normalized * (update.norm() / normalized.norm().clamp(min=1e-10))


class Muon(torch.optim.Optimizer):
    """Muon for 2-D weights: a momentum buffer per matrix (an EMA of its gradient, Nesterov by default), whose
    orthogonalized version moves the matrix by lr * sqrt(max(1, rows / cols)), after decoupled weight decay
    param *= 1 - lr * weight_decay. Without the options below this is torch.optim.Muon's step, state and param
    groups (its state_dict loads: checkpoints of gpt2train before this class).

    The recipe's options: `orthogonalizer` (a key of ORTHOGONALIZERS), `normalize` (NorMuon, normalize_neurons,
    its second moment's decay `beta2`), `cautious_weight_decay` (decay only the entries where the update and the
    weight have the same sign: Chen et al. 2025), and `orthogonalize_in`, the dtype of the orthogonalization,
    which the machine decides. They are attributes, not param-group keys: the groups keep torch's Muon's keys,
    which a sharded (DCP) checkpoint of torch's Muon must find, and the options follow the config on resume.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 nesterov: bool = True, eps: float = 1e-7, *, orthogonalizer: str = "newton_schulz",
                 normalize: bool = False, beta2: float = 0.95, cautious_weight_decay: bool = False,
                 orthogonalize_in: torch.dtype = torch.bfloat16):
        if orthogonalizer not in ORTHOGONALIZERS:
            raise ValueError(f"orthogonalizer {orthogonalizer!r} is not one of {', '.join(ORTHOGONALIZERS)}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "nesterov": nesterov, "eps": eps})
        shapes = {tuple(p.shape) for group in self.param_groups for p in group["params"] if p.dim() != 2}
        if shapes:
            raise ValueError(f"Muon takes 2-D weights only, not shapes {sorted(shapes)}")
        self.orthogonalizer, self.normalize, self.beta2 = orthogonalizer, normalize, beta2
        self.cautious_weight_decay, self.orthogonalize_in = cautious_weight_decay, orthogonalize_in

    def __setstate__(self, state: dict):
        super().__setstate__(state)
        for group in self.param_groups:  # torch's Muon's, from a checkpoint of it: the orthogonalizer is ours
            for key in ("ns_coefficients", "ns_steps", "adjust_lr_fn"):
                group.pop(key, None)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.update(param, group)
        return loss

    def update(self, param: torch.Tensor, group: dict):
        grad, state, beta = param.grad, self.state[param], group["momentum"]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        momentum = state["momentum_buffer"]
        momentum.lerp_(grad, 1 - beta)
        direction = grad.lerp(momentum, beta) if group["nesterov"] else momentum
        update = orthogonalize(direction, self.orthogonalizer, self.orthogonalize_in, group["eps"]).to(param.dtype)
        if self.normalize:
            update = normalize_neurons(update, state, self.beta2)
        lr, decay = group["lr"], group["weight_decay"]
        if decay and self.cautious_weight_decay:
            param.sub_(param * (update * param >= 0), alpha=lr * decay)  # where the step already heads to 0
        elif decay:
            param.mul_(1 - lr * decay)
        param.add_(update, alpha=-lr * math.sqrt(max(1, param.size(0) / param.size(1))))  # RMS 1/sqrt(cols) if tall too


class MuonAdamW:
    """Muon and AdamW stepped as one optimizer, with what the rest of gpt2train uses of one: param_groups
    (Muon's, then AdamW's; GradScaler and the LR go through them), state, step, zero_grad, and a state dict
    that keeps the two apart (so that an AdamW checkpoint does not load into it, nor it into AdamW)."""

    def __init__(self, muon: Muon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw
        self.optimizers = [muon, adamw]

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]  # fresh: load_state_dict replaces groups

    @property
    def state(self) -> dict:
        return {**self.muon.state, **self.adamw.state}  # read-only view: each parameter is in one of them

    def step(self):
        for opt in self.optimizers:
            opt.step()

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


def set_lr(optimizer: torch.optim.Optimizer | MuonAdamW, step: int, cfg: TrainConfig) -> float:
    """Give every param group its LR for optimizer step `step`: lr_at's schedule with the group's own peak
    (cfg.muon_lr for Muon's groups, cfg.embedding_lr for the token tables' where they have one, cfg.lr for the
    rest). Returns AdamW's LR, the one logs report."""
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg, peak=cfg.embedding_lr) if group.get("token_tables") else lr
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
    decay_start = wsd_decay_start(cfg)
    if step <= decay_start:
        return max_lr
    progress = (step - decay_start) / max(1, cfg.max_steps - decay_start)
    return max_lr - progress * (max_lr - min_lr)


def wsd_decay_start(cfg: TrainConfig) -> int:
    """The last step at the peak before WSD's decay: the last decay_fraction of max_steps decays."""
    return cfg.max_steps - int(cfg.decay_fraction * cfg.max_steps)


def schedule_warning(cfg: TrainConfig) -> str | None:
    """One line when the schedule cannot run its course in max_steps (an explicit train.warmup_steps, or a
    resume with a shorter max_steps): warmup that reaches the last step, or WSD's decay that starts before
    warmup ends. None when the schedule fits."""
    warmup, steps = cfg.warmup_steps, cfg.max_steps
    fix = "lower train.warmup_steps, or leave it unset (train.warmup_fraction x train.max_steps)"
    if warmup >= steps:
        never = "" if cfg.schedule == "constant" else " and never decays"
        return (f"train.warmup_steps = {warmup:,} reaches train.max_steps = {steps:,}: the learning rate is still "
                f"warming up at the last step{never}; {fix}")
    if cfg.schedule == "wsd" and warmup > wsd_decay_start(cfg):
        return (f"train.warmup_steps = {warmup:,} runs into the decay, which starts after step "
                f"{wsd_decay_start(cfg):,} (the last {cfg.decay_fraction:g} of train.max_steps = {steps:,}): the "
                f"learning rate never holds its peak and decays over fewer steps; {fix}")
    return None
