"""One pass from what the user wrote to the run's config (runconfig.py): one rule for "set by the user", the
shape from train.init_from or from the checkpoint a fine-tune resumes, where each derived value came from, a
read-only result, and train, plan, config show and the library agreeing on it."""

from __future__ import annotations

import copy
import dataclasses
import shutil
import sys
from pathlib import Path

import pytest

from conftest import one_line, tiny_config
from gpt2train import cli
from gpt2train.config import ConfigError, dump_toml, load_config, preset_files, to_dict, written_keys
from gpt2train.plan import make_plan, target_device
from gpt2train.runconfig import Environment, resolve_run
from gpt2train.training.loop import train
from gpt2train.training.speed import resolve_measuring

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

QUIET = ["train.device=cpu", "train.dtype=float32", "train.compile=false", "eval.interval=0", "eval.val_batches=1",
         "eval.sample_interval=0", "log.progress=lines"]


@pytest.fixture(scope="module")
def source_run(char_data, tmp_path_factory) -> Path:
    """A run of ours to fine-tune from: 2 layers, 32 wide, a context of 32 tokens."""
    out = tmp_path_factory.mktemp("source") / "run"
    train(tiny_config(char_data, max_steps=1), out)
    return out


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


# --- one rule for "set by the user" -----------------------------------------------------------------------

def test_written_keys_are_the_file_the_overrides_and_code_never_the_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nn_layer = 12\n[train]\nlr = 6e-4\n")  # both equal to the defaults: still written
    cfg = load_config(path, ["train.max_steps=5"])
    cfg.eval.interval = 250
    assert written_keys(cfg) == {"model.n_layer", "train.lr", "train.max_steps", "eval.interval"}
    assert written_keys(load_config(None, [])) == set()
    assert written_keys(copy.deepcopy(cfg)) == written_keys(cfg)  # a copy keeps the record


