"""`gpt2train pipeline`: its arguments and its handler, which loads the pipeline (every stage's command checked
before any runs), then plans it (--plan) or runs it and writes the report card."""

from __future__ import annotations

import shlex
import sys

from gpt2train.cli.arguments import POSITIVE_INT


def add_pipeline(sub) -> None:
    p = sub.add_parser("pipeline", help="the whole job in one resumable command: data, pretraining, the suite, a chat "
                       "fine-tune, its eval, the exports and a report card (docs/pipeline.md)")
    p.add_argument("--config", default="pipeline-cpu", help="a pipeline TOML file, or a preset: pipeline-cpu (Tiny "
                   "Shakespeare to a chat model on a CPU), pipeline-gpt2 (FineWeb-Edu, GPT-2 124M, GPUs) (default "
                   "%(default)s)")
    p.add_argument("--out", help="the pipeline's folder, {out} in its commands (default: the file's [pipeline] out)")
    p.add_argument("--set", action="append", metavar="STAGE.KEY=VALUE", help="a train stage's config key "
                   "(pretrain.train.max_steps=50), or another stage's flag (data.val-fraction=0.2); repeatable (default: none, "
                   "the stages as written)")
    p.add_argument("--plan", action="store_true", help="say each stage's work, time and memory, and the total; run nothing")
    p.add_argument("--device", default="auto", help="with --plan: H100, H200, A100 (80GB), A100-40GB, L4, RTX 4090, "
                   "CPU, or auto: this machine (default %(default)s)")
    p.add_argument("--gpus", type=POSITIVE_INT, default=1, help="with --plan: devices the training uses (default "
                   "%(default)s; a run under torchrun uses its ranks)")
    p.set_defaults(func=cmd_pipeline)


def cmd_pipeline(args) -> int:
    from gpt2train import cli
    from gpt2train.distributed import launch_env
    from gpt2train.pipeline.card import write_card
    from gpt2train.pipeline.definition import load_pipeline
    from gpt2train.pipeline.runner import Runner
    from gpt2train.ranges import UsageError

    if not args.plan and (args.device != "auto" or args.gpus != 1):
        raise UsageError("--device and --gpus go with --plan (a run uses this machine, and torchrun's ranks)")
    pipeline = load_pipeline(args.config, cli.build_parser(), out=args.out, overrides=args.set or [])
    rank, _, world_size = launch_env()
    if args.plan:
        print(planned(pipeline, args.device, args.gpus))
        return 0
    command = continue_command(args)
    if rank == 0:
        print(f"pipeline {pipeline.name}: {len(pipeline.stages)} stages into {pipeline.out}", flush=True)
        print(first_plan(pipeline, world_size), flush=True)
    runner = Runner(pipeline, cli.main, say=lambda line: print(line, flush=True) if rank == 0 else None, rank=rank,
                    continue_command=command)
    status = run_in_one_group(runner) if world_size > 1 else runner.run()
    if status or rank != 0:
        return status
    card = write_card(pipeline, runner.outcomes, args.config, command)
    sys.stdout.write(card.read_text())
    print(f"wrote {card} and {card.with_suffix('.html')}")
    return 0


def planned(pipeline, device: str, gpus: int) -> str:
    """What --plan prints: each stage's estimate on `gpus` x `device`, and the total."""
    from gpt2train.pipeline.estimate import estimate_pipeline, format_estimates

    return format_estimates(estimate_pipeline(pipeline, device, gpus), device, gpus)


def first_plan(pipeline, world_size: int) -> str:
    """The plan a run starts with (what --plan prints for this machine); a stage it cannot estimate yet is no
    reason not to run, so a failure is said in one line instead."""
    try:
        return planned(pipeline, "auto", world_size)
    except (ValueError, OSError) as e:  # a config that resolves only once an earlier stage has run, ...
        return f"plan: not estimated ({str(e).splitlines()[0] if str(e) else type(e).__name__})"


def run_in_one_group(runner) -> int:
    """Under torchrun: the ranks join one process group for the whole pipeline, which its train and eval stages
    use (each would otherwise leave it at its end, and a second rendezvous in one process does not meet)."""
    from gpt2train import distributed as D

    D.init_distributed("auto")
    status = 1
    try:
        status = runner.run()
    finally:
        D.shutdown_distributed(clean=status == 0)
    return status


def continue_command(args) -> str:
    """The command that runs this pipeline again (and skips what is done)."""
    words = ["gpt2train", "pipeline", "--config", args.config, *(["--out", args.out] if args.out else [])]
    words += [w for item in args.set or [] for w in ("--set", item)]
    return shlex.join(words)
