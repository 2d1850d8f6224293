"""The playground page at `/`, in a real browser: Debian's chromium driven by Playwright, against `gpt2train serve`
started in a subprocess on a tiny checkpoint (and on the session's chat_run for the Chat view). The screenshot is
kept in the test's tmp folder (its path printed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, missing
from gpt2train.bench.serve import free_port
from gpt2train.checkpoint import model_state, save_checkpoint
from gpt2train.config import Config, to_dict
from gpt2train.model import GPT, GPTConfig
from gpt2train.tokenizer import CharTokenizer

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # the dev extra installs it; conftest.missing says so
    sync_playwright = None

# Playwright's own browser download cannot work here: it drives the distribution's chromium (`make setup-dev`
# installs Debian's). CHROMIUM names another Chromium or Chrome binary.
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
# Without the background-networking flags Chromium keeps trying to reach Google's hosts, which a closed
# network refuses; as root it needs --no-sandbox (Playwright adds it, with --headless and a fresh profile).
CHROMIUM_ARGS = ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

VOCAB = "abcdefghijklmnopqrstuvwxyz "
BLOCK_SIZE = 8192  # room for thousands of new tokens: the text is still streaming when Stop is pressed
SERVER_START_S = 180


def streaming_checkpoint(run_dir: Path, block_size: int = BLOCK_SIZE, vocab: str = VOCAB) -> Path:
    """A char-vocabulary model whose next-token distribution is the same at every position and puts the
    end-of-text token far below the rest: sampling never ends early, so a long answer streams until stopped."""
    tok = CharTokenizer(vocab)
    cfg = Config()
    cfg.model = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size, vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    with torch.no_grad():
        # The last LayerNorm outputs its bias (all ones) whatever its input; logits are that vector times each
        # token's (tied) embedding, so end-of-text, embedded as all minus ones, scores -n_embd, the others ~N(0, 1).
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.transformer.wte.weight[tok.eot_id] = -1.0
    meta = {"config": to_dict(cfg), "tokens": 0, "best_val_loss": None, "tokenizer": tok.spec()}
    save_checkpoint(run_dir, step=0, weights=model_state(model), state={}, meta=meta)
    return run_dir



def wait_healthy(url: str, proc: subprocess.Popen, log: Path):
    """Poll GET /health until 200; fail with the server's log if it exits or never gets there."""
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"gpt2train serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while the model loads
        time.sleep(0.2)
    pytest.fail(f"gpt2train serve did not answer /health with 200 in {SERVER_START_S} s:\n{log.read_text()}")


