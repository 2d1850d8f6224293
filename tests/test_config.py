"""Config files and --set overrides: typed, range-checked, and written back losslessly."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from gpt2train.config import (
    RANGES,
    Config,
    ConfigError,
    config_from_resolved,
    dump_toml,
    load_config,
    preset_files,
    to_dict,
    validate,
)
from gpt2train.runconfig import resolve_run

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.model.n_embd % cfg.model.n_head == 0


def test_presets_have_hugging_face_shapes():
    shapes = {p.stem: load_config(p).model for p in CONFIGS}
    assert (shapes["gpt2"].n_layer, shapes["gpt2"].n_head, shapes["gpt2"].n_embd) == (12, 12, 768)
    assert (shapes["gpt2-medium"].n_layer, shapes["gpt2-medium"].n_head, shapes["gpt2-medium"].n_embd) == (24, 16, 1024)
    assert (shapes["gpt2-large"].n_layer, shapes["gpt2-large"].n_head, shapes["gpt2-large"].n_embd) == (36, 20, 1280)
    assert (shapes["gpt2-xl"].n_layer, shapes["gpt2-xl"].n_head, shapes["gpt2-xl"].n_embd) == (48, 25, 1600)


def test_overrides_are_typed():
    cfg = load_config(None, ["train.lr=3e-4", "model.n_layer=3", "train.compile=true", "data.dir=some/where",
                             "eval.sample_prompts=[\"a\", \"b\"]", "train.min_lr_ratio=0"])
    assert cfg.train.lr == 3e-4 and cfg.model.n_layer == 3 and cfg.train.compile is True
    assert cfg.data.dir == "some/where" and cfg.eval.sample_prompts == ["a", "b"]
    assert isinstance(cfg.train.min_lr_ratio, float)
    assert load_config(None, ["train.compile=auto"]).train.compile == "auto"


@pytest.mark.parametrize("override, message", [
    ("train.lr=fast", "train.lr = 'fast' has the wrong type; expected a number"),
    ("model.n_layer=2.5", "expected an integer"),
    ("train.nope=1", "unknown key train.nope; keys in [train] are"),
    ("nope.lr=1", "unknown section"),
    ("train.dtype=bf17", "use one of: auto, float32, bfloat16, float16"),
    ("train.compile=maybe", "use one of: true, false, auto"),
    ("train.lr", "expected section.key=value"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        load_config(None, [override])
    assert "\n" not in str(info.value)


def test_bad_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlr = = 3\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
    bad.write_text("[trian]\nlr = 3\n")
    with pytest.raises(ConfigError, match=r"unknown config section \[trian\]"):
        load_config(bad)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.lr=1e-3", "eval.sample_prompts=[\"x\\\"y\\n\"]", "train.compile=false"])
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(cfg))
    assert to_dict(load_config(path)) == to_dict(cfg)


def numeric_keys() -> list[str]:
    """section.key of every int or float field of every section (the bool ones are not numbers here)."""
    cfg = Config()
    keys = []
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        hints = typing.get_type_hints(type(obj))
        keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(obj) if hints[f.name] in (int, float)]
    return keys


def test_every_numeric_key_has_a_range():
    keys = numeric_keys()
    assert len(keys) > 30 and "train.lr" in keys and "guard.spike_window" in keys
    assert [k for k in keys if k not in RANGES] == [], "give each new numeric key its range in config.RANGES"
    assert [k for k in RANGES if k not in keys] == []  # and no range for a key that has gone


def test_every_default_and_shipped_preset_is_in_range():
    validate(Config())
    for name in preset_files():
        if name in ("finetune-cpu", "chat-cpu"):  # their source, the quickstart's run, is not here: keys checked on load
            load_config(name)      # (tests/test_short_runs.py resolves and trains it from a stand-in)
            continue
        resolve_run(name)


@pytest.mark.parametrize("override, message", [
    ("log.interval=0", "log.interval = 0 is out of range; it must be >= 1"),
    ("train.lr=-1", "train.lr = -1.0 is out of range; it must be >= 0"),
    ("train.lr=nan", "train.lr = nan is out of range"),
    ("train.lr=inf", "train.lr = inf is out of range"),
    ("model.dropout=1", "model.dropout = 1.0 is out of range; it must be in [0, 1)"),
    ("train.min_lr_ratio=1.5", "it must be in [0, 1]"),
    ("train.seed=-1", "train.seed = -1 is out of range; it must be in [0, 2147483647]"),
    ("checkpoint.keep_last=0", "it must be >= 1"),
    ("train.lr=1" + "0" * 400, "is too large for a number"),
    ("model.n_head=5", "model.n_embd = 768 is not a multiple of model.n_head = 5"),
    ("train.seq_len=2048", "train.seq_len = 2048 exceeds model.block_size = 1024"),
    ("train.compile=1", "train.compile = 1 has the wrong type"),
    ("train.device=tpu", "train.device = 'tpu' is not allowed; use auto, cpu, cuda, cuda:N or mps"),
    # rope_base 1e-300 is 0 in fp32: the frequencies inf, the angles nan, a run of nan losses (a probe found it)
    ("model.rope_base=1e-300", "model.rope_base = 1e-300 is out of range; it must be > 1"),
])
def test_values_out_of_range_name_the_key_and_the_range(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        resolve_run(None, [override])  # a rule between two keys is checked once the config is resolved
    assert "\n" not in str(info.value)


def test_a_config_built_in_code_is_checked_before_the_trainer_starts(char_data, tmp_path):
    from conftest import tiny_config
    from gpt2train.training.loop import train

    cfg = tiny_config(char_data)
    cfg.log.interval = 0  # would divide by zero at the first step
    with pytest.raises(ConfigError, match="log.interval = 0 is out of range"):
        resolve_run(cfg)
    with pytest.raises(ConfigError, match="log.interval = 0 is out of range"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # stopped before the run directory was made


def test_a_checkpoints_config_loads_even_out_of_today_s_ranges():
    saved = to_dict(Config())
    saved["guard"]["spike_window"] = 0  # once allowed, say; the weights must stay loadable
    assert config_from_resolved(saved).guard.spike_window == 0
