"""A request's fields, checked: the JSON bodies of OpenAI's POST /v1/completions and POST /v1/chat/completions
(plus top_k) as pydantic models, CompletionRequest and ChatRequest, on the fields they share (SamplingRequest);
what they refuse is a BadRequest whose one-line message names the field. The numbers take the ranges `gpt2train
sample` takes (ranges.py); what needs the tokenizer (a prompt it cannot encode, a conversation longer than the
context) is checked by the app, and so is what needs the served model: the most tokens a request may ask for
(check_token_limit, with the app's limit: serve --max-tokens, or the model's context)."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
    model_validator,
)

from gpt2train.chat import ConversationError, check_messages
from gpt2train.ranges import NEW_TOKENS, SAMPLES, SEEDS, TEMPERATURES, TOP_K, TOP_P

MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 200  # each is looked for in the text after every token
DEFAULT_MAX_TOKENS = 16  # a completion's max_tokens left out, as OpenAI's

RANGES = {"max_tokens": NEW_TOKENS, "max_completion_tokens": NEW_TOKENS, "temperature": TEMPERATURES, "top_p": TOP_P,
          "top_k": TOP_K, "n": SAMPLES, "seed": SEEDS}
# OpenAI's fields that change nothing at these values: accepted there, refused (not ignored) elsewhere.
NEUTRAL = {"echo": (None, False), "logprobs": (None,), "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
           "presence_penalty": (None, 0), "frequency_penalty": (None, 0)}
CHAT_NEUTRAL = {"logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
                "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "response_format": (None, {"type": "text"}),
                "tools": (None, [])}
IGNORED = ("model", "user")  # any string: one model is served, and users are not told apart
# What a missing required field is told it takes.
REQUIRED = {"prompt": "a string or a list of strings", "messages": 'a non-empty list of {"role", "content"} objects'}
# pydantic's refusals of a value's type, in this server's words: "<field> must be <this>, not <what came>"
TYPES = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false", "string_type": "a string"}


class BadRequest(ValueError):
    """A request's fault, answered with 400 and this message; `param` names the field. A ValueError: raised in
    a validator, pydantic keeps it in its error, where `refusal` finds it again."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def one_message(param: str, message: str) -> WrapValidator:
    """Any fault of the field's value, in any part of it, as one message saying what the field takes
    (pydantic has one error per member of a union, and per item)."""

    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise BadRequest(param, message) from None

    return WrapValidator(validate)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool | None = None  # a last chunk with the usage; null is false

    @model_validator(mode="before")
    @classmethod
    def an_object(cls, data):
        """Anything but an object of include_usage is refused whole, before pydantic reads its keys (one may be
        no text: a lone surrogate)."""
        if not isinstance(data, dict) or set(data) - {"include_usage"}:
            raise BadRequest("stream_options", 'stream_options must be an object like {"include_usage": true}')
        return data


PROMPT = "prompt must be a string or a non-empty list of strings (token ids are not taken)"