@contextmanager
def running_server(ckpt: Path, log: Path, api_key: str | None = None, options: tuple[str, ...] = ()):
    """`gpt2train serve` on 127.0.0.1 and a free port, on the CPU in float32 and eager, with or without an API key
    and with `options` added; yields its base URL and stops it after."""
    from gpt2train.serve.app import API_KEY_ENV

    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop(API_KEY_ENV, None)
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gpt2train", "serve", "--ckpt", str(ckpt), "--host", "127.0.0.1",
                                 "--port", url.rsplit(":", 1)[1], "--device", "cpu", "--dtype", "float32", "--compile", "false",
                                 *options],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return streaming_checkpoint(tmp_path_factory.mktemp("playground_ckpt") / "run")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    with running_server(checkpoint, tmp_path_factory.mktemp("playground_server") / "serve.log") as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    if sync_playwright is None:
        missing("the playwright package is not installed")
    if not CHROMIUM.exists():
        missing(f"{CHROMIUM} is missing (Debian's chromium package)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@contextmanager
def open_page(browser, url: str):
    """The playground at url in a fresh browser context; an exception in the page's script fails the test."""
    context = browser.new_context(viewport={"width": 1000, "height": 800})
    page = context.new_page()
    page.set_default_timeout(60_000)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/")
    yield page
    context.close()
    assert not errors, errors


@pytest.fixture
def page(browser, server):
    with open_page(browser, server) as page:
        yield page


def rows_decoding(url: str) -> float:
    """The server's gauge of rows in its running batch, read from GET /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        families = text_string_to_metric_families(response.read().decode())
    return next(f.samples[0].value for f in families if f.name == "gpt2train_batch_rows")


def wait_no_rows_decoding(url: str):
    deadline = time.monotonic() + 60
    while rows_decoding(url) != 0:
        assert time.monotonic() < deadline, "the server still decodes a row a minute after Stop"
        time.sleep(0.1)


def server_error(url: str, body: dict) -> str:
    """The message of the 4xx JSON error the server answers to this completion request."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert 400 <= e.value.code < 500, e.value.code
    return json.loads(e.value.read())["error"]["message"]


def completion_length(page) -> int:
    return page.locator("#completion").evaluate("e => e.textContent.length")


def wait_longer_than(page, n: int) -> int:
    page.wait_for_function("n => document.getElementById('completion').textContent.length > n", arg=n)
    return completion_length(page)


def fill_settings(page, prompt: str, max_tokens: int):
    page.get_by_label("Prompt").fill(prompt)
    page.get_by_label("Max tokens").fill(str(max_tokens))
    page.get_by_label("Temperature").fill("1")
    page.get_by_label("Top-k").fill("10")  # end-of-text scores lowest: never among the 10 kept
    page.get_by_label("Top-p").fill("1")


@pytest.mark.slow
def test_playground_streams_text_and_stop_ends_it(page, server, tmp_path):
    status = page.get_by_role("status")
    expect(page.locator("#model")).to_contain_text(f"context {BLOCK_SIZE} tokens")  # GET /v1/models was read
    # serve's default limit is the context: nothing goes past it, and the page does not say it would
    expect(page.locator("#model")).to_contain_text(f"tokens · up to {BLOCK_SIZE} tokens a request")
    expect(page.locator("#model")).not_to_contain_text("past it")
    fill_settings(page, "hello world", max_tokens=BLOCK_SIZE - 100)
    page.get_by_role("button", name="Generate").click()
    expect(status).to_have_text("Generating…")

    # The text arrives in pieces while the request runs: two different lengths seen before the end.
    first = wait_longer_than(page, 0)
    second = wait_longer_than(page, first)
    assert 0 < first < second
    expect(page.locator("#shown-prompt")).to_have_text("hello world")
    expect(page.locator("#stats")).to_contain_text("tokens/s")
    page.screenshot(path=str(tmp_path / "playground-streaming.png"), full_page=True)

    page.get_by_role("button", name="Stop").click()
    expect(status).to_contain_text("Stopped after")
    stopped = completion_length(page)
    page.wait_for_timeout(1000)  # a stream still running would add text here
    assert completion_length(page) == stopped < BLOCK_SIZE - 100
    # Each token of a char vocabulary is one character; the page counts streamed pieces, one token or more each.
    counted = int(re.fullmatch(r"Stopped after (\d+) tokens?\.", status.text_content()).group(1))
    assert 0 < counted <= stopped
    assert set(page.locator("#completion").text_content()) <= set(VOCAB)
    expect(page.get_by_role("button", name="Generate")).to_be_enabled()
    expect(page.get_by_role("button", name="Stop")).to_be_disabled()
    wait_no_rows_decoding(server)  # the abort reached the server, which freed the row long before max_tokens

    shot = tmp_path / "playground.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 0
    print(f"screenshots: {shot} and {shot.with_stem('playground-streaming')}")


def test_playground_runs_to_max_tokens_then_shows_a_server_error(page, server):
    status = page.get_by_role("status")
    fill_settings(page, "abc", max_tokens=5)
    page.get_by_role("button", name="Generate").click()
    expect(status).to_have_text("Done: max tokens (length).")
    assert completion_length(page) == 5  # and the usage at the end tells the page it was 5 tokens
    assert re.search(r"^5 tokens · first after \d+ ms( · [\d.]+ tokens/s)?$", page.locator("#stats").text_content())

    # Upper case is not in the checkpoint's vocabulary: the server answers 400 with a message the page shows.
    page.get_by_label("Prompt").fill("Hello")
    page.get_by_role("button", name="Generate").click()
    expect(status).to_contain_text("Error 400: ")
    assert status.text_content() == f"Error 400: {server_error(server, {'prompt': 'Hello', 'max_tokens': 5})}"
    expect(page.get_by_role("button", name="Generate")).to_be_enabled()


@pytest.mark.slow
def test_playground_sends_the_api_key_it_is_given(browser, checkpoint, tmp_path):
    key = "playground-test-key"
    with running_server(checkpoint, tmp_path / "serve.log", api_key=key) as url, open_page(browser, url) as page:
        status = page.get_by_role("status")
        expect(page.locator("#model")).to_contain_text("Model: unknown (401: a valid API key is required")
        fill_settings(page, "abc", max_tokens=5)
        page.get_by_role("button", name="Generate").click()
        expect(status).to_contain_text("Error 401: a valid API key is required")

        page.get_by_text("API key", exact=True).click()  # the field is folded away until asked for
        page.get_by_label("API key").fill(key)
        page.get_by_label("API key").press("Tab")  # a changed key reloads the model's name with it
        expect(page.locator("#model")).to_contain_text(f"context {BLOCK_SIZE} tokens")
        page.get_by_role("button", name="Generate").click()
        expect(status).to_have_text("Done: max tokens (length).")
        assert completion_length(page) == 5


@pytest.mark.slow
def test_playground_defaults_fit_a_short_context_and_go_past_it_as_sample_does(browser, tmp_path):
    """Found walking the second hour: Max tokens was 200 on a 128-token model, so the first Generate failed.
    The page reads the context (32 here) and starts at half of it; past the context the text goes on as
    `gpt2train sample` does (docs/model.md, "Past the context") where `serve --max-tokens` allows it, and a prompt
    longer than it is cropped."""
    ckpt = streaming_checkpoint(tmp_path / "run", block_size=32, vocab=VOCAB + "ABCDEFGHIJKLMNOPQRSTUVWXYZ:")
    with running_server(ckpt, tmp_path / "serve.log", options=("--max-tokens", "128")) as url, \
            open_page(browser, url) as page:
        status = page.get_by_role("status")
        expect(page.locator("#model")).to_contain_text("context 32 tokens (past it, the text goes on from the last 32)"
                                                       " · up to 128 tokens a request")
        assert page.get_by_label("Max tokens").get_attribute("max") == "128"
        expect(page.get_by_label("Max tokens")).to_have_value("16")
        page.get_by_role("button", name="Generate").click()  # the page's own defaults: a newcomer's first click
        expect(status).to_have_text("Done: max tokens (length).", timeout=60_000)
        assert completion_length(page) == 16

        fill_settings(page, "abc", max_tokens=100)  # 3 + 100 tokens in a context of 32
        page.get_by_label("Temperature").fill("0")
        page.get_by_role("button", name="Generate").click()
        expect(status).to_have_text("Done: max tokens (length).", timeout=60_000)
        sample = subprocess.run([sys.executable, "-m", "gpt2train", "sample", "--ckpt", str(ckpt), "--prompt", "abc",
                                 "--max-new-tokens", "100", "--temperature", "0", "--dtype", "float32", "--device", "cpu"],
                                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "src")}, capture_output=True,
                                text=True, timeout=300)
        assert sample.returncode == 0, sample.stderr
        assert "abc" + page.locator("#completion").text_content() + "\n" == sample.stdout

        fill_settings(page, "hello world " * 4, max_tokens=5)  # 48 tokens: the first 16 are cropped
        page.get_by_role("button", name="Generate").click()
        expect(status).to_have_text("Done: max tokens (length). The prompt's first 16 tokens were cropped: the model "
                                    "reads its last 32.", timeout=60_000)
        assert completion_length(page) == 5


