"""Using a trained model: `gpt2train sample`, `chat` and `serve`, each one's arguments beside its handler, and the
decoding and sampling options they share."""

from __future__ import annotations

import argparse
import sys
import time

from gpt2train.cli.arguments import AUTO_COMPILE_HELP, AUTO_DTYPE_HELP, COUNT, POSITIVE_INT, SEED, device_name, ranged
from gpt2train.ranges import COMPILE_SETTINGS, DTYPE_NAMES, NEW_TOKENS, SAMPLES, TEMPERATURES, TOP_K, TOP_P, between


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


def cropped_to_context(ids: list[int], context: int) -> list[int]:
    """The prompt's last `context` tokens, saying so on stderr when that drops some: the model sees no more."""
    if len(ids) <= context:
        return ids
    print(f"warning: the prompt's {len(ids)} tokens are cropped to its last {context} (the model's context)",
          file=sys.stderr)
    return ids[-context:]


def add_chat(sub) -> None:
    p = sub.add_parser("chat", parents=[decoding_options(), sampling_options()],
                       help="talk to a model fine-tuned on conversations, in the terminal (docs/chat.md)")
    p.add_argument("--ckpt", required=True, help="run directory or checkpoint folder of a chat model")
    p.add_argument("--system", help="the system message that opens the conversation (kept by /reset) (default: none)")
    p.add_argument("--max-tokens", type=ranged(int, NEW_TOKENS), help="the longest reply, in tokens; the rest of the "
                   "context holds the conversation, the oldest messages dropped first (default: half the context)")
    p.set_defaults(func=cmd_chat)


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
    p.add_argument("--max-tokens", type=POSITIVE_INT, help="the most tokens a request may ask for (max_tokens), per "
                   "completion; more get 400; above the context the window slides, as in sample (default: the "
                   "model's context)")
    p.add_argument("--grace-seconds", type=ranged(float, between(0, 24 * 3600)), default=30,
                   help="on SIGTERM or Ctrl-C, new requests get 503 while those in flight get this long to finish; "
                   "what is left is then cut, a stream with its last chunk (finish_reason length) and [DONE] "
                   "(default %(default)s)")
    p.set_defaults(func=cmd_serve)


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
          prefill_tokens=args.prefill_tokens, max_tokens=args.max_tokens,
          grace_seconds=args.grace_seconds)
    return 0
