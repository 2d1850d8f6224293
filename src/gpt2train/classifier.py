"""The classifier at the end of the model and its loss: the tanh soft cap, and a cross-entropy that never
materializes the full (B*T, V) logits (chunked, fused with its gradient when one is wanted).

model.py calls it when config.loss_chunk > 0; tests/test_model.py and tests/test_modern.py check it against
F.cross_entropy on the plain logits, in value and gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap), in fp32: close to the logits while small, never beyond +-cap."""
    return cap * torch.tanh(logits.float() / cap)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                          vocab_size: int | None = None, cap: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of (hidden @ weight.T)[:, :vocab_size] against targets, `chunk` rows at a time
    (the logits soft-capped first when cap > 0).

    The full (B*T, V) logits never exist: each chunk's logits are made, scored and dropped. When gradients
    are wanted, the fused classifier below also computes them in the same pass. Equal to the plain loss in
    value and gradients, up to float rounding. Targets of -1 are ignored; on a CPU, outside a compiled graph,
    their rows are left out before the classifier (scored_rows).
    """
    hidden, targets = scored_rows(hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1))  # (B*T, C), (B*T,)
    vocab_size = vocab_size or weight.size(0)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return FusedClassifier.apply(hidden, weight, targets, vocab_size, chunk, cap)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.size(0), chunk):
        logits = _masked_logits(hidden[start : start + chunk], weight, vocab_size, cap)
        total += F.cross_entropy(logits, targets[start : start + chunk], ignore_index=-1, reduction="sum")
    return total / (targets != -1).sum().clamp(min=1)


def scored_rows(hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows whose target counts (not -1), when some do not and the mask can be read for free: on a CPU, outside
    a compiled graph (on a GPU it would wait for the device; compiled, it would break the graph). Chat data trains
    on the assistant's tokens alone, a sixth of a row or less, and the classifier is most of a small model's
    compute: skipping the rest made chat-cpu's steps ~3x faster (docs/chat.md). Masked rows have zero gradient,
    so the loss and the gradients are the same."""
    if hidden.device.type != "cpu" or torch.compiler.is_compiling():
        return hidden, targets
    valid = targets != -1
    if bool(valid.all()):
        return hidden, targets
    rows = valid.nonzero().squeeze(1)
    return hidden[rows], targets[rows]


class FusedClassifier(torch.autograd.Function):
    """The classifier and its loss in one pass per chunk: logits, log-softmax, loss, and the gradient of the
    summed loss with respect to the logits (softmax - one-hot), turned at once into the gradients of hidden
    and weight; backward only scales them. Per chunk the logits are read a few times while they are still
    in cache, instead of the passes over (B*T, V) arrays that cross_entropy and its backward make, and
    nothing of size V is saved for backward.

    The matmuls run in the autocast dtype (bf16 under autocast, as the plain path's would), the softmax in
    fp32, the weight's gradient is summed in fp32.
    Padded vocabulary columns are set to -inf in place: never scored, zero gradient. With a soft cap the
    logits' gradient passes through the cap's derivative, 1 - tanh^2.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_size: int, chunk: int, cap: float = 0.0):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        with torch.autocast(device, enabled=False):
            w, hid = weight.to(dtype), hidden.to(dtype)
            valid = targets != -1
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros_like(weight, dtype=torch.float32)
            for start in range(0, hidden.size(0), chunk):
                h, t = hid[start : start + chunk], targets[start : start + chunk].clamp(min=0)
                ok = valid[start : start + chunk, None]  # (n, 1): rows whose target counts
                if cap > 0:  # cap * tanh(z / cap) = 2 cap * sigmoid(2 z / cap) - cap: sigmoid is far cheaper than
                    # tanh on a CPU, the softmax ignores the shift by -cap, and 2 / cap scales the small input
                    logits = ((h * (2 / cap)) @ w.t()).float().sigmoid_().mul_(2 * cap)  # (n, padded V)
                else:
                    logits = (h @ w.t()).float()  # (n, padded V); a copy then fp32 log_softmax beats its dtype=
                if logits.size(1) > vocab_size:
                    logits[:, vocab_size:] = float("-inf")
                log_probs = torch.log_softmax(logits, dim=1)
                total -= (log_probs.gather(1, t[:, None]) * ok).sum()
                grad = log_probs.exp_()  # softmax, in place
                grad[torch.arange(len(t), device=t.device), t] -= 1.0
                if cap > 0:  # through the cap: d(cap * tanh(z / cap)) / dz = 4 sigmoid (1 - sigmoid)
                    logits[:, vocab_size:] = 0.0  # -inf there, where the gradient is already 0
                    sig = logits.mul_(1 / (2 * cap))
                    grad.mul_(sig.addcmul_(sig, sig, value=-1.0).mul_(4.0))
                grad = grad.to(dtype)
                grad_hidden[start : start + chunk] = (grad @ w) * ok
                grad_weight += grad.t() @ (h * ok)
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_loss / count
        return grad_hidden * scale, (grad_weight * scale).to(ctx.weight_dtype), None, None, None, None


def _masked_logits(h: torch.Tensor, weight: torch.Tensor, vocab_size: int, cap: float = 0.0) -> torch.Tensor:
    """(rows, padded V) fp32 logits whose padded columns are -inf: masked in place, not sliced and copied."""
    logits = (h @ weight.t()).float()
    if cap > 0:
        logits = softcap(logits, cap)
    if logits.size(1) > vocab_size:
        logits[:, vocab_size:] = float("-inf")
    return logits
