"""The commands around a run: `gpt2train report`, `plan`, `doctor`, `ckpt inspect`, `memory` and `config` (show,
list), each one's arguments beside its handler."""

from __future__ import annotations

from pathlib import Path

from gpt2train.cli.arguments import OUT_FOLDER, POSITIVE, POSITIVE_INT, PROBABILITY_MASS, config_options, ranged
from gpt2train.ranges import UsageError, between


def add_report(sub) -> None:
    p = sub.add_parser("report", help="figures and an HTML page of one or more runs (works mid-run)")
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories; several overlay")
    p.add_argument("--out", type=OUT_FOLDER, metavar="DIR", help="default: RUN_DIR/report, or ./report for several runs")
    p.add_argument("--log-y", action="store_true", help="loss on a log scale")
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from gpt2train.report import build_report

    print(build_report(args.run_dirs, args.out, log_y=args.log_y))
    return 0


def add_plan(sub) -> None:
    p = sub.add_parser("plan", parents=[config_options()],
                       help="parameters, FLOPs, tokens, time and memory of a config before training it")
    p.add_argument("--data", metavar="DIR", help="prepared data folder (default: data.dir of the config)")
    p.add_argument("--device", default="auto", help="H100, H200, A100 (80GB), A100-40GB, L4, RTX 4090, CPU, "
                   "or auto: this machine (default %(default)s)")
    p.add_argument("--gpus", type=POSITIVE_INT, default=1, help="devices the run uses (default %(default)s)")
    p.add_argument("--mfu", type=PROBABILITY_MASS, help="assumed model FLOPs utilization, 0..1 (default: a gpt2train bench "
                   "figure from runs/bench-*/journey.json, else 0.40)")
    p.add_argument("--bench-json", metavar="PATH", help="take the MFU from this gpt2train bench journey.json "
                   "(default: see --mfu)")
    p.add_argument("--tokens-per-s", type=POSITIVE, metavar="N", help="a device without a known peak (CPU): its "
                   "training tokens/s, e.g. from a run's log (default: timed here on a few steps)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from gpt2train.plan import PlanError, format_plan, make_plan, target_device
    from gpt2train.runconfig import Environment
    from gpt2train.training.speed import resolve_measuring

    try:
        device = target_device(args.device)
    except PlanError as e:  # a name outside the device table is a bad argument
        raise UsageError(str(e)) from None
    run = resolve_measuring(args.config, args.set or [], Environment(world_size=args.gpus), device=device,
                            mfu=args.mfu, tokens_per_s=args.tokens_per_s)  # the dial's batch for --gpus
    plan = make_plan(run, device, gpus=args.gpus, mfu=args.mfu, data_dir=args.data,
                     bench_json=args.bench_json, tokens_per_s=args.tokens_per_s)
    print(format_plan(plan))
    return 0


def add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="diagnose a run from its metrics: symptoms, evidence and fixes",
                       description="Exit status: 0 healthy, 1 warnings only, 2 serious findings (or bad input).")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="run directory holding metrics.jsonl")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args) -> int:
    import json

    from gpt2train.doctor import diagnose, format_diagnosis
    from gpt2train.runlog import RunLogError

    try:
        diagnosis = diagnose(args.run_dir)
    except RunLogError as e:  # exit 1 is doctor's "warnings only": an unreadable RUN_DIR is the argument's fault
        raise UsageError(str(e)) from e
    print(json.dumps(diagnosis.to_dict(), indent=2) if args.json else format_diagnosis(diagnosis))
    return diagnosis.exit_status


def add_ckpt(sub) -> None:
    p = sub.add_parser("ckpt", help="look into checkpoints")
    ckpt = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = ckpt.add_parser("inspect", help="step, tokens, losses, model, tokenizer and config of a checkpoint; "
                        "a damaged one is reported in one line (exit 1)")
    c.add_argument("path", type=Path, metavar="PATH", help="run directory (its newest good checkpoint) or a checkpoint folder")
    c.set_defaults(func=cmd_ckpt_inspect)


def cmd_ckpt_inspect(args) -> int:
    from gpt2train.checkpoint import describe_checkpoint

    print(describe_checkpoint(args.path))
    return 0


def add_memory(sub) -> None:
    p = sub.add_parser("memory", parents=[config_options()],
                       help="predicted memory per device; --find-batch measures what fits")
    p.add_argument("--world-size", type=POSITIVE_INT, default=1, help="ranks: FSDP divides weights, gradients, optimizer "
                   "(default %(default)s)")
    p.add_argument("--find-batch", action="store_true", help="search the largest micro_batch that fits (CUDA)")
    p.add_argument("--headroom", type=ranged(float, between(0, 1, high_open=True)), default=0.1,
                   help="share of device memory left free (default %(default)s)")
    p.add_argument("--gpu-memory-gib", type=POSITIVE, default=80.0,
                   help="without CUDA, the GPU memory the estimate-based suggestion plans for (default %(default)s)")
    p.set_defaults(func=cmd_memory)


def cmd_memory(args) -> int:
    from gpt2train.bench.find_batch import find_batch_report
    from gpt2train.memory import estimate_memory
    from gpt2train.runconfig import Environment
    from gpt2train.training.speed import resolve_measuring

    cfg = resolve_measuring(args.config, args.set or [], Environment(world_size=args.world_size)).config
    print(estimate_memory(cfg, args.world_size).format())
    if args.find_batch:
        print(find_batch_report(cfg, args.headroom, args.world_size, args.gpu_memory_gib))
    return 0


def add_config(sub) -> None:
    p = sub.add_parser("config", help="the presets, and the config a run would use")
    conf = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = conf.add_parser("show", parents=[config_options()],
                        help="the resolved config as TOML: defaults <- --config <- --set")
    c.set_defaults(func=cmd_config_show)
    c = conf.add_parser("list", help="the presets shipped with gpt2train, with what each is for")
    c.set_defaults(func=cmd_config_list)


def cmd_config_show(args) -> int:
    from gpt2train.config import dump_toml
    from gpt2train.sizing import format_derived
    from gpt2train.training.speed import resolve_measuring

    run = resolve_measuring(args.config, args.set or [])
    print(dump_toml(run.config), end="")
    # Where the values nobody wrote came from, as TOML comments: the output stays a config file.
    if run.dial:
        print(f"\n# the size dial, model.depth = {run.config.model.depth} (docs/training.md, \"One size dial\"):")
        print("\n".join(f"#   {line}" for line in format_derived(run.dial)))
    others = [key for key in run.origins if key not in {d.key for d in run.dial}]
    if others:
        print("\n# derived, not set in the config:")
        print("\n".join(f"#   {key} = {run.value(key)!r}  ({run.origin(key)})" for key in others))
    return 0


def cmd_config_list(args) -> int:
    from gpt2train.config import preset_descriptions

    presets = preset_descriptions()
    width = max(len(name) for name in presets)
    for name, description in presets.items():
        print(f"{name:<{width}}  {description}")
    return 0
