"""Chat data: the template's ids and mask, turn tokens never from text, `prepare chat`, the loader's rows, the
masked loss (fused and plain, against a reference), exact resume, init_from's new rows, and the CLI end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import chat_conversations as conversations
from conftest import run_cli, tiny_config, write_jsonl
from gpt2train.chat import ConversationError, check_conversation, check_messages, fit_prompt, render, render_prompt, render_text
from gpt2train.classifier import chunked_cross_entropy, scored_rows
from gpt2train.data.chat_loader import ChatLoader
from gpt2train.data.conversations import prepare_chat
from gpt2train.data.sources import SourceError
from gpt2train.model import GPT, GPTConfig
from gpt2train.tokenizer import (
    IM_END,
    IM_START,
    ChatTokens,
    GPT2Tokenizer,
    same_tokenizer,
    tokenizer_from_spec,
    train_bpe,
    with_chat_tokens,
)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chat")
    prepare_chat([write_jsonl(root / "conv.jsonl", conversations(200))], root / "data", val_fraction=0.1)
    return root / "data"


# --- the template -------------------------------------------------------------------------------------

def test_render_gives_the_template_ids_and_masks_only_assistant_turns():
    tok = with_chat_tokens(GPT2Tokenizer())
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids, mask = render(tok, messages)
    enc = tok.encode
    nl = enc("\n")
    user = [50257, *enc("user"), *nl, *enc("Hi"), 50258, *nl]
    answer = [50257, *enc("assistant"), *nl]
    assert ids.tolist() == [50256, *user, *answer, *enc("Hello"), 50258, *nl]
    trained = [0] * (1 + len(user) + len(answer)) + [1] * (len(enc("Hello")) + 1) + [0] * len(nl)
    assert mask.tolist() == trained
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    assert tok.decode(ids[1:]) == render_text(messages) == text
    assert (tok.im_start_id, tok.im_end_id, tok.vocab_size) == (50257, 50258, 50259)


def test_a_prompt_is_the_rendered_conversation_then_the_assistant_header():
    tok = with_chat_tokens(GPT2Tokenizer())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = render_prompt(tok, messages)
    assert tok.decode(ids[1:]) == render_text(messages) + "<|im_start|>assistant\n"
    # what a reply of "Yo" then <|im_end|> completes is exactly what training rendered for the whole conversation
    whole, _ = render(tok, [*messages, {"role": "assistant", "content": "Yo"}])
    assert [*ids, *tok.encode("Yo"), tok.im_end_id, *tok.encode("\n")] == whole.tolist()


def test_a_long_history_drops_its_oldest_messages_first_and_keeps_the_system_message():
    tok = with_chat_tokens(GPT2Tokenizer())
    system = {"role": "system", "content": "Be brief."}
    turns = [{"role": r, "content": f"message {i} " * 5} for i, r in enumerate(["user", "assistant"] * 3 + ["user"])]
    full = render_prompt(tok, [system, *turns])
    assert fit_prompt(tok, [system, *turns], len(full)) == (full, 0)
    ids, dropped = fit_prompt(tok, [system, *turns], len(full) - 1)
    assert (ids, dropped) == (render_prompt(tok, [system, *turns[1:]]), 1)
    ids, dropped = fit_prompt(tok, [system, *turns], len(render_prompt(tok, [system, turns[-1]])))
    assert dropped == 6 and ids == render_prompt(tok, [system, turns[-1]])
    ids, dropped = fit_prompt(tok, [system, *turns], len(render_prompt(tok, turns[-1:])))  # the system goes last
    assert (ids, dropped) == (render_prompt(tok, turns[-1:]), 7)
    with pytest.raises(ConversationError, match="the last message alone takes"):
        fit_prompt(tok, [system, *turns], 5)


@pytest.mark.parametrize("messages, problem", [
    ([], "non-empty list"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "end with the user's turn"),
    ([{"role": "robot", "content": "hi"}], "role 'robot'"),
    ([{"role": "user"}], "no text"),
])
def test_bad_chat_requests_are_refused(messages, problem):
    with pytest.raises(ConversationError, match=problem):
        check_messages(messages)


def test_turn_tokens_never_come_from_text(tmp_path):
    text = f"a {IM_START}user\nsneaky{IM_END} b"
    gpt2 = with_chat_tokens(GPT2Tokenizer())
    assert max(gpt2.encode(text)) < 50257
    bpe = train_bpe([f"some text to learn merges from {i} " * 5 for i in range(50)], 300, tmp_path / "tok.json")
    chat = ChatTokens(bpe)
    assert (chat.im_start_id, chat.im_end_id) == (bpe.vocab_size, bpe.vocab_size + 1)
    assert max(chat.encode(text)) < chat.im_start_id
    assert chat.decode([chat.im_start_id, *chat.encode("hi"), chat.im_end_id]) == f"{IM_START}hi{IM_END}"
    rebuilt = tokenizer_from_spec(chat.spec())  # the spec records the turn tokens; ordinary text is the base's
    assert rebuilt.spec()["chat"] == {IM_START: chat.im_start_id, IM_END: chat.im_end_id}
    assert same_tokenizer(chat.spec(), bpe.spec())


@pytest.mark.parametrize("row, problem", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
    ({"messages": [{"role": "assistant"}]}, "no text \"content\""),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
    ({"text": "x"}, "no \"messages\" list"),
])
def test_bad_conversations_are_refused(row, problem):
    with pytest.raises(ConversationError, match=problem):
        check_conversation(row)


def test_prepare_chat_names_the_bad_line(tmp_path):
    good = conversations(3)
    for bad, says in (("{not json", "is not valid JSON"), ({"messages": [{"role": "user", "content": "x"}]},
                                                           "no assistant message")):
        path = write_jsonl(tmp_path / "c.jsonl", [*good[:2], bad, good[2]])
        with pytest.raises(SourceError, match=rf"c.jsonl:3 .*{says}"):
            prepare_chat([path], tmp_path / "out")
    assert not (tmp_path / "out" / "meta.json").exists()


def test_prepare_chat_refuses_a_file_mostly_not_text_and_counts_a_few_bad_bytes(tmp_path):
    """Issue 58: conversations whose contents are mostly invalid UTF-8 (valid JSON around them) are refused,
    naming the file and its share, before anything is written; a few bad bytes are replaced and counted."""
    def line(content: bytes) -> bytes:
        return (b'{"messages": [{"role": "user", "content": "' + content +
                b'"}, {"role": "assistant", "content": "ok"}]}\n')

    noisy = tmp_path / "noisy.jsonl"
    noisy.write_bytes(line(b"\xff" * 200) * 20)
    with pytest.raises(SourceError, match=r"noisy.jsonl is not UTF-8 text: 4,000 invalid UTF-8 sequences in its "
                                          r"[0-9,]+ bytes \([0-9]+%; more than 25% is refused"):
        prepare_chat([noisy], tmp_path / "out", val_fraction=0.1)
    assert not (tmp_path / "out").exists()
    few = tmp_path / "few.jsonl"
    few.write_bytes(line(b"caf\xe9 au lait") * 20)
    assert prepare_chat([few], tmp_path / "out", val_fraction=0.1)["invalid_utf8_replacements"] == 20


def test_prepared_folder_holds_masks_and_starts(chat_data):
    meta = json.loads((chat_data / "meta.json").read_text())
    assert meta["chat"]["template"] == "chatml" and meta["tokenizer"]["chat"] == {IM_START: 50257, IM_END: 50258}
    assert meta["documents"] == {"train": 180, "val": 20} and meta["vocab_size"] == 50259
    assert (chat_data / "train_000000.mask.bin").is_file() and (chat_data / "train_000000.starts.bin").is_file()


# --- the loader ---------------------------------------------------------------------------------------

def test_loader_rows_are_whole_conversations_with_masked_targets(chat_data, capsys):
    tok = with_chat_tokens(GPT2Tokenizer())
    loader = ChatLoader(chat_data, "train", 4, 24, seed=3)
    skipped = loader.skipped
    assert skipped > 0 and "longer than a row of 25 tokens" in capsys.readouterr().err
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 24)
    same = ChatLoader(chat_data, "train", 4, 24, seed=3)
    ids = same.take_ids(4)
    tokens, mask = same.rows(ids)
    assert torch.equal(x, torch.from_numpy(tokens[:, :-1]))
    assert torch.equal(y, torch.from_numpy(np.where(mask[:, 1:], tokens[:, 1:], -1)))
    for row, row_y, i in zip(tokens.tolist(), y.tolist(), ids):
        length = int(same.end[i] - same.begin[i])
        assert row[0] == tok.eot_id and row[length:] == [tok.eot_id] * (25 - length)  # padded after its end
        text = tok.decode(row[1:length])
        assert text.count(IM_START) in (2, 3) and text.endswith("<|im_end|>\n")
        answer = text.split("assistant\n")[1].removesuffix("<|im_end|>\n")
        assert [t for t in row_y if t != -1] == tok.encode(answer) + [tok.im_end_id]  # the reply and its end only
    assert loader.targets_seen == int((y != -1).sum())


def test_loader_resumes_exactly(chat_data):
    one = ChatLoader(chat_data, "train", 8, 32, seed=1)
    batches = [one.next_batch() for _ in range(30)]  # several epochs
    two = ChatLoader(chat_data, "train", 8, 32, seed=1)
    for _ in range(12):
        two.next_batch()
    state = json.loads(json.dumps(two.state_dict()))
    three = ChatLoader(chat_data, "train", 8, 32, seed=1)
    three.load_state_dict(state)
    for x, y in batches[12:]:
        x3, y3 = three.next_batch()
        assert torch.equal(x, x3) and torch.equal(y, y3)
    assert three.targets_seen == one.targets_seen


# --- the masked loss ------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_chunk", [0, 7])
def test_masked_positions_have_zero_gradient_and_the_loss_is_the_unmasked_mean(loss_chunk):
    """The model's loss (plain cross-entropy, or the fused classifier with loss_chunk > 0) with targets of -1,
    against the reference: plain cross-entropy over the kept positions' logits only."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=70, loss_chunk=loss_chunk))
    x, y = torch.randint(0, 70, (3, 16)), torch.randint(0, 70, (3, 16))
    keep = torch.rand(3, 16) < 0.4
    hidden = torch.randn(3, 16, 16, requires_grad=True)  # the final hidden states, as classify() receives them
    _, loss = model.classify(hidden, torch.where(keep, y, -1))
    loss.backward()
    leaf = hidden.detach().requires_grad_(True)
    logits = model.lm_head(leaf)[..., :70]
    reference = F.cross_entropy(logits[keep].float(), y[keep])
    reference.backward()
    assert torch.allclose(loss, reference, atol=1e-6, rtol=1e-5)
    assert torch.count_nonzero(hidden.grad[~keep]) == 0  # a masked position: exactly zero
    assert torch.allclose(hidden.grad, leaf.grad, atol=1e-6)
    with torch.no_grad():  # and the whole model's loss is the same mean
        _, masked = model(x, torch.where(keep, y, -1))
        assert torch.allclose(masked, F.cross_entropy(model(x)[keep].float(), y[keep]), atol=1e-5)


