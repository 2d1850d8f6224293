"""Generation: exact logit filters, the KV cache against recomputation, prompts, EOT, seeds, batches, CLI."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import gpt2train.cli
import gpt2train.generation
from conftest import DEVICES, one_line, run_cli
from gpt2train.checkpoint import model_state, save_checkpoint
from gpt2train.config import Config, to_dict
from gpt2train.generation import (
    Decoder,
    RowBlockLinears,
    TextStream,
    filter_logits,
    generate,
    generate_batch,
    generate_stream,
    sample_next,
    speed_report,
)
from gpt2train.model import GPT, GPTConfig, KVCache
from gpt2train.tokenizer import CharTokenizer, GPT2Tokenizer

INF = float("-inf")


def tiny_model(attention: str = "sdpa", block_size: int = 16, vocab_size: int = 70) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size, vocab_size=vocab_size,
                          attention=attention))
    with torch.no_grad():  # larger weights than the init: logits far apart, so argmax has no near-ties
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


# ---------------------------------------------------------------- filters on hand-made logits


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, -1.0, 2.0, 1.0, 3.0]])
    want = torch.tensor([[INF, 5.0, 3.0, 4.0, INF], [INF, INF, 2.0, 1.0, 3.0]])
    assert torch.equal(filter_logits(logits, top_k=3), want)
    assert torch.equal(filter_logits(logits, top_k=0), logits)
    assert torch.equal(filter_logits(logits, top_k=10), logits)


def test_top_k_keeps_ties_with_the_kth():
    assert torch.equal(filter_logits(torch.tensor([3.0, 1.0, 3.0, 2.0]), top_k=1), torch.tensor([3.0, INF, 3.0, INF]))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.125, 0.5, 0.03125, 0.25, 0.09375])  # ranked: ids 1, 3, 0, 4, 2

    def kept(top_p):
        return torch.isfinite(filter_logits(probs.log(), top_p=top_p)).nonzero().flatten().tolist()

    assert kept(0.3) == [1]  # 0.5 alone reaches 0.3
    assert kept(0.6) == [1, 3]  # 0.5 + 0.25 = 0.75
    assert kept(0.8) == [0, 1, 3]  # + 0.125 = 0.875
    assert kept(0.9) == [0, 1, 3, 4]  # + 0.09375 = 0.96875
    assert kept(0.99) == [0, 1, 2, 3, 4]
    assert kept(1.0) == [0, 1, 2, 3, 4]
    assert kept(1e-9) == [1]  # the most likely token always survives


def test_top_p_on_a_batch_and_after_top_k():
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    out = filter_logits(logits, top_k=2, top_p=0.5)
    assert torch.equal(out, torch.tensor([[2.0, INF, INF], [INF, INF, 5.0]]))
    # Row 0 after top-k is softmax([2, 1]) = (0.73, 0.27): both are needed to reach 0.9.
    assert torch.equal(filter_logits(logits, top_k=2, top_p=0.9)[0], torch.tensor([2.0, INF, 1.0]))


# ---------------------------------------------------------------- the KV cache against recomputation


@pytest.mark.parametrize("attention", ["sdpa", "naive"])
def test_greedy_with_cache_equals_without_across_a_full_context(attention):
    model = tiny_model(attention, block_size=16)
    prompt = [3, 14, 15, 9, 2]
    cached = generate(model, prompt, 30, temperature=0)  # fills the 16-token context after 11 tokens
    recomputed = generate(model, prompt, 30, temperature=0, use_cache=False)
    assert len(cached) == 30
    assert cached == recomputed


def test_greedy_without_cache_is_argmax_of_the_last_window():
    model = tiny_model(block_size=8)
    tokens = [1, 2, 3]
    out = generate(model, tokens, 10, temperature=0)
    for new in out:
        with torch.no_grad():
            want = int(model(torch.tensor([tokens[-8:]]))[0, -1].argmax())
        assert new == want
        tokens.append(new)


def test_sampling_is_reproducible_with_a_seed_and_stays_in_vocab():
    model = tiny_model(vocab_size=70)  # 128 embedding rows: 58 padded ids that must never appear
    a = generate(model, [1, 2], 40, temperature=1.5, seed=7)
    assert a == generate(model, [1, 2], 40, temperature=1.5, seed=7)
    assert a != generate(model, [1, 2], 40, temperature=1.5, seed=8)
    assert max(a) < 70
    top1 = generate(model, [1, 2], 10, temperature=1.0, top_k=1, seed=3)
    assert top1 == generate(model, [1, 2], 10, temperature=0)


# ---------------------------------------------------------------- prompts, EOT, batches


def test_a_tiny_positive_temperature_draws_the_argmax_instead_of_failing_on_nan():
    # Found by tests/test_properties_config.py: --temperature 4e-286 made logits / T infinite and multinomial raise.
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 0.0]])
    for temperature in (4e-286, 1e-30, 1e-6):
        assert sample_next(logits, temperature, top_k=0, top_p=1.0, generator=None).flatten().tolist() == [1, 0]


@pytest.mark.parametrize("prompt, kwargs, says", [
    ("ROMEO:", {}, "a prompt must be a list of token ids (tokenizer.encode(text)), not str"),
    (torch.tensor([1, 2]), {}, "a prompt must be a list of token ids (tokenizer.encode(text)), not Tensor"),
    ([1, 70], {}, "prompt token 70 is not a token id of this model: an integer in [0, 70)"),
    ([-1], {}, "prompt token -1 is not a token id of this model: an integer in [0, 70)"),
    ([1], {"max_new_tokens": -1}, "max_new_tokens = -1 is out of range; it must be >= 0"),
    ([1], {"max_new_tokens": 5.0}, "max_new_tokens = 5.0 is not an integer"),
    ([1], {"temperature": -1.0}, "temperature = -1.0 is out of range; it must be >= 0"),
    ([1], {"temperature": float("nan")}, "temperature = nan is out of range; it must be >= 0"),
    ([1], {"top_k": -1}, "top_k = -1 is out of range; it must be >= 0"),
    ([1], {"top_p": 2.0}, "top_p = 2.0 is out of range; it must be in (0, 1]"),
    ([1], {"seed": "a"}, "seed = 'a' is not an integer"),
])
def test_a_bad_argument_to_generate_is_one_line_naming_it(prompt, kwargs, says):
    """Bugs (library face): each of these raised torch's error from deep inside (a str prompt: 'can only concatenate
    list', an id past the vocabulary: 'index out of range in self', top_k -1: 'selected index k out of range', a nan
    temperature: 'probability tensor contains inf, nan') or passed silently (a temperature of -1 sampled greedily,
    top_p 2 sampled unfiltered, -1 new tokens gave []). The numbers take `sample`'s ranges."""
    model = tiny_model(vocab_size=70)
    kwargs = {"max_new_tokens": 3, **kwargs}
    assert one_line(ValueError, generate, model, prompt, kwargs.pop("max_new_tokens"), **kwargs) == says


