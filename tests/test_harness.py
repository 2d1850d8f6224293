"""lm-evaluation-harness on our checkpoints (eval/harness.py): the bridge's scores against log-probs
computed directly from the model, batching that changes nothing, the rolling windows, and
`gpt2train eval --tasks lm-eval:...` end to end on tasks defined on local files (nothing downloaded)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import one_line, tiny_config
from gpt2train import cli
from gpt2train.eval import harness
from gpt2train.eval.harness import MISSING, harness_model, rolling_loglikelihood, rolling_windows
from gpt2train.eval.likelihood import score_continuations
from gpt2train.loading import load_for_inference
from gpt2train.model import GPT, GPTConfig
from gpt2train.tokenizer import CharTokenizer, GPT2Tokenizer
from gpt2train.training.loop import train

BLOCK, VOCAB = 16, 100


@pytest.fixture(scope="module")
def small_model() -> GPT:
    """A random 2-layer model whose padded vocabulary ids (100..127) get large logits: the bridge must cut them."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=VOCAB, pad_vocab_multiple=64))
    with torch.no_grad():
        model.transformer.wte.weight[VOCAB:] = 5.0  # tied to lm_head
    return model.eval()


def direct_logprobs(model, row: list[int]) -> torch.Tensor:
    """(len(row) - 1,) log p(row[t] | row[:t]) from one unbatched forward over the tokenizer's vocabulary."""
    with torch.no_grad():
        logits = model.forward(torch.tensor([row[:-1]]))[0, :, :VOCAB]  # the model cuts padding itself; so do we
    return F.log_softmax(logits.double(), -1).gather(1, torch.tensor(row[1:])[:, None])[:, 0]


def test_loglikelihood_is_the_sum_of_direct_log_probs_and_batching_changes_nothing(small_model):
    g = torch.Generator().manual_seed(1)
    lengths = [(3, 2), (1, 1), (12, 4), (30, 5), (5, 16), (2, 7), (20, 20)]  # crops: context, then continuation too
    pairs = [(torch.randint(0, VOCAB, (c,), generator=g).tolist(), torch.randint(0, VOCAB, (n,), generator=g).tolist())
             for c, n in lengths]
    one = score_continuations(small_model, pairs, batch_size=1)
    batched = score_continuations(small_model, pairs, batch_size=4)
    for (context, continuation), (ll, _), (ll_batched, _) in zip(pairs, one, batched):
        row = (context + continuation)[-(BLOCK + 1):]
        n = min(len(continuation), BLOCK)
        assert ll == pytest.approx(direct_logprobs(small_model, row)[-n:].sum().item(), abs=1e-5)
        assert ll_batched == pytest.approx(ll, abs=1e-5)
    assert [greedy for _, greedy in one] == [greedy for _, greedy in batched]

    # The greedy continuation is recognised as greedy; changing its last token makes it not.
    context = [7, 3, 9]
    greedy = []
    for _ in range(4):
        with torch.no_grad():
            greedy.append(int(small_model(torch.tensor([context + greedy]))[0, -1].argmax()))
    assert all(g < VOCAB for g in greedy)  # the padded ids, with the largest raw weights, are never picked
    changed = greedy[:-1] + [(greedy[-1] + 1) % VOCAB]
    [(_, is_greedy), (_, not_greedy)] = score_continuations(small_model, [(context, greedy), (context, changed)])
    assert is_greedy and not not_greedy


