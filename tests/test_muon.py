"""train.optimizer = "muon": Muon for the blocks' weight matrices, AdamW for the rest, stepped as one optimizer
by the trainer, the LR schedule, the grad scaler, checkpoints and the memory estimator."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import one_line, tiny_config
from gpt2train.config import Config, ConfigError, TrainConfig
from gpt2train.memory import estimate_memory
from gpt2train.model import GPT, GPTConfig
from gpt2train.training import optim
from gpt2train.training.loop import Trainer, train
from gpt2train.training.optim import (
    TORCH_NEWTON_SCHULZ,
    MuonAdamW,
    lr_at,
    make_optimizer,
    muon_parameter_count,
    newton_schulz,
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
    assert [g["weight_decay"] for g in adamw] == [0.1, 0.0] and adamw[0]["lr"] == 6e-4 and adamw[0]["foreach"]
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


def test_torchs_muon_still_calls_the_orthogonalization_we_swap(monkeypatch):
    """optim swaps torch's private torch.optim._muon._zeropower_via_newtonschulz for an fp32 one where bf16 is
    emulated. If a torch upgrade renames it or stops looking it up there, this fails and says so (instead of the
    swap silently doing nothing)."""
    assert TORCH_NEWTON_SCHULZ is not None, \
        "torch.optim._muon._zeropower_via_newtonschulz is gone: update gpt2train.training.optim.orthogonalization_in"
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return TORCH_NEWTON_SCHULZ(*args, **kwargs)

    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", counting)
    weight = torch.nn.Parameter(torch.randn(8, 4))
    weight.grad = torch.randn(8, 4)
    torch.optim.Muon([weight], lr=0.01).step()
    assert calls, "torch's Muon no longer calls _zeropower_via_newtonschulz: update gpt2train.training.optim"


# --- where bf16 is emulated: the orthogonalization in fp32 ------------------------------------------------
def test_newton_schulz_in_any_dtype_is_torchs_iteration():
    """The same iteration as torch's: in bf16 it gives torch's update up to bf16 rounding (torch fuses the
    multiply-adds into addmm); in fp32 it agrees with float64 to fp32 rounding. Wide and tall matrices."""
    torch.manual_seed(0)
    for shape in [(32, 96), (128, 32)]:
        grad = torch.randn(shape)
        ours = newton_schulz(torch.bfloat16)(grad, (3.4445, -4.775, 2.0315), 5, 1e-7)
        theirs = TORCH_NEWTON_SCHULZ(grad, (3.4445, -4.775, 2.0315), 5, 1e-7)
        # elements are about 0.06 in size; the two bf16 roundings differ by up to 0.022 here
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=0.03)
        fp32 = newton_schulz(torch.float32)(grad, (3.4445, -4.775, 2.0315), 5, 1e-7)
        torch.testing.assert_close(fp32, theirs.float(), rtol=0, atol=0.015)  # fp32 is off bf16 by 0.011 at most
        fp64 = newton_schulz(torch.float64)(grad.double(), (3.4445, -4.775, 2.0315), 5, 1e-7)
        assert fp32.dtype == torch.float32 and fp32.shape == shape
        torch.testing.assert_close(fp32.double(), fp64, rtol=0, atol=1e-5)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_a_cpu_that_emulates_bf16_orthogonalizes_in_fp32(monkeypatch, native_bf16):
    """make_optimizer picks fp32 where oneDNN has no bf16 (emulated bf16 made a modern-recipe step 1.9x slower on
    an AVX2 CPU); a step then equals torch's Muon running newton_schulz(fp32), differs from its bf16 step, and
    leaves torch's own function in place."""
    monkeypatch.setattr(optim, "cpu_has_native_bf16", lambda: native_bf16)
    model, opt = muon_model()
    assert opt.orthogonalize_in == (None if native_bf16 else torch.float32)
    if native_bf16:
        return
    x = torch.randint(0, 66, (2, 32))

    def one_step(model, opt):
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        return [p.detach().clone() for p in model.parameters()]

    fp32_step = one_step(model, opt)
    assert torch.optim._muon._zeropower_via_newtonschulz is TORCH_NEWTON_SCHULZ
    stock_model, stock = muon_model()
    stock.orthogonalize_in = None
    bf16_step = one_step(stock_model, stock)
    by_hand_model, by_hand = muon_model()
    by_hand.orthogonalize_in = None
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", newton_schulz(torch.float32))
    by_hand_step = one_step(by_hand_model, by_hand)
    assert all(torch.equal(a, b) for a, b in zip(fp32_step, by_hand_step))
    assert not all(torch.equal(a, b) for a, b in zip(fp32_step, bf16_step))


def test_an_orthogonalization_put_there_by_someone_else_stays(monkeypatch):
    """A test's float64 iteration (the DDP/FSDP comparisons put one there) is not replaced by the fp32 one."""
    float64 = newton_schulz(torch.float64)
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", float64)
    called = []
    with optim.orthogonalization_in(torch.float32):
        called.append(torch.optim._muon._zeropower_via_newtonschulz)
    assert called == [float64] and torch.optim._muon._zeropower_via_newtonschulz is float64


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


def test_a_muon_checkpoint_holds_muon_momentum(char_data, tmp_path):
    train(tiny_config(char_data, optimizer="muon", max_steps=2, warmup_steps=1), tmp_path)
    saved = torch.load(tmp_path / "checkpoints" / "step_00000002" / "state.pt", weights_only=True)["optimizer"]
    assert saved.keys() == {"muon", "adamw"}
    assert [set(s) for s in saved["muon"]["state"].values()] == [{"momentum_buffer"}] * len(BLOCK_MATRICES)


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
