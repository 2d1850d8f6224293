"""The optimization journey: real stages on a tiny CPU run, the ablation's shape, honest skips."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from conftest import run_here, tiny_config
from gpt2train import runtime
from gpt2train.bench import journey
from gpt2train.bench.journey import (
    TECHNIQUES,
    JourneyOptions,
    PythonLoopBatches,
    StageResult,
    not_applicable,
    run_journey,
    write_synthetic_data,
)
from gpt2train.bench_results import read_cpu_ceiling, read_final_mfu
from gpt2train.config import TrainConfig
from gpt2train.counting import flops_per_token
from gpt2train.data.loader import TokenLoader
from gpt2train.devices import cpu_name
from gpt2train.mfu_basis import mfu_basis
from gpt2train.model import GPT, GPTConfig, preset_config
from gpt2train.runlog import load_metrics
from gpt2train.training.loop import train
from gpt2train.training.optim import make_optimizer

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def cpu_with_bf16(monkeypatch):
    """Run the bf16 stage on any CPU, so that these tests see the same stages everywhere."""
    monkeypatch.setattr(journey, "cpu_has_native_bf16", lambda: True)


def tiny_options(**kw) -> JourneyOptions:
    base = dict(model="gpt2-tiny", device="cpu", micro_batch=2, seq_len=16, steps=2, warmup=1, data_tokens=20_000)
    return JourneyOptions(**{**base, **kw})


@pytest.mark.slow
def test_journey_runs_stages_and_writes_md_json_png(tmp_path):
    result = run_journey(tiny_options(techniques=["ram_loader", "tf32"]), tmp_path, progress=False)
    naive, ram, tf32 = result.stages
    assert naive.status == ram.status == "ok"
    for stage in (naive, ram):
        assert len(stage.step_ms_all) == 2 and stage.tokens_per_s > 0 and np.isfinite(stage.final_loss)
        assert stage.mfu > 0  # against the matmul ceiling measured on this CPU
        assert stage.warmup_s is not None
    assert naive.speedup_vs_first == 1.0 and naive.speedup_vs_previous is None
    assert ram.speedup_vs_previous == pytest.approx(ram.tokens_per_s / naive.tokens_per_s)
    assert ram.setup["ram_loader"] and not naive.setup["ram_loader"]
    assert naive.mfu / naive.tokens_per_s == pytest.approx(ram.mfu / ram.tokens_per_s)  # one basis for every row
    assert tf32.status == "skipped" and "TF32" in tf32.reason and tf32.tokens_per_s is None

    md = (tmp_path / "journey.md").read_text()
    assert "| naive |" in md and "skipped" in md and "TF32 is an NVIDIA" in md and "matmul ceiling, measured" in md
    saved = json.loads((tmp_path / "journey.json").read_text())
    assert [s["name"] for s in saved["stages"]] == [s.name for s in result.stages]
    assert saved["environment"]["torch"] == torch.__version__
    assert (tmp_path / "journey.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ablation_has_one_row_per_technique(tmp_path, monkeypatch):
    measured = []

    def fake_measure(name, setup, options, data_dir, device, memory):
        measured.append((name, setup))
        on = sum(getattr(setup, k) for k, _ in TECHNIQUES)  # pretend each technique adds 10% throughput
        return StageResult(name=name, setup={}, step_ms=100 / (1 + 0.1 * on), tokens_per_s=32 * (1 + 0.1 * on),
                           warmup_s=0.0, final_loss=10.0)

    monkeypatch.setattr(journey, "measure_stage", fake_measure)
    result = run_journey(tiny_options(ablate=True, techniques=[]), tmp_path, progress=False)
    rows = result.ablation
    assert [r.name for r in rows] == ["all on"] + [f"- {journey.SHORT_NAMES[k]}" for k, _ in TECHNIQUES]
    everything = measured[1][1]
    assert not everything.tf32 and everything.compile  # TF32 cannot apply on a CPU
    tf32_row = rows[1 + [k for k, _ in TECHNIQUES].index("tf32")]
    assert tf32_row.status == "skipped" and "TF32" in tf32_row.reason
    for (name, setup), key in zip(measured[2:], [k for k, _ in TECHNIQUES if k != "tf32"]):
        assert not getattr(setup, key) and name == f"- {journey.SHORT_NAMES[key]}"
        assert sum(getattr(setup, k) for k, _ in TECHNIQUES) == sum(getattr(everything, k) for k, _ in TECHNIQUES) - 1
    assert all(r.speedup_vs_first < 1 for r in rows[1:] if r.status == "ok")
    assert "## Ablation" in (tmp_path / "journey.md").read_text()


def test_a_journey_cut_short_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """journey.json and .md were written at the end only: a GPU session's time limit (or Ctrl-C) during a
    late stage lost every row measured before it."""
    calls = []

    def measure_then_stop(name, setup, options, data_dir, device, memory):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # not an Exception: the journey does not record it as a failed stage
        return StageResult(name=name, setup={}, step_ms=100 / len(calls), tokens_per_s=32.0 * len(calls),
                           warmup_s=0.0, final_loss=10.0)

    monkeypatch.setattr(journey, "measure_stage", measure_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run_journey(tiny_options(techniques=["ram_loader", "sdpa", "pad_vocab"]), tmp_path, progress=False)
    saved = json.loads((tmp_path / "journey.json").read_text())
    assert saved["finished"] is False and [s["name"] for s in saved["stages"]] == calls[:2]
    assert saved["stages"][1]["speedup_vs_first"] == 2.0
    md = (tmp_path / "journey.md").read_text()
    assert md.rstrip().endswith(journey.UNFINISHED) and f"| {calls[1]} |" in md
    with pytest.raises(ValueError, match="stopped before its last stage"):  # plan takes no MFU from it
        read_final_mfu(tmp_path / "journey.json")
    run_journey(tiny_options(techniques=[]), tmp_path, progress=False)  # finished: the line goes
    assert json.loads((tmp_path / "journey.json").read_text())["finished"] is True
    assert journey.UNFINISHED not in (tmp_path / "journey.md").read_text()


def test_a_cpu_journey_records_the_ceiling_that_a_training_run_on_this_cpu_takes(tmp_path, monkeypatch):
    """The journey's MFU column divides by this CPU's matmul ceiling; journey.json keeps it, and a run beside it
    on this CPU, with the same threads and dtype, divides by the same figure (gpt2train.mfu_basis)."""
    def measured(name, setup, options, data_dir, device, memory):
        return StageResult(name=name, setup={}, step_ms=10.0, tokens_per_s=3.2, warmup_s=0.0, final_loss=10.0)

    monkeypatch.setattr(journey, "measure_stage", measured)
    result = run_journey(tiny_options(techniques=[]), tmp_path / "bench-1", progress=False)
    ceiling, name = read_cpu_ceiling(tmp_path / "bench-1" / "journey.json")
    assert name == cpu_name() and (ceiling.dtype, ceiling.threads) == ("bfloat16", torch.get_num_threads())
    model_flops = flops_per_token(preset_config("gpt2-tiny", vocab_size=50257, pad_vocab_multiple=1), 16)
    assert result.stages[0].mfu == pytest.approx(3.2 * model_flops / ceiling.flop_s)
    basis = mfu_basis(CPU, torch.bfloat16, tf32=False, runs_dir=tmp_path)
    assert basis.flop_s == ceiling.flop_s and str(tmp_path / "bench-1" / "journey.json") in basis.source
    assert mfu_basis(CPU, torch.float32, tf32=False, runs_dir=tmp_path).source.endswith(
        f"measured at start (float32 1024x1024x1024, {torch.get_num_threads()} threads)")  # another dtype: probed


def test_a_failing_stage_is_reported_not_hidden(tmp_path, monkeypatch):
    def broken(name, setup, options, data_dir, device, memory):
        raise RuntimeError("no C++ compiler\nsecond line")

    monkeypatch.setattr(journey, "measure_stage", broken)
    result = run_journey(tiny_options(techniques=[]), tmp_path, progress=False)
    assert result.stages[0].status == "failed" and result.stages[0].reason == "RuntimeError: no C++ compiler"


def test_a_failed_technique_stays_off_in_later_stages_and_the_ablation(tmp_path, monkeypatch):
    def compile_breaks(name, setup, options, data_dir, device, memory):
        if setup.compile:
            raise RuntimeError("no C++ compiler")
        return StageResult(name=name, setup=dataclasses.asdict(setup), step_ms=10.0, tokens_per_s=3.2, warmup_s=0.0,
                           final_loss=10.0)

    monkeypatch.setattr(journey, "measure_stage", compile_breaks)
    result = run_journey(tiny_options(techniques=["compile", "sdpa"], ablate=True), tmp_path, progress=False)
    assert [s.status for s in result.stages] == ["ok", "failed", "ok"]
    assert result.stages[2].setup["sdpa"] and not result.stages[2].setup["compile"]
    rows = {r.name: r for r in result.ablation}
    assert rows["all on"].status == "ok" and not rows["all on"].setup["compile"]
    assert rows["- torch.compile"].status == "skipped" and "no C++ compiler" in rows["- torch.compile"].reason
    md = (tmp_path / "journey.md").read_text()
    header, *rows_md = [line for line in md.splitlines() if line.startswith("| ")][:4]
    assert all(line.count("|") == header.count("|") for line in rows_md)  # failed rows keep the table's width


def test_tf32_is_not_applicable_on_cpu_and_the_rest_is():
    assert "TF32" in not_applicable("tf32", CPU)
    for key in ("ram_loader", "bf16", "compile", "sdpa", "pad_vocab", "chunked_loss", "cpu_allocator"):
        assert not_applicable(key, CPU) is None
    assert "CPU setting" in not_applicable("cpu_allocator", torch.device("cuda"))
    reason = not_applicable("fused_adamw", CPU)  # torch decides; either it runs or we say why not
    assert reason is None or "fused" in reason


def test_the_allocator_stage_sets_glibc_and_puts_its_defaults_back(monkeypatch):
    """mallopt is process-wide: a stage that sets it restores glibc's defaults, so a later stage without it
    (the ablation's "- CPU allocator") measures the default."""
    calls = []
    record = lambda keep=True: calls.append(keep) or True  # noqa: E731
    monkeypatch.setattr(journey, "keep_freed_cpu_memory", record)
    monkeypatch.setattr(runtime, "keep_freed_cpu_memory", record)  # what Runtime.apply() calls
    options = JourneyOptions(seq_len=32)
    with journey.applied(journey.stage_runtime(journey.Setup(cpu_allocator=True), options, CPU)):
        assert calls == [True]
    assert calls == [True, False]
    with journey.applied(journey.stage_runtime(journey.Setup(), options, CPU)):
        pass
    assert calls == [True, False]


def test_bf16_is_skipped_on_a_cpu_that_would_emulate_it(monkeypatch):
    monkeypatch.setattr(journey, "cpu_has_native_bf16", lambda: False)
    assert "emulate bf16" in not_applicable("bf16", CPU)
    assert not_applicable("bf16", torch.device("meta")) is None  # only a CPU's own bf16 support is asked about


def test_naive_batches_are_next_token_windows_like_the_ram_loader(tmp_path):
    data = write_synthetic_data(tmp_path, 5_000, vocab_size=100)
    x, y = PythonLoopBatches(data, batch_size=3, seq_len=8, device=CPU).next_batch()
    assert x.shape == y.shape == (3, 8) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    xr, yr = TokenLoader(data, "train", 3, 8, mode="ram").next_batch()  # the synthetic data feeds the real loader
    assert xr.shape == (3, 8) and torch.equal(xr[:, 1:], yr[:, :-1])


def test_synthetic_data_with_a_val_split_trains(tmp_path):
    """benchmarks/gpu_session.sh times `gpt2train train` on random ids: the trainer needs a val split too; the
    train ids are those of the same seed without one."""
    data = write_synthetic_data(tmp_path / "with", 5_000, vocab_size=100, val_tokens=1_000)
    alone = write_synthetic_data(tmp_path / "alone", 5_000, vocab_size=100)
    assert (data / "train_000000.bin").read_bytes() == (alone / "train_000000.bin").read_bytes()
    cfg = tiny_config(data, max_steps=2)
    cfg.eval.interval = 2
    train(cfg, tmp_path / "run")
    assert any(r["kind"] == "val" for r in load_metrics(tmp_path / "run"))


def test_forced_fused_or_plain_adamw_keeps_the_library_groups():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=50))
    library = make_optimizer(model, TrainConfig(), "cpu")
    plain, fused = (make_optimizer(model, TrainConfig(), "cpu", fused=f) for f in (False, True))
    assert plain.defaults["foreach"] is False and not plain.defaults["fused"]
    assert fused.defaults["fused"] is True
    for opt in (plain, fused):
        assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in library.param_groups]
        assert [g["weight_decay"] for g in opt.param_groups] == [g["weight_decay"] for g in library.param_groups]


