"""Real clients against `gpt2train serve` run as a command: the official `openai` package (completions and chat
completions, and streaming; chat with the session's chat_run) and `curl -N`, with the API key on; the bounds on a
request's work as the openai package is told them; and the command's one-line errors (a missing extra, a bad
checkpoint, a port in use, a bad --max-tokens)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from conftest import REPO, chat_conversations, run_cli
from gpt2train import cli
from gpt2train.bench.serve import free_port
from gpt2train.chat import fit_prompt, render_prompt
from gpt2train.counting import parameter_count
from gpt2train.loading import load_for_inference, load_pretrained, load_pretrained_tokenizer
from gpt2train.units import format_count
from serving import CONTEXT, continuation, greedy, save_tiny_run, tiny_model

KEY = "test-key-1"


@contextlib.contextmanager
def serving_command(run: Path, log_path: Path, *options: str) -> Iterator[str]:
    """`python -m gpt2train serve` of the run on a free port, float32, the API key set, and the options; yields its
    base URL."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "GPT2TRAIN_API_KEY": KEY}
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "gpt2train", "serve", "--ckpt", str(run), "--port", str(port),
                             "--dtype", "float32", "--max-batch", "4", *options], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server did not become healthy"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()  # SIGTERM: uvicorn shuts down gracefully, then exits by the signal
        proc.wait(timeout=30)
        log.close()
    assert "Application shutdown complete" in log_path.read_text()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tiny char-level model's server (no chat template), taking requests of up to 60 tokens, past its 48-token
    context (the window slides, as in sample); yields (base URL, run dir)."""
    run = tmp_path_factory.mktemp("serve") / "run"
    save_tiny_run(run)
    with serving_command(run, run.parent / "server.log", "--max-tokens", "60") as url:
        yield url, run


@pytest.fixture(scope="module")
def chat_server(chat_run, tmp_path_factory):
    """chat_run's server: a model fine-tuned on conversations with the template, replies of up to 16 tokens (half
    its context); yields its base URL."""
    with serving_command(chat_run, tmp_path_factory.mktemp("chat_serve") / "server.log", "--max-tokens", "16") as url:
        yield url


def expected(run, prompt: str, max_tokens: int) -> tuple[str, str]:
    return greedy(load_pretrained(run), prompt, max_tokens)


@pytest.mark.slow
def test_the_openai_package_completes_and_streams(server):
    url, run = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    want, reason = expected(run, "bad cafe", 20)
    done = client.completions.create(model="tiny", prompt="bad cafe", max_tokens=20, temperature=0)
    assert done.choices[0].text == want and done.choices[0].finish_reason == reason
    assert done.usage.prompt_tokens == len("bad cafe")
    assert done.usage.completion_tokens == len(want) + (reason == "stop")
    stream = client.completions.create(model="tiny", prompt="bad cafe", max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    assert [m.id for m in client.models.list()] == [str(run)]
    assert client.models.retrieve(str(run)).id == str(run)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    several = client.completions.create(model="tiny", prompt=["a", "b"], n=2, max_tokens=5, temperature=0.9, seed=3)
    assert sorted(c.index for c in several.choices) == [0, 1, 2, 3]


def test_past_the_context_the_openai_package_gets_what_sample_prints(server, capsys):
    """One context policy for sample and the API (docs/model.md, "Past the context"): max_tokens beyond the
    48-token context (up to the server's --max-tokens 60) slides the window, and a prompt longer than the context
    is cropped to its last 48 tokens, which sample says on stderr and the usage in prompt_tokens_cropped."""
    url, run = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    for prompt, n, cropped in (("bad cafe", 60, 0), ("dead beef " * 6, 10, 12)):
        done = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0)
        assert cli.main(["sample", "--ckpt", str(run), "--prompt", prompt, "--max-new-tokens", str(n),
                         "--temperature", "0", "--dtype", "float32", "--device", "cpu"]) == 0
        printed = capsys.readouterr()
        assert printed.out == prompt + done.choices[0].text + "\n"
        assert done.usage.completion_tokens == n and done.choices[0].finish_reason == "length"
        assert (done.usage.model_extra or {}).get("prompt_tokens_cropped", 0) == cropped
        assert done.usage.prompt_tokens == len(prompt) - cropped
        assert (f"the prompt's {len(prompt)} tokens are cropped to its last 48" in printed.err) == (cropped > 0)


def reply(run: Path, messages: list[dict], max_tokens: int, **sampling) -> tuple[str, str, int]:
    """generate's reply to the conversation: (its text up to <|im_end|>, finish_reason, tokens)."""
    model, _, _ = load_for_inference(run)
    tok = load_pretrained_tokenizer(run)
    return continuation(model, tok, render_prompt(tok, messages), max_tokens, tok.im_end_id, **sampling)


@pytest.mark.slow
def test_the_openai_package_chats_with_a_fine_tuned_model_whole_streamed_and_sampled(chat_server, chat_run):
    client = openai.OpenAI(base_url=f"{chat_server}/v1", api_key=KEY, max_retries=0)
    messages = chat_conversations(1, seed=5)[0]["messages"][:-1]  # the user's question, the assistant's turn next
    want, reason, tokens = reply(chat_run, messages, 12)
    assert reason == "stop"  # chat_run ends its turns
    done = client.chat.completions.create(model="chat", messages=messages, max_tokens=12, temperature=0)
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant"
    assert (done.choices[0].message.content, done.choices[0].finish_reason) == (want, reason)
    prompt_tokens = len(render_prompt(load_pretrained_tokenizer(chat_run), messages))
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_tokens, tokens)  # <|im_end|> counts

    chunks = list(client.chat.completions.create(model="chat", messages=messages, max_completion_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].usage.completion_tokens == tokens

    sampled = client.chat.completions.create(model="chat", messages=messages, max_tokens=12, temperature=1.0, n=2,
                                             seed=3)
    assert [c.message.content for c in sampled.choices] == [reply(chat_run, messages, 12, temperature=1.0,
                                                                  seed=3 + i)[0] for i in range(2)]
    assert client.models.list().data[0].model_extra["chat"] is True


def test_the_openai_package_gets_a_long_chat_with_its_oldest_messages_dropped(chat_server, chat_run):
    """The conversation must fit chat_run's 32-token context less max_tokens: the oldest messages are dropped, and
    the usage says how many; a last message that does not fit alone is a 400."""
    client = openai.OpenAI(base_url=f"{chat_server}/v1", api_key=KEY, max_retries=0)
    tok = load_pretrained_tokenizer(chat_run)
    history = [m for row in chat_conversations(3, seed=8) for m in row["messages"] if m["role"] != "system"][:-1]
    fitted, dropped = fit_prompt(tok, history, 32 - 8)
    assert dropped >= 2
    done = client.chat.completions.create(model="chat", messages=history, max_tokens=8, temperature=0)
    model, _, _ = load_for_inference(chat_run)
    assert done.choices[0].message.content == continuation(model, tok, fitted, 8, tok.im_end_id)[0]
    assert done.usage.prompt_tokens == len(fitted) and done.usage.model_extra["prompt_messages_dropped"] == dropped
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "apple " * 30}], max_tokens=8)
    assert e.value.param == "messages" and "lower max_tokens" in e.value.message


