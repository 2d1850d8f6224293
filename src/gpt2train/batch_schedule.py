"""The tokens of each optimizer step as a function of its step number: train.batch_schedule's stages.

A stage [fraction, multiplier] makes every step after the first fraction x max_steps (rounded) take multiplier x
train.total_batch_tokens (the base; steps before the first stage take it once). The extra tokens come as more
micro-batches of gradient accumulation, so micro_batch and seq_len, and with them every compiled shape, stay
as they are. The loader is one stream cut into micro-batches, so step n reads the stream's micro-batches
accum(1) + ... + accum(n - 1) up to accum(1) + ... + accum(n): a function of n, which a resume continues.

Whatever counts a run's tokens asks this one schedule: the trainer's counter, tokens/s and MFU, the size
dial's steps for a token budget (steps_for_tokens), plan and the scaling ladder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSchedule:
    base_tokens: int  # tokens of a step at multiplier 1, all ranks: micro_batch x seq_len x world_size x base_accum
    base_accum: int = 1  # micro-batches per rank of such a step
    starts: tuple[tuple[int, int], ...] = ()  # (steps before the stage, its multiplier), in order

    @classmethod
    def of(cls, stages, max_steps: int, base_tokens: int, base_accum: int = 1) -> BatchSchedule:
        """The schedule of a run of max_steps; `stages`: config.batch_stages' (fraction, multiplier) pairs."""
        # Half up, not Python's round to even: a stage at 0.5 of 5 steps starts after 3, and one more step never
        # moves a start by two (steps_for_tokens counts on it).
        return cls(base_tokens, base_accum, tuple((math.floor(f * max_steps + 0.5), int(m)) for f, m in stages))

    def multiplier(self, step: int) -> int:
        """Step `step`'s multiple of the base batch (steps count from 1)."""
        return next((m for start, m in reversed(self.starts) if step > start), 1)

    def accum(self, step: int) -> int:
        """Micro-batches per rank at step `step`."""
        return self.base_accum * self.multiplier(step)

    def tokens_at(self, step: int) -> int:
        return self.base_tokens * self.multiplier(step)

    def tokens_through(self, step: int) -> int:
        """Tokens of steps 1 .. step together (0 for step 0)."""
        steps, done, m = 0, 0, 1  # steps counts base batches
        for start, multiplier in self.starts:
            upto = min(start, step)
            if upto > done:
                steps, done = steps + (upto - done) * m, upto
            m = multiplier
        return (steps + max(0, step - done) * m) * self.base_tokens

    @property
    def staged(self) -> bool:
        return any(m != 1 for _, m in self.starts)

    def describe(self) -> str:
        """The stages in words: "1x from step 1, 2x from step 4, 3x from step 7" (a stage that rounding left
        without steps is left out)."""
        firsts = [(1, 1), *((start + 1, m) for start, m in self.starts)]
        kept = [(first, m) for i, (first, m) in enumerate(firsts) if i + 1 == len(firsts) or firsts[i + 1][0] > first]
        return ", ".join(f"{m}x from step {first}" for first, m in kept)


def steps_for_tokens(stages, tokens: float, base_tokens: int) -> int:
    """The fewest steps whose schedule (stages spread over that many steps) reaches `tokens`, at least one. The
    tokens of a run grow with its steps because multipliers never fall (config.batch_stages), so a bisection finds it."""
    if not stages:
        return max(1, math.ceil(tokens / base_tokens))

    def through(steps: int) -> int:
        return BatchSchedule.of(stages, steps, base_tokens).tokens_through(steps)

    low, high = 1, max(1, math.ceil(tokens / base_tokens))  # every step takes at least the base
    while low < high:
        mid = (low + high) // 2
        low, high = (mid + 1, high) if through(mid) < tokens else (low, mid)
    return low
