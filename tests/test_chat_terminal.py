"""`gpt2train chat`: each printed reply is the greedy generate() of fit_prompt's ids of the conversation so far
(the reply before it included), the history cropped and reset as said, a model without the turn tokens refused,
and Ctrl-C a clean 130. One subprocess reads a real pipe; the rest runs main() in-process on chat_run."""

from __future__ import annotations

import io

import pytest

from conftest import random_checkpoint, run_cli
from gpt2train.chat import fit_prompt
from gpt2train.chat_terminal import ChatSession
from gpt2train.cli import main
from gpt2train.generation import generate
from gpt2train.loading import load_for_inference, load_pretrained_tokenizer


@pytest.fixture(scope="module")
def chat_model(chat_run):
    model, _, _ = load_for_inference(chat_run)
    return model, load_pretrained_tokenizer(chat_run)


def expected_replies(chat_model, turns: list[str | None], max_tokens: int, system: str | None = None):
    """The reference: per user line (None: /reset), the greedy reply to fit_prompt's ids of the history, and how
    many messages fit_prompt dropped."""
    model, tok = chat_model
    opening = [{"role": "system", "content": system}] if system else []
    history, replies, drops = list(opening), [], []
    for text in turns:
        if text is None:
            history = list(opening)
            continue
        history.append({"role": "user", "content": text})
        ids, dropped = fit_prompt(tok, history, budget=model.config.block_size - max_tokens)
        new = generate(model, ids, max_tokens, temperature=0, eot_id=tok.im_end_id)
        reply = tok.decode([t for t in new if t != tok.im_end_id])
        history.append({"role": "assistant", "content": reply})
        replies.append(reply)
        drops.append(dropped)
    return replies, drops, history


@pytest.mark.slow
def test_each_reply_is_the_greedy_reply_to_the_history_so_far(chat_run, chat_model):
    turns = ["apple river", "stone lamp"]
    replies, drops, history = expected_replies(chat_model, turns, max_tokens=4)
    assert drops == [0, 0], "the second prompt must hold the first reply: shorter lines, or a smaller --max-tokens"
    assert all(replies) and history[1]["content"] == replies[0]

    r = run_cli("chat", "--ckpt", str(chat_run), "--temperature", "0", "--max-tokens", "4", "--dtype", "float32",
                input="".join(t + "\n" for t in turns))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "".join(reply + "\n" for reply in replies)  # no "you> " from a pipe, no turn token
    assert "you>" not in r.stdout + r.stderr and "cropped" not in r.stderr and "Traceback" not in r.stderr

    # the library's session holds that history: the first reply is in the second prompt
    session = ChatSession(*chat_model, max_tokens=4, temperature=0)
    for text, reply in zip(turns, replies):
        assert session.send(text) == 0
        assert "".join(session.reply()) == reply and session.finished
    assert session.messages == history


def test_history_is_cropped_with_a_notice_and_reset_keeps_the_system_message(chat_run, chat_model, monkeypatch, capsys):
    turns = ["reverse: apple river", "reverse: stone lamp", None, "reverse: tiger music"]
    replies, drops, _ = expected_replies(chat_model, turns, max_tokens=8, system="be brief")
    assert drops[0] == 0 and drops[1] > 0 and drops[2] == 0
    lines = ["reverse: apple river", "reverse: stone lamp", "/reset", "", "word " * 40, "reverse: tiger music",
             "/exit", "never read"]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    status = main(["chat", "--ckpt", str(chat_run), "--temperature", "0", "--max-tokens", "8", "--dtype", "float32",
                   "--system", "be brief"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert out == "".join(reply + "\n" for reply in replies)  # the blank line and the long one got no reply
    notices = [line for line in err.splitlines() if line.startswith("(")]
    assert notices == [f"(history cropped: the oldest {drops[1]} messages no longer fit the 32-token context, 8 of "
                       "its tokens kept for the reply)", "(history cleared)", notices[2]]
    assert notices[2].startswith("(not sent: the last message alone takes") and "write a shorter message" in notices[2]


def test_a_model_not_fine_tuned_on_conversations_is_refused(tmp_path, capsys):
    run = tmp_path / "plain"
    random_checkpoint(run, 50304, {"kind": "gpt2"})
    assert main(["chat", "--ckpt", str(run)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: {run} was not fine-tuned on conversations") and "gpt2train prepare chat" in err
    assert "docs/chat.md" in err


def test_max_tokens_that_leave_no_room_are_a_usage_error(chat_run, capsys):
    assert main(["chat", "--ckpt", str(chat_run), "--max-tokens", "32"]) == 2
    assert "give at most 31" in capsys.readouterr().err


class CtrlC(io.StringIO):
    def __iter__(self):
        raise KeyboardInterrupt


def test_ctrl_c_exits_130_without_a_traceback(chat_run, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", CtrlC())
    assert main(["chat", "--ckpt", str(chat_run)]) == 130
    assert "Traceback" not in capsys.readouterr().err