def test_generation_stops_after_eot():
    model = tiny_model()
    free = generate(model, [5, 6], 12, temperature=0)
    eot = free[3]
    stopped = generate(model, [5, 6], 12, temperature=0, eot_id=eot)
    assert stopped == free[: free.index(eot) + 1]


def test_empty_prompt_starts_from_eot():
    model = tiny_model()
    assert generate(model, [], 6, temperature=0, eot_id=69) == generate(model, [69], 6, temperature=0, eot_id=69)
    with pytest.raises(ValueError, match="end-of-text"):
        generate(model, [], 3)


def test_long_prompt_is_cropped_with_a_warning():
    model = tiny_model(block_size=16)
    prompt = list(range(1, 31))
    with pytest.warns(UserWarning, match="cropped to its last 16"):
        out = generate(model, prompt, 5, temperature=0)
    assert out == generate(model, prompt[-16:], 5, temperature=0)


@pytest.mark.parametrize("device", DEVICES)
def test_batch_of_prompts_of_different_lengths(device):
    """Batched generation (left-padded prompts, one KV cache) gives each prompt's own greedy continuation,
    also once the context is full (30 new tokens in a 16-token context: the sliding window)."""
    model = tiny_model().to(device)
    prompts = [[1], [2, 3, 4, 5, 6, 7], [8, 9, 10]]
    for new_tokens in (8, 30):
        want = [generate(model, p, new_tokens, temperature=0) for p in prompts]
        assert generate_batch(model, prompts, new_tokens, temperature=0) == want


