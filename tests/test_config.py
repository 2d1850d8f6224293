"""Config files and --set overrides: typed, checked, and written back losslessly."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpt2train.config import ConfigError, dump_toml, load_config, to_dict

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
