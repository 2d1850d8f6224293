"""train.optimizer = "muon": Muon for the blocks' weight matrices, AdamW for the rest, stepped as one optimizer
by the trainer, the LR schedule, the grad scaler, checkpoints and the memory estimator; our Muon against
torch.optim.Muon, and the recipe's options (Polar Express, NorMuon, cautious weight decay) against updates
written out by hand."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch

from conftest import one_line, tiny_config
from gpt2train.config import CHOICES, Config, ConfigError, TrainConfig, validate
from gpt2train.memory import estimate_memory
from gpt2train.model import GPT, GPTConfig
from gpt2train.training import optim
from gpt2train.training.loop import Trainer, train
from gpt2train.training.optim import (
    ORTHOGONALIZERS,
    Muon,
    MuonAdamW,
    lr_at,
    make_optimizer,
    muon_parameter_count,
    orthogonalize,
    set_lr,
)

MODEL = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=66)
BLOCK_MATRICES = [f"transformer.h.{i}.{m}.weight" for i in range(2)
                  for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


def muon_model(**train) -> tuple[GPT, MuonAdamW]:
    torch.manual_seed(0)
    model = GPT(MODEL)
    return model, make_optimizer(model, TrainConfig(optimizer="muon", **train), "cpu")


def names(model: torch.nn.Module, params: list) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def group_names(model, optimizer) -> list[set[str]]:
    return [names(model, g["params"]) for g in optimizer.param_groups]


# --- which parameter goes where ----------------------------------------------------------------------------
def test_block_matrices_go_to_muon_and_the_rest_to_adamw_with_its_groups():
    model, opt = muon_model()
    muon, decay, no_decay = group_names(model, opt)
    assert muon == set(BLOCK_MATRICES)
    assert decay == {"transformer.wte.weight", "transformer.wpe.weight"}  # lm_head is wte (tied): once
    assert no_decay and all(model.get_parameter(n).dim() == 1 for n in no_decay)  # gains and biases
    assert len(muon) + len(decay) + len(no_decay) == len(list(model.parameters()))
    adamw = opt.adamw.param_groups
    assert [g["weight_decay"] for g in adamw] == [0.1, 0.0] and adamw[0]["lr"] == 6e-4 and adamw[0]["fused"]
    assert opt.muon.param_groups[0]["lr"] == 0.02 and opt.muon.param_groups[0]["momentum"] == 0.95


def test_an_untied_head_and_a_model_without_wpe_go_to_adamw():
    torch.manual_seed(0)
    model = GPT(MODEL)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # tied_head = false
    del model.transformer.wpe  # rotary position encoding has no position embedding
    opt = make_optimizer(model, TrainConfig(optimizer="muon"), "cpu")
    muon, decay, _ = group_names(model, opt)
    assert muon == set(BLOCK_MATRICES)
    assert decay == {"transformer.wte.weight", "lm_head.weight"}


class Wrapper(torch.nn.Module):
    """Names its child `module`, as DDP does."""

    def __init__(self, module):
        super().__init__()
        self.module = module


@pytest.mark.parametrize("wrap", [Wrapper, torch.compile], ids=["ddp-prefix", "compile-prefix"])
def test_the_split_ignores_wrapper_prefixes(wrap):
    torch.manual_seed(0)
    model = GPT(MODEL)
    opt = make_optimizer(wrap(model), TrainConfig(optimizer="muon"), "cpu")
    assert names(model, opt.muon.param_groups[0]["params"]) == set(BLOCK_MATRICES)


def test_adamw_alone_stays_one_adamw():
    model = GPT(MODEL)
    opt = make_optimizer(model, TrainConfig(), "cpu")
    assert type(opt) is torch.optim.AdamW and len(opt.param_groups) == 2


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_embedding_lr_gives_the_token_tables_a_group_and_a_schedule_of_their_own(optimizer):
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(MODEL, value_embeddings=1, tied_head=False))
    cfg = TrainConfig(optimizer=optimizer, embedding_lr=0.05, lr=0.01, warmup_steps=4, max_steps=20,
                      schedule="wsd", decay_fraction=0.5)
    opt = make_optimizer(model, cfg, "cpu")
    adamw = opt if optimizer == "adamw" else opt.adamw
    decay, no_decay, tables = group_names(model, adamw)
    assert tables == {"transformer.wte.weight", "value_embeds.0.weight"}
    assert "lm_head.weight" in decay and not tables & (decay | no_decay)
    for step in (1, 4, 12, 20):  # warmup, flat, decay, end
        set_lr(opt, step, cfg)
        assert [g["lr"] for g in adamw.param_groups] == [lr_at(step, cfg)] * 2 + [lr_at(step, cfg, peak=0.05)]
    assert len(make_optimizer(model, TrainConfig(optimizer=optimizer), "cpu").param_groups) == len(
        adamw.param_groups) - 1 + (optimizer == "muon")  # 0: the groups as before, so older checkpoints load


@pytest.mark.slow
def test_a_token_tables_step_is_adamws_at_the_embedding_lr():
    model, opt = muon_model(embedding_lr=0.05, weight_decay=0.1)
    reference = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())
    by_hand = torch.optim.AdamW([reference], lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    cfg = TrainConfig(optimizer="muon", embedding_lr=0.05, warmup_steps=0, schedule="constant")
    for _ in range(3):
        idx = torch.randint(0, MODEL.vocab_size, (2, 8))
        opt.zero_grad()
        model(idx, idx)[1].backward()
        reference.grad = model.transformer.wte.weight.grad.clone()
        set_lr(opt, 1, cfg)
        opt.step()
        by_hand.step()
    # the trainer's AdamW is the fused kernel, the reference the foreach path: equal up to float rounding
    torch.testing.assert_close(model.transformer.wte.weight, reference, rtol=1e-6, atol=1e-7)


# --- the update --------------------------------------------------------------------------------------------
def test_muon_update_of_a_matrix_is_orthogonalized():
    """Given a full-rank gradient whose singular values span 1 to 0.03, the step moves each block matrix by
    lr * sqrt(max(1, rows/cols)) times a matrix of its shape whose singular values are all near 1 (five
    Newton-Schulz steps in bf16 land them in about [0.68, 1.14])."""
    model, opt = muon_model(muon_weight_decay=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for name in BLOCK_MATRICES:
        p = model.get_parameter(name)
        rows, cols = p.shape
        k = min(rows, cols)
        u, _ = torch.linalg.qr(torch.randn(rows, k))
        v, _ = torch.linalg.qr(torch.randn(cols, k))
        p.grad = u @ torch.diag(torch.logspace(0, -1.5, k)) @ v.T
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    for name in BLOCK_MATRICES:
        p = model.get_parameter(name)
        rows, cols = p.shape
        update = (before[name] - p.detach()) / (0.02 * math.sqrt(max(1, rows / cols)))
        assert update.shape == p.shape
        singular = torch.linalg.svd(update).S
        assert singular.min() > 0.6 and singular.max() < 1.25, (name, singular.min(), singular.max())
    wte = before["transformer.wte.weight"]  # AdamW's: with a zero gradient only its weight decay moves it
    torch.testing.assert_close(model.transformer.wte.weight.detach(), wte * (1 - 6e-4 * 0.1), rtol=0, atol=1e-9)


def matrices(shapes=((24, 8), (8, 24), (16, 16)), dtype=torch.float32) -> list[torch.nn.Parameter]:
    """A tall, a wide and a square weight."""
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in shapes]


def step_with(optimizers_and_params, grads):
    """Give each optimizer's parameters the same gradients, then step each."""
    for opt, params in optimizers_and_params:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("nesterov", [True, False])
