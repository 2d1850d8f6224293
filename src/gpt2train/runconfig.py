"""A run's config resolved in one pass: what the user wrote, then every value derived from it, with its source.

    resolve_run(file or preset or Config, --set overrides, Environment) -> RunConfig

in this order: the model's shape from train.init_from (or from the checkpoint a fine-tune resumes), the
vocabulary from the prepared data, the context for train.seq_len 0, the size dial's rules (sizing.py), the
warmup as a share of the steps where no one set it in steps; then every check once. `train`, `plan`, `memory`,
`config show`, the benchmarks and the library's train() all call it and read only its result, so they agree on
what a config means. The result is sealed (sections.py): nothing changes a run's config after it was resolved.

"Set by the user" has one meaning: the key was written (the file, --set, or code; sections.py). Such a key
wins over a rule of the dial, and must agree with train.init_from's shape. What the environment gives (the
ranks, a measured speed for train.time_budget, the checkpoint being resumed) comes in as an Environment: where
a budget needs a speed and none is known, SpeedNeeded; training/speed.py measures it and resolves again (train(),
`gpt2train train`, plan, config show).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpt2train import sizing
from gpt2train.checkpoint import CheckpointError, newest_checkpoint, read_meta, resolve_checkpoint
from gpt2train.config import Config, ConfigError, apply_override, config_from_resolved, load_config, validate, written_keys
from gpt2train.data.mixture import data_meta
from gpt2train.distributed import launch_env
from gpt2train.runtime import batch_problem
from gpt2train.sizing import Derived, SpeedNeeded
from gpt2train.training import init_from

SHAPE_KEYS = init_from.SOURCE_SHAPE  # the [model] keys a source's weights fix


@dataclass(frozen=True)
class Environment:
    """What a config is resolved against besides its own keys."""

    world_size: int = 1  # processes the batch splits over
    run_dir: Path | None = None  # the run's folder and the trainer's --resume ("auto" or a path): a resumed
    resume: str | None = None  # run keeps the shape and the speed its checkpoint recorded
    speed: tuple[float, str] | None = None  # tokens/s of all ranks and where the figure comes from (time_budget)

    @classmethod
    def of_launch(cls, run_dir: str | Path | None = None, resume: str | Path | None = None) -> Environment:
        """This process's: torchrun's world size (1 without torchrun)."""
        return cls(world_size=launch_env()[2], run_dir=Path(run_dir) if run_dir else None,
                   resume=str(resume) if resume else None)

    def with_speed(self, tokens_per_s: float, source: str) -> Environment:
        return replace(self, speed=(float(tokens_per_s), source))


@dataclass(frozen=True)
class RunConfig:
    """A resolved, checked, read-only run config and the record of how each value came to be."""

    config: Config
    user_keys: frozenset[str]  # "section.key" written by the user
    origins: Mapping[str, str] = field(default_factory=dict)  # each derived key -> where its value came from
    dial: tuple[Derived, ...] = ()  # the size dial's rules, as plan and config show print them
    environment: Environment = Environment()
    resumed: Path | None = None  # the checkpoint a resume continues, when there is one

    def value(self, key: str):
        section, name = key.split(".")
        return getattr(getattr(self.config, section), name)

    def origin(self, key: str) -> str:
        """Where key's value comes from: a source of derived values, the user, or the default."""
        if key in self.origins:
            return self.origins[key]
        return "set by you" if key in self.user_keys else "default"


