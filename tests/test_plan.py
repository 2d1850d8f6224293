"""gpt2train plan: counts against hand-computed values for GPT-2 124M, the device table, the MFU source,
and the memory fit/suggestion logic with a stubbed estimate (never the estimator's exact numbers)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from conftest import REPO, run_cli
from gpt2train import devices
from gpt2train import plan as P
from gpt2train.bench.journey import JourneyResult, StageResult
from gpt2train.config import Config, load_config
from gpt2train.counting import flops_per_token, parameter_count
from gpt2train.memory import estimate_memory
from gpt2train.model import preset_config

GPT2_TOML = REPO / "configs" / "gpt2.toml"
H100_BF16 = 989e12


def gpt2_config(**train) -> Config:
    cfg = load_config(GPT2_TOML)
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


# --- counting ----------------------------------------------------------------------------------


def test_gpt2_124m_parameters():
    assert parameter_count(preset_config("gpt2", pad_vocab_multiple=1)) == 124_439_808
    assert parameter_count(preset_config("gpt2")) == 124_475_904  # vocab padded to 50304
    assert parameter_count(preset_config("gpt2"), non_embedding=True) == 85_056_000


def test_gpt2_124m_flops_per_token():
    # 6N + 12*L*C*T with N = 123,689,472 (all but the position embedding), T = 1024
    assert flops_per_token(preset_config("gpt2"), 1024) == 6 * 123_689_472 + 12 * 12 * 768 * 1024 == 855_383_040


def test_plan_numbers_for_gpt2_on_8_h100(tmp_path):
    plan = P.make_plan(gpt2_config(), P.target_device("H100"), gpus=8, runs_dir=tmp_path)
    assert plan.params == 124_475_904 and plan.params_non_embedding == 85_056_000
    assert plan.flops_per_token == 855_383_040
    assert plan.tokens_per_step == 524_288 and plan.grad_accum == 1  # 64 x 1024 x 8 GPUs
    assert plan.budget_tokens == 19_073 * 524_288
    assert plan.chinchilla_tokens == 20 * 124_475_904
    assert plan.peak_flops == H100_BF16 and plan.mfu == 0.40 and plan.mfu_source.startswith("assumed")
    assert plan.wall_s(plan.budget_tokens) == plan.budget_tokens * 855_383_040 / (H100_BF16 * 0.40 * 8)
    assert plan.wall_s(plan.chinchilla_tokens) == 20 * 124_475_904 * 855_383_040 / (H100_BF16 * 0.40 * 8)
    assert plan.train_tokens is None and any("no prepared data" in n for n in plan.notes)


def test_accumulation_fills_the_step():
    plan = P.make_plan(gpt2_config(), P.target_device("H100"), gpus=2, mfu=0.5)
    assert plan.grad_accum == 4 and plan.tokens_per_step == 524_288
    assert plan.wall_s(1_000_000) == 1_000_000 * 855_383_040 / (H100_BF16 * 0.5 * 2)


def test_steps_and_epochs_from_meta(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    meta = {"vocab_size": 50257, "tokens": {"train": 1_000_000, "val": 5_000}, "shards": {"train": [], "val": []},
            "tokenizer": {"kind": "gpt2"}}
    (data / "meta.json").write_text(json.dumps(meta))
    cfg = gpt2_config(micro_batch=4, total_batch_tokens=0, max_steps=500)  # one micro-batch: 4096 tokens/step
    cfg.model.vocab_size = 0  # taken from meta.json
    plan = P.make_plan(cfg, P.target_device("cpu"), data_dir=str(data), runs_dir=tmp_path)
    assert plan.cfg.model.vocab_size == 50257 and plan.params == 124_475_904
    assert plan.tokens_per_step == 4096 and plan.budget_tokens == 500 * 4096
    assert plan.train_tokens == 1_000_000
    assert plan.steps_per_epoch == 1_000_000 / 4096
    assert plan.epochs == 500 * 4096 / 1_000_000
    assert plan.peak_flops is None and plan.wall_s(plan.budget_tokens) is None  # no CPU peak
    assert "1,000,000 train tokens = 244.1 steps/epoch" in P.format_plan(plan)
    assert any("too big to time here" in n for n in plan.notes)  # GPT-2 124M: minutes per step on a CPU


def test_cpu_time_from_tokens_per_s_given_or_measured_here(tmp_path):
    cfg = Config()
    cfg.model = preset_config("gpt2-tiny", vocab_size=300)
    cfg.data.dir = str(tmp_path / "not-prepared")  # not the repo's data/shakespeare (GPT-2 vocabulary), if prepared
    cfg.train.micro_batch, cfg.train.seq_len, cfg.train.max_steps, cfg.train.total_batch_tokens = 2, 32, 100, 0
    given = P.make_plan(cfg, P.target_device("cpu"), tokens_per_s=640.0, runs_dir=tmp_path)
    assert given.wall_s(given.budget_tokens) == 100 * 64 / 640.0
    assert "640 tokens/s per device, given with --tokens-per-s" in P.format_plan(given)
    measured = P.make_plan(cfg, P.target_device("cpu"), runs_dir=tmp_path)
    assert measured.tokens_per_s > 0 and measured.tokens_per_s_source.startswith("measured here")
    assert measured.wall_s(6400) == 6400 / measured.tokens_per_s
    assert "time        budget:" in P.format_plan(measured)
    with pytest.raises(P.PlanError, match="must be positive"):
        P.make_plan(cfg, P.target_device("cpu"), tokens_per_s=0.0, runs_dir=tmp_path)


def test_a_short_run_prints_its_small_figures_not_zeros(tmp_path):
    """The quickstart's config on an L4: 0.042 tokens/param, 0.0021x of Chinchilla, a budget of 0.28 s;
    rounded to one or two decimals these printed as 0.0, 0.00x and 0 s."""
    cfg = load_config("shakespeare-cpu")
    cfg.data.dir = str(tmp_path / "not-prepared")
    text = P.format_plan(P.make_plan(cfg, P.target_device("L4"), runs_dir=tmp_path))
    assert "; 0.042 tokens/param" in text and "budget is 0.0021x of it" in text
    assert "budget: 0.28 s, 0.000078 GPU-hours" in text
    assert " 0.0 " not in text and "0.00x" not in text and " 0 s" not in text, text


def test_vocab_defaults_to_gpt2_without_data(tmp_path):
    cfg = gpt2_config()
    cfg.model.vocab_size = 0
    cfg.data.dir = str(tmp_path / "not-prepared")
    plan = P.make_plan(cfg, P.target_device("H100"), runs_dir=tmp_path)
    assert plan.cfg.model.vocab_size == 50257


def test_bad_input_is_one_line_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="meta.json not found"):  # --data given but not prepared
        P.make_plan(gpt2_config(), P.target_device("H100"), data_dir=str(tmp_path / "none"))
    with pytest.raises(P.PlanError, match="--mfu 1.5"):
        P.make_plan(gpt2_config(), P.target_device("H100"), mfu=1.5)
    with pytest.raises(ValueError, match="not a multiple"):  # the trainer's own accumulation check
        P.make_plan(gpt2_config(), P.target_device("H100"), gpus=3)


# --- devices -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, expected, gib", [
    ("H100", "H100 80GB", 80), ("h100 80gb", "H100 80GB", 80), ("H200", "H200 141GB", 141),
    ("A100", "A100 80GB", 80), ("A100-40GB", "A100 40GB", 40), ("a100_80gb", "A100 80GB", 80),
    ("L4", "L4 24GB", 24), ("RTX 4090", "RTX 4090 24GB", 24), ("4090", "RTX 4090 24GB", 24),
])
def test_device_table(name, expected, gib):
    device = P.target_device(name)
    assert device.name == expected and device.memory_bytes == gib * 2**30 and device.is_gpu


def test_cpu_device_is_system_ram():
    cpu = P.target_device("CPU")
    assert cpu.memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") and not cpu.is_gpu
    assert cpu.peaks is None


def test_auto_device_on_this_machine():
    import torch

    device = P.target_device("auto")
    assert device.is_gpu == torch.cuda.is_available()


def test_unknown_device():
    with pytest.raises(P.PlanError, match="unknown device 'TPU'.*H100 80GB"):
        P.target_device("TPU")


def test_peak_follows_precision():
    cfg = gpt2_config()
    h100, l4 = P.target_device("H100"), P.target_device("L4")
    assert P.peak_flops_for(h100, cfg) == H100_BF16  # dtype auto: bf16 on a GPU
    assert P.peak_flops_for(l4, cfg) == 121e12
    cfg.train.dtype = "float32"
    assert P.peak_flops_for(h100, cfg) == 494e12  # tf32 on
    cfg.train.tf32 = False
    assert P.peak_flops_for(h100, cfg) == 67e12


# --- MFU: --mfu, then a bench figure, then the default ---------------------------------------------


def write_bench(runs, name, mfu, device_name="NVIDIA H100 80GB HBM3"):
    """A journey.json as `gpt2train bench journey` writes it: the last stage has every technique on; the
    ablation rows (each one technique off) come after it in the file and must not be taken."""
    path = runs / name / "journey.json"
    path.parent.mkdir(parents=True)
    stages = [StageResult("naive", {}, mfu=0.2), StageResult("+ chunked cross-entropy", {}, mfu=mfu),
              StageResult("+ TF32", {}, status="skipped")]
    ablation = [StageResult("all on", {}, mfu=mfu), StageResult("all but compile", {}, mfu=0.11)]
    result = JourneyResult(options={}, environment={"device_name": device_name, "device": "cuda"},
                           stages=stages, ablation=ablation)
    path.write_text(json.dumps(dataclasses.asdict(result) | {"markdown": None}))
    return path


def test_mfu_from_newest_bench(tmp_path):
    runs = tmp_path / "runs"
    old = write_bench(runs, "bench-1", 0.3)
    new = write_bench(runs, "bench-2", 0.47)
    os.utime(old, (1, 1))
    plan = P.make_plan(gpt2_config(), P.target_device("H100"), gpus=8, runs_dir=runs)
    assert plan.mfu == 0.47 and str(new) in plan.mfu_source
    assert plan.wall_s(plan.budget_tokens) == plan.budget_tokens * 855_383_040 / (H100_BF16 * 0.47 * 8)
    assert P.make_plan(gpt2_config(), P.target_device("H100"), mfu=0.33, runs_dir=runs).mfu == 0.33  # --mfu wins
    explicit = P.make_plan(gpt2_config(), P.target_device("H100"), bench_json=old, runs_dir=runs)
    assert explicit.mfu == 0.3


def test_bench_from_another_device_is_not_used(tmp_path):
    write_bench(tmp_path, "bench-1", 0.47, device_name="NVIDIA A100-SXM4-40GB")
    plan = P.make_plan(gpt2_config(), P.target_device("H100"), runs_dir=tmp_path)
    assert plan.mfu == devices.ASSUMED_GPU_MFU
    assert any("measured on NVIDIA A100-SXM4-40GB, not H100 80GB" in n for n in plan.notes)
    with pytest.raises(P.PlanError, match="does not exist"):
        P.make_plan(gpt2_config(), P.target_device("H100"), bench_json=tmp_path / "none.json")


# --- memory: fit and suggestions, with a stubbed estimate ---------------------------------------------


def stub_estimate(monkeypatch, bytes_of):
    """Replace the estimator with bytes_of(cfg, world_size) in GiB; record what it was asked."""
    asked = []

    def estimate(cfg, world_size):
        asked.append((cfg.train.micro_batch, cfg.model.grad_checkpointing, cfg.model.loss_chunk,
                      cfg.train.distributed, world_size))
        return int(bytes_of(cfg, world_size) * 2**30), {"all": int(bytes_of(cfg, world_size) * 2**30)}, "stub"

    monkeypatch.setattr(P, "estimate_memory_bytes", estimate)
    return asked


def resolved(gpus=1, **train) -> Config:
    return P.config_as_trained(gpt2_config(**train), gpus, None, P.target_device("H100"))


def test_fits_as_configured(monkeypatch):
    stub_estimate(monkeypatch, lambda cfg, ws: 50)
    fit = P.memory_fit(resolved(), P.target_device("H100"), 1)
    assert fit.fits and fit.suggestion is None and fit.usable_bytes == int(80 * 2**30 * 0.9)


def test_halving_micro_batch_first(monkeypatch):
    stub_estimate(monkeypatch, lambda cfg, ws: 10 + cfg.train.micro_batch)  # 74 GiB at 64, 42 at 32
    fit = P.memory_fit(resolved(), P.target_device("H100"), 1)
    assert not fit.fits
    s = fit.suggestion
    assert s.micro_batch == 32 and s.grad_accum == 16  # 524288 / (32 x 1024)
    assert s.overrides == {"train.micro_batch": 32, "train.total_batch_tokens": 524288}
    assert P.set_flags(s.overrides) == "--set train.micro_batch=32 --set train.total_batch_tokens=524288"


def test_checkpointing_after_micro_batch(monkeypatch):
    def gib(cfg, ws):  # never fits without checkpointing, which fits from micro-batch 32
        return 40 + 0.6 * cfg.train.micro_batch if cfg.model.grad_checkpointing else 80 + cfg.train.micro_batch

    asked = stub_estimate(monkeypatch, gib)
    s = P.memory_fit(resolved(), P.target_device("H100"), 1).suggestion
    assert s.label == "micro-batch 32 + activation checkpointing"
    assert s.overrides == {"model.grad_checkpointing": True, "train.micro_batch": 32,
                           "train.total_batch_tokens": 524288}
    tried = [(mb, ckpt) for mb, ckpt, *_ in asked]
    assert tried == [(64, False), (64, False), (32, False), (16, False), (8, False), (4, False), (2, False),
                     (1, False), (64, True), (32, True)]


def test_chunked_loss_then_fsdp(monkeypatch):
    def gib(cfg, ws):
        if cfg.train.distributed == "fsdp":
            return 200 / ws
        return 100 if cfg.model.loss_chunk else 200

    stub_estimate(monkeypatch, gib)
    s = P.memory_fit(resolved(gpus=8), P.target_device("H100"), 8).suggestion
    assert s.label == "activation checkpointing + chunked loss + FSDP over 8 GPUs"
    assert s.micro_batch == 64 and s.grad_accum == 1
    assert s.overrides == {"model.grad_checkpointing": True, "model.loss_chunk": P.SUGGESTED_LOSS_CHUNK,
                           "train.distributed": "fsdp"}

    stub_estimate(monkeypatch, lambda cfg, ws: 50 if cfg.model.loss_chunk and cfg.train.micro_batch <= 16 else 200)
    s = P.memory_fit(resolved(), P.target_device("H100"), 1).suggestion
    assert s.label == "micro-batch 16 + activation checkpointing + chunked loss"  # no FSDP on one GPU


def test_nothing_fits(monkeypatch):
    stub_estimate(monkeypatch, lambda cfg, ws: 1000)
    fit = P.memory_fit(resolved(gpus=8), P.target_device("L4"), 8)
    assert not fit.fits and fit.suggestion is None


def test_options_already_on_are_not_suggested(monkeypatch):
    asked = stub_estimate(monkeypatch, lambda cfg, ws: 1000)
    cfg = resolved()
    cfg.model.grad_checkpointing, cfg.model.loss_chunk = True, 512
    P.memory_fit(cfg, P.target_device("H100"), 1)
    assert {(ckpt, chunk) for _, ckpt, chunk, *_ in asked} == {(True, 512)}


def test_memory_comes_from_the_estimator():
    cfg = resolved()
    fit = P.memory_fit(cfg, P.target_device("H100"), 1)
    assert fit.total_bytes == estimate_memory(cfg, 1).total_bytes and fit.estimator == "gpt2train.memory"


# --- CLI ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_plan_end_to_end(tmp_path):
    out = run_cli("plan", "--config", str(GPT2_TOML), "--device", "H100", "--gpus", "8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for text in ("124,475,904", "85,056,000 without embeddings", "855,383,040", "524,288 tokens/step",
                 "9,999,745,024 tokens", "2,489,518,080 tokens", "8 x H100 80GB: 989 TFLOP/s", "MFU         0.40",
                 "budget: 45m 03s, 6.0 GPU-hours", "memory "):
        assert text in out.stdout, text

    out = run_cli("plan", "--config", str(GPT2_TOML), "--device", "TPU", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("error: unknown device") and out.stderr.count("\n") == 1
