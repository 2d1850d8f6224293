"""The HTTP face of `gpt2train serve`: OpenAI's POST /v1/completions and POST /v1/chat/completions (one JSON
answer, or server-sent events with stream=true) and GET /v1/models over an Engine; GET /health, GET /metrics
(Prometheus text) and the playground page at GET /. Every refusal is a JSON error in OpenAI's shape with its
status: 400 a field's type or range (named), or more than the server's bounds (tokens, completions), 401 the
API key, 413 the body's size, 415 a body not declared as JSON, 429 a full queue, 503 the model still loading, the
server stopping, or stopped on a failure it could not recover from; a request never reaches the engine unless it
is good, and never gets a 500 for its own fault.

A stop signal drains the server before uvicorn shuts it down (Served.drain, from GracefulServer): new requests get
503, those in flight finish within the grace period or are cut, a stream with a last chunk and [DONE].
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hmac
import importlib.resources
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from gpt2train.chat import ConversationError, fit_prompt, has_chat_tokens
from gpt2train.counting import parameter_count
from gpt2train.serve.engine import Completion, Draining, Engine, EngineStopped, Inbox, Piece, QueueFull, Sampling, one_line
from gpt2train.serve.request import DEFAULT_MAX_TOKENS, BadRequest, ChatRequest, CompletionRequest, SamplingRequest, parse_request
from gpt2train.units import format_count

API_KEY_ENV = "GPT2TRAIN_API_KEY"  # when set, /v1/* needs `Authorization: Bearer <it>`
MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused (413)
GRACE_SECONDS = 30.0  # a stop signal's drain: Kubernetes' default grace period before it kills a pod
log = logging.getLogger("gpt2train.serve")


class ApiError(Exception):
    """A refusal: its status, a one-line message, OpenAI's error type and the field it concerns."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers


class ErrorResponse(JSONResponse):
    """OpenAI's error body, as ASCII JSON: a message or param that quotes the request (a field name holding a
    lone surrogate) is always encodable, where UTF-8 output would fail on it and turn a 400 into a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, kind: str, param: str | None = None, headers=None) -> JSONResponse:
    return ErrorResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status,
                         headers=headers)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (several apps in one process stay apart)."""

    def __init__(self, served: Served):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("gpt2train_requests", "requests to /v1/ by status code", ["status"], registry=r)
        self.prompt_tokens = Counter("gpt2train_prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.completion_tokens = Counter("gpt2train_completion_tokens", "tokens generated", registry=r)
        Gauge("gpt2train_queue_depth", "completions waiting for a row", registry=r).set_function(
            lambda: served.engine.queued if served.engine else 0)
        Gauge("gpt2train_batch_rows", "rows decoding in the batch", registry=r).set_function(
            lambda: served.engine.running if served.engine else 0)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram("gpt2train_time_to_first_token_seconds", "request received to its first token",
                              buckets=buckets, registry=r)
        self.itl = Histogram("gpt2train_inter_token_latency_seconds", "time between a completion's tokens",
                             buckets=buckets, registry=r)


class Served:
    """What the app serves, and how: the engine once loaded (or why loading failed, or why the engine stopped),
    the model's id, the API key, the limits on a request (its body's bytes, its tokens) and the metrics. The
    routes reach it as a dependency."""

    def __init__(self, load: Callable[[], Engine], model_id: str, api_key: str | None, max_body_bytes: int,
                 max_tokens: int | None, on_load_error: Callable[[BaseException], None] | None,
                 on_loaded: Callable[[Engine], None] | None):
        self.load, self.on_load_error, self.on_loaded = load, on_load_error, on_loaded
        self.model_id, self.api_key, self.max_body_bytes = model_id, api_key, max_body_bytes
        self.token_limit = max_tokens  # None: the model's context, known once it is loaded
        self.created = int(time.time())
        self.engine: Engine | None = None
        self.error: str | None = None
        self.stopping = False  # a stop signal came: no new request is taken (drain)
        self.metrics = Metrics(self)

    def load_engine(self) -> None:
        """In a thread of its own, at startup: the engine, started, or the one-line reason it failed."""
        try:
            self.engine = self.load().start()
            log.info("model %s loaded", self.model_id)
            if self.on_loaded is not None:
                self.on_loaded(self.engine)
        except Exception as e:  # noqa: BLE001 -- reported by /health and to whoever started the server
            self.error = one_line(e)
            log.error("the model failed to load: %s", self.error)
            if self.on_load_error is not None:
                self.on_load_error(e)

    def ready(self) -> Engine:
        if self.stopping:
            raise stopping()
        if self.engine is None:
            raise ApiError(503, f"the model failed to load: {self.error}" if self.error else "the model is loading",
                           "server_error", headers={"Retry-After": "5"})
        if self.engine.failure is not None:
            raise ApiError(503, str(EngineStopped(self.engine.failure)), "server_error")
        return self.engine

    async def drain(self, grace_seconds: float) -> None:
        """Stop taking requests (503, and /health says "stopping"), let the engine finish those it holds within
        grace_seconds and cut the rest (Engine.drain); returns once it holds nothing."""
        self.stopping = True
        if self.engine is not None:
            await asyncio.to_thread(self.engine.drain, grace_seconds)

    def end_grace(self) -> None:
        """Cut what the drain still waits for, now."""
        if self.engine is not None:
            self.engine.cut()

    def failure(self) -> str | None:
        """Why the model is not served (it failed to load, or the engine stopped); None while it is or loads."""
        return self.engine.failure if self.engine is not None else self.error

    def max_tokens(self, engine: Engine) -> int:
        """The most tokens a request may ask for, per completion: serve --max-tokens, else the model's context."""
        return self.token_limit or engine.context

    def model_entry(self) -> dict:
        """OpenAI's model entry, with (ours) the context, the most tokens a request may ask for, and whether
        /v1/chat/completions serves the model."""
        engine = self.ready()
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "gpt2train",
                "context_length": engine.context, "max_tokens": self.max_tokens(engine),
                "chat": has_chat_tokens(engine.tokenizer)}