def resolve_run(config: str | Path | Config | None = None, overrides: Sequence[str] = (),
                env: Environment | None = None) -> RunConfig:
    """The run config of a file or preset name (None: the defaults) or of a Config made in code, with `--set`
    overrides, in `env` (None: this process's launch). One-line ConfigError for anything a run cannot take;
    SpeedNeeded when train.time_budget needs a speed that neither env nor a resumed checkpoint gives."""
    env = env or Environment.of_launch()
    if isinstance(config, Config):
        spec = copy.deepcopy(config)
        for item in overrides:
            apply_override(spec, item)
        validate(spec, between_keys=False)  # a Config made in code meets the same rules as a file
    else:
        spec = load_config(config, list(overrides))
    user = written_keys(spec)
    cfg, origins = copy.deepcopy(spec), {}
    # The checkpoint a resume continues matters for a fine-tune's shape and a time budget's speed only (finding
    # it verifies its files, which the trainer's resume does again).
    resumed = checkpoint_to_resume(env) if needs_resumed(cfg) else None

    meta = prepared_meta(cfg)
    adopt_source_shape(cfg, user, resumed, meta, origins)
    fixed = user | set(origins)  # the dial's rules leave a source's shape as it is
    take_data_vocab(cfg, meta, origins)
    if cfg.train.seq_len == 0:
        cfg.train.seq_len = cfg.model.block_size
        origins["train.seq_len"] = "model.block_size (train.seq_len = 0)"
    try:
        dial = sizing.derive(cfg, fixed, env.world_size, recorded_speed(resumed) or env.speed)
    except SpeedNeeded as e:
        e.shaped = copy.deepcopy(e.shaped)
        raise
    except sizing.SizingError as e:
        raise ConfigError(str(e)) from None
    for d in dial:
        if not d.explicit and d.key not in ("tokens", "decay"):
            origins[d.key] = d.rule if d.key == "train.tokens_per_s" else f"the size dial ({d.rule})"
    scale_warmup(cfg, user, origins)

    try:
        validate(cfg)
        check_tasks(cfg)
        problem = batch_problem(cfg.train.total_batch_tokens, cfg.train.micro_batch, cfg.train.seq_len, env.world_size)
        if problem:
            raise ConfigError(problem)
    except ConfigError as e:
        raise ConfigError(with_origins(str(e), cfg, origins)) from None
    seal(cfg)
    return RunConfig(cfg, user, origins, tuple(dial), env, resumed)


def check_tasks(cfg: Config) -> None:
    """eval.tasks names the suite's tasks (or "core"): an unknown name is a one-line ConfigError here, before a
    run starts, rather than a warning at its first suite step."""
    if not cfg.eval.tasks:
        return
    from gpt2train.eval.suite import resolve_tasks  # the suite's own list of names

    try:
        resolve_tasks(cfg.eval.tasks)
    except ValueError as e:
        raise ConfigError(f"eval.tasks = {cfg.eval.tasks!r}: {str(e).splitlines()[0]}") from None


def as_run(cfg: Config | RunConfig, env: Environment | None = None) -> RunConfig:
    """A RunConfig as it is; a Config resolved (the library's entry points take either)."""
    if isinstance(cfg, RunConfig):
        return cfg
    if not isinstance(cfg, Config):  # a dict or a preset name: Python would name an attribute, or read a file
        raise TypeError(f"a run takes a Config, not {type(cfg).__name__}: load_config(PATH_OR_PRESET) makes one")
    return resolve_run(cfg, env=env)


def needs_resumed(cfg: Config) -> bool:
    return not init_from.is_scratch(cfg.train.init_from) or cfg.train.time_budget > 0


def checkpoint_to_resume(env: Environment) -> Path | None:
    """The checkpoint the trainer will continue (its --resume), or None for a new run. A damaged one is left
    for the trainer to name."""
    if not env.resume:
        return None
    try:
        if env.resume == "auto":
            return newest_checkpoint(env.run_dir, warn=False) if env.run_dir is not None else None
        return resolve_checkpoint(env.resume)
    except CheckpointError:
        return None


def prepared_meta(cfg: Config) -> dict | None:
    """The run's data's meta.json (data.dir's, or the sources' shared one); None while it is not prepared (plan
    and config show still work; the trainer needs it and says so)."""
    try:
        return data_meta(cfg.data)
    except (FileNotFoundError, ValueError):  # not prepared yet, or unreadable: the trainer says which
        return None


