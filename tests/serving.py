"""Helpers of the serve tests: a tiny char-level model, its engine and app, a real uvicorn server on a free
port of 127.0.0.1 in a thread, and what `generate` gives for a prompt (the reference)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import torch
import uvicorn

from gpt2train.generation import generate
from gpt2train.model import GPT, GPTConfig
from gpt2train.serve.app import create_app
from gpt2train.serve.engine import Engine
from gpt2train.tokenizer import CharTokenizer

TOKENIZER = CharTokenizer("abcdefgh \n")  # ten characters and end-of-text: a token is a character
CONTEXT = 48


def tiny_model(dtype=torch.float32) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=CONTEXT, vocab_size=TOKENIZER.vocab_size))
    with torch.no_grad():  # larger weights than the init: logits far apart, so argmax has no near-ties
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.to(dtype).eval()


def tiny_engine(max_batch: int = 4, max_queue: int = 16, model: GPT | None = None) -> Engine:
    return Engine(model or tiny_model(), TOKENIZER, max_batch=max_batch, max_queue=max_queue, compile=False)


def tiny_app(max_batch: int = 4, max_queue: int = 16, **kwargs):
    return create_app(lambda: tiny_engine(max_batch, max_queue), model_id="tiny", **kwargs)


def greedy(model: GPT, prompt: str, max_tokens: int) -> tuple[str, str]:
    """(text, finish_reason) of `generate`'s greedy continuation, as the server must answer it."""
    ids = generate(model, TOKENIZER.encode(prompt) or [TOKENIZER.eot_id], max_tokens, temperature=0,
                   eot_id=TOKENIZER.eot_id)
    ended = ids[-1] == TOKENIZER.eot_id
    return TOKENIZER.decode(ids[:-1] if ended else ids), "stop" if ended else "length"


def wait_ready(client, timeout: float = 60) -> None:
    """Until /health answers 200 (the model loads in a thread)."""
    deadline = time.monotonic() + timeout
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the model did not load"
        time.sleep(0.02)


@contextlib.contextmanager
def running(app, ready: bool = True) -> Iterator[str]:
    """The app served by uvicorn on a free port of 127.0.0.1, in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
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
