"""`pipeline --plan`: each stage's work, time and memory before any is spent, on this machine or a named one
(`--device H100 --gpus 8`), and the total. A train stage is `gpt2train plan`'s estimate of its config (a fine-tune
of an earlier stage's model: planned with that model's shape, which the stage will read); an eval stage is the
forward passes its tasks make, at the train stage's speed; a prepare or export stage is said in words (its time
depends on disk and tokenizer, not on the device), with a figure where the input's size gives one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpt2train.pipeline.definition import Pipeline, Stage
from gpt2train.pipeline.measure import folder_bytes
from gpt2train.units import format_bytes, format_count, format_duration

# Forward-only tokens of an eval's tasks (a rough count: windows and choices of typical length). The suite: ten
# CORE tasks of up to 500 examples, about four choices of 100 tokens; chat: 500 conversations, 24 reply tokens
# generated after a prompt of 40.
EVAL_TOKENS = {"val": 20 * 1024, "core": 10 * 500 * 4 * 100, "chat": 500 * (40 + 24 * 24), "hellaswag": 10042 * 4 * 100}
FORWARD_SHARE = 1 / 3  # a forward costs about a third of a training step's FLOPs


@dataclass
class Estimate:
    stage: Stage
    work: str
    seconds: float | None  # None: not estimated
    memory: int | None = None  # bytes per device


def estimate_pipeline(pipeline: Pipeline, device_name: str = "auto", gpus: int = 1) -> list[Estimate]:
    from gpt2train.plan import target_device

    device = target_device(device_name)
    plans: dict[str, object] = {}  # train stage -> its Plan, for the stages that read its model
    estimates = []
    for stage in pipeline.stages:
        command = stage.argv[0]
        if command == "train":
            plans[stage.name] = plan = train_plan(stage, plans, device, gpus)
            estimates.append(Estimate(stage, f"{plan.cfg.train.max_steps:,} steps of {format_count(plan.tokens_per_step)} "
                                      f"tokens, {format_count(plan.params)} parameters",
                                      plan.wall_s(plan.budget_tokens), plan.memory.total_bytes))
        elif command == "eval":
            estimates.append(eval_estimate(stage, source_plan(stage, plans)))
        else:
            estimates.append(Estimate(stage, other_work(stage), None))
    return estimates


def source_plan(stage: Stage, plans: dict):
    """The plan of the train stage whose model this stage reads (its checkpoint or init_from), if any."""
    return next((plans[name] for name in stage.after if name in plans), None)


def train_plan(stage: Stage, plans: dict, device, gpus: int):
    from gpt2train.plan import make_plan
    from gpt2train.runconfig import Environment
    from gpt2train.training.speed import resolve_measuring

    overrides = list(stage.args.set or [])
    source = source_plan(stage, plans)
    if source is not None:  # its init_from is made by an earlier stage: not there yet, its shape known
        m = source.cfg.model
        overrides += ["train.init_from=", *(f"model.{k}={getattr(m, k)}" for k in
                                            ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"))]
    run = resolve_measuring(stage.args.config, overrides, Environment(world_size=gpus), device=device)
    return make_plan(run, device, gpus=gpus)


def eval_estimate(stage: Stage, plan) -> Estimate:
    tasks = (stage.args.tasks or "val").split(",")
    limit = stage.args.limit
    tokens = 0
    for task in tasks:
        base = EVAL_TOKENS.get(task, EVAL_TOKENS["core"] / 10)
        if limit and task in ("core", "chat", "hellaswag"):
            base = base * min(1.0, limit / 500)
        tokens += base
    work = f"{stage.args.tasks or 'default tasks'}" + (f", at most {limit} examples each" if limit else "")
    if plan is None:
        return Estimate(stage, work, None)
    seconds = plan.wall_s(int(tokens * FORWARD_SHARE))
    return Estimate(stage, f"{work}, ~{format_count(int(tokens))} tokens forward", seconds)


def other_work(stage: Stage) -> str:
    args, command = stage.args, stage.command
    if command == "prepare hf":
        return f"stream and tokenize {args.name} from the Hub (its size sets the time; `gpt2train bench prepare`)"
    if command == "prepare chat" and args.hf:
        return f"stream and render {args.hf}'s conversations from the Hub (its size sets the time)"
    if command == "prepare chat" and args.demo:
        return f"make and tokenize the {args.demo} demo's conversations (seconds)"
    paths = [Path(p) for p in getattr(args, "paths", None) or []]
    if paths:
        return f"tokenize {format_bytes(sum(folder_bytes(p) for p in paths if p.exists()))} of text"
    if command.startswith("export"):
        return "write the weights (seconds); then measure the export's greedy agreement"
    return f"{command} (seconds to minutes)"


def format_estimates(estimates: list[Estimate], device_name: str, gpus: int) -> str:
    where = "this machine" if device_name == "auto" else f"{gpus} x {device_name}"
    width = max(len(e.stage.name) for e in estimates)
    lines = [f"plan on {where}:"]
    for e in estimates:
        time_text = format_duration(e.seconds) if e.seconds is not None else "-"
        memory = f", {format_bytes(e.memory)} per device" if e.memory else ""
        lines.append(f"  {e.stage.name:<{width}}  {time_text:>12}  {e.work}{memory}")
    known = [e.seconds for e in estimates if e.seconds is not None]
    rest = len(estimates) - len(known)
    lines.append(f"  {'total':<{width}}  {format_duration(sum(known)):>12}"
                 + (f"  (+ the {rest} stage(s) not timed: see their work)" if rest else ""))
    return "\n".join(lines)
