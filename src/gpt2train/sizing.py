"""The size dial: `model.depth` sets the model's shape, and the run's other settings follow by stated rules.

A key the user set (written in the file, with --set or in code) always wins over a rule; a rule fills only
the keys nobody set. runconfig.resolve_run applies the rules once, after train.init_from's shape. Every
value a rule sets is kept with the rule's words, which `plan` and `config show` print. docs/training.md
("One size dial") gives each rule's source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpt2train.batch_schedule import steps_for_tokens
from gpt2train.config import ConfigError, batch_stages
from gpt2train.counting import parameter_count

# GPT-2 124M's AdamW learning rate at its width (GPT-3's Table 2.1, 6e-4 at 768), scaled as 1/width.
REFERENCE_LR, REFERENCE_WIDTH = 6e-4, 768
# The batch grows with the run's tokens alone: 2^19 tokens at 10B tokens (llm.c's GPT-2 124M run), times D^0.4.
REFERENCE_BATCH_TOKENS, REFERENCE_TOKENS, BATCH_EXPONENT = 2 ** 19, 10e9, 0.4
WARMUP_FRACTION = 0.05  # of the steps


@dataclass(frozen=True)
class Derived:
    key: str  # section.key, or a quantity the rules pass on ("tokens", "decay")
    value: object  # the run's value: the rule's, or the user's where explicit
    rule: str  # how the rule reaches its value, in words and numbers
    explicit: bool = False  # the user set the key; `rule_value` is what the rule would have given
    rule_value: object = None


class SizingError(ConfigError):
    """A dial setting no model can take (the message names the key)."""


class SpeedNeeded(SizingError):
    """train.time_budget sizes the run by its speed and none is known: the caller measures it for `shaped` (the
    config with the model's shape set) and resolves again with the figure."""

    def __init__(self, shaped):
        super().__init__("train.time_budget needs the run's speed: set train.tokens_per_s (`gpt2train plan` "
                         "reports it), or use a command that measures it (train, plan, config show)")
        self.shaped = shaped


def scaling_parameters(model) -> int:
    """N of the scaling rules: the blocks' parameters without embeddings and head (Kaplan et al. 2020), so it
    does not depend on the vocabulary."""
    return parameter_count(model, non_embedding=True)


def batch_tokens_for(tokens: float, granule: int) -> int:
    """REFERENCE_BATCH_TOKENS * (tokens / REFERENCE_TOKENS)^BATCH_EXPONENT to the nearest multiple of `granule`
    (one micro-batch on every rank), at least one. Not to a power of two: between two rungs of a ladder that
    would halve or double the batch in one jump, and the deeper rung could get fewer steps than the shallower."""
    ideal = REFERENCE_BATCH_TOKENS * (tokens / REFERENCE_TOKENS) ** BATCH_EXPONENT
    return max(1, round(ideal / granule)) * granule


def derive(cfg, explicit: set[str], ranks: int = 1, speed: tuple[float, str] | None = None) -> list[Derived]:
    """Fill cfg's dial-derived keys that are not in `explicit`; returns what was set and why. Nothing when
    model.depth is 0. Order matters: width before learning rate, tokens before batch, batch before steps.

    ranks: the processes the batch splits over. speed: (tokens/s of all ranks, where the figure comes from)
    for train.time_budget where train.tokens_per_s is 0 (kept in train.tokens_per_s); without one such a
    config raises SpeedNeeded, for its caller to measure."""
    if cfg.model.depth <= 0:
        return []
    dial = Dial(cfg, explicit)
    dial_shape(dial)
    tokens = dial_tokens(dial, speed)
    dial_batch_and_steps(dial, tokens, ranks)
    return dial.derived


class Dial:
    """The rules' work on one config: each key a rule fills, or would fill where the user set it, as a Derived."""

    def __init__(self, cfg, explicit: set[str]):
        self.cfg, self.explicit = cfg, explicit
        self.derived: list[Derived] = []

    def fill(self, key: str, value, rule: str) -> None:
        """Set section.key to the rule's value, unless the user set it (then the rule's value is only recorded)."""
        section, name = key.split(".")
        if key in self.explicit:
            self.derived.append(Derived(key, getattr(getattr(self.cfg, section), name), rule, explicit=True,
                                        rule_value=value))
            return
        setattr(getattr(self.cfg, section), name, value)
        self.derived.append(Derived(key, value, rule))

    def note(self, key: str, value, rule: str) -> None:
        """Record a quantity the rules pass on, or a key they keep as it is."""
        self.derived.append(Derived(key, value, rule))


def dial_shape(dial: Dial) -> None:
    """The model's shape from model.depth, and the learning rate from its width."""
    model, train = dial.cfg.model, dial.cfg.train
    width = model.depth * model.aspect_ratio
    if width % model.head_dim:
        raise SizingError(f"model.depth * model.aspect_ratio = {width} is not a multiple of model.head_dim = "
                          f"{model.head_dim}; pick an aspect ratio that is a multiple of the head size")
    dial.fill("model.n_layer", model.depth, f"model.depth = {model.depth}")
    dial.fill("model.n_embd", width, f"depth {model.depth} x aspect_ratio {model.aspect_ratio}")
    dial.fill("model.n_head", model.n_embd // model.head_dim, f"n_embd {model.n_embd} / head_dim {model.head_dim}")
    dial.fill("train.lr", REFERENCE_LR * REFERENCE_WIDTH / model.n_embd,
              f"{REFERENCE_LR:g} x {REFERENCE_WIDTH} / n_embd {model.n_embd} (AdamW's rate falls as 1/width)")
    if train.optimizer == "muon" and "train.muon_lr" not in dial.explicit:
        dial.note("train.muon_lr", train.muon_lr, "kept: Muon's orthogonalized step does not grow with width")


def dial_tokens(dial: Dial, speed: tuple[float, str] | None) -> float:
    """The run's length in tokens: train.time_budget at the run's speed, train.flops_budget / 6N, or else
    train.tokens_per_param x N."""
    cfg = dial.cfg
    model, train = cfg.model, cfg.train
    n = scaling_parameters(model)
    if train.flops_budget > 0 and train.time_budget > 0:
        raise SizingError(f"train.flops_budget = {train.flops_budget:g} and train.time_budget = "
                          f"{train.time_budget:g} both set the run's length; set one of them (the other to 0)")
    if train.time_budget > 0:
        if train.tokens_per_s <= 0:
            if speed is None:  # an explicit 0 too: it means "measure it"
                raise SpeedNeeded(cfg)
            rate, source = speed
            train.tokens_per_s = float(rate)
            dial.note("train.tokens_per_s", train.tokens_per_s, source)
        tokens = train.time_budget * train.tokens_per_s
        how = f"train.time_budget {train.time_budget:g} s x train.tokens_per_s {train.tokens_per_s:,.0f}"
    elif train.flops_budget > 0:
        tokens = train.flops_budget / (6 * n)
        how = f"train.flops_budget {train.flops_budget:.3g} / (6 x N {n:,})"
    else:
        tokens = train.tokens_per_param * n
        how = f"train.tokens_per_param {train.tokens_per_param:g} x N {n:,}"
    if not math.isfinite(tokens):  # each factor is finite, their product may not be
        raise SizingError(f"the run's length in tokens ({how.split(' x ')[0]} x ...) is more than a number holds; lower "
                          f"train.tokens_per_param or train.time_budget x train.tokens_per_s")
    dial.note("tokens", int(tokens), how)
    return tokens


def dial_batch_and_steps(dial: Dial, tokens: float, ranks: int) -> None:
    """The batch from the run's tokens, then the steps that spend them, the warmup and the decay."""
    model, train = dial.cfg.model, dial.cfg.train
    seq_len = train.seq_len or model.block_size
    granule = train.micro_batch * seq_len * ranks  # the batch must split evenly over the ranks
    dial.fill("train.total_batch_tokens", batch_tokens_for(tokens, granule),
              f"2^19 x (tokens / 1e10)^{BATCH_EXPONENT:g}, in whole micro-batches of {granule:,}")
    batch, stages = train.total_batch_tokens or granule, batch_stages(train)
    dial.fill("train.max_steps", steps_for_tokens(stages, tokens, batch), f"tokens {int(tokens):,} / batch {batch:,}"
              + (", the batch growing as train.batch_schedule says" if stages else ""))
    if "train.warmup_fraction" in dial.explicit:  # the config's share of the steps wins over the dial's
        dial.fill("train.warmup_steps", warmup_steps_for(train),
                  f"train.warmup_fraction {train.warmup_fraction:g} of the steps")
    else:
        dial.fill("train.warmup_steps", round(WARMUP_FRACTION * train.max_steps), f"{WARMUP_FRACTION:.0%} of the steps")
    decay = (f"the last {train.decay_fraction:g} of the steps" if train.schedule == "wsd"
             else "the steps after warmup" if train.schedule == "cosine" else "none (constant)")
    dial.note("decay", decay, f"train.schedule = {train.schedule} over max_steps {train.max_steps:,}")


def warmup_steps_for(train) -> int:
    """train.warmup_fraction of train.max_steps, in whole steps: the warmup of a config that does not set
    train.warmup_steps (runconfig.py), and of the dial's where the config sets the fraction."""
    return round(train.warmup_fraction * train.max_steps)


def format_derived(derived: list[Derived]) -> list[str]:
    """One line per value the dial touches: `key = value  (rule)`, or, where the user's key won,
    `key = value  (set in the config; the rule gives X: rule)`."""
    def shown(v):
        return f"{v:.4g}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)
    return [f"{d.key} = {shown(d.value)}  (set in the config; the rule gives {shown(d.rule_value)}: {d.rule})"
            if d.explicit else f"{d.key} = {shown(d.value)}  ({d.rule})" for d in derived]
