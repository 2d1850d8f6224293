"""`gpt2train bench serve`: the server under load, held against the plain batched decode of the same shapes.

A model preset with random weights (the same cost as trained ones) is saved as a checkpoint in a temporary
folder and served by `gpt2train serve` in a process of its own on 127.0.0.1. For each concurrency c, c
clients (asyncio + httpx) send `requests` streamed completions between them, one after another each, all
with the same prompt of `prompt_tokens` tokens and max_tokens `new_tokens`, greedy. Measured at the
clients: requests/s and output tokens/s (the usage the server counts) over the wall time of the level,
time to first token (the first piece of text) and inter-token latency (the gaps between pieces of text:
one token each, unless a client falls behind and gets several at once), p50 and p99, and errors (a
status other than 200, a broken stream, a transport error). After the server is stopped, the same
process runs `bench generate`'s path (generate_ids with a Decoder) on batches of c such prompts: the
ceiling, c x new_tokens tokens over the whole generation, prefill included, as the server's rows also
pay for their prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from gpt2train.bench.generate import check_context, sync, write_result
from gpt2train.checkpoint import model_state, save_checkpoint
from gpt2train.config import Config, to_dict
from gpt2train.devices import describe
from gpt2train.distributed import resolve_device
from gpt2train.generation import Decoder, generate_ids
from gpt2train.model import GPT, preset_config
from gpt2train.ranges import COMPILE_SETTINGS
from gpt2train.runtime import resolve_dtype
from gpt2train.tokenizer import GPT2Tokenizer
from gpt2train.units import format_utc


@dataclass
class ServeBenchOptions:
    model: str = "gpt2"
    device: str = "auto"
    dtype: str = "auto"  # the server's weights and the ceiling's (auto: as `sample`)
    compile: str = "auto"  # the server's --compile and the ceiling's Decoder (auto: on CUDA)
    concurrency: list[int] = field(default_factory=lambda: [1, 8])
    requests: int = 0  # per concurrency level; 0: four times the concurrency (the first burst is a quarter)
    prompt_tokens: int = 64
    new_tokens: int = 128
    max_batch: int = 0  # the server's --max-batch; 0: the largest concurrency
    prefill_tokens: int = 0  # the server's --prefill-tokens (0: its default)
    repeats: int = 2  # timed runs of the ceiling, the median reported
    startup_timeout_s: float = 600.0

    def __post_init__(self):
        """UsageError, in one line, before any work, for what one option's argparse type cannot see: whether the
        prompt and the new tokens fit the model. Each option's own range is checked once, by its type in cli/bench.py."""
        check_context(self.model, self.prompt_tokens, self.new_tokens)


@dataclass
class Level:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    requests_s: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    completion_tokens: int
    plain_tok_s: float = 0.0  # the ceiling: plain batched generation of `concurrency` rows
    of_plain: float = 0.0  # output_tok_s / plain_tok_s
    error_examples: list[str] = field(default_factory=list)


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # between pieces of text (a piece is a token unless the
    # client fell behind and the server sent several at once)
    tokens: int = 0
    error: str = ""


def require_load_client() -> None:
    """ImportError, in one line, before any work, when the load generator's client is missing."""
    try:
        import httpx  # noqa: F401 -- the load generator's client
    except ImportError:
        raise ImportError("`gpt2train bench serve` needs httpx and the server's packages: "
                          "pip install 'gpt2train[serve]'") from None


def fixed_prompt(tokenizer: GPT2Tokenizer, tokens: int) -> str:
    """A prompt of exactly `tokens` GPT-2 tokens (" the" is one token, and so is each repeat)."""
    text = " the" * tokens
    assert len(tokenizer.encode(text)) == tokens
    return text


