"""gpt2train serve: the continuous-batching engine (tokens the same alone or beside others, rows joining and
leaving), the app's answers and refusals in process (completions and chat), and a real server in a thread: a
client that leaves frees its row."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from gpt2train import cli
from gpt2train.chat import fit_prompt, render_prompt
from gpt2train.generation import generate
from gpt2train.model import GPT, GPTConfig
from gpt2train.serve.app import API_KEY_ENV, create_app, engine_loader
from gpt2train.serve.engine import BatchCache, Completion, Engine, Inbox, Sampling, StopText
from gpt2train.tokenizer import train_bpe
from serving import (
    CHAT_TOKENIZER,
    CONTEXT,
    TOKENIZER,
    continuation,
    greedy,
    running,
    save_tiny_run,
    tiny_app,
    tiny_chat_app,
    tiny_chat_model,
    tiny_engine,
    tiny_model,
    wait_ready,
)

GREEDY = Sampling(temperature=0)


async def complete(engine: Engine, prompt: str, max_tokens: int, sampling: Sampling = GREEDY,
                   stop: tuple[str, ...] = (), end_id: int | None = None) -> tuple[str, str]:
    """(text, finish_reason) of one completion run by the engine."""
    inbox = Inbox()
    engine.submit([Completion(TOKENIZER.encode(prompt), max_tokens, inbox, sampling, stop, end_id=end_id)])
    text = ""
    while True:
        for _, piece in await inbox.get():
            text += piece.text
            if piece.finish_reason:
                return text, piece.finish_reason


async def after_steps(engine: Engine, steps: int) -> None:
    """Until the engine has run `steps` forwards, or no work is left (then there is no step to wait for)."""
    await asyncio.sleep(0)  # a task just created submits first
    while engine.steps < steps and (engine.running or engine.queued):
        await asyncio.sleep(0.001)


def run_engine(coroutine_fn, **engine_options):
    engine = tiny_engine(**engine_options).start()
    try:
        return asyncio.run(coroutine_fn(engine))
    finally:
        engine.stop()


# ---------------------------------------------------------------- the engine


@pytest.mark.parametrize("options", [{}, dict(attention_window=3, value_embeddings=1, unet_skips=True)])
def test_kv_cache_rows_join_and_leave_a_running_batch(options):
    """The engine cache's moves (BatchCache): a row prefilled while another has decoded, both decoded
    together, then realigned (the first leaves, the rows swap places): each row's logits stay its own full
    forward's at every token; a sliding window counts the row's tokens, not its slots."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=70, **options)).eval()
    a, b = torch.randint(0, 70, (12,)), torch.randint(0, 70, (9,))

    def expected(seq, t):  # the logits after seq[:t], computed alone without a cache
        return model(seq[None, :t])[0, -1]

    cache = BatchCache(model.config, 3, 16, "cpu", torch.float32)
    cache.realign([], 4)  # empty: the next tokens go to slot 4
    got = model(a[None, :4], kv_cache=cache.rows(0, 1, filled=0))[0, -1]
    torch.testing.assert_close(got, expected(a, 4), atol=1e-5, rtol=1e-5)
    for t in (4, 5):  # row 0 decodes alone
        got = model(a[None, t:t + 1], kv_cache=cache.rows(0, 1))[0, -1]
        torch.testing.assert_close(got, expected(a, t + 1), atol=1e-5, rtol=1e-5)
    assert cache.length == 6
    # b joins in row 1: its 3 prompt tokens fill slots 3-5, just before the next step's slot 6
    got = model(b[None, :3], kv_cache=cache.rows(1, 2, filled=cache.length - 3))[0, -1]
    torch.testing.assert_close(got, expected(b, 3), atol=1e-5, rtol=1e-5)
    for t in (6, 7):  # both rows decode
        logits = model(torch.stack([a[t:t + 1], b[t - 3:t - 2]]), kv_cache=cache.rows(0, 2))[:, -1]
        torch.testing.assert_close(logits[0], expected(a, t + 1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[1], expected(b, t - 2), atol=1e-5, rtol=1e-5)
    cache.realign([1, 0], 8)  # swapped, each right-aligned at slot 8
    assert cache.real[:, :8].sum(1).tolist() == [5, 8, 0] and cache.length == 8
    logits = model(torch.stack([b[5:6], a[8:9]]), kv_cache=cache.rows(0, 2))[:, -1]
    torch.testing.assert_close(logits[0], expected(b, 6), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], expected(a, 9), atol=1e-5, rtol=1e-5)
    cache.realign([0], 6)  # a leaves; b's 6 tokens now fill slots 0-5
    assert cache.real.sum(1).tolist() == [6, 0, 0] and cache.real[0, :6].all()
    got = model(b[None, 6:7], kv_cache=cache.rows(0, 1))[0, -1]
    torch.testing.assert_close(got, expected(b, 7), atol=1e-5, rtol=1e-5)
    cache.move_rows([0], [2])  # b moves to row 2, its slots as they are
    assert cache.real[:, :7].sum(1).tolist() == [7, 0, 7] and cache.length == 7
    got = model(torch.stack([a[0:1], a[0:1], b[7:8]]), kv_cache=cache)[2, -1]
    torch.testing.assert_close(got, expected(b, 8), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot realign rows holding 8 tokens to 6"):
        cache.realign([2], 6)


# (prompt, max_tokens, seed: None greedy, else sampled at temperature 1 with that seed)
REQUESTS = [("abc", 30, None), ("h", 12, 1), ("bad cafe\nge", 20, None), ("a", 1, None), ("ggg", 25, 2),
            ("dead beef", 9, None), ("c", 40, 3), ("fed", 7, None), ("ab ab ab ab ab ab", 18, 4), ("e", 33, 5)]


def sampling_of(seed: int | None) -> Sampling:
    return GREEDY if seed is None else Sampling(temperature=1.0, seed=seed)


def reference(model, prompt: str, max_tokens: int, seed: int | None) -> tuple[str, str]:
    """`generate`'s continuation of the prompt alone: greedy, or drawn with that seed."""
    if seed is None:
        return greedy(model, prompt, max_tokens)
    ids = generate(model, TOKENIZER.encode(prompt), max_tokens, temperature=1.0, seed=seed, eot_id=TOKENIZER.eot_id)
    ended = ids[-1] == TOKENIZER.eot_id
    return TOKENIZER.decode(ids[:-1] if ended else ids), "stop" if ended else "length"


def test_tokens_are_the_same_alone_as_beside_requests_joining_and_leaving():
    """float32: every request's text is `generate`'s for its prompt alone (greedy, or sampled with the same
    seed), whether it runs alone or among requests of other lengths that start at other steps, more of
    them than rows (some wait, rows leave and the cache is realigned)."""
    model = tiny_model()

    async def staggered(engine):
        tasks = []
        for i, (prompt, n, seed) in enumerate(REQUESTS):
            tasks.append(asyncio.create_task(complete(engine, prompt, n, sampling_of(seed))))
            await after_steps(engine, engine.steps + i % 3)  # some join together, some a few steps later
        return await asyncio.gather(*tasks)

    together = run_engine(staggered, max_batch=3)
    alone = [run_engine(lambda e, p=p, n=n, s=s: complete(e, p, n, sampling_of(s))) for p, n, s in REQUESTS[:3]]
    assert together == [reference(model, *request) for request in REQUESTS]
    assert alone == together[:3]
    assert len({text for text, _ in together}) == len(REQUESTS)


# Past the context of 48 tokens: (prompt, max_tokens, sampling) whose rows slide beside rows decoding from the cache
# and rows joining; "a" * 48 fills the context alone, so it slides from its first token. Top-k 4 leaves out
# end-of-text: the sampled rows run to max_tokens too.
PAST_THE_CONTEXT = [("abc", 70, GREEDY), ("h", 55, Sampling(1.0, top_k=4, seed=1)), ("bad cafe\nge", 40, GREEDY),
                    ("a" * CONTEXT, 12, GREEDY), ("ggg", 20, Sampling(1.0, top_k=4, seed=2)), ("e", 5, GREEDY)]


def test_rows_past_the_context_slide_as_generate_does_beside_rows_in_the_cache():
    """The server's one context policy is `sample`'s (docs/model.md, "Past the context"): a row whose tokens
    fill the context goes on reading its last 48 tokens, afresh at each step. float32: each request's text
    is `generate`'s for its prompt alone, whether its row slides, decodes from the cache or joins beside them."""
    model = tiny_model()

    async def staggered(engine):
        tasks = []
        for i, (prompt, n, sampling) in enumerate(PAST_THE_CONTEXT):
            tasks.append(asyncio.create_task(complete(engine, prompt, n, sampling)))
            await after_steps(engine, engine.steps + 5 * (i % 3))  # some join while others slide
        return await asyncio.gather(*tasks), engine.sliding, engine.running

    got, sliding, running = run_engine(staggered, max_batch=3)
    want = []
    for prompt, n, s in PAST_THE_CONTEXT:
        ids = generate(model, TOKENIZER.encode(prompt), n, temperature=s.temperature, top_k=s.top_k, seed=s.seed,
                       eot_id=TOKENIZER.eot_id)
        assert len(ids) == n and TOKENIZER.eot_id not in ids  # each row runs to max_tokens: 4 of them slide
        want.append((TOKENIZER.decode(ids), "length"))
    assert got == want
    assert sliding == [] and running == 0  # rows that slid left when they ended


@pytest.mark.slow  # compiling takes ~20 s on 2 cores
def test_a_compiled_decode_step_gives_the_same_tokens():
    """Compiled, every step decodes all rows over the whole cache (one shape): rows that are free or joined
    at that step feed a token that is not theirs, which must stay hidden from them."""
    model = tiny_model()
    engine = Engine(model, TOKENIZER, max_batch=3, max_queue=16, compile=True).start()

    async def staggered():
        tasks = []
        for prompt, n, seed in REQUESTS[:5]:
            tasks.append(asyncio.create_task(complete(engine, prompt, n, sampling_of(seed))))
            await after_steps(engine, engine.steps + 2)
        return await asyncio.gather(*tasks)

    try:
        got = asyncio.run(staggered())
    finally:
        engine.stop()
    assert engine.decoder.path.startswith("compiled"), engine.decoder.path
    assert got == [reference(model, *request) for request in REQUESTS[:5]]


@pytest.mark.parametrize("budget, joined", [(2, [1, 1, 1, 1]), (3, [1, 2, 1]), (4, [2, 2]), (100, [4])])
def test_at_most_prefill_tokens_join_at_a_step_one_prompt_at_least(monkeypatch, budget, joined):
    prefills = []
    prefill = Engine.prefill

    def recording(self, new):
        prefills.append(len(new))
        return prefill(self, new)

    monkeypatch.setattr(Engine, "prefill", recording)
    engine = Engine(tiny_model(), TOKENIZER, max_batch=4, prefill_tokens=budget)

    async def burst():
        inbox = Inbox()
        jobs = [Completion(TOKENIZER.encode(p), 3, inbox, GREEDY, index=i) for i, p in enumerate(["ab", "cd", "e", "fgh"])]
        engine.submit(jobs)  # before the engine starts: all four wait together
        engine.start()
        done = 0
        while done < len(jobs):
            done += sum(piece.finish_reason is not None for _, piece in await inbox.get())

    try:
        asyncio.run(burst())
    finally:
        engine.stop()
    assert prefills == joined  # prompts of 2, 2, 1 and 3 tokens: "fgh" joins alone past a budget of 2


def test_a_row_is_free_once_its_last_piece_is_out():
    async def one(engine):
        await complete(engine, "abc", 3)
        return engine.running

    assert run_engine(one) == 0


def test_a_request_starts_without_waiting_for_a_longer_one_to_finish():
    async def two(engine):
        order = []

        async def tracked(name, prompt, n):
            await complete(engine, prompt, n)
            order.append(name)

        long = asyncio.create_task(tracked("long", "abc", 40))
        await after_steps(engine, 3)
        await tracked("short", "d", 3)
        await long
        return order

    assert run_engine(two, max_batch=2) == ["short", "long"]


def test_a_seeded_request_is_reproducible_alone():
    seeded = Sampling(temperature=1.0, top_k=5, top_p=0.9, seed=11)
    first = run_engine(lambda e: complete(e, "abc", 30, seeded))
    assert first == run_engine(lambda e: complete(e, "abc", 30, seeded))
    assert first != run_engine(lambda e: complete(e, "abc", 30, Sampling(1.0, 5, 0.9, seed=12)))


def test_a_completion_ends_before_its_stop_string():
    model = tiny_model()
    text, _ = greedy(model, "abc", 30)
    stop = text[5:7]  # a string the greedy text holds
    want = text[:text.index(stop)]
    assert run_engine(lambda e: complete(e, "abc", 30, stop=("zz", stop))) == (want, "stop")


def test_a_completion_ends_at_its_own_end_token_as_generate_does():
    """A chat reply ends at <|im_end|>, not at end-of-text: a completion's end_id is the token that ends it (its
    last, not shown), as generate's eot_id; one without keeps the tokenizer's end-of-text."""
    model = tiny_model()
    prompt = TOKENIZER.encode("abc")
    end = generate(model, prompt, 30, temperature=0)[6]  # a token the greedy text reaches
    want = continuation(model, TOKENIZER, prompt, 30, end)
    assert want[1] == "stop"
    assert run_engine(lambda e: complete(e, "abc", 30, end_id=end)) == want[:2]
    assert run_engine(lambda e: complete(e, "abc", 30)) == greedy(model, "abc", 30)


def test_stop_text_holds_back_what_could_start_a_stop_string():
    stop = StopText(("END", "xy"))
    assert stop.push("abc E") == ("abc ", False)  # "E" may start END
    assert stop.push("N") == ("", False)
    assert stop.push("D and more") == ("", True)  # the stop string and what follows are never shown
    stop = StopText(("END",))
    assert stop.push("abE") == ("ab", False)
    assert stop.push("x") == ("Ex", False)  # not a stop after all: released
    assert stop.flush() == ""
    stop = StopText(("xy", "b"))
    assert stop.push("axyb") == ("a", True)  # the earliest of several


def test_a_failing_step_ends_its_completions_with_an_error_and_the_engine_serves_on(monkeypatch):
    prefill = Engine.prefill
    failures = iter([RuntimeError("out of memory")])

    def failing_once(self, new):
        for error in failures:
            raise error
        return prefill(self, new)

    monkeypatch.setattr(Engine, "prefill", failing_once)

    async def two(engine):
        return await complete(engine, "abc", 5), await complete(engine, "abc", 5)

    failed, served = run_engine(two)
    assert failed == ("the engine failed: RuntimeError: out of memory", "error")
    assert served == greedy(tiny_model(), "abc", 5)


def test_a_completion_that_ends_at_its_prefill_gets_no_error_when_the_decode_of_that_step_fails(monkeypatch):
    """A running row, and a completion of max_tokens 1 joining it (both of one request, as with n=2): its
    prefill ends it, then the step's decode fails. Its last piece is its "length" one; only the running row
    gets the error (a second last piece would close another completion of the request in the app's count)."""
    prefill, decode = Engine.prefill, Engine.decode
    short = []  # set once the short completion's prefill is done

    def recording_prefill(self, new):
        produced = prefill(self, new)
        short.extend(c for c in new if c.max_tokens == 1)
        return produced

    def failing_after_the_short_prefill(self, n):
        if short:
            raise RuntimeError("out of memory")
        return decode(self, n)

    monkeypatch.setattr(Engine, "prefill", recording_prefill)
    monkeypatch.setattr(Engine, "decode", failing_after_the_short_prefill)

    async def joined(engine):
        inbox = Inbox()
        engine.submit([Completion(TOKENIZER.encode("h"), CONTEXT - 1, inbox, GREEDY, index=0)])
        pieces = await inbox.get()  # the long one runs
        engine.submit([Completion(TOKENIZER.encode("ab"), 1, inbox, GREEDY, index=1)])
        while not any(p.finish_reason for i, p in pieces if i == 0):
            pieces += await asyncio.wait_for(inbox.get(), 30)
        await asyncio.sleep(0.1)  # anything more that was coming has come
        return pieces + inbox.items

    pieces = run_engine(joined)
    assert [p.finish_reason for i, p in pieces if i == 0 and p.finish_reason] == ["error"]
    assert [p.finish_reason for i, p in pieces if i == 1] == ["length"]


def test_an_engine_that_cannot_recover_from_a_failed_step_answers_503_and_health_says_so(monkeypatch):
    """A step fails and so does the cleanup after it (the cache's realign): the engine's thread cannot go on.
    The request it held, and every later one, get a 503 JSON error at once (none hangs); /health is 503."""
    def failing_step(self):
        raise RuntimeError("out of memory")

    def failing_realign(self, slots, length):
        raise RuntimeError("the cache cannot be realigned")

    monkeypatch.setattr(Engine, "step", failing_step)
    monkeypatch.setattr(BatchCache, "realign", failing_realign)
    body = {"prompt": "a", "max_tokens": 3}
    with running(tiny_app()) as url, httpx.Client(base_url=url, timeout=10) as http:
        held = http.post("/v1/completions", json=body)
        health = http.get("/health")
        later = [http.post("/v1/completions", json=body), http.post("/v1/completions", json={**body, "stream": True})]
    for r in [held, *later]:
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and "the cache cannot be realigned" in error["message"]
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert "the cache cannot be realigned" in health.json()["error"]


def test_submit_refuses_more_than_the_free_rows_and_the_queue():
    from gpt2train.serve.engine import QueueFull

    async def overfill():
        engine = tiny_engine(max_batch=2, max_queue=1)  # not started: nothing leaves the queue
        inbox = Inbox()
        engine.submit([Completion([1], 5, inbox), Completion([1], 5, inbox)])  # the two free rows
        engine.submit([Completion([1], 5, inbox)])  # the waiting place
        with pytest.raises(QueueFull):
            engine.submit([Completion([1], 5, inbox)])
        with pytest.raises(ValueError, match="out of range"):  # the app crops a prompt longer than the context
            engine.submit([Completion([1] * (CONTEXT + 1), 5, inbox)])

    asyncio.run(overfill())


def steps_by_hand(engine: Engine, steps: int) -> None:
    """`steps` of the engine's loop, run here rather than in its thread: the test sees the state between them."""
    with torch.no_grad():
        for _ in range(steps):
            engine.step()


def test_a_completion_cancelled_while_waiting_leaves_the_queue_by_the_next_step():
    """One row, busy; one waiting place, taken by a completion whose client then leaves: by the next step it
    no longer waits, so the queue depth is 0 and the place is free for another (no spurious 429)."""
    from gpt2train.serve.engine import QueueFull

    async def cancelled_while_waiting():
        engine = tiny_engine(max_batch=1, max_queue=1)  # not started: the test runs its steps
        inbox = Inbox()
        engine.submit([Completion(TOKENIZER.encode("h"), CONTEXT - 1, inbox, GREEDY)])
        steps_by_hand(engine, 1)  # it takes the row
        gone = Completion(TOKENIZER.encode("a"), 5, inbox, GREEDY)
        engine.submit([gone])
        with pytest.raises(QueueFull):
            engine.submit([Completion(TOKENIZER.encode("b"), 5, inbox, GREEDY)])
        gone.cancel()
        steps_by_hand(engine, 1)
        assert engine.running == 1 and engine.queued == 0
        engine.submit([Completion(TOKENIZER.encode("b"), 5, inbox, GREEDY)])

    asyncio.run(cancelled_while_waiting())


def test_submit_counts_the_rows_taken_at_this_step_but_not_yet_prefilled(monkeypatch):
    """Two rows, no waiting place; one completion admitted, its prefill about to run: one row is left, so one
    more completion may come, not two."""
    from gpt2train.serve.engine import QueueFull

    checked = []
    prefill = Engine.prefill

    def submitting_first(self, new):
        inbox = new[0].inbox
        with pytest.raises(QueueFull):
            self.submit([Completion([1], 5, inbox), Completion([2], 5, inbox)])
        self.submit([Completion([1], 5, inbox)])
        checked.append(True)
        return prefill(self, new)

    monkeypatch.setattr(Engine, "prefill", submitting_first)

    async def admitted():
        engine = tiny_engine(max_batch=2, max_queue=0)  # not started: the test runs its step
        engine.submit([Completion(TOKENIZER.encode("a"), 5, Inbox(), GREEDY)])
        steps_by_hand(engine, 1)
        assert checked and engine.running == 1 and engine.queued == 1

    asyncio.run(admitted())


# ---------------------------------------------------------------- the app, in process


@pytest.fixture(scope="module")
def client():
    with TestClient(tiny_app(max_batch=4, max_queue=4, max_body_bytes=4096)) as client:
        wait_ready(client)
        yield client


def test_completion_answers_in_openai_shape(client):
    model = tiny_model()
    r = client.post("/v1/completions", json={"prompt": ["abc", "h"], "max_tokens": 12, "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "tiny"
    want = [greedy(model, "abc", 12)] * 2 + [greedy(model, "h", 12)] * 2
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == \
        [(i, text, reason) for i, (text, reason) in enumerate(want)]
    tokens = sum(len(text) + (reason == "stop") for text, reason in want)  # a char is a token; EOT counts
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": tokens, "total_tokens": 4 + tokens}


def test_stream_sends_openai_events_ending_with_done(client):
    want, reason = greedy(tiny_model(), "bad", 20)
    with client.stream("POST", "/v1/completions", json={"prompt": "bad", "max_tokens": 20, "temperature": 0,
                                                         "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == want
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == reason
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(want) + (reason == "stop")


def test_models_health_metrics_and_the_page(client):
    assert client.get("/health").json() == {"status": "ok", "model": "tiny"}
    assert client.head("/health").status_code == 200  # was 405: uptime checks that send HEAD saw it down
    model = client.get("/v1/models").json()["data"][0]
    assert model["id"] == "tiny" and model["context_length"] == CONTEXT and model["chat"] is False
    assert model["max_tokens"] == CONTEXT  # serve --max-tokens left out: the context
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 0})
    metrics = client.get("/metrics").text
    for name in ('gpt2train_requests_total{status="200"}', 'gpt2train_requests_total{status="400"}',
                 "gpt2train_prompt_tokens_total", "gpt2train_completion_tokens_total", "gpt2train_queue_depth",
                 "gpt2train_batch_rows", "gpt2train_time_to_first_token_seconds_bucket",
                 "gpt2train_inter_token_latency_seconds_bucket"):
        assert name in metrics, name


BAD = [  # (body, the field named)
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "a", "temperature": -0.1}, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_k": -1}, "top_k"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 9}, "n"),  # more than --max-batch + --max-queue (8)
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "stop": 3}, "stop"),
    ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": "a", "seed": 2**31}, "seed"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "stream_options": {"x": 1}}, "stream_options"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
    ({"prompt": "a", "logprobs": 2}, "logprobs"),
    ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "a", "color": "red"}, "color"),
    ({"prompt": "a", "model": 3}, "model"),
    ({"prompt": "XYZ"}, "prompt"),  # characters the char tokenizer has no id for
]


