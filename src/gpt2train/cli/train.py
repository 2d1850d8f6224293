"""`gpt2train train`: its arguments and its handler, which resolves the run, trains it and says how it ended
(for a run a signal stopped: the command that resumes it)."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from gpt2train.cli.arguments import OUT_FOLDER, config_options
from gpt2train.training.signals import exit_status, ignore_from_now_on, signal_name


def add_train(sub) -> None:
    p = sub.add_parser("train", parents=[config_options()], help="train a model from a TOML config")
    p.add_argument("--out", type=OUT_FOLDER, help="run directory: config.toml, metrics.jsonl, checkpoints/ "
                   "(default runs/<config file name>, runs/default without --config)")
    p.add_argument("--resume", metavar="auto|PATH",
                   help="auto: continue the run in --out from its newest checkpoint (a new run if it has none); PATH: "
                        "continue from that checkpoint or run directory; without it a new run starts, refused if --out "
                        "holds a run")
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    from gpt2train.distributed import launch_env
    from gpt2train.runconfig import Environment
    from gpt2train.training.console import ALREADY_FINISHED
    from gpt2train.training.loop import train
    from gpt2train.training.speed import resolve_measuring

    rank, _, world_size = launch_env()  # torchrun's variables, checked before the config splits the batch over them
    run_dir = args.out or default_run_dir(args.config)
    # One resolution (the file and --set's, as train() resolves a Config); a time budget's speed: the resumed
    # checkpoint's, else measured (or estimated) here.
    run = resolve_measuring(args.config, args.set or [], Environment.of_launch(run_dir, args.resume))
    if args.config is None and rank == 0:
        print(no_config_line(run.config), flush=True)
    out = train(run, run_dir, resume=args.resume)  # a lost rank raises PeerLost, a ConnectionError: exit 1
    # A run stopped by a signal (saved) exits with the shell's status for it, on every rank (they agreed on one).
    status = exit_status(out["signal"]) if out["reason"] == "signal" else 0
    if status and world_size > 1:
        ignore_from_now_on()  # torchrun's SIGTERM, once a rank exited with it, must not end this one by the signal
    # Under torchrun rank 0 alone reports; a run resumed at its end has said so (and what to raise) already.
    if rank != 0 or out["reason"] == ALREADY_FINISHED:
        return status
    best = out["best_val_loss"]  # inf until the first validation (a run stopped before it)
    best_text = f"{best:.4f}" if math.isfinite(best) else "n/a (no validation yet)"
    if status:
        print(f"stopped by {signal_name(out['signal'])} at step {out['step']} (saved); best val loss {best_text}; "
              f"exit status {status}; resume with: {resume_command(args, run_dir)}")
    else:
        print(f"finished at step {out['step']} ({out['reason']}); best val loss {best_text}; run directory {run_dir}")
    return status


def resume_command(args, run_dir: Path) -> str:
    """The command that continues this run from its newest checkpoint: this launch's, with --out and --resume auto."""
    from gpt2train.distributed import launch_env, local_world_size

    words = ["gpt2train", "train", *(["--config", args.config] if args.config else [])]
    words += [word for setting in args.set or [] for word in ("--set", setting)]
    command = shlex.join([*words, "--out", str(run_dir), "--resume", "auto"])
    world_size, per_node = launch_env()[2], local_world_size()
    if world_size == 1:
        return command
    launcher = (f"torchrun --standalone --nproc_per_node={per_node}" if per_node == world_size
                else "torchrun <this launch's options>")
    return f"{launcher} -m {command}"  # -m gpt2train: the module torchrun runs


def no_config_line(cfg) -> str:
    """What `train` without --config trains: the built-in defaults, a GPT-2 124M, slow on a CPU; said first."""
    from dataclasses import replace

    from gpt2train.counting import parameter_count
    from gpt2train.tokenizer import GPT2_VOCAB_SIZE
    from gpt2train.units import format_count

    m, t = cfg.model, cfg.train
    params = parameter_count(replace(m, vocab_size=m.vocab_size or GPT2_VOCAB_SIZE))
    data = ", ".join(cfg.data.sources) or cfg.data.dir
    return (f"no --config: training the built-in defaults, a GPT-2 of {format_count(params)} parameters "
            f"({m.n_layer} layers x {m.n_embd}, context {m.block_size}) for {t.max_steps:,} steps on {data} "
            "(`gpt2train config show`); on a CPU try --config shakespeare-cpu (`gpt2train config list`)")


def default_run_dir(config: str | None) -> Path:
    """runs/<config name>: the same folder on every launch, so `--resume auto` finds the run again."""
    return Path("runs") / (Path(config).stem if config else "default")