def stopping() -> ApiError:
    """A new request's answer once a stop signal came (ready() refuses it, and so does a submit that came after)."""
    return ApiError(503, "the server is stopping and takes no new requests; retry, on another replica if there is one",
                    "server_error", headers={"Retry-After": "5"})


class CountRequests:
    """ASGI middleware: each /v1/ response counted by its status (streams too, unlike a response hook)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The model loads in a thread while the server already answers (/health is 503 until it is in)."""
    served: Served = app.state.served
    loader = threading.Thread(target=served.load_engine, name="gpt2train-load", daemon=True)
    loader.start()
    yield
    # A model still loading is waited for (uvicorn stops at once when it cannot listen): a process that exits
    # under a thread inside torch is aborted by glibc ("FATAL: exception not rethrown").
    await asyncio.to_thread(loader.join)
    if served.engine is not None:
        served.engine.stop()


# ---------------------------------------------------------------- what the routes depend on
# async, all of them: FastAPI runs a plain `def` dependency in its thread pool, a hop per request.


async def get_served(request: Request) -> Served:
    return request.app.state.served


ServedDep = Annotated[Served, Depends(get_served)]


async def authorize(request: Request, served: ServedDep) -> None:
    """With an API key set, a request must bear it (every /v1/ route depends on this, before anything else)."""
    if served.api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), served.api_key.encode()):
        raise ApiError(401, f"a valid API key is required: send `Authorization: Bearer <key>` (the server's "
                       f"{API_KEY_ENV})", "authentication_error", headers={"WWW-Authenticate": "Bearer"})


async def ready_engine(served: ServedDep) -> Engine:
    return served.ready()


async def arrival() -> float:
    return time.perf_counter()


async def json_body(request: Request, served: ServedDep):
    """The body, checked: declared as JSON (415), within the size limit (413), JSON (400). Read here rather than
    by FastAPI, which reads a body before any dependency runs (the API key's too) and whole, however large."""
    check_json_body(request)
    body = await read_body(request, served.max_body_bytes)
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
        raise BadRequest(None, "the body is not valid JSON") from None


async def completion_request(data: Annotated[object, Depends(json_body)]) -> CompletionRequest:
    return parse_request(CompletionRequest, data)  # good fields, or 400


async def chat_request(data: Annotated[object, Depends(json_body)]) -> ChatRequest:
    return parse_request(ChatRequest, data)


# ---------------------------------------------------------------- the routes

pages = APIRouter()  # open to all: load balancers and Prometheus hold no key
v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])


@pages.get("/", include_in_schema=False)
async def page():
    return HTMLResponse(playground())