def test_our_muon_steps_as_torchs_muon(nesterov):
    """With torch's defaults (Newton-Schulz in bf16, Nesterov, the sqrt(max(1, rows / cols)) LR, decoupled weight
    decay), three steps of ours equal three of torch.optim.Muon's bit for bit on fp32 weights: the same
    operations in the same order, both orthogonalizing in bf16."""
    ours, theirs = matrices(), matrices()
    ours_opt = Muon(ours, lr=0.02, weight_decay=0.1, nesterov=nesterov, orthogonalize_in=torch.bfloat16)
    theirs_opt = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, nesterov=nesterov)
    for _ in range(3):
        step_with([(ours_opt, ours), (theirs_opt, theirs)], [torch.randn(p.shape) for p in ours])
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
            assert torch.equal(ours_opt.state[a]["momentum_buffer"], theirs_opt.state[b]["momentum_buffer"])


@pytest.mark.slow
def test_a_checkpoint_of_torchs_muon_loads_and_steps_on_as_torchs_would():
    """gpt2train's checkpoints before its own Muon hold torch.optim.Muon's state ({"muon": ..., "adamw": ...}):
    ours loads it (momentum buffers, LR, momentum, weight decay; torch's own orthogonalizer keys dropped) and its
    next step is the one torch's Muon would have taken."""
    model, opt = muon_model(muon_weight_decay=0.1)
    opt.muon.orthogonalize_in = torch.bfloat16  # torch's, also where bf16 is emulated
    torch.manual_seed(1)
    old_model = GPT(MODEL)
    old_model.load_state_dict(model.state_dict())
    named = list(old_model.named_parameters())
    old_muon = torch.optim.Muon([p for n, p in named if n in BLOCK_MATRICES], lr=0.02, weight_decay=0.1)
    old_adamw = optim.make_adamw([(n, p) for n, p in named if n not in BLOCK_MATRICES], TrainConfig(), "cpu")
    x = torch.randint(0, 66, (2, 32))

    def one_step(model, optimizers):
        for o in optimizers:
            o.zero_grad()
        model(x, x)[1].backward()
        for o in optimizers:
            o.step()

    for _ in range(2):
        one_step(old_model, [old_muon, old_adamw])
    state_pt = io.BytesIO()  # through torch.save / torch.load as a checkpoint's state.pt
    torch.save({"muon": old_muon.state_dict(), "adamw": old_adamw.state_dict()}, state_pt)
    state_pt.seek(0)
    model.load_state_dict(old_model.state_dict())
    opt.load_state_dict(torch.load(state_pt, weights_only=True))
    assert set(opt.muon.param_groups[0]) == {"params", "lr", "momentum", "weight_decay", "nesterov", "eps"}
    assert opt.muon.param_groups[0]["weight_decay"] == 0.1
    one_step(old_model, [old_muon, old_adamw])
    one_step(model, [opt])
    for (name, a), b in zip(model.named_parameters(), old_model.parameters()):
        assert torch.equal(a, b), name


