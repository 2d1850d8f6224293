"""Exact match on held-out conversations: does the model's greedy reply equal the conversation's last assistant
message? The prompt is the conversation up to that message (what chat.render_prompt gives for the messages
before it), the reply is generated greedily until <|im_end|>, and it counts when its text, stripped, equals the
message's.

The conversations are a chat folder's val split as `prepare chat` wrote it: the mask tells each conversation's
last assistant message (its last run of trained tokens, which ends with <|im_end|>), so the prompt and the
reference are read from the ids themselves, with no second copy of the data to keep in step.
"""

from __future__ import annotations

import numpy as np
import torch

from gpt2train.chat import has_chat_tokens
from gpt2train.data.chat_loader import split_conversations
from gpt2train.eval import rank_and_world, rank_batches, sum_across_ranks
from gpt2train.generation import generate_batch
from gpt2train.progress import show_progress

SLACK = 8  # tokens a reply may run past its reference's length (another split of the same text) before it is cut


def last_reply(ids: np.ndarray, mask: np.ndarray) -> tuple[list[int], list[int]]:
    """(prompt, reference) of one rendered conversation: the ids before its last assistant message's content
    (they end with the assistant's header), and that content's ids (without the <|im_end|> that closes it)."""
    trained = np.flatnonzero(mask)
    if len(trained) == 0:
        raise ValueError("a conversation without an assistant message has no reply to check")
    end = int(trained[-1])  # the <|im_end|>
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return ids[:start].tolist(), ids[start:end].tolist()


def held_out_replies(data_dir, block_size: int, limit: int = 0) -> tuple[list[tuple[list[int], list[int]]], int]:
    """The (prompt, reference) of the val split's conversations, the first `limit` of them (0: all), and how many
    of those were left out because the prompt and the reply would not fit the model's context."""
    pairs, skipped = [], 0
    for ids, mask in split_conversations(data_dir, "val"):
        if limit and len(pairs) + skipped >= limit:
            break
        if len(ids) > block_size:
            skipped += 1
            continue
        pairs.append(last_reply(ids, mask))
    return pairs, skipped


def reply_text(tokenizer, ids: list[int]) -> str | None:
    """A generated reply as text: up to its <|im_end|>, stripped. A reply that never ended is None: it cannot
    match."""
    if tokenizer.im_end_id not in ids:
        return None
    return tokenizer.decode(ids[: ids.index(tokenizer.im_end_id)]).strip()


@torch.no_grad()
def exact_match(model, tokenizer, pairs: list[tuple[list[int], list[int]]], batch_size: int,
                progress: bool = False) -> dict:
    """Greedy replies to each (prompt, reference), batch_size prompts per batch, each rank every world_size-th;
    {"exact_match", "n", "correct", "examples"}: the accuracy, the counts over all ranks, and rank 0's first few
    (prompt, reference and reply as text)."""
    if not has_chat_tokens(tokenizer):
        raise ValueError("exact match needs the chat template's tokenizer (ChatTokens): read it from the chat data")
    device = next(model.parameters()).device
    correct, examples = 0, []
    for rows in show_progress(rank_batches(len(pairs), batch_size), desc="chat", unit="batch",
                              enabled=progress and rank_and_world()[0] == 0):
        if len(rows) == 0:
            continue
        prompts = [pairs[i][0] for i in rows]
        budgets = [len(pairs[i][1]) + 1 + SLACK for i in rows]  # the reference, its <|im_end|>, some slack
        longest = max(min(b, model.config.block_size - len(p)) for b, p in zip(budgets, prompts))
        replies = generate_batch(model, prompts, max(1, longest), temperature=0.0, eot_id=tokenizer.im_end_id)
        for i, reply, budget in zip(rows, replies, budgets):
            text = reply_text(tokenizer, reply[:budget])  # each row's own budget: the same for any batch
            reference = tokenizer.decode(pairs[i][1]).strip()
            correct += text == reference
            if len(examples) < 3:
                examples.append({"prompt": tokenizer.decode(pairs[i][0]), "reference": reference, "reply": text})
    (correct,) = sum_across_ranks([correct], device)  # every rank holds all pairs and scored its share
    n = len(pairs)
    return {"exact_match": correct / n if n else 0.0, "n": n, "correct": int(correct), "examples": examples}