@pytest.mark.parametrize("body, field", BAD, ids=[json.dumps(b)[:40] for b, _ in BAD])
def test_a_bad_field_is_a_400_naming_it(client, body, field):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"] and len(error["message"].splitlines()) == 1


def test_past_the_context_the_api_slides_and_crops_a_long_prompt_as_sample_does():
    """Not refused (they were 400s): max_tokens past the context slides the window, where the server's limit
    (serve --max-tokens) is above the context, and a prompt longer than the context is cropped to its last 48
    tokens, which the usage says (prompt_tokens_cropped)."""
    model = tiny_model()
    with TestClient(tiny_app(max_tokens=CONTEXT + 10)) as client:
        wait_ready(client)
        past_the_context(client, model)


def past_the_context(client, model) -> None:
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": CONTEXT + 10, "temperature": 0})
    assert r.status_code == 200, r.text
    assert (r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]) == greedy(model, "abc", CONTEXT + 10)
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": CONTEXT + 10, "total_tokens": CONTEXT + 13}

    long = "dead beef " * 6  # 60 tokens: the first 12 are cropped
    r = client.post("/v1/completions", json={"prompt": [long, "ab"], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [greedy(model, long[12:], 8)[0], greedy(model, "ab", 8)[0]]
    assert r.json()["usage"] == {"prompt_tokens": CONTEXT + 2, "completion_tokens": 16, "total_tokens": CONTEXT + 18,
                                 "prompt_tokens_cropped": 12}


def limit_message(param: str, asked: int, limit: int) -> str:
    return f"{param} {asked} is above this server's limit of {limit} tokens per request (serve --max-tokens)"


def test_max_tokens_above_the_servers_limit_is_a_400_naming_it(client, chat_client):
    """A request bounded by serve --max-tokens, by default the context: max_tokens 1e9 was taken, and past the
    context the window slid until the client hung up, holding a row. At the limit it is served; above it, a 400
    naming the field and the limit, for completions and chat alike."""
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": CONTEXT, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == CONTEXT, r.text
    for path, c, body in [("/v1/completions", client, {"prompt": "a"}), ("/v1/chat/completions", chat_client,
                                                                          {"messages": ONE})]:
        for field in ["max_tokens", "max_completion_tokens"] if c is chat_client else ["max_tokens"]:
            for asked in (CONTEXT + 1, 1_000_000_000):
                r = c.post(path, json={**body, field: asked, "stream": True})
                assert r.status_code == 400, r.text
                assert r.json()["error"] == {"message": limit_message(field, asked, CONTEXT), "code": 400,
                                             "type": "invalid_request_error", "param": field}


def test_a_limit_below_the_defaults_bounds_what_is_left_out():
    """serve --max-tokens below a completion's default of 16 and below what the context leaves a chat reply: a
    request that leaves max_tokens out gets the limit, not a 400 for a number it did not send."""
    # One app at a time: each loads its model on a thread of its own after torch.manual_seed(0), and two loads at
    # once drew from the one global generator in turn, giving both other weights than tiny_model()'s
    with TestClient(tiny_app(max_tokens=4)) as client:
        wait_ready(client)
        assert client.get("/v1/models").json()["data"][0]["max_tokens"] == 4
        r = client.post("/v1/completions", json={"prompt": "a", "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy(tiny_model(), "a", 4)[0]
    with TestClient(tiny_chat_app(max_tokens=4)) as chat:
        wait_ready(chat)
        r = chat.post("/v1/chat/completions", json={"messages": ONE, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4, r.text
        prompt = render_prompt(CHAT_TOKENIZER, ONE)
        want, reason, tokens = continuation(tiny_chat_model(), CHAT_TOKENIZER, prompt, 4, CHAT_TOKENIZER.im_end_id)
        assert (r.json()["choices"][0]["message"]["content"], r.json()["usage"]["completion_tokens"]) == (want, tokens)
        r = chat.post("/v1/chat/completions", json={"messages": ONE, "max_tokens": 5})
        assert r.status_code == 400 and r.json()["error"]["message"] == limit_message("max_tokens", 5, 4)


def test_more_prompts_than_the_server_takes_are_refused_before_any_is_encoded(monkeypatch):
    """Encoding costs CPU for every prompt: a body of a hundred thousand prompts (within the default
    body limit) was tokenized in full, holding every other request up, before its count was refused."""
    from gpt2train.serve import app as app_module

    def no_encoding(*args, **kwargs):
        raise AssertionError("encoded the prompts of a request refused by its count")

    monkeypatch.setattr(app_module, "encode_prompts", no_encoding)
    with TestClient(tiny_app(max_batch=4, max_queue=4)) as client:
        wait_ready(client)
        r = client.post("/v1/completions", json={"prompt": ["a"] * 100_000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_neutral_values_of_openai_fields_are_accepted(client):
    body = {"prompt": "a", "max_tokens": 2, "model": "anything", "user": "u", "echo": False, "logprobs": None,
            "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "suffix": None,
            "stop": None, "seed": None, "n": None}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/completions", json={**body, "echo": None}).status_code == 200  # null is the default


# Refusals in the words the hand-written checks used before the pydantic model: its errors are translated,
# not passed through ("Input should be a valid integer", one error per member of a union).
WORDED = [  # (body, param, message)
    ({"prompt": "a", "max_tokens": 2.0}, "max_tokens", "max_tokens must be an integer, not a number"),
    ({"prompt": "a", "temperature": True}, "temperature", "temperature must be a number, not a boolean"),
    ({"prompt": "a", "stream": 1}, "stream", "stream must be true or false, not an integer"),
    ({"prompt": "a", "user": ["u"]}, "user", "user must be a string, not a list"),
    ({"prompt": "a", "top_p": 0}, "top_p", "top_p 0 is out of range; it must be in (0, 1]"),  # the number as sent
    ({"prompt": "a", "temperature": 10**400}, "temperature", "temperature is too large"),  # past a float's range
    ({}, "prompt", "prompt is required: a string or a list of strings"),
    ({"prompt": None}, "prompt", "prompt must be a string or a non-empty list of strings (token ids are not taken)"),
    ({"prompt": ["a", 1]}, "prompt", "prompt must be a string or a non-empty list of strings (token ids are not taken)"),
    ({"prompt": "a", "stop": ["a", None]}, "stop", "stop must be a string or a list of up to 4 strings"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage",
     "include_usage must be true or false, not a string"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options",
     'stream_options must be an object like {"include_usage": true}'),
    ({"prompt": "a", "echo": 0}, "echo", "echo is not supported; leave it out or give null or false"),  # 0 is no false
    ({"prompt": "a", "color": None}, "color", "unknown field 'color'; this server takes prompt, max_tokens, "
     "temperature, top_p, top_k, n, stop, stream, stream_options, seed (and ignores model, user)"),  # null too
    (["a"], None, "the body must be a JSON object, not a list"),
]


@pytest.mark.parametrize("body, param, message", WORDED, ids=[json.dumps(b)[:40] for b, _, _ in WORDED])
def test_a_refusal_says_what_the_field_takes_in_one_line(client, body, param, message):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": 400}}


# ---------------------------------------------------------------- chat, in process

HELLO = [{"role": "system", "content": "be"}, {"role": "user", "content": "abc"}]  # 35 tokens of the 48


@pytest.fixture(scope="module")
def chat_client():
    with TestClient(tiny_chat_app()) as client:
        wait_ready(client)
        yield client


def chat_chunks(client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


def test_chat_replies_after_the_template_in_openai_shape_whole_and_streamed(chat_client):
    """The reply is generate's continuation of render_prompt's ids, up to <|im_end|>; n greedy choices are alike;
    streamed, the first delta of each choice names the role and the deltas' contents make the same text."""
    ids = render_prompt(CHAT_TOKENIZER, HELLO)
    assert len(ids) + 12 <= CONTEXT  # nothing dropped
    text, reason, tokens = continuation(tiny_chat_model(), CHAT_TOKENIZER, ids, 12, CHAT_TOKENIZER.im_end_id)
    r = chat_client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 12, "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == "tiny-chat"
    assert body["choices"] == [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                "finish_reason": reason} for i in range(2)]
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 2 * tokens,
                             "total_tokens": len(ids) + 2 * tokens}

    chunks = chat_chunks(chat_client, {"messages": HELLO, "max_completion_tokens": 12, "temperature": 0,
                                       "stream_options": {"include_usage": True}})
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and chunks[-1]["choices"] == []
    deltas = [c["choices"][0] for c in chunks[:-1]]
    assert deltas[0]["delta"]["role"] == "assistant" and all("role" not in d["delta"] for d in deltas[1:])
    assert "".join(d["delta"].get("content", "") for d in deltas) == text
    assert [d["finish_reason"] for d in deltas] == [None] * (len(deltas) - 1) + [reason]
    assert chunks[-1]["usage"]["completion_tokens"] == tokens
    assert chat_client.get("/v1/models").json()["data"][0]["chat"] is True


def test_a_chat_reply_without_max_tokens_may_fill_the_context_and_a_long_one_drops_the_oldest_messages(chat_client):
    """Without max_tokens the reply gets what the prompt leaves of the context. With it, the conversation must fit
    the context less max_tokens: its oldest messages are dropped (the system message kept), and the usage says how
    many (prompt_messages_dropped)."""
    model, end = tiny_chat_model(), CHAT_TOKENIZER.im_end_id
    talk = [{"role": "user", "content": "sun sun sun sun"}]  # 35 tokens, whose greedy reply runs on
    ids = render_prompt(CHAT_TOKENIZER, talk)
    text, reason, tokens = continuation(model, CHAT_TOKENIZER, ids, CONTEXT - len(ids), end)
    assert (reason, tokens) == ("length", CONTEXT - len(ids))
    r = chat_client.post("/v1/chat/completions", json={"messages": talk, "temperature": 0})
    assert r.json()["choices"][0]["message"]["content"] == text and r.json()["usage"]["completion_tokens"] == tokens
    assert r.json()["choices"][0]["finish_reason"] == "length"
    long = [HELLO[0]] + [{"role": role, "content": f"{word} beef"} for word in ("abc", "dead", "cafe", "bad", "fade")
                         for role in ("user", "assistant")][:-1]
    fitted, dropped = fit_prompt(CHAT_TOKENIZER, long, CONTEXT - 10)
    assert dropped > 0
    r = chat_client.post("/v1/chat/completions", json={"messages": long, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == continuation(model, CHAT_TOKENIZER, fitted, 10, end)[0]
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(fitted) and usage["prompt_messages_dropped"] == dropped


ONE = [{"role": "user", "content": "hi"}]
CHAT_BAD = [  # (body, param, words in the message)
    ({}, "messages", "messages is required"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": "hi"}, "messages", "non-empty list"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "messages", "message 0 has role 'bot'; use one of system"),
    ({"messages": [{"role": "user"}]}, "messages", 'message 0 (user) has no text "content"'),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "messages",
     "the last message is the assistant's"),
    ({"messages": [{"role": "user", "content": "XYZ"}]}, "messages", "cannot be encoded"),
    ({"messages": [{"role": "user", "content": "a" * CONTEXT}], "max_tokens": 4}, "messages", "lower max_tokens"),
    ({"messages": ONE, "max_tokens": CONTEXT}, "max_tokens", "leaves no room for the conversation"),
    ({"messages": ONE, "max_tokens": 2, "max_completion_tokens": 2}, "max_completion_tokens", "not both"),
    ({"messages": ONE, "max_completion_tokens": 0}, "max_completion_tokens", "out of range"),
    ({"messages": ONE, "temperature": -1}, "temperature", "out of range"),
    ({"messages": ONE, "n": 9}, "n", "at most 8"),
    ({"messages": ONE, "logprobs": True}, "logprobs", "not supported"),
    ({"messages": ONE, "prompt": "a"}, "prompt", "unknown field 'prompt'; this server takes messages, "
     "max_completion_tokens, max_tokens, temperature, top_p, top_k, n, stop, stream, stream_options, seed"),
]


@pytest.mark.parametrize("body, param, words", CHAT_BAD, ids=[json.dumps(b)[:40] for b, _, _ in CHAT_BAD])
def test_a_bad_chat_request_is_a_400_naming_the_field(chat_client, body, param, words):
    r = chat_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and len(error["message"].splitlines()) == 1


def test_chat_with_a_model_without_the_template_is_a_400_saying_what_to_do(client):
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": ONE})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    message = r.json()["error"]["message"]
    assert "not fine-tuned on conversations" in message and "/v1/completions" in message and "prepare chat" in message


def test_the_api_key_is_checked_before_the_body():
    """The body is read by the route's own dependency, after the key's: FastAPI reads a declared body before
    any dependency runs, so a client without the key would learn what is wrong with its body (and have it read
    whole, past the size limit) before being told of the key."""
    with TestClient(tiny_app(api_key="s3cret", max_body_bytes=4096)) as client:
        wait_ready(client)
        for content, content_type in [(b"{not json", "application/json"), (b'{"prompt": 5}', "application/json"),
                                      (json.dumps({"prompt": "a" * 5000}).encode(), "application/json"),
                                      (b'{"prompt": "a"}', "text/plain")]:
            r = client.post("/v1/completions", content=content, headers={"content-type": content_type})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text


def test_a_bad_request_is_told_so_while_the_model_loads():
    """The request is checked before the engine is asked for: a bad one gets its 400 at once, a good one the
    503 that says to come back."""
    loaded = threading.Event()

    def slow_load():
        loaded.wait(30)
        return tiny_engine()

    with TestClient(create_app(slow_load, model_id="tiny")) as client:
        try:
            bad = client.post("/v1/completions", json={"prompt": "a", "max_tokens": "3"})
            good = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
        finally:
            loaded.set()
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert good.status_code == 503 and good.headers["retry-after"] == "5"


def test_an_error_that_quotes_the_request_is_still_a_400():
    """A field named by a lone surrogate was a 500: its name went into `param`, which UTF-8 cannot encode."""
    with TestClient(tiny_app(), raise_server_exceptions=False) as client:
        wait_ready(client)
        r = client.post("/v1/completions", content=b'{"prompt": "a", "\\ud800": 1}')
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "\ud800" and "unknown field" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": "XYZ"})  # the tokenizer's message, not its repr
        assert r.json()["error"]["message"] == ("prompt 0 cannot be encoded: character 'X' is not in this char "
                                                "tokenizer's vocabulary")


def test_a_prompt_being_encoded_holds_up_no_other_request():
    """Encoding ran on the event loop: one long prompt stalled /health and every other client until it was done.
    Here encoding waits until /health has answered; on the loop it would wait for ever (10 s, then fail)."""
    entered, released = threading.Event(), threading.Event()
    app = tiny_app()
    with running(app) as url:
        tokenizer = app.state.served.engine.tokenizer
        encode = tokenizer.encode

        def slow_encode(text):
            entered.set()
            released.wait(10)
            return encode(text)

        tokenizer.encode = slow_encode
        try:
            done = []
            post = threading.Thread(target=lambda: done.append(httpx.post(
                f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 2}, timeout=60)))
            post.start()
            assert entered.wait(30)
            health = httpx.get(f"{url}/health", timeout=5)
            answered_while_encoding = not released.is_set()
            released.set()
            post.join()
        finally:
            tokenizer.encode = encode
    assert health.status_code == 200 and answered_while_encoding
    assert done[0].status_code == 200, done[0].text


def test_a_client_that_leaves_before_its_body_arrived_is_no_server_error(caplog):
    """It was a 500, with a traceback in the log, counted in the 500s of /metrics."""
    import socket

    app = tiny_app()
    with running(app) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        deadline = time.monotonic() + 30
        while 'status="499"' not in (metrics := httpx.get(f"{url}/metrics").text):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.02)
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    assert 'status="500"' not in metrics
    assert "internal error" not in caplog.text


def test_a_model_is_found_by_its_id(client):
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"[" * 2000 + b"]" * 2000, b"\xff\xfe{}",
                                  b'{"prompt": "\\ud800"}'],
                         ids=["not json", "an array", "nested 2000 deep", "not UTF-8", "a lone surrogate"])
def test_a_body_that_is_not_a_json_object_is_a_400(client, body):
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("content_type, status", [("text/plain", 415), ("application/x-www-form-urlencoded", 415),
                                                  ("multipart/form-data; boundary=x", 415), ("", 415),
                                                  ("application/json; charset=utf-8", 200), (None, 200)])
def test_a_body_declared_as_anything_but_json_is_a_415(client, content_type, status):
    """A web page of another site can make the user's browser POST text/plain or a form to a local server
    without asking (no CORS preflight), and made it compute; application/json needs the server's consent."""
    headers = {} if content_type is None else {"content-type": content_type}
    r = client.post("/v1/completions", content=b'{"prompt": "a", "max_tokens": 2}', headers=headers)
    assert r.status_code == status, r.text
    if status == 415:
        assert "Content-Type: application/json" in r.json()["error"]["message"]


def test_a_body_over_the_limit_is_a_413_declared_or_not(client):
    big = json.dumps({"prompt": "a" * 5000}).encode()
    assert client.post("/v1/completions", content=big).status_code == 413
    chunked = client.post("/v1/completions", content=iter([big[:3000], big[3000:]]))  # no Content-Length
    assert chunked.status_code == 413 and "exceeds" in chunked.json()["error"]["message"]


def test_unknown_paths_and_methods_answer_json(client):
    assert client.get("/v1/nothing").json()["error"]["code"] == 404
    assert client.get("/v1/completions").status_code == 405


def test_the_api_key_guards_v1_but_not_health(monkeypatch):
    with TestClient(tiny_app(api_key="s3cret")) as client:
        wait_ready(client)
        body = {"prompt": "a", "max_tokens": 2}
        assert client.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and API_KEY_ENV in r.json()["error"]["message"]
        assert client.get("/v1/models").status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert client.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert client.get("/v1/models", headers=ok).status_code == 200


def test_health_is_503_until_the_model_is_loaded():
    loaded = threading.Event()

    def slow_load():
        loaded.wait(30)
        return tiny_engine()

    with TestClient(create_app(slow_load, model_id="tiny")) as client:
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 503 and r.json()["error"]["message"] == "the model is loading"
        loaded.set()
        wait_ready(client)
        assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


def test_shutdown_waits_for_a_model_still_loading():
    """A server stopped while its model loads (uvicorn stops at once when it cannot listen) waits for the loading
    thread: exiting under it, inside torch, made glibc abort the process ("FATAL: exception not rethrown", exit
    -6) in about 1 of 3 runs of tests/test_serve_clients.py's port-in-use case."""
    release = threading.Event()
    stopped = []

    def slow_load():
        release.wait(30)
        engine = tiny_engine()
        stopped.append(engine)
        return engine

    threading.Timer(0.5, release.set).start()
    with TestClient(create_app(slow_load, model_id="tiny")) as client:
        assert client.get("/health").status_code == 503
    assert release.is_set() and len(stopped) == 1  # the shutdown returned after the load, not before
    assert not stopped[0].thread.is_alive()  # and stopped the engine the load made


def test_a_kv_cache_too_large_for_the_device_says_to_lower_max_batch():
    """It was an internal error naming the bytes torch could not allocate."""
    from gpt2train.ranges import UsageError

    with pytest.raises(UsageError) as e:
        Engine(tiny_model(), TOKENIZER, max_batch=10**12, compile=False)
    assert str(e.value) == ("the KV cache of --max-batch 1000000000000 rows of 48 tokens needs 22,888,183.6 GiB, "
                            "which cpu cannot hold; lower --max-batch")  # 2 (k, v) x 2 layers x 10^12 x 48 x 32 x 4 B


def test_a_model_that_fails_to_load_is_reported_by_health():
    def broken():
        raise FileNotFoundError("no weights here")

    with TestClient(create_app(broken, model_id="tiny")) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = client.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "failed", "error": "FileNotFoundError: no weights here"}


# ---------------------------------------------------------------- what --ckpt takes


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """(its checkpoints/step_* folder, the model, its tokenizer): a tiny model with a byte-level BPE of its own
    (the char tokenizer has no Hugging Face form), saved as a run."""
    root = tmp_path_factory.mktemp("bpe_run")
    tokenizer = train_bpe(["a bad cafe fed a dead beef; the cafe had a bad egg\n" * 20], 300, root / "tokenizer.json")
    model = tiny_model(vocab_size=tokenizer.vocab_size)
    return save_tiny_run(root / "run", model, tokenizer), model, tokenizer


@pytest.mark.parametrize("form", ["checkpoints/step_*", "export-hf"])
def test_serve_takes_a_checkpoint_folder_and_a_hugging_face_folder(bpe_run, tmp_path, form):
    """--ckpt takes a run directory (the client tests), one checkpoint of it, or the Hugging Face folder that
    `export-hf` makes of it: each serves the model's greedy text with its own tokenizer."""
    step_folder, model, tokenizer = bpe_run
    ckpt = step_folder
    if form == "export-hf":
        ckpt = tmp_path / "hf"
        assert cli.main(["export-hf", "--ckpt", str(step_folder.parent.parent), "--out", str(ckpt)]) == 0
        assert (ckpt / "config.json").is_file() and (ckpt / "tokenizer.json").is_file()
    load = engine_loader(ckpt, torch.device("cpu"), torch.float32, compile=False)
    with TestClient(create_app(load, model_id=str(ckpt))) as client:
        wait_ready(client)
        r = client.post("/v1/completions", json={"prompt": "a bad", "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == greedy(model, "a bad", 12, tokenizer)
    assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode("a bad"))


# ---------------------------------------------------------------- a real server, in a thread


def test_a_full_queue_is_a_429(monkeypatch):
    """One row and one waiting place, the engine held before its first step: the third request is refused, as
    the openai package sees it (a RateLimitError, which it would retry after Retry-After)."""
    gate = threading.Event()
    step = Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: (gate.wait(30), step(self)))
    app = tiny_app(max_batch=1, max_queue=1)

    async def three(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            body = {"prompt": "a", "max_tokens": 3}
            first = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(2)]
            engine = app.state.served.engine
            while engine.queued < 2:
                await asyncio.sleep(0.01)
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.RateLimitError) as e:
                await client.completions.create(model="tiny", **body)
            await client.close()
            refused = e.value.response
            gate.set()
            return refused, await asyncio.gather(*first)

    with running(app) as url:
        refused, served = asyncio.run(three(url))
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert refused.json()["error"]["message"] == ("the server is busy (2 completion(s) wait and 1 more do not fit: "
                                                  "1 free row(s) and 1 waiting place(s) take at most 2); retry later")
    assert [r.status_code for r in served] == [200, 200]


def test_a_client_that_disconnects_mid_stream_frees_its_row_within_one_decode_step(monkeypatch):
    """A stream beside another request: its client reads the first piece, then closes the connection while
    the engine is inside the first decode step that holds the stream's row (held there until the server
    has seen the client leave). That step is the last one the row is in; the other request decodes on."""
    decoded: list[tuple[int, set]] = []  # (the engine's step count when a decode began, the completions in it)
    cancelled_at: dict[Completion, int] = {}
    arrived, inside, left = threading.Event(), threading.Event(), threading.Event()
    decode, cancel = Engine.decode, Completion.cancel
    app = tiny_app(max_batch=4)
    streamed = CONTEXT - 3  # the stream's max_tokens tells its completion apart

    def recording_decode(self, n):
        completions = {row.completion for row in self.rows[:n]}
        decoded.append((self.steps, completions))
        if not arrived.wait(30):  # the other request's first steps wait for the stream to be sent
            raise TimeoutError("the stream did not arrive")
        if any(c.max_tokens == streamed for c in completions) and not inside.is_set():
            inside.set()
            left.wait(30)
        return decode(self, n)

    def recording_submit(self, completions, submit=Engine.submit):
        submit(self, completions)
        if completions[0].max_tokens == streamed:
            arrived.set()

    def recording_cancel(self):
        cancelled_at.setdefault(self, app.state.served.engine.steps)
        cancel(self)

    monkeypatch.setattr(Engine, "decode", recording_decode)
    monkeypatch.setattr(Engine, "submit", recording_submit)
    monkeypatch.setattr(Completion, "cancel", recording_cancel)
    with running(app) as url:
        engine = app.state.served.engine
        deadline = time.monotonic() + 30
        other = threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                                 kwargs={"json": {"prompt": "h", "max_tokens": CONTEXT - 1, "temperature": 0},
                                         "timeout": 60})
        other.start()
        while engine.running < 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        with httpx.Client(base_url=url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": streamed,
                                                               "stream": True, "temperature": 0}) as r:
                lines = r.iter_lines()  # kept: a dropped iterator closes the response
                assert next(lines).startswith("data: ")  # the prefill's piece
                assert inside.wait(30) and engine.running == 2
            # the response is closed: the connection drops mid-stream
            while not cancelled_at:
                assert time.monotonic() < deadline, "the server did not notice the client leave"
                time.sleep(0.001)
            left.set()
        (gone, at), = cancelled_at.items()
        while engine.running > 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert gone.max_tokens == streamed and engine.running == 1
        other.join()
    assert [step for step, completions in decoded if gone in completions] == [at]  # the held step alone
    assert any(step > at for step, _ in decoded)  # the other request kept decoding after it left


def test_greedy_float32_through_http_matches_generate_for_concurrent_clients():
    """Concurrent HTTP clients of different lengths: each answer is its prompt's `generate` alone."""
    model = tiny_model()
    prompts = [("abc", 30), ("h", 12), ("bad cafe\nge", 20), ("dead", 9), ("c", 40), ("fed", 7)]

    async def all_at_once(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={"prompt": p, "max_tokens": n,
                                                                              "temperature": 0}) for p, n in prompts))

    with running(tiny_app(max_batch=4)) as url:
        answers = asyncio.run(all_at_once(url))
    got = [(a.json()["choices"][0]["text"], a.json()["choices"][0]["finish_reason"]) for a in answers]
    assert got == [greedy(model, p, n) for p, n in prompts]


def test_bf16_weights_serve_too():
    with TestClient(create_bf16_app()) as client:
        wait_ready(client)
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 5, "temperature": 0.7, "seed": 1})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def create_bf16_app():
    return create_app(lambda: tiny_engine(model=tiny_model(torch.bfloat16)), model_id="tiny-bf16")
