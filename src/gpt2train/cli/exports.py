"""A model into and out of other tools' formats: `gpt2train import-hf`, `export-hf` and `export-gguf`, each one's
arguments beside its handler, and the greedy `sample` command whose text an export reproduces."""

from __future__ import annotations

import shlex

from gpt2train.cli.arguments import OUT_FILE, OUT_FOLDER
from gpt2train.ranges import EXPLICIT_DTYPE_NAMES, GGUF_DTYPE_NAMES


def add_import_hf(sub) -> None:
    p = sub.add_parser("import-hf", help="a Hugging Face GPT-2 (folder or Hub name) as a run directory")
    p.add_argument("source", metavar="HF_DIR_OR_NAME", help="folder with config.json + model.safetensors, or e.g. gpt2")
    p.add_argument("--out", type=OUT_FOLDER, required=True, help="run directory to create (checkpoints/step_00000000)")
    p.set_defaults(func=cmd_import_hf)


def cmd_import_hf(args) -> int:
    from gpt2train.checkpoint import read_meta
    from gpt2train.hf import describe_tokenizer, import_hf_to_run

    ckpt = import_hf_to_run(args.source, args.out)
    tokenizer = describe_tokenizer(read_meta(ckpt)["tokenizer"])
    print(f"imported {args.source} into {ckpt} (tokenizer: {tokenizer}); try `gpt2train sample --ckpt {args.out}`")
    return 0


def add_export_hf(sub) -> None:
    p = sub.add_parser("export-hf", help="a checkpoint as a Hugging Face GPT-2 folder (transformers loads it)")
    p.add_argument("--ckpt", required=True, help="run directory or checkpoint folder")
    p.add_argument("--out", type=OUT_FOLDER, required=True, help="folder for config.json, model.safetensors and tokenizer files")
    p.add_argument("--dtype", default="float32", choices=EXPLICIT_DTYPE_NAMES,
                   help="dtype of the saved tensors (default float32: lossless)")
    p.set_defaults(func=cmd_export_hf)


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


def add_export_gguf(sub) -> None:
    p = sub.add_parser("export-gguf", help="a checkpoint as one GGUF file for llama.cpp, Ollama, LM Studio")
    p.add_argument("--ckpt", required=True, help="run directory or checkpoint folder")
    p.add_argument("--out", type=OUT_FILE, required=True, help="the .gguf file to write (replaced whole, or left as it was)")
    p.add_argument("--dtype", default="f32", choices=GGUF_DTYPE_NAMES, help="stored type of the weight matrices: "
                   "f32 lossless, f16 half the size, q8_0 a quarter (default %(default)s; vectors stay f32)")
    p.set_defaults(func=cmd_export_gguf)


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
