"""FLOPs per token, MFU against the device's peak (on a CPU its measured matmul ceiling), the train records of
metrics.jsonl, TensorBoard and W&B."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from gpt2train.bench_results import CEILING_KEY, MatmulCeiling
from gpt2train.checkpoint import read_meta
from gpt2train.counting import flops_per_token
from gpt2train.devices import cpu_name
from gpt2train.mfu_basis import MfuBasis, mfu_basis, probe_cpu_ceiling
from gpt2train.model import GPT, GPTConfig
from gpt2train.runlog import MetricsLogger, load_metrics
from gpt2train.training.loop import Trainer, train


def test_flops_per_token_gpt2_124m_by_hand():
    # GPT-2 124M with the vocabulary padded to 50304, T = 1024:
    #   N without position embeddings = 124,475,904 - 1024 * 768 = 123,689,472
    #   6 N = 742,136,832;  attention 12 * 12 * 768 * 1024 = 113,246,208
    assert flops_per_token(GPTConfig(), 1024) == 6 * 123_689_472 + 113_246_208 == 855_383_040


@pytest.mark.parametrize("bias", [True, False])
def test_flops_per_token_counts_every_parameter_but_position_embeddings(bias):
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=66, bias=bias)
    model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()  # the modules' own count
    assert flops_per_token(cfg, 16) == 6 * n + 12 * 3 * 32 * 16


def test_mfu_is_tokens_per_second_times_flops_over_peak(char_data, tmp_path):
    trainer = Trainer(tiny_config(char_data), tmp_path)
    trainer.mfu_basis = MfuBasis(1e12, "a pretend device's peak")
    out = {**trainer.train_step(), "seconds": 0.5}
    trainer._log_train(out, first_compiled=False)
    trainer.console.end(trainer.state.step, trainer.state.tokens, "done")
    rec = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-2]
    tokens_per_s = 4 * 32 / 0.5
    assert rec["tokens_per_s"] == tokens_per_s
    assert rec["mfu"] == pytest.approx(tokens_per_s * 201_984 / 1e12, rel=1e-12)  # 6N + 12LCT, written out in the next test
    assert rec["step_ms"] == 500 and rec["loss"] == out["loss"]


def test_train_records_follow_the_schema_and_cpu_mfu_is_over_the_measured_matmul_ceiling(char_data, tmp_path, capsys):
    cfg = tiny_config(char_data, max_steps=4)
    cfg.log.interval = 2
    cfg.checkpoint.every_steps = 0
    trainer = Trainer(cfg, tmp_path / "run")  # its cfg has the data's vocabulary filled in
    trainer.fit()
    printed = capsys.readouterr().out
    ceiling = probe_cpu_ceiling(torch.float32)  # the run's dtype; measured once per process
    assert (f"mfu: against {ceiling.flop_s / 1e9:,.1f} GFLOP/s per process, this CPU's float32 matmul ceiling, "
            f"measured at start (float32 1024x1024x1024, {torch.get_num_threads()} threads)") in printed
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 4]  # the first step, then every interval, and the last
    for r in train:
        assert {"step", "tokens", "loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "mfu", "peak_mem_mb"} <= r.keys()
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * 201_984 / ceiling.flop_s, rel=1e-9)
        assert r["peak_mem_mb"] is None and "compile_ms" not in r
        assert r["tokens"] == r["step"] * 4 * 32 and r["tokens_per_s"] > 0
        assert f"| mfu {100 * r['mfu']:.1f}% |" in printed
    start = next(r for r in records if r["kind"] == "run_start")
    # 6N + 12 L C T (docs/plan-and-doctor.md) for L = 2, C = 32, T = 32, the 66 characters padded to 128 rows:
    # N = L (12 C^2 + 13 C) + 2 C (ln_f) + 128 C (the tied head) = 29,568; 6N = 177,408; 12 L C T = 24,576
    assert trainer.cfg.model.padded_vocab_size == 128
    assert start["flops_per_token"] == 201_984 and start["peak_flops"] == ceiling.flop_s
    assert start["mfu_basis"].startswith("this CPU's float32 matmul ceiling, measured at start")
    # what the report shows: hardware and the code's revision, recorded when the run starts
    assert start["hardware"] == {"device": "cpu", "device_name": "cpu", "torch": torch.__version__, "world_size": 1,
                                 "cuda": torch.version.cuda}
    assert "git" in start and start["version"]
    val = next(r for r in records if r["kind"] == "val" and r["step"] == 4)
    # Tiny Shakespeare in chars: one byte per character, so bits per byte is the loss in bits (the
    # end-of-text id, 0 bytes, never appears in one play)
    assert val["val_bpb"] == pytest.approx(val["val_loss"] / math.log(2), rel=1e-6)


def write_cpu_journey(runs: Path, name: str, flop_s: float, threads: int, dtype: str = "float32",
                      mtime: int = 1) -> Path:
    """A journey.json as `gpt2train bench journey` writes it on this CPU: the ceiling its MFU column divides by."""
    path = runs / name / "journey.json"
    path.parent.mkdir(parents=True)
    ceiling = MatmulCeiling(flop_s=flop_s, dtype=dtype, threads=threads, n=1024)
    environment = {"device": "cpu", "device_name": cpu_name(), CEILING_KEY: dataclasses.asdict(ceiling)}
    path.write_text(json.dumps({"environment": environment, "stages": [], "finished": True}))
    os.utime(path, (mtime, mtime))
    return path


def test_a_cpu_run_takes_the_ceiling_of_a_journey_beside_it_on_this_cpu(char_data, tmp_path, capsys):
    """The newest journey measured on this CPU with this run's threads and dtype is the basis; others are not."""
    runs, threads = tmp_path / "runs", torch.get_num_threads()
    taken = write_cpu_journey(runs, "bench-1", 2e9, threads, mtime=1)
    write_cpu_journey(runs, "bench-2", 3e9, threads + 1, mtime=2)  # other threads: another ceiling
    write_cpu_journey(runs, "bench-3", 4e9, threads, dtype="bfloat16", mtime=3)  # another dtype
    trainer = Trainer(tiny_config(char_data, max_steps=1), runs / "run")
    trainer.fit()
    assert trainer.mfu_basis.flop_s == 2e9
    assert (f"mfu: against 2.0 GFLOP/s per process, this CPU's float32 matmul ceiling, measured by gpt2train bench "
            f"journey ({taken}: float32 1024x1024x1024, {threads} threads)") in capsys.readouterr().out
    start, train = (next(r for r in load_metrics(runs / "run") if r["kind"] == kind) for kind in ("run_start", "train"))
    assert start["peak_flops"] == 2e9 and str(taken) in start["mfu_basis"]
    assert train["mfu"] == pytest.approx(train["tokens_per_s"] * 201_984 / 2e9, rel=1e-9)


