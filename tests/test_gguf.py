"""GGUF export, proven by llama.cpp itself: llama-cpp-python (built from llama.cpp's sources by `make setup-dev`)
loads every file written here, and its greedy text, its logits and its tokenizer are compared with ours.

f32 is owed the same greedy tokens as `gpt2train sample --temperature 0`; f16 the same as our model running
the file's own (rounded) weights; q8_0 the same top-1 token at >= 99% of the positions of held-out text.
llama.cpp's logits differ from ours by a few thousandths (its GELU reads a float16 table), so where our two
best tokens are closer than that, either may come first: `assert_same_greedy` says how that one case is judged.
"""

from __future__ import annotations

import ctypes
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import CHAT_REQUESTS, REPO, missing, one_line, run_cli, tiny_config
from gpt2train import cli
from gpt2train.chat import JINJA_TEMPLATE, render_prompt
from gpt2train.data.prepare import prepare_shakespeare, shakespeare_text
from gpt2train.data.shards import open_shard
from gpt2train.generation import generate
from gpt2train.gguf_export import GGUFExportError, export_gguf, gguf_vocabulary
from gpt2train.loading import load_for_inference, load_pretrained_tokenizer
from gpt2train.model import GPT, GPTConfig
from gpt2train.ranges import UsageError
from gpt2train.tokenizer import (
    GPT2_EOT,
    IM_END,
    IM_START,
    BPETokenizer,
    ChatTokens,
    GPT2Tokenizer,
    tokenizer_from_spec,
    train_bpe,
)
from gpt2train.training.loop import train

try:
    import gguf
except ImportError:  # conftest.missing says what to do
    gguf = None
try:
    import llama_cpp
except ImportError:
    llama_cpp = None

PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed", "\n", "O, she doth teach the torches"]
AWKWARD = ["", " ", "  two spaces", "tabs\t\tand\nnew\n\n\nlines   ", "trailing   ", "   leading",
           "don't I'LL we've 's", "12345 3.14159 1,000,000", "naïve café ﬁ Ⅻ", "日本語のテキスト", "emoji 👍🏽 ok",
           "a\u00a0b\u200bc", "<|endoftext|>", "tokens<|endoftext|>between", "x" * 300]


@pytest.fixture(autouse=True)
def gguf_package():
    if gguf is None:
        missing("the gguf package is missing")


def llama(path, **options):
    """llama.cpp's model from a GGUF file (quiet, deterministic); conftest.missing where llama-cpp-python is."""
    if llama_cpp is None:
        missing("llama-cpp-python (it compiles llama.cpp) is missing")
    return llama_cpp.Llama(model_path=str(path), n_threads=2, seed=0, verbose=False, **options)


def llama_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """n tokens of llama.cpp's greedy decoding after prompt_ids (it goes on past end-of-text, as ours does)."""
    new = []
    for token in model.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        new.append(token)
        if len(new) == n:
            return new
    return new


def ours_greedy(model: GPT, prompt_ids: list[int], n: int) -> list[int]:
    return generate(model, prompt_ids, n, temperature=0)


# llama.cpp's logits are ours to within this (test_f32_logits_in_llama_cpp_are_ours; its GELU reads a float16
# table): 2.2e-3 at most in f32 and 4.5e-3 in f16 over 512 held-out positions here.
TIE = 1e-2


def assert_same_greedy(llm, model: GPT, prompt_ids: list[int], n: int) -> list[int]:
    """llama.cpp's greedy tokens are ours, token for token; returns them. The one allowance: at a step where our
    two best logits are within TIE, llama.cpp may take the other one (a tie its float16 GELU table decides; it
    happened once, 26 tokens in, on another build of llama.cpp). Then every token it chose, on its own
    continuation, must still be within TIE of our best there."""
    theirs, ours = llama_greedy(llm, prompt_ids, n), ours_greedy(model, prompt_ids, n)
    if theirs == ours:
        return theirs
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + theirs[:-1]]))[0, len(prompt_ids) - 1:]
    short_of_best = logits.max(-1).values - logits[torch.arange(n), torch.tensor(theirs)]
    first = next(i for i in range(n) if theirs[i] != ours[i])
    assert short_of_best[first] < TIE, f"llama.cpp left our greedy path at token {first}, which was no near-tie"
    assert (short_of_best < TIE).all(), f"llama.cpp's tokens fall short of our best by {short_of_best.tolist()}"
    return theirs


