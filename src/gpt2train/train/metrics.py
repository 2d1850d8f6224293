"""What a run reports: FLOPs per token, MFU against the real device's peak, and the metrics sinks
(metrics.jsonl always; TensorBoard and Weights & Biases when asked)."""

from __future__ import annotations

import json
import time
from pathlib import Path

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


class MetricsLogger:
    """Writes records to RUN_DIR/metrics.jsonl (one flushed line each) and mirrors scalars to TensorBoard
    and W&B when enabled. Only rank 0 builds an active logger."""

    def __init__(self, run_dir: Path | None, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str = "gpt2train", wandb_mode: str = "offline", config: dict | None = None):
        self.active = run_dir is not None
        self.file = self.tb = self.wandb = None
        if not self.active:
            return
        self.file = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("log.tensorboard = true needs TensorBoard: pip install tensorboard") from None
            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if wandb and wandb_mode != "disabled":
            try:
                import wandb as wandb_lib
            except ImportError:
                raise ImportError("log.wandb = true needs Weights & Biases: pip install wandb") from None
            self.wandb = wandb_lib.init(project=wandb_project, mode=wandb_mode, dir=str(run_dir),
                                        name=Path(run_dir).name, config=config)

    def log(self, kind: str, **fields):
        if not self.active:
            return
        record = {"kind": kind, "time": time.time(), **fields}
        self.file.write(json.dumps(record) + "\n")
        step = fields.get("step")
        scalars = {f"{kind}/{k}": v for k, v in fields.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if self.tb is not None and step is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None and step is not None and scalars:
            self.wandb.log(scalars, step=step)

    def close(self):
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
