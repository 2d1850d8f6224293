"""Property-based (hypothesis): generated request bodies thrown at the served app, in process.

Whatever the body (a good request, a field of the wrong type or out of range, an unknown field, bytes that
are no JSON at all), /v1/completions and /v1/chat/completions answer 2xx, or 4xx with a JSON error in OpenAI's
shape; never a 5xx, and the server answers a good request afterwards. Examples are derandomized and few, on a tiny model: the
test takes seconds.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from serving import tiny_app, tiny_chat_app, wait_ready

CHECKS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], max_examples=150)
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stream", "stream_options", "seed",
          "model", "user", "echo", "logprobs", "best_of", "suffix", "logit_bias", "presence_penalty", "frequency_penalty"]

# JSON values of every kind, near the edges of the ranges and far beyond them.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 60), st.integers(), st.floats(allow_nan=False),
                    st.sampled_from([0, 1, 0.5, 1.0, 2**31, -(2**63), 1e-300, 1e308]), st.text(max_size=6),
                    st.text(alphabet="abcdefgh \n", max_size=12), st.just("\udfff"))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                            st.dictionaries(st.text(max_size=5), inner, max_size=4)),
                           max_leaves=10)
# Fields in range most of the time, so that many bodies reach the engine.
good = {
    "prompt": st.one_of(st.text(alphabet="abcdefgh \n", max_size=10),
                        st.lists(st.text(alphabet="abcdefgh", max_size=6), min_size=1, max_size=3),
                        st.text(max_size=4)),  # characters the tokenizer may not have
    "max_tokens": st.integers(1, 12),
    "temperature": st.one_of(st.just(0), st.floats(0, 3)),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(0, 20),
    "n": st.integers(1, 3),
    "stop": st.one_of(st.text(alphabet="abcdefgh", min_size=1, max_size=3),
                      st.lists(st.text(alphabet="abcdefgh", min_size=1, max_size=3), max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "seed": st.integers(0, 2**31 - 1),
}


good_bodies = st.fixed_dictionaries({"prompt": good["prompt"]}, optional={k: v for k, v in good.items() if k != "prompt"})


def one_field_changed(body: dict, name: str, value) -> dict:
    return {**body, name: value}


# Unknown names too, one of them a lone surrogate (JSON can say "\ud800"; UTF-8 cannot): an error quoting it was a 500.
names = st.sampled_from(FIELDS + ["nope", "\ud800", "caf\u00e9"])
bodies = st.one_of(
    good_bodies,
    st.builds(one_field_changed, good_bodies, names, json_values),
    st.dictionaries(names, json_values, max_size=5),
    json_values,
)
raw_bodies = st.one_of(bodies.map(lambda b: json.dumps(b).encode()), st.binary(max_size=40))


# A chat request's: messages of good and bad roles and contents (characters the tokenizer lacks, no text at all).
CHAT_FIELDS = ["messages", "max_completion_tokens", "top_logprobs", "response_format", "tools"] + FIELDS[1:]
def message(roles, contents):
    return st.fixed_dictionaries({"role": st.sampled_from(roles), "content": contents})


texts = st.text(alphabet="abcdemnrstu ", max_size=10)
messages = st.one_of(  # a conversation ending with the user's turn, or messages of any role and content
    st.builds(lambda history, last: [*history, last], st.lists(message(["system", "user", "assistant"], texts), max_size=3),
              message(["user"], texts)),
    st.lists(message(["system", "user", "assistant", "bot"], st.one_of(texts, st.text(max_size=3), scalars)),
             min_size=1, max_size=4))
good_chat_bodies = st.fixed_dictionaries(
    {"messages": messages},
    optional={"max_completion_tokens": good["max_tokens"]} | {k: v for k, v in good.items() if k != "prompt"})
chat_bodies = st.one_of(
    good_chat_bodies,
    st.builds(one_field_changed, good_chat_bodies, st.sampled_from(CHAT_FIELDS + ["nope", "\ud800"]), json_values),
    json_values,
)


@pytest.fixture(scope="module")
def client():
    with TestClient(tiny_app(max_batch=4, max_queue=8), raise_server_exceptions=False) as client:
        wait_ready(client)
        yield client


def answers_properly(response) -> None:
    assert 200 <= response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"] and len(error["message"].splitlines()) == 1
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = response.text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""], response.text
        for event in events[:-2]:
            assert "choices" in json.loads(event.removeprefix("data: "))
    else:
        body = response.json()
        assert all(c["finish_reason"] in ("stop", "length") for c in body["choices"])
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


@pytest.mark.slow
@settings(**CHECKS)
@given(body=raw_bodies)
def test_any_body_gets_a_2xx_or_a_json_4xx(client, body):
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    event(f"status {response.status_code}")
    answers_properly(response)


@settings(**{**CHECKS, "max_examples": 80})
@given(body=chat_bodies)
def test_any_chat_body_gets_a_2xx_or_a_json_4xx(chat_client, body):
    response = chat_client.post("/v1/chat/completions", content=json.dumps(body).encode(),  # JSON's escapes: "\\ud800"
                                headers={"content-type": "application/json"})
    event(f"status {response.status_code}")
    answers_properly(response)


@pytest.fixture(scope="module")
def chat_client():
    with TestClient(tiny_chat_app(), raise_server_exceptions=False) as client:
        wait_ready(client)
        yield client


def test_the_server_still_answers_after_them(client):  # the same client, after the generated bodies
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert client.get("/health").status_code == 200
    metrics = client.get("/metrics").text
    assert 'gpt2train_requests_total{status="500"}' not in metrics
    assert client.app.state.served.engine.running == 0
