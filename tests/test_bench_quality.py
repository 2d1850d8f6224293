"""`gpt2train bench quality`: the rows (cumulative, ablated, skipped, refused), the reach arithmetic, and a
tiny real run through the trainer that writes its table, JSON and figure."""

from __future__ import annotations

import copy
import json
import signal

import pytest

from conftest import one_line, run_cli, tiny_config
from gpt2train import cli
from gpt2train.bench import quality, runs
from gpt2train.bench.quality import (
    QualityOptions,
    SeedRun,
    aggregate,
    cell,
    reach,
    run_quality,
    score,
    step_seconds,
)
from gpt2train.bench.recipe import flat, plan_rows
from gpt2train.config import Config, load_config, save_config
from gpt2train.ranges import UsageError
from gpt2train.runconfig import Environment, resolve_run

SKIPPED = ["rotary", "untied head", "zero-init projections", "logit soft cap", "Polar Express", "NorMuon",
           "cautious weight decay", "value embeddings", "U-net skips", "embedding learning rate",
           "AdamW learning rate", "attention-window warmup",
           "multi-token prediction", "batch-size schedule", "weight average"]


def recipe_of(base: Config) -> Config:
    """The base with four of the eight changes: Muon, QK norm, ReLU², WSD schedule (two keys of it)."""
    modern = copy.deepcopy(base)
    modern.train.optimizer, modern.train.muon_lr = "muon", 0.05
    modern.model.qk_norm = True
    modern.model.mlp = "relu2"
    modern.train.schedule, modern.train.decay_fraction = "wsd", 0.4
    return modern


def test_journey_rows_add_one_change_at_a_time_in_order(char_data):
    base = tiny_config(char_data)
    modern = recipe_of(base)
    rows, notes = plan_rows(base, modern)
    assert [r.name for r in rows] == ["GPT-2", "+ Muon", "+ QK norm", "+ ReLU²", "+ WSD schedule"]
    assert [r.slug for r in rows] == ["gpt2", "muon", "qk-norm", "relu2", "wsd"]
    assert flat(rows[0].cfg) == flat(base) and rows[0].changes == {}
    assert rows[1].changes == {"train.optimizer": "muon", "train.muon_lr": 0.05}
    assert rows[2].changes == {**rows[1].changes, "model.qk_norm": True}  # cumulative
    assert rows[3].changes == {**rows[2].changes, "model.mlp": "relu2"}
    assert flat(rows[-1].cfg) == flat(modern)  # the last row is the whole recipe
    assert [n.split(":")[0] for n in notes] == SKIPPED
    assert all("skipped, both configs have the same" in n for n in notes)


def test_recipe_only_rows_are_gpt2_and_the_full_recipe(char_data):
    base = tiny_config(char_data)
    modern = recipe_of(base)
    rows, _ = plan_rows(base, modern, recipe_only=True)
    assert [(r.name, r.slug) for r in rows] == [("GPT-2", "gpt2"), ("full recipe", "recipe")]
    assert flat(rows[1].cfg) == flat(modern)
    with pytest.raises(UsageError, match="--ablate and --recipe-only"):
        run_quality(QualityOptions(ablate=True, recipe_only=True), "unused")


def test_ablation_rows_are_the_recipe_minus_one_change_each(char_data):
    base = tiny_config(char_data)
    modern = recipe_of(base)
    rows, notes = plan_rows(base, modern, ablate=True)
    assert [r.name for r in rows] == ["GPT-2", "full recipe", "- Muon", "- QK norm", "- ReLU²", "- WSD schedule"]
    assert rows[2].slug == "recipe-minus-muon"
    assert flat(rows[1].cfg) == flat(modern)
    minus_muon = rows[2].cfg
    assert (minus_muon.train.optimizer, minus_muon.train.muon_lr) == ("adamw", base.train.muon_lr)
    assert minus_muon.model.qk_norm and minus_muon.model.mlp == "relu2" and minus_muon.train.schedule == "wsd"
    assert set(rows[-1].changes) == {"train.optimizer", "train.muon_lr", "model.qk_norm", "model.mlp"}
    assert [n.split(":")[0] for n in notes] == SKIPPED


