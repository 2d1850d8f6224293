"""The compute multiplier (`gpt2train bench multiplier`): the inverse of the fitted law, the multiplier of a
candidate whose ladder is the base's with its compute scaled by a known factor, the rows of each form, and a
real bench of two tiny recipes that continues where it stopped and shares its ladders between forms; the suite
score as the target: read off the rungs rising to it, no multiplier where the scores do not rise, and the suite
run in every row for it and in none otherwise."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from conftest import one_line, run_cli
from gpt2train.bench import multiplier
from gpt2train.bench.multiplier import (
    TARGETS,
    MultiplierOptions,
    SuiteScore,
    compare,
    compare_scores,
    compute_to_reach,
    plan,
    reach_score,
    run_multiplier,
)
from gpt2train.bench.scaling import Fit, Rung, fit_power_law
from gpt2train.eval.suite import CORE
from gpt2train.ranges import UsageError
from test_scaling import ladder_config


def law(E, A, alpha):
    return Fit("compute", E, A, alpha, 0.0)


def test_compute_to_reach_inverts_the_law_and_says_when_it_never_gets_there():
    fit = law(1.5, 300.0, 0.3)
    for c in (1e9, 3.3e11, 7e13):
        assert compute_to_reach(fit, fit(c)) == pytest.approx(c, rel=1e-12)
    assert compute_to_reach(fit, 1.5) is None and compute_to_reach(fit, 1.2) is None


def ladder(name, fit, flops, seconds_per_flop, scale=1.0):
    """A ladder on `fit` whose rungs spend `flops` but reach the loss the law gives at flops x scale."""
    rungs = [Rung(depth=d, seed=1, width=8, heads=1, params=1, tokens=1, batch_tokens=1, steps=1, lr=0.1, flops=c,
                  val_loss=fit(c * scale), wall_s=c * seconds_per_flop) for d, c in enumerate(flops, 1)]
    losses = [r.val_loss for r in rungs]
    return {"name": name, "rungs": rungs, "fit": fit_power_law(flops, losses),
            "time_fit": fit_power_law([r.wall_s for r in rungs], losses, "seconds")}


def test_a_candidate_that_gets_the_base_loss_with_a_third_of_the_compute_is_a_3x_multiplier():
    """The candidate's loss at C is the base's at 3C: 3x in compute; at twice the seconds per FLOP, 1.5x in time."""
    fit = law(1.2, 900.0, 0.25)
    flops = [1e10, 4e10, 1.6e11, 6.4e11]
    base = ladder("base", fit, flops, 1e-9)
    candidate = ladder("candidate", fit, [c / 2 for c in flops], 2e-9, scale=3.0)
    c = compare(base, candidate, seed=1)
    assert c.target_loss == pytest.approx(fit(6.4e11)) and c.reference_flops == 6.4e11
    assert c.flops_multiplier == pytest.approx(3.0, rel=1e-3)
    assert c.time_multiplier == pytest.approx(1.5, rel=1e-3)
    assert c.interpolated  # 6.4e11 / 3 lies within the candidate's rungs (5e9 .. 3.2e11)
    worse = compare(base, ladder("worse", fit, flops, 1e-9, scale=0.25), seed=1)
    assert worse.flops_multiplier == pytest.approx(0.25, rel=1e-3) and not worse.interpolated  # beyond its rungs


def test_read_off_the_rungs_a_pure_power_law_gives_the_exact_multiplier_and_says_when_it_extends_them():
    """With E = 0 the law is a straight line in log-log, so straight lines between the rungs are exact."""
    fit = law(0.0, 50.0, 0.1)
    flops = [1e10, 4e10, 1.6e11]
    base = ladder("base", fit, flops, 1e-9)
    c = compare(base, ladder("candidate", fit, flops, 1e-9, scale=2.0), seed=1)
    assert c.between_multiplier == pytest.approx(2.0, rel=1e-9) and c.between_rungs
    assert c.between_time_multiplier == pytest.approx(2.0, rel=1e-9)
    far = compare(base, ladder("far", fit, flops, 1e-9, scale=100.0), seed=1)  # below the base's best on every rung
    assert far.between_multiplier == pytest.approx(100.0, rel=1e-9) and not far.between_rungs
    assert multiplier.between_rungs([1.0, 10.0, 100.0], [4.0, 2.0, 1.0], 2.0) == (pytest.approx(10.0), True)
    assert multiplier.between_rungs([1.0, 10.0], [4.0, 2.0], 8.0) == (pytest.approx(0.1), False)  # before the first


def two_recipes(tmp_path, data):
    base = ladder_config(tmp_path, data)
    text = open(base).read().replace("[model]\n", '[model]\nmlp = "relu2"\nqk_norm = true\n')
    candidate = tmp_path / "candidate.toml"
    candidate.write_text(text)
    return base, str(candidate)


def test_each_form_compares_the_rows_it_should(char_data, tmp_path):
    base, candidate = two_recipes(tmp_path, char_data)
    rows, pairs, _ = plan(MultiplierOptions(base=base, candidate=candidate, form="pair"))
    assert [r.name for r in rows] == [base, candidate] and pairs == [(0, 1)]
    rows, pairs, _ = plan(MultiplierOptions(base=base, candidate=candidate, form="journey"))
    assert [r.name for r in rows] == [base, "+ QK norm", "+ ReLU²"] and pairs == [(0, 1), (1, 2)]
    rows, pairs, _ = plan(MultiplierOptions(base=base, candidate=candidate, form="ablate"))
    assert [r.name for r in rows] == [candidate, "- QK norm", "- ReLU²"] and pairs == [(1, 0), (2, 0)]
    assert rows[1].cfg.model.qk_norm is False and rows[1].cfg.model.mlp == "relu2"
    with pytest.raises(UsageError, match="at least three distinct depths"):
        MultiplierOptions(depths=[1, 2, 2])
    with pytest.raises(UsageError, match="form 'both'"):
        MultiplierOptions(form="both")


@pytest.mark.slow
def test_a_bench_of_two_tiny_recipes_continues_and_shares_its_ladders(char_data, tmp_path, monkeypatch):
    base, candidate = two_recipes(tmp_path, char_data)
    options = MultiplierOptions(base=base, candidate=candidate, depths=[1, 2, 3], seeds=[1, 2])
    out = tmp_path / "out"
    result = run_multiplier(options, out, progress=False)
    for name in ("multiplier.json", "multiplier.md", "multiplier.png"):
        assert (out / name).is_file()
    (comparison,) = result["comparisons"]
    assert [s["seed"] for s in comparison["seeds"]] == [1, 2]
    for s in comparison["seeds"]:  # each seed's multiplier is the base's compute over the candidate's fit's
        row = result["rows"][1]["ladders"][[1, 2].index(s["seed"])]
        fit = Fit(**row["fit"])
        top = max(result["rows"][0]["ladders"][[1, 2].index(s["seed"])]["rungs"], key=lambda r: r["flops"])
        assert s["target_loss"] == top["val_loss"] and s["reference_flops"] == top["flops"]
        if s["candidate_flops"] is not None:
            assert fit(s["candidate_flops"]) == pytest.approx(top["val_loss"], rel=1e-9)
            assert s["flops_multiplier"] == pytest.approx(top["flops"] / s["candidate_flops"])
    assert all(s["between_multiplier"] == pytest.approx(s["reference_flops"] / s["between_flops"])
               for s in comparison["seeds"])
    worst = max(ladder["fit"]["rms_log_error"] for row in result["rows"] for ladder in row["ladders"])
    assert ("does not follow its fitted law" in result["law"]) == (worst > 0.01)
    assert result["law"] in result["markdown"]
    assert f"| {candidate} | {base} |" in result["markdown"]
    assert json.loads((out / "multiplier.json").read_text())["comparisons"] == result["comparisons"]

    trained = []
    real = multiplier.train_rung
    monkeypatch.setattr(multiplier, "train_rung", lambda run, rung, run_dir: trained.append(run_dir) or real(run, rung, run_dir))
    again = run_multiplier(options, out, progress=False)
    assert trained == [] and again["comparisons"] == result["comparisons"]  # every rung read back
    ablation = run_multiplier(MultiplierOptions(base=base, candidate=candidate, form="ablate", depths=[1, 2, 3],
                                                seeds=[1]), out, progress=False)
    # The candidate's ladder (the full recipe's) was read; only the two rows without a change trained.
    assert len(trained) == 2 * 3 and all("-minus-" in str(d) for d in trained)
    assert [c["reference"] for c in ablation["comparisons"]] == ["- QK norm", "- ReLU²"]


@pytest.mark.slow
def test_bench_multiplier_cli_says_what_to_fix_in_one_line(tmp_path):
    r = run_cli("bench", "multiplier", "--ablate", "--journey")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
    r = run_cli("bench", "multiplier", "--base", "ladder-gpt2", "--candidate", "ladder-2024",
                "--set", f"data.dir={tmp_path / 'none'}", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "holds no prepared data; make the ladder's corpus first" in r.stderr


# --- a suite score as the target (--target suite) ------------------------------------------------------------
def score_ladder(name, flops, scores, seconds_per_flop=1e-9, stderr=0.0):
    """Rungs at `flops` with these suite scores; each rung's wall time holds 5 s of suite beside its training."""
    rungs = [Rung(depth=d, seed=1, width=8, heads=1, params=1, tokens=1, batch_tokens=1, steps=1, lr=0.1, flops=c,
                  val_loss=1.0, wall_s=c * seconds_per_flop + 5.0) for d, c in enumerate(flops, 1)]
    return {"name": name, "rungs": rungs, "suite": [SuiteScore(s, stderr, 5.0, {}) for s in scores]}


