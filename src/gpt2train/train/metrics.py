"""The cost side of training: FLOPs per token, and the device peaks that MFU is measured against.

The run log these numbers are written to (metrics.jsonl, TensorBoard, W&B) is gpt2train.runlog."""

from __future__ import annotations

import torch

from gpt2train.model import GPTConfig

# Dense peak FLOP/s by precision, from the vendors' data sheets (no sparsity).
# Keys are matched as substrings of torch.cuda.get_device_name(), most specific first.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),
    ("H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100 NVL", {"bf16": 835e12, "tf32": 418e12, "fp32": 60e12}),
    ("H100", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),  # SXM
    ("A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("L40", {"bf16": 181e12, "tf32": 90.5e12, "fp32": 90.5e12}),  # before "L4", which it contains
    ("L4", {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("A10G", {"bf16": 70e12, "tf32": 35e12, "fp32": 31.2e12}),
    ("A10", {"bf16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("RTX 4090", {"bf16": 165e12, "tf32": 82.6e12, "fp32": 82.6e12}),
    ("RTX 3090", {"bf16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12}),
    ("V100", {"bf16": 125e12, "tf32": 15.7e12, "fp32": 15.7e12}),  # no bf16: the fp16 tensor-core peak
    ("T4", {"bf16": 65e12, "tf32": 8.1e12, "fp32": 8.1e12}),  # likewise fp16
]


def flops_per_token(cfg: GPTConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6 * N + 12 * n_layer * n_embd * seq_len.

    N counts every parameter used in a matmul: all but the position embedding (the token embedding
    counts once, as the tied lm_head). 6 = 2 (multiply-add) * 3 (forward + two backward matmuls).
    The second term is attention's QK^T and AV, which no parameter count sees.
    """
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.padded_vocab_size
    weights = 12 * C * C  # c_attn 3C^2 + attn c_proj C^2 + c_fc 4C^2 + mlp c_proj 4C^2
    biases = 9 * C if cfg.bias else 0  # 3C + C + 4C + C
    layer_norms = 2 * (2 * C if cfg.bias else C)  # ln_1 and ln_2: a gain (and a bias)
    n = V * C + L * (weights + biases + layer_norms) + (2 * C if cfg.bias else C)  # + ln_f
    return 6 * n + 12 * L * C * seq_len


def peak_flops(device: torch.device, precision: str = "bf16") -> float | None:
    """The device's dense peak for a precision ("bf16", "tf32", "fp32"), or None if unknown (CPU too)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_FLOPS:
        if key in name:
            return peaks[precision]
    return None


def peak_for_run(name_or_device, dtype: torch.dtype, tf32: bool) -> float | None:
    precision = "bf16" if dtype in (torch.bfloat16, torch.float16) else ("tf32" if tf32 else "fp32")
    if isinstance(name_or_device, str):
        for key, peaks in PEAK_FLOPS:
            if key.lower() in name_or_device.lower():
                return peaks[precision]
        return None
    return peak_flops(name_or_device, precision)