def test_a_shape_key_set_to_the_default_still_conflicts_with_the_source(char_data, source_run, tmp_path, capsys):
    """The bug: a value equal to the default counted as unset, so `--set model.n_layer=12` against a 2-layer
    source was silently replaced by 2 (where `model.n_layer=8` was refused)."""
    base = ["train", "--out", str(tmp_path / "ft"), *sets(f"data.dir={char_data}", f"train.init_from={source_run}",
                                                          *QUIET)]
    for n_layer in (12, 8):
        assert cli.main([*base, *sets(f"model.n_layer={n_layer}")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: model.n_layer = {n_layer} conflicts with "
                                                       f"train.init_from = '{source_run}', which has n_layer = 2")
    assert not (tmp_path / "ft").exists()  # refused before the run directory was made
    cfg = load_config(None, [f"data.dir={char_data}", f"train.init_from={source_run}"])
    cfg.model.n_layer = 12  # in code: the same rule
    assert "model.n_layer = 12 conflicts with" in one_line(ConfigError, resolve_run, cfg)
    run = resolve_run(None, [f"data.dir={char_data}", f"train.init_from={source_run}",
                             "model.n_layer=2"])  # agreeing with the source is fine
    assert run.config.model.n_layer == 2 and run.origin("model.n_layer") == f"train.init_from = '{source_run}'"
    assert run.origin("model.n_embd") == f"train.init_from = '{source_run}'"  # not written: the source's
    assert run.origin("model.dropout") == "default" and run.origin("data.dir") == "set by you"


def test_an_error_about_a_derived_value_says_where_it_came_from_and_what_to_set(char_data, source_run, capsys):
    """Tried as a new user: finetune-shakespeare on a 32-token run said "train.seq_len = 1024 exceeds
    model.block_size = 32" without saying the 32 is the source's, nor what to set."""
    args = ["--config", "finetune-shakespeare", *sets(f"train.init_from={source_run}", f"data.dir={char_data}")]
    assert cli.main(["config", "show", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: train.seq_len = 1024 exceeds model.block_size = 32; set train.seq_len to at most 32 "
                          "(0: the model's context)")
    assert f"(model.block_size = 32 comes from train.init_from = '{source_run}')" in err
    assert cli.main(["config", "show", *args, *sets("train.seq_len=0", "train.total_batch_tokens=0")]) == 0
    out = capsys.readouterr().out
    assert tomllib.loads(out)["model"]["block_size"] == 32
    assert f"#   model.block_size = 32  (train.init_from = '{source_run}')" in out
    assert "#   train.seq_len = 32  (model.block_size (train.seq_len = 0))" in out


def test_the_dial_keeps_a_sources_shape_and_sizes_the_rest_by_it(char_data, source_run):
    """A fine-tune from the quickstart's preset (model.depth = 4): the shape is the source's, not the dial's."""
    run = resolve_run("shakespeare-cpu", [f"train.init_from={source_run}", f"data.dir={char_data}",
                                          "model.block_size=32", "train.seq_len=0"])  # the preset's 128: not the source's
    assert (run.config.model.n_layer, run.config.model.n_embd) == (2, 32)
    assert run.origin("model.n_embd") == f"train.init_from = '{source_run}'"
    dial = {d.key: d for d in run.dial}
    assert dial["model.n_embd"].explicit and dial["model.n_embd"].rule_value == 128  # depth 4's, not taken


# --- a resolved config is read-only ---------------------------------------------------------------------

def test_a_resolved_config_cannot_change_and_a_copy_can(char_data):
    run = resolve_run("shakespeare-cpu", [f"data.dir={char_data}"])
    with pytest.raises(dataclasses.FrozenInstanceError, match="a resolved run config is read-only"):
        run.config.train.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.config.model = run.config.model
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.user_keys = frozenset()  # the record too
    mine = copy.deepcopy(run.config)
    mine.train.lr = 1.0
    assert run.config.train.lr != 1.0 and resolve_run(mine).config.train.lr == 1.0


def test_derived_values_name_their_source(char_data):
    run = resolve_run("shakespeare-cpu", [f"data.dir={char_data}"])
    assert run.config.model.n_layer == 4 and run.origin("model.n_layer") == "the size dial (model.depth = 4)"
    assert run.config.model.vocab_size == 66 and run.origin("model.vocab_size") == f"the prepared data ({char_data})"
    assert run.origin("model.depth") == "set by you"
    missing = resolve_run("shakespeare-cpu", ["data.dir=nowhere"])  # plan and config show work before prepare
    assert missing.config.model.vocab_size == 0
    assert missing.origin("model.vocab_size") == "the prepared data, once nowhere is prepared"


# --- every consumer reads the same resolution -----------------------------------------------------------

def shown(capsys, config, overrides) -> dict:
    assert cli.main(["config", "show", "--config", str(config), *sets(*overrides)]) == 0
    return tomllib.loads(capsys.readouterr().out)


def planned(config, overrides) -> dict:
    run = resolve_measuring(config, overrides, Environment(), device=target_device("cpu"))
    plan = make_plan(load_config(config, overrides), target_device("cpu"), measure_cpu=False)
    assert to_dict(plan.run.config) == to_dict(run.config)
    return to_dict(run.config)


def trained(tmp_path, config, overrides, resume: str | None = None) -> dict:
    out = tmp_path / "run"
    args = ["train", "--config", str(config), "--out", str(out), *sets(*overrides)]
    assert cli.main(args + (["--resume", resume] if resume else [])) == 0
    return tomllib.loads((out / "config.toml").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(preset_files()))
def test_config_show_plan_and_the_library_resolve_every_preset_alike(preset, gpt2_data, char_data, source_run, capsys):
    overrides = [f"data.dir={gpt2_data}"]  # GPT-2's tokens: finetune-shakespeare's source (gpt2) refuses others
    if preset in ("finetune-cpu", "chat-cpu"):  # a run of ours stands in for the quickstart's, with its data and context
        overrides = [f"data.dir={char_data}", f"train.init_from={source_run}", "train.seq_len=32"]
    library = to_dict(resolve_run(preset, overrides).config)
    assert shown(capsys, preset, overrides) == library
    assert planned(preset, overrides) == library


@pytest.mark.slow
@pytest.mark.parametrize("case", ["shakespeare-cpu", "depth 6", "scaling-cpu", "init_from"])
def test_train_runs_the_config_the_others_resolve(case, char_data, source_run, tmp_path, capsys):
    preset, overrides = {
        "shakespeare-cpu": ("shakespeare-cpu", []),
        "depth 6": ("shakespeare-cpu", ["model.depth=6"]),
        "scaling-cpu": ("scaling-cpu", ["model.depth=2"]),
        "init_from": ("finetune-shakespeare", [f"train.init_from={source_run}", "train.seq_len=0",
                                               "train.total_batch_tokens=0"]),
    }[case]
    overrides = [*overrides, f"data.dir={char_data}", "train.max_steps=1", *QUIET]
    library = to_dict(resolve_run(preset, overrides).config)
    assert trained(tmp_path, preset, overrides) == library
    capsys.readouterr()  # the training's lines
    assert shown(capsys, preset, overrides) == library
    assert planned(preset, overrides) == library


def test_a_resumed_finetune_keeps_its_checkpoints_shape_everywhere(char_data, source_run, tmp_path, capsys):
    """A fine-tune resumed after its source is gone: the shape comes from its own checkpoint, for the
    library as for train."""
    source = tmp_path / "source"
    shutil.copytree(source_run, source)
    config = tmp_path / "ft.toml"
    spec = tiny_config(char_data, max_steps=1)
    spec.train.init_from = str(source)
    config.write_text(dump_toml(spec))
    overrides = ["eval.interval=0", "log.progress=lines"]
    trained(tmp_path, config, overrides)
    shutil.rmtree(source)
    later = [*overrides, "train.max_steps=2"]
    run = resolve_run(config, later, Environment(run_dir=tmp_path / "run", resume="auto"))
    assert run.origin("model.n_layer").startswith(f"the checkpoint resumed ({tmp_path / 'run'}")
    assert trained(tmp_path, config, later, resume="auto") == to_dict(run.config)
