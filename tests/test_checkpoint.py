"""What a checkpoint holds, how it is laid out, that a crash at any instant of a save leaves the previous one
usable, `ckpt inspect`, and sharded (DCP) checkpoints of FSDP runs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import gpt2train.checkpoint as C
import gpt2train.checkpoint.format as checkpoint_format  # where the files are written: faults go in there
from conftest import MUON_RECIPE, REPO, one_line, run_cli, run_here, tiny_config
from gpt2train import cli
from gpt2train.config import config_from_resolved, dump_toml, to_dict
from gpt2train.loading import load_for_inference
from gpt2train.model import GPT, GPTConfig
from gpt2train.training.loop import Trainer, train

sys.path.insert(0, str(REPO / "scripts"))
from fault_trials import after_each_save_step  # noqa: E402  the steps of a save, as the SIGKILL trials widen them

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained_run(char_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("ckpt") / "run"
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests (one_thread) that train on from it
    train(tiny_config(char_data, max_steps=10), run)
    torch.set_num_threads(before)
    return run


def test_checkpoint_holds_the_whole_training_state(trained_run, char_data):
    ckpt = trained_run / "checkpoints" / "step_00000010"
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "model.safetensors", "state.pt"]

    weights = load_file(ckpt / "model.safetensors")
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in weights) and "lm_head.weight" not in weights
    model = GPT(config_from_resolved(json.loads((ckpt / "meta.json").read_text())["config"]).model)
    C.load_model_state(model, weights)

    state = torch.load(ckpt / "state.pt", weights_only=True)  # plain data only: no pickled code runs on load
    assert {"optimizer", "scaler", "ranks", "guard"} <= state.keys()
    assert len(state["optimizer"]["state"]) == len(list(model.parameters()))
    assert state["optimizer"]["state"][0]["step"].item() == 10
    (rank0,) = state["ranks"]
    assert {"python", "numpy", "torch"} <= rank0["rng"].keys()
    assert {"rng", "epoch", "position", "seed", "batch"} <= rank0["loader"].keys()
    assert len(state["guard"]["recent"]) == 10

    meta = json.loads((ckpt / "meta.json").read_text())
    expected = tiny_config(char_data, max_steps=10)
    expected.model.vocab_size = 66
    assert meta["config"] == to_dict(expected)
    assert meta["step"] == 10 and meta["tokens"] == 10 * 4 * 32
    assert meta["val_loss"] == meta["best_val_loss"] and meta["val_loss"] > 0
    assert meta["version"] and meta["saved_at"] > 0 and meta["train_wall_s"] > 0
    assert meta["tokenizer"]["kind"] == "char" and meta["world_size"] == 1 and meta["sharded"] is False
    assert meta["files"] == {"model.safetensors": (ckpt / "model.safetensors").stat().st_size,
                             "state.pt": (ckpt / "state.pt").stat().st_size}
    assert meta["files_crc32"] == {name: zlib.crc32((ckpt / name).read_bytes()) for name in meta["files"]}
    assert (trained_run / "checkpoints" / "latest").read_text().strip() == "step_00000010"


def test_weights_are_saved_without_wrapper_prefixes():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    compiled = torch.compile(model)  # wraps as _orig_mod; compiles nothing until called
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    keys = C.model_state(compiled).keys()
    assert keys == {k for k in model.state_dict() if k != "lm_head.weight"}


def fake_save(run_dir, step, *, ring=True, best=False, keep_last=2):
    weights = {"w": torch.full((4,), float(step))}
    meta = {"tokens": step, "config": {"model": {}}}
    return C.save_checkpoint(run_dir, step, weights, {"scaler": {}}, meta, keep_last=keep_last, ring=ring, best=best)


def ring_names(run_dir):
    return sorted(p.name for _, p in C.ring_entries(run_dir / "checkpoints"))


def test_ring_keeps_last_k_and_best_takes_no_slot(tmp_path):
    for step in (1, 2, 3, 4):
        fake_save(tmp_path, step)
    assert ring_names(tmp_path) == ["step_00000003", "step_00000004"]
    fake_save(tmp_path, 5, ring=False, best=True)  # a new best between regular saves
    assert ring_names(tmp_path) == ["step_00000003", "step_00000004"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert C.read_meta(tmp_path / "checkpoints" / "best")["step"] == 5

    fake_save(tmp_path, 6, best=True)  # a regular save that is also the best: one write, linked
    assert ring_names(tmp_path) == ["step_00000004", "step_00000006"]
    best, six = tmp_path / "checkpoints" / "best", tmp_path / "checkpoints" / "step_00000006"
    assert C.read_meta(best)["step"] == 6
    assert (best / "state.pt").stat().st_ino == (six / "state.pt").stat().st_ino
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]

    # Resuming from step 4 and saving step 5 abandons step 6: the ring follows the new timeline.
    fake_save(tmp_path, 5)
    assert ring_names(tmp_path) == ["step_00000004", "step_00000005"]


class Crash(BaseException):
    """Stands for SIGKILL: nothing after it runs, no cleanup."""


def test_a_crash_at_any_instant_of_a_save_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    instants = 0
    for crash_at in range(1, 12):
        run = tmp_path / f"run{crash_at}"
        fake_save(run, 1, best=True)
        calls = 0

        def crash_once_there(crash_at=crash_at):
            nonlocal calls
            calls += 1
            if calls == crash_at:
                raise Crash

        after_each_save_step(crash_once_there, monkeypatch.setattr)
        try:
            fake_save(run, 2, best=True)
        except Crash:
            instants += 1
        monkeypatch.undo()
        found = C.newest_checkpoint(run)
        assert found is not None and found.name in ("step_00000001", "step_00000002")
        latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
        weights, _, meta = C.load_checkpoint(latest)  # `latest` always names a complete checkpoint
        assert weights["w"][0].item() == meta["step"]
        C.recover(run / "checkpoints")
        assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    # after the weights, after state.pt, after meta + fsync, before `latest` moves, best/'s copy synced unrenamed
    assert instants == 5


def test_a_crash_between_the_renames_of_an_overwrite_is_undone(tmp_path, monkeypatch):
    fake_save(tmp_path, 1, ring=False, best=True)
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(src)
        if len(calls) == 2:  # the old best is moved aside, the new one not yet in
            raise Crash
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint_format.os, "replace", replace)
    with pytest.raises(Crash):
        fake_save(tmp_path, 2, ring=False, best=True)
    monkeypatch.undo()
    assert not (tmp_path / "checkpoints" / "best").exists()
    C.recover(tmp_path / "checkpoints")
    assert C.load_checkpoint(tmp_path / "checkpoints" / "best")[2]["step"] == 1


@pytest.mark.slow
def test_inspect_prints_a_summary_and_reports_damage_in_one_line(trained_run, tmp_path):
    r = run_here("ckpt", "inspect", str(trained_run))
    assert r.returncode == 0, r.stderr
    for text in ("step_00000010", "step        10 of 10", "tokens      1,280", "val loss", "saved", "model       2 layers",
                 "tokenizer   char", "config      data", "ring        step_00000005, step_00000010 (latest)"):
        assert text in r.stdout, text
    assert re.search(r"after \d+(\.\d+)? s of training", r.stdout) and re.search(r"\d+\.\d\d [KM]iB\n", r.stdout)  # units.py

    damaged = tmp_path / "damaged"
    shutil.copytree(trained_run / "checkpoints" / "step_00000010", damaged)
    data = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(data[: len(data) - 100])
    r = run_here("ckpt", "inspect", str(damaged))
    assert r.returncode == 1 and r.stdout == ""  # a damaged file found while working: exit 1
    assert r.stderr.count("\n") == 1 and "model.safetensors is" in r.stderr and "truncated" in r.stderr

    (damaged / "model.safetensors").write_bytes(data)
    flip_a_byte(damaged / "model.safetensors")  # the size intact: only the checksum sees it
    r = run_here("ckpt", "inspect", str(damaged))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "model.safetensors changed after it was saved" in r.stderr

    (damaged / "model.safetensors").write_bytes(data)
    (damaged / "meta.json").write_text('{"step": 10, "conf')
    r = run_here("ckpt", "inspect", str(damaged))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "meta.json is unreadable" in r.stderr


@contextlib.contextmanager
def process_umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.slow
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_file_of_a_run_and_its_export_is_as_readable_as_the_umask_allows(gpt2_data, tmp_path, umask):
    """safetensors writes through a temporary file created 0600: the weights must still get the mode any file
    created under the umask gets (0644 under umask 022), like meta.json, state.pt and the rest."""
    from gpt2train.hf import export_hf

    with process_umask(umask):
        train(tiny_config(gpt2_data, max_steps=5), tmp_path / "run")
        model, _, meta = load_for_inference(tmp_path / "run")
        export_hf(model, tmp_path / "hf", tokenizer_spec=meta["tokenizer"])
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in tmp_path.rglob("*") if p.is_file()}
    assert {"run/checkpoints/step_00000005/model.safetensors", "run/checkpoints/step_00000005/meta.json",
            "run/checkpoints/best/model.safetensors", "hf/model.safetensors", "hf/config.json",
            "hf/vocab.json"} <= modes.keys()
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_inspect_and_the_run_log_show_what_ran_beside_what_was_asked(char_data, tmp_path, monkeypatch):
    """`ckpt inspect` showed `dtype auto` (the config) where bfloat16 or float32 ran. A CPU without native bf16
    (monkeypatched, so the test holds on both kinds): auto resolves to float32 and compile auto to off."""
    monkeypatch.setattr("gpt2train.runtime.cpu_has_native_bf16", lambda: False)
    run = tmp_path / "run"
    train(tiny_config(char_data, max_steps=2, dtype="auto", compile="auto"), run)
    assert "ran         dtype float32 (asked: auto), compile off (asked: auto), device cpu\n" in C.describe_checkpoint(run)
    (start,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["kind"] == "run_start"]
    assert start["runtime"] == {"dtype": "float32", "compile": False, "device": "cpu"}

    ckpt = run / "checkpoints" / "step_00000002"  # saved before the record existed: what was asked, said so
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["runtime"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert ("ran         not recorded (saved before gpt2train recorded it); asked: dtype auto, compile auto, device cpu"
            in C.describe_checkpoint(ckpt))


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{"optimizer": "adamw"}, {"optimizer": "muon"}, MUON_RECIPE],
                         ids=["adamw", "muon", "muon-recipe"])
def test_fsdp_saves_sharded_with_dcp_and_resumes_exactly(char_data, tmp_path, settings):
    """Two CPU processes over gloo with FSDP2: every rank writes its shards through DCP; a resumed run ends
    with the same weights as the uninterrupted one; a sharded checkpoint also loads into a single process.
    Muon + AdamW saves and loads as the list of its two optimizers (NorMuon's second moment with them)."""
    cfg = tiny_config(char_data, max_steps=4, **settings)
    cfg.train.distributed = "fsdp"
    cfg.checkpoint.every_steps, cfg.eval.interval = 2, 2
    config = tmp_path / "fsdp.toml"
    config.write_text(dump_toml(cfg))

    def torchrun(*args):
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "gpt2train", "train", "--config", str(config), *args]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]

    torchrun("--out", str(tmp_path / "a"))
    step2 = tmp_path / "a" / "checkpoints" / "step_00000002"
    meta = C.verify(step2)
    assert meta["sharded"] is True and meta["world_size"] == 2
    assert meta["files_crc32"].keys() == meta["files"].keys() >= {"dcp/.metadata", "model.safetensors", "state.pt"}
    assert (step2 / "dcp" / ".metadata").is_file() and len(list((step2 / "dcp").glob("*.distcp"))) == 2
    assert "optimizer" not in torch.load(step2 / "state.pt", weights_only=True)
    assert len(torch.load(step2 / "state.pt", weights_only=True)["ranks"]) == 2

    torchrun("--out", str(tmp_path / "b"), "--resume", str(step2))
    final_a = load_file(tmp_path / "a" / "checkpoints" / "step_00000004" / "model.safetensors")
    final_b = load_file(tmp_path / "b" / "checkpoints" / "step_00000004" / "model.safetensors")
    assert final_a.keys() == final_b.keys() and all(torch.equal(final_a[k], final_b[k]) for k in final_a)

    model, _, _ = load_for_inference(tmp_path / "a")  # full weights sit beside the shards, for sampling
    # One process (no FSDP) resumes the sharded checkpoint through DCP's resharding.
    # The same 256 tokens per step: 2 micro-batches in one process for 1 on each of 2 ranks.
    single = Trainer(tiny_config(char_data, max_steps=6, total_batch_tokens=2 * 4 * 32, **settings),
                     tmp_path / "single",
                     resume=str(tmp_path / "a"))
    assert single.state.step == 4
    for key, value in C.model_state(single.raw_model).items():
        assert torch.equal(value, final_a[key]), key
    assert len(single.optimizer.state) == len(list(single.raw_model.parameters()))
    if settings.get("muon_normalize"):
        second = [single.optimizer.muon.state[p]["second_moment"] for p in single.optimizer.muon.param_groups[0]["params"]]
        assert [tuple(v.shape) for v in second] == [(96, 1), (32, 1), (128, 1), (1, 128)] * 2
        assert all(v.min() > 0 for v in second)  # the saved moments, not fresh zeros