# llama.cpp's names for GPT-2's tensors, written out here (not taken from the exporter): name -> ours.
def our_name(gguf_name: str) -> str:
    top = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
           "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    _, layer, part, kind = gguf_name.split(".")
    module = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
              "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}[part]
    return f"transformer.h.{layer}.{module}.{kind}"


def file_weights(path) -> dict[str, torch.Tensor]:
    """The weights a GGUF file holds, dequantized to float32, under our names and in our (out, in) layout."""
    weights = {}
    for t in gguf.GGUFReader(path).tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        weights[our_name(t.name)] = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(
            tuple(int(d) for d in reversed(t.shape)))
    return weights


def model_with_file_weights(model: GPT, path) -> GPT:
    """A copy of `model` running the weights stored in the file (rounded as the file rounds them)."""
    copy = GPT(model.config).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, value in file_weights(path).items():
            param = copy.get_parameter(name)
            param[: value.size(0)] = value  # token embedding: the padded rows are not in the file
    return copy


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A small model trained on Tiny Shakespeare until its greedy text varies; a byte-level BPE of our own (512
    tokens) makes the steps take seconds where GPT-2's 50,257 take minutes. 256 wide: q8_0's rounding flips
    the top token wherever two are nearly tied, and a narrow model has many near-ties (q8_0's top-1 agreement
    with ours, 64 wide: 98.0%; 128: 99.0-99.4%; 256: 99.2-99.6%, on 2,048-4,096 positions here). A 50-step warmup:
    with 2 steps this width learned slowly (val loss 4.1 at step 400), and whether its greedy text varied or
    was newlines only depended on the thread count's rounding (on an AVX-512 CPU, one thread: newlines); now
    3.4 on 1 or 2 threads, the same greedy text."""
    root = tmp_path_factory.mktemp("gguf_run")
    train_bpe([shakespeare_text()], 512, root / "tokenizer.json")
    prepare_shakespeare(root / "data", tokenizer=f"bpe:{root / 'tokenizer.json'}")
    cfg = tiny_config(root / "data", max_steps=400, lr=3e-3, micro_batch=16, warmup_steps=50)
    cfg.model.n_embd, cfg.model.block_size = 256, 64
    cfg.train.seq_len = 64
    cfg.log.interval, cfg.eval.interval, cfg.checkpoint.every_steps = 100, 400, 400
    train(cfg, root / "run")
    return root


def trained(run_root):
    """The trained run's model, block size, tokenizer and tokenizer spec."""
    model, cfg, meta = load_for_inference(run_root / "run")
    return model, cfg.model.block_size, tokenizer_from_spec(meta["tokenizer"]), meta["tokenizer"]


def held_out_tokens(data_dir, n: int) -> list[int]:
    return open_shard(data_dir / "val_000000.bin")[:n].tolist()


class FixedTokens:
    """Stands in for llama.cpp's model: its greedy generation yields the tokens given."""

    def __init__(self, tokens):
        self.tokens = tokens

    def generate(self, prompt_ids, **sampling):
        yield from self.tokens


def test_the_greedy_comparison_fails_where_a_token_is_no_near_tie():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64)).eval()
    prompt = [1, 2, 3]
    ours = ours_greedy(model, prompt, 4)
    assert assert_same_greedy(FixedTokens(ours), model, prompt, 4) == ours
    with torch.no_grad():
        worst = int(model(torch.tensor([prompt + ours[:1]]))[0, -1].argmin())
    with pytest.raises(AssertionError, match="token 1, which was no near-tie"):
        assert_same_greedy(FixedTokens([ours[0], worst, *ours[2:]]), model, prompt, 4)


# ---------------------------------------------------------------- the file itself


