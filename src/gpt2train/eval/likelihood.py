"""The log-likelihood of a continuation given a context under our model: the one scorer beneath the
multiple-choice suite (suite.py) and lm-evaluation-harness's requests (harness.py). Plain torch."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F


@torch.no_grad()
def score_continuations(model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]], batch_size: int = 16,
                        autocast=None) -> list[tuple[float, bool]]:
    """(sum of log-probs of the continuation's tokens, whether greedy decoding picks each of them) for every
    (context ids, continuation ids) pair; the context must hold at least one token.

    A row is context + continuation cropped from the left to block_size + 1 tokens (the input is all but
    the last). Rows are batched longest first, right-padded: a causal model's logits at a position do not
    depend on what comes after it, so padding changes no score. Only the positions that predict a
    continuation token go through the head and the softmax: a long few-shot context costs its blocks, not
    the vocabulary-wide head at each of its positions.
    """
    device = next(model.parameters()).device
    block_size, vocab_size = model.config.block_size, model.config.vocab_size
    rows, lengths = [], []
    for context, continuation in pairs:
        if not context:
            raise ValueError("a continuation needs at least one context token (the end-of-text token for none)")
        rows.append((context + continuation)[-(block_size + 1):])
        lengths.append(min(len(continuation), block_size))
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    results: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        T = len(rows[batch[0]]) - 1  # the longest input in this batch
        inputs = torch.zeros((len(batch), T), dtype=torch.long)
        for b, i in enumerate(batch):
            inputs[b, : len(rows[i]) - 1] = torch.tensor(rows[i][:-1])
        # (row in the batch, position, its target) for every continuation token: the input at position t
        # predicts token t + 1 of its row
        scored = [(b, t, rows[i][t + 1]) for b, i in enumerate(batch)
                  for t in range(len(rows[i]) - 1 - lengths[i], len(rows[i]) - 1)]
        if not scored:
            model(inputs[:, :1].to(device))  # nothing to score, but every rank runs the same forwards (FSDP)
            continue
        owners, positions, targets = (torch.tensor(column, device=device) for column in zip(*scored))
        with autocast or nullcontext():
            logits = model(inputs.to(device), positions=(owners, positions))  # (scored tokens, V)
        logprobs = F.log_softmax(logits[:, :vocab_size].float(), dim=-1)
        token_logprobs = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        greedy = (logprobs.argmax(-1) == targets).tolist()
        start_of = 0
        for i in batch:
            n = lengths[i]
            results[i] = (sum(token_logprobs[start_of : start_of + n]), all(greedy[start_of : start_of + n]))
            start_of += n
    return results


def split_context(context: str, continuation: str) -> tuple[str, str]:
    """Move trailing spaces of the context onto the continuation: GPT-2's BPE puts a word's leading space
    in the word's token, so ("The sky is ", "blue") must score " blue", not "blue" after a lone " "."""
    stripped = context.rstrip(" ")
    return stripped, context[len(stripped):] + continuation