def chat_reply(url: str, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    """The server's greedy reply to the conversation (its JSON answer), and how many messages it left out."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    return answer["choices"][0]["message"]["content"], answer["usage"].get("prompt_messages_dropped", 0)


@pytest.mark.slow
def test_playground_chat_streams_each_reply_into_the_conversation_it_keeps(browser, chat_run, tmp_path):
    """Two turns with chat_run in the Chat view: each streamed reply is the API's greedy reply to the whole
    conversation so far (the page keeps it, and sends it all), the status saying when the oldest messages had to be
    left out of chat_run's 32-token context."""
    with running_server(chat_run, tmp_path / "serve.log") as url, open_page(browser, url) as page:
        status = page.get_by_role("status")
        expect(page.locator("#model")).to_contain_text("context 32 tokens")
        page.get_by_role("tab", name="Chat").click()
        expect(page.get_by_role("button", name="Send")).to_be_enabled()
        page.get_by_label("Max tokens").fill("8")
        page.get_by_label("Temperature").fill("0")
        history = []
        for turn, text in enumerate(["reverse: apple river", "reverse: stone cloud lamp"]):
            page.get_by_label("Message", exact=True).fill(text)
            page.get_by_role("button", name="Send").click()
            expect(page.locator("#messages li")).to_have_count(2 * turn + 2)
            expect(status).to_have_text(re.compile(r"^Done: "))
            history.append({"role": "user", "content": text})
            want, dropped = chat_reply(url, history, 8)
            assert page.locator("#messages .assistant .content").nth(turn).text_content() == want
            history.append({"role": "assistant", "content": want})
            left_out = {0: "", 1: " The oldest message was left out to fit the context."}.get(
                dropped, f" The oldest {dropped} messages were left out to fit the context.")
            assert status.text_content() == "Done: the model ended its turn (stop)." + left_out
        assert dropped > 0  # the second turn's conversation outgrew the context less max_tokens
        assert page.locator("#messages .user .content").all_text_contents() == [m["content"] for m in history[::2]]
        expect(page.get_by_label("Message", exact=True)).to_have_value("")
        page.screenshot(path=str(tmp_path / "playground-chat.png"), full_page=True)


def test_playground_chat_says_when_the_model_has_no_chat_template(page):
    page.get_by_role("tab", name="Chat").click()
    expect(page.locator("#chat-note")).to_contain_text("not fine-tuned on conversations with the chat template")
    expect(page.get_by_role("button", name="Send")).to_be_disabled()
    page.get_by_role("tab", name="Generate").click()
    expect(page.get_by_label("Prompt")).to_be_visible()
    expect(page.get_by_role("button", name="Generate")).to_be_enabled()
