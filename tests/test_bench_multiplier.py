"""The compute multiplier (`gpt2train bench multiplier`): the inverse of the fitted law, the multiplier of a
candidate whose ladder is the base's with its compute scaled by a known factor, the rows of each form, and a
real bench of two tiny recipes that continues where it stopped and shares its ladders between forms."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from gpt2train.bench import multiplier
from gpt2train.bench.multiplier import MultiplierOptions, compare, compute_to_reach, plan, run_multiplier
from gpt2train.bench.scaling import Fit, Rung, fit_power_law
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


def test_bench_multiplier_cli_says_what_to_fix_in_one_line(tmp_path):
    r = run_cli("bench", "multiplier", "--ablate", "--journey")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
    r = run_cli("bench", "multiplier", "--base", "ladder-gpt2", "--candidate", "ladder-2024",
                "--set", f"data.dir={tmp_path / 'none'}", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "holds no prepared data; make the ladder's corpus first" in r.stderr
