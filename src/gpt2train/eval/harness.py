"""EleutherAI's lm-evaluation-harness on a gpt2train checkpoint: `gpt2train eval --tasks lm-eval:TASK`.

The harness turns a task into text requests of three kinds and asks a model object to answer them;
HarnessModel answers with our GPT and tokenizer, so no conversion to Hugging Face is needed:
  loglikelihood          (context, continuation) -> (sum of log p(continuation tokens), greedy or not)
  loglikelihood_rolling  (document,)             -> sum of log p(every token), EOT as the first context
  generate_until         (context, gen_kwargs)    -> text up to the first stop string
Scores come from logits cut to the tokenizer's vocabulary, as in val.py and hellaswag.py: padded ids get
no probability. The harness is an optional extra (`pip install gpt2train[eval]`), imported only here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gpt2train.eval import rank_and_world
from gpt2train.eval.likelihood import score_continuations, split_context
from gpt2train.generation import generate_stream
from gpt2train.ranges import UsageError

PREFIX = "lm-eval:"  # how --tasks names a harness task
MISSING = "lm-evaluation-harness is not installed: pip install 'gpt2train[eval]' (or pip install lm-eval)"
DEFAULT_MAX_GEN_TOKS = 256  # the harness's own default when a task sets no max_gen_toks


def import_lm_eval():
    try:
        import lm_eval
        import lm_eval.api.model  # noqa: F401  (the LM base class)
        import lm_eval.tasks  # noqa: F401  (TaskManager)
    except ImportError:
        raise ImportError(MISSING) from None
    return lm_eval


# --- documents as continuations (plain torch, no harness needed) -------------------------------------
def rolling_windows(ids: list[int], prefix_id: int, block_size: int) -> list[tuple[list[int], list[int]]]:
    """A document as (context, continuation) pairs that predict each of its tokens exactly once.

    The document is cut into spans of block_size tokens; each span is scored as the continuation of
    everything before it (the prefix token first), so with score_continuations' left crop each span sees
    a full block_size of context, the last (shorter) one included.
    """
    tokens = [prefix_id] + ids
    return [(tokens[: start + 1], tokens[start + 1 : start + 1 + block_size]) for start in range(0, len(ids), block_size)]


def rolling_loglikelihood(model: torch.nn.Module, documents: list[list[int]], prefix_id: int, batch_size: int = 16,
                          autocast=None) -> list[float]:
    """Sum of log-probs of every token of each document, all documents' windows batched together."""
    windows, owner = [], []
    for d, ids in enumerate(documents):
        for pair in rolling_windows(ids, prefix_id, model.config.block_size):
            windows.append(pair)
            owner.append(d)
    totals = [0.0] * len(documents)
    for d, (logprob, _) in zip(owner, score_continuations(model, windows, batch_size, autocast)):
        totals[d] += logprob
    return totals


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """text up to the first stop string, and whether one was found."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


# --- the harness's model interface --------------------------------------------------------------------
def harness_model(model: torch.nn.Module, tokenizer, batch_size: int = 16, autocast=None):
    """An lm_eval.api.model.LM that answers the harness's requests with `model` (eval mode) and `tokenizer`."""
    lm_eval = import_lm_eval()

    class HarnessModel(lm_eval.api.model.LM):
        def __init__(self):
            super().__init__()
            self._rank, self._world_size = rank_and_world()
            self._device = next(model.parameters()).device

        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            pairs = []
            for request in requests:
                context, continuation = split_context(*request.args)
                pairs.append((encode_task_text(tokenizer, context) or [tokenizer.eot_id],
                              encode_task_text(tokenizer, continuation)))
            return score_continuations(model, pairs, batch_size, autocast)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            documents = [encode_task_text(tokenizer, request.args[0]) for request in requests]
            return rolling_loglikelihood(model, documents, tokenizer.eot_id, batch_size, autocast)

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            return [generate_until_stop(model, tokenizer, context, gen_kwargs or {})
                    for context, gen_kwargs in (r.args for r in requests)]

        # Under torchrun the harness gives each rank its share of the requests and gathers the answers.
        def all_gather(self, tensor):
            return all_gather_ranks(tensor, self._world_size)

        def gather_object(self, obj, dst=0):
            return gather_object_ranks(obj, self._rank, self._world_size, dst)

        def barrier(self) -> None:
            if self._world_size > 1:
                dist.barrier()

    return HarnessModel()