def test_without_a_basis_the_banner_says_why_once_and_the_step_lines_leave_mfu_out(char_data, tmp_path, capsys):
    """They printed "mfu n/a" on every line; an MPS or an unknown GPU still has no basis."""
    trainer = Trainer(tiny_config(char_data, max_steps=3), tmp_path)
    trainer.mfu_basis = MfuBasis(None, "no peak FLOP/s known for mps (add its row to gpt2train.devices.DEVICES)")
    trainer.fit()
    out = capsys.readouterr().out
    assert ("mfu: not shown: no peak FLOP/s known for mps (add its row to gpt2train.devices.DEVICES); the step lines "
            "report tokens/s only") in out
    lines = [line for line in out.splitlines() if line.startswith("step ") and " tok/s " in line]
    assert len(lines) == 3 and not any("mfu" in line for line in lines)
    assert all(r["mfu"] is None for r in load_metrics(tmp_path) if r["kind"] == "train")


def test_a_gpus_basis_is_still_its_data_sheet_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    basis = mfu_basis(torch.device("cuda"), torch.bfloat16, tf32=True)
    assert basis.flop_s == 989e12 and basis.source == "the dense bf16 peak of NVIDIA H100 80GB HBM3 (gpt2train.devices)"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future Accelerator")
    assert mfu_basis(torch.device("cuda"), torch.bfloat16, tf32=True).flop_s is None


def test_the_ceiling_probe_leaves_the_runs_random_numbers_alone():
    """It runs after the trainer seeded torch: a draw from the global generator would change the run."""
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    ceiling = probe_cpu_ceiling(torch.float32, n=64)
    assert torch.equal(torch.rand(3), expected)
    assert ceiling.flop_s > 0 and (ceiling.dtype, ceiling.n, ceiling.threads) == ("float32", 64, torch.get_num_threads())


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


# --- TensorBoard and W&B across resume and rollback (docs/metrics.md) ----------------------------------------
def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the run's event files as TensorBoard shows it: (step, value) pairs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_each_step_once(scalars: dict[str, list[tuple[int, float]]]):
    for tag, points in scalars.items():
        steps = [s for s, _ in points]
        assert steps == sorted(set(steps)), f"{tag}: steps {steps}"


def assert_redo_values_shown(scalars: dict, run_dir):
    """TensorBoard shows, for each step, the values metrics.jsonl's reader keeps (the redo's)."""
    kept = {r["step"]: r["step_ms"] for r in load_metrics(run_dir) if r["kind"] == "train"}
    shown = dict(scalars["train/step_ms"])
    assert shown.keys() == kept.keys()
    for step in kept:  # step_ms is a wall time: a launch's own, not the same for a redone step
        assert shown[step] == pytest.approx(kept[step], rel=1e-6)


def test_tensorboard_after_a_resume_holds_each_step_once(char_data, tmp_path):
    pytest.importorskip("tensorboard", reason="log.tensorboard needs the tensorboard package")
    cfg = tiny_config(char_data, max_steps=8)
    cfg.log.tensorboard = True
    cfg.checkpoint.save_final = False  # the newest checkpoint is step 5: the resume re-does 6-8
    train(cfg, tmp_path)
    cfg = tiny_config(char_data, max_steps=10)
    cfg.log.tensorboard = True
    train(cfg, tmp_path, resume="auto")

    scalars = tensorboard_scalars(tmp_path)
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 11))
    assert_each_step_once(scalars)
    assert_redo_values_shown(scalars, tmp_path)


