"""The CLI as a user drives it: prepare -> train a few steps -> sample, and one-line errors."""

from __future__ import annotations

import json

from conftest import REPO, run_cli


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
    assert "tok/s" in r.stderr and r.stderr.startswith("device: cpu")  # auto picks the CPU here, and says so


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
    ]
    for args in cases:
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, r.stderr)
