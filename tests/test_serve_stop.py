"""A stopped server finishes what it started (docs/serving.md, "Stopping"): the engine's drain (completions held
run on for the grace period, the rest are cut with a last piece), the app's answers while it drains (503 for new
requests, /health "stopping", a cut stream ends with its last chunk and [DONE], a cut plain request is a JSON
error, one log line per cut request), and `gpt2train serve` stopped by SIGTERM or Ctrl-C mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from conftest import REPO
from gpt2train.bench.serve import free_port
from gpt2train.serve.app import graceful_server_class
from gpt2train.serve.engine import Completion, Draining, Engine, Inbox, Piece, Sampling
from serving import TOKENIZER, greedy, save_tiny_run, served_by, tiny_app, tiny_engine, tiny_model, uvicorn_config

GREEDY = Sampling(temperature=0)
ENDLESS = 10**9  # max_tokens past the context: the row slides on and never ends by itself


async def pieces_until_done(inbox: Inbox, completions: int) -> dict[int, list[Piece]]:
    """Every piece of the inbox's completions, by index, until each has had its last."""
    got: dict[int, list[Piece]] = {}
    while sum(p[-1].finish_reason is not None for p in got.values()) < completions:
        for index, piece in await inbox.get():
            got.setdefault(index, []).append(piece)
    return got


def test_a_draining_engine_lets_what_it_holds_finish_within_the_grace_then_cuts_the_rest():
    async def drain():
        engine = tiny_engine(max_batch=2).start()
        try:
            inbox = Inbox()
            short = Completion(TOKENIZER.encode("bad"), 5, inbox, GREEDY, index=0)
            endless = Completion(TOKENIZER.encode("cafe"), ENDLESS, inbox, GREEDY, index=1)
            engine.submit([short, endless])
            started = time.monotonic()
            drained = asyncio.create_task(asyncio.to_thread(engine.drain, 0.5))
            got = await pieces_until_done(inbox, 2)
            await drained
            waited = time.monotonic() - started
            with pytest.raises(Draining):
                engine.submit([Completion(TOKENIZER.encode("a"), 5, inbox, GREEDY)])
            return got, waited, engine.drained()
        finally:
            engine.stop()

    got, waited, drained = asyncio.run(drain())
    assert ("".join(p.text for p in got[0]), got[0][-1].finish_reason) == greedy(tiny_model(), "bad", 5)
    assert got[1][-1].finish_reason == "cut" and got[1][-1].tokens == 0  # a last piece, no token of its own
    assert 0.5 <= waited < 5 and drained  # the grace was waited out: the endless one ran on till then


def test_a_completion_still_waiting_for_a_row_is_cut_too_and_cut_ends_the_grace_at_once():
    async def drain():
        engine = tiny_engine(max_batch=1, max_queue=1).start()
        try:
            inbox = Inbox()
            engine.submit([Completion(TOKENIZER.encode("a"), ENDLESS, inbox, GREEDY, index=0),
                           Completion(TOKENIZER.encode("b"), 5, inbox, GREEDY, index=1)])  # waits for the row
            started = time.monotonic()
            drained = asyncio.create_task(asyncio.to_thread(engine.drain, 600))
            while not engine.draining:
                await asyncio.sleep(0.01)
            engine.cut()  # a second Ctrl-C: the grace ends now
            got = await pieces_until_done(inbox, 2)
            await drained
            return got, time.monotonic() - started
        finally:
            engine.stop()

    got, waited = asyncio.run(drain())
    assert got[0][-1].finish_reason == "cut"
    assert got[1] == [Piece("", 0, "cut")]  # it never ran
    assert waited < 30


def test_an_idle_engine_drains_at_once():
    engine = tiny_engine().start()
    try:
        started = time.monotonic()
        engine.drain(600)
        assert time.monotonic() - started < 5 and engine.drained()
    finally:
        engine.stop()


@contextlib.contextmanager
def graceful(app, grace_seconds: float):
    """The app run by serve's GracefulServer in a thread; yields (base URL, server). server.handle_exit is what
    a stop signal calls."""
    server = graceful_server_class()(uvicorn_config(app), app.state.served, grace_seconds)
    with served_by(server) as url:
        yield url, server


