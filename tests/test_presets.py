"""Config presets by name: shipped inside the package, usable from any folder, listed and shown by the CLI."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import REPO, one_line, run_cli, run_here
from gpt2train.config import ConfigError, dump_toml, load_config, preset_descriptions, preset_files
from gpt2train.runconfig import resolve_run

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESETS = ("chat-cpu", "finetune-cpu", "finetune-shakespeare", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt2-modern",
           "ladder-2024",
           "ladder-gpt2", "ladder-modern", "scaling-cpu", "shakespeare-cpu", "shakespeare-modern")


def test_the_presets_are_the_repository_configs():
    """configs/ in the repository is a symlink to the package's presets: one copy of each file."""
    assert set(preset_files()) == set(PRESETS)
    assert {p.stem for p in (REPO / "configs").glob("*.toml")} == set(PRESETS)


def test_a_preset_by_name_is_the_file():
    assert load_config("gpt2") == load_config(REPO / "configs" / "gpt2.toml")


def test_a_file_that_exists_wins_over_a_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2").write_text("[model]\nn_layer = 3\n")
    assert load_config("gpt2").model.n_layer == 3


def test_an_unknown_name_is_one_line_listing_the_presets():
    message = one_line(ConfigError, load_config, "gpt3")
    assert message.startswith("config gpt3 is neither a file nor a preset; presets are chat-cpu, finetune-cpu, "
                              "finetune-shakespeare, gpt2,")
    assert all(name in message for name in PRESETS)


def test_each_preset_describes_itself():
    descriptions = preset_descriptions()
    assert descriptions["gpt2"].startswith("GPT-2 124M (gpt2)")
    assert descriptions["shakespeare-cpu"].startswith("A small GPT that learns Tiny Shakespeare")


@pytest.mark.slow
def test_train_with_a_preset_from_another_folder(char_data, tmp_path):
    """No configs/ folder in sight: the preset comes from the package, the run goes to runs/<preset>."""
    r = run_cli("train", "--config", "shakespeare-cpu", "--set", f"data.dir={char_data}", "--set", "train.max_steps=2",
                "--set", "model.n_layer=1", "--set", "train.device=cpu", "--set", "train.compile=false",
                "--set", "train.dtype=float32", "--set", "eval.val_batches=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "finished at step 2" in r.stdout
    assert (tmp_path / "runs" / "shakespeare-cpu" / "config.toml").is_file()


@pytest.mark.slow
def test_config_show_prints_the_resolved_config(tmp_path):
    r = run_cli("config", "show", "--config", "gpt2", "--set", "train.lr=1e-4", "--set", "model.n_layer=2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    shown = tomllib.loads(r.stdout)
    assert shown["train"]["lr"] == 1e-4 and shown["model"]["n_layer"] == 2 and shown["model"]["n_embd"] == 768
    assert r.stdout == dump_toml(resolve_run("gpt2", ["train.lr=1e-4", "model.n_layer=2"]).config) + (
        "\n# derived, not set in the config:\n"
        "#   train.warmup_steps = 715  (train.warmup_fraction 0.0375 x train.max_steps 19,073)\n")


@pytest.mark.slow
def test_config_list_names_every_preset(tmp_path):
    r = run_cli("config", "list", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines] == sorted(PRESETS)
    assert any(line.startswith("gpt2 ") and "GPT-2 124M" in line for line in lines)


@pytest.mark.slow
def test_config_show_of_an_unknown_preset_is_one_line(tmp_path):
    r = run_cli("config", "show", "--config", "gpt3", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.startswith("error: config gpt3 is neither a file nor a preset") and len(r.stderr.splitlines()) == 1


@pytest.mark.slow
def test_the_wheel_ships_the_presets(tmp_path):
    """Built from a copy of the sources, so no build/ or *.egg-info lands in the checkout."""
    source = tmp_path / "source"
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("gpt2train-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"gpt2train/configs/{name}.toml" for name in PRESETS} <= names
    assert "gpt2train/templates/report.html" in names
    assert "gpt2train/serve/playground.html" in names  # what `gpt2train serve` answers at /


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["shakespeare-modern", "gpt2-modern"])
def test_a_modern_preset_trains_resumes_and_samples(preset, char_data, tmp_path):
    """The recipe's presets as a user runs them, shrunk to a few steps of a two-layer model (the value table
    feeds the first and the last block: one layer cannot hold it)."""
    shrink = ["--set", f"data.dir={char_data}", "--set", "model.n_layer=2", "--set", "model.n_head=2",
              "--set", "model.n_embd=32", "--set", "model.block_size=32", "--set", "train.seq_len=32",
              "--set", "train.micro_batch=2", "--set", "train.total_batch_tokens=0", "--set", "train.device=cpu",
              "--set", "train.compile=false", "--set", "train.dtype=float32", "--set", "train.warmup_steps=1",
              "--set", "eval.val_batches=1", "--set", "eval.interval=0", "--set", "eval.sample_interval=0",
              "--set", "eval.hellaswag_interval=0", "--set", "checkpoint.every_steps=2"]
    cfg = load_config(preset)
    assert (cfg.train.optimizer, cfg.model.position, cfg.model.tied_head) == ("muon", "rotary", False)
    run = tmp_path / "run"
    r = run_here("train", "--config", preset, "--out", str(run), "--set", "train.max_steps=3", *shrink)
    assert r.returncode == 0, r.stderr
    r = run_here("train", "--config", preset, "--out", str(run), "--resume", "auto", "--set", "train.max_steps=5", *shrink)
    assert r.returncode == 0, r.stderr
    assert "resumed" in r.stdout.lower() and "finished at step 5" in r.stdout
    r = run_here("sample", "--ckpt", str(run), "--prompt", "ab", "--max-new-tokens", "5", "--seed", "0")
    assert r.returncode == 0, r.stderr
    r = run_here("export-hf", "--ckpt", str(run), "--out", str(tmp_path / "hf"))
    assert r.returncode == 1 and "cannot be exported" in r.stderr and not (tmp_path / "hf").exists()