FLOPS = [1e10, 1e11, 1e12]


def on_line(scale):
    """Scores straight in log compute, the base's at scale x the compute: 0.0, 0.1, 0.2 at scale 1."""
    return [0.1 * math.log10(c * scale) - 1.0 for c in FLOPS]


def test_a_score_is_read_off_straight_lines_in_log_compute_rising_to_it():
    assert reach_score(FLOPS, [0.0, 0.1, 0.2], 0.15) == (pytest.approx(10 ** 11.5), True)
    assert reach_score(FLOPS, [0.0, 0.3, 0.1], 0.2) == (pytest.approx(10 ** (10 + 2 / 3)), True)  # the first rise to it
    assert reach_score(FLOPS, [0.0, 0.1, 0.2], 0.3) == (pytest.approx(1e13), False)  # the last segment extended up
    assert reach_score(FLOPS, [0.2, 0.3, 0.4], 0.1) == (pytest.approx(1e9), False)  # the first one, back
    assert reach_score(FLOPS, [0.2, 0.1, 0.3], 0.2) == (pytest.approx(1e10), True)  # there at the smallest rung
    # Higher is better: a falling curve never rises to a score it starts above, nor a flat one to one above it.
    assert reach_score(FLOPS, [0.3, 0.2, 0.1], 0.15) == (None, False)
    assert reach_score(FLOPS, [0.0, 0.1, 0.1], 0.2) == (None, False)
    assert reach_score(FLOPS, [0.0, (-0.2 - 0.1) / 2, -0.15], 0.2) == (None, False)  # flat but for rounding


