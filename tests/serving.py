"""Helpers of the serve tests: a tiny char-level model, its engine and app (and a chat app, its tokenizer with the
turn tokens), a run directory holding it, a real uvicorn server on a free port of 127.0.0.1 in a thread, and what
`generate` gives for a prompt (the reference)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
import uvicorn

from gpt2train.checkpoint import model_state, save_checkpoint
from gpt2train.config import Config, to_dict
from gpt2train.generation import generate
from gpt2train.model import GPT, GPTConfig
from gpt2train.serve.app import create_app
from gpt2train.serve.engine import Engine
from gpt2train.tokenizer import CharTokenizer, ChatTokens

TOKENIZER = CharTokenizer("abcdefgh \n")  # ten characters and end-of-text: a token is a character
CHAT_TOKENIZER = ChatTokens(CharTokenizer("abcdefghimnrstuy \n"))  # the letters of the roles, which the template spells
CONTEXT = 48


def tiny_model(dtype=torch.float32, vocab_size: int = TOKENIZER.vocab_size) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=CONTEXT, vocab_size=vocab_size))
    with torch.no_grad():  # larger weights than the init: logits far apart, so argmax has no near-ties
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.to(dtype).eval()


def tiny_engine(max_batch: int = 4, max_queue: int = 16, model: GPT | None = None) -> Engine:
    return Engine(model or tiny_model(), TOKENIZER, max_batch=max_batch, max_queue=max_queue, compile=False)


def tiny_app(max_batch: int = 4, max_queue: int = 16, **kwargs):
    return create_app(lambda: tiny_engine(max_batch, max_queue), model_id="tiny", **kwargs)


def tiny_chat_model() -> GPT:
    return tiny_model(vocab_size=CHAT_TOKENIZER.vocab_size)


def tiny_chat_app(max_batch: int = 4, max_queue: int = 4, **kwargs):
    """An app whose model's tokenizer has the turn tokens (random weights: replies are whatever `generate` gives)."""
    return create_app(lambda: Engine(tiny_chat_model(), CHAT_TOKENIZER, max_batch=max_batch, max_queue=max_queue,
                                     compile=False), model_id="tiny-chat", **kwargs)


def save_tiny_run(folder, model: GPT | None = None, tokenizer=TOKENIZER) -> Path:
    """A run directory holding the model (tiny_model()) at step 0; returns its checkpoints/step_* folder."""
    model = model or tiny_model()
    cfg = Config()
    cfg.model = model.config
    meta = {"config": to_dict(cfg), "tokens": 0, "best_val_loss": None, "tokenizer": tokenizer.spec()}
    return save_checkpoint(folder, step=0, weights=model_state(model), state={}, meta=meta)


def greedy(model: GPT, prompt: str, max_tokens: int, tokenizer=TOKENIZER) -> tuple[str, str]:
    """(text, finish_reason) of `generate`'s greedy continuation, as the server must answer it."""
    text, reason, _ = continuation(model, tokenizer, tokenizer.encode(prompt) or [tokenizer.eot_id], max_tokens,
                                   tokenizer.eot_id)
    return text, reason


def continuation(model: GPT, tokenizer, prompt_ids: list[int], max_tokens: int, end_id: int,
                 **sampling) -> tuple[str, str, int]:
    """(text, finish_reason, tokens) of `generate`'s continuation of the ids, up to end_id (not in the text; a
    chat reply's is <|im_end|>): greedy, or sampled with generate's options (temperature, seed ...)."""
    ids = generate(model, prompt_ids, max_tokens, **{"temperature": 0, **sampling}, eot_id=end_id)
    ended = ids[-1] == end_id
    return tokenizer.decode(ids[:-1] if ended else ids), "stop" if ended else "length", len(ids)


def wait_ready(client, timeout: float = 60) -> None:
    """Until /health answers 200 (the model loads in a thread); fails at once if loading failed."""
    deadline = time.monotonic() + timeout
    while (health := client.get("/health")).status_code != 200:
        assert health.json()["status"] != "failed", health.json()["error"]
        assert time.monotonic() < deadline, "the model did not load"
        time.sleep(0.02)


@contextlib.contextmanager
def running(app, ready: bool = True) -> Iterator[str]:
    """The app served by uvicorn on a free port of 127.0.0.1, in a thread; yields its base URL."""
    with served_by(uvicorn.Server(uvicorn_config(app)), ready) as url:
        yield url


def uvicorn_config(app) -> uvicorn.Config:
    return uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")


@contextlib.contextmanager
def served_by(server: uvicorn.Server, ready: bool = True) -> Iterator[str]:
    """The uvicorn server (of uvicorn_config) run in a thread; yields its base URL."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    try:
        if ready:
            with httpx.Client(base_url=url) as client:
                wait_ready(client)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