def test_a_difference_no_change_covers_is_refused_in_one_line(char_data):
    base = tiny_config(char_data)
    modern = recipe_of(base)
    modern.train.beta1, modern.model.n_layer = 0.8, 3
    message = one_line(UsageError, plan_rows, base, modern)
    assert "model.n_layer, train.beta1" in message and "no change covers" in message
    assert "same config" in one_line(UsageError, plan_rows, base, copy.deepcopy(base))


def test_reach_interpolates_between_the_evals_around_the_crossing():
    tokens, losses = [100, 200, 300], [3.0, 2.0, 1.0]
    assert reach(tokens, losses, 1.5) == 250.0  # halfway from 2.0 down to 1.0
    assert reach(tokens, losses, 1.75) == 225.0
    assert reach(tokens, losses, 2.0) == 200.0  # exactly at an eval
    assert reach(tokens, losses, 1.0) == 300.0
    assert reach(tokens, losses, 3.5) == 100.0  # there at the first eval already
    assert reach(tokens, losses, 0.9) is None  # never
    assert reach([100, 200, 300, 400], [3.0, 1.0, 2.0, 0.5], 1.5) == 175.0  # the first crossing counts


def test_the_first_step_counts_at_the_median_of_the_others():
    records = [{"step": 1, "step_ms": 5000.0, "compile_ms": 5000.0}, {"step": 2, "step_ms": 100.0},
               {"step": 3, "step_ms": 300.0}, {"step": 4, "step_ms": 200.0}]
    assert step_seconds(records) == {1: 0.2, 2: 0.1, 3: 0.3, 4: 0.2}
    assert step_seconds(records[:1]) == {1: 5.0}  # nothing else to compare with


def curve(seed: int, losses: list[float], train_s: list[float], flops_per_token: float = 100.0) -> SeedRun:
    run = SeedRun(seed, f"runs/s{seed}", steps=[1, 2], tokens=[100, 200], val_loss=losses, train_s=train_s,
                  flops_per_token=flops_per_token)
    run.final_val_loss, run.total_tokens, run.total_train_s = losses[-1], 200, train_s[-1]
    return run


def test_score_against_the_gpt2_row_of_the_same_seed_and_aggregate_the_seeds():
    gpt2 = [curve(1, [2.0, 1.5], [1.0, 2.0]), curve(2, [2.0, 1.4], [1.0, 4.0])]
    recipe = [curve(1, [1.7, 1.2], [0.5, 1.0], flops_per_token=110.0), curve(2, [1.5, 1.45], [1.0, 2.0])]
    for run, base in zip(recipe, gpt2):
        score(run, base)
    first, second = recipe
    assert first.target == 1.5 and first.reach_tokens == pytest.approx(140.0)  # 100 + 100 * 0.2 / 0.5
    assert first.reach_s == pytest.approx(0.7)
    assert first.tokens_ratio == pytest.approx(140 / 200) and first.time_ratio == pytest.approx(0.7 / 2.0)
    assert first.flops_ratio == pytest.approx(140 * 110 / (200 * 100))  # 10% more FLOPs per token than GPT-2's row
    assert second.target == 1.4 and second.reach_tokens is None and second.time_ratio is None  # never below 1.45
    summary = aggregate(recipe)
    assert summary["final_val_loss"] == pytest.approx({"mean": 1.325, "min": 1.2, "max": 1.45, "n": 2})
    assert summary["tokens_ratio"] == pytest.approx({"mean": 0.7, "min": 0.7, "max": 0.7, "n": 1})
    assert cell(summary["tokens_ratio"], lambda v: f"{v:.2f}x", 2) == "0.70x, 1/2 seeds"
    assert cell(summary["final_val_loss"], lambda v: f"{v:.3f}", 2) == "1.325 (1.200..1.450)"
    assert cell(None, str, 2) == "not reached"