def test_a_candidate_that_gets_the_base_score_with_a_third_of_the_compute_is_a_3x_multiplier():
    """The candidate's score at C is the base's at 3C: 3x in compute; at twice the seconds per FLOP, 1.5x in time,
    with each rung's 5 s of suite left out of both."""
    base = score_ladder("base", FLOPS, on_line(1))
    c = compare_scores(base, score_ladder("candidate", FLOPS, on_line(3), seconds_per_flop=2e-9), seed=1)
    assert c.target_score == pytest.approx(0.2) and c.reference_flops == 1e12 and c.reference_s == pytest.approx(1000)
    assert c.between_multiplier == pytest.approx(3.0) and c.between_rungs and not c.reason
    assert c.between_time_multiplier == pytest.approx(1.5)
    ahead = compare_scores(base, score_ladder("ahead", FLOPS, on_line(300)), seed=1)  # above the target on every rung
    assert ahead.between_multiplier == pytest.approx(300.0) and not ahead.between_rungs
    behind = compare_scores(base, score_ladder("behind", FLOPS, on_line(0.01)), seed=1)  # below it on every rung
    assert behind.between_multiplier == pytest.approx(0.01) and not behind.between_rungs


def test_scores_that_do_not_rise_give_no_multiplier_and_say_why():
    good = score_ladder("candidate", FLOPS, on_line(3))
    # At chance: flat, noise, or equal but for the rounding of a mean (the first a hair below -0.15 in floats).
    for scores in ([0.0, 0.0, 0.0], [0.01, -0.01, 0.02], [(-0.2 - 0.1) / 2, -0.15, 0.1]):
        c = compare_scores(score_ladder("base", FLOPS, scores), good, seed=1)
        assert c.between_multiplier is None and c.between_time_multiplier is None
        assert c.reason.startswith("base's suite scores do not rise with compute (")
        assert c.reason.endswith("smallest rung first): no target to read a multiplier at")
    noisy = compare_scores(score_ladder("base", FLOPS, [0.0, 0.01, 0.02], stderr=0.03), good, seed=1)
    assert noisy.between_multiplier is None
    assert "rise by 0.0200 over its rungs (0.0000, 0.0100, 0.0200), within 2 standard errors (0.0849)" in noisy.reason
    base = score_ladder("base", FLOPS, on_line(1))
    flat = compare_scores(base, score_ladder("flat", FLOPS, [0.0, 0.1, 0.1]), seed=1)
    assert flat.between_multiplier is None and flat.reason == (
        "flat's suite scores (0.0000, 0.1000, 0.1000, smallest rung first) stay below the target and do not rise at its "
        "largest rung: where it reaches 0.2000 is not measured")
    falling = compare_scores(base, score_ladder("falling", FLOPS, [0.5, 0.4, 0.3]), seed=1)
    assert falling.between_multiplier is None
    assert "are above the target at its smallest rung and do not rise from there" in falling.reason