def adopt_source_shape(cfg: Config, user: frozenset[str], resumed: Path | None, meta: dict | None,
                       origins: dict) -> None:
    """train.init_from's model shape into cfg.model: a resumed fine-tune's from its checkpoint, else the
    source's, whose tokenizer must be the data's. A shape key the user set must equal the source's."""
    source = cfg.train.init_from
    if init_from.is_scratch(source):
        return
    if resumed is not None:
        try:
            shape, where = config_from_resolved(read_meta(resumed)["config"]).model, f"the checkpoint resumed ({resumed})"
        except CheckpointError:
            return  # the trainer's resume names what is wrong with it
    else:
        shape, tokenizer = init_from.source_shape(source)
        where = f"train.init_from = {source!r}"
        if meta is not None:
            init_from.check_tokenizer(meta["tokenizer"], init_from.data_name(cfg.data), tokenizer, source)
    for key in SHAPE_KEYS:
        mine, theirs = getattr(cfg.model, key), getattr(shape, key)
        if f"model.{key}" in user and mine != theirs and not (key == "vocab_size" and mine <= 0):
            raise ConfigError(f"model.{key} = {mine!r} conflicts with {where}, which has {key} = {theirs!r}; remove "
                              f"model.{key} (the shape comes from the source)")
        setattr(cfg.model, key, theirs)
        origins[f"model.{key}"] = where


def recorded_speed(resumed: Path | None) -> tuple[float, str] | None:
    """The tokens/s a time-budgeted run was sized by at its first launch, kept in the checkpoint it resumes:
    a resume keeps that horizon and batch instead of measuring again."""
    if resumed is None:
        return None
    try:
        train = read_meta(resumed)["config"].get("train", {})
    except CheckpointError:
        return None
    if train.get("time_budget", 0) > 0 and train.get("tokens_per_s", 0) > 0:
        return float(train["tokens_per_s"]), f"measured at the run's first launch, kept in {resumed}"
    return None


def scale_warmup(cfg: Config, user: frozenset[str], origins: dict) -> None:
    """train.warmup_steps that neither the user nor the size dial set: train.warmup_fraction of max_steps, so that
    a preset shortened with --set train.max_steps warms up for its share of the steps, not its full run's count."""
    if "train.warmup_steps" in user or "train.warmup_steps" in origins:
        return
    cfg.train.warmup_steps = sizing.warmup_steps_for(cfg.train)
    origins["train.warmup_steps"] = (f"train.warmup_fraction {cfg.train.warmup_fraction:g} x train.max_steps "
                                     f"{cfg.train.max_steps:,}")


def take_data_vocab(cfg: Config, meta: dict | None, origins: dict) -> None:
    """model.vocab_size 0 takes the prepared data's vocabulary (kept 0 while the data is not prepared); a set
    one must hold every id of the data."""
    where = ", ".join(folder for folder in cfg.data.sources) or cfg.data.dir
    if cfg.model.vocab_size <= 0:
        if meta is not None:
            cfg.model.vocab_size = int(meta["vocab_size"])
            origins["model.vocab_size"] = f"the prepared data ({where})"
        else:
            origins["model.vocab_size"] = f"the prepared data, once {where} is prepared"
    elif meta is not None and cfg.model.vocab_size < int(meta["vocab_size"]):
        if meta.get("chat") and cfg.model.vocab_size == int(meta["vocab_size"]) - 2 and "model.vocab_size" in origins:
            # a source pretrained without the turn tokens: its vocabulary grows by them (init_from.load_into)
            cfg.model.vocab_size = int(meta["vocab_size"])
            origins["model.vocab_size"] += f", and the two chat turn tokens of {where}"
            return
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the data's vocabulary "
                          f"({meta['vocab_size']}); set it to {meta['vocab_size']} or 0 (from the data)")


KEY = re.compile(r"\b(model|data|train|eval|log|checkpoint|guard)\.[a-z_0-9]+\b")


def with_origins(message: str, cfg: Config, origins: Mapping[str, str]) -> str:
    """An error about derived values, each followed by where it came from: a user who never wrote
    model.block_size = 128 learns that train.init_from's source has it."""
    named = dict.fromkeys(m.group(0) for m in KEY.finditer(message))
    notes = []
    for key in named:
        if key in origins:
            section, name = key.split(".")
            notes.append(f"{key} = {getattr(getattr(cfg, section), name)!r} comes from {origins[key]}")
    return f"{message} ({'; '.join(notes)})" if notes else message


def seal(cfg: Config) -> None:
    for f in cfg.__dataclass_fields__:
        getattr(cfg, f).seal()
    cfg.seal()