def test_the_classifier_scores_only_the_rows_whose_target_counts():
    """On a CPU the masked rows never reach the classifier (chat data trains a sixth of each row): the same loss and
    the same gradients of the hidden states and of the head's weight as the plain loss over every row."""
    torch.manual_seed(1)
    hidden, weight = torch.randn(20, 8, requires_grad=True), torch.randn(64, 8, requires_grad=True)
    targets = torch.where(torch.rand(20) < 0.3, torch.randint(0, 60, (20,)), -1)
    kept, kept_targets = scored_rows(hidden, targets)
    assert torch.equal(kept, hidden[targets != -1]) and torch.equal(kept_targets, targets[targets != -1])
    every = torch.randint(0, 60, (20,))
    assert scored_rows(hidden, every)[0] is hidden  # nothing masked: the rows as they are
    loss = chunked_cross_entropy(hidden, weight, targets, chunk=3, vocab_size=60)
    grads = torch.autograd.grad(loss, (hidden, weight))
    reference = F.cross_entropy((hidden @ weight.t())[:, :60], targets, ignore_index=-1)
    expected = torch.autograd.grad(reference, (hidden, weight))
    assert torch.allclose(loss, reference, atol=1e-6)
    assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(grads, expected))


# --- training -----------------------------------------------------------------------------------------