def test_a_scores_standard_error_is_each_tasks_binomial_centered_and_averaged():
    one = {"copa": {"acc": 0.6, "centered": 0.2, "n": 100}}  # chance 0.5
    assert multiplier.suite_stderr(one) == pytest.approx(math.sqrt(0.6 * 0.4 / 100) / 0.5)
    two = one | {"arc_easy": {"acc": 0.25, "centered": 0.0, "n": 48}}  # chance 0.25
    expected = math.sqrt(0.6 * 0.4 / 100 / 0.5 ** 2 + 0.25 * 0.75 / 48 / 0.75 ** 2) / 2
    assert multiplier.suite_stderr(two) == pytest.approx(expected)


def test_the_suite_target_says_so_in_the_json_and_the_markdown(tmp_path):
    """run_multiplier's result from synthetic ladders: the target, each rung's score, the multipliers and why one
    is missing."""
    options = MultiplierOptions(target="suite", suite_tasks="copa", depths=[1, 2, 3], seeds=[1, 2])
    ladders = {1: (score_ladder("base", FLOPS, on_line(1)), score_ladder("cand", FLOPS, on_line(3))),
               2: (score_ladder("base", FLOPS, [0.0, 0.0, 0.0]), score_ladder("cand", FLOPS, on_line(3)))}
    per_seed = [compare_scores(*ladders[s], seed=s) for s in (1, 2)]
    comparison = multiplier.score_comparison("base", "cand", per_seed)
    assert comparison["between_multiplier"] == {"mean": pytest.approx(3.0), "min": pytest.approx(3.0),
                                                "max": pytest.approx(3.0), "n": 1, "of": 2}
    assert comparison["reasons"] == ["seed 2: base's suite scores do not rise with compute (0.0000, 0.0000, 0.0000, "
                                     "smallest rung first): no target to read a multiplier at"]
    fit = Fit("compute", 0.0, 1.0, 0.1, 0.0)
    result = {"options": dataclasses.asdict(options), "data": "data/x", "floor": {"value": 0.0, "from": "none"},
              "law": "a law line", "notes": [], "comparisons": [comparison],
              "target": multiplier.target_description(options, ["copa"]),
              "rows": [{"name": name, "ladders": [{"seed": s, "rungs": [dataclasses.asdict(r) for r in lad["rungs"]],
                                                   "fit": dataclasses.asdict(fit),
                                                   "suite": [dataclasses.asdict(x) for x in lad["suite"]]}
                                                  for s, lad in ((s, ladders[s][k]) for s in (1, 2))]}
                       for k, name in enumerate(("base", "cand"))]}
    assert result["target"] == {"name": "suite", "measure": TARGETS["suite"], "tasks": ["copa"], "limit": 200,
                                "read": "off the candidate's rungs only, straight lines in (log compute, score): no "
                                        "law is fitted to scores"}
    text = multiplier.multiplier_markdown(result)
    assert "target: the base's suite score (centered mean) on its largest rung" in text
    assert "Suite scores (centered mean over copa; at most 200 examples each)" in text
    assert "| base | 1 | 0.0000 ± 0.0000 | 0.1000 ± 0.0000 | 0.2000 ± 0.0000 |" in text
    assert "| cand | base | 0.1000 | 3.00x (1 of 2 seeds) | 3.00x (1 of 2 seeds) |" in text  # 0.1: the seeds' mean target
    assert "no law is fitted to scores" in text and f"- cand over base, {comparison['reasons'][0]}" in text
    assert multiplier.multiplier_summary(result) == (
        "cand over base (suite score): 3.00x (1 of 2 seeds) compute, 3.00x (1 of 2 seeds) time (its rungs) "
        f"(1 seed without: {comparison['reasons'][0]})")
    multiplier.plot(result, tmp_path / "m.png")
    assert (tmp_path / "m.png").is_file()