def test_rolling_loglikelihood_predicts_every_token_once_with_full_context(small_model):
    doc = torch.randint(0, VOCAB - 1, (3 * BLOCK + 5,), generator=torch.Generator().manual_seed(2)).tolist()
    eot = VOCAB - 1
    windows = rolling_windows(doc, eot, BLOCK)
    assert sum(len(c) for _, c in windows) == len(doc) and [t for _, c in windows for t in c] == doc
    # Directly: non-overlapping windows of [EOT] + doc; the last slides back to a full block and scores only new tokens.
    tokens, expected, done = [eot] + doc, 0.0, 0
    while done < len(doc):
        end = min(done + BLOCK, len(doc))  # doc tokens done..end are scored, at positions done+1..end of tokens
        start = max(0, end - BLOCK)
        expected += direct_logprobs(small_model, tokens[start : end + 1])[-(end - done):].sum().item()
        done = end
    short = doc[:5]
    [long_ll, short_ll] = rolling_loglikelihood(small_model, [doc, short], eot, batch_size=3)
    assert long_ll == pytest.approx(expected, abs=1e-4)
    assert short_ll == pytest.approx(direct_logprobs(small_model, [eot] + short).sum().item(), abs=1e-5)
    assert rolling_loglikelihood(small_model, [doc, short], eot, batch_size=1) == pytest.approx([long_ll, short_ll], abs=1e-5)


# --- through the harness ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm_eval():
    return pytest.importorskip("lm_eval")


def instance(kind, args):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_harness_model_answers_each_request_kind(lm_eval, small_model):
    tok = CharTokenizer("".join(chr(97 + i) for i in range(VOCAB - 2)) + " ")  # 99 characters + EOT = VOCAB
    lm = harness_model(small_model, tok, batch_size=2)
    [(ll, _), (ll_empty, _)] = lm.loglikelihood([instance("loglikelihood", ("abc ", "de")),
                                                 instance("loglikelihood", ("", "de"))])
    # The context's trailing space moves to the continuation, and an empty context is the EOT token.
    assert ll == pytest.approx(direct_logprobs(small_model, tok.encode("abc de"))[-3:].sum().item(), abs=1e-5)
    assert ll_empty == pytest.approx(direct_logprobs(small_model, [tok.eot_id] + tok.encode("de")).sum().item(), abs=1e-5)
    [rolled] = lm.loglikelihood_rolling([instance("loglikelihood_rolling", ("abcdefgh",))])
    assert rolled == pytest.approx(direct_logprobs(small_model, [tok.eot_id] + tok.encode("abcdefgh")).sum().item(), abs=1e-5)
    [text, stopped] = lm.generate_until([instance("generate_until", ("abc", {"until": [], "max_gen_toks": 6})),
                                         instance("generate_until", ("abc", {"until": ["a"], "max_gen_toks": 40}))])
    assert len(text) <= 6 and "a" not in stopped
    message = one_line(ValueError, lm.loglikelihood, [instance("loglikelihood", ("abc", "Ω"))])
    assert "char tokenizer cannot encode the task's text" in message and "'Ω'" in message


