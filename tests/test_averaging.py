"""train.average_last: the weight average against a hand-kept list of weight snapshots, blended into the final
model before the final evaluation (and said so in the log); its state resumes exactly in the middle of the window
and is rewound by a rollback."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from conftest import one_line, tiny_config
from gpt2train.config import ConfigError, load_config
from gpt2train.training.averaging import WeightAverage
from gpt2train.training.loop import Trainer, train
from test_resume import assert_same_tensors, records, stop_with_sigterm_at


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def mean_of(snapshots: list[dict]) -> dict[str, torch.Tensor]:
    return {name: torch.stack([s[name] for s in snapshots]).mean(0) for name in snapshots[0]}


def assert_close(a: dict, b: dict, atol: float = 1e-6):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol)


def moves(model: torch.nn.Module, steps: int, seed: int = 0) -> dict[int, list[torch.Tensor]]:
    """A random move of every weight for each of steps 1 .. steps: a stand-in for training."""
    torch.manual_seed(seed)
    return {step: [torch.randn_like(p) for p in model.parameters()] for step in range(1, steps + 1)}


def steps_of_training(model: torch.nn.Module, average: WeightAverage, moved: dict, steps) -> dict[int, dict]:
    """Move the weights for each step, then hand them to the average as the trainer does; returns the weights
    after each step, before any blend."""
    kept = {}
    for step in steps:
        with torch.no_grad():
            for p, move in zip(model.parameters(), moved[step]):
                p.add_(move)
        kept[step] = snapshot(model)
        average.after_step(step)
    return kept


@pytest.mark.parametrize("blend", [1.0, 0.25])
def test_the_average_is_the_mean_of_the_last_steps_weights_blended_in_after_the_last(blend):
    model = torch.nn.Linear(5, 3)
    average = WeightAverage(model, average_last=0.3, blend=blend, max_steps=10)  # the last 3 steps: 8, 9, 10
    assert average.first == 8
    moved = moves(model, 10)
    kept = steps_of_training(model, average, moved, range(1, 10))
    assert average.count == 2  # after step 9: steps 8 and 9
    assert_close(average.mean, mean_of([kept[8], kept[9]]))
    assert_close(snapshot(model), kept[9], atol=0)  # nothing blended before the last step

    with torch.no_grad():
        for p, move in zip(model.parameters(), moved[10]):
            p.add_(move)
    last = snapshot(model)
    assert average.after_step(10) is True and average.count == 3
    mean = mean_of([kept[8], kept[9], last])
    assert_close(snapshot(model), {k: (1 - blend) * last[k] + blend * mean[k] for k in mean})


def test_off_or_a_window_shorter_than_a_step():
    model = torch.nn.Linear(2, 2)
    off = WeightAverage(model, average_last=0.0, blend=1.0, max_steps=10)
    kept = steps_of_training(model, off, moves(model, 10), range(1, 11))
    assert off.first is None and off.count == 0 and off.state_dict() == {"first": None, "count": 0, "mean": {}}
    assert_close(snapshot(model), kept[10], atol=0)
    one = WeightAverage(model, average_last=0.01, blend=1.0, max_steps=10)  # at least the last step
    kept = steps_of_training(model, one, moves(model, 10, seed=1), range(1, 11))
    assert one.count == 1 and one.first == 10
    assert_close(snapshot(model), kept[10], atol=0)  # the mean of one step is that step's weights


def test_the_state_continues_the_same_mean_and_a_moved_window_starts_again():
    model = torch.nn.Linear(4, 4)
    start, moved = copy.deepcopy(model), moves(model, 8)
    steps_of_training(model, WeightAverage(model, 0.5, 1.0, max_steps=8), moved, range(1, 9))  # steps 5..8

    stopped = copy.deepcopy(start)
    first = WeightAverage(stopped, 0.5, 1.0, max_steps=8)
    steps_of_training(stopped, first, moved, range(1, 7))  # stopped after step 6, in the window
    state = first.state_dict()
    assert state["count"] == 2 and state["first"] == 5
    resumed = WeightAverage(stopped, 0.5, 1.0, max_steps=8)
    resumed.load_state_dict(state)
    steps_of_training(stopped, resumed, moved, (7, 8))
    assert_close(snapshot(stopped), snapshot(model), atol=0)  # bit for bit

    longer = WeightAverage(torch.nn.Linear(4, 4), 0.5, 1.0, max_steps=12)  # resumed with more steps: 7..12
    longer.load_state_dict(state)
    assert longer.count == 0 and longer.mean == {}


def test_the_keys_are_checked_in_one_line():
    assert "train.average_last = 1.5 is out of range" in one_line(ConfigError, load_config, None, ["train.average_last=1.5"])
    assert "it must be in (0, 1]" in one_line(ConfigError, load_config, None, ["train.average_blend=0"])


# --- in the trainer -------------------------------------------------------------------------------------

def averaged_config(char_data, **train):
    cfg = tiny_config(char_data, max_steps=6, average_last=0.5, **train)  # steps 4, 5, 6
    cfg.eval.interval = 0  # validation at the end only: the averaged model's
    cfg.checkpoint.save_best = False
    return cfg


def test_the_final_model_and_its_val_loss_are_the_averages(char_data, tmp_path, capsys):
    cfg = averaged_config(char_data)
    cfg.checkpoint.every_steps, cfg.checkpoint.save_final = 5, False
    trainer = Trainer(cfg, tmp_path / "run")
    kept, train_step = {}, trainer.train_step

    def kept_step():
        out = train_step()
        kept[trainer.state.step] = snapshot(trainer.raw_model)
        return out

    trainer.train_step = kept_step
    out = trainer.fit()
    assert_close(snapshot(trainer.raw_model), mean_of([kept[4], kept[5], kept[6]]))
    assert out["val_loss"] == trainer.evaluate()  # the final evaluation measured the averaged model
    assert [(r["step"], r["steps"], r["blend"]) for r in records(tmp_path / "run", "average")] == [(6, 3, 1.0)]
    assert "the average of the last 3 steps' weights replaced the weights" in capsys.readouterr().out

    # A rollback rewinds the average with the weights: to step 5's checkpoint, holding steps 4 and 5.
    assert trainer.checkpointer.rollback("a test") == 5
    assert trainer.average.count == 2
    assert_close(trainer.average.mean, mean_of([kept[4], kept[5]]))
    assert_close(snapshot(trainer.raw_model), kept[5], atol=0)


def test_a_run_stopped_inside_the_window_resumes_to_the_same_average(char_data, tmp_path):
    straight = train(averaged_config(char_data), tmp_path / "straight")
    trainer = Trainer(averaged_config(char_data), tmp_path / "resumed")
    stop_with_sigterm_at(trainer, 5)  # steps 4 and 5 averaged, 6 to come
    assert trainer.fit()["step"] == 5
    saved = torch.load(tmp_path / "resumed" / "checkpoints" / "step_00000005" / "state.pt", weights_only=True)
    assert saved["average"]["count"] == 2 and saved["average"]["mean"].keys() == dict(trainer.raw_model.named_parameters()).keys()
    resumed = train(averaged_config(char_data), tmp_path / "resumed", resume="auto")
    assert resumed["val_loss"] == straight["val_loss"]
    final = "checkpoints/step_00000006/model.safetensors"
    assert_same_tensors(load_file(tmp_path / "resumed" / final), load_file(tmp_path / "straight" / final))
