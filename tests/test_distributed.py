"""Distributed training on CPU (gloo): two torchrun processes with B sequences each must train exactly like
one process with 2B, under DDP and FSDP2; ranks read disjoint slices of one common draw; DDP all-reduces
only on the last micro-batch of a step; a rank that dies or hangs stops the other in one line."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from conftest import MUON_RECIPE, REPO, WELL_CONDITIONED_EPS, one_line, run_cli, tiny_config
from distributed_worker import full_state_dict, worker_config
from gpt2train import distributed as D
from gpt2train.checkpoint import load_checkpoint, newest_checkpoint
from gpt2train.config import dump_toml, load_config
from gpt2train.data.loader import TokenLoader
from gpt2train.ranges import UsageError
from gpt2train.training.loop import Trainer, train

# The ranks run with one thread each (torchrun sets OMP_NUM_THREADS=1); so does the single-process
# reference, so that no thread-count-dependent reduction order separates them.
pytestmark = pytest.mark.usefixtures("one_thread")

# Two runs that see the same windows differ only in the order of float sums (the batch mean is taken
# over rows in another order, gradients are averaged across ranks): a few ulps, amplified a little by Adam.
TOL = 1e-6


def torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + str(REPO / "tests"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]

    def launch():
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)

    r = launch()
    if r.returncode != 0 and any(s in r.stderr for s in PORT_RACE):
        r = launch()  # --standalone's free port was taken before the ranks bound it: that race, once more
    return r


PORT_RACE = ("EADDRINUSE", "Address already in use", "address already in use")


def latest_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    name = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / name / "model.safetensors"))


def train_losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = TOL):
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= tol, f"max weight difference {worst:.2e} > {tol:.0e}"


def test_ranks_take_disjoint_slices_of_one_common_draw(char_data):
    single = TokenLoader(char_data, "train", 6, 16, seed=3)
    ranks = [TokenLoader(char_data, "train", 3, 16, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        both = single.next_batch_numpy()
        r0, r1 = (loader.next_batch_numpy() for loader in ranks)
        np.testing.assert_array_equal(r0, both[0::2])
        np.testing.assert_array_equal(r1, both[1::2])


def test_single_process_without_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    info = D.init_distributed("cpu")
    assert (info.rank, info.world_size, info.is_main, info.enabled) == (0, 1, True, False)
    assert not dist.is_initialized()


def test_more_ranks_than_gpus_is_one_line_before_any_process_group(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("set_device on a missing GPU"))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    message = one_line(ValueError, D.init_distributed, "auto")
    assert "LOCAL_RANK 3" in message and "2 GPU(s)" in message
    assert "--nproc_per_node=2" in message and "train.device=cpu" in message
    assert not dist.is_initialized()


@pytest.mark.parametrize("env, says", [
    ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 must be in [0, 1]"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 must be in [0, 1]"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "5"}, "LOCAL_RANK=5 must be in [0, 1]"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 must be a TCP port"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not an integer"),
])
def test_torchrun_variables_set_by_hand_wrong_are_one_line_before_any_process_group(env, says, monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: pytest.fail("joined a process group"))
    assert says in one_line(UsageError, D.init_distributed, "cpu")


@pytest.mark.slow
def test_train_with_a_world_size_of_zero_is_a_usage_error_not_a_division_by_zero(char_data, tmp_path):
    r = run_cli("train", "--config", "shakespeare-cpu", "--set", f"data.dir={char_data}", "--out", str(tmp_path / "run"),
                env={"RANK": "0", "WORLD_SIZE": "0"}, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: WORLD_SIZE=0 must be >= 1 (the number of "
                                                                    "processes torchrun started)"], r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("rank", ["0", "1"])
def test_ranks_that_never_meet_are_one_line_naming_the_rendezvous_not_an_internal_error(rank, char_data, tmp_path):
    """Found by a probe: rank 0 alone (its peer never started) ended in 'DistStoreError: Timed out after 6 seconds
    waiting for clients. 1/2 clients joined. (an internal error; ...)', rank 1 alone in a DistNetworkError."""
    port = str(29400 + os.getpid() % 500)
    r = run_cli("train", "--config", "shakespeare-cpu", "--set", f"data.dir={char_data}", "--set", "train.device=cpu",
                "--set", "train.collective_timeout_s=2", "--out", str(tmp_path / "run"), timeout=120,
                env={"RANK": rank, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
    lines = [line for line in r.stderr.strip().splitlines() if line.startswith("error: ")]  # torch's C++ logs too
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: rank {rank} could not meet the other rank at 127.0.0.1:{port}"), lines
    assert "start every rank" in lines[0] and "train.collective_timeout_s" in lines[0]
    assert "internal error" not in lines[0]


def test_the_collective_timeout_reaches_the_process_group_and_must_be_positive(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    D.init_distributed("cpu", timeout_s=7.5)
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(seconds=7.5)}
    for bad in (0, -1, float("nan")):
        assert "train.collective_timeout_s" in one_line(ValueError, D.init_distributed, "cpu", bad)


def test_a_collective_that_lost_its_peer_is_told_apart_from_other_errors(monkeypatch):
    """gloo raises plain RuntimeErrors: the two it raises when a peer is gone become a few words each."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    closed = RuntimeError("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:18824. "
                          "This is typically caused by a remote worker crashing.")
    assert D.peer_gone(closed) == "Connection closed by peer [127.0.0.1]:18824"
    timed_out = RuntimeError("[/x/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete")
    assert D.peer_gone(timed_out) == "Timed out waiting 5000ms for recv operation to complete"
    assert D.peer_gone(dist.DistBackendError("NCCL error")) == "NCCL error"
    assert D.peer_gone(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert D.peer_gone(ValueError("timed out")) is None
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    assert D.peer_gone(closed) is None


def two_rank_config(char_data, tmp_path, max_steps: int, every_steps: int, **train):
    """A tiny config of B=2 per rank and 2 micro-steps: 2 ranks make 256 tokens per step."""
    cfg = tiny_config(char_data, micro_batch=2, max_steps=max_steps, total_batch_tokens=2 * 32 * 2 * 2, **train)
    cfg.train.eps = WELL_CONDITIONED_EPS  # weights are compared (conftest says why)
    cfg.eval.interval = 0
    cfg.checkpoint.every_steps = every_steps
    config = tmp_path / "tiny.toml"
    config.write_text(dump_toml(cfg))
    return config


@pytest.mark.slow
def test_ddp_torchrun_two_processes_equal_one_process_with_twice_the_batch(char_data, tmp_path):
    """The documented launch, end to end: torchrun -m gpt2train train with 2 ranks x B=2, two micro-batches
    per step, against one process with B=4; final checkpoints and logged (rank-averaged) losses agree."""
    config = two_rank_config(char_data, tmp_path, max_steps=4, every_steps=0)

    two = tmp_path / "two"
    r = torchrun("-m", "gpt2train", "train", "--config", str(config), "--out", str(two))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "world size 2" in r.stdout and "2 ranks x 2 micro-steps" in r.stdout
    assert r.stdout.count("finished at step 4") == 1  # rank 0 alone reports

    one = tmp_path / "one"
    train(load_config(config, ["train.micro_batch=4"]), one)

    assert_close(latest_weights(two), latest_weights(one))
    np.testing.assert_allclose(train_losses(two), train_losses(one), rtol=0, atol=TOL)


@pytest.mark.slow
def test_a_two_rank_run_resumes_in_one_process_with_the_same_global_batch(char_data, tmp_path):
    """2 ranks x B=2 x 2 micro-steps saved at step 3, resumed by one process with B=4 x 2 micro-steps: the
    same windows per step, so steps 4..6 log the losses the 2-rank run logged."""
    resume_two_ranks_in_one_process(two_rank_config(char_data, tmp_path, max_steps=6, every_steps=3), tmp_path)


def resume_two_ranks_in_one_process(config: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Runs of 6 steps: 2 ranks x B=2 under torchrun ("two"), and its step-3 checkpoint resumed by one process
    with B=4 ("one"), whose steps 4..6 must log the 2-rank run's losses."""
    two = tmp_path / "two"
    r = torchrun("-m", "gpt2train", "train", "--config", str(config), "--out", str(two))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    one = tmp_path / "one"
    train(load_config(config, ["train.micro_batch=4"]), one, resume=str(two / "checkpoints" / "step_00000003"))
    np.testing.assert_allclose(train_losses(one), train_losses(two)[3:], rtol=0, atol=1e-5)
    return one, two


@pytest.mark.slow
def test_a_two_rank_mixture_run_resumes_in_one_process_with_the_same_rows(char_data, tmp_path):
    """data.sources under torchrun: 2 ranks x B=2 draw a 3:1 mixture of two folders, every rank the same row
    schedule and its own rows of it; saved at step 3 and resumed by one process with B=4, steps 4..6 log the
    losses the 2-rank run logged, and each source's val loss is the 2-rank run's."""
    web, code = tmp_path / "web", tmp_path / "code"
    shutil.copytree(char_data, web)
    shutil.copytree(char_data, code)
    config = two_rank_config(char_data, tmp_path, max_steps=6, every_steps=3)
    mixture = [f'data.sources=["{web}=3", "{code}=1"]', "eval.interval=3", "eval.val_batches=2"]
    config.write_text(dump_toml(load_config(config, mixture)))
    one, two = resume_two_ranks_in_one_process(config, tmp_path)
    val = {run: [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "val"]
           for run in (one, two)}
    assert set(val[two][-1]["sources"]) == {str(web), str(code)}
    for name in (str(web), str(code)):
        assert val[one][-1]["sources"][name]["val_loss"] == pytest.approx(val[two][-1]["sources"][name]["val_loss"],
                                                                           abs=1e-5)


@pytest.mark.slow
def test_torchrun_into_a_run_without_resume_stops_every_rank_in_one_line_and_changes_nothing(char_data, tmp_path):
    """Rank 0 looks into the run directory and every rank learns its verdict: both stop with the same one line
    (exit 2), none waits for the other, and the run's checkpoints and metrics.jsonl stay as they were."""
    config = two_rank_config(char_data, tmp_path, max_steps=2, every_steps=2)
    run = tmp_path / "run"
    train(load_config(config, ["train.micro_batch=4"]), run)
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}

    r = torchrun("--tee", "3", "-m", "gpt2train", "train", "--config", str(config), "--out", str(run), timeout=120)
    for rank in (0, 1):
        lines = [line.removeprefix(f"[default{rank}]:") for line in r.stderr.splitlines()
                 if line.startswith(f"[default{rank}]:")]
        assert [line for line in lines if line.startswith("error:")] == [
            f"error: {run} already holds a run (checkpoints up to step_00000002); continue it with --resume auto "
            "(resume='auto' in Python), or pass another --out to start a new run"], r.stderr[-3000:]
    assert re.search(r"exitcode\s*: 2 ", r.stderr), r.stderr[-3000:]
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"} == before


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["hang", "kill"])
def test_a_rank_that_hangs_or_dies_stops_the_other_in_one_line_and_the_checkpoint_stands(char_data, tmp_path, fault):
    """Rank 1 hangs (sleeps) or SIGKILLs itself as it starts step 5 of 8, checkpoints every 2 steps. Rank 0,
    waiting for it in a collective, fails within train.collective_timeout_s (hang) or at once (kill), prints one
    line naming itself and its last step, and exits 1; step 4's checkpoint loads. The hang is the case torchrun
    cannot see: only our timeout ends it."""
    config = two_rank_config(char_data, tmp_path, max_steps=8, every_steps=2, collective_timeout_s=5.0)
    run = tmp_path / "run"
    start = time.monotonic()
    r = torchrun("--tee", "3", str(REPO / "tests" / "rank_fault_worker.py"), fault, "5",
                 "--config", str(config), "--out", str(run), timeout=60)
    seconds = time.monotonic() - start
    assert seconds < 60
    rank0 = [line.removeprefix("[default0]:") for line in r.stderr.splitlines() if line.startswith("[default0]:")]
    errors = [line for line in rank0 if line.startswith("error:")]
    saved = run / "checkpoints" / "step_00000004"
    assert len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith("error: rank 0: lost contact with another rank after step 4 (")
    assert errors[0].endswith(f"; the last checkpoint ({saved}) is intact; resume with --resume auto")
    if fault == "hang":
        assert "(Timed out waiting 5000ms" in errors[0]
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*exitcode\s*: 1 ", r.stderr), r.stderr[-3000:]  # not a signal
    assert not any(line.startswith("Traceback") for line in rank0)
    assert "gpt2train" not in "".join(line for line in r.stderr.splitlines() if line.strip().startswith("File "))

    assert newest_checkpoint(run) == saved
    weights, _, meta = load_checkpoint(run)
    assert meta["step"] == 4 and weights


