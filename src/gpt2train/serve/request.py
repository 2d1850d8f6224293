"""A completion request's fields, checked: the JSON body of OpenAI's POST /v1/completions (plus top_k) into
a CompletionRequest, or a BadRequest whose one-line message names the field. The numbers take the
ranges `gpt2train sample` takes (ranges.py); what needs the tokenizer and the model (the prompt's length
against the context) is checked by the app."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gpt2train.ranges import NEW_TOKENS, SAMPLES, SEEDS, TEMPERATURES, TOP_K, TOP_P, Range

MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 200  # each is looked for in the text after every token

# OpenAI's fields that change nothing at these values: accepted there, refused (not ignored) elsewhere.
NEUTRAL = {"echo": (None, False), "logprobs": (None,), "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
           "presence_penalty": (None, 0), "frequency_penalty": (None, 0)}
IGNORED = ("model", "user")  # any string: one model is served, and users are not told apart
FIELDS = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stream", "stream_options", "seed")


class BadRequest(ValueError):
    """A request's fault, answered with 400 and this message; `param` names the field."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class CompletionRequest:
    prompts: list[str]
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # not OpenAI's: 0 is no limit
    n: int = 1  # completions of each prompt
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    seed: int | None = None

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


def parse_completion_request(data) -> CompletionRequest:
    if not isinstance(data, dict):
        raise BadRequest(None, f"the body must be a JSON object, not {kind(data)}")
    for name in data:
        check_known(name, data[name])
    if "prompt" not in data:
        raise BadRequest("prompt", "prompt is required: a string or a list of strings")
    stream_options = options(data.get("stream_options"))
    if stream_options and data.get("stream") is not True:
        raise BadRequest("stream_options", "stream_options is taken only with stream: true")
    return CompletionRequest(
        prompts=prompts(data["prompt"]),
        max_tokens=integer(data, "max_tokens", NEW_TOKENS, 16),
        temperature=number(data, "temperature", TEMPERATURES, 1.0),
        top_p=number(data, "top_p", TOP_P, 1.0),
        top_k=integer(data, "top_k", TOP_K, 0),
        n=integer(data, "n", SAMPLES, 1),
        stop=stops(data.get("stop")),
        stream=boolean(data, "stream"),
        include_usage=boolean(stream_options, "include_usage"),
        seed=integer(data, "seed", SEEDS, None),
    )


def check_known(name: str, value) -> None:
    if name in FIELDS:
        return
    if name in IGNORED:
        if value is not None and not isinstance(value, str):
            raise BadRequest(name, f"{name} must be a string, not {kind(value)}")
        return
    if name in NEUTRAL:
        if not any(same(value, allowed) for allowed in NEUTRAL[name]):
            shown = " or ".join(json.dumps(v) for v in NEUTRAL[name])
            raise BadRequest(name, f"{name} is not supported; leave it out or give {shown}")
        return
    raise BadRequest(name, f"unknown field {name!r}; this server takes {', '.join(FIELDS)} (and ignores model, user)")


def same(value, allowed) -> bool:
    """Equal as JSON values: 0.0 is 0, but false is not 0."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    return value == allowed


def kind(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)


def integer(data: dict, name: str, allowed: Range, default):
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(name, f"{name} must be an integer, not {kind(value)}")
    if value not in allowed:
        raise BadRequest(name, f"{name} {value} is out of range; it must be {allowed}")
    return value


def number(data: dict, name: str, allowed: Range, default: float) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(name, f"{name} must be a number, not {kind(value)}")
    if value not in allowed:
        raise BadRequest(name, f"{name} {value} is out of range; it must be {allowed}")
    try:
        return float(value)
    except OverflowError:  # an integer beyond float's range
        raise BadRequest(name, f"{name} is too large") from None


def boolean(data: dict, name: str) -> bool:
    value = data.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(name, f"{name} must be true or false, not {kind(value)}")
    return value


def prompts(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        return value
    raise BadRequest("prompt", "prompt must be a string or a non-empty list of strings (token ids are not taken)")


def stops(value) -> tuple[str, ...]:
    if value is None:
        return ()
    found = [value] if isinstance(value, str) else value
    if not isinstance(found, list) or not all(isinstance(s, str) for s in found):
        raise BadRequest("stop", f"stop must be a string or a list of up to {MAX_STOPS} strings")
    if len(found) > MAX_STOPS:
        raise BadRequest("stop", f"stop has {len(found)} strings; at most {MAX_STOPS} are taken")
    if not all(0 < len(s) <= MAX_STOP_CHARS for s in found):
        raise BadRequest("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return tuple(found)


def options(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise BadRequest("stream_options", 'stream_options must be an object like {"include_usage": true}')
    return value