@pytest.mark.slow
def test_the_file_holds_llama_cpps_gpt2_metadata_names_and_unpadded_vocabulary(tmp_path):
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=48)).eval()  # 50257 padded to 50304 rows
    export_gguf(model, tmp_path / "m.gguf", {"kind": "gpt2"})
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert fields["general.architecture"] == "gpt2"
    assert (fields["gpt2.context_length"], fields["gpt2.embedding_length"], fields["gpt2.feed_forward_length"],
            fields["gpt2.block_count"], fields["gpt2.attention.head_count"]) == (48, 64, 256, 2, 4)
    assert fields["gpt2.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert fields["general.file_type"] == 0  # all f32
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == 50257 and tokens[50256] == GPT2_EOT and tokens[198] == "Ċ"  # "\n", byte-level
    assert fields["tokenizer.ggml.token_type"][50256] == 3 and fields["tokenizer.ggml.token_type"][0] == 1
    assert fields["tokenizer.ggml.merges"][0] == "Ġ t" and len(fields["tokenizer.ggml.merges"]) == 50000
    assert fields["tokenizer.ggml.eos_token_id"] == 50256 and fields["tokenizer.ggml.add_bos_token"] is False
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}  # GGML order: (in, out)
    assert shapes["token_embd.weight"] == (64, 50257) and shapes["position_embd.weight"] == (64, 48)
    assert shapes["blk.1.attn_qkv.weight"] == (64, 192) and shapes["blk.1.ffn_down.weight"] == (256, 64)
    assert "output.weight" not in shapes  # tied: llama.cpp reads token_embd for the head
    assert len(shapes) == 2 + 2 * 12 + 2


def test_f32_weights_read_back_exactly_with_our_own_bpe_and_without_biases(tmp_path):
    tokenizer = train_bpe([shakespeare_text()[:20000]], 300, tmp_path / "tok.json")
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=tokenizer.vocab_size, bias=False)
    model = GPT(cfg).eval()
    export_gguf(model, tmp_path / "m.gguf", tokenizer.spec())
    back = file_weights(tmp_path / "m.gguf")
    ours = model.state_dict()
    biases = {k for k in back if k.endswith(".bias")}
    assert set(back) - biases == {k for k in ours if k != "lm_head.weight"} and len(biases) == 2 * 6 + 1
    for name, value in back.items():
        expected = ours[name][: cfg.vocab_size] if name == "transformer.wte.weight" else ours.get(name)
        assert torch.equal(value, torch.zeros_like(value) if expected is None else expected), name
    tokens = gguf.GGUFReader(tmp_path / "m.gguf").fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == cfg.vocab_size and tokens[tokenizer.eot_id] == GPT2_EOT


# ---------------------------------------------------------------- llama.cpp runs it as we do


@pytest.mark.slow
def test_a_trained_model_in_f32_gives_llama_cpp_our_greedy_text(trained_run, tmp_path):
    model, block_size, tok, spec = trained(trained_run)
    export_gguf(model, tmp_path / "m.gguf", spec)
    llm = llama(tmp_path / "m.gguf", n_ctx=block_size)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert llm.tokenize(prompt.encode(), add_bos=False) == ids
        theirs = assert_same_greedy(llm, model, ids, 32)
        assert len(set(theirs)) > 5, "a trained model's greedy text is more than a token or two repeated"


@pytest.fixture(scope="module")
def exported(trained_run):
    """export-gguf and export-hf of the trained run, as a user runs them: their output, with the hints."""
    out = {}
    for command, path in (("export-gguf", trained_run / "m.gguf"), ("export-hf", trained_run / "hf")):
        r = run_cli(command, "--ckpt", str(trained_run / "run"), "--out", str(path), env={"HF_HUB_OFFLINE": "1"})
        assert r.returncode == 0, r.stderr
        out[command] = r.stdout
    return out


def printed_command(output: str, program: str) -> list[str]:
    """The `program ...` command an export's output names in backquotes, split as a shell splits it."""
    found = re.search(rf"`({program} [^`]*)`", output)
    assert found, f"no `{program} ...` in: {output}"
    return shlex.split(found.group(1))


