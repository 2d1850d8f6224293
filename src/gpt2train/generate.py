"""Sampling from a trained model with a KV cache: each new token costs one position, not the whole prefix."""

from __future__ import annotations

import warnings
from typing import Iterator

import torch
import torch.nn.functional as F

from gpt2train.model import GPT, KVCache


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Keep the top_k most likely tokens and the smallest set whose probability reaches top_p."""
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # tokens after the set already reached top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def generate_stream(model: GPT, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, eot_id: int | None = None, seed: int | None = None,
                    use_cache: bool = True) -> Iterator[int]:
    """Yield new token ids one at a time. temperature 0 means greedy. Stops at eot_id or the token budget.

    An empty prompt starts from EOT; a prompt longer than the context is cropped to its last tokens.
    """
    cfg = model.config
    device = next(model.parameters()).device
    if not prompt_ids:
        if eot_id is None:
            raise ValueError("an empty prompt needs the tokenizer's end-of-text id to start from")
        prompt_ids = [eot_id]
    if len(prompt_ids) >= cfg.block_size:
        warnings.warn(f"prompt of {len(prompt_ids)} tokens cropped to its last {cfg.block_size - 1}", stacklevel=2)
        prompt_ids = prompt_ids[-(cfg.block_size - 1):]
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    cache = KVCache(cfg, 1, cfg.block_size, device, next(model.parameters()).dtype) if use_cache else None
    tokens = idx
    for _ in range(max_new_tokens):
        if cache is not None and cache.length + idx.size(1) > cfg.block_size:
            cache = None  # the context is full: fall back to a sliding window without the cache
        if cache is None:
            idx = tokens[:, -cfg.block_size:]
        logits = model(idx, kv_cache=cache)[:, -1, : cfg.vocab_size].float()  # padded ids are never sampled
        if temperature <= 0:
            next_id = logits.argmax(-1, keepdim=True)
        else:
            probs = F.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
            next_id = torch.multinomial(probs, 1, generator=generator)
        token = int(next_id)
        yield token
        if eot_id is not None and token == eot_id:
            return
        tokens = torch.cat([tokens, next_id], dim=1)
        idx = next_id if cache is not None else tokens


def generate(model: GPT, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    return list(generate_stream(model, prompt_ids, max_new_tokens, **kwargs))