@pages.api_route("/health", methods=["GET", "HEAD"])  # load balancers and uptime checks often send HEAD
async def health(served: ServedDep):
    if served.failure() is not None:
        return JSONResponse({"status": "failed", "error": served.failure()}, 503)
    if served.stopping:
        return JSONResponse({"status": "stopping"}, 503)
    if served.engine is None:
        return JSONResponse({"status": "loading"}, 503)
    return {"status": "ok", "model": served.model_id}


@pages.get("/metrics")
async def prometheus(served: ServedDep):
    return Response(generate_latest(served.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@v1.get("/models")
async def models(served: ServedDep):
    return {"object": "list", "data": [served.model_entry()]}


@v1.get("/models/{name:path}")  # a run directory's name has slashes
async def one_model(name: str, served: ServedDep):
    if name != served.model_id:
        raise ApiError(404, f"model {name!r} is not served here; this server serves {served.model_id!r}",
                       param="model")
    return served.model_entry()


@v1.post("/completions")
async def completions(request: Request, served: ServedDep,
                      started: Annotated[float, Depends(arrival)],  # before the body: its arrival counts in TTFT
                      req: Annotated[CompletionRequest, Depends(completion_request)],
                      engine: Annotated[Engine, Depends(ready_engine)]):
    check_bounds(served, engine, req)  # before encoding, which costs CPU for every prompt
    prompt_ids, cropped = await asyncio.to_thread(encode_prompts, engine, req)  # a long one holds up no other request
    noted = {"prompt_tokens_cropped": cropped} if cropped else {}
    max_tokens = req.reply_tokens or min(DEFAULT_MAX_TOKENS, served.max_tokens(engine))
    return await answer(request, served, engine, Answer, req, prompt_ids, max_tokens, started, noted)


@v1.post("/chat/completions")
async def chat_completions(request: Request, served: ServedDep,
                           started: Annotated[float, Depends(arrival)],
                           req: Annotated[ChatRequest, Depends(chat_request)],
                           engine: Annotated[Engine, Depends(ready_engine)]):
    if not has_chat_tokens(engine.tokenizer):
        raise BadRequest("model", "this model was not fine-tuned on conversations with the chat template (its "
                         "tokenizer has no <|im_start|> and <|im_end|> tokens): send text to continue to "
                         "/v1/completions, or fine-tune it on conversations made with `gpt2train prepare chat` "
                         "(docs/chat.md)")
    check_bounds(served, engine, req)
    prompt_ids, dropped = await asyncio.to_thread(chat_prompt, engine, req)
    max_tokens = req.reply_tokens or min(engine.context - len(prompt_ids), served.max_tokens(engine))
    noted = {"prompt_messages_dropped": dropped} if dropped else {}
    return await answer(request, served, engine, ChatAnswer, req, [prompt_ids], max_tokens, started, noted,
                        end_id=engine.tokenizer.im_end_id)


# ---------------------------------------------------------------- every refusal in OpenAI's shape


async def api_error(request: Request, e: ApiError):
    return error_response(e.status, e.message, e.kind, e.param, e.headers)


async def bad_request(request: Request, e: BadRequest):
    return error_response(400, str(e), "invalid_request_error", e.param)


async def http_error(request: Request, e: HTTPException):  # Starlette's: an unknown path, a method not allowed
    return error_response(e.status_code, str(e.detail), "invalid_request_error", headers=e.headers)


async def internal_error(request: Request, e: Exception):  # a bug: still JSON, and counted
    log.exception("internal error")
    if request.url.path.startswith("/v1/"):
        request.app.state.served.metrics.requests.labels("500").inc()
    return error_response(500, f"internal error: {type(e).__name__}", "server_error")


def create_app(load: Callable[[], Engine], model_id: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, max_tokens: int | None = None,
               on_load_error: Callable[[BaseException], None] | None = None,
               on_loaded: Callable[[Engine], None] | None = None) -> FastAPI:
    """The app; `load` builds the engine in a thread at startup (/health answers 503 until it is done), then
    calls on_loaded(engine), or on_load_error(exception) when it failed. max_tokens: the most tokens a request
    may ask for, per completion (None: the model's context)."""
    app = FastAPI(title="gpt2train", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  exception_handlers={ApiError: api_error, BadRequest: bad_request, HTTPException: http_error,
                                      Exception: internal_error})
    app.state.served = Served(load, model_id, api_key, max_body_bytes, max_tokens, on_load_error, on_loaded)
    app.add_middleware(CountRequests, metrics=app.state.served.metrics)
    app.include_router(pages)
    app.include_router(v1)
    return app


@functools.cache
def playground() -> str:
    return importlib.resources.files("gpt2train.serve").joinpath("playground.html").read_text(encoding="utf-8")


def check_json_body(request: Request) -> None:
    """A body declared as anything but JSON is refused (no header is taken as JSON, as FastAPI does): a page of
    another site can make a browser POST text/plain or a form here without asking, but not application/json."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.partition(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"send the body as JSON, with `Content-Type: application/json` (not {media or 'empty'!r})")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` bytes (declared, or as it arrives)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body of {int(declared):,} bytes exceeds this server's {limit:,}")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"the body exceeds this server's {limit:,} bytes")
    except ClientDisconnect:  # the client's fault, not the server's: no traceback, not counted as a 500
        raise ApiError(499, "the client closed the request before its body arrived") from None
    return bytes(body)


def check_bounds(served: Served, engine: Engine, req: SamplingRequest) -> None:
    """The server's bounds on a request's work, before any prompt is encoded: its completions (prompts x n) within
    --max-batch + --max-queue, and its tokens within --max-tokens (docs/serving.md, "What bounds a request's
    work"); a 400 naming the field otherwise."""
    req.check_token_limit(served.max_tokens(engine))
    if req.choices > engine.capacity:
        raise BadRequest("n", f"{req.choices} completions (prompts x n) asked at once; this server takes at most "
                         f"{engine.capacity} (--max-batch + --max-queue)")


def encode_prompts(engine: Engine, req: CompletionRequest) -> tuple[list[list[int]], int]:
    """Each prompt's ids, and how many tokens were cropped from their starts in all: an empty prompt starts
    from end-of-text and one longer than the context is cropped to its last tokens, as `sample` does (the
    model reads no more; docs/model.md, "Past the context"); 400 when a prompt cannot be encoded."""
    tokenizer = engine.tokenizer
    found, cropped = [], 0
    for i, prompt in enumerate(req.prompts):
        try:
            ids = tokenizer.encode(prompt) or [tokenizer.eot_id]
        except Exception as e:  # noqa: BLE001 -- a character the tokenizer has no id for, a lone surrogate ...
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise BadRequest("prompt", f"prompt {i} cannot be encoded: {reason}") from None
        cropped += max(len(ids) - engine.context, 0)
        found.append(ids[-engine.context:])
    return found, cropped


def chat_prompt(engine: Engine, req: ChatRequest) -> tuple[list[int], int]:
    """The conversation's prompt (gpt2train.chat.render_prompt), and how many of its oldest messages were dropped
    so that it fits the context less the reply's max_tokens (without one, the reply gets what the prompt leaves
    of the context); 400 when even the last message does not fit, or a message cannot be encoded."""
    if req.reply_tokens is not None and req.reply_tokens >= engine.context:
        name = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        raise BadRequest(name, f"{name} {req.reply_tokens} leaves no room for the conversation in the model's "
                         f"context of {engine.context} tokens; ask for fewer")
    budget = engine.context - (req.reply_tokens or 1)
    try:
        return fit_prompt(engine.tokenizer, req.messages, budget)
    except ConversationError as e:  # the last message does not fit alone
        if req.reply_tokens:
            raise BadRequest("messages", f"{e} (the context of {engine.context} tokens less max_tokens "
                             f"{req.reply_tokens}); shorten it or lower max_tokens") from None
        raise BadRequest("messages", f"{e} (the context of {engine.context} tokens); shorten it") from None
    except Exception as e:  # noqa: BLE001 -- a lone surrogate, a character the tokenizer has no id for ...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BadRequest("messages", f"the messages cannot be encoded: {reason}") from None


async def answer(request: Request, served: Served, engine: Engine, kind: type[Answer], req: SamplingRequest,
                 prompt_ids: list[list[int]], max_tokens: int, started: float, noted: dict, end_id: int | None = None):
    """Each prompt's n completions submitted as one request's jobs (429 when the queue is full), then their
    answer: server-sent events, or one JSON body once they are done."""
    inbox = Inbox()
    jobs = [Completion(ids, max_tokens, inbox, sampling(req, i * req.n + j), req.stops, index=i * req.n + j,
                       end_id=end_id)
            for i, ids in enumerate(prompt_ids) for j in range(req.n)]
    try:
        engine.submit(jobs)
    except QueueFull as e:
        raise ApiError(429, f"the server is busy ({e}); retry later", "rate_limit_error",
                       headers={"Retry-After": "1"}) from None
    except EngineStopped as e:  # since ready_engine
        raise ApiError(503, str(e), "server_error") from None
    except Draining:
        raise stopping() from None
    prompt_tokens = sum(len(ids) for ids in prompt_ids)  # as OpenAI counts them: once, whatever n
    served.metrics.prompt_tokens.inc(prompt_tokens)
    reply = kind(served.model_id, jobs, prompt_tokens, served.metrics, started, engine, noted)
    if req.stream:
        return EventStream(reply, req.include_usage)
    return await reply.whole(request)


def sampling(req: SamplingRequest, index: int) -> Sampling:
    """Choice `index` of a seeded request draws from seed + index: the n choices of a prompt differ, and
    each is reproducible."""
    seed = None if req.seed is None else (req.seed + index) % 2**31
    return Sampling(req.temperature, req.top_k, req.top_p, seed)


class Answer:
    """One request's completions as their pieces arrive: streamed as server-sent events, or gathered into
    one JSON answer (OpenAI's completion objects); the latency metrics are observed on the way."""

    id_prefix, whole_object, chunk_object = "cmpl-", "text_completion", "text_completion"

    def __init__(self, model_id: str, jobs: list[Completion], prompt_tokens: int, metrics: Metrics, started: float,
                 engine: Engine, noted: dict | None = None):
        self.id, self.model_id, self.jobs, self.engine = f"{self.id_prefix}{uuid.uuid4().hex}", model_id, jobs, engine
        self.inbox = jobs[0].inbox
        self.prompt_tokens, self.metrics, self.started = prompt_tokens, metrics, started
        self.noted = noted or {}  # ours, in the usage: what was left out of the prompt to fit the context
        self.created = int(time.time())
        self.texts = [""] * len(jobs)
        self.tokens = [0] * len(jobs)
        self.finish: list[str | None] = [None] * len(jobs)
        self.cut = 0  # completions cut short by the server's stop (Engine.drain)
        self.last_arrival: list[float | None] = [None] * len(jobs)

    async def pieces(self) -> AsyncIterator[tuple[int, Piece]]:
        """(index, piece) as they come, a completion's pieces of one hand-over merged into one. One cut short by
        the server's stop ends as OpenAI's "length" (the client keeps what it got, as at max_tokens), and the
        request is logged in one line once all have ended."""
        open_ = len(self.jobs)
        while open_:
            merged: dict[int, Piece] = {}
            for index, piece in await self.inbox.get():
                if index in merged:
                    m = merged[index]
                    merged[index] = Piece(m.text + piece.text, m.tokens + piece.tokens, piece.finish_reason)
                else:
                    merged[index] = piece
            for index, piece in merged.items():
                if piece.finish_reason == "cut":
                    self.cut += 1
                    piece = Piece(piece.text, piece.tokens, "length")
                self.observe(index, piece)
                open_ -= piece.finish_reason is not None
                yield index, piece
        if self.cut:
            log.warning("%s cut short by the server's stop: %d of its %d completion(s) unfinished, %d token(s) "
                        "generated", self.id, self.cut, len(self.jobs), sum(self.tokens))

    def observe(self, index: int, piece: Piece) -> None:
        now = time.perf_counter()
        if piece.tokens:
            before = self.last_arrival[index]
            if before is None:
                self.metrics.ttft.observe(now - self.started)
            else:
                for _ in range(piece.tokens):
                    self.metrics.itl.observe((now - before) / piece.tokens)
            self.last_arrival[index] = now
            self.metrics.completion_tokens.inc(piece.tokens)
        self.texts[index] += piece.text
        self.tokens[index] += piece.tokens
        if piece.finish_reason:
            self.finish[index] = piece.finish_reason

    def error_status(self) -> int:
        """A completion's error: 503 once the engine has stopped for good, else 500 (one step failed; the
        next requests are served)."""
        return 503 if self.engine.failure is not None else 500

    def usage(self) -> dict:
        """OpenAI's usage: prompt_tokens are those the model read; then what was noted (ours, there only when
        something was left out): prompt_tokens_cropped, the tokens cropped from the starts of prompts longer
        than the context, or prompt_messages_dropped, the oldest messages of a conversation left out."""
        completion = sum(self.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion, **self.noted}

    def chunk(self, choices: list[dict], object_name: str | None = None, **more) -> dict:
        """An answer object: a streamed chunk unless object_name says otherwise."""
        return {"id": self.id, "object": object_name or self.chunk_object, "created": self.created,
                "model": self.model_id, "choices": choices, **more}

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        """A choice of the whole answer."""
        return {"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}

    def delta(self, index: int, piece: Piece) -> dict:
        """The choice of a streamed chunk: the piece's text."""
        return self.choice(index, piece.text, piece.finish_reason)

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: `data: {chunk}` per piece of text, a last chunk per completion with its
        finish_reason, the usage if asked for, then `data: [DONE]`. A client that leaves cancels them."""
        try:
            async for index, piece in self.pieces():
                if piece.finish_reason == "error":
                    yield sse({"error": {"message": piece.text, "type": "server_error", "param": None,
                                         "code": self.error_status()}})
                    return
                if piece.text or piece.finish_reason:
                    yield sse(self.chunk([self.delta(index, piece)]))
            if include_usage:
                yield sse(self.chunk([], usage=self.usage()))
            yield "data: [DONE]\n\n"
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Free the rows of the completions still running (a client that left)."""
        for job in self.jobs:
            job.cancel()

    async def whole(self, request: Request) -> JSONResponse:
        """Every completion's text in one answer; a client that leaves first cancels them."""
        gather = asyncio.ensure_future(self.drain())
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not gather.done():
                gather.cancel()
                self.cancel()
        if not gather.done() or gather.cancelled():
            return error_response(499, "the client closed the request", "invalid_request_error")
        if "error" in self.finish:
            return error_response(self.error_status(), next(t for t, f in zip(self.texts, self.finish) if f == "error"),
                                  "server_error")
        if self.cut:
            return error_response(503, f"the server stopped before this request was done ({self.cut} of its "
                                  f"{len(self.jobs)} completion(s) unfinished); send it again", "server_error",
                                  headers={"Retry-After": "5"})
        choices = [self.choice(i, text, reason) for i, (text, reason) in enumerate(zip(self.texts, self.finish))]
        return JSONResponse(self.chunk(choices, self.whole_object, usage=self.usage()))

    async def drain(self) -> None:
        async for _ in self.pieces():
            pass


class ChatAnswer(Answer):
    """A chat request's replies: each choice the assistant's message (chat.completion), streamed as its deltas
    (chat.completion.chunk), the first of each choice naming the role."""

    id_prefix, whole_object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.begun: set[int] = set()  # choices whose first chunk is out

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def delta(self, index: int, piece: Piece) -> dict:
        delta = {} if index in self.begun else {"role": "assistant"}
        self.begun.add(index)
        if piece.text:
            delta["content"] = piece.text
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": piece.finish_reason}


class EventStream(StreamingResponse):
    """An Answer's server-sent events. Starlette cancels the stream when the client disconnects; the rows
    are freed then, even if the stream had not started."""

    def __init__(self, answer: Answer, include_usage: bool):
        super().__init__(answer.events(include_usage), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.answer = answer

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.answer.cancel()


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (after the body, the server's next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def engine_loader(ckpt: str | Path, device: torch.device, dtype: torch.dtype, **engine_options) -> Callable[[], Engine]:
    """What create_app loads for `serve --ckpt`: a run directory, one of its checkpoints/step_* folders, or a
    Hugging Face GPT-2 folder. Its tokenizer is read now (a bad path fails here, in one line), its weights
    when the returned function is called; engine_options go to Engine."""
    from gpt2train.loading import load_pretrained, load_pretrained_tokenizer

    tokenizer = load_pretrained_tokenizer(ckpt)

    def load() -> Engine:
        return Engine(load_pretrained(ckpt, device=device).to(dtype), tokenizer, **engine_options)

    return load


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for uvicorn to serve on, or a one-line OSError saying why it cannot be."""
    try:
        address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(address[0], socket.SOCK_STREAM)
    except OSError as e:
        raise OSError(f"could not listen on {host}:{port} ({e.strerror or e}); pass another --host") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind(address[4])
    except OSError as e:
        sock.close()
        hint = "is the port in use? pass another --port" if e.errno == errno.EADDRINUSE else "pass another --host/--port"
        raise OSError(f"could not listen on {host}:{port} ({e.strerror}); {hint}") from None
    return sock


def graceful_server_class():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, draining before it shuts down: the first stop signal (SIGTERM, Ctrl-C) starts
        Served.drain at uvicorn's next tick (it still listens, and answers new requests 503), and uvicorn's own
        shutdown follows once the drain is over. A second signal ends the grace period at once; a third is
        uvicorn's own stop. It remembers the first: serve exits by it (uvicorn raises again only the signals it
        handled itself)."""

        def __init__(self, config: uvicorn.Config, served: Served, grace_seconds: float):
            super().__init__(config)
            self.served, self.grace_seconds = served, grace_seconds
            self.stopped_by: int | None = None
            self.signals = 0  # acted on at the next tick: a signal handler must not wait for the engine's lock
            self.drain: asyncio.Task | None = None
            self.hurried = False

        def handle_exit(self, sig: int, frame) -> None:
            self.signals += 1
            if self.stopped_by is None:
                self.stopped_by = sig
            if self.signals > 2:
                super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self.signals and self.drain is None:
                print(f"stopping: no new requests; those in flight get up to {self.grace_seconds:g} s to finish "
                      "(Ctrl-C again ends them now)", file=sys.stderr, flush=True)
                self.drain = asyncio.create_task(self.served.drain(self.grace_seconds))
            if self.signals > 1 and not self.hurried:
                print("stopping now: the requests in flight are cut", file=sys.stderr, flush=True)
                self.hurried = True
                self.served.end_grace()
            return await super().on_tick(counter) or (self.drain is not None and self.drain.done())

    return GracefulServer


def stopped_by_signal(signum: int) -> KeyboardInterrupt:
    """What the CLI turns into the shell's status for the signal (128 + its number)."""
    interrupt = KeyboardInterrupt(signal.Signals(signum).name)
    interrupt.signum = signum
    return interrupt


def serve(ckpt: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8, max_queue: int = 64,
          dtype: str = "auto", compile: bool | str = "auto", device: str = "auto", prefill_tokens: int = 0,
          max_tokens: int | None = None, grace_seconds: float = GRACE_SECONDS) -> None:
    """`gpt2train serve`: the checkpoint's tokenizer is read now (a bad path fails here, in one line); its
    weights load while the server already answers /health (503 until they are in). max_tokens: the most tokens a
    request may ask for (None: the model's context); grace_seconds: how long a stop signal lets the requests in
    flight run before they are cut."""
    import uvicorn

    from gpt2train.distributed import resolve_device
    from gpt2train.runtime import resolve_dtype

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device.type)
    load = engine_loader(ckpt, torch_device, torch_dtype, max_batch=max_batch, max_queue=max_queue, compile=compile,
                         prefill_tokens=prefill_tokens)

    failures: list[BaseException] = []

    def stop_on_failure(e: BaseException) -> None:
        failures.append(e)
        server.should_exit = True

    url = f"http://{host}:{port}/"

    def say_loaded(engine: Engine) -> None:
        params = format_count(parameter_count(engine.model.config))  # as training's banner and the model card count
        print(f"model loaded: {ckpt} ({params} parameters, context {engine.context} tokens); serving on {url}",
              file=sys.stderr, flush=True)

    app = create_app(load, model_id=str(ckpt), api_key=os.environ.get(API_KEY_ENV) or None, max_tokens=max_tokens,
                     on_load_error=stop_on_failure, on_loaded=say_loaded)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    server = graceful_server_class()(config, app.state.served, grace_seconds)
    listening = listen(host, port)  # a port in use fails here in one line, before uvicorn logs anything
    key = f"; /v1/* needs the API key in {API_KEY_ENV}" if os.environ.get(API_KEY_ENV) else ""
    print(f"loading {Path(ckpt)} to serve on {url} ({torch_device}, {str(torch_dtype).removeprefix('torch.')}, "
          f"up to {max_batch} rows){key}; /health answers 503 until it is loaded", file=sys.stderr, flush=True)
    with listening:
        server.run(sockets=[listening])
    if failures:
        raise failures[0]
    if server.stopped_by is not None:
        raise stopped_by_signal(server.stopped_by)