def greedy_text(tok, prompt: str, tokens: list[int]) -> str:
    """What `sample` prints for these new tokens: the prompt, the text up to end-of-text, a newline."""
    return prompt + tok.decode(tokens[: tokens.index(tok.eot_id)] if tok.eot_id in tokens else tokens) + "\n"


@pytest.mark.slow
def test_the_command_the_exports_print_gives_llama_cpps_and_transformers_greedy_text(trained_run, exported,
                                                                                     cpu_kind):
    """Found walking the second hour: on a CPU with native bf16 `sample --temperature 0` decodes in bf16 and its
    greedy text left llama.cpp's. The promise holds for the command the exports print (it names float32), on
    a CPU with native bf16 and on one without (cpu_kind: where sample's dtype auto is bf16, and fp32)."""
    transformers = pytest.importorskip("transformers")
    assert exported["export-gguf"].startswith(f"wrote {trained_run / 'm.gguf'} (") and "f32" in exported["export-gguf"]
    sample = printed_command(exported["export-gguf"], "gpt2train sample")
    assert sample == printed_command(exported["export-hf"], "gpt2train sample")  # one promise, one command
    assert sample[sample.index("--dtype") + 1] == "float32"
    r = run_cli(*sample[1:], cpu_bf16=cpu_kind, env={"CUDA_VISIBLE_DEVICES": ""})  # the command, on this CPU kind
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("device: cpu, float32")

    llama_args = printed_command(exported["export-gguf"], "llama-completion")
    prompt, n = llama_args[llama_args.index("-p") + 1], int(llama_args[llama_args.index("-n") + 1])
    assert (sample[sample.index("--prompt") + 1], int(sample[sample.index("--max-new-tokens") + 1])) == (prompt, n)
    model, block_size, tok, _ = trained(trained_run)
    ids = tok.encode(prompt)
    assert len(ids) + n <= block_size  # llama.cpp aborts past the context
    assert r.stdout == greedy_text(tok, prompt, ours_greedy(model, ids, n))
    llm = llama(trained_run / "m.gguf", n_ctx=block_size)
    theirs = assert_same_greedy(llm, model, ids, n)  # llama.cpp's: ours, but for a near-tie (see there)
    if theirs == ours_greedy(model, ids, n):
        assert r.stdout == greedy_text(tok, prompt, theirs)

    hf = transformers.GPT2LMHeadModel.from_pretrained(trained_run / "hf", local_files_only=True).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(trained_run / "hf", local_files_only=True)
    assert hf_tok(prompt)["input_ids"] == ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=tok.eot_id)
    assert r.stdout == greedy_text(tok, prompt, out[0, len(ids):].tolist())


def test_f32_logits_in_llama_cpp_are_ours(trained_run, tmp_path):
    model, block_size, _, spec = trained(trained_run)
    export_gguf(model, tmp_path / "m.gguf", spec)
    window = held_out_tokens(trained_run / "data", block_size)
    llm = llama(tmp_path / "m.gguf", n_ctx=len(window), logits_all=True)
    llm.eval(window)
    theirs = torch.from_numpy(np.array(llm.scores[: len(window)]))
    with torch.no_grad():
        ours = model(torch.tensor([window]))[0]
    # llama.cpp's GELU reads a float16 table: activations differ by up to ~1e-3, so logits agree to 1e-2
    torch.testing.assert_close(theirs, ours, atol=1e-2, rtol=0)
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_f16_runs_in_llama_cpp_as_our_model_on_the_rounded_weights(trained_run, tmp_path):
    model, block_size, tok, spec = trained(trained_run)
    export_gguf(model, tmp_path / "m.gguf", spec, dtype="f16")
    rounded = model_with_file_weights(model, tmp_path / "m.gguf")
    qkv = model.transformer.h[0].attn.c_attn
    assert torch.equal(rounded.transformer.h[0].attn.c_attn.weight, qkv.weight.half().float())
    assert not torch.equal(rounded.transformer.h[0].attn.c_attn.weight, qkv.weight)  # the rounding happened
    assert torch.equal(rounded.transformer.h[0].attn.c_attn.bias, qkv.bias)  # vectors stay f32
    llm = llama(tmp_path / "m.gguf", n_ctx=block_size)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert_same_greedy(llm, rounded, ids, 32)