def test_saves_by_wall_clock_go_into_the_ring(char_data, tmp_path):
    cfg = tiny_config(char_data, max_steps=4)
    cfg.checkpoint.every_steps, cfg.checkpoint.every_minutes, cfg.eval.interval = 0, 1e-9, 0  # due after every step
    train(cfg, tmp_path)
    saves = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in saves if r["kind"] == "checkpoint"] == [1, 2, 3, 4]
    assert ring_names(tmp_path) == ["step_00000002", "step_00000003", "step_00000004"]


# --- a checkpoint checked on load: one line naming the file and what to do ---------------------------------
def copy_checkpoint(trained_run, tmp_path) -> Path:
    ckpt = tmp_path / "step_00000010"
    shutil.copytree(trained_run / "checkpoints" / "step_00000010", ckpt)
    return ckpt


def rewrite(ckpt, state=None, **meta_changes):
    """Replace state.pt and/or meta.json keys, keeping the recorded file sizes and checksums right (damage
    verify() misses)."""
    meta = json.loads((ckpt / "meta.json").read_text())
    if state is not None:
        torch.save(state, ckpt / "state.pt")
        meta["files"]["state.pt"] = (ckpt / "state.pt").stat().st_size
        meta["files_crc32"]["state.pt"] = zlib.crc32((ckpt / "state.pt").read_bytes())
    meta.update(meta_changes)
    (ckpt / "meta.json").write_text(json.dumps(meta))