def test_muon_takes_matrices_only_and_its_own_orthogonalizers():
    with pytest.raises(ValueError, match=r"2-D weights only, not shapes \[\(4,\)\]"):
        Muon([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="'cubic' is not one of newton_schulz, polar_express"):
        Muon(matrices(), orthogonalizer="cubic")


# --- the orthogonalization: Newton-Schulz, Polar Express, in bf16 or fp32 ---------------------------------
def spread_singular_values(rows: int, cols: int, decades: float = 1.5) -> torch.Tensor:
    """A full-rank matrix whose singular values span 1 to 10^-decades."""
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, dtype=torch.float64))
    return u @ torch.diag(torch.logspace(0, -decades, k, dtype=torch.float64)) @ v.T


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(32, 96), (128, 32)], ids=["wide", "tall"])
def test_orthogonalize_in_fp32_is_the_float64_iteration(shape):
    """The fp32 path (a CPU without native bf16) agrees with float64 to fp32 rounding and with bf16 to bf16's."""
    torch.manual_seed(0)
    grad = torch.randn(shape)
    fp32 = orthogonalize(grad, dtype=torch.float32)
    assert fp32.dtype == torch.float32 and fp32.shape == shape
    torch.testing.assert_close(fp32.double(), orthogonalize(grad.double(), dtype=torch.float64), rtol=0, atol=1e-5)
    bf16 = orthogonalize(grad, dtype=torch.bfloat16)  # elements about 0.06; bf16 is off fp32 by 0.011 at most
    torch.testing.assert_close(bf16.float(), fp32, rtol=0, atol=0.015)


