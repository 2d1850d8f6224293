"""Sampling from a trained model with a KV cache: each new token costs one position, not the whole prefix.

Several prompts (or several samples of one) run as one batch: the prompts are left-padded to a common
length, and the KV cache keeps a padding mask and per-row positions, so every row is continued exactly as
it would be alone (the same greedy tokens; see model.KVCache). Each step is one forward of (B, 1) new ids.
A prompt is read in one forward (the prefill, whose length varies), then every step feeds one id per row
(the decode step, always the same shapes): that step can be compiled once, on CUDA as a CUDA graph.

Seeded sampling: one torch.Generator draws the whole batch's tokens, so a batch is reproducible for a
given seed; row i of a batch is not the sample that row alone would give with any seed (one draw per
step for the batch costs a fraction of B draws of one row each on a GPU).

When prompt + generated tokens fill the context (block_size), generation goes on with a sliding window
of the last block_size tokens, recomputed at every step, as nanoGPT does (Decoder.slide; the server's rows
slide the same way: docs/model.md, "Past the context").
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpt2train.model import GPT, KVCache
from gpt2train.ranges import SEEDS, TEMPERATURES, TOP_K, TOP_P, at_least


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top_k largest (0: no limit) and outside the smallest set of
    tokens, taken from the most likely down, whose probability reaches top_p (1.0: no limit).

    Tokens tied with the k-th logit are all kept. The most likely token always survives.
    """
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # probability of the tokens ranked above each one
        drop_sorted = mass_before >= top_p  # the set had already reached top_p without this token
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