def live_model_and_optimizer(ckpt):
    cfg = config_from_resolved(json.loads((ckpt / "meta.json").read_text())["config"])
    model = GPT(cfg.model)
    return model, torch.optim.AdamW(model.parameters())


def flip_a_byte(path: Path) -> None:
    """Change one byte in the middle of a file, keeping its size, as a failing disk or a bad copy does."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_file_given_as_checkpoint_is_one_line(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 64)
    assert "is a file, not a checkpoint" in one_line(C.CheckpointError, load_for_inference, tmp_path / "weights.bin")


@pytest.mark.slow
def test_a_data_folder_given_as_checkpoint_says_what_it_is(char_data):
    expected = f"{char_data} is a prepared data folder, not a checkpoint; pass a run directory or a checkpoints/step_* folder"
    for load in (load_for_inference, C.describe_checkpoint, C.resolve_checkpoint):
        assert one_line(C.CheckpointError, load, char_data) == expected
    r = run_cli("sample", "--ckpt", str(char_data), env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 1 and r.stderr == f"error: {expected}\n"


def test_a_hugging_face_folder_given_as_checkpoint_says_to_import_it(trained_run, tmp_path):
    from gpt2train import load_model
    from gpt2train.hf import export_hf

    hf = tmp_path / "hf"
    export_hf(load_for_inference(trained_run)[0], hf)  # config.json + model.safetensors, no meta.json
    expected = f"{hf} is a Hugging Face model folder; import it first: gpt2train import-hf {hf} --out RUN_DIR"
    for load in (load_for_inference, C.describe_checkpoint, C.resolve_checkpoint):
        assert one_line(C.CheckpointError, load, hf) == expected
    assert load_model(hf).config.n_layer == 2  # the library (and serve) read HF folders directly
    (hf / "model.safetensors").unlink()  # weights in another file (pytorch_model.bin): still a HF folder
    assert one_line(C.CheckpointError, C.resolve_checkpoint, hf) == expected


@pytest.mark.parametrize("name", ["model.safetensors", "state.pt"])
def test_a_changed_byte_is_one_line_naming_the_file(trained_run, tmp_path, name):
    ckpt = copy_checkpoint(trained_run, tmp_path)
    flip_a_byte(ckpt / name)
    expected = f"{ckpt} is damaged: {name} changed after it was saved"
    assert expected in one_line(C.CheckpointError, load_for_inference, ckpt)
    assert expected in one_line(C.CheckpointError, C.load_training_checkpoint, ckpt, *live_model_and_optimizer(ckpt),
                                sharded=False)


@pytest.mark.slow
def test_a_changed_byte_in_the_newest_checkpoint_falls_back_to_the_one_before(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    flip_a_byte(run / "checkpoints" / "step_00000010" / "model.safetensors")
    env = {"OMP_NUM_THREADS": "1"}
    r = run_cli("sample", "--ckpt", str(run), "--max-new-tokens", "4", env=env)
    assert r.returncode == 0, r.stderr
    (warning,) = [line for line in r.stderr.splitlines() if line.startswith("warning")]
    assert "skipping step_00000010" in warning and "model.safetensors changed after it was saved" in warning
    r = run_cli("sample", "--ckpt", str(run / "checkpoints" / "step_00000010"), env=env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "model.safetensors changed" in r.stderr


def test_a_checkpoint_saved_before_checksums_has_its_sizes_checked(trained_run, tmp_path):
    ckpt = copy_checkpoint(trained_run, tmp_path)
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["files_crc32"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert C.load_checkpoint(ckpt)[2]["step"] == 10
    data = (ckpt / "state.pt").read_bytes()
    (ckpt / "state.pt").write_bytes(data[:-10])
    assert "state.pt is" in one_line(C.CheckpointError, C.load_checkpoint, ckpt)


def test_weights_that_do_not_match_the_config_are_one_line(trained_run, tmp_path):
    ckpt = copy_checkpoint(trained_run, tmp_path)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["config"]["model"]["n_embd"] = 64
    rewrite(ckpt, config=meta["config"])
    msg = one_line(C.CheckpointError, load_for_inference, ckpt)
    assert "model.safetensors: the weights do not match" in msg
    assert "transformer.wte.weight is (128, 32), the model needs (128, 64)" in msg


def test_a_checkpoint_missing_what_a_resume_reads_is_one_line(trained_run, tmp_path):
    ckpt = copy_checkpoint(trained_run, tmp_path)
    state = torch.load(ckpt / "state.pt", weights_only=True)
    rewrite(ckpt, {k: v for k, v in state.items() if k != "scaler"})
    assert "lacks scaler" in one_line(C.CheckpointError, C.load_training_checkpoint, ckpt,
                                      *live_model_and_optimizer(ckpt), sharded=False)
    rewrite(ckpt, {k: v for k, v in state.items() if k != "optimizer"})
    assert "weights only" in one_line(C.CheckpointError, C.load_training_checkpoint, ckpt,
                                      *live_model_and_optimizer(ckpt), sharded=False)
    rewrite(ckpt, [1, 2])
    assert "holds a list" in one_line(C.CheckpointError, C.load_training_checkpoint, ckpt,
                                      *live_model_and_optimizer(ckpt), sharded=False)
    rewrite(ckpt, state)
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["tokens"]  # a checkpoint saved before tokens were recorded
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert "lacks tokens" in one_line(C.CheckpointError, C.load_training_checkpoint, ckpt,
                                      *live_model_and_optimizer(ckpt), sharded=False)


META_EDITS = {  # meta.json edited by hand: each once a crash (AttributeError, TypeError, KeyError) or a misread
    "tokens": lambda m: m.update(tokens="x"),
    "config": lambda m: m["config"].update(model="x"),
    "n_layer": lambda m: m["config"]["model"].update(n_layer="2"),
    "batch": lambda m: m["batch"].pop("seq_len"),
    "val_loss": lambda m: m.update(val_loss="low"),
    "tokenizer": lambda m: m.update(tokenizer="char"),
    "step": lambda m: m.update(step=99),
}


@pytest.mark.parametrize("field", list(META_EDITS))
def test_a_meta_json_edited_into_other_types_is_a_corrupt_checkpoint_in_one_line(trained_run, tmp_path, capsys, field):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    ckpt = run / "checkpoints" / "step_00000010"
    meta = json.loads((ckpt / "meta.json").read_text())
    META_EDITS[field](meta)
    (ckpt / "meta.json").unlink()  # best/ holds a hard link to it
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert cli.main(["ckpt", "inspect", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {ckpt}/meta.json: ") and field in err and "corrupt" in err
    assert cli.main(["ckpt", "inspect", str(run)]) == 0  # a run directory: the checkpoint before it
    out, err = capsys.readouterr()
    assert "checkpoint  " + str(run / "checkpoints" / "step_00000005") in out and err.startswith("warning: skipping")


def test_a_meta_json_whose_step_is_not_its_folders_sets_aside_only_that_checkpoint(char_data, trained_run, tmp_path):
    """Its step once decided which checkpoints were "newer" than the one resumed: a step of -5 in step_00000010
    moved the good step_00000005 aside as damaged too, and the resume failed."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    ckpt = run / "checkpoints" / "step_00000010"
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").unlink()
    (ckpt / "meta.json").write_text(json.dumps({**meta, "step": -5}))
    out = train(tiny_config(char_data, max_steps=10), run, resume="auto")
    assert out["step"] == 10 and sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        ".damaged-step_00000010", "best", "latest", "step_00000005", "step_00000010"]


def test_optimizer_moments_of_another_shape_are_one_line(tmp_path):
    def adam_state(n_embd, n_head):
        model = GPT(GPTConfig(n_layer=1, n_head=n_head, n_embd=n_embd, block_size=8, vocab_size=32))
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
        optimizer.step()
        return model, optimizer

    _, other = adam_state(32, 2)
    model, optimizer = adam_state(16, 2)  # the same number of tensors: torch loads it without a word
    msg = one_line(C.CheckpointError, C.load_optimizer_state, optimizer, other.state_dict(), tmp_path)
    assert "state.pt: optimizer exp_avg has shape" in msg and "start a new run directory" in msg
