"""The training guard: it watches each step's loss and gradient norm and says what to do about a bad one.

  non-finite loss or grad norm          skip the update (the train step leaves the weights alone)
  max_nonfinite of those in a row       roll back to the last good checkpoint
  a loss spike                          roll back (spikes.py's rule, the one `report` and `doctor` use, with
                                        guard.spike_window and guard.spike_factor, whose defaults are the rule's)
  max_rollbacks rollbacks in a row      stop: rolling back again would only loop
  (no new checkpoint saved between them)

A rollback reloads weights, optimizer and scaler but not the data loader, which keeps moving forward: the
batches that led to the trouble are not replayed. The guard only decides; the Trainer acts. Its decisions
depend only on the loss averaged over ranks, so every rank decides the same.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from gpt2train.config import GuardConfig
from gpt2train.spikes import LOSS_MIN_RISE, SpikeRule


class GuardError(ValueError):
    """The guard gave up on a run (rollbacks that loop, or divergence with nothing to roll back to)."""


@dataclass
class Verdict:
    action: str  # "skip" or "rollback"
    reason: str


class TrainingGuard:
    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.spike_rule = SpikeRule(window=max(1, cfg.spike_window), factor=cfg.spike_factor, min_rise=LOSS_MIN_RISE)
        self.recent: deque[float] = deque(maxlen=self.spike_rule.window)  # finite losses of accepted steps
        self.nonfinite_in_a_row = 0
        self.rollbacks_in_a_row = 0  # since the last new checkpoint

    def observe(self, loss: float, grad_norm: float, norm_may_overflow: bool = False) -> Verdict | None:
        """The verdict on one step's (rank-averaged) loss and pre-clip grad norm, or None when it is fine.

        `norm_may_overflow`: with fp16 a GradScaler skips overflowing steps itself and an infinite norm is
        routine, so only the loss counts then."""
        if not self.cfg.enabled:
            return None
        finite = math.isfinite(loss) and (norm_may_overflow or math.isfinite(grad_norm))
        if not finite:
            self.nonfinite_in_a_row += 1
            if self.cfg.max_nonfinite > 0 and self.nonfinite_in_a_row >= self.cfg.max_nonfinite:
                return Verdict("rollback", f"{self.nonfinite_in_a_row} non-finite steps in a row")
            return Verdict("skip", "non-finite loss or grad norm")
        self.nonfinite_in_a_row = 0
        if self.cfg.spike_factor > 0:
            base = self.spike_rule.baseline(self.recent)
            if base is not None and loss > base.bar:
                return Verdict("rollback", f"loss spike: {loss:.4g} > {base.bar:.4g} ({self.spike_rule}, "
                                           f"over the last {len(self.recent)} losses: median {base.median:.4g})")
        self.recent.append(loss)  # a spike never enters the window it is judged against: its step is undone
        return None

    def before_rollback(self, to_step: int, at_step: int) -> None:
        """Count a rollback; raise GuardError when the run keeps falling back to the same checkpoint."""
        if self.rollbacks_in_a_row >= self.cfg.max_rollbacks:
            raise GuardError(f"guard: {self.rollbacks_in_a_row} rollbacks in a row to step {to_step} and step {at_step} "
                             "failed again; lower train.lr, raise guard.spike_factor, or set guard.enabled = false")
        self.rollbacks_in_a_row += 1
        self.nonfinite_in_a_row = 0

    def after_checkpoint(self) -> None:
        """A new checkpoint means the run got past whatever made it roll back."""
        self.rollbacks_in_a_row = 0

    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "nonfinite_in_a_row": self.nonfinite_in_a_row,
                "rollbacks_in_a_row": self.rollbacks_in_a_row}

    def rewind(self, state: dict) -> None:
        """A rollback to the checkpoint that saved `state`: the losses judged against go back to that
        checkpoint's, its weights' own; the counters move on. A window of the timeline left held losses lower
        than the reloaded weights' (after a fall), which then looked like spikes and rolled back until the run
        stopped (a chat fine-tune did)."""
        self.recent.clear()
        self.recent.extend(state.get("recent", []))

    def load_state_dict(self, state: dict) -> None:
        self.recent.clear()
        self.recent.extend(state.get("recent", []))
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        self.rollbacks_in_a_row = int(state.get("rollbacks_in_a_row", 0))


def finite_or_none(x: float) -> float | None:
    """A guard record's loss or norm: null in the run log where it is not finite (JSON has no NaN)."""
    return x if math.isfinite(x) else None