def test_the_suite_runs_in_every_row_for_its_target_and_in_none_otherwise(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text(open(ladder_config(tmp_path, "data/x")).read().replace("[eval]\n", '[eval]\ntasks = ["core"]\n'))
    candidate = tmp_path / "candidate.toml"
    candidate.write_text(base.read_text().replace("[model]\n", "[model]\nqk_norm = true\n"))
    rows, _, _ = plan(MultiplierOptions(base=str(base), candidate=str(candidate)))
    assert [row.cfg.eval.tasks for row in rows] == [[], []]
    rows, _, _ = plan(MultiplierOptions(base=str(base), candidate=str(candidate), target="suite", suite_limit=7))
    assert {(tuple(r.cfg.eval.tasks), r.cfg.eval.tasks_interval, r.cfg.eval.tasks_limit) for r in rows} == {
        (tuple(CORE), 0, 7)}  # the base's own tasks, named one by one
    rows, _, _ = plan(MultiplierOptions(base=str(base), candidate=str(candidate), target="suite", suite_tasks="copa"))
    assert [row.cfg.eval.tasks for row in rows] == [["copa"], ["copa"]]
    assert one_line(UsageError, MultiplierOptions, target="hellaswag") == "target 'hellaswag' is not one of val, suite"
    assert one_line(UsageError, MultiplierOptions, suite_tasks="copa").startswith("--suite-tasks names the suite's tasks")
    assert one_line(UsageError, MultiplierOptions, target="suite", suite_tasks="copa,nope").startswith(
        "unknown suite task 'nope'")


def test_a_suite_target_on_data_it_cannot_read_is_refused_before_any_rung_trains(char_data, tmp_path):
    base, candidate = two_recipes(tmp_path, char_data)
    options = MultiplierOptions(base=base, candidate=candidate, depths=[1, 2, 3], seeds=[1], target="suite",
                                suite_tasks="copa")
    assert one_line(UsageError, run_multiplier, options, tmp_path / "out", progress=False) == (
        f"--target suite needs data whose tokenizer encodes any text (gpt2, or a byte-level bpe); {char_data} uses "
        "'char'")
    assert not (tmp_path / "out").exists()


def test_a_rungs_suite_score_and_seconds_are_read_from_its_log(tmp_path):
    tasks = {"copa": {"acc": 0.5, "centered": 0.0, "n": 10}}
    records = [{"kind": "val", "time": 100.0, "step": 4, "tokens": 8, "val_loss": 2.0},
               {"kind": "suite", "time": 103.5, "step": 4, "tokens": 8, "centered_mean": 0.25, "tasks": tasks},
               {"kind": "val", "time": 200.0, "step": 8, "tokens": 16, "val_loss": 1.5},
               {"kind": "suite", "time": 201.5, "step": 8, "tokens": 16, "centered_mean": 0.5, "tasks": tasks}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    score = multiplier.read_suite(tmp_path, 8)
    assert (score.centered_mean, score.seconds, score.tasks) == (0.5, 5.0, tasks)
    assert score.stderr == pytest.approx(math.sqrt(0.25 / 10) / 0.5)
    message = one_line(ValueError, multiplier.read_suite, tmp_path, 12)
    assert message.startswith(f"{tmp_path} holds no suite score at step 12: the suite was skipped")