@pytest.mark.slow
@pytest.mark.parametrize("args, says", [
    (["--seq-len", "4096"], "block_size 128"),
    (["--skip", "bf17"], "unknown technique 'bf17'"),
    (["--model", "gpt3"], "argument --model: invalid choice: 'gpt3' (choose from 'gpt2', "),
])
def test_cli_bench_bad_arguments_are_one_usage_line_before_any_work(tmp_path, args, says):
    out = tmp_path / "bench"
    r = run_here("bench", "journey", "--device", "cpu", *args, "--out", str(out))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().startswith("error:") and says in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_skip_leaves_a_technique_out_and_says_so(tmp_path, monkeypatch):
    setups = []

    def fake_measure(name, setup, options, data_dir, device, memory):
        setups.append(setup)
        return StageResult(name=name, setup={}, step_ms=10.0, tokens_per_s=3.2, warmup_s=0.0, final_loss=10.0)

    monkeypatch.setattr(journey, "measure_stage", fake_measure)
    result = run_journey(tiny_options(techniques=["bf16", "sdpa"], skip=["bf16"]), tmp_path, progress=False)
    assert [s.status for s in result.stages] == ["ok", "skipped", "ok"]
    assert result.stages[1].reason == "left out with --skip"
    assert setups[-1].sdpa and not setups[-1].bf16
    with pytest.raises(ValueError, match="unknown technique 'bf17'"):
        run_journey(tiny_options(skip=["bf17"]), tmp_path, progress=False)
