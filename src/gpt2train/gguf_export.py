"""GGUF export: a model as one file that llama.cpp runs (and the tools built on it: Ollama, LM Studio,
llama-cpp-python).

llama.cpp's `gpt2` architecture computes GPT-2's recipe as our model does, so the export is a rename:
- metadata: context length, width, layers, heads, the feed-forward width, LayerNorm's epsilon, file type;
- tensors under llama.cpp's names, in our (out, in) layout, which GGUF stores as llama.cpp reads it;
  the padded vocabulary rows are dropped; a tied head is left out (llama.cpp reads the token embedding
  for it), an untied one is written as `output.weight`; bias = false is written as zero biases (exact);
- the tokenizer: GPT-2's BPE or a byte-level BPE of our own, as the vocabulary and merges llama.cpp's
  `gpt2` tokenizer applies after GPT-2's pre-tokenizer split; a model trained with the chat template also gets
  its turn tokens (control tokens), the template as Jinja and <|im_end|> as the end of a reply.

Rotary positions, QK norm, ReLU², the logit soft cap and the char tokenizer have no place in that graph:
they are refused, in one line naming them, before anything is written. The `gguf` package (PyPI, the
`gguf` extra) writes the file; nothing of llama.cpp itself is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from gpt2train.chat import JINJA_TEMPLATE
from gpt2train.files import AtomicFile
from gpt2train.model import GPTConfig
from gpt2train.ranges import GGUF_DTYPE_NAMES, UsageError
from gpt2train.tokenizer import GPT2_EOT, GPT2_VOCAB_SIZE, IM_END, gpt2_vocab_and_merges, tokenizer_from_spec

ARCH = "gpt2"
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which every LayerNorm of ours uses
Q8_0_BLOCK = 32  # q8_0 quantizes rows in blocks of 32 values; a shorter row stays f16

# Our parameter names (Hugging Face's GPT-2) -> llama.cpp's; in a block, transformer.h.{i}.MODULE -> blk.{i}.NAME.
GLOBAL_NAMES = {
    "transformer.wte.weight": "token_embd.weight",
    "transformer.wpe.weight": "position_embd.weight",
    "transformer.ln_f.weight": "output_norm.weight",
    "transformer.ln_f.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
}
BLOCK_NAMES = {
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
VOCAB_ROWS = ("transformer.wte.weight", "lm_head.weight")  # padded to a multiple of 64; GGUF gets vocab_size


class GGUFExportError(ValueError):
    """A model or tokenizer that a GGUF file for llama.cpp cannot hold; the message says which and why."""


def is_gguf_file(path: Path) -> bool:
    """Whether the file begins with GGUF's magic bytes."""
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def export_gguf(model: torch.nn.Module, out_path: str | Path, tokenizer_spec: dict | None = None,
                dtype: str = "f32", name: str | None = None) -> Path:
    """Write `model` and its tokenizer as one GGUF file of llama.cpp's gpt2 architecture; returns the path.

    dtype: f32 (lossless), f16 or q8_0 for the weight matrices (vectors, norms and biases stay f32).
    tokenizer_spec: the run's (meta.json's "tokenizer"); None means GPT-2's, for GPT-2's vocabulary only.
    Everything that cannot be exported is refused before the file is opened; the file appears whole or not
    at all (written beside, then renamed)."""
    from gpt2train.distributed import unwrap

    if dtype not in GGUF_DTYPE_NAMES:
        raise GGUFExportError(f"GGUF dtype {dtype!r} is not one of {', '.join(GGUF_DTYPE_NAMES)}")
    out = Path(out_path)
    if out.is_dir():
        raise UsageError(f"{out} is a folder; --out takes the file to write, such as {out / 'model.gguf'}")
    if out.is_file() and not is_gguf_file(out):  # an earlier export is replaced; any other file is kept
        raise UsageError(f"{out} exists and is not a GGUF file; give another --out (nothing was written)")
    try:
        import gguf
    except ImportError:
        raise GGUFExportError("GGUF export needs the gguf package: pip install 'gpt2train[gguf]'") from None
    cfg: GPTConfig = unwrap(model).config
    check_exportable(cfg)
    vocab = gguf_vocabulary(tokenizer_spec, cfg.vocab_size)
    tensors = gguf_tensors(model, dtype)

    partial = AtomicFile(out, mode=None)  # the gguf package opens the temporary file by its name
    writer = gguf.GGUFWriter(str(partial.temp), ARCH)
    try:
        write_metadata(writer, cfg, dtype, name or out.stem)
        write_vocabulary(writer, vocab)
        for tensor_name, (data, stored) in tensors.items():
            writer.add_tensor(tensor_name, data, raw_dtype=stored)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        partial.commit()
    except OSError as e:
        if e.filename is not None:  # names the file already
            raise
        # The gguf package's writes on a full disk name no file: "[Errno 28] No space left on device", or NumPy's
        # short write "N requested and M written".
        raise OSError(f"could not write {out} ({e.strerror or e}); free space and export again (nothing was "
                      "written)") from None
    finally:
        writer.close()
        partial.discard()  # nothing after a commit
    return out


