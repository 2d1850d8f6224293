"""FLOPs per token, MFU against the device's peak, the train records of metrics.jsonl, TensorBoard and W&B."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_config
from gpt2train.model import GPT, GPTConfig, flops_per_token
from gpt2train.runlog import MetricsLogger
from gpt2train.train.loop import Trainer


def test_flops_per_token_gpt2_124m_by_hand():
    # GPT-2 124M with the vocabulary padded to 50304, T = 1024:
    #   N without position embeddings = 124,475,904 - 1024 * 768 = 123,689,472
    #   6 N = 742,136,832;  attention 12 * 12 * 768 * 1024 = 113,246,208
    assert flops_per_token(GPTConfig(), 1024) == 6 * 123_689_472 + 113_246_208 == 855_383_040


@pytest.mark.parametrize("bias", [True, False])
def test_flops_per_token_counts_every_parameter_but_position_embeddings(bias):
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=66, bias=bias)
    model = GPT(cfg)
    n = model.num_params() - model.transformer.wpe.weight.numel()
    assert flops_per_token(cfg, 16) == 6 * n + 12 * 3 * 32 * 16


def test_mfu_is_tokens_per_second_times_flops_over_peak(char_data, tmp_path):
    trainer = Trainer(tiny_config(char_data), tmp_path)
    trainer.peak_flops = 1e12  # pretend a device with a known peak
    out = {**trainer.train_step(), "seconds": 0.5}
    trainer._log_train(out, first_compiled=False)
    trainer.console.end(trainer.state.step, trainer.state.tokens, "done")
    rec = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-2]
    tokens_per_s = 4 * 32 / 0.5
    assert rec["tokens_per_s"] == tokens_per_s
    assert rec["mfu"] == pytest.approx(tokens_per_s * flops_per_token(trainer.cfg.model, 32) / 1e12, rel=1e-12)
    assert rec["step_ms"] == 500 and rec["loss"] == out["loss"]


def test_train_records_follow_the_schema_and_cpu_mfu_is_unknown(char_data, tmp_path, capsys):
    cfg = tiny_config(char_data, max_steps=4)
    cfg.log.interval = 2
    cfg.checkpoint.every_steps = 0
    trainer = Trainer(cfg, tmp_path)  # its cfg has the data's vocabulary filled in
    trainer.fit()
    printed = capsys.readouterr().out
    assert "mfu: unknown for cpu" in printed and "tok/s" in printed
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 4]  # the first step, then every interval, and the last
    for r in train:
        assert {"step", "tokens", "loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "mfu", "peak_mem_mb"} <= r.keys()
        assert r["mfu"] is None and r["peak_mem_mb"] is None and "compile_ms" not in r
        assert r["tokens"] == r["step"] * 4 * 32 and r["tokens_per_s"] > 0
    start = next(r for r in records if r["kind"] == "run_start")
    assert start["flops_per_token"] == flops_per_token(trainer.cfg.model, 32) and start["peak_flops"] is None
    # what the report shows: hardware and the code's revision, recorded when the run starts
    assert start["hardware"] == {"device": "cpu", "device_name": "cpu", "torch": torch.__version__, "world_size": 1,
                                 "cuda": torch.version.cuda}
    assert "git" in start and start["version"]
    assert any(r["kind"] == "val" and r["step"] == 4 for r in records)


def test_tensorboard_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard", reason="log.tensorboard needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, tensorboard=True)
    for step, loss in [(1, 4.0), (2, 3.5)]:
        logger.log("train", step=step, loss=loss, mfu=None)
    logger.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 4.0), (2, 3.5)]
    assert "train/mfu" not in acc.Tags()["scalars"]  # null values are left out, not written as 0


@pytest.mark.slow
def test_wandb_offline_without_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="log.wandb needs the wandb package")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, wandb=True, wandb_mode="offline", config={"train": {"lr": 1e-3}})
    logger.log("train", step=1, loss=4.0)
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_progress_bar_or_plain_lines(char_data, tmp_path, capsys):
    cfg = tiny_config(char_data, max_steps=3)
    cfg.checkpoint.every_steps = 0
    cfg.log.progress = "bar"
    Trainer(cfg, tmp_path / "bar").fit()
    captured = capsys.readouterr()
    assert "3/3" in captured.err and "loss" in captured.err and "tok/s" in captured.err and "mfu" in captured.err
    assert "step      1/3 |" not in captured.out

    cfg.log.progress = "auto"  # pytest's stderr is not a terminal: plain lines
    Trainer(cfg, tmp_path / "auto").fit()
    captured = capsys.readouterr()
    assert "step      3/3 | loss" in captured.out and "3/3 [" not in captured.err
    lines = [line for line in captured.out.splitlines() if line.startswith("step ") and " | " in line]
    assert all(" | eta " in line for line in lines) and lines[-1].endswith("| eta 0 s")  # nothing left at the end