def test_tensorboard_after_a_rollback_holds_each_step_once(char_data, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="log.tensorboard needs the tensorboard package")
    from test_faults import guarded_config, inject_loss_faults  # the fault injection of the guard's tests

    inject_loss_faults(monkeypatch, {8: 20.0})  # a spike at step 8: back to step 5, steps 6-8 again
    cfg = guarded_config(char_data, spike_factor=3.0)
    cfg.log.tensorboard = True
    train(cfg, tmp_path)

    scalars = tensorboard_scalars(tmp_path)
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 13))
    assert [s for s, _ in scalars["guard/to_step"]] == [8]  # the guard's own record stays
    assert_each_step_once(scalars)
    assert_redo_values_shown(scalars, tmp_path)


def test_tensorboard_holds_the_config_and_samples_as_text(tmp_path):
    pytest.importorskip("tensorboard", reason="log.tensorboard needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, tensorboard=True, config={"train": {"lr": 1e-3}})
    logger.log("sample", step=5, prompt="Once upon", text=" a time")
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["tensors"]) >= {"config/text_summary", "sample/Once_upon/text_summary"}
    (sample,) = acc.Tensors("sample/Once_upon/text_summary")
    assert sample.step == 5 and b"Once upon a time" in sample.tensor_proto.string_val[0]


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run(char_data, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="log.wandb needs the wandb package")

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"

    def config(max_steps):
        cfg = tiny_config(char_data, max_steps=max_steps)
        cfg.log.wandb, cfg.log.wandb_mode = True, "offline"
        cfg.eval.interval = 0
        return cfg

    train(config(5), run_dir)
    run_id = read_meta(run_dir / "checkpoints" / "step_00000005")["wandb_run_id"]
    assert run_id

    trainer = Trainer(config(6), run_dir, resume="auto")
    try:
        assert trainer.console.logger.wandb.id == run_id  # wandb.init was handed the stored id
        trainer.fit()
    finally:
        trainer.close()
    assert read_meta(run_dir / "checkpoints" / "step_00000006")["wandb_run_id"] == run_id
    # Offline, each launch writes its own folder, named with the run id (and -1 for a second launch in the
    # same second): `wandb sync` puts both in one run.
    folders = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    named = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(folders) == 2 and all(named.fullmatch(name) for name in folders), folders


class FakeWandbRun:
    """What MetricsLogger uses of a wandb run, recorded: W&B's own rule (no step below the last) is the
    logger's to respect, and this checks it without starting W&B."""

    def __init__(self, **init_args):
        self.init_args, self.step, self.logged, self.configs = init_args, 0, [], []
        self.id = init_args["id"]
        self.config = self  # run.config.update(...)

    def update(self, config: dict, allow_val_change: bool = False):
        self.configs.append(config)

    def log(self, values: dict, step: int):
        assert step >= self.step, f"W&B would drop step {step} after {self.step}"
        self.step = step
        self.logged.append((step, values))

    def finish(self):
        pass


def test_wandb_gets_the_stored_run_id_no_lower_step_and_a_samples_table(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="log.wandb needs the wandb package")
    runs = []
    monkeypatch.setattr(wandb, "init", lambda **kw: runs.append(FakeWandbRun(**kw)) or runs[-1])

    logger = MetricsLogger(tmp_path, wandb=True, wandb_run_id="abc123", start_step=6, config={"train": {"lr": 1}})
    assert runs[0].init_args["id"] == "abc123" and runs[0].init_args["resume"] == "allow"
    assert runs[0].configs == [{"train": {"lr": 1}}]
    logger.log("train", step=8, loss=3.0)
    logger.redo_from(6)  # a rollback: TensorBoard is off here, and W&B is left alone
    logger.log("train", step=6, loss=3.1)  # a re-done step below W&B's last one: not sent
    logger.log("sample", step=8, prompt="Hi", text=" there")
    logger.log("sample", step=10, prompt="Hi", text=" you")
    logger.close()
    assert [(step, sorted(values)) for step, values in runs[0].logged] == [
        (8, ["train/loss"]), (8, ["samples"]), (10, ["samples"])]
    table = runs[0].logged[-1][1]["samples"]
    assert table.columns == ["step", "prompt", "text"] and table.data == [[8, "Hi", " there"], [10, "Hi", " you"]]
    assert [r["step"] for r in load_metrics(tmp_path) if r["kind"] == "train"] == [8, 6]  # the JSONL has them all

    (tmp_path / "new").mkdir()
    fresh = MetricsLogger(tmp_path / "new", wandb=True)
    assert fresh.wandb_run_id and runs[1].init_args["id"] == fresh.wandb_run_id  # made once, for the checkpoints
    fresh.close()
