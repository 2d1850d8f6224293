"""`gpt2train bench BENCHMARK`: each benchmark's arguments beside its handler, which makes the benchmark's options
from them, runs it and prints its table (journey, profile, generate, serve, quality, scaling, multiplier, prepare,
chat)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpt2train.cli.arguments import (
    AUTO_COMPILE_HELP,
    AUTO_DTYPE_HELP,
    CONFIG_HELP,
    COUNT,
    OUT_FILE,
    OUT_FOLDER,
    POSITIVE_INT,
    WORKERS,
    batch_size_list,
    depth_list,
    device_name,
    ranged,
    seed_list,
)
from gpt2train.data.chat_demo import DEFAULT_CONVERSATIONS, DEMOS
from gpt2train.ranges import COMPILE_SETTINGS, DTYPE_NAMES, at_least
from gpt2train.units import name_stamp

THREADS_HELP = "CPU threads for torch, 0: torch's choice (default %(default)s)"


class ModelShapeNames:
    """The model shapes `bench` takes, the names of gpt2train.model.PRESETS, as argparse choices. Read when a
    --help or a --model needs them, so that parsing any other command line does not import torch."""

    def names(self) -> list[str]:
        from gpt2train.model import PRESETS

        return list(PRESETS)

    def __iter__(self):
        return iter(self.names())

    def __contains__(self, name) -> bool:
        return name in self.names()


MODEL_SHAPES = ModelShapeNames()


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="performance lab: measured speedups, technique by technique")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for add_benchmark in (add_bench_journey, add_bench_profile, add_bench_generate, add_bench_serve, add_bench_quality,
                          add_bench_scaling, add_bench_multiplier, add_bench_prepare, add_bench_chat):
        add_benchmark(bench)


def add_bench_journey(bench) -> None:
    p = bench.add_parser("journey", help="naive -> fast, one cumulative technique per stage (or --ablate)")
    p.add_argument("--model", default="gpt2-tiny", choices=MODEL_SHAPES, metavar="NAME",
                   help="model shape, random weights: %(choices)s (default %(default)s)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda if there is one, else cpu (default %(default)s)")
    p.add_argument("--micro-batch", type=POSITIVE_INT, default=8, help="sequences per step (default %(default)s)")
    p.add_argument("--seq-len", type=COUNT, default=0, help="tokens per sequence, 0: the model's block_size "
                   "(default %(default)s)")
    p.add_argument("--steps", type=POSITIVE_INT, default=10, help="measured steps per stage (default %(default)s)")
    p.add_argument("--warmup", type=COUNT, default=3, help="untimed steps first, compilation included "
                   "(default %(default)s)")
    p.add_argument("--skip", action="append", metavar="TECHNIQUE",
                   help="leave a technique off (repeatable): ram_loader, tf32, bf16, compile, sdpa, pad_vocab, "
                        "fused_adamw, chunked_loss, cpu_allocator (default: none, every technique on)")
    p.add_argument("--threads", type=COUNT, default=0, help=THREADS_HELP)
    p.add_argument("--out", type=OUT_FOLDER, help="output folder (default runs/bench-<time>)")
    p.add_argument("--ablate", action="store_true", help="also: everything on minus one technique at a time")
    p.set_defaults(func=cmd_bench_journey)


def cmd_bench_journey(args) -> int:
    from gpt2train.bench.journey import JourneyOptions, run_journey

    options = JourneyOptions(model=args.model, device=args.device, micro_batch=args.micro_batch,
                             seq_len=args.seq_len, steps=args.steps, warmup=args.warmup, ablate=args.ablate,
                             threads=args.threads, skip=args.skip or [])
    out = Path(args.out) if args.out else Path("runs") / name_stamp("bench")
    result = run_journey(options, out)
    print(result.markdown)
    print(f"wrote {out}/journey.md, journey.json, journey.png")
    return 0


def add_bench_profile(bench) -> None:
    p = bench.add_parser("profile", help="torch.profiler over a few training steps of each config: kernel time by "
                         "category (matmul, attention, optimizer, ...), step time, tokens/s, MFU")
    p.add_argument("--config", action="append", help="a config to profile, " + CONFIG_HELP + " (repeatable; "
                   "default: gpt2 and gpt2-modern)")
    p.add_argument("--data", metavar="DIR", help="a prepared data folder (default: random GPT-2 ids in a "
                   "temporary folder; speed does not depend on the text)")
    p.add_argument("--warmup", type=COUNT, default=3, help="untimed steps first, compilation included "
                   "(default %(default)s)")
    p.add_argument("--steps", type=POSITIVE_INT, default=3, help="steps timed without the profiler, then as many "
                   "profiled (default %(default)s)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config key of every "
                   "config (repeatable) (default: none)")
    p.add_argument("--device", type=device_name, help="train.device of every config (default: the config's)")
    p.add_argument("--out", type=OUT_FOLDER, help="output folder (default runs/bench-profile-<time>)")
    p.set_defaults(func=cmd_bench_profile)


def cmd_bench_profile(args) -> int:
    from gpt2train.bench.profile import ProfileOptions, run_profile

    options = ProfileOptions(configs=args.config or ProfileOptions().configs, data=args.data or "", warmup=args.warmup,
                             steps=args.steps, overrides=args.set or [], device=args.device or "")
    out = Path(args.out) if args.out else Path("runs") / name_stamp("bench-profile")
    result = run_profile(options, out)
    print(result["markdown"])
    print(f"wrote {out}/profile.md, profile.json")
    return 0


def add_bench_generate(bench) -> None:
    p = bench.add_parser("generate", help="time to first token, decode tok/s, bandwidth use; against transformers")
    p.add_argument("--model", default="gpt2", choices=MODEL_SHAPES, metavar="NAME",
                   help="model shape, random weights: %(choices)s (default %(default)s)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda, then mps, then cpu (default %(default)s)")
    p.add_argument("--batch-sizes", type=batch_size_list, default="1,8", help="comma-separated (default %(default)s)")
    p.add_argument("--prompt-tokens", type=POSITIVE_INT, default=8, help="prompt length (default %(default)s)")
    p.add_argument("--new-tokens", type=POSITIVE_INT, default=256, help="tokens generated per row (default %(default)s)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=2, help="timed runs of each, alternating "
                   "(default %(default)s)")
    p.add_argument("--compile", default="auto", choices=list(COMPILE_SETTINGS),
                   help=f"compile the decode step (default %(default)s; {AUTO_COMPILE_HELP})")
    p.add_argument("--no-hf", action="store_true", help="skip the comparison with transformers")
    p.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp (llama-cpp-python, CPU) on the same "
                   "weights as an f32 GGUF file, at batch 1")
    p.add_argument("--threads", type=COUNT, default=0, help=THREADS_HELP)
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                   help=f"weights' dtype, ours and transformers' (default %(default)s; {AUTO_DTYPE_HELP})")
    p.add_argument("--hf-dtype", choices=DTYPE_NAMES,
                   help="transformers' alone (default: the same as --dtype)")
    p.add_argument("--out", type=OUT_FILE, help="JSON file (default runs/bench-generate-<time>.json)")
    p.set_defaults(func=cmd_bench_generate)


def cmd_bench_generate(args) -> int:
    from gpt2train.bench.generate import GenerateOptions, run_generate_bench

    options = GenerateOptions(model=args.model, device=args.device, batch_sizes=args.batch_sizes,
                              prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats,
                              compile=COMPILE_SETTINGS[args.compile],
                              compare_hf=not args.no_hf, compare_llama_cpp=args.llama_cpp, threads=args.threads,
                              dtype=args.dtype, hf_dtype=args.hf_dtype or "")
    out = Path(args.out) if args.out else Path("runs") / name_stamp("bench-generate", ".json")
    result = run_generate_bench(options, out)
    print(result["markdown"])
    print(f"wrote {out}")
    return 0


def add_bench_serve(bench) -> None:
    p = bench.add_parser("serve", help="gpt2train serve under load: requests/s, output tok/s, time to first token, "
                         "inter-token latency; against the plain batched decode (pip install 'gpt2train[serve]')")
    p.add_argument("--model", default="gpt2", choices=MODEL_SHAPES, metavar="NAME",
                   help="model shape, random weights: %(choices)s (default %(default)s)")
    p.add_argument("--device", type=device_name, default="auto", help="the server's and the plain decode's "
                   "(default %(default)s)")
    p.add_argument("--concurrency", type=batch_size_list, default="1,8",
                   help="clients at once, comma-separated levels (default %(default)s)")
    p.add_argument("--requests", type=COUNT, default=0, help="requests per level, 0: four times the level "
                   "(default %(default)s)")
    p.add_argument("--prompt-tokens", type=POSITIVE_INT, default=64, help="prompt length (default %(default)s)")
    p.add_argument("--new-tokens", type=POSITIVE_INT, default=128, help="max_tokens of each request "
                   "(default %(default)s)")
    p.add_argument("--max-batch", type=COUNT, default=0, help="the server's --max-batch, 0: the largest level "
                   "(default %(default)s)")
    p.add_argument("--prefill-tokens", type=COUNT, default=0, help="the server's --prefill-tokens, 0: its own "
                   "(default %(default)s)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=2, help="timed runs of the plain decode (default %(default)s)")
    p.add_argument("--compile", default="auto", choices=list(COMPILE_SETTINGS),
                   help=f"as for sample (default %(default)s; {AUTO_COMPILE_HELP})")
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                   help=f"weights' dtype (default %(default)s; {AUTO_DTYPE_HELP})")
    p.add_argument("--out", type=OUT_FILE, help="JSON file (default runs/bench-serve-<time>.json)")
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args) -> int:
    from gpt2train.bench.serve import ServeBenchOptions, run_serve_bench

    options = ServeBenchOptions(model=args.model, device=args.device, dtype=args.dtype, compile=args.compile,
                                concurrency=args.concurrency, requests=args.requests, prompt_tokens=args.prompt_tokens,
                                new_tokens=args.new_tokens, max_batch=args.max_batch, repeats=args.repeats,
                                prefill_tokens=args.prefill_tokens)
    out = Path(args.out) if args.out else Path("runs") / name_stamp("bench-serve", ".json")
    result = run_serve_bench(options, out)
    print(result["markdown"])
    print(f"wrote {out}")
    return 0


def add_bench_quality(bench) -> None:
    p = bench.add_parser("quality", help="GPT-2 -> the modern recipe, one change per row (or --ablate): tokens and "
                         "time to reach GPT-2's validation loss")
    p.add_argument("--config", default="shakespeare-cpu", help="the GPT-2 row: " + CONFIG_HELP
                   + " (default %(default)s)")
    p.add_argument("--modern", default="shakespeare-modern", help="the recipe, a file or preset (default "
                   "%(default)s); it may differ from --config only in the changes' keys")
    # Whether --ablate and --recipe-only go together is QualityOptions' one check (the library's callers get it too).
    p.add_argument("--ablate", action="store_true", help="rows: GPT-2, the full recipe, the recipe minus each change")
    p.add_argument("--recipe-only", action="store_true", help="rows: GPT-2 and the full recipe only (the target "
                   "over several seeds, for less time; not with --ablate)")
    p.add_argument("--seeds", type=seed_list, help="comma-separated train.seed values; every row trains once per seed "
                   "(default: the config's seed)")
    p.add_argument("--steps", type=POSITIVE_INT, help="train.max_steps of every row (default: the config's)")
    p.add_argument("--eval-interval", type=POSITIVE_INT, default=25, help="steps between validations "
                   "(default %(default)s)")
    p.add_argument("--val-batches", type=COUNT, help="micro-batches per validation, 0: the whole val split "
                   "(default: the config's eval.val_batches)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config key of every row "
                   "(repeatable), e.g. data.dir=... (default: none)")
    p.add_argument("--device", type=device_name, help="train.device of every row (default: the config's)")
    p.add_argument("--target", choices=("val", "suite"), default="val", help="what a row must reach: GPT-2's final "
                   "validation loss, or its final score on the multiple-choice suite (eval.tasks, \"core\" where unset), "
                   "which then runs at every evaluation (default %(default)s)")
    p.add_argument("--out", type=OUT_FOLDER, help="output folder (default runs/bench-quality-<time>)")
    p.set_defaults(func=cmd_bench_quality)


def cmd_bench_quality(args) -> int:
    from gpt2train.bench.quality import QualityOptions, run_quality, target_line

    options = QualityOptions(config=args.config, modern=args.modern, ablate=args.ablate,
                             recipe_only=args.recipe_only, seeds=args.seeds,
                             steps=args.steps or 0, eval_interval=args.eval_interval, val_batches=args.val_batches,
                             overrides=args.set or [], device=args.device or "", target=args.target)
    out = Path(args.out) if args.out else Path("runs") / name_stamp("bench-quality")
    result = run_quality(options, out)
    print(result.table)
    print(target_line(result.target))
    print(f"wrote {out}/quality.md, quality.json, quality.png; each run's log in {out}/runs/")
    return 0


def add_bench_scaling(bench) -> None:
    p = bench.add_parser("scaling", help="a ladder of model.depth rungs at their compute-optimal budgets: fit loss "
                         "against compute, predict a bigger rung, train it, compare")
    p.add_argument("--config", default="scaling-cpu", help=CONFIG_HELP + "; it must leave the shape, batch and "
                   "steps to the size dial (default %(default)s)")
    p.add_argument("--depths", type=depth_list, help="the ladder's rungs, at least three (default 3,4,5: on "
                   "scaling-cpu depth 2 lies above the line through the others, docs/benchmarks.md)")
    p.add_argument("--predict", type=POSITIVE_INT, default=6, help="the rung to predict, then train (default %(default)s)")
    p.add_argument("--seeds", type=seed_list, help="comma-separated train.seed values; one ladder each "
                   "(default: the config's seed)")
    p.add_argument("--floor", type=ranged(float, at_least(0.0)), help="a known lower bound on the validation loss "
                   "(nats per token) that the fits keep their E above (default: the data's loss_floor in meta.json, "
                   "which `prepare markov` records; else 0)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config key of every rung "
                   "(repeatable), e.g. data.dir=... (default: none)")
    p.add_argument("--out", type=OUT_FOLDER, help="output folder; run again with the same one to continue an interrupted ladder "
                   "(default runs/bench-scaling)")
    p.set_defaults(func=cmd_bench_scaling)


def cmd_bench_scaling(args) -> int:
    from gpt2train.bench.scaling import ScalingOptions, run_ladder, summary_line

    options = ScalingOptions(config=args.config, depths=args.depths or ScalingOptions().depths, predict=args.predict,
                             seeds=args.seeds, floor=args.floor, overrides=args.set or [])
    out = Path(args.out) if args.out else Path("runs") / "bench-scaling"
    result = run_ladder(options, out)
    print(result["markdown"])
    print(summary_line(result))
    print(f"wrote {out}/scaling.md, scaling.json, scaling.png; each rung's run in {out}/seed<S>/depth<d>/")
    return 0


def add_bench_multiplier(bench) -> None:
    p = bench.add_parser("multiplier", help="a candidate recipe's compute multiplier over a base recipe: both train a "
                         "ladder of model.depth rungs, and the compute the candidate needs for the base's loss (or suite "
                         "score) on its largest rung is read off its rungs (and, for the loss, off its fitted law)")
    p.add_argument("--base", default="ladder-2024", help="the reference recipe: " + CONFIG_HELP
                   + " (default %(default)s)")
    p.add_argument("--candidate", default="ladder-modern", help="the recipe measured against it, a file or preset "
                   "(default %(default)s); it may differ from --base only in the recipe changes' keys")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--ablate", action="store_true", help="rows: the candidate, and the candidate minus each "
                      "change; each change's multiplier (the base is not trained)")
    form.add_argument("--journey", action="store_true", help="rows: the base, then one more change per row; each "
                      "row's multiplier over the row before")
    p.add_argument("--depths", type=depth_list, help="each ladder's rungs, at least three (default 3,4,5)")
    p.add_argument("--seeds", type=seed_list, help="comma-separated train.seed values; every ladder trains once per "
                   "seed, and seed s of the candidate is compared with seed s of the base (default 1,2)")
    p.add_argument("--floor", type=ranged(float, at_least(0.0)), help="a known lower bound on the validation loss "
                   "that the fits keep their E above (default: the data's loss_floor in meta.json, else 0)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config key of every rung "
                   "(repeatable) (default: none)")
    p.add_argument("--target", choices=("val", "suite"), default="val", help="what the candidate must reach: the base's "
                   "final validation loss on its largest rung, or its final score on the multiple-choice suite, which "
                   "then runs at the end of every rung (default %(default)s)")
    p.add_argument("--suite-tasks", metavar="TASKS", help="with --target suite: comma-separated suite tasks, core for "
                   "the ten CORE tasks (docs/eval.md lists them) (default: the base's eval.tasks, else core)")
    p.add_argument("--suite-limit", type=COUNT, help="with --target suite: at most N examples of each task, 0: all of "
                   "them (default 200)")
    p.add_argument("--out", type=OUT_FOLDER, help="output folder; run again with the same one to continue, and to "
                   "reuse the ladders another form trained there (default runs/bench-multiplier)")
    p.set_defaults(func=cmd_bench_multiplier)


def cmd_bench_multiplier(args) -> int:
    from gpt2train.bench.multiplier import MultiplierOptions, multiplier_summary, run_multiplier

    defaults = MultiplierOptions()
    form = "ablate" if args.ablate else "journey" if args.journey else "pair"
    options = MultiplierOptions(base=args.base, candidate=args.candidate, form=form,
                                depths=args.depths or defaults.depths, seeds=args.seeds or defaults.seeds,
                                floor=args.floor, overrides=args.set or [], target=args.target,
                                suite_tasks=args.suite_tasks or "",
                                suite_limit=defaults.suite_limit if args.suite_limit is None else args.suite_limit)
    out = Path(args.out) if args.out else Path("runs") / "bench-multiplier"
    result = run_multiplier(options, out)
    print(result["markdown"])
    print(multiplier_summary(result))
    print(f"wrote {out}/multiplier.md, multiplier.json, multiplier.png; each rung's run in {out}/<recipe>/seed<S>/depth<d>/")
    return 0


def add_bench_prepare(bench) -> None:
    p = bench.add_parser("prepare", help="prepare files against the plain fineweb.py loop: tokens/s, wall time, "
                         "peak memory")
    p.add_argument("inputs", nargs="*", help="parquet files or folders of them (default: synthetic corpora of "
                   "--chars characters)")
    p.add_argument("--chars", type=char_count_list, default="12e6,120e6",
                   help="sizes of the synthetic corpora of short documents in characters, comma-separated (default "
                   "%(default)s)")
    p.add_argument("--long-chars", type=long_corpus_chars, default="120e6",
                   help="size of the synthetic corpus of long documents (1 KB to 6 MB each) in characters; 0: none "
                   "(default %(default)s)")
    p.add_argument("--workers", type=WORKERS, help="processes or threads for both (default: all CPU cores)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=3, help="timed runs of each, alternating; then one more "
                   "each for memory (default %(default)s)")
    p.add_argument("--out", type=OUT_FILE, help="JSON file (default runs/bench-prepare-<time>.json)")
    p.set_defaults(func=cmd_bench_prepare)


def long_corpus_chars(text: str) -> int:
    """--long-chars: 0, or a corpus size in characters that holds documents enough for a val split."""
    from gpt2train.bench.prepare import MIN_LONG_CHARS

    try:
        chars = int(float(text))
    except ValueError:
        chars = -1
    if chars != 0 and chars < MIN_LONG_CHARS:
        raise argparse.ArgumentTypeError(f"{text!r}: give 0 (no long-document corpus) or at least {MIN_LONG_CHARS} "
                                         "characters, e.g. 120e6")
    return chars


def char_count_list(text: str) -> list[int]:
    """--chars: synthetic corpus sizes (characters, enough for a val split) separated by commas; 1.2e7 style is
    fine."""
    from gpt2train.bench.prepare import min_synthetic_chars

    try:
        sizes = [int(float(part.strip())) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < min_synthetic_chars():
        raise argparse.ArgumentTypeError(f"{text!r}: give corpus sizes of at least {min_synthetic_chars()} "
                                         f"characters separated by commas, e.g. 12e6,120e6")
    return sizes


def cmd_bench_prepare(args) -> int:
    from gpt2train.bench.prepare import PrepareBenchOptions, run_prepare_bench

    options = PrepareBenchOptions(inputs=args.inputs, chars=args.chars, long_chars=args.long_chars,
                                  workers=args.workers or 0, repeats=args.repeats)
    out = Path(args.out) if args.out else Path("runs") / name_stamp("bench-prepare", ".json")
    result = run_prepare_bench(options, out)
    print(result["markdown"])
    print(f"wrote {out}")
    return 0


def add_bench_chat(bench) -> None:
    p = bench.add_parser("chat", help="the chat fine-tune on each offline demo task: prepare its conversations, "
                         "fine-tune a base run with a chat preset, score the held-out replies (exact match)")
    p.add_argument("--tasks", type=task_list, default=",".join(DEMOS), help="comma-separated demo tasks: "
                   f"{', '.join(DEMOS)} (default %(default)s; docs/chat.md, The demo)")
    p.add_argument("--base", default="runs/shakespeare", help="the run (or checkpoint, or Hugging Face GPT-2 folder) "
                   "every fine-tune starts from (default %(default)s: the quickstart's)")
    p.add_argument("--config", default="chat-cpu", help=CONFIG_HELP + " (default %(default)s)")
    p.add_argument("--conversations", type=COUNT, default=0, help="conversations per task, one in ten held out; "
                   "0: each task's default (" + ", ".join(f"{t} {n:,}" for t, n in DEFAULT_CONVERSATIONS.items())
                   + ") (default %(default)s)")
    p.add_argument("--seed", type=COUNT, default=0, help="the demos' seed (default %(default)s)")
    p.add_argument("--steps", type=POSITIVE_INT, help="train.max_steps of every fine-tune (default: the config's)")
    p.add_argument("--limit", type=COUNT, default=0, help="held-out conversations scored per task, 0: all "
                   "(default %(default)s)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config key of every "
                   "fine-tune (repeatable), e.g. train.lr=1e-3 (default: none)")
    p.add_argument("--device", type=device_name, help="train.device of every fine-tune, and eval's (default: the "
                   "config's)")
    p.add_argument("--out", type=OUT_FOLDER, help="output folder (default runs/bench-chat-<time>)")
    p.set_defaults(func=cmd_bench_chat)


def task_list(text: str) -> list[str]:
    """--tasks: demo tasks separated by commas, each once."""
    tasks = [part.strip() for part in text.split(",") if part.strip()]
    if not tasks or any(t not in DEMOS for t in tasks) or len(set(tasks)) != len(tasks):
        raise argparse.ArgumentTypeError(f"{text!r}: give demo tasks ({', '.join(DEMOS)}) separated by commas, "
                                         "each once")
    return tasks


def cmd_bench_chat(args) -> int:
    from gpt2train.bench.chat import ChatBenchOptions, run_chat_bench

    options = ChatBenchOptions(tasks=args.tasks, base=args.base, config=args.config, conversations=args.conversations,
                               seed=args.seed, steps=args.steps or 0, limit=args.limit, overrides=args.set or [],
                               device=args.device or "")
    out = Path(args.out) if args.out else Path("runs") / name_stamp("bench-chat")
    result = run_chat_bench(options, out)
    print(result["markdown"])
    print(f"wrote {out}/chat.md, chat.json; each task's data and run in {out}/TASK/")
    return 0
