"""The record-setting recipe's model options (value embeddings, U-net skips, a sliding attention window and its
warmup, multi-token prediction), each against a direct computation; off, GPT-2 stays as it was
(tests/test_trajectory.py pins the default run's losses)."""

from __future__ import annotations

import math
import signal

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import one_line, tiny_config
from gpt2train.config import Config, ConfigError, validate
from gpt2train.counting import flops_per_token, matmul_parameter_count, parameter_count
from gpt2train.generation import generate_batch
from gpt2train.gguf_export import GGUFExportError, export_gguf
from gpt2train.hf import HFConversionError, export_hf
from gpt2train.model import GPT, GPTConfig, KVCache
from gpt2train.training.loop import Trainer, train
from gpt2train.training.step import attention_window_at
from test_resume import assert_same_tensors, stop_with_sigterm_at, train_losses

RECIPE = dict(value_embeddings=1, unet_skips=True, attention_window=5, mtp_weight=0.5)


def tiny(**overrides) -> GPTConfig:
    return GPTConfig(**{**dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=70), **overrides})


def built(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def attention_by_hand(attn, x: torch.Tensor, mask: torch.Tensor, ve: torch.Tensor | None = None) -> torch.Tensor:
    """One attention layer written out: q, k, v (+ the weighted value embedding), softmax(q k^T / sqrt(hs))
    over the keys `mask` (T, T) allows, times v, projected."""
    B, T, C = x.shape
    hs = C // attn.n_head
    q, k, v = (x @ attn.c_attn.weight.t() + attn.c_attn.bias).split(C, dim=2)
    if ve is not None:
        v = v + attn.ve_lambda * ve
    q, k, v = (t.reshape(B, T, attn.n_head, hs).permute(0, 2, 1, 3) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
    y = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
    return y.permute(0, 2, 1, 3).reshape(B, T, C) @ attn.c_proj.weight.t() + attn.c_proj.bias


def attention_io(model: GPT, layer: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input (after ln_1) and output of block `layer`'s attention in a forward of idx."""
    seen = {}
    handle = model.transformer.h[layer].attn.register_forward_hook(
        lambda module, args, out: seen.update(x=args[0], y=out))
    model(idx)
    handle.remove()
    return seen["x"], seen["y"]


def window_mask(T: int, window: int) -> torch.Tensor:
    """(T, T): query i sees key j when j <= i and i - j < window, written out pair by pair."""
    return torch.tensor([[0 <= i - j < window for j in range(T)] for i in range(T)])


# ---------------------------------------------------------------- value embeddings


def test_value_embedding_tables_feed_the_first_and_last_blocks_in_a_u():
    assert [tiny(n_layer=6, value_embeddings=2).value_table(i) for i in range(6)] == [0, 1, None, None, 0, 1]
    assert [tiny(n_layer=3, value_embeddings=1).value_table(i) for i in range(3)] == [0, None, 0]
    assert [tiny(n_layer=4).value_table(i) for i in range(4)] == [None] * 4
    model = built(tiny(n_layer=4, value_embeddings=2))
    assert len(model.value_embeds) == 2 and all(hasattr(b.attn, "ve_lambda") for b in model.transformer.h)
    assert not hasattr(built(tiny(n_layer=6, value_embeddings=2)).transformer.h[2].attn, "ve_lambda")


@pytest.mark.parametrize("layer, table", [(0, 0), (3, 1)])  # of 4 blocks, 0 and 2 share table 0, 1 and 3 table 1
def test_a_layers_attention_with_value_embeddings_equals_the_direct_computation(layer, table):
    model = built(tiny(n_layer=4, value_embeddings=2)).eval()
    with torch.no_grad():
        model.transformer.h[layer].attn.ve_lambda.fill_(0.7)
        model.value_embeds[table].weight.mul_(20.0)  # rows as large as the values, so that they matter
    idx = torch.randint(0, 70, (2, 16))
    x, y = attention_io(model, layer, idx)
    ve = model.value_embeds[table](idx)
    with torch.no_grad():
        torch.testing.assert_close(y, attention_by_hand(model.transformer.h[layer].attn, x, window_mask(16, 16), ve),
                                   atol=1e-5, rtol=1e-5)
        assert not torch.allclose(y, attention_by_hand(model.transformer.h[layer].attn, x, window_mask(16, 16)), atol=1e-3)


# ---------------------------------------------------------------- U-net skips


def test_unet_skips_equal_a_hand_written_loop_over_the_blocks():
    model = built(tiny(n_layer=5, unet_skips=True)).eval()
    with torch.no_grad():
        model.skip_weights.copy_(torch.tensor([0.3, -1.7]))  # weight j: of block j's output
    idx = torch.randint(0, 70, (2, 16))
    with torch.no_grad():
        h = model.transformer.h
        x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(16))
        out0 = x = h[0](x)
        out1 = x = h[1](x)
        x = h[2](x)  # the middle block of five takes no skip
        x = h[3](x - 1.7 * out1)
        x = h[4](x + 0.3 * out0)
        want = model.lm_head(model.transformer.ln_f(x))[..., :70]
        torch.testing.assert_close(model(idx), want, atol=1e-6, rtol=1e-6)
    assert model.skip_weights.shape == (2,)


# ---------------------------------------------------------------- the sliding window


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "naive"])
@pytest.mark.parametrize("window", [1, 4])
def test_sliding_window_attention_equals_naive_attention_masked_by_hand(attention, window):
    model = built(tiny(attention=attention, attention_window=window)).eval()
    idx = torch.randint(0, 70, (2, 16))
    for layer in (0, 1):
        x, y = attention_io(model, layer, idx)
        with torch.no_grad():
            torch.testing.assert_close(y, attention_by_hand(model.transformer.h[layer].attn, x, window_mask(16, window)),
                                       atol=1e-5, rtol=1e-5)
    causal = built(tiny(attention=attention)).eval()
    assert not torch.allclose(model(idx), causal(idx), atol=1e-3)  # the window does cut the context