def test_q8_0_picks_our_top_token_on_held_out_text_and_is_a_quarter_of_f32(trained_run, tmp_path):
    model, T, _, spec = trained(trained_run)
    f32 = export_gguf(model, tmp_path / "f32.gguf", spec)
    q8 = export_gguf(model, tmp_path / "q8.gguf", spec, dtype="q8_0")
    # every matrix row (256, 1024 wide) fills whole blocks of 32: 34 bytes for 32 values where f32 takes 128
    assert q8.stat().st_size < 0.3 * f32.stat().st_size
    tokens = held_out_tokens(trained_run / "data", 64 * T)
    llm = llama(q8, n_ctx=T, logits_all=True)
    agree = total = 0
    worst = 0.0
    for start in range(0, len(tokens), T):
        window = tokens[start:start + T]
        llm.reset()
        llm.eval(window)
        theirs = torch.tensor(np.array(llm.scores[: len(window)]))
        with torch.no_grad():
            ours = model(torch.tensor([window]))[0]
        worst = max(worst, float((theirs - ours).abs().max()))
        agree += int((theirs.argmax(-1) == ours.argmax(-1)).sum())
        total += len(window)
    # Pinned from a run here (AVX-512 CPU, 2026-11-26): logits within 0.14 of ours, top-1 agreement 99.2%; the
    # top tokens that differ were near-ties (ours ahead by at most 0.065). A wrong block scale or row order
    # moves logits by whole units.
    assert total == 64 * T and worst < 0.3, f"q8_0 logits differ from ours by up to {worst:.3f}"
    assert agree / total >= 0.98, f"top-1 agreement {agree / total:.2%}"


# ---------------------------------------------------------------- the tokenizer


def test_llama_cpp_tokenizes_awkward_text_as_our_gpt2_bpe(tmp_path):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)).eval()
    export_gguf(model, tmp_path / "m.gguf", {"kind": "gpt2"})
    assert_same_tokens(llama(tmp_path / "m.gguf", vocab_only=True), GPT2Tokenizer())


def test_llama_cpp_tokenizes_awkward_text_as_our_own_bpe_and_runs_its_model(tmp_path):
    tokenizer = train_bpe([shakespeare_text()], 600, tmp_path / "tok.json")
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=tokenizer.vocab_size,
                    tied_head=False, bias=False)  # an untied head (output.weight) and zero biases: both exact
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # far from the init, so that every tensor matters
    export_gguf(model, tmp_path / "m.gguf", tokenizer.spec())
    llm = llama(tmp_path / "m.gguf", n_ctx=32)
    assert_same_tokens(llm, tokenizer)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert_same_greedy(llm, model, ids, 16)


def assert_same_tokens(llm, tokenizer):
    for text in AWKWARD:
        ids = tokenizer.encode(text)
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids, repr(text)
        assert llm.detokenize(ids).decode("utf-8") == text, repr(text)
    assert llm.tokenize(GPT2_EOT.encode(), add_bos=False, special=True) == [tokenizer.eot_id]
    assert llm.token_eos() == tokenizer.eot_id and llm.token_bos() == tokenizer.eot_id


# ---------------------------------------------------------------- chat