@pytest.mark.slow
def test_ranks_stopped_by_different_signals_save_the_same_step_and_exit_alike(char_data, tmp_path):
    """Rank 0 gets a SIGINT and rank 1 a SIGTERM as they start step 3 of 8: they agree on SIGTERM (a scheduler's
    stop wins), save step 3 and both exit 143; rank 0 prints the torchrun command that resumes the run."""
    config = two_rank_config(char_data, tmp_path, max_steps=8, every_steps=0)
    run = tmp_path / "run"
    r = torchrun("--tee", "3", str(REPO / "tests" / "rank_fault_worker.py"), "signal", "3",
                 "--config", str(config), "--out", str(run), timeout=120)
    for rank in (0, 1):
        assert re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)\s*exitcode\s*: 143 ", r.stderr), r.stderr[-3000:]
    assert r.returncode == 1  # torchrun's own status when a rank failed, whatever the rank's
    rank0 = [line.removeprefix("[default0]:") for line in r.stdout.splitlines() if line.startswith("[default0]:")]
    assert rank0[-1].startswith("stopped by SIGTERM at step 3 (saved); "), r.stdout[-3000:]
    assert rank0[-1].endswith(f"resume with: torchrun --standalone --nproc_per_node=2 -m gpt2train train --config "
                              f"{config} --out {run} --resume auto"), repr(rank0[-1][-200:])
    assert not any(line.startswith("[default1]:stopped") for line in r.stdout.splitlines())  # rank 0 alone reports
    assert newest_checkpoint(run) == run / "checkpoints" / "step_00000003"