def test_polar_express_is_the_published_schedule():
    """A loop written out with Amsel et al.'s coefficients as modded-nanogpt prints them (5 iterations, a 2%
    safety margin): X / (1.02 |X|_F), then X <- a X + b (X Xᵀ) X + c (X Xᵀ)² X, one (a, b, c) per iteration."""
    published = [(8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]
    torch.manual_seed(0)
    for rows, cols in [(6, 10), (10, 6)]:
        m = torch.randn(rows, cols, dtype=torch.float64)
        x = m if rows <= cols else m.T
        x = x / (1.02 * torch.linalg.matrix_norm(x))
        for a, b, c in published:
            gram = x @ x.T
            x = a * x + b * gram @ x + c * gram @ gram @ x
        expected = x if rows <= cols else x.T
        torch.testing.assert_close(orthogonalize(m, "polar_express", torch.float64), expected, rtol=0, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_polar_express_brings_singular_values_nearer_1_than_newton_schulz(dtype):
    """Singular values spread over 1.5 decades: Polar Express lands them within 15% of 1 (its last polynomial
    equioscillates about 1: [0.86, 1.14] measured), Newton-Schulz in about [0.68, 1.14]."""
    torch.manual_seed(0)
    for shape in [(32, 96), (128, 32), (64, 64)]:
        m = spread_singular_values(*shape).float()
        polar = torch.linalg.svdvals(orthogonalize(m, "polar_express", dtype).float())
        newton = torch.linalg.svdvals(orthogonalize(m, "newton_schulz", dtype).float())
        assert 0.85 < polar.min() and polar.max() < 1.15, (shape, polar.min(), polar.max())
        assert 0.6 < newton.min() < 0.75 and newton.max() < 1.2, (shape, newton.min(), newton.max())


@pytest.mark.parametrize("native_bf16", [True, False])
def test_a_cpu_that_emulates_bf16_orthogonalizes_in_fp32(monkeypatch, native_bf16):
    """make_optimizer picks fp32 where oneDNN has no bf16 (emulated bf16 made a modern-recipe step 1.9x slower on
    an AVX2 CPU), bf16 (torch's Muon's choice) elsewhere; a step then follows that dtype."""
    monkeypatch.setattr(optim, "cpu_has_native_bf16", lambda: native_bf16)
    model, opt = muon_model()
    assert opt.muon.orthogonalize_in == (torch.bfloat16 if native_bf16 else torch.float32)
    assert make_optimizer(model, TrainConfig(optimizer="muon"), "cuda").muon.orthogonalize_in == torch.bfloat16
    x = torch.randint(0, 66, (2, 32))

    def one_step(dtype):
        model, opt = muon_model()
        opt.muon.orthogonalize_in = dtype
        model(x, x)[1].backward()
        opt.step()
        return [p.detach().clone() for p in model.parameters()]

    fp32, bf16 = one_step(torch.float32), one_step(torch.bfloat16)
    assert not all(torch.equal(a, b) for a, b in zip(fp32, bf16))


# --- NorMuon and cautious weight decay ---------------------------------------------------------------------
def test_normuon_update_by_hand_over_three_steps():
    """NorMuon written out for a tall (3 x 2: a second moment per row) and a wide (2 x 3: per column) matrix in
    float64: v <- beta2 v + (1 - beta2) (the mean square of each neuron's orthogonalized update), each neuron's
    update divided by sqrt(v), the whole scaled back to the orthogonalized update's Frobenius norm."""
    lr, momentum, beta2 = 0.1, 0.9, 0.8
    params = matrices(((3, 2), (2, 3)), torch.float64)
    by_hand = [p.detach().clone() for p in params]
    opt = Muon(params, lr=lr, momentum=momentum, normalize=True, beta2=beta2, orthogonalize_in=torch.float64)
    buffers = [torch.zeros_like(p) for p in by_hand]
    second = [torch.zeros(3, 1, dtype=torch.float64), torch.zeros(1, 3, dtype=torch.float64)]
    for _ in range(3):
        grads = [torch.randn(p.shape, dtype=torch.float64) for p in params]
        step_with([(opt, params)], grads)
        for i, (w, g) in enumerate(zip(by_hand, grads)):
            buffers[i] = momentum * buffers[i] + (1 - momentum) * g
            o = orthogonalize((1 - momentum) * g + momentum * buffers[i], dtype=torch.float64)
            if i == 0:  # tall: one neuron per row
                per_neuron = torch.stack([sum(o[r, c] ** 2 for c in range(2)) / 2 for r in range(3)]).reshape(3, 1)
            else:  # wide: one per column
                per_neuron = torch.stack([sum(o[r, c] ** 2 for r in range(2)) / 2 for c in range(3)]).reshape(1, 3)
            second[i] = beta2 * second[i] + (1 - beta2) * per_neuron
            normalized = o / second[i].sqrt()
            normalized = normalized * torch.linalg.matrix_norm(o) / torch.linalg.matrix_norm(normalized)
            by_hand[i] = w - lr * max(1, w.shape[0] / w.shape[1]) ** 0.5 * normalized
        for p, w, v in zip(params, by_hand, second):
            torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-12)
            torch.testing.assert_close(opt.state[p]["second_moment"], v, rtol=0, atol=1e-15)


def test_cautious_weight_decay_by_hand():
    """Decay only where the update (what is subtracted) and the weight have the same sign: there the step already
    moves the weight towards 0; elsewhere the decay would undo part of the step. Two steps, 4 x 4."""
    lr, decay = 0.05, 0.5
    (param,) = matrices(((4, 4),), torch.float64)
    w = param.detach().clone()
    opt = Muon([param], lr=lr, weight_decay=decay, momentum=0.0, cautious_weight_decay=True,
               orthogonalize_in=torch.float64)
    masks = []
    for _ in range(2):
        grad = torch.randn(4, 4, dtype=torch.float64)
        step_with([(opt, [param])], [grad])
        update = orthogonalize(grad, dtype=torch.float64)  # momentum 0: the gradient itself
        same_sign = torch.tensor([[float(update[r, c] * w[r, c] >= 0) for c in range(4)] for r in range(4)],
                                 dtype=torch.float64)
        masks.append(same_sign)
        w = w - lr * decay * same_sign * w - lr * update
        torch.testing.assert_close(param.detach(), w, rtol=0, atol=1e-12)
    assert all(0 < m.sum() < 16 for m in masks)  # both cases were there


def test_cautious_weight_decay_without_weight_decay_changes_nothing():
    plain, cautious = matrices(), matrices()
    plain_opt = Muon(plain, orthogonalize_in=torch.float32)
    cautious_opt = Muon(cautious, cautious_weight_decay=True, orthogonalize_in=torch.float32)
    step_with([(plain_opt, plain), (cautious_opt, cautious)], [torch.randn(p.shape) for p in plain])
    assert all(torch.equal(a, b) for a, b in zip(plain, cautious))


def test_the_recipe_keys_reach_muon_and_are_checked():
    model, opt = muon_model(muon_orthogonalizer="polar_express", muon_normalize=True, muon_beta2=0.9,
                            cautious_weight_decay=True)
    assert (opt.muon.orthogonalizer, opt.muon.normalize, opt.muon.beta2, opt.muon.cautious_weight_decay) == \
        ("polar_express", True, 0.9, True)
    assert opt.adamw.param_groups[0]["weight_decay"] == 0.1  # AdamW's groups: plain decoupled decay, as before
    assert CHOICES["train.muon_orthogonalizer"] == tuple(ORTHOGONALIZERS)
    for key, value, message in [("muon_orthogonalizer", "cubic", "train.muon_orthogonalizer"),
                                ("muon_beta2", 1.0, "train.muon_beta2"),
                                ("muon_normalize", "yes", "train.muon_normalize")]:
        cfg = Config()
        setattr(cfg.train, key, value)
        assert message in one_line(ConfigError, validate, cfg, between_keys=False)


# --- the schedule ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lr", [1e-3, 0.0])
def test_the_schedule_scales_muon_groups_to_muon_lr(lr):
    cfg = TrainConfig(optimizer="muon", lr=lr, muon_lr=0.02, warmup_steps=10, max_steps=100)
    model, opt = muon_model(lr=lr, muon_lr=0.02)
    assert set_lr(opt, 1, cfg) == lr_at(1, cfg) == lr / 10  # AdamW's LR, the one logs report
    assert [g["lr"] for g in opt.muon.param_groups] == [0.02 * 1 / 10]  # also with train.lr = 0
    assert [g["lr"] for g in opt.adamw.param_groups] == [lr / 10] * 2
    set_lr(opt, 100, cfg)  # the end of the cosine: both at min_lr_ratio of their peaks
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(0.02 * cfg.min_lr_ratio, rel=1e-12)
    assert opt.adamw.param_groups[0]["lr"] == pytest.approx(lr * cfg.min_lr_ratio, rel=1e-12)


# --- training ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_short_muon_run_lowers_the_loss(char_data):
    trainer = Trainer(tiny_config(char_data, optimizer="muon", max_steps=20), None)
    outs = [trainer.train_step() for _ in range(20)]
    assert outs[-1]["loss"] < outs[0]["loss"] - 0.2, [o["loss"] for o in outs]
    assert outs[0]["lr"] == 1e-3 / 2  # AdamW's LR is logged
    state = trainer.optimizer.state
    assert all(set(state[trainer.raw_model.get_parameter(n)]) == {"momentum_buffer"} for n in BLOCK_MATRICES)
    assert set(state[trainer.raw_model.transformer.wte.weight]) == {"step", "exp_avg", "exp_avg_sq"}


def fp16_scaler_available() -> bool:
    try:
        torch.amp.GradScaler("cpu")
        return True
    except (RuntimeError, AssertionError, TypeError):
        return False


@pytest.mark.skipif(not fp16_scaler_available(), reason="this torch has no CPU GradScaler")
def test_grad_scaler_unscales_steps_and_skips_through_muon_adamw():
    """GradScaler's fp16 path with the composite: scaling by a power of two and unscaling is exact, so the step
    equals an unscaled one bit for bit; an inf gradient skips both optimizers and halves the scale."""
    x = torch.randint(0, 66, (2, 32))

    def scaled_step(opt, model, scaler, poison=False):
        opt.zero_grad()
        _, loss = model(x, x)
        scaler.scale(loss).backward()
        if poison:
            model.transformer.h[0].mlp.c_fc.weight.grad[0, 0] = math.inf
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    plain_model, plain = muon_model()
    scaled_model, scaled = muon_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    for _ in range(2):
        scaled_step(plain, plain_model, torch.amp.GradScaler("cpu", enabled=False))
        scaled_step(scaled, scaled_model, scaler)
    for a, b in zip(plain_model.parameters(), scaled_model.parameters()):
        assert torch.equal(a, b)
    before = [p.detach().clone() for p in scaled_model.parameters()]
    scaled_step(scaled, scaled_model, scaler, poison=True)
    assert all(torch.equal(a, b) for a, b in zip(before, scaled_model.parameters()))
    assert scaler.get_scale() == 2.0 ** 15


# --- checkpoints -------------------------------------------------------------------------------------------
def test_resuming_under_the_other_optimizer_is_one_line(char_data, tmp_path):
    for saved, other in (("adamw", "muon"), ("muon", "adamw")):
        run = tmp_path / saved
        train(tiny_config(char_data, optimizer=saved, max_steps=2, warmup_steps=1), run)
        message = one_line(ConfigError, Trainer, tiny_config(char_data, optimizer=other, max_steps=4), run,
                           resume="auto")
        assert f"train.optimizer changed ({saved} -> {other})" in message
        assert f'set train.optimizer = "{saved}"' in message


@pytest.mark.parametrize("normalize", [False, True], ids=["muon", "normuon"])
def test_a_muon_checkpoint_holds_muon_momentum(char_data, tmp_path, normalize):
    """Muon's momentum under torch's Muon's name; NorMuon's second moment beside it, one per neuron, and it loads
    back (the checkpoint's check of moments against their parameters' shapes lets a neuron statistic through)."""
    cfg = tiny_config(char_data, optimizer="muon", max_steps=2, warmup_steps=1, muon_normalize=normalize)
    train(cfg, tmp_path)
    saved = torch.load(tmp_path / "checkpoints" / "step_00000002" / "state.pt", weights_only=True)["optimizer"]
    assert saved.keys() == {"muon", "adamw"}
    kept = {"momentum_buffer", "second_moment"} if normalize else {"momentum_buffer"}
    assert [set(s) for s in saved["muon"]["state"].values()] == [kept] * len(BLOCK_MATRICES)
    if normalize:  # c_attn (96 x 32), attn.c_proj (32 x 32), c_fc (128 x 32): rows; mlp.c_proj (32 x 128): columns
        shapes = [tuple(s["second_moment"].shape) for s in saved["muon"]["state"].values()]
        assert shapes == [(96, 1), (32, 1), (128, 1), (1, 128)] * 2
    trainer = Trainer(tiny_config(char_data, optimizer="muon", max_steps=3, muon_normalize=normalize), tmp_path,
                      resume="auto")
    try:
        assert trainer.state.step == 2
        assert all(torch.equal(trainer.optimizer.muon.state[p][k], s[k])
                   for p, s in zip(trainer.optimizer.muon.param_groups[0]["params"], saved["muon"]["state"].values())
                   for k in kept)
    finally:
        trainer.close()


def test_a_rollback_restores_muon_momentum(char_data, tmp_path):
    trainer = Trainer(tiny_config(char_data, optimizer="muon"), tmp_path)
    try:
        trainer.train_step(), trainer.train_step()
        trainer.checkpointer.save()
        saved = {p: {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
        trainer.train_step(), trainer.train_step()
        assert trainer.checkpointer.rollback("test") == 2
        state = trainer.optimizer.state
        assert state.keys() == saved.keys()
        for p in saved:
            assert all(torch.equal(state[p][k], saved[p][k]) for k in saved[p])
    finally:
        trainer.close()


# --- memory ------------------------------------------------------------------------------------------------
def test_memory_estimate_counts_one_muon_buffer_per_block_matrix():
    cfg = Config()
    cfg.model = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=300)
    cfg.train.device, cfg.train.dtype, cfg.train.micro_batch = "cpu", "float32", 4
    adamw = estimate_memory(cfg).breakdown["optimizer states"]
    cfg.train.optimizer = "muon"
    muon = estimate_memory(cfg).breakdown["optimizer states"]
    assert muon_parameter_count(cfg.model) == 2 * 12 * 32 * 32
    assert adamw - muon == muon_parameter_count(cfg.model) * 4  # one fp32 buffer instead of two

    # What a real MuonAdamW keeps after a step (AdamW's 0-dim step counters aside).
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = make_optimizer(model, cfg.train, "cpu")
    x = torch.randint(0, 300, (2, 32))
    model(x, x)[1].backward()
    opt.step()
    kept = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    assert muon == kept
    cfg.train.distributed = "fsdp"
    assert estimate_memory(cfg, 4).breakdown["optimizer states"] == math.ceil(muon / 4)