def test_the_openai_package_sees_bad_messages_and_a_model_without_the_template_as_400s(chat_server, server):
    client = openai.OpenAI(base_url=f"{chat_server}/v1", api_key=KEY, max_retries=0)
    for messages, words in [([{"role": "bot", "content": "hi"}], "role 'bot'"),
                            ([{"role": "user"}], 'no text "content"'),
                            ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                             "the last message is the assistant's"),
                            ([], "non-empty list")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="chat", messages=messages)
        assert e.value.param == "messages" and words in e.value.message, e.value.message
    base = openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        base.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert "not fine-tuned on conversations" in e.value.message and "/v1/completions" in e.value.message
    assert "prepare chat" in e.value.message and base.models.list().data[0].model_extra["chat"] is False


def test_the_openai_package_is_told_each_bound_of_a_request(server, chat_server):
    """What bounds a request's work (docs/serving.md), as the openai package sees it: tokens (serve --max-tokens,
    in /v1/models; at the limit served, above it a 400 naming the field and the limit, completions and chat alike,
    and a chat reply left without max_tokens within it), completions at once (n), stop strings, the body's size.
    The prompt's length bounds nothing: it is cropped (test_past_the_context_...); the queue: test_serve.py."""
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    chat = openai.OpenAI(base_url=f"{chat_server}/v1", api_key=KEY, max_retries=0)
    assert [(m.model_extra["context_length"], m.model_extra["max_tokens"]) for m in client.models.list()] == [(48, 60)]
    assert chat.models.list().data[0].model_extra["max_tokens"] == 16
    done = client.completions.create(model="tiny", prompt="a", max_tokens=60, temperature=0)
    assert done.usage.completion_tokens == 60
    messages = [{"role": "user", "content": "reverse: apple"}]
    assert chat.chat.completions.create(model="chat", messages=messages, max_tokens=16).usage.completion_tokens <= 16
    assert chat.chat.completions.create(model="chat", messages=messages, temperature=1.0, n=4,
                                        seed=1).usage.completion_tokens <= 4 * 16  # left out: within the limit
    for create, limit, field, asked in [(client.completions.create, 60, "max_tokens", 61),
                                        (client.completions.create, 60, "max_tokens", 1_000_000_000),
                                        (chat.chat.completions.create, 16, "max_tokens", 17),
                                        (chat.chat.completions.create, 16, "max_completion_tokens", 1_000_000_000)]:
        body = {"prompt": "a"} if create == client.completions.create else {"messages": messages}
        with pytest.raises(openai.BadRequestError) as e:
            create(model="any", **body, **{field: asked})
        assert e.value.param == field and e.value.body["message"] == (f"{field} {asked} is above this server's "
                                                                      f"limit of {limit} tokens per request (serve "
                                                                      "--max-tokens)")
    for options, field, words in [({"prompt": ["a", "b"], "n": 35}, "n", "70 completions (prompts x n) asked at "
                                   "once; this server takes at most 68 (--max-batch + --max-queue)"),
                                  ({"prompt": "a", "stop": list("abcde")}, "stop", "at most 4 are taken"),
                                  ({"prompt": "a", "stop": "a" * 201}, "stop", "1 to 200 characters")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", max_tokens=2, **options)
        assert e.value.param == field and words in e.value.message, e.value.message
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt="a" * (1 << 20), max_tokens=2)
    assert e.value.status_code == 413 and "exceeds this server's 1,048,576" in e.value.message