@pytest.mark.slow
def test_a_chat_run_exported_chats_in_llama_cpp_as_in_gpt2train(chat_run, tmp_path, capsys):
    """A model trained with the chat template: its turn tokens are control tokens at our ids, the file's template
    gives render_prompt's ids both where llama-cpp-python renders it (create_chat_completion) and where llama.cpp's
    own ChatML does (llama-server without --jinja: it adds <|endoftext|> as the bos token), and the reply is our
    greedy one, ended at <|im_end|>."""
    assert cli.main(["export-gguf", "--ckpt", str(chat_run), "--out", str(tmp_path / "chat.gguf")]) == 0
    assert "a chat model: llama.cpp's chat" in capsys.readouterr().out
    model, cfg, _ = load_for_inference(chat_run)
    tok = load_pretrained_tokenizer(chat_run)
    fields = {name: field.contents() for name, field in gguf.GGUFReader(tmp_path / "chat.gguf").fields.items()
              if name.startswith("tokenizer.")}
    assert fields["tokenizer.ggml.tokens"][50256:] == [GPT2_EOT, IM_START, IM_END]
    assert fields["tokenizer.ggml.token_type"][50256:] == [3, 3, 3]  # control
    assert fields["tokenizer.chat_template"] == JINJA_TEMPLATE
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"],
            fields["tokenizer.ggml.eot_token_id"], fields["tokenizer.ggml.add_bos_token"]) == (50256, 50258, 50258, True)

    llm = llama(tmp_path / "chat.gguf", n_ctx=cfg.model.block_size)
    stopped = False
    for messages in CHAT_REQUESTS:
        ids = render_prompt(tok, messages)
        # create_chat_completion: the file's template rendered with its bos token's text, parsed, no bos added
        formatter = llama_cpp.llama_chat_format.Jinja2ChatFormatter(fields["tokenizer.chat_template"], eos_token=IM_END,
                                                                    bos_token=GPT2_EOT)
        assert llm.tokenize(formatter(messages=messages).prompt.encode(), add_bos=False, special=True) == ids
        assert llm.tokenize(llama_cpp_render(fields["tokenizer.chat_template"], messages), add_bos=True, special=True) == ids

        n = cfg.model.block_size - len(ids)  # GPT-2's learned positions end at the context
        theirs = assert_same_greedy(llm, model, ids, n)  # ours, but for a near-tie (see there)
        reply = theirs[: theirs.index(tok.im_end_id)] if tok.im_end_id in theirs else theirs
        answer = llm.create_chat_completion(messages, temperature=0, max_tokens=n)
        assert answer["usage"]["prompt_tokens"] == len(ids)
        assert answer["choices"][0]["message"]["content"] == tok.decode(reply)
        assert answer["choices"][0]["finish_reason"] == ("stop" if len(reply) < n else "length")
        stopped |= len(reply) + 1 < n  # it stopped at <|im_end|>, with tokens to spare
    assert stopped


def llama_cpp_render(template: str, messages) -> bytes:
    """The text llama.cpp renders without a Jinja engine (llama_chat_apply_template, what llama-server and
    llama-cli use without --jinja): it recognises the template as ChatML and writes no bos token of its own."""
    chat = (llama_cpp.llama_chat_message * len(messages))(
        *(llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages))
    buffer = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_chat_apply_template(template.encode(), chat, len(messages), True, buffer, len(buffer))
    assert 0 < n <= len(buffer)
    return buffer.raw[:n]


def test_our_own_bpe_with_the_turn_tokens_gives_them_its_ids_after_its_vocabulary(tmp_path):
    base = train_bpe([shakespeare_text()[:20000]], 300, tmp_path / "tok.json")
    vocab = gguf_vocabulary(ChatTokens(BPETokenizer(tmp_path / "tok.json")).spec(), base.vocab_size + 2)
    assert vocab["tokens"][base.vocab_size:] == [IM_START, IM_END] and vocab["chat"][IM_END] == base.vocab_size + 1
    assert gguf_vocabulary(base.spec(), base.vocab_size)["chat"] == {}


# ---------------------------------------------------------------- GPT-2 124M's shape, through Hugging Face


