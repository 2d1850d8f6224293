"""The chat fine-tune across tasks: for each offline demo task (data/chat_demo.py), its conversations are made and
prepared, a base run is fine-tuned on them with a chat preset (chat-cpu), and the result is scored on the held-out
conversations: exact match of the greedy replies and the assistant tokens' loss.

Each step is the library function its command calls: write_demo and prepare_chat (`prepare chat --demo`), train
(`train`), evaluate_checkpoint (`eval --tasks val,chat`); the bench only chains them and writes the table.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpt2train.bench.runs import run_hardware, train_logged
from gpt2train.config import load_config
from gpt2train.data.chat_demo import DEFAULT_CONVERSATIONS, DEMOS, most_conversations, write_demo
from gpt2train.data.conversations import prepare_chat
from gpt2train.eval.run import evaluate_checkpoint
from gpt2train.files import write_json_atomic, write_text_atomic
from gpt2train.ranges import UsageError
from gpt2train.units import format_utc

TARGET = 0.8  # issue 58: every task's held-out exact match from the quickstart's run


@dataclass
class ChatBenchOptions:
    tasks: list[str] = field(default_factory=lambda: list(DEMOS))
    base: str = "runs/shakespeare"  # train.init_from of every fine-tune: a run, a checkpoint or a HF GPT-2 folder
    config: str = "chat-cpu"
    conversations: int = 0  # per task, one in ten held out; 0: each task's default (DEFAULT_CONVERSATIONS)
    seed: int = 0  # the demos' seed
    steps: int = 0  # train.max_steps; 0: the config's
    limit: int = 0  # held-out conversations scored; 0: all
    overrides: list[str] = field(default_factory=list)  # --set, applied to every fine-tune
    device: str = ""  # "": the config's train.device; eval's too ("auto" where empty)

    def __post_init__(self):
        if not self.tasks or any(t not in DEMOS for t in self.tasks) or len(set(self.tasks)) != len(self.tasks):
            raise UsageError(f"tasks {self.tasks}: give demo tasks ({', '.join(DEMOS)}), each once")
        most = min(most_conversations(task) for task in self.tasks)
        if self.conversations and not 20 <= self.conversations <= most:  # 20: two held out, and a batch of the rest
            raise UsageError(f"conversations must be 20 to {most:,} (what the demos make), not {self.conversations:,}")


@dataclass
class TaskResult:
    task: str
    conversations: int = 0  # made, one in ten held out
    status: str = "ok"  # ok | failed
    reason: str = ""
    steps: int = 0
    train_s: float = 0.0  # the fine-tune's wall time: build, steps, its validations and checkpoints
    eval_s: float = 0.0
    exact_match: float | None = None
    correct: int = 0
    held_out: int = 0  # the held-out conversations scored
    loss: float | None = None  # the held-out assistant tokens' mean loss (the windows the run validates on)
    loss_conversations: int = 0
    examples: list[dict] = field(default_factory=list)  # a few held-out (prompt, reference, reply)


def run_chat_bench(options: ChatBenchOptions, out_dir: str | Path, progress: bool = True) -> dict:
    """Prepare, fine-tune and score every task into OUT/TASK/{data,run}; write chat.md and chat.json to OUT."""
    out = Path(out_dir)
    taken = [task for task in options.tasks if (out / task).exists()]
    if taken:
        raise UsageError(f"{out / taken[0]} exists already (an earlier bench): pass a new --out")
    started = time.time()
    results = []
    for i, task in enumerate(options.tasks):
        result = run_task(task, options, out / task)
        results.append(result)
        if progress:
            print(f"[{i + 1}/{len(options.tasks)}] {task}: {describe(result)}", flush=True)
    record = {"options": dataclasses.asdict(options), "date": format_utc(started), "torch": torch.__version__,
              "cpu_threads": torch.get_num_threads(), "hardware": hardware(out, results), "target": TARGET,
              "tasks": [dataclasses.asdict(r) for r in results], "command": command_line(options, out)}
    record["markdown"] = to_markdown(record)
    write_text_atomic(out / "chat.md", record["markdown"])
    write_json_atomic(out / "chat.json", record)
    return record


def run_task(task: str, options: ChatBenchOptions, folder: Path) -> TaskResult:
    """One task: its conversations prepared, the fine-tune (console in run/console.log), then eval. A failing
    fine-tune (the guard giving up, a config the data cannot feed) is reported with its error; the others go on."""
    result = TaskResult(task, conversations=options.conversations or DEFAULT_CONVERSATIONS[task])
    data, run = folder / "data", folder / "run"
    prepare_chat([write_demo(task, data, result.conversations, options.seed)], data)
    cfg = load_config(options.config, [*options.overrides, f"data.dir={data}", f"train.init_from={options.base}"])
    cfg.train.max_steps = options.steps or cfg.train.max_steps
    cfg.train.device = options.device or cfg.train.device
    cfg.log.progress, cfg.log.tensorboard, cfg.log.wandb = "lines", False, False
    run.mkdir(parents=True)
    start = time.perf_counter()
    try:
        trained = train_logged(cfg, run)
        result.steps, result.train_s = trained["step"], time.perf_counter() - start
        start = time.perf_counter()
        scored = evaluate_checkpoint(run, "val,chat", limit=options.limit, device=options.device or "auto",
                                     progress=False)["tasks"]
        result.eval_s = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - the other tasks still tell something
        result.status, result.reason = "failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        result.train_s = result.train_s or time.perf_counter() - start
        return result
    chat, val = scored["chat"], scored["val"]
    result.exact_match, result.correct, result.held_out = chat["exact_match"], chat["correct"], chat["n"]
    result.loss, result.loss_conversations, result.examples = val["loss"], val["windows"], chat["examples"]
    return result


def hardware(out: Path, results: list[TaskResult]) -> dict:
    """The device the first fine-tune that started trained on, from its run_start record."""
    for r in results:
        hardware = run_hardware(out / r.task / "run") if (out / r.task / "run").is_dir() else {}
        if hardware:
            return hardware
    return {}


def describe(r: TaskResult) -> str:
    if r.status != "ok":
        return f"failed after {r.train_s:.0f} s ({r.reason})"
    return (f"exact match {r.exact_match:.4f} ({r.correct} of {r.held_out} held out), held-out loss {r.loss:.4f}, "
            f"{r.steps} steps in {r.train_s:.0f} s, eval {r.eval_s:.0f} s")


def command_line(options: ChatBenchOptions, out: Path) -> str:
    """The command that repeats this bench."""
    defaults = ChatBenchOptions()
    parts = ["gpt2train bench chat"]
    parts += [f"--tasks {','.join(options.tasks)}"] if options.tasks != defaults.tasks else []
    parts += [f"--{name} {getattr(options, name)}" for name in ("base", "config", "conversations", "seed", "steps",
                                                                 "limit", "device")
              if getattr(options, name) != getattr(defaults, name)]
    parts += [f"--set {item}" for item in options.overrides]
    return " ".join(parts + [f"--out {out}"])


def table(tasks: list[dict]) -> str:
    lines = ["| task | held-out exact match | correct | held-out assistant loss | steps | fine-tune wall time | "
             "eval wall time |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for t in tasks:
        if t["status"] != "ok":
            lines.append(f"| {t['task']} | failed: {t['reason']} | | | | {t['train_s']:.0f} s | |")
            continue
        lines.append(f"| {t['task']} | {t['exact_match']:.4f} | {t['correct']} of {t['held_out']} | {t['loss']:.4f} "
                     f"({t['loss_conversations']} conversations) | {t['steps']} | {t['train_s']:.0f} s | "
                     f"{t['eval_s']:.0f} s |")
    return "\n".join(lines)


def conversations(tasks: list[dict]) -> str:
    return ", ".join(f"{t['task']} {t['conversations']:,}" for t in tasks)


def to_markdown(record: dict) -> str:
    o, hw = record["options"], record["hardware"]
    device = hw.get("device_name") or hw.get("device") or "n/a"
    reached = [t["task"] for t in record["tasks"] if t["status"] == "ok" and t["exact_match"] >= record["target"]]
    lines = [f"# Chat fine-tune across tasks: {o['config']} from {o['base']}", "",
             f"- date: {record['date']}; torch {record['torch']}; device {device}, torch threads: "
             f"{record['cpu_threads']}",
             f"- command: `{record['command']}`",
             f"- per task: {conversations(record['tasks'])} conversations (seed {o['seed']}), one in ten held out; "
             "exact match: greedy replies equal to the held-out answer",
             "", table(record["tasks"]), "",
             f"{len(reached)} of {len(record['tasks'])} tasks reach {record['target']} held-out exact match"
             + (f": {', '.join(reached)}" if reached else "")]
    return "\n".join(lines) + "\n"
