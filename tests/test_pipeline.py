"""`gpt2train pipeline` (docs/pipeline.md): the default preset end to end at a tiny size, its report card, a second
run that skips every stage, a changed setting that reruns its stage and those after it, an interrupted pipeline that
resumes inside its stage and ends as the uninterrupted one, --plan of the GPU preset on 8 H100s, ranks other than 0
waiting for rank 0's stages, and every mistake in a pipeline refused in one line before any work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_here
from gpt2train.cli import build_parser
from gpt2train.pipeline.definition import load_pipeline
from gpt2train.pipeline.runner import Runner, StageRecord, fingerprint, record_path, write_record
from gpt2train.runlog import load_run

# pipeline-cpu at a tiny size: a 1-layer model, a few steps each, a few examples of each eval
TINY = ["--set", "pretrain.model.depth=1", "--set", "pretrain.train.max_steps=8", "--set", "pretrain.train.micro_batch=4",
        "--set", "pretrain.eval.interval=4", "--set", "pretrain.eval.val_batches=2", "--set",
        "pretrain.eval.sample_interval=0", "--set", "pretrain.checkpoint.every_steps=4",
        "--set", "suite.limit=2", "--set", "chat_data.conversations=100",
        "--set", "sft.train.max_steps=6", "--set", "sft.train.micro_batch=4", "--set", "sft.eval.interval=3",
        "--set", "sft.eval.val_batches=2", "--set", "sft.checkpoint.every_steps=3", "--set", "chat_eval.limit=4"]
STAGES = ["data", "pretrain", "suite", "chat_data", "sft", "chat_eval", "export_hf", "export_gguf"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """pipeline-cpu run once at the tiny size: (its folder, the command's result, report.md as it was written)."""
    out = tmp_path_factory.mktemp("pipeline") / "p"
    done = run_here("pipeline", "--out", str(out), *TINY)
    return out, done, (out / "report.md").read_text() if (out / "report.md").exists() else ""


@pytest.mark.slow
def test_the_default_pipeline_runs_end_to_end_and_prints_its_report_card(finished):
    out, done, card = finished
    assert done.returncode == 0, done.stderr[-2000:]
    assert card and card in done.stdout  # printed, and written
    plan = done.stdout.splitlines()[1:len(STAGES) + 3]  # the run's first lines: each stage's estimate, the total
    assert plan[0] == "plan on this machine:" and [line.split()[0] for line in plan[1:]] == [*STAGES, "total"]
    rows = {line.split(" | ")[0].strip("| "): line for line in card.splitlines() if line.startswith("| ")}
    assert [name for name in rows if name in STAGES] == STAGES
    assert "8 steps" in rows["pretrain"] and "best val loss" in rows["pretrain"]
    assert "CORE mean centered" in rows["suite"] and "val loss" in rows["suite"]
    assert "exact match" in rows["chat_eval"] and "of 4 held-out conversations" in rows["chat_eval"]
    for stage, within in (("export_hf", 1e-3), ("export_gguf", 1e-2)):  # float32 exports: our logits, near enough
        measured = json.loads((out / ".pipeline" / f"{stage}.json").read_text())["measured"]
        if measured["agreement"] is None:  # transformers or llama-cpp-python not installed: said so
            assert "not installed" in measured["why"] and "not measured" in rows[stage]
            continue
        assert measured["max_logit_diff"] < within and measured["agreement"] >= 0.9, measured
    assert "[reference] " in card  # the held-out conversations, answered
    page = (out / "report.html").read_text()  # in the style of `gpt2train report`'s page
    assert "<th>stage</th>" in page and "<td>pretrain</td>" in page and "border-collapse" in page
    for name in ("data", "base", "chat_data", "chat", "hf", "chat.gguf"):
        assert (out / name).exists()


@pytest.mark.slow
def test_run_again_it_skips_every_stage_and_a_changed_setting_reruns_that_stage_and_those_after(finished):
    out, done, _ = finished
    assert done.returncode == 0
    again = run_here("pipeline", "--out", str(out), *TINY)
    assert again.returncode == 0, again.stderr[-2000:]
    said = [line for line in again.stdout.splitlines() if line.startswith("stage ")]
    assert said == [line for line in said if line.split(":")[1].startswith(" done (")] and len(said) == len(STAGES)
    old_chat = load_file(next((out / "chat" / "checkpoints").glob("step_*")) / "model.safetensors")
    changed = run_here("pipeline", "--out", str(out), *TINY, "--set", "sft.train.lr=1e-3")
    assert changed.returncode == 0, changed.stderr[-2000:]
    lines = changed.stdout.splitlines()
    skipped = [s for s in STAGES if f"stage {s}: done (" in changed.stdout]
    assert skipped == ["data", "pretrain", "suite", "chat_data"]
    assert any(line.startswith(f"stage sft: {out / 'chat'} was made otherwise (its settings or inputs changed): "
                               "moved to ") for line in lines)
    assert all(f"stage {s}: gpt2train " in changed.stdout for s in ("sft", "chat_eval", "export_hf", "export_gguf"))
    aside = next((out / ".pipeline" / "replaced").glob("sft-*"))  # the old run, kept, not reused
    kept = load_file(next((aside / "checkpoints").glob("step_*")) / "model.safetensors")
    assert kept.keys() == old_chat.keys() and all(torch.equal(kept[k], old_chat[k]) for k in kept)


def tiny_pretraining(tmp_path: Path, steps: int = 24) -> Path:
    """A pipeline file of two stages: Tiny Shakespeare, then a 1-layer model trained `steps` steps."""
    path = tmp_path / "two.toml"
    train = (f"train --config shakespeare-cpu --set data.dir={{out}}/data --set model.depth=1 --set train.max_steps={steps} "
             "--set train.micro_batch=4 --set eval.interval=8 --set eval.val_batches=2 --set eval.sample_interval=0 "
             "--set checkpoint.every_steps=4 --out {out}/base")
    path.write_text(f'[stage.data]\nrun = "prepare shakespeare --out {{out}}/data"\n\n[stage.pretrain]\nrun = "{train}"\n')
    return path


@pytest.mark.slow
def test_an_interrupted_pipeline_resumes_inside_its_stage_and_ends_as_the_uninterrupted_one(tmp_path):
    """Ctrl-C while pretraining: the run saves, the pipeline exits 130 with the command that continues; run again,
    the data stage is skipped and training resumes from its checkpoint, ending with the weights and the losses of
    the same pipeline run without a stop."""
    pipeline = tiny_pretraining(tmp_path, steps=400)  # 24 steps, set below: what a stop changes must not be the file
    whole = run_here("pipeline", "--config", str(pipeline), "--out", str(tmp_path / "whole"), "--set",
                     "pretrain.train.max_steps=24")
    assert whole.returncode == 0, whole.stderr[-2000:]
    out = tmp_path / "stopped"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "gpt2train", "pipeline", "--config", str(pipeline), "--out",
                             str(out), "--set", "pretrain.train.max_steps=24"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not list((out / "base" / "checkpoints").glob("step_*")):  # past its first checkpoint, at step 4
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    printed, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, printed
    assert (f"pipeline stopped at stage pretrain (exit status 130); finished stages are kept: continue with gpt2train "
            f"pipeline --config {pipeline} --out {out} --set pretrain.train.max_steps=24") in printed
    resumed = run_here("pipeline", "--config", str(pipeline), "--out", str(out), "--set", "pretrain.train.max_steps=24")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "stage data: done (" in resumed.stdout
    assert "stage pretrain: it was stopped; running it again" in resumed.stdout
    final = [load_file(folder / "base" / "checkpoints" / "step_00000024" / "model.safetensors") for folder in
             (tmp_path / "whole", out)]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    for kind, key in (("train", "loss"), ("val", "val_loss")):
        logged = [{r["step"]: r[key] for r in load_run(folder / "base").of(kind)} for folder in (tmp_path / "whole", out)]
        # the same figures at every step the whole run logged; the stopped one also logged the step it stopped at
        assert len(logged[0]) >= 3 and logged[0].items() <= logged[1].items() and len(logged[1]) <= len(logged[0]) + 1


@pytest.mark.slow
def test_under_torchrun_the_ranks_train_and_evaluate_together_and_rank_0_prepares(tmp_path):
    """Two CPU ranks (gloo), as `torchrun -m gpt2train pipeline` runs on a GPU node: data on rank 0, the training
    and then its eval on both ranks in one process group (an eval after a train stage hung when each stage made
    its own), the card once."""
    pipeline = tiny_pretraining(tmp_path, steps=4)
    with open(pipeline, "a") as f:
        f.write('\n[stage.suite]\nrun = "eval --ckpt {out}/base --tasks val"\n')
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                          "gpt2train", "pipeline", "--config", str(pipeline), "--out", str(tmp_path / "p")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "world size 2" in ran.stdout and "2 rank(s)" in ran.stdout  # the train and the eval stage
    assert ran.stdout.count("# Report card: two") == 1 and ran.stdout.count("stage data: gpt2train prepare") == 1
    assert json.loads((tmp_path / "p" / ".pipeline" / "suite.json").read_text())["status"] == "done"


def test_plan_of_the_gpu_preset_on_8_h100s_needs_no_gpu_and_no_data():
    """Each stage's work, time and memory, and the total, before anything is spent: the pretraining is plan's
    estimate of gpt2-modern on 8 H100s, the fine-tune planned with the base's shape (not made yet)."""
    planned = run_here("pipeline", "--config", "pipeline-gpt2", "--plan", "--device", "H100", "--gpus", "8")
    assert planned.returncode == 0, planned.stderr
    lines = planned.stdout.splitlines()
    assert lines[0] == "plan on 8 x H100:"
    by_stage = {line.split()[0]: line for line in lines[1:]}
    assert list(by_stage) == ["data", "pretrain", "suite", "chat_data", "sft", "chat_eval", "total"]
    assert "19,073 steps of 524.29K tokens" in by_stage["pretrain"] and "GiB per device" in by_stage["pretrain"]
    assert "2,000 steps" in by_stage["sft"] and by_stage["pretrain"].split()[-3:] == by_stage["sft"].split()[-3:]
    assert "HuggingFaceFW/fineweb-edu" in by_stage["data"] and "not timed" in by_stage["total"]
    assert not Path("runs/pipeline-gpt2").exists()  # nothing made


def test_ranks_other_than_0_run_train_and_eval_stages_and_wait_for_rank_0_on_the_others(tmp_path):
    """Under torchrun every rank runs the pipeline: a train stage is torchrun's own (each rank runs it), a prepare
    stage is rank 0's alone (the others wait for its record of this run)."""
    pipeline = load_pipeline(str(tiny_pretraining(tmp_path)), build_parser(), out=str(tmp_path / "p"))
    ran: list[str] = []
    runner = Runner(pipeline, lambda argv: ran.append(argv[0]) or 0, say=lambda line: None, rank=1)
    data = pipeline.stage("data")
    fp = fingerprint(data, {}, pipeline.out)

    def rank_0_prepares():
        time.sleep(0.5)
        write_record(record_path(pipeline, data), StageRecord(fp, "done", time.time(), 0.1, {}))

    # an earlier run's record of the stage, failed: no answer to this run's wait
    write_record(record_path(pipeline, data), StageRecord(fp, "failed", time.time() - 3600, 0.1, {}))
    threading.Thread(target=rank_0_prepares).start()
    started = time.monotonic()
    assert runner.run() == 0
    assert ran == ["train"] and time.monotonic() - started >= 0.5  # it waited for the data, then trained
    assert not record_path(pipeline, pipeline.stage("pretrain")).exists()  # rank 0 keeps the records


BAD = {
    "a command that is no stage": ('[stage.talk]\nrun = "serve --ckpt runs/x"\n',
                                   "stage talk: runs 'serve'; a stage runs one of prepare, tokenizer, train, eval, "
                                   "export-hf, export-gguf"),
    "a stage that is no table": ('stage = 3\n', "bad: [pipeline] and each [stage.NAME] must be tables"),
    "an unknown key": ('[stage.data]\nrun = "prepare shakespeare --out {out}/d"\nruns = 2\n',
                       "bad: [stage.data] has an unknown key 'runs'; it takes run"),
    "a bad argument": ('[stage.data]\nrun = "prepare shakespeare --out {out}/d --val-fraction 2"\n',
                       "stage data: argument --val-fraction: 2 is out of range"),
    "out of order": ('[stage.eval]\nrun = "eval --ckpt {out}/base"\n[stage.pretrain]\nrun = "train --config '
                     'shakespeare-cpu --out {out}/base"\n',
                     "stage eval reads OUT/base, which stage pretrain makes after it; put pretrain first"),
    "a missing input": ('[stage.export]\nrun = "export-hf --ckpt {out}/nothing --out {out}/hf"\n',
                        "stage export reads OUT/nothing, which does not exist and no stage before it makes"),
    "two writers": ('[stage.a]\nrun = "prepare shakespeare --out {out}/d"\n[stage.b]\nrun = "prepare markov --chars 1000 --out '
                    '{out}/d"\n', "stages a and b both write OUT/d; give b another --out"),
    "an export the recipe cannot go to": (
        '[stage.data]\nrun = "prepare shakespeare --out {out}/d"\n[stage.base]\nrun = "train --config '
        'shakespeare-modern --set data.dir={out}/d --out {out}/base"\n[stage.hf]\nrun = "export-hf --ckpt {out}/base '
        '--out {out}/hf"\n', "stage hf exports stage base's model: a model with model.position = rotary"),
    "a fine-tune on another tokenizer": (
        '[stage.data]\nrun = "prepare shakespeare --out {out}/d"\n[stage.base]\nrun = "train --config shakespeare-cpu '
        '--set data.dir={out}/d --out {out}/base"\n[stage.chat_data]\nrun = "prepare chat --demo recall --tokenizer '
        'char --out {out}/c"\n[stage.sft]\nrun = "train --config chat-cpu --set train.init_from={out}/base --set '
        'data.dir={out}/c --out {out}/chat"\n',
        "stage sft fine-tunes stage base's model (tokenizer gpt2, stage data) on stage chat_data's data (tokenizer "
        "char); prepare both with one --tokenizer"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_mistake_in_a_pipeline_is_one_line_naming_the_stage_before_any_work(case, tmp_path):
    text, message = BAD[case]
    (tmp_path / "bad.toml").write_text(text)
    out = tmp_path / "out"
    said = run_here("pipeline", "--config", str(tmp_path / "bad.toml"), "--out", str(out))
    assert said.returncode == 2 and said.stdout == ""
    assert said.stderr.startswith("error: " + message.replace("OUT", str(out))), said.stderr
    assert len(said.stderr.splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("setting, message", [
    ("nostage.x=1", "--set 'nostage.x=1': no stage 'nostage'; stages are data, pretrain, suite, chat_data, sft, "
                    "chat_eval, export_hf, export_gguf"),
    ("suite.train.lr=1", "--set 'suite.train.lr=1': stage suite runs `eval`, which has no config keys"),
    ("sft.nope.x=1", "stage sft: --set 'nope.x=1': unknown section 'nope'"),
    ("x", "--set 'x': expected STAGE.KEY=VALUE"),
])
def test_a_bad_setting_is_one_line_naming_it(setting, message, tmp_path):
    said = run_here("pipeline", "--out", str(tmp_path / "out"), "--set", setting)
    assert said.returncode == 2 and said.stderr.startswith("error: " + message), said.stderr
    assert not (tmp_path / "out").exists()


def test_plan_flags_without_plan_are_refused(tmp_path):
    said = run_here("pipeline", "--out", str(tmp_path / "out"), "--gpus", "8")
    assert said.returncode == 2 and "--device and --gpus go with --plan" in said.stderr
