"""The library face (`from gpt2train import ...`), and README's Python example run as written there."""

from __future__ import annotations

import re

import pytest
import torch

import gpt2train
from conftest import REPO, one_line, tiny_config

TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "train.seq_len=32",
        "train.micro_batch=2", "train.max_steps=2", "train.warmup_steps=1", "train.device=cpu", "train.compile=false",
        "train.dtype=float32", "eval.val_batches=1", "log.progress=lines"]


def readme_example() -> str:
    """The first ```python block of README's Python section."""
    section = (REPO / "README.md").read_text().split("\n## Python\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_trains_loads_and_samples_and_runs_again(char_data, tmp_path, monkeypatch, capsys):
    """Only the overrides change (tiny and on the char fixture); every other line runs as printed. Run twice (bug:
    the second run appended a second history from step 1 to metrics.jsonl), it finds its run finished, changes
    nothing, and samples the same text."""
    code = readme_example()
    overrides = re.search(r'load_config\("shakespeare-cpu", (\[.*?\])\)', code).group(1)
    code = code.replace(overrides, repr(TINY + [f"data.dir={char_data}"]))
    monkeypatch.chdir(tmp_path)  # the example's runs/demo lands here
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("ROMEO:") and len(out[-1]) > len("ROMEO:")
    assert (tmp_path / "runs" / "demo" / "config.toml").is_file()

    log = (tmp_path / "runs" / "demo" / "metrics.jsonl").read_bytes()
    exec(compile(code, "README.md", "exec"), {})
    again = capsys.readouterr().out.splitlines()
    assert again[0].startswith("runs/demo is already finished at step 2") and again[-1] == out[-1]
    assert (tmp_path / "runs" / "demo" / "metrics.jsonl").read_bytes() == log


def test_the_face_names_are_the_library_functions():
    from gpt2train.config import load_config
    from gpt2train.generation import generate
    from gpt2train.model import GPT, GPTConfig
    from gpt2train.training.loop import train

    assert (gpt2train.GPT, gpt2train.GPTConfig, gpt2train.load_config) == (GPT, GPTConfig, load_config)
    # the functions' modules are imported above: they sit on the package under names of their own
    assert gpt2train.train is train and gpt2train.generate is generate
    assert set(gpt2train.__all__) >= {"GPT", "GPTConfig", "load_config", "train", "load_model", "generate"}
    with pytest.raises(AttributeError):
        gpt2train.no_such_name  # noqa: B018


def test_load_model_reads_a_run_and_a_hugging_face_folder(char_data, tmp_path):
    from gpt2train.hf import export_hf

    gpt2train.train(tiny_config(char_data, max_steps=2), tmp_path / "run")
    model = gpt2train.load_model(tmp_path / "run")
    assert isinstance(model, gpt2train.GPT) and not model.training
    export_hf(model, tmp_path / "hf")
    again = gpt2train.load_model(tmp_path / "hf")
    x = torch.randint(0, 60, (1, 8))
    with torch.no_grad():
        assert torch.allclose(model(x)[0], again(x)[0], atol=1e-5)
    assert gpt2train.load_tokenizer(tmp_path / "run").decode([0, 1]) != ""


def test_a_wrong_kind_of_argument_to_the_face_is_one_line_saying_what_it_takes(char_data, tmp_path):
    """load_config read an overrides string letter by letter ("--set 't': expected ..."); train() given a dict or
    a preset name failed on an attribute ('dict' object has no attribute 'model'), resume=True in pathlib."""
    from gpt2train import load_config, train

    assert "pass ['train.lr=1e-3']" in one_line(TypeError, load_config, "shakespeare-cpu", "train.lr=1e-3")
    assert "takes a Config, not dict" in one_line(TypeError, train, {"train": {}}, tmp_path / "a")
    assert "takes a Config, not str" in one_line(TypeError, train, "shakespeare-cpu", tmp_path / "b")
    cfg = tiny_config(char_data)
    assert "resume is 'auto' or a checkpoint path" in one_line(TypeError, train, cfg, tmp_path / "c", resume=True)
    assert not any((tmp_path / name).exists() for name in "abc")
    first = train(cfg, tmp_path / "d")
    assert train(cfg, tmp_path / "d", resume=tmp_path / "d")["step"] == first["step"]  # a Path is a path
