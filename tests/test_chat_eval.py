"""`gpt2train eval` on chat data (the assistant tokens' val loss, the exact match of greedy replies) and the
offline demo's conversations (`prepare chat --demo`)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
import torch

from conftest import chat_conversations, random_checkpoint, run_cli, run_here
from gpt2train.chat import render, render_prompt
from gpt2train.cli import main
from gpt2train.config import load_config
from gpt2train.data.chat_demo import (
    DEMOS,
    KINDS,
    NAMES,
    ORDINALS,
    PLACES,
    THINGS,
    demo_conversations,
    most_conversations,
)
from gpt2train.data.chat_loader import ChatLoader, split_conversations
from gpt2train.data.prepared import load_meta
from gpt2train.eval.chat import exact_match, held_out_replies, last_reply, reply_text
from gpt2train.eval.run import evaluate_checkpoint
from gpt2train.generation import generate
from gpt2train.loading import load_for_inference, load_pretrained_tokenizer, with_vocabulary
from gpt2train.runlog import load_metrics
from gpt2train.tokenizer import tokenizer_from_name, with_chat_tokens


def facts(row: dict) -> tuple[str, str]:
    """The (name, place) a demo conversation's first message states."""
    first = row["messages"][0]["content"]
    return next(n for n in NAMES if f" {n}" in first), next(p for p in PLACES if f" {p}." in first)


def test_demo_conversations_are_seeded_and_need_what_the_user_said():
    rows = demo_conversations("recall", 400, seed=7)
    assert rows == demo_conversations("recall", 400, seed=7) and rows != demo_conversations("recall", 400, seed=8)
    pairs = [facts(row) for row in rows]
    assert len(set(pairs)) == len(pairs)  # no pair twice: a held-out one is one training never saw
    for row, (name, place) in zip(rows, pairs):
        answer = row["messages"][-1]["content"]
        assert answer in (f"Your name is {name}.", f"You live in {place}.")
    assert {len(row["messages"]) for row in rows} == {2, 4}  # one turn, or two with the greeting between
    with pytest.raises(ValueError, match="1 to"):
        demo_conversations("recall", most_conversations() + 1)


def test_prepare_chat_demo_writes_a_split_whose_held_out_pairs_are_unseen(tmp_path):
    r = run_cli("prepare", "chat", "--demo", "recall", "--conversations", "200", "--seed", "3", "--out",
                str(tmp_path / "chat"))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (tmp_path / "chat" / "recall.jsonl").read_text().splitlines()]
    assert rows == demo_conversations("recall", 200, seed=3)
    meta = load_meta(tmp_path / "chat")
    assert meta["documents"] == {"train": 180, "val": 20}
    tok = with_chat_tokens(tokenizer_from_name("gpt2"))
    text = {split: [tok.decode(ids) for ids, _ in split_conversations(tmp_path / "chat", split)]
            for split in ("train", "val")}
    held_out = set(range(9, 200, 10))  # prepare's rule: every (1/F)-th conversation, the 10th, 20th, ...
    rendered = [tok.decode(render(tok, row["messages"])[0]) for row in rows]
    assert text["val"] == [rendered[i] for i in sorted(held_out)]
    assert text["train"] == [rendered[i] for i in range(200) if i not in held_out]
    train_pairs = {facts(rows[i]) for i in range(200) if i not in held_out}
    assert not {facts(rows[i]) for i in held_out} & train_pairs


def test_recall_is_the_same_file_it_always_was():
    """The demo's figures in docs/chat.md were measured on these conversations: the other tasks must not move them."""
    text = json.dumps(demo_conversations("recall", 5000, seed=0))
    assert hashlib.sha256(text.encode()).hexdigest() == "05bb86ef67923e9b3442938e383337338eea4a0f462754af2774e39f0ad848c6"


def stated(row: dict) -> tuple:
    """What a pick or count conversation's user states, before the question: the list of things, or the
    (number, kind) pairs."""
    first = row["messages"][0]["content"]
    statement = first[: first.index(".") + 1]
    numbers = re.findall(r"(\d+) ([a-z]+)", statement)
    if numbers:
        return tuple((int(n), kind) for n, kind in numbers)
    return tuple(word for word in re.findall(r"[a-z]+", statement) if word in THINGS)