@pytest.mark.slow
def test_fsdp_torchrun_two_processes_equal_one_process(char_data, tmp_path):
    """FSDP2 (fully_shard) runs on CPU with gloo in this torch: same weights as one process with 2B."""
    out = tmp_path / "fsdp.pt"
    r = torchrun(str(REPO / "tests" / "distributed_worker.py"), str(char_data), str(out), "--strategy", "fsdp",
                 "--micro-batch", "2", "--accum", "2", "--steps", "3")
    if r.returncode != 0 and "fully_shard" in r.stderr and "cpu" in r.stderr.lower():
        pytest.skip("FSDP2 does not support CPU/gloo in this torch: " + r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-3000:]
    fsdp = torch.load(out, weights_only=False)
    assert fsdp["model_type"].startswith("FSDP")  # fully_shard really wrapped the model
    # One gradient reduction per step for each of the 3 sharded units (2 blocks + the root), not one per
    # micro-batch: backward of the first micro-batch runs inside the no-sync window too.
    assert fsdp["reduce_scatters"] == [3, 3, 3]
    assert fsdp["forward_weight_dtypes"] == ["torch.float32"] and fsdp["master_dtype"] == "torch.float32"

    ref = Trainer(worker_config(char_data, "fsdp", micro_batch=4, accum=2, steps=3, world_size=1), None)
    losses = [ref.train_step()["loss"] for _ in range(3)]
    np.testing.assert_allclose(fsdp["losses"], losses, rtol=0, atol=TOL)
    assert abs(fsdp["val_loss"] - ref.evaluate()) <= TOL
    assert_close(fsdp["weights"], full_state_dict(ref.raw_model))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_batch_schedule_and_a_weight_average_under_torchrun_equal_one_process_and_resume(char_data, tmp_path, strategy):
    """train.batch_schedule (2x from step 3: 4 micro-steps per rank) and train.average_last (steps 3 and 4) with 2
    ranks x B=2 against one process with B=4. Under FSDP2 each rank averages its own shards, a checkpoint holds
    the gathered mean, and a 2-rank resume of the step-3 checkpoint cuts it into shards again."""
    config = two_rank_config(char_data, tmp_path, max_steps=4, every_steps=3, distributed=strategy,
                             batch_schedule=[[0.5, 2]], average_last=0.5)
    two, resumed = tmp_path / "two", tmp_path / "resumed"
    r = torchrun("-m", "gpt2train", "train", "--config", str(config), "--out", str(two))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "the average of the last 2 steps' weights replaced the weights" in r.stdout
    r = torchrun("-m", "gpt2train", "train", "--config", str(config), "--out", str(resumed),
                 "--resume", str(two / "checkpoints" / "step_00000003"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    one = tmp_path / "one"
    assert train(load_config(config, ["train.micro_batch=4"]), one)["tokens"] == 256 * (1 + 1 + 2 + 2)

    assert_close(latest_weights(two), latest_weights(one))
    assert_close(latest_weights(resumed), latest_weights(two))
    np.testing.assert_allclose(train_losses(two), train_losses(one), rtol=0, atol=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,recipe", [("ddp", False), ("fsdp", False), ("fsdp", True)],
                         ids=["ddp", "fsdp", "fsdp-recipe"])
def test_muon_two_processes_equal_one_process(char_data, tmp_path, strategy, recipe):
    """train.optimizer = muon under DDP and under FSDP2, whose matrices are sharded DTensors: Newton-Schulz
    must orthogonalize each whole matrix, not each rank's shard. With bf16 Newton-Schulz the weights
    here differ from one process's by up to 1.7e-3 (DDP) and 1.8e-3 (FSDP) after 3 steps, rounding amplified,
    so both sides orthogonalize in float64 (Muon.orthogonalize_in); a shard-wise one would be off by the size of
    an update. The recipe's options (Polar Express, NorMuon's per-neuron second moment over a sharded matrix,
    cautious weight decay) go through DTensor alike."""
    out = tmp_path / f"{strategy}-muon.pt"
    r = torchrun(str(REPO / "tests" / "distributed_worker.py"), str(char_data), str(out), "--strategy", strategy,
                 "--micro-batch", "2", "--accum", "2", "--steps", "3", "--optimizer", "muon", "--ns-float64",
                 *(["--muon-recipe"] if recipe else []))
    assert r.returncode == 0, r.stderr[-3000:]
    two = torch.load(out, weights_only=False)

    cfg = worker_config(char_data, strategy, micro_batch=4, accum=2, steps=3, world_size=1)
    cfg.train.optimizer = "muon"
    for key, value in (MUON_RECIPE if recipe else {}).items():
        setattr(cfg.train, key, value)
    ref = Trainer(cfg, None)
    ref.optimizer.muon.orthogonalize_in = torch.float64
    np.testing.assert_allclose(two["losses"], [ref.train_step()["loss"] for _ in range(3)], rtol=0, atol=TOL)
    assert_close(two["weights"], full_state_dict(ref.raw_model))


@pytest.mark.slow
def test_fsdp_bf16_gathers_and_reduces_in_bf16_keeps_fp32_masters(char_data, tmp_path):
    """A bf16 FSDP2 run: weights gathered in bf16 for forward, gradients reduce-scattered once per step,
    master weights and AdamW state fp32; losses within bf16 rounding of one process in bf16 autocast."""
    out = tmp_path / "fsdp-bf16.pt"
    r = torchrun(str(REPO / "tests" / "distributed_worker.py"), str(char_data), str(out), "--strategy", "fsdp",
                 "--micro-batch", "2", "--accum", "2", "--steps", "3", "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr[-3000:]
    fsdp = torch.load(out, weights_only=False)
    assert fsdp["forward_weight_dtypes"] == ["torch.bfloat16"] and fsdp["master_dtype"] == "torch.float32"
    assert fsdp["optimizer_dtypes"] == ["torch.float32"] and fsdp["reduce_scatters"] == [3, 3, 3]
    cfg = worker_config(char_data, "fsdp", micro_batch=4, accum=2, steps=3, world_size=1)
    cfg.train.dtype = "bfloat16"
    ref = Trainer(cfg, None)
    np.testing.assert_allclose(fsdp["losses"], [ref.train_step()["loss"] for _ in range(3)], rtol=0, atol=2e-2)


@pytest.fixture
def gloo_group(tmp_path):
    """A one-process gloo group, enough for DDP to run its all-reduce hooks."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        D.shutdown_distributed(clean=False)
    assert not dist.is_initialized()


def test_ddp_all_reduces_only_on_the_last_micro_batch(char_data, gloo_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    trainer = Trainer(tiny_config(char_data, micro_batch=2), None)
    trainer.step_fn.model = DDP(trainer.raw_model)
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    trainer.step_fn.model.register_comm_hook(None, counting_hook)
    trainer.step_fn.grad_accum = 1
    trainer.train_step()  # the first step may rebuild buckets; count from the second
    calls.clear()
    trainer.train_step()
    per_step = len(calls)
    assert per_step >= 1
    calls.clear()
    trainer.step_fn.grad_accum = 4
    trainer.train_step()
    assert len(calls) == per_step  # three micro-batches under no_sync, one all-reduce round at the end


def test_gloo_shutdown_pauses_after_the_last_collective(tmp_path, monkeypatch):
    """Bug (CI, torch 2.13): a rank finished its run, then aborted at interpreter exit ("terminate called without
    an active exception") because a gloo worker thread was still freeing the last collective's tensors and
    needed the GIL. shutdown_distributed must release the GIL after the barrier and the group's destruction."""
    events = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: events.append("barrier"))
    destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: (events.append("destroy"), destroy())[1])
    monkeypatch.setattr(D.time, "sleep", lambda s: events.append(f"sleep {s}"))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    D.shutdown_distributed(clean=True)
    assert not dist.is_initialized()
    assert events[:2] == ["barrier", "destroy"] and events[2].startswith("sleep ") and float(events[2][6:]) >= 0.1
