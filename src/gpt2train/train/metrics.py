"""The metrics sinks of a run: metrics.jsonl always; TensorBoard and Weights & Biases when asked.

FLOPs per token live in gpt2train.model, the devices' peaks in gpt2train.devices."""

from __future__ import annotations

import json
import time
from pathlib import Path

# train/loop.py still imports these two from here; re-exported until it imports them from their homes.
from gpt2train.devices import peak_flops as peak_for_run  # noqa: F401
from gpt2train.model import flops_per_token  # noqa: F401


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