def expected_answer(row: dict) -> str:
    """The answer worked out here from the statement and the question, independently of the generator."""
    facts, asked = stated(row), row["messages"][-2]["content"]
    question = asked[asked.index(".") + 1:] if len(row["messages"]) == 2 else asked  # after the statement
    if isinstance(facts[0], tuple):  # count
        kind = next(k for k in KINDS if re.search(rf"\b{k}\b", question))
        number = next(n for n, k in facts if k == kind)
        return f"There are {number} {kind}."
    if "last" in question:
        return f"The last one is the {facts[-1]}."
    ordinal = next((o for o in ORDINALS if o in question), None)
    if ordinal:
        return f"The {ordinal} one is the {facts[ORDINALS.index(ordinal)]}."
    before = next(t for t in THINGS if re.search(rf"the {t}\?", question))
    return f"After the {before} comes the {facts[facts.index(before) + 1]}."


@pytest.mark.parametrize("demo", ["pick", "count"])
def test_pick_and_count_are_seeded_and_answered_from_what_the_user_said(demo):
    rows = demo_conversations(demo, 600, seed=7)
    assert rows == demo_conversations(demo, 600, seed=7) and rows != demo_conversations(demo, 600, seed=8)
    statements = [stated(row) for row in rows]
    assert len(set(statements)) == len(rows)  # nothing stated twice: a held-out one is one training never saw
    for row, facts in zip(rows, statements):
        assert 2 <= len(facts) <= 5 and len(set(facts)) == len(facts)
        if demo == "count":  # one number per kind, each different: the asked kind's number is the only right one
            assert len({n for n, _ in facts}) == len(facts) and len({k for _, k in facts}) == len(facts)
        assert row["messages"][-1]["content"] == expected_answer(row)
    # every way of asking comes up, one turn and two
    assert {len(row["messages"]) for row in rows} == {2, 4}
    if demo == "pick":
        answers = " ".join(row["messages"][-1]["content"] for row in rows)
        assert all(f"The {o} one" in answers for o in ORDINALS) and "The last one" in answers and "After the" in answers


@pytest.mark.parametrize("demo", DEMOS)
def test_every_demo_conversation_fits_a_row_of_chat_cpu(demo):
    """chat-cpu's rows hold seq_len + 1 tokens: a longer conversation would be skipped, not trained or scored."""
    tok = with_chat_tokens(tokenizer_from_name("gpt2"))
    row_tokens = load_config("chat-cpu").train.seq_len + 1
    longest = max(len(render(tok, row["messages"])[0]) for row in demo_conversations(demo, 2000, seed=1))
    assert 30 < longest <= row_tokens


@pytest.mark.parametrize("demo", ["pick", "count"])
def test_prepare_chat_demo_holds_out_statements_training_never_saw(tmp_path, demo):
    r = run_here("prepare", "chat", "--demo", demo, "--conversations", "300", "--seed", "2", "--out",
                 str(tmp_path / "chat"))
    assert r.returncode == 0, r.stderr
    assert f"300 conversations of the {demo} demo" in r.stdout
    rows = [json.loads(line) for line in (tmp_path / "chat" / f"{demo}.jsonl").read_text().splitlines()]
    assert rows == demo_conversations(demo, 300, seed=2)
    assert load_meta(tmp_path / "chat")["documents"] == {"train": 270, "val": 30}
    tok = with_chat_tokens(tokenizer_from_name("gpt2"))
    val = [tok.decode(ids) for ids, _ in split_conversations(tmp_path / "chat", "val")]
    held_out = set(range(9, 300, 10))
    assert val == [tok.decode(render(tok, rows[i]["messages"])[0]) for i in sorted(held_out)]
    train = {stated(rows[i]) for i in range(300) if i not in held_out}
    assert not {stated(rows[i]) for i in held_out} & train