def test_sampled_batch_is_reproducible_with_a_seed():
    """One generator draws the whole batch (not seed + i per row, which cost one draw per row and step):
    the batch is reproducible as a whole, and a batch of one is the prompt's own seeded sample."""
    model = tiny_model()
    prompts = [[1], [2, 3, 4, 5, 6, 7], [8, 9, 10]]
    sampled = generate_batch(model, prompts, 8, temperature=1.0, seed=11)
    assert sampled == generate_batch(model, prompts, 8, temperature=1.0, seed=11)
    assert sampled != generate_batch(model, prompts, 8, temperature=1.0, seed=12)
    assert generate_batch(model, prompts[1:2], 8, temperature=1.0, seed=11) == [
        generate(model, prompts[1], 8, temperature=1.0, seed=11)]


def test_batch_rows_stop_at_their_own_eot():
    model = tiny_model()
    prompts = [[5, 6], [1, 2, 3]]
    free = generate_batch(model, prompts, 12, temperature=0)
    eot = free[0][3]
    stopped = generate_batch(model, prompts, 12, temperature=0, eot_id=eot)
    assert stopped == [row[: row.index(eot) + 1] if eot in row else row for row in free]


@pytest.mark.parametrize("attention", ["sdpa", "naive"])
def test_padding_mask_isolates_rows(attention):
    """What sits in a padded slot never reaches a real token: other pad ids give the same logits."""
    model = tiny_model(attention)
    idx = torch.tensor([[0, 0, 0, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    real = torch.tensor([[False] * 3 + [True] * 3, [True] * 6])
    logits = []
    for pad in (0, 7, 42):
        idx[0, :3] = pad
        cache = KVCache(model.config, 2, 8, "cpu", torch.float32)
        with torch.no_grad():
            prefill = model(idx, kv_cache=cache, padding_mask=real)
            step = model(torch.tensor([[9], [9]]), kv_cache=cache)
        logits.append(torch.cat([prefill[:, 3:], step], dim=1))
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    # The padded row is the 3-token prompt alone, at positions 0, 1, 2 (then 3).
    with torch.no_grad():
        alone = model(torch.tensor([[4, 5, 6, 9]]))
    torch.testing.assert_close(logits[0][0], alone[0], atol=1e-5, rtol=1e-5)


def test_an_eager_step_attends_over_the_used_slots_only():
    """The cache holds 12 slots; a step eagerly reads only those filled so far (an empty slot costs memory
    traffic and nothing else: the mask hides it), and gives the logits of the whole sequence's forward."""
    model = tiny_model()
    idx = torch.tensor([[3, 1, 4, 1, 5]])
    cache = KVCache(model.config, 1, 12, "cpu", torch.float32)
    seen = []
    with torch.no_grad():
        full = model(idx)
        for block in model.transformer.h:
            block.attn.register_forward_hook(lambda mod, args, out: seen.append(args[2].shape[-1]))  # mask's slots
        prefill = model(idx[:, :3], kv_cache=cache)
        steps = [model(idx[:, t : t + 1], kv_cache=cache) for t in (3, 4)]
    assert seen == [3, 3, 4, 4, 5, 5]  # two layers a forward, never 12
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, atol=1e-5, rtol=1e-5)


class AtenOps(TorchDispatchMode):
    """Records the aten ops that run inside it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 32), (8, 1, 32), (2, 32, 32), (65, 32)])  # (65, 32): past MAX_ROWS
def test_row_block_linears_equal_f_linear_and_block_only_a_few_rows(shape, bias):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(32, 48, bias=bias), torch.nn.Linear(48, 7))  # 7 rows: no blocks
    x = torch.randn(shape)
    with torch.no_grad(), RowBlockLinears(layers), AtenOps() as seen:
        blocked = layers[0](x)
        unsplit = layers[1](blocked)
    torch.testing.assert_close(blocked, layers[0](x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unsplit, layers(x), atol=1e-5, rtol=1e-5)
    assert blocked.shape == (*shape[:-1], 48) and blocked.is_contiguous()
    few_rows = x.numel() // 32 <= RowBlockLinears.MAX_ROWS
    assert seen.ops.count("bmm") + seen.ops.count("baddbmm") == few_rows, seen.ops  # layers[1]: addmm or mm
    assert not any("forward" in vars(layer) for layer in layers)  # the class's forward again


def test_row_blocks_follow_a_weight_or_bias_moved_and_leave_gradients_to_f_linear():
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(32, 48), torch.randn(2, 32)
    blocks = RowBlockLinears(layer)
    with torch.no_grad(), blocks:
        layer(x)  # the views of the first weights are made
    for new_memory in (layer.weight, layer.bias):  # as model.to(...) gives
        new_memory.data = torch.randn_like(new_memory)
        with torch.no_grad(), blocks, AtenOps() as seen:
            y = layer(x)
        torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))
        assert "baddbmm" in seen.ops
    with blocks, AtenOps() as seen:  # gradients on: the blocks are detached views, so F.linear
        layer(x).sum().backward()
    assert "baddbmm" not in seen.ops and layer.weight.grad is not None


def test_a_weight_stored_transposed_runs_unblocked():
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(32, 48), torch.randn(2, 32)
    expected = layer(x).detach()
    layer.weight.data = layer.weight.data.t().contiguous().t()  # the same values, (in, out) in memory
    with torch.no_grad(), RowBlockLinears(layer), AtenOps() as seen:
        y = layer(x)
    torch.testing.assert_close(y, expected)
    assert "bmm" not in seen.ops and "baddbmm" not in seen.ops


def test_blocked_decoding_on_a_cpu_in_fp32_only_and_the_same_greedy_tokens():
    model = tiny_model()
    prompts = [[1], [2, 3, 4, 5, 6, 7]]
    decoder = Decoder(model, compile=False)
    assert decoder.blocked and decoder.describe(2) == "decode: eager, KV cache, matmuls in row blocks, batch 2"
    with AtenOps() as seen:
        blocked = generate_batch(model, prompts, 10, temperature=0, decoder=decoder)
    assert "bmm" in seen.ops and "addmm" not in seen.ops  # the prefill too
    assert blocked == generate_batch(model, prompts, 10, temperature=0, decoder=Decoder(model, blocked=False))
    assert not Decoder(tiny_model().to(torch.bfloat16), compile=False).blocked


@pytest.mark.slow  # compiling takes ~20 s on 2 cores
def test_compiled_decode_step_equals_eager_greedy():
    model = tiny_model()
    prompts = [[1], [2, 3, 4, 5, 6, 7]]
    decoder = Decoder(model, compile=True)
    compiled = generate_batch(model, prompts, 6, temperature=0, decoder=decoder)
    assert decoder.path.startswith("compiled"), decoder.path
    assert compiled == generate_batch(model, prompts, 6, temperature=0, decoder=Decoder(model, compile=False))
    assert decoder.describe(2) == "decode: compiled (default), KV cache, batch 2"


def test_a_failing_compiled_step_falls_back_to_the_eager_one_with_a_warning():
    model = tiny_model()
    prompts = [[1], [2, 3, 4, 5, 6, 7]]
    decoder = Decoder(model, compile=False)
    eager = generate_batch(model, prompts, 6, temperature=0, decoder=decoder)

    def no_compiler(ids, cache):
        raise RuntimeError("no C++ compiler")

    decoder.compiled = no_compiler
    with pytest.warns(UserWarning, match="compiled decode failed, decoding eagerly: RuntimeError: no C"):
        assert generate_batch(model, prompts, 6, temperature=0, decoder=decoder) == eager
    assert decoder.compiled is None
    assert decoder.describe(2) == "decode: eager (compile failed), KV cache, matmuls in row blocks, batch 2"


def test_training_mode_is_restored():
    model = tiny_model().train()
    for _ in generate_stream(model, [1, 2], 3):
        assert not model.training
    assert model.training


def test_text_stream_holds_back_split_characters():
    tok = GPT2Tokenizer()
    text = "Hi 😀 there, 東京!"
    ids = tok.encode(text)
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert len(ids) > len([p for p in pieces if p])  # some tokens were partial characters


# ---------------------------------------------------------------- the sample command


@pytest.mark.slow
def test_sample_command_prints_several_samples(tmp_path, cpu_kind):
    tok = CharTokenizer("abcdefgh \n")
    cfg = Config()
    cfg.model = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    meta = {"config": to_dict(cfg), "tokens": 0, "best_val_loss": None, "tokenizer": tok.spec()}
    save_checkpoint(tmp_path / "run", step=0, weights=model_state(GPT(cfg.model)), state={}, meta=meta)
    result = run_cli("sample", "--ckpt", str(tmp_path / "run"), "--prompt", "abc", "--num-samples", "2",
                     "--max-new-tokens", "5", "--temperature", "1.0", "--device", "cpu", cpu_bf16=cpu_kind)
    assert result.returncode == 0, result.stderr
    assert "--- sample 1 of 2\nabc" in result.stdout and "--- sample 2 of 2\nabc" in result.stdout
    # --dtype auto: bf16 weights where the CPU computes bf16 natively; else fp32, whose few-row matmuls run in
    # row blocks
    auto = "bfloat16" if cpu_kind else "float32"
    blocks = "" if cpu_kind else ", matmuls in row blocks"
    assert f"device: cpu, {auto}" in result.stderr and "tok/s" in result.stderr, result.stderr
    assert f"decode: eager, KV cache{blocks}, batch 2" in result.stderr, result.stderr
    bad = run_cli("sample", "--ckpt", str(tmp_path / "run"), "--num-samples", "0")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: argument --num-samples: 0 is out of range")
    for dtype in ("float32", "bfloat16"):  # the weights' dtype while sampling (auto: bf16 where native)
        result = run_cli("sample", "--ckpt", str(tmp_path / "run"), "--prompt", "abc", "--max-new-tokens", "3",
                         "--dtype", dtype, "--device", "cpu", cpu_bf16=cpu_kind)
        assert result.returncode == 0 and f"device: cpu, {dtype}" in result.stderr, result.stderr
        blocks = ", matmuls in row blocks" if dtype == "float32" else ""  # whatever the CPU
        assert f"decode: eager, KV cache{blocks}, batch 1" in result.stderr, result.stderr


def tiny_char_run(path) -> None:
    """A run directory holding an untrained 1-layer model with a char tokenizer (vocab 10)."""
    tok = CharTokenizer("abcdefgh \n")
    cfg = Config()
    cfg.model = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    meta = {"config": to_dict(cfg), "tokens": 0, "best_val_loss": None, "tokenizer": tok.spec()}
    save_checkpoint(path, step=0, weights=model_state(GPT(cfg.model)), state={}, meta=meta)


def test_speed_report_tells_the_compiling_step_apart():
    assert speed_report(120, 2.0, 1) == "--- 120 tokens in 2.00 s (60.0 tok/s)"  # eager: as before
    assert speed_report(120, 14.0, 1, first_step_s=12.0) == (
        "--- 120 tokens in 14.00 s: 12.00 s compiling (the first decode step), then 59.5 tok/s over the other 119 tokens")
    assert speed_report(16, 9.0, 8, first_step_s=7.0).endswith("then 4.0 tok/s over the other 8 tokens")  # a batch
    assert speed_report(1, 3.0, 1, first_step_s=3.0) == "--- 1 tokens in 3.00 s: 3.00 s compiling (the first decode step)"


class FakeClock:
    """time.perf_counter for gpt2train.cli and gpt2train.generation: 0.5 s a reading, plus what `advance` adds."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.5
        return self.now

    def advance(self, seconds: float):
        self.now += seconds


def test_sample_with_compile_reports_the_compiling_step_apart_from_tokens_per_s(tmp_path, monkeypatch, capsys):
    """`sample --compile true` gave tokens/s with compiling inside. A fake compile (no compiler runs) whose first
    call costs 30 s of a fake clock: the first step's time is told apart, tokens/s is of the other tokens."""
    tiny_char_run(tmp_path / "run")
    clock = FakeClock()
    monkeypatch.setattr(gpt2train.cli.use, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(gpt2train.generation, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))

    def fake_compile(step, **options):
        calls = []

        def compiled(ids, cache):
            if not calls:
                clock.advance(30.0)  # compiling
            calls.append(1)
            return step(ids, cache)

        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    args = ["sample", "--ckpt", str(tmp_path / "run"), "--prompt", "abc", "--max-new-tokens", "5", "--temperature",
            "0", "--compile", "true", "--device", "cpu", "--dtype", "float32"]
    assert gpt2train.cli.main(args) == 0
    err = capsys.readouterr().err
    # Readings: start 0.5; the first decode step 1.0 -> 31.5 (30.5 s); end 32.0. The other 4 tokens: 1.0 s.
    assert "--- 5 tokens in 31.50 s: 30.50 s compiling (the first decode step), then 4.0 tok/s over the other " \
           "4 tokens" in err, err
    assert "decode: compiled (default), KV cache, batch 1" in err