def raw_stream(url: str, body: dict, first: threading.Event, lines: list[str]) -> None:
    """A stream read as the bytes come (httpx): every line it sends; `first` is set at its first event."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            lines.append(line)
            first.set()


@pytest.mark.slow
def test_a_stop_signal_drains_the_server_its_clients_get_whole_answers(monkeypatch, caplog):
    """Mid-stream, a stop signal: a stream that ends within the grace period ends as it would have, an endless
    stream and an endless plain request are cut when it is over (a last chunk and [DONE]; a 503 JSON error),
    new requests get 503 with Retry-After and /health says "stopping", one log line per cut request, and the
    server then stops by itself."""
    step = Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: (time.sleep(0.005), step(self)))  # a short stream spans the stop
    app = tiny_app(max_batch=4, max_tokens=ENDLESS)
    with graceful(app, grace_seconds=2) as (url, server):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        short = client.completions.create(model="tiny", prompt="bad", max_tokens=40, temperature=0, stream=True)
        first_chunk = next(short)
        cut_lines: list[str] = []
        cut_first = threading.Event()
        streaming = threading.Thread(target=raw_stream, args=(url, {"prompt": "cafe", "max_tokens": ENDLESS,
                                                                    "temperature": 0}, cut_first, cut_lines))
        streaming.start()
        plain: list[httpx.Response] = []
        posting = threading.Thread(target=lambda: plain.append(httpx.post(
            f"{url}/v1/completions", json={"prompt": "cafe", "max_tokens": ENDLESS, "temperature": 0},
            timeout=60)))
        posting.start()
        while not (cut_first.is_set() and app.state.served.engine.running == 3):
            time.sleep(0.01)
        server.handle_exit(signal.SIGTERM, None)
        while not app.state.served.stopping:
            time.sleep(0.01)
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model="tiny", prompt="a", max_tokens=5)
        health = httpx.get(f"{url}/health")
        rest = list(short)
        streaming.join(30)
        posting.join(30)
        deadline = time.monotonic() + 30
        while listening(url):  # it stops by itself once drained
            assert time.monotonic() < deadline, "the server did not stop after its drain"
            time.sleep(0.05)
    assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "5"
    assert "stopping" in refused.value.response.json()["error"]["message"]
    assert health.status_code == 503 and health.json() == {"status": "stopping"}
    chunks = [first_chunk, *rest]
    assert ("".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason) == \
        greedy(tiny_model(), "bad", 40)  # finished within the grace, as it would have
    events = [line.removeprefix("data: ") for line in cut_lines if line]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    (answer,) = plain
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    assert answer.json()["error"]["message"] == ("the server stopped before this request was done (1 of its 1 "
                                                 "completion(s) unfinished); send it again")
    cut = [r.getMessage() for r in caplog.records if "cut short by the server's stop" in r.getMessage()]
    assert len(cut) == 2 and all("1 of its 1 completion(s) unfinished" in line for line in cut), cut
    assert server.stopped_by == signal.SIGTERM


@pytest.mark.slow
@pytest.mark.parametrize("signals, grace, status", [((signal.SIGTERM,), "1", 143),
                                                     ((signal.SIGINT, signal.SIGINT), "600", 130)],
                         ids=["sigterm-after-the-grace", "ctrl-c-twice"])
def test_serve_stopped_mid_stream_gives_its_clients_complete_streams(signals, grace, status, tmp_path):
    """`gpt2train serve` as a user runs it, two clients streaming without end (curl -N and the openai package):
    SIGTERM cuts them when the grace is over; a second Ctrl-C cuts them at once. Either way each gets a last
    chunk and [DONE] (curl exits 0, not 18 for a transfer cut short), the log has one line per cut request and no
    traceback, and the command exits with the shell's status for the first signal."""
    save_tiny_run(tmp_path / "run")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gpt2train", "serve", "--ckpt", str(tmp_path / "run"),
                                 "--port", str(port), "--dtype", "float32", "--max-tokens", str(ENDLESS),
                                 "--grace-seconds", grace], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not health_ok(url):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        body = json.dumps({"prompt": "bad", "max_tokens": ENDLESS, "temperature": 0, "stream": True})
        curl = subprocess.Popen(["curl", "-sN", "-H", "Content-Type: application/json", "-d", body,
                                 f"{url}/v1/completions"], stdout=subprocess.PIPE, text=True)
        first_line = curl.stdout.readline()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="cafe", max_tokens=ENDLESS, temperature=0,
                                           stream=True)
        chunks = [next(stream)]
        for signum in signals:
            proc.send_signal(signum)
            time.sleep(0.5)
        chunks += list(stream)
        curl_out, _ = curl.communicate(timeout=60)
        assert proc.wait(timeout=60) == status
    finally:
        proc.kill()
    assert curl.returncode == 0
    events = [line.removeprefix("data: ") for line in (first_line + curl_out).split("\n") if line]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert chunks[-1].choices[0].finish_reason == "length"
    printed = log_path.read_text()
    assert printed.count("cut short by the server's stop") == 2, printed
    assert "Traceback" not in printed and "Application shutdown complete" in printed, printed


def listening(url: str) -> bool:
    try:
        httpx.get(f"{url}/health")
    except httpx.TransportError:
        return False
    return True


def health_ok(url: str) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return httpx.get(f"{url}/health").status_code == 200
    return False