class SamplingRequest(BaseModel):
    """What a completion and a chat request share: how many tokens, drawn how, ended by what, streamed or not.
    A subclass adds what it completes and the OpenAI fields it accepts at their neutral values (`neutral`)."""

    # strict: JSON's types as they are (2.0 is no integer, "3" no number, true no 1); an unknown field is
    # refused by known_fields, before pydantic would
    model_config = ConfigDict(strict=True, extra="forbid")
    neutral: ClassVar[dict[str, tuple]] = {}

    max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS (a chat reply: what the context leaves), within the limit
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # not OpenAI's: 0 is no limit
    n: int = 1  # choices (of each prompt)
    stop: Annotated[str | list[str] | None, one_message(
        "stop", f"stop must be a string or a list of up to {MAX_STOPS} strings")] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    # IGNORED: any string
    model: str | None = None
    user: str | None = None

    @classmethod
    def fields_taken(cls) -> list[str]:
        """The fields a request may set, as the refusal of an unknown one lists them: its own first."""
        own = [name for name in cls.model_fields if name not in SamplingRequest.model_fields]
        return [name for name in own + list(SamplingRequest.model_fields) if name not in cls.neutral and name not in IGNORED]

    @model_validator(mode="before")
    @classmethod
    def known_fields(cls, data):
        """An unknown field is refused by its name (pydantic's own refusal fails on a name that is no text, a
        lone surrogate); a field given as null takes its default, as in OpenAI's API (a required one has none)."""
        if not isinstance(data, dict):
            return data  # pydantic refuses it: the body must be an object
        for name in data:
            if name not in cls.model_fields:
                raise BadRequest(name, f"unknown field {name!r}; this server takes {', '.join(cls.fields_taken())} "
                                 f"(and ignores {', '.join(IGNORED)})")
        return {name: value for name, value in data.items() if value is not None or cls.model_fields[name].is_required()}

    @field_validator(*RANGES, mode="wrap", check_fields=False)
    @classmethod
    def in_range(cls, value, handler, info: ValidationInfo):
        checked = handler(value)  # its type first
        allowed = RANGES[info.field_name]
        if value not in allowed:
            raise BadRequest(info.field_name, f"{info.field_name} {value} is out of range; it must be {allowed}")
        return checked

    @field_validator("stop")
    @classmethod
    def few_short_stops(cls, value: str | list[str]) -> list[str]:
        found = [value] if isinstance(value, str) else value
        if len(found) > MAX_STOPS:
            raise BadRequest("stop", f"stop has {len(found)} strings; at most {MAX_STOPS} are taken")
        if not all(0 < len(s) <= MAX_STOP_CHARS for s in found):
            raise BadRequest("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
        return found

    @field_validator(*NEUTRAL, *CHAT_NEUTRAL, check_fields=False)
    @classmethod
    def neutral_value(cls, value, info: ValidationInfo):
        name = info.field_name
        if not any(same(value, allowed) for allowed in cls.neutral[name]):
            shown = " or ".join(json.dumps(v) for v in cls.neutral[name])
            raise BadRequest(name, f"{name} is not supported; leave it out or give {shown}")
        return value

    @model_validator(mode="after")
    def stream_options_with_stream(self):
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise BadRequest("stream_options", "stream_options is taken only with stream: true")
        return self

    @property
    def reply_tokens(self) -> int | None:
        """The most tokens each completion may take, as asked; None: left out."""
        return self.max_tokens

    @property
    def tokens_param(self) -> str:
        """The field that asked for them, as a refusal names it."""
        return "max_tokens"

    def check_token_limit(self, limit: int) -> None:
        """A request may ask for `limit` tokens per completion at most (serve --max-tokens, by default the model's
        context): past the context the window slides, so without a limit one request could hold a row until its
        client hangs up. Above it: a 400 naming the field and the limit, as OpenAI's and vLLM's."""
        if self.reply_tokens is not None and self.reply_tokens > limit:
            raise BadRequest(self.tokens_param, f"{self.tokens_param} {self.reply_tokens} is above this server's "
                             f"limit of {limit} tokens per request (serve --max-tokens)")

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    """The body of POST /v1/completions."""

    neutral: ClassVar[dict[str, tuple]] = NEUTRAL

    prompt: Annotated[str | Annotated[list[str], Field(min_length=1)], one_message("prompt", PROMPT)]
    # NEUTRAL: any JSON value, refused unless neutral
    echo: Any = None
    logprobs: Any = None
    best_of: Any = None
    suffix: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


class ChatRequest(SamplingRequest):
    """The body of POST /v1/chat/completions: the conversation so far, whose next assistant message is asked for.
    max_tokens (or OpenAI's newer name for it, max_completion_tokens) left out: the reply may take the context
    the conversation leaves, up to the server's limit."""

    neutral: ClassVar[dict[str, tuple]] = CHAT_NEUTRAL

    messages: Any  # checked by gpt2train.chat.check_messages, in its words
    max_completion_tokens: int | None = None
    # CHAT_NEUTRAL: any JSON value, refused unless neutral
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    response_format: Any = None
    tools: Any = None

    @field_validator("messages")
    @classmethod
    def a_conversation(cls, value):
        try:
            return check_messages(value)
        except ConversationError as e:
            raise BadRequest("messages", str(e)) from None

    @model_validator(mode="after")
    def one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise BadRequest("max_completion_tokens", "give max_completion_tokens or max_tokens (its older name), "
                             "not both")
        return self

    @property
    def reply_tokens(self) -> int | None:
        """The most tokens the reply may take; None: what the context leaves."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def tokens_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def choices(self) -> int:
        return self.n


def parse_request(kind: type[SamplingRequest], data) -> SamplingRequest:
    """The request of this kind that a JSON body holds, or the BadRequest of its first fault."""
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise refusal(e.errors()[0]) from None


def refusal(error: dict) -> BadRequest:
    """One of pydantic's errors as this server's refusal, naming the field."""
    raised = error.get("ctx", {}).get("error")
    if isinstance(raised, BadRequest):  # one of the request's own checks
        return raised
    given = error["input"]
    if not error["loc"]:
        return BadRequest(None, f"the body must be a JSON object, not {kind(given)}")
    name = error["loc"][-1]  # the field, or the field within one (stream_options' include_usage)
    if error["type"] == "missing":  # the prompt or the messages: no other field is required
        return BadRequest(name, f"{name} is required: {REQUIRED[name]}")
    if error["type"] == "float_type" and type(given) is int:  # an integer beyond a float's range
        return BadRequest(name, f"{name} is too large")
    if error["type"] in TYPES:
        return BadRequest(name, f"{name} must be {TYPES[error['type']]}, not {kind(given)}")
    return BadRequest(name, f"{name}: {error['msg']}")


def same(value, allowed) -> bool:
    """Equal as JSON values: 0.0 is 0, but false is not 0."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    return value == allowed


def kind(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)