@pytest.mark.parametrize("args,problem", [
    (["x.jsonl", "--demo", "recall"], "(one of the three)"),
    (["--hf", "x", "--demo", "recall"], "(one of the three)"),
    ([], "(one of the three)"),
    (["x.jsonl", "--seed", "1"], "read only with --demo"),
    (["--demo", "recall", "--conversations", "999999"], "more than the recall demo makes"),
    (["--demo", "count", "--conversations", "999999"], "more than the count demo makes"),
])
def test_prepare_chat_demo_usage_errors(tmp_path, args, problem, capsys):
    assert main(["prepare", "chat", *args, "--out", str(tmp_path / "chat")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and problem in err[0], err


def test_last_reply_is_render_prompt_of_the_messages_before_it_and_the_message():
    tok = with_chat_tokens(tokenizer_from_name("gpt2"))
    for row in [*chat_conversations(4, seed=2), *demo_conversations("recall", 4, seed=1)]:
        messages = row["messages"]
        prompt, reference = last_reply(*render(tok, messages))
        assert prompt == render_prompt(tok, messages[:-1])
        assert reference == tok.encode(messages[-1]["content"])


def test_a_reply_counts_only_once_it_has_ended():
    tok = with_chat_tokens(tokenizer_from_name("gpt2"))
    ids = tok.encode(" You live in Rome. ")
    assert reply_text(tok, [*ids, tok.im_end_id, 11]) == "You live in Rome." and reply_text(tok, ids) is None


def test_exact_match_scores_each_greedy_reply_against_its_reference(chat_run):
    model, cfg, _ = load_for_inference(chat_run)
    tok = load_pretrained_tokenizer(chat_run)
    pairs, skipped = held_out_replies(cfg.data.dir, model.config.block_size, limit=6)
    assert skipped == 0 and len(pairs) == 6
    # By hand: each prompt's greedy reply, one at a time (generate, not the batch), up to its <|im_end|>
    replies = [generate(model, prompt, 20, temperature=0.0, eot_id=tok.im_end_id) for prompt, _ in pairs]
    assert all(reply[-1] == tok.im_end_id for reply in replies)
    # references: the model's own reply for the first four (they match), another text for the last two (they don't)
    wrong = tok.encode(" not this")
    pairs = [(prompt, reply[:-1] if i < 4 else wrong) for i, ((prompt, _), reply) in enumerate(zip(pairs, replies))]
    out = exact_match(model, tok, pairs, batch_size=4)  # two batches, prompts of several lengths
    assert (out["correct"], out["n"], out["exact_match"]) == (4, 6, 4 / 6)
    assert out["examples"][0]["reply"] == tok.decode(replies[0][:-1]).strip()


@pytest.mark.slow
def test_eval_on_chat_data_prints_the_masked_val_loss_the_run_logged_and_the_exact_match(chat_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(chat_run, run)  # eval writes eval.json: not into the shared fixture
    logged = [r for r in load_metrics(run) if r["kind"] == "val"][-1]
    r = run_cli("eval", "--ckpt", str(run), "--device", "cpu")  # chat data: val and chat by default
    assert r.returncode == 0, r.stderr
    record = json.loads((run / "checkpoints" / f"step_{logged['step']:08d}" / "eval.json").read_text())["tasks"]
    assert record["val"]["loss"] == pytest.approx(logged["val_loss"], rel=1e-6, abs=0)
    assert record["val"]["chat"] and record["val"]["windows"] == record["val"]["run_windows"]
    chat = record["chat"]
    assert chat["n"] == 20 and chat["correct"] == round(chat["exact_match"] * 20) and chat["turn_tokens"] == "the model's own"
    assert "conversations the run validates on (assistant tokens only" in r.stdout
    assert f"exact_match     {chat['exact_match']:.4f}  greedy replies to 20 held-out conversations" in r.stdout


@pytest.mark.slow
def test_a_model_without_the_turn_tokens_is_scored_with_them_at_the_mean(chat_run, tmp_path):
    data = chat_run.parent / "data"
    base = random_checkpoint(tmp_path / "base", 50257, {"kind": "gpt2"})
    model, _, _ = load_for_inference(base)
    grown = with_vocabulary(model, 50259)
    wte = grown.transformer.wte.weight.detach()
    mean = model.transformer.wte.weight.detach()[:50257].mean(0)
    assert grown.config.vocab_size == 50259 and torch.equal(wte[:50257], model.transformer.wte.weight[:50257])
    assert torch.allclose(wte[50257], mean) and torch.allclose(wte[50258], mean)
    assert with_vocabulary(grown, 50259) is grown

    record = evaluate_checkpoint(base, "val,chat", data_dir=str(data), device="cpu", progress=False)["tasks"]
    assert record["chat"]["turn_tokens"] == "added at the mean of the embedding" and record["chat"]["n"] == 20
    assert record["val"]["chat"] and record["val"]["tokens"] == ChatLoader(data, "val", 1, 32).targets.sum()
    r = run_cli("eval", "--ckpt", str(base), "--tasks", "chat", "--device", "cpu")  # its own data is not chat data
    assert r.returncode == 2 and "chat needs chat data" in r.stderr, r.stderr