def check_exportable(cfg: GPTConfig) -> None:
    """Refuse, in one line, what llama.cpp's gpt2 graph has no place for (an untied head and bias = false it does
    hold: the head as output.weight, missing biases as zeros)."""
    unsupported = [option for option in cfg.beyond_gpt2() if not option.startswith("model.tied_head")]
    if unsupported:
        raise GGUFExportError(f"a model with {', '.join(unsupported)} cannot be exported to GGUF: llama.cpp's gpt2 "
                              "architecture computes GPT-2's recipe only; use the checkpoint with gpt2train itself")


def gguf_stored_type(shape: tuple[int, ...], dtype: str):
    """The GGML type a tensor is stored as: vectors (norms, biases) always f32; matrices as `dtype`, except
    q8_0 rows shorter than a multiple of its block, which stay f16."""
    from gguf import GGMLQuantizationType as Q

    if len(shape) < 2 or dtype == "f32":
        return Q.F32
    if dtype == "q8_0" and shape[-1] % Q8_0_BLOCK == 0:
        return Q.Q8_0
    return Q.F16


def gguf_tensors(model: torch.nn.Module, dtype: str) -> dict[str, tuple[np.ndarray, object]]:
    """llama.cpp's tensor name -> (the data as stored, its GGML type), in the model's order (tensor_order)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    from gpt2train.checkpoint import model_state
    from gpt2train.distributed import unwrap

    cfg: GPTConfig = unwrap(model).config
    state = model_state(model)  # a tied lm_head is left out: llama.cpp reads token_embd for it
    for key in list(state):  # bias = false: llama.cpp's graph adds biases, and zeros compute the same
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and key not in VOCAB_ROWS and key != "transformer.wpe.weight":
            state.setdefault(module + ".bias", torch.zeros(state[key].shape[0]))

    tensors = {}
    for key, tensor in state.items():
        if key in VOCAB_ROWS:
            tensor = tensor[:cfg.vocab_size]
        data = tensor.detach().float().cpu().contiguous().numpy()
        stored = gguf_stored_type(data.shape, dtype)
        if stored == Q.F16:
            data = data.astype(np.float16)
        elif stored == Q.Q8_0:
            data = quantize(data, Q.Q8_0)
        tensors[gguf_name(key)] = (data, stored)
    return dict(sorted(tensors.items(), key=lambda item: tensor_order(item[0])))


def gguf_name(key: str) -> str:
    """Our parameter name -> llama.cpp's (transformer.h.3.attn.c_attn.weight -> blk.3.attn_qkv.weight)."""
    if key in GLOBAL_NAMES:
        return GLOBAL_NAMES[key]
    parts = key.split(".")  # transformer h {i} module... weight|bias
    if parts[:2] != ["transformer", "h"] or ".".join(parts[3:-1]) not in BLOCK_NAMES:
        raise GGUFExportError(f"{key} has no GGUF name: not a GPT-2 parameter")
    return f"blk.{parts[2]}.{BLOCK_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def tensor_order(name: str) -> tuple:
    """Embeddings, then the blocks by number (blk.10 after blk.9), then the output: the order data flows."""
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.endswith("embd.weight") else 2, 0, name)


def write_metadata(writer, cfg: GPTConfig, dtype: str, name: str) -> None:
    import gguf

    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
    writer.add_name(name)
    writer.add_context_length(cfg.block_size)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(4 * cfg.n_embd)
    writer.add_block_count(cfg.n_layer)
    writer.add_head_count(cfg.n_head)
    writer.add_layer_norm_eps(LAYER_NORM_EPS)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)  # the q8_0 block layout this file uses


# ----------------------------------------------------------------------------------------- tokenizer


