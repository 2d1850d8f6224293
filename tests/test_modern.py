"""The modern recipe's model options, each against what it must do; GPT-2's defaults stay as they were
(tests/test_trajectory.py pins the default run's losses)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import one_line, tiny_config
from gpt2train.checkpoint import check_same_shape, model_state
from gpt2train.classifier import chunked_cross_entropy, softcap
from gpt2train.config import ConfigError, to_dict
from gpt2train.counting import flops_per_token, parameter_count
from gpt2train.generation import generate_batch
from gpt2train.hf import HFConversionError, export_hf
from gpt2train.model import GPT, GPTConfig, KVCache, rotary_angles, rotate
from gpt2train.training.loop import train

MODERN = dict(position="rotary", qk_norm=True, mlp="relu2", tied_head=False, zero_init_proj=True, logit_softcap=15.0)


def tiny(**overrides) -> GPTConfig:
    return GPTConfig(**{**dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=70), **overrides})


def built(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


# ---------------------------------------------------------------- rotary


def test_rotary_attention_scores_depend_only_on_the_distance_between_positions():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(query_pos: int, key_pos: int) -> float:
        angles_q, angles_k = rotary_angles(torch.tensor([query_pos]), 8, 100.0), rotary_angles(torch.tensor([key_pos]), 8, 100.0)
        return float((rotate(q, *angles_q) * rotate(k, *angles_k)).sum())

    for distance in (0, 1, 5):
        scores = [score(start + distance, start) for start in (0, 3, 11, 40)]
        assert max(scores) - min(scores) < 1e-5, (distance, scores)
    assert abs(score(5, 0) - score(1, 0)) > 1e-3  # and the distance itself does matter


def test_rotation_keeps_lengths_and_position_zero_is_the_identity():
    x = torch.randn(2, 3, 5, 8)
    cos, sin = rotary_angles(torch.arange(5), 8, 10000.0)
    torch.testing.assert_close(rotate(x, cos, sin).norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(rotate(x, cos, sin)[:, :, 0], x[:, :, 0])


@pytest.mark.slow
def test_rotary_model_has_no_position_embedding_and_its_kv_cache_gives_the_full_forward():
    model = built(tiny(position="rotary")).eval()
    assert not hasattr(model.transformer, "wpe")
    idx = torch.randint(0, 70, (2, 16))
    full = model(idx)
    cache = KVCache(model.config, 2, 16, "cpu", torch.float32)
    pieces = [model(idx[:, :5], kv_cache=cache)] + [model(idx[:, t : t + 1], kv_cache=cache) for t in range(5, 16)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_a_left_padded_rotary_row_generates_what_it_generates_alone():
    model = built(tiny(**{**MODERN, "zero_init_proj": False})).eval()  # random heads: greedy choices that differ
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    together = generate_batch(model, prompts, 6, temperature=0.0)
    alone = [generate_batch(model, [p], 6, temperature=0.0)[0] for p in prompts]
    assert together == alone


# ---------------------------------------------------------------- QK norm, ReLU², zero init, untied head


def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys():
    model = built(tiny(qk_norm=True)).eval()
    idx = torch.randint(0, 70, (2, 16))
    before = model(idx)
    with torch.no_grad():
        C = model.config.n_embd
        for block in model.transformer.h:
            block.attn.c_attn.weight[: 2 * C] *= 7.0  # queries and keys, not values
            block.attn.c_attn.bias[: 2 * C] *= 7.0
    torch.testing.assert_close(model(idx), before, atol=1e-4, rtol=1e-4)
    plain = built(tiny()).eval()
    with torch.no_grad():
        for block in plain.transformer.h:
            block.attn.c_attn.weight[: 2 * C] *= 7.0
    assert not torch.allclose(plain(idx), built(tiny()).eval()(idx), atol=1e-3)  # without it the scale matters


def test_relu2_is_relu_squared():
    mlp = built(tiny(mlp="relu2")).transformer.h[0].mlp
    x = torch.linspace(-3, 3, 13)
    assert torch.equal(mlp.gelu(x), torch.where(x > 0, x * x, torch.zeros_like(x)))


def test_zero_init_projections_make_each_block_the_identity_and_an_untied_head_uniform():
    model = built(tiny(zero_init_proj=True, tied_head=False))
    for block in model.transformer.h:
        assert not block.attn.c_proj.weight.any() and not block.mlp.c_proj.weight.any()
    assert not model.lm_head.weight.any()
    idx, targets = torch.randint(0, 70, (2, 16)), torch.randint(0, 70, (2, 16))
    _, loss = model(idx, targets)
    assert loss.item() == pytest.approx(math.log(70), abs=1e-6)  # uniform over the real vocabulary
    tied = built(tiny(zero_init_proj=True))
    assert tied.lm_head.weight.any()  # a tied head is the embedding, which is never zeroed


def test_untied_head_is_its_own_matrix_counted_and_saved():
    cfg = tiny(tied_head=False, position="rotary")
    model = built(cfg)
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert parameter_count(cfg) == sum(p.numel() for p in model.parameters())
    assert parameter_count(cfg) - parameter_count(tiny()) == cfg.padded_vocab_size * 32 - 16 * 32  # head - wpe
    # The FLOPs of a step do not change: the head's matmul is the same, the embeddings are lookups.
    assert flops_per_token(cfg, 16) == flops_per_token(tiny(), 16)
    state = model_state(model)
    assert "lm_head.weight" in state
    fresh = built(cfg, seed=1)
    fresh.load_state_dict(state)
    idx = torch.randint(0, 70, (1, 8))
    assert torch.equal(fresh(idx), model(idx))
    assert "lm_head.weight" not in model_state(built(tiny()))  # tied: stored once, as the embedding


# ---------------------------------------------------------------- logit soft cap


def test_soft_cap_bounds_the_logits():
    model = built(tiny(logit_softcap=5.0)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(1000.0)
    logits = model(torch.randint(0, 70, (2, 16)))
    assert logits.abs().max() <= 5.0 and logits.abs().max() > 4.9
    small = torch.tensor([0.01, -0.02])
    torch.testing.assert_close(softcap(small, 30.0), small, atol=1e-7, rtol=1e-6)  # the identity near 0


@pytest.mark.parametrize("chunk", [1, 5, 100])
def test_fused_classifier_with_a_soft_cap_equals_cross_entropy_of_capped_logits(chunk):
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = (3 * torch.randn(64, 16)).requires_grad_()  # large logits, where the cap bends them
    targets = torch.randint(0, 50, (3, 7))
    targets[0, 2:5] = -1
    capped = 4.0 * torch.tanh((hidden @ weight.t())[..., :50] / 4.0)
    plain = F.cross_entropy(capped.reshape(-1, 50), targets.reshape(-1), ignore_index=-1)
    want = torch.autograd.grad(plain, (hidden, weight))
    fused = chunked_cross_entropy(hidden, weight, targets, chunk, vocab_size=50, cap=4.0)
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-6)
    for got, expected in zip(torch.autograd.grad(fused, (hidden, weight)), want):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the evaluation path
        torch.testing.assert_close(chunked_cross_entropy(hidden, weight, targets, chunk, 50, 4.0), plain)


# ---------------------------------------------------------------- the recipe as a whole


@pytest.mark.slow
def test_every_option_together_trains_resumes_and_grad_checkpoints(char_data, tmp_path):
    cfg = tiny_config(char_data, max_steps=8)
    for key, value in MODERN.items():
        setattr(cfg.model, key, value)
    cfg.model.loss_chunk = 16
    out = train(cfg, tmp_path / "run")
    assert out["step"] == 8 and out["val_loss"] < math.log(66) - 0.05  # below uniform over 66 characters
    cfg.train.max_steps = 10
    assert train(cfg, tmp_path / "run", resume="auto")["step"] == 10

    model = built(tiny(**{**MODERN, "zero_init_proj": False}, grad_checkpointing=True)).train()
    idx, targets = torch.randint(0, 70, (2, 16)), torch.randint(0, 70, (2, 16))
    plain = built(tiny(**{**MODERN, "zero_init_proj": False})).train()
    grads = []
    for m in (model, plain):
        _, loss = m(idx, targets)
        loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5, msg=name)


def test_resume_refuses_a_changed_option_and_reads_old_checkpoints_as_gpt2():
    saved = to_dict_model(GPTConfig())
    old = {k: v for k, v in saved.items() if k not in MODERN and k != "rope_base"}  # before the keys existed
    check_same_shape(old, saved)
    message = one_line(ConfigError, check_same_shape, saved, to_dict_model(GPTConfig(mlp="relu2")))
    assert "model settings changed (mlp: gelu -> relu2)" in message


def to_dict_model(model: GPTConfig) -> dict:
    from gpt2train.config import Config

    cfg = Config()
    cfg.model = model
    return to_dict(cfg)["model"]


@pytest.mark.parametrize("option", sorted(MODERN))
def test_export_hf_refuses_what_gpt2_cannot_hold_in_one_line(option, tmp_path):
    model = built(tiny(**{option: MODERN[option]}))
    if option == "zero_init_proj":  # only an init: the weights are GPT-2's
        assert (export_hf(model, tmp_path / "out") / "model.safetensors").exists()
        return
    message = one_line(HFConversionError, export_hf, model, tmp_path / "out")
    assert f"model.{option} = {MODERN[option]}" in message and "cannot be exported" in message
    assert not (tmp_path / "out").exists()  # nothing written