def test_serve_refuses_a_max_tokens_below_one_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--ckpt", "x", "--max-tokens", "0"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and lines == [
        "error: argument --max-tokens: 0 is out of range; it must be >= 1; see `gpt2train serve --help`"], lines


def test_the_openai_package_sees_a_wrong_key_and_a_bad_field(server):
    url, _ = server
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="a", max_tokens=2)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="a", max_tokens=2, top_p=1.5)
    assert "top_p" in str(e.value)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_server_sent_events(server):
    url, run = server
    want, reason = expected(run, "h", 15)
    body = json.dumps({"prompt": "h", "max_tokens": 15, "temperature": 0, "stream": True})
    out = subprocess.run(["curl", "-sN", "--fail-with-body", "-H", f"Authorization: Bearer {KEY}", "-H",
                          "Content-Type: application/json", "-d", body, f"{url}/v1/completions"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    events = out.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == reason
    health = subprocess.run(["curl", "-s", f"{url}/health"], capture_output=True, text=True, timeout=60).stdout
    assert json.loads(health)["status"] == "ok"  # open without the key


@pytest.mark.slow
def test_serve_says_in_one_line_when_its_model_is_loaded_and_ctrl_c_exits_130(tmp_path):
    """It printed where it listens, then nothing of its own: a user could not tell when the model was in. Now one
    line says it, with the URL, once /health answers 200; Ctrl-C then stops it with the shell's status, 130."""
    save_tiny_run(tmp_path / "run")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "gpt2train", "serve", "--ckpt", str(tmp_path / "run"), "--port",
                             str(port), "--dtype", "float32"], env=env, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        seen = []
        while not seen or not seen[-1].startswith("model loaded"):
            seen.append(lines.get(timeout=120).rstrip("\n"))
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200  # ready when it says so
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    assert seen[0].startswith(f"loading {tmp_path / 'run'} to serve on http://127.0.0.1:{port}/ (cpu, float32, ")
    params = format_count(parameter_count(tiny_model().config))
    assert seen[-1] == (f"model loaded: {tmp_path / 'run'} ({params} parameters, context {CONTEXT} tokens); serving "
                        f"on http://127.0.0.1:{port}/")


def test_serve_without_the_extra_names_it_in_one_line(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "gpt2train.serve.app", raising=False)
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if FastAPI were not installed
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(["serve", "--ckpt", str(tmp_path)])
    assert status == 1
    assert err.getvalue() == ("error: `gpt2train serve` needs FastAPI, uvicorn and prometheus-client (fastapi is "
                              "missing): pip install 'gpt2train[serve]'\n")


@pytest.mark.slow
def test_serve_refuses_a_bad_checkpoint_and_a_port_in_use(tmp_path):
    missing = run_cli("serve", "--ckpt", str(tmp_path / "nothing"), "--port", str(free_port()))
    assert missing.returncode == 1 and missing.stderr.startswith("error: ") and "does not exist" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    save_tiny_run(tmp_path / "run")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = run_cli("serve", "--ckpt", str(tmp_path / "run"), "--port", str(taken.getsockname()[1]))
    assert busy.returncode == 1
    # one line, before any loading: it was the last of uvicorn's log lines, after "loading ..."
    assert busy.stderr.strip().startswith("error: could not listen on 127.0.0.1:"), busy.stderr
    assert len(busy.stderr.strip().splitlines()) == 1 and "port in use" in busy.stderr, busy.stderr
    bad = run_cli("serve", "--ckpt", str(tmp_path / "run"), "--max-batch", "0")
    assert bad.returncode == 2 and "--max-batch" in bad.stderr



@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_serve_exits_by_the_stop_signal_even_where_uvicorn_does_not_raise_it_again(signum, status, tmp_path,
                                                                                   monkeypatch):
    """Once shut down, uvicorn raises the stop signal again so that Ctrl-C exits as Ctrl-C does; in one suite run
    that was lost (asyncio's own SIGINT handler took it) and serve exited 0. A server whose run returns after a stop
    signal, saying nothing, exits with the shell's status for it all the same (serve's drain keeps the first signal
    from uvicorn, which never raises it again)."""
    import uvicorn

    def stopped_quietly(self, sockets=None):
        self.handle_exit(signum, None)  # what uvicorn's signal handler does, and then its run returns

    monkeypatch.setattr(uvicorn.Server, "run", stopped_quietly)
    save_tiny_run(tmp_path / "run")
    assert cli.main(["serve", "--ckpt", str(tmp_path / "run"), "--port", str(free_port())]) == status