def gguf_vocabulary(tokenizer_spec: dict | None, vocab_size: int) -> dict:
    """The tokenizer as llama.cpp's gpt2 BPE holds it: tokens (byte-level strings, one per model row), their
    types, the merges, the end-of-text id and, for a model trained with the chat template, the turn tokens' ids
    ("chat"). Rows past the tokenizer's vocabulary get unused tokens."""
    from gguf import TokenType

    if tokenizer_spec is None:
        if vocab_size != GPT2_VOCAB_SIZE:
            raise GGUFExportError(f"no tokenizer given and vocab_size {vocab_size} is not GPT-2's {GPT2_VOCAB_SIZE}; "
                                  "pass the run's tokenizer spec (meta.json's \"tokenizer\")")
        tokenizer_spec = {"kind": "gpt2"}
    chat = tokenizer_spec.get("chat") or {}
    kind = tokenizer_spec.get("kind")
    if kind == "gpt2":
        vocab, merges = gpt2_files()
    elif kind == "bpe":
        base = tokenizer_from_spec({k: v for k, v in tokenizer_spec.items() if k != "chat"})
        vocab, merges = bpe_vocab_and_merges(base.json_str)
    else:
        raise GGUFExportError(f"a run with the {kind} tokenizer cannot be exported to GGUF: llama.cpp has no "
                              "tokenizer like it; prepare the data with --tokenizer gpt2 or bpe:tokenizer.json "
                              "(gpt2train tokenizer train) and train on that to export")
    if GPT2_EOT not in vocab:
        raise GGUFExportError(f"the tokenizer has no {GPT2_EOT} token, which llama.cpp needs as its end of text")
    if chat and sorted(chat.values()) != [len(vocab), len(vocab) + 1]:
        raise GGUFExportError(f"the chat turn tokens' ids {chat} do not follow the tokenizer's {len(vocab)} tokens; "
                              "it is not the tokenizer the model was trained with")
    vocab = {**vocab, **chat}  # the turn tokens, right after the base vocabulary
    if len(vocab) > vocab_size:
        raise GGUFExportError(f"the tokenizer has {len(vocab)} tokens but the model only {vocab_size} rows; "
                              "it is not this model's tokenizer")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [TokenType.UNUSED] * vocab_size
    for token, i in vocab.items():
        tokens[i], types[i] = token, TokenType.NORMAL
    eot = vocab[GPT2_EOT]
    for i in (eot, *chat.values()):  # tokens that mark structure: llama.cpp leaves them out of the text it prints
        types[i] = TokenType.CONTROL
    return {"tokens": tokens, "types": types, "merges": merges, "eot": eot, "chat": chat}


def write_vocabulary(writer, vocab: dict) -> None:
    writer.add_tokenizer_model("gpt2")  # byte-level BPE
    writer.add_tokenizer_pre("gpt-2")  # GPT-2's split of text into words before the merges
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(vocab["eot"])  # GPT-2 begins and ends documents with <|endoftext|>
    if not vocab["chat"]:
        writer.add_eos_token_id(vocab["eot"])
        writer.add_add_bos_token(False)  # prompts are taken as they are, as `gpt2train sample` takes them
        return
    # A chat model: a reply ends at <|im_end|>, and a conversation begins with <|endoftext|>. The template starts
    # with bos_token, which llama.cpp's own chat (llama-server) drops from its text where add_bos_token is set
    # and adds as a token instead; llama-cpp-python parses the text's <|endoftext|> and adds none: one either way.
    writer.add_eos_token_id(vocab["chat"][IM_END])
    writer.add_eot_token_id(vocab["chat"][IM_END])
    writer.add_add_bos_token(True)
    writer.add_chat_template(JINJA_TEMPLATE)


def gpt2_files() -> tuple[dict[str, int], list[str]]:
    """OpenAI's GPT-2 vocabulary and merges ("a b" each)."""
    vocab, merges = gpt2_vocab_and_merges()
    return vocab, [" ".join(pair) for pair in merges]


def bpe_vocab_and_merges(tokenizer_json: str) -> tuple[dict[str, int], list[str]]:
    """A `tokenizers` byte-level BPE's vocabulary (special tokens included) and merges ("a b" each). Only
    GPT-2's pre-tokenizer (ByteLevel with its regex, no prefix space) is what llama.cpp's gpt-2 split does."""
    data = json.loads(tokenizer_json)
    pre = data.get("pre_tokenizer") or {}
    model = data.get("model") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") \
            or not pre.get("use_regex", True):
        raise GGUFExportError("the tokenizer is not a byte-level BPE with GPT-2's pre-tokenizer (what "
                              "`gpt2train tokenizer train` makes), so llama.cpp would split text differently")
    vocab = dict(model["vocab"])
    for added in data.get("added_tokens") or ():
        vocab[added["content"]] = added["id"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or ()]
    return vocab, merges