def save_random_checkpoint(options: ServeBenchOptions, folder: Path) -> GPT:
    torch.manual_seed(0)
    cfg = Config()
    cfg.model = preset_config(options.model)
    model = GPT(cfg.model).eval()
    meta = {"config": to_dict(cfg), "tokens": 0, "best_val_loss": None, "tokenizer": GPT2Tokenizer().spec()}
    save_checkpoint(folder, step=0, weights=model_state(model), state={}, meta=meta)
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(ckpt: Path, options: ServeBenchOptions, max_batch: int, max_queue: int, log: Path):
    """`gpt2train serve` in a process of its own; yields its URL once /health answers 200."""
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "gpt2train", "serve", "--ckpt", str(ckpt), "--port", str(port),
               "--max-batch", str(max_batch), "--max-queue", str(max_queue), "--device", options.device,
               "--dtype", options.dtype, "--compile", options.compile, "--prefill-tokens", str(options.prefill_tokens)]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + options.startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer /health within {options.startup_timeout_s:.0f} s; see {log}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def one_request(client, body: dict) -> RequestResult:
    """A streamed completion: when its first text came, the gaps between the later pieces, its tokens."""
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens, done = 0, False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return RequestResult(False, error=f"status {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=chunk["error"]["message"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 -- counted as an error, the level goes on
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    if not done or first is None:
        return RequestResult(False, error="the stream ended without [DONE] or without text")
    return RequestResult(True, first - start, gaps, tokens)


async def load_level(url: str, concurrency: int, requests: int, body: dict) -> tuple[list[RequestResult], float]:
    """`requests` completions sent by `concurrency` clients, each sending its next when one is done."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        await one_request(client, {**body, "max_tokens": 2})  # warm: connections, the server's first forwards
        left = iter(range(requests))
        results: list[RequestResult] = []

        async def worker():
            for _ in left:
                results.append(await one_request(client, body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def summarize_level(concurrency: int, results: list[RequestResult], wall: float) -> Level:
    good = [r for r in results if r.ok]
    ttft = [r.ttft_s * 1e3 for r in good]
    itl = [g * 1e3 for r in good for g in r.gaps_s]
    tokens = sum(r.tokens for r in good)

    def pct(values, q):
        return float(np.percentile(values, q)) if values else float("nan")

    return Level(concurrency, len(results), len(results) - len(good), wall, len(good) / wall, tokens / wall,
                 pct(ttft, 50), pct(ttft, 99), pct(itl, 50), pct(itl, 99), tokens,
                 error_examples=sorted({r.error for r in results if not r.ok})[:3])


def plain_tok_s(model: GPT, prompt_ids: list[int], batch: int, new_tokens: int, decoder: Decoder,
                repeats: int) -> float:
    """The ceiling: batch x new_tokens tokens over one plain batched generation, prefill included (median)."""
    prompts = [prompt_ids] * batch
    device = next(model.parameters()).device
    for _ in generate_ids(model, prompts, 4, temperature=0, decoder=decoder):  # warm up
        pass
    rates = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in generate_ids(model, prompts, new_tokens, temperature=0, decoder=decoder):
            pass
        sync(device)
        rates.append(batch * new_tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def run_serve_bench(options: ServeBenchOptions, out: Path | None = None, progress: bool = True) -> dict:
    require_load_client()
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device.type)
    tokenizer = GPT2Tokenizer()
    prompt = fixed_prompt(tokenizer, options.prompt_tokens)
    body = {"prompt": prompt, "max_tokens": options.new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    max_batch = options.max_batch or max(options.concurrency)
    levels: list[Level] = []
    with tempfile.TemporaryDirectory(prefix="gpt2train-bench-serve-") as folder:
        ckpt = Path(folder) / "run"
        model = save_random_checkpoint(options, ckpt)
        log = Path(folder) / "server.log"
        try:
            with running_server(ckpt, options, max_batch, max(options.concurrency), log) as url:
                for concurrency in options.concurrency:
                    requests = options.requests or 4 * concurrency
                    results, wall = asyncio.run(load_level(url, concurrency, requests, body))
                    levels.append(summarize_level(concurrency, results, wall))
                    if progress:
                        level = levels[-1]
                        print(f"  concurrency {concurrency}: {level.output_tok_s:,.1f} output tok/s, "
                              f"{level.errors} errors", flush=True)
        except RuntimeError:
            print(log.read_text()[-2000:], file=sys.stderr)
            raise
    model = model.to(device=device, dtype=dtype)
    decoder = Decoder(model, COMPILE_SETTINGS[options.compile])
    prompt_ids = tokenizer.encode(prompt)
    for level in levels:  # after the server has stopped: the two never share the machine
        level.plain_tok_s = plain_tok_s(model, prompt_ids, level.concurrency, options.new_tokens, decoder,
                                        options.repeats)
        level.of_plain = level.output_tok_s / level.plain_tok_s
    result = {
        "model": options.model,
        "device": describe(device).name if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()})",
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prompt_tokens": options.prompt_tokens,
        "new_tokens": options.new_tokens,
        "max_batch": max_batch,
        "date": format_utc(time.time()),
        "torch": torch.__version__,
        "decode_path": decoder.describe(max_batch),
        "levels": [asdict(level) for level in levels],
        "targets": targets(levels),
    }
    result["markdown"] = serve_table(result)
    write_result(result, out)
    return result


def targets(levels: list[Level]) -> dict:
    """Issue 31's targets where concurrency 1 and 8 were both measured: concurrency 8's output tokens/s at
    least 3x concurrency 1's and 0.85x the plain batch-8 decode, its p50 time to first token at most 3x
    concurrency 1's, and no errors."""
    by = {level.concurrency: level for level in levels}
    found = {"errors": sum(level.errors for level in levels)}
    if 1 in by and 8 in by:
        one, eight = by[1], by[8]
        found.update(throughput_8_over_1=eight.output_tok_s / one.output_tok_s, of_plain_8=eight.of_plain,
                     ttft_p50_8_over_1=eight.ttft_p50_ms / one.ttft_p50_ms)
        found["met"] = {"throughput_8_over_1 >= 3": found["throughput_8_over_1"] >= 3,
                        "of_plain_8 >= 0.85": found["of_plain_8"] >= 0.85,
                        "ttft_p50_8_over_1 <= 3": found["ttft_p50_8_over_1"] <= 3,
                        "errors == 0": found["errors"] == 0}
    return found


def serve_table(result: dict) -> str:
    lines = [f"{result['model']} (random weights) on {result['device']}, {result['dtype']}, {result['threads']} threads: "
             f"{result['prompt_tokens']}-token prompt, {result['new_tokens']} new tokens, greedy, streamed; "
             f"server --max-batch {result['max_batch']}",
             "",
             "| concurrency | requests | req/s | output tok/s | plain tok/s | of plain | TTFT p50 / p99 (ms) | "
             "ITL p50 / p99 (ms) | errors |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["levels"]:
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['requests_s']:.2f} | {r['output_tok_s']:,.1f} | "
                     f"{r['plain_tok_s']:,.1f} | {r['of_plain']:.2f} | {r['ttft_p50_ms']:,.0f} / {r['ttft_p99_ms']:,.0f} | "
                     f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['errors']} |")
    lines += ["", f"plain: {result['decode_path']}"]
    found = result["targets"]
    if "met" in found:
        lines.append(f"targets: concurrency 8 / 1 throughput {found['throughput_8_over_1']:.2f}x (>= 3), "
                     f"of plain batch 8 {found['of_plain_8']:.2f} (>= 0.85), TTFT p50 8 / 1 "
                     f"{found['ttft_p50_8_over_1']:.2f}x (<= 3), errors {found['errors']} (0): "
                     + ", ".join(f"{name} {'met' if ok else 'NOT met'}" for name, ok in found["met"].items()))
    return "\n".join(lines)