MIN_TEMPERATURE = 1e-4


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """(B, V) logits -> (B, 1) next ids: argmax when temperature <= 0, else a filtered, tempered draw."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    # Dividing by a tinier temperature overflows float32 to inf (nan probabilities); this one is greedy already.
    temperature = max(temperature, MIN_TEMPERATURE)
    probs = F.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


class RowBlockLinears:
    """A context in which every nn.Linear of a model computes an input of at most MAX_ROWS rows (a decode
    step, a short prefill) as one batched matmul over row blocks of its weight (BlockedLinear); larger
    inputs run F.linear as before. Decoder uses it on a CPU for fp32 weights: there MKL streams a (out, in)
    weight through x @ W^T for a few rows more slowly than it streams the same weight's row blocks through
    one bmm, and a decode step is bound by reading its weights (docs/benchmarks.md, "Matmuls in row
    blocks"). Nothing is copied: the blocks are views of the weights, made on the
    first entry and again only after a weight was replaced or moved. Each layer gets an instance attribute
    `forward` (nn.Module calls it in place of the class's) while the context is open: a TorchFunctionMode
    would do the same for any F.linear, but it intercepts every op of the forward, which cost more than the
    blocks won in a decode step."""

    MAX_ROWS = 64  # where the blocks stop paying (docs/benchmarks.md, "Matmuls in row blocks")

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, nn.Linear) and row_blocks(m.out_features)]
        self.forwards: dict[nn.Linear, BlockedLinear | None] = {}

    # Straight into the instance's __dict__: nn.Module's __setattr__ and __delattr__ checks, twice per layer
    # and step, cost a measurable part of an eager decode step (docs/benchmarks.md, "Matmuls in row blocks").
    def __enter__(self):
        for module in self.layers:
            forward = self.forwards.get(module)
            if forward is None or not forward.current():
                # A weight stored transposed (a view of an (in, out) tensor) has no row blocks to view.
                forward = self.forwards[module] = BlockedLinear(module) if module.weight.is_contiguous() else None
            if forward is not None:
                vars(module)["forward"] = forward

    def __exit__(self, *exc):
        for module in self.layers:
            vars(module).pop("forward", None)


class BlockedLinear:
    """An nn.Linear's forward for a few rows: F.linear(x, weight, bias) as one batched matmul of x's rows by
    each of `blocks` row blocks of the weight, the same products summed in another order (equal to
    F.linear within fp32 rounding). The views of the weight and bias are made once, detached: with
    gradients on (or many rows), the layer's own F.linear runs."""

    def __init__(self, module: nn.Linear):
        self.module = module
        self.memory = memory_of(module)
        self.out_features, self.in_features = module.weight.shape
        self.blocks = row_blocks(self.out_features)
        weight = module.weight.detach().view(self.blocks, -1, self.in_features)
        self.weight_blocks = weight.transpose(1, 2)  # (blocks, in, out / blocks)
        self.bias_blocks = None if module.bias is None else module.bias.detach().view(self.blocks, 1, -1)

    def current(self) -> bool:
        """Whether the views still show the layer's weight and bias (`.data =` or `.to()` gives them new memory)."""
        return memory_of(self.module) == self.memory

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > RowBlockLinears.MAX_ROWS * self.in_features or torch.is_grad_enabled():
            return F.linear(x, self.module.weight, self.module.bias)
        rows = x.reshape(1, -1, self.in_features).expand(self.blocks, -1, -1)  # (blocks, rows, in), not copied
        if self.bias_blocks is None:
            y = torch.bmm(rows, self.weight_blocks)
        else:
            y = torch.baddbmm(self.bias_blocks, rows, self.weight_blocks)
        return y.transpose(0, 1).reshape(*x.shape[:-1], self.out_features)  # (blocks, rows, out/blocks) -> (..., out)


def memory_of(module: nn.Linear) -> tuple[int, int]:
    return module.weight.data_ptr(), 0 if module.bias is None else module.bias.data_ptr()


def row_blocks(out_features: int) -> int:
    """How many row blocks a weight of out_features rows splits into evenly (16, 8, 4 or 2), 0 if none."""
    return next((n for n in (16, 8, 4, 2) if out_features % n == 0), 0)


class Decoder:
    """The model's forwards while generating: the prefill (the prompt, once) and the decode step: logits
    (B, V) of the next token from one new id per row (B, 1) and the KV cache.

    The decode step runs eagerly, or compiled once with torch.compile (its shapes never change: the cache
    is preallocated, the input is (B, 1)): on CUDA in mode reduce-overhead, which replays the step as a
    CUDA graph instead of launching ~100 small kernels. compile="auto" compiles on CUDA only: on a CPU the
    compiled step was slower (docs/benchmarks.md, Generation). Where compiling fails, the step falls back
    to eager, with a warning, and `path` says so. Eager forwards on a CPU with fp32 weights run their
    matmuls in row blocks (blocked="auto"; see RowBlockLinears). The first compiled call, which compiles,
    is timed: `first_step_s`, so that a speed can be given without it (speed_report).
    """

    def __init__(self, model: GPT, compile: bool | str = "auto", blocked: bool | str = "auto"):
        self.model = model
        param = next(model.parameters())
        self.device = param.device
        if compile == "auto":
            compile = self.device.type == "cuda"
        if blocked == "auto":
            blocked = self.device.type == "cpu" and param.dtype == torch.float32
        self.blocked = bool(blocked)
        self.eager_context = RowBlockLinears(model) if self.blocked else contextlib.nullcontext()
        self.compiled = None
        self.path = "eager"
        if compile:
            mode = "reduce-overhead" if self.device.type == "cuda" else "default"
            self.compiled = torch.compile(self.eager_step, mode=mode, fullgraph=True, dynamic=False)
            self.path = f"compiled ({mode})"
        self._static_cache = None
        self.first_step_s: float | None = None  # seconds of the first compiled call: compiling, mostly

    def prefill(self, ids: torch.Tensor, padding_mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (B, V) after the prompts (B, T), left-padded (padding_mask False there), filling the cache."""
        with self.eager_context:
            return self.model(ids, kv_cache=cache, padding_mask=padding_mask, last_only=True)[:, -1]

    def slide(self, window: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) after each row's window (B, T), the last tokens of a row whose tokens fill the context,
        read afresh into a cache of their own (real: False at left padding). Past the context every new token
        costs a forward of the whole window."""
        cache = KVCache(self.model.config, window.size(0), window.size(1), window.device, next(self.model.parameters()).dtype)
        return self.prefill(window, real, cache)

    def eager_step(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return self.model(ids, kv_cache=cache, last_only=True)[:, -1]

    def __call__(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if self.compiled is None:
            with self.eager_context:
                return self.eager_step(ids, cache)
        if self.first_step_s is not None:
            return self.compiled_step(ids, cache)
        start = time.perf_counter()  # this call compiles: timed apart from the steps after it
        logits = self.compiled_step(ids, cache)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.first_step_s = time.perf_counter() - start
        return logits

    def compiled_step(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The compiled decode step; the eager one (for good, with a warning) where compiling fails."""
        if cache is not self._static_cache:  # CUDA graphs may update a tensor in place only at a fixed address
            for t in (*cache.k, *cache.v, cache.real, cache.filled):
                torch._dynamo.mark_static_address(t)
            self._static_cache = cache
        try:
            if self.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs may be overwritten
            return self.compiled(ids, cache)
        except Exception as e:  # noqa: BLE001 -- no C++ compiler, an unsupported backend...: eager still works
            warnings.warn(f"compiled decode failed, decoding eagerly: {type(e).__name__}: {e}", stacklevel=3)
            self.compiled, self.path = None, "eager (compile failed)"
            return self(ids, cache)

    def cache_size(self, needed: int) -> int:
        """Slots to preallocate: eagerly, what this generation needs (attention reads every slot); compiled,
        that rounded up to a multiple of 128, so that generations of other lengths mostly reuse a compiled
        step. (The whole context, one shape for all, made the compiled step on a CPU several times slower:
        docs/benchmarks.md, "Matmuls in row blocks".)"""
        if self.compiled is None:
            return needed
        return min(self.model.config.block_size, -(-needed // 128) * 128)

    def describe(self, batch_size: int) -> str:
        blocked = ", matmuls in row blocks" if self.blocked and self.compiled is None else ""
        return f"decode: {self.path}, KV cache{blocked}, batch {batch_size}"


def speed_report(tokens: int, seconds: float, batch: int, first_step_s: float | None = None) -> str:
    """The line a generation's speed is told in: `tokens` new tokens (all rows) in `seconds`. With
    `first_step_s` (Decoder.first_step_s: the first decode step, which compiled), that step's time is told
    apart and tokens/s is of the other tokens (the step made one per row), so that compiling is not read as
    decoding speed."""
    line = f"--- {tokens} tokens in {seconds:.2f} s"
    if first_step_s is None:
        return f"{line} ({tokens / max(seconds, 1e-9):.1f} tok/s)"
    line += f": {first_step_s:.2f} s compiling (the first decode step)"
    rest_tokens, rest_s = tokens - batch, seconds - first_step_s
    if rest_tokens <= 0 or rest_s <= 0:
        return line
    return f"{line}, then {rest_tokens / rest_s:.1f} tok/s over the other {rest_tokens} tokens"


def left_padded(prompts: list[list[int]], block_size: int, eot_id: int | None,
                device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as (B, T) ids, left-padded with 0 to the longest, and (B, T) booleans, False at the padding.

    An empty prompt starts from EOT (as GPT-2 saw documents begin); a prompt longer than the context is
    cropped to its last block_size tokens, with a warning.
    """
    rows = []
    for ids in prompts:
        if not ids:
            if eot_id is None:
                raise ValueError("an empty prompt needs the tokenizer's end-of-text id to start from")
            ids = [eot_id]
        if len(ids) > block_size:
            warnings.warn(f"prompt of {len(ids)} tokens cropped to its last {block_size} (the model's context)",
                          stacklevel=4)
            ids = ids[-block_size:]
        rows.append(ids)
    T = max(len(ids) for ids in rows)
    tokens = torch.tensor([[0] * (T - len(ids)) + ids for ids in rows], dtype=torch.long, device=device)
    real = torch.tensor([[False] * (T - len(ids)) + [True] * len(ids) for ids in rows], device=device)
    return tokens, real


def check_generation_args(model: GPT, prompts, max_new_tokens, temperature, top_k, top_p, seed) -> None:
    """ValueError in one line for an argument generation cannot use: a library caller's mistake would otherwise
    surface as torch's error from deep inside, or pass silently (a negative temperature sampled greedily).
    The numbers take the ranges `gpt2train sample` and the server take."""
    vocab = model.config.vocab_size
    for ids in prompts:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"a prompt must be a list of token ids (tokenizer.encode(text)), not {type(ids).__name__}")
        for i in ids:
            if not is_integer(i) or not 0 <= i < vocab:
                raise ValueError(f"prompt token {i!r} is not a token id of this model: an integer in [0, {vocab})")
    numbers = (("max_new_tokens", max_new_tokens, at_least(0)), ("temperature", temperature, TEMPERATURES),
               ("top_k", top_k, TOP_K), ("top_p", top_p, TOP_P), ("seed", 0 if seed is None else seed, SEEDS))
    for name, value, allowed in numbers:
        integer = name in ("max_new_tokens", "top_k", "seed")
        if not (is_integer(value) or not integer and isinstance(value, float)):
            raise ValueError(f"{name} = {value!r} is not {'an integer' if integer else 'a number'}")
        if value not in allowed:
            raise ValueError(f"{name} = {value!r} is out of range; it must be {allowed}")


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@torch.no_grad()
def generate_ids(model: GPT, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, eot_id: int | None = None, seed: int | None = None,
                 use_cache: bool = True, decoder: Decoder | None = None) -> Iterator[torch.Tensor]:
    """Yield the next id of every prompt's row, (B,), step by step: max_new_tokens steps, or fewer once
    every row has produced eot_id (a row's ids after its eot_id are to be ignored). temperature 0 means
    greedy; seed makes sampling reproducible (None: torch's global generator). use_cache=False recomputes
    the whole window at each step (a reference; one prompt only). The model is in eval mode meanwhile.
    """
    check_generation_args(model, prompts, max_new_tokens, temperature, top_k, top_p, seed)
    cfg = model.config
    param = next(model.parameters())
    tokens, real = left_padded(prompts, cfg.block_size, eot_id, param.device)
    B = tokens.size(0)
    if not use_cache and not real.all():
        raise ValueError("prompts of different lengths need the KV cache (its padding mask)")
    generator = torch.Generator(device=param.device).manual_seed(seed) if seed is not None else None
    decoder = decoder or Decoder(model, compile=False)
    # The last new token is never fed back: the cache needs prompt + max_new_tokens - 1 slots at most.
    size = decoder.cache_size(min(cfg.block_size, tokens.size(1) + max_new_tokens - 1))
    finished = torch.zeros(B, dtype=torch.bool, device=param.device)
    was_training = model.training
    model.eval()
    try:
        cache, cached, next_ids = None, 0, None
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = model(tokens[:, -cfg.block_size:])[:, -1]
            elif cache is None:  # the prefill
                cache = KVCache(cfg, B, size, param.device, param.dtype)
                logits = decoder.prefill(tokens, real, cache)
                cached = tokens.size(1)
            elif cached < cache.size:
                logits = decoder(next_ids, cache)  # (B, V); the last ids, contiguous: the same strides every step
                cached += 1
            else:  # the context is full: the last block_size tokens, afresh
                logits = decoder.slide(tokens[:, -cfg.block_size:], real[:, -cfg.block_size:])
            next_ids = sample_next(logits, temperature, top_k, top_p, generator)  # (B, 1)
            yield next_ids[:, 0]
            if eot_id is not None:
                finished |= next_ids[:, 0] == eot_id
                if finished.all():
                    return
            tokens = torch.cat([tokens, next_ids], dim=1)
            real = torch.cat([real, torch.ones_like(next_ids, dtype=torch.bool)], dim=1)
    finally:
        model.train(was_training)


def generate_stream(model: GPT, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> Iterator[int]:
    """Yield one prompt's new token ids one at a time, stopping after eot_id; see generate_ids for the options."""
    for next_ids in generate_ids(model, [prompt_ids], max_new_tokens, **kwargs):
        yield int(next_ids[0])


def generate(model: GPT, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """The new token ids (not the prompt); see generate_ids for the options."""
    return list(generate_stream(model, prompt_ids, max_new_tokens, **kwargs))


def generate_batch(model: GPT, prompts: list[list[int]], max_new_tokens: int, **kwargs) -> list[list[int]]:
    """New token ids for each prompt (any lengths), all rows in one batch, each row ending at its eot_id.
    Greedy rows equal each prompt's `generate`; a seeded batch is reproducible as a whole."""
    eot_id = kwargs.get("eot_id")
    steps = [ids.tolist() for ids in generate_ids(model, prompts, max_new_tokens, **kwargs)]
    rows = [list(row) for row in zip(*steps)] if steps else [[] for _ in prompts]
    return [row[: row.index(eot_id) + 1] if eot_id in row else row for row in rows]


class TextStream:
    """Printable text from token ids as they arrive. A character whose UTF-8 bytes span several tokens
    (an emoji, most CJK) is held back until complete, instead of printing replacement characters."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token: int) -> str:
        """The new text that `token` completes ('' while a character is still incomplete)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # maybe the first bytes of a character: wait for the rest
            return ""
        return self.flush()

    def flush(self) -> str:
        """Whatever is not shown yet, complete or not (call once at the end)."""
        text = self.tokenizer.decode(self.ids)
        new, self.shown = text[len(self.shown):], text
        return new
