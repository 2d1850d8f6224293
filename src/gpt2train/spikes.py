"""The one rule for what a spike is: a value far above the values before it.

The training guard applies it to each step's loss as the step ends (training/guard.py rolls the step back);
`report` and `doctor` apply it afterwards to the logged losses and gradient norms (runlog.find_spikes). One
rule, so that what the guard let stand is not called a spike on the same metrics.jsonl later, nor the reverse.

A value is a spike when it is above the median of the SPIKE_WINDOW values before it by more than SPIKE_MADS
median absolute deviations (MAD) and by more than SPIKE_FACTOR times that median; it is judged once
SPIKE_MIN_HISTORY values are known (or the whole window, when a guard's window is shorter). Median and MAD
are robust: one earlier spike in the window barely moves them, and a loss falling fast early on pulls them
down at once, where a mean lags and hides a spike. The MAD term scales the bar with the series' own noise
(grad norms, small batches); the factor keeps ordinary noise on a very steady stretch (MAD near 0) from
counting. A loss must also rise by LOSS_MIN_RISE nats: near zero (a fine-tune that has learned its task) a jump
from 0.0014 to 0.03 is many times the median and many MADs, yet nothing went wrong, and the guard rolled a run
back on such jumps until it gave up.

The guard once had its own rule, 3x the mean of the last 50 losses. That let a character model at loss 1.5
fall back to uniform guessing over 65 characters (ln 65 = 4.17, 2.8x) without a rollback, while `doctor`
warned of 2x spikes: this rule, the readers', is right for both.

Which values came before is the caller's choice, the values that stand: the guard leaves out a step it rolled
back, the log's readers keep every logged value (a rolled-back step's record is replaced by its redo).
Non-finite values are neither judged nor remembered here: the guard skips those steps.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

SPIKE_WINDOW = 20  # values before it that a value is judged against: short, so a fast early fall hides no spike
SPIKE_MADS = 5.0  # a spike sits this many median absolute deviations above their median...
SPIKE_FACTOR = 1.5  # ...and above this multiple of it
SPIKE_MIN_HISTORY = 10  # too few values before this to judge what is normal
LOSS_MIN_RISE = 0.1  # nats per token: a loss that rises less above its median is no spike, whatever the ratio


class Baseline(NamedTuple):
    """What the next value is judged against."""
    median: float  # of the values before it
    bar: float  # a value above this is a spike


@dataclass(frozen=True)
class SpikeRule:
    """The rule with its numbers; the defaults are the rule. The guard's config may set its own window and
    factor (guard.spike_window, guard.spike_factor), whose defaults are these."""
    window: int = SPIKE_WINDOW
    factor: float = SPIKE_FACTOR
    mads: float = SPIKE_MADS
    min_rise: float = 0.0  # a spike is at least this far above the median (LOSS_MIN_RISE for losses)

    def baseline(self, before: Iterable[float]) -> Baseline | None:
        """The median and the bar of the last `window` finite values in `before`; None with too few to judge."""
        recent = [v for v in before if math.isfinite(v)][-self.window:]
        if len(recent) < min(SPIKE_MIN_HISTORY, self.window):
            return None
        median = statistics.median(recent)
        mad = statistics.median(abs(v - median) for v in recent)
        return Baseline(median, median + max(self.mads * mad, (self.factor - 1) * abs(median), self.min_rise))

    def is_spike(self, value: float, before: Iterable[float]) -> bool:
        base = self.baseline(before)
        return base is not None and math.isfinite(value) and value > base.bar

    def __str__(self) -> str:
        rise = f" and + {self.min_rise:g}" if self.min_rise else ""
        return f"above median + {self.mads:g} MAD and {self.factor:g}x the median{rise}"


SPIKE_RULE = SpikeRule()  # grad norms
LOSS_SPIKE_RULE = SpikeRule(min_rise=LOSS_MIN_RISE)  # losses
