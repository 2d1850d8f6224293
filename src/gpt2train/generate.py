"""Sampling from a trained model with a KV cache: each new token costs one position, not the whole prefix.

One prompt at a time. `generate_batch` continues several prompts by running them one after another:
prompts of different lengths then need no padding, attention masks or per-row positions, and every
row gives exactly what it gives alone. (Batching rows would be faster on a GPU; sampling is not where
this project spends its time.)

When prompt + generated tokens fill the context (block_size), generation goes on with a sliding window
of the last block_size tokens, recomputed without the cache, as nanoGPT does.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from gpt2train.model import GPT, KVCache


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


@torch.no_grad()
def generate_stream(model: GPT, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, eot_id: int | None = None, seed: int | None = None,
                    use_cache: bool = True) -> Iterator[int]:
    """Yield new token ids one at a time. temperature 0 means greedy. Stops after yielding eot_id, or
    after max_new_tokens. seed makes sampling reproducible (None: torch's global generator).

    An empty prompt starts from EOT (as GPT-2 saw documents begin); a prompt longer than the context
    is cropped to its last block_size tokens, with a warning. The model is in eval mode meanwhile.
    """
    cfg = model.config
    param = next(model.parameters())
    if not prompt_ids:
        if eot_id is None:
            raise ValueError("an empty prompt needs the tokenizer's end-of-text id to start from")
        prompt_ids = [eot_id]
    if len(prompt_ids) > cfg.block_size:
        warnings.warn(f"prompt of {len(prompt_ids)} tokens cropped to its last {cfg.block_size} "
                      f"(the model's context)", stacklevel=2)
        prompt_ids = prompt_ids[-cfg.block_size:]
    generator = torch.Generator(device=param.device).manual_seed(seed) if seed is not None else None
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=param.device)  # (1, T)
    cache = KVCache(cfg, 1, cfg.block_size, param.device, param.dtype) if use_cache else None
    was_training = model.training
    model.eval()
    try:
        new = tokens  # what the model has not seen yet: the prompt, then one token per step
        for _ in range(max_new_tokens):
            if cache is not None and cache.length + new.size(1) > cfg.block_size:
                cache = None  # the context is full: from here on, a sliding window without the cache
            if cache is None:
                new = tokens[:, -cfg.block_size:]
            logits = model(new, kv_cache=cache)[:, -1, :]  # (1, V)
            next_id = sample_next(logits, temperature, top_k, top_p, generator)  # (1, 1)
            token = int(next_id)
            yield token
            if eot_id is not None and token == eot_id:
                return
            tokens = torch.cat([tokens, next_id], dim=1)
            new = next_id
    finally:
        model.train(was_training)


def generate(model: GPT, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """The new token ids (not the prompt); see generate_stream for the options."""
    return list(generate_stream(model, prompt_ids, max_new_tokens, **kwargs))


def generate_batch(model: GPT, prompts: list[list[int]], max_new_tokens: int, *, seed: int | None = None,
                   **kwargs) -> list[list[int]]:
    """New token ids for each prompt (any lengths), each continued on its own; row i uses seed + i, so a
    row's sample does not depend on the other rows."""
    return [generate(model, prompt, max_new_tokens, seed=None if seed is None else seed + i, **kwargs)
            for i, prompt in enumerate(prompts)]


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