@pytest.fixture
def pair(char_data, tmp_path):
    """Base and recipe TOML files that differ in the schedule only: two rows."""
    base = tiny_config(char_data, max_steps=6)
    recipe = copy.deepcopy(base)
    recipe.train.schedule = "wsd"
    save_config(base, tmp_path / "base.toml")
    save_config(recipe, tmp_path / "recipe.toml")
    return tmp_path / "base.toml", tmp_path / "recipe.toml"


@pytest.mark.slow
def test_a_tiny_journey_trains_every_row_and_seed_and_writes_md_json_png(pair, tmp_path):
    base, recipe = pair
    options = QualityOptions(config=str(base), modern=str(recipe), seeds=[3, 4], eval_interval=2, val_batches=1)
    result = run_quality(options, tmp_path / "out", progress=False)
    assert [r.name for r in result.rows] == ["GPT-2", "+ WSD schedule"]
    for row in result.rows:
        assert [r.seed for r in row.runs] == [3, 4] and all(r.status == "ok" for r in row.runs)
        for run in row.runs:
            assert run.steps == [2, 4, 6] and run.tokens == [256, 512, 768]  # 4 x 32 tokens per step
            assert 0 < run.train_s[0] < run.train_s[1] < run.train_s[2] == run.total_train_s
            saved = load_config(f"{run.run_dir}/config.toml")  # what the trainer really ran
            assert saved.train.seed == run.seed and saved.train.schedule == ("wsd" if row.slug == "wsd" else "cosine")
            assert saved.eval.interval == 2 and not saved.checkpoint.save_final
    gpt2, wsd = result.rows
    for own, other in zip(gpt2.runs, wsd.runs):  # each seed is scored against GPT-2's run with that seed
        assert own.target == other.target == own.final_val_loss
        assert own.reach_tokens is not None and own.reach_tokens <= own.total_tokens
    assert result.target["row"] == "+ WSD schedule"
    assert result.recipe == {"WSD schedule": {"train.schedule": ["cosine", "wsd"]}}

    out = tmp_path / "out"
    md = (out / "quality.md").read_text()
    assert "| GPT-2 |" in md and "| + WSD schedule |" in md and "seeds: 3, 4" in md
    assert "full recipe reaches GPT-2's loss" in md or "full recipe does not reach" in md
    assert "Muon: skipped" in md and "WSD schedule: train.schedule \"cosine\" -> \"wsd\"" in md
    saved = json.loads((out / "quality.json").read_text())
    curve_of = saved["rows"][1]["runs"][1]
    assert curve_of["seed"] == 4 and curve_of["tokens"] == [256, 512, 768] and len(curve_of["val_loss"]) == 3
    assert (out / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any((out / "runs" / name / "checkpoints").exists() for name in ("gpt2-seed3", "wsd-seed4"))
    message = one_line(UsageError, run_quality, options, out, progress=False)  # never over an earlier bench
    assert "exists already" in message


@pytest.mark.slow
def test_the_command_prints_the_table_and_refuses_what_it_cannot_compare(pair, tmp_path):
    base, recipe = pair
    out = tmp_path / "cli"
    r = run_cli("bench", "quality", "--config", str(base), "--modern", str(recipe), "--ablate", "--steps", "4",
                "--eval-interval", "2", "--val-batches", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert ("| row | final val loss | tokens to GPT-2's loss | x GPT-2 tokens | x GPT-2 FLOPs | time to it | "
            "x GPT-2 time |") in r.stdout
    assert "| GPT-2 |" in r.stdout and "| full recipe |" in r.stdout and "| - WSD schedule |" in r.stdout
    assert "FLOPs (target <= 0.2)" in r.stdout
    assert {p.name for p in out.iterdir()} == {"quality.md", "quality.json", "quality.png", "runs"}
    saved = json.loads((out / "quality.json").read_text())
    assert saved["target"]["row"] == "full recipe"  # with --ablate the recipe is the second row, not the last
    assert {p.name for p in (out / "runs").iterdir()} == {"gpt2-seed1337", "recipe-seed1337",
                                                         "recipe-minus-wsd-seed1337"}

    bad = load_config(recipe)
    bad.train.beta1 = 0.8
    save_config(bad, tmp_path / "bad.toml")
    r = run_cli("bench", "quality", "--config", str(base), "--modern", str(tmp_path / "bad.toml"))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("error: the base and the recipe also differ in train.beta1")


@pytest.mark.parametrize("args, message", [
    (["--seeds", "1,1"], "argument --seeds: '1,1' repeats a seed"),
    (["--seeds", "1,x"], "argument --seeds: 'x' is not an integer"),
    (["--seeds", "1,-2"], "argument --seeds: -2 is out of range"),
    (["--steps", "0"], "argument --steps: 0 is out of range; it must be >= 1"),
    (["--eval-interval", "0"], "argument --eval-interval: 0 is out of range; it must be >= 1"),
    (["--val-batches", "-1"], "argument --val-batches: -1 is out of range; it must be >= 0"),
    (["--device", "tpu"], "argument --device: 'tpu' is not one of auto, cpu, cuda, cuda:N or mps"),
])
def test_arguments_are_checked_before_any_work(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "quality", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and message in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_ablate_with_recipe_only_is_refused_once_by_the_options(tmp_path, monkeypatch, capsys):
    """argparse's mutually exclusive group and run_quality both refused it; QualityOptions alone does now."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "quality", "--ablate", "--recipe-only"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: --ablate and --recipe-only choose different rows: pass one of them"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_row_that_raises_is_reported_failed_and_a_stop_signal_stops_the_bench(pair, tmp_path, monkeypatch):
    base, recipe = pair
    options = QualityOptions(config=str(base), modern=str(recipe), eval_interval=2)

    def diverges(cfg, run_dir, resume=None):
        raise ValueError("guard: loss spike at step 3 and no checkpoint to roll back to\nmore")

    monkeypatch.setattr(runs, "train", diverges)  # bench/runs.py trains every bench's runs
    result = run_quality(options, tmp_path / "failed", progress=False)
    assert [r.runs[0].status for r in result.rows] == ["failed", "failed"]
    assert result.rows[0].runs[0].reason == "ValueError: guard: loss spike at step 3 and no checkpoint to roll back to"
    assert "| GPT-2 | failed |" in result.markdown and "GPT-2, seed 1337: failed: ValueError: guard" in result.markdown
    assert result.target["tokens_ratio"] is None and (tmp_path / "failed" / "quality.png").is_file()

    monkeypatch.setattr(runs, "train", lambda cfg, run_dir, resume=None: {"reason": "signal", "signal": signal.SIGTERM})
    with pytest.raises(KeyboardInterrupt) as stopped:
        run_quality(options, tmp_path / "stopped", progress=False)
    assert stopped.value.signum == signal.SIGTERM  # the command exits 143, as the trainer stopped by it would
    assert not (tmp_path / "stopped" / "quality.md").exists()


def test_the_default_pair_differs_in_the_recipes_keys_alone():
    """Bug: shakespeare-cpu states its shape with the size dial and shakespeare-modern did with n_layer, n_head
    and n_embd; once load_config stopped applying the dial, `bench quality` with its defaults refused the pair
    (they "also differ in model.n_layer, ..."). Both now state it the same way."""
    rows, _ = plan_rows(*quality.load_pair(QualityOptions()), recipe_only=True)
    assert [r.name for r in rows] == ["GPT-2", "full recipe"]
    assert not any(key.startswith("model.") and key.split(".")[1] in ("n_layer", "n_head", "n_embd", "depth")
                   for key in rows[1].changes)



@pytest.mark.slow
def test_each_row_warms_up_for_its_share_of_the_bench_steps():
    """Both presets state warmup as a share of the steps. A row that took the WSD change's keys with equal
    values wrote train.warmup_steps as its default (100), which won over the share: 100 warmup steps in a
    300-step row. Only keys that differ are taken, so every row resolves to its share: GPT-2's 10% until the
    WSD change, the recipe's 3% from it on."""
    for steps, gpt2, recipe in ((0, 30, 9), (40, 4, 1)):
        rows, _ = plan_rows(*quality.load_pair(QualityOptions(steps=steps)))
        wsd = [r.name for r in rows].index("+ WSD schedule")
        warmups = [resolve_run(r.cfg, env=Environment()).config.train.warmup_steps for r in rows]
        assert warmups == [gpt2] * wsd + [recipe] * (len(rows) - wsd)


# --- a suite score as the target (--target suite) ------------------------------------------------------------
def test_a_suite_score_is_reached_from_below():
    gpt2 = curve(1, [2.0, 1.5], [1.0, 2.0])
    gpt2.suite_score, gpt2.final_suite_score = [0.1, 0.3], 0.3
    recipe = curve(1, [1.9, 1.4], [0.5, 1.0])
    recipe.suite_score, recipe.final_suite_score = [0.2, 0.6], 0.6
    score(recipe, gpt2, "suite")
    assert recipe.target == 0.3 and recipe.reach_tokens == pytest.approx(125.0)  # 100 + 100 * 0.1 / 0.4
    assert recipe.reach_s == pytest.approx(0.625) and recipe.tokens_ratio == pytest.approx(125 / 200)
    behind = curve(1, [1.9, 1.4], [0.5, 1.0])
    behind.suite_score, behind.final_suite_score = [0.0, 0.2], 0.2
    score(behind, gpt2, "suite")
    assert behind.reach_tokens is None  # never up to 0.3, though its loss ends below GPT-2's
    score(behind, gpt2)
    assert behind.target == 1.5 and behind.reach_tokens == pytest.approx(180.0)  # the loss target: 1.9 -> 1.4


def test_the_suite_runs_at_each_evaluation_for_its_target_and_not_at_all_otherwise(char_data):
    preset = load_config("gpt2")  # runs the core suite every 2,000 steps as shipped
    assert quality.shared_settings(copy.deepcopy(preset), QualityOptions()).eval.tasks == []
    for cfg in (preset, load_config("shakespeare-cpu")):  # named tasks kept; none named: the core
        ran = quality.shared_settings(copy.deepcopy(cfg), QualityOptions(target="suite")).eval
        assert (ran.tasks, ran.tasks_interval, ran.interval) == (["core"], 0, 25)
    assert one_line(UsageError, QualityOptions, target="hellaswag") == "target 'hellaswag' is not one of val, suite"


@pytest.mark.slow
def test_a_tiny_journey_to_gpt2s_suite_score(gpt2_data, tmp_path):
    base = tiny_config(gpt2_data, max_steps=4)
    recipe = copy.deepcopy(base)
    recipe.train.schedule = "wsd"
    save_config(base, tmp_path / "base.toml")
    save_config(recipe, tmp_path / "recipe.toml")
    options = QualityOptions(config=str(tmp_path / "base.toml"), modern=str(tmp_path / "recipe.toml"), eval_interval=2,
                             val_batches=1, overrides=["eval.tasks_limit=3"], target="suite")
    result = run_quality(options, tmp_path / "out", progress=False)
    gpt2, wsd = (row.runs[0] for row in result.rows)
    for run in (gpt2, wsd):
        logged = [r for r in map(json.loads, open(f"{run.run_dir}/metrics.jsonl")) if r["kind"] == "suite"]
        assert run.status == "ok" and run.steps == [2, 4] == [r["step"] for r in logged]
        assert run.suite_score == [r["centered_mean"] for r in logged] and run.final_suite_score == logged[-1]["centered_mean"]
        assert run.target == gpt2.final_suite_score
        assert run.reach_tokens == reach(run.tokens, [-v for v in run.suite_score], -run.target)
    assert "| row | final val loss | final suite score | tokens to GPT-2's suite score |" in result.table
    assert {line.count("|") for line in result.table.splitlines()} == {10}  # head, rule and rows: 9 columns each
    assert "target: the GPT-2 row's final suite score" in result.markdown and "--target suite" in result.command
    assert ("full recipe reaches GPT-2's suite score" in result.markdown
            or "full recipe does not reach GPT-2's suite score" in result.markdown)
    assert json.loads((tmp_path / "out" / "quality.json").read_text())["target"]["reaches"] == "GPT-2's suite score"