@pytest.mark.parametrize("window", [16, 17, 1000])
def test_a_window_as_long_as_the_sequence_is_exactly_causal(window):
    idx, targets = torch.randint(0, 70, (2, 16)), torch.randint(0, 70, (2, 16))
    windowed, causal = built(tiny(attention_window=window)).train(), built(tiny()).train()
    assert torch.equal(windowed(idx, targets)[1], causal(idx, targets)[1])
    assert torch.equal(windowed.eval()(idx), causal.eval()(idx))
    assert torch.equal(windowed(idx[:, :7]), causal(idx[:, :7]))


def test_the_kv_cache_applies_the_window_and_left_padded_rows_generate_what_they_generate_alone():
    model = built(tiny(attention_window=4, value_embeddings=1, unet_skips=True)).eval()
    idx = torch.randint(0, 70, (2, 16))
    full = model(idx)
    cache = KVCache(model.config, 2, 16, "cpu", torch.float32)
    pieces = [model(idx[:, :6], kv_cache=cache)] + [model(idx[:, t : t + 1], kv_cache=cache) for t in range(6, 16)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    together = generate_batch(model, prompts, 6, temperature=0.0)
    assert together == [generate_batch(model, [p], 6, temperature=0.0)[0] for p in prompts]


def window_at(step: int, window: int, warmup_steps: int) -> int:
    cfg = Config()
    cfg.model.attention_window, cfg.train.window_warmup_steps = window, warmup_steps
    return attention_window_at(step, cfg)


def test_the_window_warmup_is_a_function_of_the_step_that_reaches_the_window():
    assert [window_at(s, 1024, 16) for s in range(1, 18)] == [64, 128, 128, 256, 256, 256, 256] + [512] * 8 + [1024] * 2
    for step in range(1, 200):
        w = window_at(step, 1000, 100)
        assert w == window_at(step, 1000, 100)  # the same at every call: a resume gets the same
        assert w <= max(1000 * step / 100, 1000 // 16) and w in (1000, 500, 250, 125, 62)
        assert (w == 1000) == (step >= 100)
        assert w <= window_at(step + 1, 1000, 100)  # it only grows
    assert window_at(1, 1000, 0) == 1000  # no warmup: the window from the first step
    assert window_at(1, 8, 100) == 1  # never below one token
    assert window_at(1, 0, 0) == 0  # no window: full causal attention


def test_the_trainer_sets_the_window_of_each_step(char_data, tmp_path):
    cfg = tiny_config(char_data, max_steps=5, window_warmup_steps=4)
    cfg.model.attention_window = 16
    cfg.eval.interval = 0
    trainer = Trainer(cfg, None)
    windows = []
    for _ in range(5):
        trainer.train_step()
        windows.append(trainer.raw_model.window)
    assert windows == [window_at(s, 16, 4) for s in range(1, 6)] == [4, 8, 8, 16, 16]
    trainer.close()


# ---------------------------------------------------------------- multi-token prediction


def final_hidden(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    seen = {}
    handle = model.transformer.ln_f.register_forward_hook(lambda module, args, out: seen.update(h=out))
    _, loss = model(idx, targets)
    handle.remove()
    return seen["h"], loss


def test_mtp_loss_is_the_next_token_loss_plus_the_weight_times_the_loss_two_ahead():
    model = built(tiny(mtp_weight=0.3, logit_softcap=10.0)).train()
    with torch.no_grad():
        model.mtp_head.weight.normal_(0, 0.3)  # zero at init; random here, so that the projection counts
    idx, targets = torch.randint(0, 70, (2, 16)), torch.randint(0, 70, (2, 16))
    targets[0, 3:6] = -1
    h, loss = final_hidden(model, idx, targets)
    W = model.lm_head.weight

    def logits(hidden):
        return 10.0 * torch.tanh((hidden @ W.t())[..., :70] / 10.0)

    main = F.cross_entropy(logits(h).reshape(-1, 70), targets.reshape(-1), ignore_index=-1)
    aux = F.cross_entropy(logits(h + h @ model.mtp_head.weight.t())[:, :-1].reshape(-1, 70), targets[:, 1:].reshape(-1),
                          ignore_index=-1)  # position t predicts targets[t + 1], the token at t + 2
    torch.testing.assert_close(loss, main + 0.3 * aux, atol=1e-6, rtol=1e-6)
    _, eval_loss = model.eval()(idx, targets)  # evaluation: the plain next-token loss
    torch.testing.assert_close(eval_loss, main, atol=1e-6, rtol=1e-6)


def test_mtp_starts_as_the_same_head_and_its_fused_loss_equals_the_plain_one():
    fresh = built(tiny(mtp_weight=1.0)).train()
    assert not fresh.mtp_head.weight.any()  # zero: the token two ahead starts from the next token's logits
    idx, targets = torch.randint(0, 70, (2, 16)), torch.randint(0, 70, (2, 16))
    results = []
    for chunk in (0, 7):
        model = built(tiny(mtp_weight=1.0, loss_chunk=chunk)).train()
        with torch.no_grad():
            model.mtp_head.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
        _, loss = model(idx, targets)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-5, rtol=1e-5, msg=name)
    assert results[0][1]["mtp_head.weight"].abs().sum() > 0


# ---------------------------------------------------------------- the recipe as a whole


@pytest.mark.parametrize("options", [dict(value_embeddings=2), dict(unet_skips=True), dict(attention_window=5),
                                     dict(mtp_weight=0.5), dict(RECIPE, value_embeddings=2, tied_head=False)])
def test_parameter_and_flop_counts_follow_the_built_model(options):
    cfg = tiny(**{"n_layer": 4, **options})
    model = built(cfg)
    params = {id(p): p for p in model.parameters()}.values()
    assert parameter_count(cfg) == sum(p.numel() for p in params)
    embeddings = [model.transformer.wte.weight, model.transformer.wpe.weight]
    embeddings += [t.weight for t in getattr(model, "value_embeds", [])]
    if not cfg.tied_head:
        embeddings.append(model.lm_head.weight)
    assert parameter_count(cfg, non_embedding=True) == sum(p.numel() for p in params) - sum(e.numel() for e in embeddings)
    matmul = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    matmul += [m.bias for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]
    assert matmul_parameter_count(cfg) == sum(p.numel() for p in {id(p): p for p in matmul}.values())

    plain = flops_per_token(tiny(n_layer=4, tied_head=cfg.tied_head), 16)
    C, V = 32, cfg.padded_vocab_size
    scalars = 2 * cfg.value_embeddings + (2 if cfg.unet_skips else 0)  # weights of the tables, of the skips
    mtp = C * C + V * C if cfg.mtp_weight else 0  # the projection, and the head a second time
    attention = 12 * 4 * C * (16 - 5) if cfg.attention_window else 0  # 5 keys per query, not 16
    assert flops_per_token(cfg, 16) == plain + 6 * (scalars + mtp) - attention


def test_every_option_together_grad_checkpoints_and_samples():
    cfg = tiny(n_layer=4, **{**RECIPE, "value_embeddings": 2})
    idx, targets = torch.randint(0, 70, (2, 16)), torch.randint(0, 70, (2, 16))
    grads = []
    for checkpointed in (False, True):
        model = built(tiny(n_layer=4, **{**RECIPE, "value_embeddings": 2}, grad_checkpointing=checkpointed)).train()
        _, loss = model(idx, targets)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch.equal(grads[0][0], grads[1][0])
    for name, grad in grads[0][1].items():
        assert grad is not None, name  # every part of the recipe learns
        torch.testing.assert_close(grads[1][1][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    out = generate_batch(built(cfg).eval(), [[1, 2, 3], [4]], 8, temperature=1.0, seed=0)
    assert [len(row) for row in out] == [8, 8]


@pytest.mark.slow
def test_every_option_compiles_whole_and_a_new_window_recompiles():
    cfg = tiny(**RECIPE, block_size=8)
    eager, compiled_model = built(cfg).train(), built(cfg).train()
    compiled = torch.compile(compiled_model, fullgraph=True)  # fullgraph: any graph break is an error
    idx, targets = torch.randint(0, 70, (2, 8)), torch.randint(0, 70, (2, 8))
    for window in (2, 5):  # as the trainer's window warmup sets it
        eager.window = compiled_model.window = window
        torch.testing.assert_close(compiled(idx, targets)[1], eager(idx, targets)[1], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_run_with_every_option_resumes_exactly(char_data, tmp_path):
    def recipe_config():
        cfg = tiny_config(char_data, max_steps=10, window_warmup_steps=8)
        cfg.model.value_embeddings, cfg.model.unet_skips, cfg.model.attention_window, cfg.model.mtp_weight = 1, True, 8, 0.5
        return cfg

    straight = train(recipe_config(), tmp_path / "straight")
    trainer = Trainer(recipe_config(), tmp_path / "resumed")
    stop_with_sigterm_at(trainer, 6)  # mid-warmup: window 4 at step 6, 8 from step 8
    assert trainer.fit()["step"] == 6
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    resumed = train(recipe_config(), tmp_path / "resumed", resume="auto")
    assert resumed["step"] == straight["step"] == 10
    assert train_losses(tmp_path / "resumed") == train_losses(tmp_path / "straight")  # exact floats
    final_a, final_b = (tmp_path / run / "checkpoints" / "step_00000010" / "model.safetensors" for run in ("straight", "resumed"))
    weights = load_file(final_a)
    assert {"skip_weights", "value_embeds.0.weight", "mtp_head.weight", "transformer.h.0.attn.ve_lambda"} <= weights.keys()
    assert_same_tensors(weights, load_file(final_b))
    assert resumed["best_val_loss"] == straight["best_val_loss"]
    assert straight["val_loss"] < math.log(66)  # below uniform over 66 characters


@pytest.mark.parametrize("option", sorted(RECIPE))
def test_exports_refuse_each_option_in_one_line_naming_it(option, tmp_path):
    model = built(tiny(**{option: RECIPE[option]}))
    named = f"model.{option} = {RECIPE[option]}"
    message = one_line(HFConversionError, export_hf, model, tmp_path / "hf")
    assert named in message and "cannot be exported" in message and not (tmp_path / "hf").exists()
    message = one_line(GGUFExportError, export_gguf, model, tmp_path / "m.gguf")
    assert named in message and "cannot be exported to GGUF" in message and not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("overrides, message", [
    (dict(value_embeddings=2), "model.value_embeddings = 2 needs 2 blocks per table"),
    (dict(n_layer=1, unet_skips=True), "model.unet_skips = true needs model.n_layer >= 2"),
    (dict(attention_window=-1), "model.attention_window = -1 is out of range"),
    (dict(mtp_weight=-0.5), "model.mtp_weight = -0.5 is out of range"),
])
def test_a_shape_the_recipe_cannot_take_is_one_line(overrides, message):
    assert message in one_line(ValueError, GPT, tiny(**overrides))


def test_a_window_warmup_without_a_window_is_one_line(char_data):
    cfg = tiny_config(char_data, window_warmup_steps=10)
    assert "train.window_warmup_steps = 10 grows the attention window" in one_line(ConfigError, validate, cfg)
    cfg.model.attention_window = 16
    validate(cfg)