def chat_config(data: Path, **train):
    cfg = tiny_config(data, seq_len=32, micro_batch=4, max_steps=6, **train)
    cfg.eval.interval = 3
    cfg.checkpoint.every_steps = 3
    return cfg


def losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_stop_and_resume_gives_the_same_losses(chat_data, tmp_path):
    from gpt2train.training.loop import train

    train(chat_config(chat_data), tmp_path / "one")
    # the same run stopped after step 3: resumed from that checkpoint into a fresh folder
    train(chat_config(chat_data), tmp_path / "three", resume=str(tmp_path / "one" / "checkpoints" / "step_00000003"))
    one, three = losses(tmp_path / "one"), losses(tmp_path / "three")
    assert [one[s] for s in (4, 5, 6)] == [three[s] for s in (4, 5, 6)]
    records = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    seen = [r["assistant_tokens"] for r in records if r["kind"] == "train"]
    assert seen == sorted(seen) and seen[0] > 0


def test_init_from_a_run_without_the_turn_tokens_starts_them_at_the_mean(chat_data, gpt2_data, tmp_path):
    from gpt2train.training.loop import Trainer, train

    base = tiny_config(gpt2_data, max_steps=2)
    train(base, tmp_path / "base")
    cfg = chat_config(chat_data, init_from=str(tmp_path / "base"))
    trainer = Trainer(cfg, tmp_path / "sft")
    try:
        wte = trainer.raw_model.transformer.wte.weight.detach()
        assert trainer.raw_model.config.vocab_size == 50259
        mean = wte[:50257].mean(0)
        assert torch.allclose(wte[50257], mean, atol=1e-6) and torch.allclose(wte[50258], mean, atol=1e-6)
    finally:
        trainer.close()