def encode_task_text(tokenizer, text: str) -> list[int]:
    """The ids of a task's text; a text the tokenizer cannot encode is a ValueError that says so."""
    try:
        return tokenizer.encode(text)
    except ValueError as e:  # e.g. a char tokenizer meeting a character its corpus lacked
        raise ValueError(f"this checkpoint's {tokenizer.name} tokenizer cannot encode the task's text: {e}") from None


def generate_until_stop(model: torch.nn.Module, tokenizer, context: str, gen_kwargs: dict) -> str:
    """generate_until's answer to one request: the model's continuation of context (its last block_size tokens),
    up to the first stop string (`until`), the end token or max_gen_toks; greedy unless do_sample."""
    until = gen_kwargs.get("until") or []
    stops = [until] if isinstance(until, str) else list(until)
    max_new = int(gen_kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
    temperature = float(gen_kwargs.get("temperature", 1.0)) if gen_kwargs.get("do_sample") else 0.0  # 0: greedy
    prompt = encode_task_text(tokenizer, context)[-model.config.block_size:] or [tokenizer.eot_id]
    ids = []
    for token in generate_stream(model, prompt, max_new, temperature=temperature, top_k=int(gen_kwargs.get("top_k", 0)),
                                 top_p=float(gen_kwargs.get("top_p", 1.0)), eot_id=tokenizer.eot_id):
        if token == tokenizer.eot_id:
            break
        ids.append(token)
        text, stopped = cut_at_stop(tokenizer.decode(ids), stops)
        if stopped:
            return text
    return cut_at_stop(tokenizer.decode(ids), stops)[0]


def all_gather_ranks(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's tensor, stacked (0-dim) or concatenated in rank order: the harness's LM.all_gather."""
    if world_size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor)
    return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)


def gather_object_ranks(obj, rank: int, world_size: int, dst: int = 0):
    """Every rank's object, as a list on rank dst (None on the others): the harness's LM.gather_object."""
    if world_size == 1:
        return [obj]
    gathered = [None] * world_size if rank == dst else None
    dist.gather_object(obj, gathered, dst=dst)
    return gathered


# --- running tasks ------------------------------------------------------------------------------------
def task_manager(include: list[str] | None = None, defaults: bool = True):
    """The harness's task index: its own tasks (unless not `defaults`: indexing them takes seconds) plus the task
    YAMLs in the `include` folders."""
    lm_eval = import_lm_eval()
    return lm_eval.tasks.TaskManager(include_path=[str(f) for f in include] if include else None, include_defaults=defaults)


def check_task_names(manager, names: list[str]) -> None:
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known and not n.endswith((".yaml", ".yml"))]
    if unknown:
        raise UsageError(f"unknown lm-eval task {unknown[0]!r}; `lm-eval ls tasks` lists the harness's tasks, "
                         "--lm-eval-include DIR adds a folder of task YAMLs")


def run_harness(model: torch.nn.Module, tokenizer, names: list[str], *, manager=None, limit: int = 0,
                batch_size: int = 16, autocast=None) -> dict[str, dict]:
    """Run harness tasks (or groups) on our model: {"lm-eval:NAME": {"metrics", "n", "num_fewshot", "harness"}}
    for every task and group the harness reports (a group's subtasks included). Empty on ranks other than 0.

    metrics holds the harness's numbers under its names (acc, acc_stderr, acc_norm, ...); a metric taken
    through a filter other than "none" keeps it after a comma (exact_match,strict-match).
    """
    lm_eval = import_lm_eval()
    manager = manager or task_manager()
    try:
        out = lm_eval.simple_evaluate(model=harness_model(model, tokenizer, batch_size, autocast), tasks=list(names),
                                      task_manager=manager, limit=limit or None, log_samples=False)
    except KeyError as e:  # the harness's "not a registered task" error, as one line
        raise ValueError(f"lm-eval: {str(e.args[0] if e.args else e).splitlines()[0]}") from e
    if out is None:  # ranks other than 0
        return {}
    results = {}
    for name, values in out["results"].items():
        metrics = {}
        for key, value in values.items():
            if "," in key:  # "acc,none": the metric, then the filter it went through
                metric, filter_name = key.split(",", 1)
                metrics[metric if filter_name == "none" else key] = value
        n = out.get("n-samples", {}).get(name, {}).get("effective")
        results[PREFIX + name] = {"metrics": metrics, "n": n, "num_fewshot": out.get("n-shot", {}).get(name),
                                  "harness": f"lm-eval {out.get('lm_eval_version', lm_eval.__version__)}"}
    return results