MC_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""
ROLLING_TASK = """task: tiny_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
GENERATE_TASK = """task: tiny_answer
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
"""
QUESTIONS = [(f"Question {i}: what does ROMEO say?", ["Thou art", "I know not", "O, she doth", "What light"], i % 4)
             for i in range(8)]
TEXTS = [f"ROMEO: but soft, what light through yonder window breaks, {i} times? " * (1 + i) for i in range(6)]  # 15 to 90 tokens


def write_tasks(folder, cache) -> None:
    folder.mkdir()
    rows = {"choice": [{"question": q, "choices": c, "label": a} for q, c, a in QUESTIONS],
            "text": [{"text": text} for text in TEXTS],
            "answer": [{"question": f"KING: say {i}\n", "answer": "the king"} for i in range(6)]}
    for name, template in (("choice", MC_TASK), ("text", ROLLING_TASK), ("answer", GENERATE_TASK)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[name]))
        (folder / f"{name}.yaml").write_text(template.format(data=folder / f"{name}.jsonl", cache=cache))


@pytest.fixture(scope="module")
def gpt2_ckpt(gpt2_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("harness_run")
    cfg = tiny_config(gpt2_data, max_steps=4)
    cfg.checkpoint.every_steps = 4
    train(cfg, run)
    return run / "checkpoints" / "step_00000004"


@pytest.mark.slow  # the harness indexes its thousands of task YAMLs for the unknown name
def test_eval_cli_runs_local_harness_tasks_beside_val(lm_eval, gpt2_ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_tasks(tmp_path / "tasks", tmp_path / "hf_cache")
    indexed = []  # the harness's own tasks are indexed (seconds) only for a name the included folder lacks
    real_task_manager = harness.task_manager
    monkeypatch.setattr(harness, "task_manager", lambda folders, defaults=True: indexed.append(defaults)
                        or real_task_manager(folders, defaults))
    args = ["eval", "--ckpt", str(gpt2_ckpt), "--device", "cpu", "--dtype", "float32", "--batch-size", "5", "--limit", "4",
            "--lm-eval-include", str(tmp_path / "tasks")]
    assert cli.main([*args, "--tasks", "val,lm-eval:tiny_choice,tiny_text,tiny_answer"]) == 0
    out = capsys.readouterr().out
    saved = json.loads((gpt2_ckpt / "eval.json").read_text())["tasks"]
    assert set(saved) == {"val", "lm-eval:tiny_choice", "lm-eval:tiny_text", "lm-eval:tiny_answer"}
    choice = saved["lm-eval:tiny_choice"]
    assert choice["n"] == 4 and set(choice["metrics"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert saved["lm-eval:tiny_text"]["metrics"]["bits_per_byte"] > 0 and "exact_match" in saved["lm-eval:tiny_answer"]["metrics"]
    assert f"{choice['metrics']['acc_norm']:.4f}" in out and "lm-eval:tiny_choice acc_norm" in out

    # The harness's accuracy is ours: the choice with the highest summed log-prob after "question" + " ".
    model, _, _ = load_for_inference(gpt2_ckpt)
    tok = GPT2Tokenizer()
    correct = 0
    for question, choices, label in QUESTIONS[:4]:
        scores = score_continuations(model, [(tok.encode(question), tok.encode(" " + c)) for c in choices])
        correct += max(range(4), key=lambda k: scores[k][0]) == label
    assert choice["metrics"]["acc"] == correct / 4
    # Its bits per byte are our rolling log-likelihood (over windows of block_size 32) in bits, per UTF-8 byte.
    logprobs = rolling_loglikelihood(model, [tok.encode(t) for t in TEXTS[:4]], tok.eot_id)
    n_bytes = sum(len(t.encode("utf-8")) for t in TEXTS[:4])
    assert saved["lm-eval:tiny_text"]["metrics"]["bits_per_byte"] == pytest.approx(-sum(logprobs) / n_bytes / math.log(2),
                                                                                    rel=1e-5)

    # A rerun of one task keeps the others' results; a task the harness does not know is a one-line error.
    assert cli.main([*args, "--tasks", "lm-eval:tiny_choice"]) == 0
    assert set(json.loads((gpt2_ckpt / "eval.json").read_text())["tasks"]) == set(saved)
    capsys.readouterr()
    assert cli.main([*args, "--tasks", "lm-eval:no_such_task"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "unknown lm-eval task 'no_such_task'" in lines[-1], lines
    assert indexed == [False, False, False, True]


def test_missing_harness_is_a_one_line_error(gpt2_ckpt, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` meets when it is not installed
    assert cli.main(["eval", "--ckpt", str(gpt2_ckpt), "--device", "cpu", "--tasks", "lm-eval:arc_easy"]) == 1
    assert capsys.readouterr().err.strip() == f"error: {MISSING}"


def test_task_list_parsing():
    from gpt2train.eval.run import parse_tasks

    assert parse_tasks("val,lm-eval:arc_easy,piqa,hellaswag,lm-eval:hellaswag") == [
        "val", "lm-eval:arc_easy", "lm-eval:piqa", "hellaswag", "lm-eval:hellaswag"]
    assert parse_tasks("val,piqa") == ["val", "piqa"]  # a bare piqa before any lm-eval: item is the suite's own
    assert "unknown task 'lambada_openai'" in one_line(ValueError, parse_tasks, "val,lambada_openai")