@pytest.mark.slow
def test_import_hf_of_gpt2_124m_then_export_gguf_gives_llama_cpp_the_greedy_text_of_transformers_and_ours(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()  # GPT-2 124M, random weights (HF's init)
    hf.save_pretrained(tmp_path / "hf")
    for command in (("import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")),
                    ("export-gguf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "m.gguf"))):
        r = run_cli(*command)
        assert r.returncode == 0, r.stderr
    ours, _, _ = load_for_inference(tmp_path / "run")
    llm = llama(tmp_path / "m.gguf", n_ctx=64)
    tok = GPT2Tokenizer()
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=tok.eot_id,
                              eos_token_id=None)
        theirs = out[0, len(ids):].tolist()
        assert ours_greedy(ours, ids, 16) == theirs, prompt  # ours and transformers' compute the same in f32
        assert_same_greedy(llm, ours, ids, 16)
        assert llm.detokenize(theirs).decode("utf-8", errors="replace") == tok.decode(theirs)


# ---------------------------------------------------------------- what cannot be exported


@pytest.mark.parametrize("option, named", [
    (dict(position="rotary"), "model.position = rotary"),
    (dict(qk_norm=True), "model.qk_norm = True"),
    (dict(mlp="relu2"), "model.mlp = relu2"),
    (dict(logit_softcap=15.0), "model.logit_softcap = 15.0"),
])
def test_what_llama_cpps_gpt2_cannot_compute_is_refused_in_one_line_before_writing(tmp_path, option, named):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, **option))
    out = tmp_path / "m.gguf"
    out.write_bytes(b"GGUF, an earlier export")
    message = one_line(GGUFExportError, export_gguf, model, out)
    assert named in message and "cannot be exported to GGUF" in message
    assert out.read_bytes() == b"GGUF, an earlier export" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


@pytest.mark.slow
def test_a_char_run_and_bad_outputs_are_refused_by_the_cli_in_one_line(char_data, tmp_path):
    train(tiny_config(char_data, max_steps=1), tmp_path / "run")
    r = run_cli("export-gguf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "m.gguf"))
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("error: a run with the char tokenizer cannot be exported to GGUF") and "bpe:" in r.stderr
    assert not (tmp_path / "m.gguf").exists()
    r = run_cli("export-gguf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "m.gguf"), "--dtype", "q4_0")
    assert r.returncode == 2 and "invalid choice: 'q4_0'" in r.stderr


def test_an_out_that_is_a_folder_or_a_wrong_tokenizer_is_refused_in_one_line(tmp_path):
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=300)).eval()
    assert "is a folder" in one_line(UsageError, export_gguf, model, tmp_path, {"kind": "gpt2"})  # exit 2
    assert "not this model's tokenizer" in one_line(GGUFExportError, export_gguf, model, tmp_path / "m.gguf",
                                                    {"kind": "gpt2"})
    assert "vocab_size 300 is not GPT-2's" in one_line(GGUFExportError, export_gguf, model, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("limit", [1_000_000, 2_000_000])  # the file fills up in the metadata, in the tensors
def test_a_write_cut_short_by_a_full_disk_names_the_file_and_leaves_nothing(tmp_path, limit):
    """It was `error: [Errno 27] File too large` or `error: 1608224 requested and 65792 written` (NumPy's short
    write), naming no file. The disk fills for real here: a file size limit (RLIMIT_FSIZE) below the file's size."""
    script = ("import resource, sys, torch\nfrom gpt2train.gguf_export import export_gguf\n"
              "from gpt2train.model import GPT, GPTConfig\n"
              "model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)).eval()\n"
              f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
              "try:\n    export_gguf(model, sys.argv[1], {'kind': 'gpt2'})\n"
              "except OSError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m.gguf")], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert r.stdout.startswith(f"could not write {tmp_path / 'm.gguf'} ("), r.stdout + r.stderr
    assert r.stdout.endswith("); free space and export again (nothing was written)\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_an_existing_file_is_replaced_only_when_it_is_a_gguf_file(tmp_path):
    """Found by a probe of bad input: any file given as --out was overwritten (a checkpoint's model.safetensors)."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)).eval()
    (tmp_path / "model.safetensors").write_bytes(b"not a gguf file")
    assert one_line(UsageError, export_gguf, model, tmp_path / "model.safetensors", {"kind": "gpt2"}) == (
        f"{tmp_path / 'model.safetensors'} exists and is not a GGUF file; give another --out (nothing was written)")
    assert (tmp_path / "model.safetensors").read_bytes() == b"not a gguf file"
    export_gguf(model, tmp_path / "m.gguf", {"kind": "gpt2"})
    export_gguf(model, tmp_path / "m.gguf", {"kind": "gpt2"}, dtype="f16")  # an earlier export is replaced
    assert gguf.GGUFReader(tmp_path / "m.gguf").fields["general.file_type"].contents() == 1
