"""The components that hold state, each with state_dict / load_state_dict, and the Checkpointer that is handed
them by name: it saves and restores a component it has never heard of, and a rollback leaves alone what
moves forward."""

from __future__ import annotations

import math

import torch

from conftest import tiny_config
from gpt2train.checkpoint import ProcessRNG
from gpt2train.mfu_basis import MfuBasis
from gpt2train.runtime import resolve_runtime
from gpt2train.training.checkpointing import RunState
from gpt2train.training.console import Console, LogContinuity
from gpt2train.training.loop import Trainer


class Counter:
    """A component of a kind the Checkpointer does not know."""

    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_run_state_and_its_position_round_trip():
    run = RunState(step=7, tokens=700, best_val=2.5, val_loss=2.75, wall_before=12.0)
    fresh = RunState()
    fresh.load_state_dict(run.state_dict())
    fresh.position.load_state_dict(run.position.state_dict())
    assert (fresh.step, fresh.tokens, fresh.best_val, fresh.val_loss) == (7, 700, 2.5, 2.75)
    assert fresh.wall_before >= 12.0
    # No validation yet: meta.json records null, which loads back as "no best so far".
    assert RunState().state_dict()["best_val_loss"] is None
    none_yet = RunState(best_val=1.0)
    none_yet.load_state_dict(RunState().state_dict())
    assert math.isinf(none_yet.best_val) and none_yet.val_loss is None


def test_process_rng_round_trips_python_numpy_and_torch():
    import random

    import numpy as np

    rng = ProcessRNG()
    saved = rng.state_dict()
    drawn = (random.random(), np.random.rand(), torch.rand(1).item())
    rng.load_state_dict(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == drawn


def test_log_continuity_round_trips_and_an_older_checkpoint_has_none():
    logs = LogContinuity("abc123")
    again = LogContinuity()
    again.load_state_dict(logs.state_dict())
    assert again.wandb_run_id == "abc123"
    again.load_state_dict({})
    assert again.wandb_run_id is None


def test_the_checkpointer_saves_and_restores_a_component_it_does_not_know(char_data, tmp_path):
    cfg = tiny_config(char_data, max_steps=4)
    first = Trainer(cfg, tmp_path / "a")
    try:
        first.train_step()
        first.checkpointer.components["counter"] = Counter(7)
        ckpt = first.checkpointer.save()
    finally:
        first.close()
    assert torch.load(ckpt / "state.pt", weights_only=True)["counter"] == {"n": 7}  # rank 0's, in state.pt

    second = Trainer(cfg, tmp_path / "b")
    try:
        counter = second.checkpointer.components["counter"] = Counter()
        second.checkpointer.resume(str(ckpt))
        assert counter.n == 7 and second.state.step == 1
    finally:
        second.close()


def test_a_rollback_rewinds_the_position_and_leaves_the_rest_moving_forward(char_data, tmp_path):
    trainer = Trainer(tiny_config(char_data, max_steps=6), tmp_path)
    try:
        trainer.train_step()
        counter = trainer.checkpointer.components["counter"] = Counter(1)
        trainer.checkpointer.save()
        trainer.train_step(), trainer.train_step()
        counter.n, trainer.state.best_val = 5, 1.5
        loader_position = trainer.train_loader.state_dict()["rng"]
        assert trainer.checkpointer.rollback("test at step 3") == 1
        assert (trainer.state.step, trainer.state.tokens) == (1, trainer.runtime.tokens_per_step)
        assert counter.n == 5 and trainer.state.best_val == 1.5  # not REWOUND: kept
        assert trainer.train_loader.state_dict()["rng"] == loader_position  # the data is not replayed
    finally:
        trainer.close()


def test_the_console_starts_from_plain_values(char_data, tmp_path, capsys):
    cfg = tiny_config(char_data)
    cfg.model.vocab_size = 66
    runtime = resolve_runtime(cfg, torch.device("cpu"), 1)
    console = Console(cfg, tmp_path, True, torch.device("cpu"))
    console.start(3, runtime, flops_per_token=1e6, basis=MfuBasis(None, "no peak known"),
                  resumed_from="somewhere/step_00000003")
    console.end(3, 0, "done")
    out = capsys.readouterr().out
    assert "resumed from somewhere/step_00000003 at step 3" in out
    # Counted from the config, no model needed: 2 layers of 12 * 32^2 weights + 13 * 32 biases and gains, plus
    # ln_f's 2 * 32 = 25,472, printed as 25.47K.
    assert "(25.47K without embeddings)" in out