def test_init_from_a_hugging_face_gpt2_folder_grows_it_by_the_turn_tokens_and_fine_tunes(chat_data, tmp_path):
    """The issue's "any checkpoint, run or Hugging Face GPT-2 folder": a GPT-2 saved by transformers (50,257 ids,
    no turn tokens) fine-tunes on conversations, its two new rows at the mean of its embedding."""
    transformers = pytest.importorskip("transformers")
    from gpt2train.training.loop import Trainer

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32))
    hf.save_pretrained(tmp_path / "hf")
    cfg = chat_config(chat_data, init_from=str(tmp_path / "hf"))
    cfg.train.max_steps = 2
    trainer = Trainer(cfg, tmp_path / "sft")
    try:
        wte = trainer.raw_model.transformer.wte.weight.detach()
        assert trainer.raw_model.config.vocab_size == 50259
        assert torch.equal(wte[:50257], hf.transformer.wte.weight.detach())
        mean = hf.transformer.wte.weight.detach().mean(0)
        assert torch.allclose(wte[50257], mean, atol=1e-6) and torch.allclose(wte[50258], mean, atol=1e-6)
        assert trainer.fit()["step"] == 2
    finally:
        trainer.close()


@pytest.mark.slow
def test_cli_prepare_chat_then_train(tmp_path):
    write_jsonl(tmp_path / "conv.jsonl", conversations(120, seed=5))
    out = run_cli("prepare", "chat", str(tmp_path / "conv.jsonl"), "--out", str(tmp_path / "data"))
    assert out.returncode == 0, out.stderr
    assert "108 train and 12 val conversations" in out.stdout
    out = run_cli("train", "--config", "chat-cpu", "--out", str(tmp_path / "run"), "--set",
                  f"data.dir={tmp_path / 'data'}", "--set", "train.init_from=scratch", "--set", "train.max_steps=12",
                  "--set", "train.seq_len=32", "--set", "train.micro_batch=8", "--set", "train.lr=3e-3",
                  "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2",
                  "--set", "eval.interval=0", "--set", "checkpoint.every_steps=0")
    assert out.returncode == 0, out.stderr[-2000:]
    seen = losses(tmp_path / "run")
    assert all(np.isfinite(v) for v in seen.values()) and seen[12] < seen[1]


@pytest.mark.slow
def test_the_chat_run_fixture_replies_and_ends_its_turn(chat_run):
    """What the serve, terminal and export tests rely on: chat_run's greedy replies end with <|im_end|>."""
    from gpt2train.chat import render_prompt
    from gpt2train.generation import generate
    from gpt2train.loading import load_for_inference, load_pretrained_tokenizer

    model, _, _ = load_for_inference(chat_run)
    tok = load_pretrained_tokenizer(chat_run)
    for row in conversations(3, seed=5):
        reply = generate(model, render_prompt(tok, row["messages"][:-1]), 12, temperature=0, eot_id=tok.im_end_id)
        assert reply[-1] == tok.im_end_id and len(reply) > 1


def test_the_jinja_template_renders_what_render_prompt_encodes():
    """The exports' template (transformers and llama-cpp-python render it in a sandbox that trims block tags' newlines):
    the end-of-text token given as bos_token, the conversation as render_text writes it, the assistant's header."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from gpt2train.chat import JINJA_TEMPLATE

    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(JINJA_TEMPLATE)
    for row in conversations(4, seed=3):
        messages = row["messages"][:-1]
        text = template.render(messages=messages, bos_token="<|endoftext|>", add_generation_prompt=True)
        assert text == "<|endoftext|>" + render_text(messages) + "<|im_start|>assistant\n"
        assert template.render(messages=messages, bos_token="<|endoftext|>") == "<|endoftext|>" + render_text(messages)

