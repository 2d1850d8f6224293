"""A recipe as named changes to a base config, and the rows that compare them (bench quality, bench multiplier).

A change is a named group of config keys (CHANGES). From a base config and a recipe, plan_rows makes the rows
to train: the journey (the base, then one more change per row, so the last row is the whole recipe), the
ablation (the recipe, then the recipe minus one change at a time), or the two alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from gpt2train.config import Config, to_dict, validate
from gpt2train.ranges import UsageError


@dataclass(frozen=True)
class Change:
    name: str
    slug: str  # its part of a run directory's name
    keys: tuple[str, ...]


# The recipe's changes, in journey order: the late-2024 recipe's (the optimizer first: it moves the most; the
# schedule last), then the changes the records set since (issue 45).
CHANGES: list[Change] = [
    Change("Muon", "muon", ("train.optimizer", "train.muon_lr", "train.muon_momentum")),
    Change("rotary", "rotary", ("model.position", "model.rope_base")),
    Change("QK norm", "qk-norm", ("model.qk_norm",)),
    Change("ReLU²", "relu2", ("model.mlp",)),
    Change("untied head", "untied-head", ("model.tied_head",)),
    Change("zero-init projections", "zero-init", ("model.zero_init_proj",)),
    Change("logit soft cap", "softcap", ("model.logit_softcap",)),
    Change("WSD schedule", "wsd", ("train.schedule", "train.decay_fraction", "train.min_lr_ratio",
                                   "train.warmup_steps", "train.warmup_fraction")),
    Change("Polar Express", "polar-express", ("train.muon_orthogonalizer",)),
    Change("NorMuon", "normuon", ("train.muon_normalize", "train.muon_beta2")),
    Change("cautious weight decay", "cautious-wd", ("train.cautious_weight_decay", "train.muon_weight_decay")),
    Change("value embeddings", "value-embeddings", ("model.value_embeddings",)),
    Change("U-net skips", "unet", ("model.unet_skips",)),
    Change("embedding learning rate", "embedding-lr", ("train.embedding_lr",)),
    Change("AdamW learning rate", "adamw-lr", ("train.lr",)),  # with Muon: the head's, gains' and biases' peak
    Change("attention-window warmup", "window", ("model.attention_window", "train.window_warmup_steps")),
    Change("multi-token prediction", "mtp", ("model.mtp_weight",)),
    Change("batch-size schedule", "batch-schedule", ("train.batch_schedule",)),
    Change("weight average", "average", ("train.average_last", "train.average_blend")),
]


@dataclass
class Row:
    name: str  # "GPT-2", "+ rotary", "full recipe", "- rotary"
    slug: str
    cfg: Config
    changes: dict = field(default_factory=dict)  # key -> value, where this row differs from the base


def get_key(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def set_key(cfg: Config, key: str, value) -> None:
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, copy.deepcopy(value))


def flat(cfg: Config) -> dict:
    return {f"{section}.{key}": value for section, values in to_dict(cfg).items() for key, value in values.items()}


def differing_keys(a: Config, b: Config) -> list[str]:
    fa, fb = flat(a), flat(b)
    return [key for key in fa if fa[key] != fb[key]]


def with_keys(cfg: Config, source: Config, keys) -> Config:
    """A copy of cfg with `keys` taken from source where they differ. An equal value is left unwritten: a
    train.warmup_steps written as its default would win over the row's train.warmup_fraction."""
    out = copy.deepcopy(cfg)
    for key in keys:
        if get_key(out, key) != get_key(source, key):
            set_key(out, key, get_key(source, key))
    return out


def plan_rows(base: Config, modern: Config, ablate: bool = False, recipe_only: bool = False,
              base_name: str = "GPT-2", base_slug: str = "gpt2") -> tuple[list[Row], list[str]]:
    """(the rows to train, notes on the changes left out). UsageError, in one line, when the configs differ
    in a key that no change covers (the rows would not isolate the changes) or in none that one does."""
    covered = {key for change in CHANGES for key in change.keys}
    differ = differing_keys(base, modern)
    uncovered = [key for key in differ if key not in covered]
    if uncovered:
        raise UsageError(f"the base and the recipe also differ in {', '.join(uncovered)}, which no change covers: "
                         "make them equal (or --set them for every row)")
    changes = [c for c in CHANGES if any(key in differ for key in c.keys)]
    notes = [f"{c.name}: skipped, both configs have the same {', '.join(c.keys)}" for c in CHANGES if c not in changes]
    if not changes:
        raise UsageError("the base and the recipe are the same config: no change to measure")

    def row(name: str, slug: str, cfg: Config) -> Row:
        validate(cfg)  # a mix of the two may break a rule neither breaks (an odd head size with rotary)
        return Row(name, slug, cfg, {key: get_key(cfg, key) for key in differing_keys(base, cfg)})

    rows = [row(base_name, base_slug, base)]
    if recipe_only:
        return rows + [row("full recipe", "recipe", modern)], notes
    if not ablate:
        cfg = base
        for c in changes:
            cfg = with_keys(cfg, modern, c.keys)
            rows.append(row(f"+ {c.name}", c.slug, cfg))
        return rows, notes
    rows.append(row("full recipe", "recipe", modern))
    rows += [row(f"- {c.name}", f"recipe-minus-{c.slug}", with_keys(modern, base, c.keys)) for c in changes]
    return rows, notes


def recipe_changes(base: Config, modern: Config) -> dict[str, dict]:
    """Change name -> {key: [the base's value, the recipe's]} for the keys where the two differ."""
    differ = differing_keys(base, modern)
    out = {c.name: {key: [get_key(base, key), get_key(modern, key)] for key in c.keys if key in differ}
           for c in CHANGES}
    return {name: keys for name, keys in out.items() if keys}
