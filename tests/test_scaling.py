"""The size dial (sizing.py) and the scaling ladder (`gpt2train bench scaling`): the rules on known shapes,
explicit keys winning, plan and config show explaining, the power-law fit, the ladder's refusals, and an
interrupted ladder that continues to the same numbers."""

from __future__ import annotations

import json
import math
import os
import signal

import numpy as np
import pytest

from conftest import one_line, run_cli
from gpt2train.bench import scaling
from gpt2train.bench.scaling import ScalingOptions, fit_power_law, run_ladder
from gpt2train.config import ConfigError, load_config
from gpt2train.data.markov import Chain, loss_floor, prepare_markov
from gpt2train.ranges import UsageError
from gpt2train.runconfig import Environment, resolve_run
from gpt2train.sizing import SpeedNeeded, batch_tokens_for, format_derived
from gpt2train.training.loop import Trainer


def derived(run) -> dict:
    return {d.key: d for d in run.dial}


def dial(config, overrides, world_size: int = 1):
    return resolve_run(config, overrides, Environment(world_size=world_size))


# --- the dial ------------------------------------------------------------------------------------------

def test_depth_12_is_gpt2_124m_with_its_learning_rate():
    run = dial(None, ["model.depth=12"])
    m, t = run.config.model, run.config.train
    assert (m.n_layer, m.n_embd, m.n_head) == (12, 768, 12)  # GPT-2 124M's shape
    assert t.lr == pytest.approx(6e-4)
    # 20 x 85,056,000 non-embedding parameters; 2^19 x (1.70e9 / 1e10)^0.4 = 258,263 -> 32 micro-batches of 8 x 1024
    tokens = 20 * 85_056_000
    assert t.total_batch_tokens == 32 * 8 * 1024 == 2 ** 18  # modded-nanogpt's batch for this model
    assert t.max_steps == math.ceil(tokens / 2 ** 18) == 6490
    assert t.warmup_steps == round(0.05 * 6490)
    assert derived(run)["tokens"].value == tokens


def test_rules_scale_with_width_and_budget():
    small, big = dial(None, ["model.depth=6"]).config, dial(None, ["model.depth=24"]).config
    assert (small.model.n_embd, small.model.n_head, big.model.n_embd, big.model.n_head) == (384, 6, 1536, 24)
    assert small.train.lr == pytest.approx(2 * 6e-4) and big.train.lr == pytest.approx(6e-4 / 2)  # 1 / width
    assert small.train.total_batch_tokens < big.train.total_batch_tokens
    flops = dial(None, ["model.depth=6", "train.flops_budget=1e17"])
    n = 6 * (12 * 384 ** 2 + 13 * 384) + 2 * 384  # blocks (weights, biases, two LayerNorms) and ln_f
    assert derived(flops)["tokens"].value == int(1e17 / (6 * n))
    half = dial(None, ["model.depth=6", "train.tokens_per_param=10"])
    assert derived(half)["tokens"].value == 10 * n


def test_batch_rule_grows_smoothly_in_whole_micro_batches():
    assert batch_tokens_for(10e9, 1024) == 2 ** 19
    assert batch_tokens_for(1e3, 8192) == 8192  # at least one micro-batch
    batches = [batch_tokens_for(tokens, 4096) for tokens in np.geomspace(1e7, 1e11, 13)]
    assert all(b % 4096 == 0 for b in batches) and batches == sorted(batches)
    assert all(later / earlier < 1.5 for earlier, later in zip(batches, batches[1:]))  # no doubling in one step
    # under torchrun: whole micro-batches on every rank
    assert dial(None, ["model.depth=12"], world_size=3).config.train.total_batch_tokens % (3 * 8 * 1024) == 0


def test_explicit_keys_win_over_the_dial_and_say_what_the_rule_gives(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nn_embd = 512\n[train]\nlr = 1e-3\n")
    run = dial(path, ["model.depth=6", "train.max_steps=77"])
    cfg = run.config
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head) == (6, 512, 8)  # heads follow the width kept
    assert (cfg.train.lr, cfg.train.max_steps) == (1e-3, 77)
    d = derived(run)
    assert d["model.n_embd"].explicit and d["model.n_embd"].rule_value == 384
    assert d["train.max_steps"].explicit and not d["model.n_layer"].explicit
    lines = format_derived(run.dial)
    assert "train.lr = 0.001  (set in the config; the rule gives 0.0009: 0.0006 x 768 / n_embd 512" in "\n".join(lines)
    assert dial(None, []).config.train.max_steps == 1000 and not dial(None, []).dial  # dial off


def test_dial_refuses_a_width_the_head_size_does_not_divide():
    with pytest.raises(ConfigError, match="model.depth \\* model.aspect_ratio = 30 is not a multiple of model.head_dim"):
        dial(None, ["model.depth=3", "model.aspect_ratio=10", "model.head_dim=4"])


@pytest.mark.slow
def test_shakespeare_cpu_is_the_same_model_and_depth_6_runs_with_every_setting_explained(char_data, tmp_path):
    cfg = dial("shakespeare-cpu", []).config
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.train.total_batch_tokens) == (4, 128, 4, 0)
    r = run_cli(*["plan", "--config", "shakespeare-cpu", "--set", "model.depth=6", "--set", f"data.dir={char_data}",
                 "--tokens-per-s", "1000"])
    assert r.returncode == 0, r.stderr
    assert "model       6 layers x 192 wide, 6 heads" in r.stdout
    for line in ("model.n_embd = 192  (depth 6 x aspect_ratio 32)", "model.n_head = 6  (n_embd 192 / head_dim 32)",
                 "train.max_steps = 300  (set in the config; the rule gives"):
        assert line in r.stdout
    shown = run_cli(*["config", "show", "--config", "shakespeare-cpu", "--set", "model.depth=6"])
    assert "#   model.n_layer = 6  (model.depth = 6)" in shown.stdout
    out = tmp_path / "run"
    r = run_cli(*["train", "--config", "shakespeare-cpu", "--out", str(out), "--set", "model.depth=6",
                 "--set", f"data.dir={char_data}", "--set", "train.max_steps=3", "--set", "eval.interval=0",
                 "--set", "eval.val_batches=1", "--set", "eval.sample_interval=0"])
    assert r.returncode == 0, r.stderr
    saved = load_config(out / "config.toml")
    assert (saved.model.n_layer, saved.model.n_embd, saved.model.n_head, saved.model.depth) == (6, 192, 6, 6)


def test_time_budget_sets_the_run_length_by_the_speed(char_data):
    base = [f"data.dir={char_data}", "model.depth=2", "model.aspect_ratio=16", "model.head_dim=16", "model.block_size=32",
            "train.micro_batch=4", "train.time_budget=2"]
    run = dial(None, [*base, "train.tokens_per_s=4000"])
    # 2 s x 4,000 tokens/s = 8,000 tokens; 2^19 x (8e3 / 1e10)^0.4 = 1,909 -> 15 micro-batches of 4 x 32 = 1,920
    tokens = derived(run)["tokens"]
    assert tokens.value == 8000 and "train.time_budget 2 s x train.tokens_per_s 4,000" in tokens.rule
    assert (run.config.train.total_batch_tokens, run.config.train.max_steps) == (1920, 5)  # ceil(8,000 / 1,920)
    # No speed known: resolving asks for one, with the shape set for the caller to measure; its figure is kept.
    with pytest.raises(SpeedNeeded) as need:
        dial(None, base)
    assert need.value.shaped.model.n_embd == 32 and "\n" not in str(need.value)
    assert str(need.value).startswith("train.time_budget needs the run's speed: set train.tokens_per_s")
    measured = resolve_run(None, base, Environment().with_speed(8000.0, "timed by the test"))
    assert measured.config.train.tokens_per_s == 8000 and measured.origin("train.tokens_per_s") == "timed by the test"
    assert "train.tokens_per_s = 8000  (timed by the test)" in format_derived(measured.dial)
    message = one_line(ConfigError, dial, None, [*base, "train.tokens_per_s=1", "train.flops_budget=1e12"])
    assert "both set the run's length; set one of them" in message


@pytest.mark.slow
def test_a_time_budget_too_big_to_time_here_names_the_config_key_to_set(tmp_path):
    """Found by a probe: `config show` (and `train`) told the user to "pass --tokens-per-s", an option only
    `plan` has; each command names its own remedy."""
    big = ["--config", "gpt2", "--set", "model.depth=12", "--set", "train.time_budget=60", "--set", "train.device=cpu"]
    r = run_cli("config", "show", *big, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: train.time_budget: a step is too big to time here")
    assert r.stderr.rstrip().endswith("; set train.tokens_per_s") and "--tokens-per-s" not in r.stderr
    r = run_cli("plan", "--set", "model.depth=12", "--set", "train.device=cpu", cwd=tmp_path)
    assert r.returncode == 0 and "pass --tokens-per-s" in r.stdout and "too big to time here quickly" in r.stdout


@pytest.mark.slow
def test_plan_sizes_a_time_budget_for_the_named_gpu(tmp_path):
    """No GPU here: the dial takes a GPU's speed from its peak and the MFU, as `plan` estimates its time."""
    r = run_cli("plan", "--device", "H100", "--set", "model.depth=12", "--set", "train.time_budget=3600", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # 989e12 bf16 peak x 0.40 / (6 x (85,056,000 + 50,304 x 768) + 12 x 12 x 768 x 1024 = 855,383,040) = 462,483
    assert ("train.tokens_per_s = 4.625e+05  (1 x H100 80GB: 989 TFLOP/s peak x MFU 0.40 (assumed" in r.stdout
            and "/ 855,383,040 FLOPs per token)" in r.stdout)
    assert "tokens = 1,664,938,318  (train.time_budget 3600 s x train.tokens_per_s 462,483)" in r.stdout
    assert "time        budget: 1h 00m," in r.stdout  # the plan's own estimate: the budget back, to a whole batch


@pytest.mark.slow
def test_plan_sizes_the_dials_batch_for_its_gpus(tmp_path):
    """plan --gpus N splits the dial's batch over N devices (it took torchrun's WORLD_SIZE, 1 here, and refused)."""
    r = run_cli("plan", "--device", "cpu", "--tokens-per-s", "1000", "--gpus", "2", "--set", "model.depth=2",
                "--set", "train.time_budget=60", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # 60 s x 1,000 tokens/s x 2 devices = 120,000 tokens; 2^19 x (1.2e5 / 1e10)^0.4 = 5,640 -> one micro-batch
    # of 8 x 1024 on each of 2 devices
    assert "batch       16,384 tokens/step = 8 x 1024 x 2 devices x 1 accumulation" in r.stdout
    assert "tokens = 120,000  (train.time_budget 60 s x train.tokens_per_s 2,000)" in r.stdout


@pytest.mark.slow
def test_time_budgeted_run_keeps_its_first_speed_on_resume(char_data, tmp_path, monkeypatch, capsys):
    """The speed is measured once, at the first launch; a resume reads it from the checkpoint, so a machine
    that now runs faster does not re-derive another batch and horizon (which the resume would refuse)."""
    from gpt2train import cli
    from gpt2train.training import speed as speeds

    speed = {"now": 4000.0}
    monkeypatch.setattr(speeds, "measure_cpu_speed", lambda cfg, notes: (speed["now"], "timed by the test"))
    out = tmp_path / "run"
    args = ["--set", f"data.dir={char_data}", "--set", "model.depth=2", "--set", "model.aspect_ratio=16",
            "--set", "model.head_dim=16", "--set", "model.block_size=32", "--set", "train.micro_batch=4",
            "--set", "train.time_budget=2", "--set", "train.device=cpu", "--set", "train.dtype=float32",
            "--set", "train.compile=false", "--set", "eval.interval=0", "--set", "eval.val_batches=1",
            "--set", "eval.sample_interval=0", "--set", "log.progress=lines"]
    assert cli.main(["config", "show", *args]) == 0
    assert "#   train.tokens_per_s = 4000  (timed by the test)" in capsys.readouterr().out
    assert cli.main(["train", "--out", str(out), *args]) == 0
    assert "finished at step 5" in capsys.readouterr().out
    assert load_config(out / "config.toml").train.tokens_per_s == 4000
    speed["now"] = 8000.0  # twice as fast now: measured again, the batch would be 2,560 and the resume refused
    assert cli.main(["train", "--out", str(out), "--resume", "auto", *args]) == 0
    assert "is already finished at step 5 (train.max_steps = 5)" in capsys.readouterr().out
    assert cli.main(["train", "--out", str(tmp_path / "new"), *args, "--set", "train.max_steps=1"]) == 0
    assert load_config(tmp_path / "new" / "config.toml").train.tokens_per_s == 8000  # a new run measures anew


def test_train_from_python_measures_a_time_budgets_speed_as_the_cli_does(char_data, tmp_path, monkeypatch):
    """The library's train() of a Config with train.time_budget raised SpeedNeeded: only `gpt2train train`
    measured the speed. Now train() measures it too, and runs what the command runs of the same settings (the
    test above: 5 steps at 4,000 tokens/s)."""
    from gpt2train import train
    from gpt2train.training import speed

    monkeypatch.setattr(speed, "measure_cpu_speed", lambda cfg, notes: (4000.0, "timed by the test"))
    cfg = load_config(None, [f"data.dir={char_data}", "model.depth=2", "model.aspect_ratio=16", "model.head_dim=16",
                             "model.block_size=32", "train.micro_batch=4", "train.time_budget=2", "train.device=cpu",
                             "train.dtype=float32", "train.compile=false", "eval.interval=0", "eval.val_batches=1",
                             "eval.sample_interval=0", "log.progress=lines"])
    out = train(cfg, tmp_path / "run")
    assert (out["reason"], out["step"]) == ("done", 5)
    saved = load_config(tmp_path / "run" / "config.toml").train
    assert (saved.tokens_per_s, saved.total_batch_tokens, saved.max_steps) == (4000, 1920, 5)


# --- the fit -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("E,A,alpha", [(1.7, 40.0, 0.3), (0.0, 12.0, 0.1), (2.5, 1e3, 0.45)])
def test_fit_recovers_a_known_power_law(E, A, alpha):
    xs = np.geomspace(1e10, 1e14, 5)
    fit = fit_power_law(xs, E + A * xs ** -alpha)
    assert fit.alpha == pytest.approx(alpha, rel=1e-3)
    assert fit.E == pytest.approx(E, abs=1e-3) and fit.rms_log_error < 1e-5
    assert fit(1e15) == pytest.approx(E + A * 1e15 ** -alpha, rel=1e-4)  # and it extrapolates


def test_a_known_floor_keeps_the_fit_above_it():
    """Noisy points of E = 1.0: the free fit puts E below the floor the data is known to have; held at the
    floor, the fit predicts the next point better. A floor below the true E changes nothing."""
    xs = np.geomspace(1e12, 1e14, 3)
    exact = 1.0 + 300.0 * xs ** -0.2
    noisy = exact * np.array([0.985, 1.0, 1.0])  # the smallest rung 1.5% low, as one seed's rung can be
    free, held = fit_power_law(xs, noisy), fit_power_law(xs, noisy, floor=1.0)
    assert free.E < 0.9 and held.E == pytest.approx(1.0, abs=1e-9)
    truth = 1.0 + 300.0 * 1e15 ** -0.2
    assert abs(held(1e15) - truth) < abs(free(1e15) - truth) / 2
    above = fit_power_law(xs, 1.5 + 300.0 * xs ** -0.2, floor=1.0)
    assert above.E == pytest.approx(1.5, abs=1e-3)
    with pytest.raises(UsageError, match=r"loss floor 2 must be at least 0 and below the rungs' lowest loss, 1.9755"):
        fit_power_law(xs, 1.5 + 300.0 * xs ** -0.2, floor=2.0)  # 1.5 + 300 / 10^2.8


def test_fit_floor_comes_from_the_option_then_the_data():
    assert scaling.fit_floor(ScalingOptions(floor=0.5), {"loss_floor": 0.9}, "d") == {"value": 0.5, "from": "--floor"}
    assert scaling.fit_floor(ScalingOptions(), {"loss_floor": 0.9}, "d") == {"value": 0.9, "from": "d/meta.json"}
    assert scaling.fit_floor(ScalingOptions(), {}, "d") == {"value": 0.0, "from": "none known"}


def test_fit_needs_three_points():
    with pytest.raises(UsageError, match="at least three rungs"):
        fit_power_law([1, 2], [3, 2])


# --- the corpus ----------------------------------------------------------------------------------------

def test_markov_corpus_is_seeded_and_made_of_the_sources_contexts():
    source = "the cat sat on the mat. the dog sat on the log. " * 20
    chain = Chain(source, order=3)
    a = chain.sample(3000, doc_chars=500, seed=1)
    assert a == chain.sample(3000, doc_chars=500, seed=1)
    assert a != chain.sample(3000, doc_chars=500, seed=2)
    assert len(a) == 6 and all(len(d) == 500 for d in a)
    grams = {source[i:i + 4] for i in range(len(source) - 3)}
    assert all(d[i:i + 4] in grams for d in a for i in range(len(d) - 3))  # every 4 characters occur in the source


def test_chain_surprisal_by_hand():
    """Order 1 on "aab" repeated: after "a" comes "a" or "b" equally (log 2 each), after "b" always "a" (0)."""
    chain = Chain("aab" * 50, order=1)
    a, b = chain.alphabet.index("a"), chain.alphabet.index("b")
    nats, counted = chain.surprisal(np.array([a, a, b, a, a, b]))
    assert counted == 5 and nats == pytest.approx(4 * math.log(2))
    nats, counted = chain.surprisal(np.array([a, a, -1, b, a]))  # -1 ends a document: no context across it
    assert counted == 2 and nats == pytest.approx(math.log(2))
    # tokens: ids of the char tokenizer ("a", "b"), 2 = end of text; 6 targets, log 2 at 2 of them
    assert loss_floor(chain, np.array([2, 0, 0, 1, 2, 1, 0]), "ab") == pytest.approx(2 * math.log(2) / 6)


def test_prepare_markov_twice_finds_its_corpus_prepared(tmp_path, capsys):
    first = prepare_markov(tmp_path / "m", 40_000, seed=3, val_tokens=2_000, progress=False)
    assert first["vocab_size"] <= 66 and first["tokens"]["train"] + first["tokens"]["val"] >= 40_000
    again = prepare_markov(tmp_path / "m", 40_000, seed=3, val_tokens=2_000, progress=True)
    assert again == first and "already prepared from these inputs" in capsys.readouterr().err
    older = {k: v for k, v in first.items() if k != "loss_floor"}  # prepared before prepare counted a floor
    (tmp_path / "m" / "meta.json").write_text(json.dumps(older))
    assert prepare_markov(tmp_path / "m", 40_000, seed=3, val_tokens=2_000, progress=False) == first
    assert json.loads((tmp_path / "m" / "meta.json").read_text())["loss_floor"] == first["loss_floor"]
    other = prepare_markov(tmp_path / "m2", 40_000, seed=4, val_tokens=2_000, progress=False)
    assert other["fingerprint"] != first["fingerprint"]


def test_prepare_markov_as_the_readme_writes_it(tmp_path):
    """Without --val-tokens (--val-fraction's count of documents ahead) it failed on every call: the reader's
    iterator had no close()."""
    r = run_cli("prepare", "markov", "--chars", "40000", "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "m" / "meta.json").read_text())
    assert meta["documents"] == {"train": 18, "val": 2} and meta["loss_floor"] > 0


def test_prepare_markov_refuses_a_tokenizer_it_would_not_use(tmp_path):
    """Its text is char-tokenized: --tokenizer gpt2 (or a --text-field) was taken and ignored before."""
    for option in (["--tokenizer", "gpt2"], ["--text-field", "body"]):
        r = run_cli("prepare", "markov", "--chars", "1000", "--out", str(tmp_path / "m"), *option)
        assert r.returncode == 2 and f"unrecognized arguments: {' '.join(option)}" in r.stderr
    assert not (tmp_path / "m").exists()


def test_prepare_markov_records_its_chains_loss_on_the_val_split(tmp_path):
    """Checked against the chain's loss counted here another way: a Counter of every 3-character context and
    its next character in the source, and -log p of each val character after 3 characters of its document."""
    from collections import Counter

    from gpt2train.data.prepare import shakespeare_text
    from gpt2train.data.shards import open_tokens

    r = run_cli("prepare", "markov", "--chars", "40000", "--order", "3", "--seed", "5", "--val-tokens", "4000",
                "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "m" / "meta.json").read_text())
    assert f"loss floor {meta['loss_floor']:.4f} nats per token: the chain's own loss on the val split" in r.stdout
    source = shakespeare_text()
    contexts = Counter(source[i:i + 3] for i in range(len(source) - 3))
    followed = Counter(source[i:i + 4] for i in range(len(source) - 3))
    chars, eot = meta["tokenizer"]["chars"], meta["eot_id"]
    val = [int(t) for t in open_tokens(tmp_path / "m" / meta["shards"]["val"][0])]
    nats = 0.0
    for i in range(3, len(val)):
        window = val[i - 3:i + 1]
        if eot not in window:
            gram = "".join(chars[t] for t in window)
            nats += math.log(contexts[gram[:3]] / followed[gram])
    assert meta["loss_floor"] == pytest.approx(nats / (len(val) - 1), abs=1e-6)
    assert 0.5 < meta["loss_floor"] < 3.0


# --- the ladder ----------------------------------------------------------------------------------------

LADDER_TOML = """
[model]
aspect_ratio = 8
head_dim = 8
block_size = 32
vocab_size = 0
[data]
dir = "{data}"
[train]
device = "cpu"
micro_batch = 4
seq_len = 32
tokens_per_param = {tpp}
dtype = "float32"
compile = false
[eval]
interval = 0
val_batches = 4
[log]
interval = 5
progress = "lines"
[checkpoint]
every_steps = 0
keep_last = 1
save_best = false
"""


def ladder_config(tmp_path, data, tpp=1):
    path = tmp_path / "ladder.toml"
    path.write_text(LADDER_TOML.format(data=data, tpp=tpp))
    return str(path)


def test_ladder_refuses_a_rung_that_would_repeat_data(char_data, tmp_path):
    options = ScalingOptions(config=ladder_config(tmp_path, char_data, tpp=500), depths=[1, 2, 3], predict=4)
    message = one_line(UsageError, run_ladder, options, tmp_path / "out", progress=False)
    assert message.startswith("rung depth 4 needs ") and "training tokens (500 per parameter x 50,880 parameters" in message
    assert "it would repeat data; prepare more text or leave depth 4 out" in message
    assert not (tmp_path / "out").exists()  # refused before any rung trained


def test_ladder_refuses_a_config_that_fixes_what_the_rungs_vary(char_data, tmp_path):
    options = ScalingOptions(config=ladder_config(tmp_path, char_data), depths=[1, 2, 3], predict=4,
                             overrides=["train.max_steps=5"])
    with pytest.raises(UsageError, match="sets train.max_steps, which the ladder derives for each rung"):
        run_ladder(options, tmp_path / "out", progress=False)
    with pytest.raises(UsageError, match="--predict 3: predict a rung deeper"):
        run_ladder(ScalingOptions(config=options.config, depths=[1, 2, 3], predict=3), tmp_path / "o", progress=False)


@pytest.mark.slow
def test_interrupted_ladder_continues_to_the_same_results(char_data, tmp_path, monkeypatch):
    config = ladder_config(tmp_path, char_data)
    options = ScalingOptions(config=config, depths=[1, 2, 3], predict=4)
    straight = run_ladder(options, tmp_path / "straight", progress=False)
    ladder = straight["ladders"][0]
    assert [r["depth"] for r in ladder["rungs"]] == [1, 2, 3, 4]
    assert all(r["val_loss"] > 0 for r in ladder["rungs"])
    assert set(ladder["fits"]) == {"compute", "params", "tokens"}
    p = ladder["prediction"]
    assert p["error"] == pytest.approx((p["measured"] - p["predicted"]) / p["predicted"])
    for name in ("scaling.json", "scaling.md", "scaling.png"):
        assert (tmp_path / "straight" / name).is_file()
    assert "| 4 | 32 | 4 |" in straight["markdown"]
    assert straight["floor"] == {"value": 0.0, "from": "none known"}  # char_data is real text
    for r in ladder["rungs"]:  # C = D x (6 x (blocks + head) + attention), the head at char_data's 66, padded to 128
        assert r["flops"] == r["tokens"] * (6 * (r["params"] + 128 * r["width"]) + 12 * r["depth"] * r["width"] * 32)

    # A SIGTERM in the middle of depth 3: the trainer checkpoints and stops, the ladder stops with it.
    original = Trainer.train_step

    def step_then_signal(self):
        out = original(self)
        if self.cfg.model.depth == 3 and self.state.step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    out = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt) as stopped:
        run_ladder(options, out, progress=False)
    assert stopped.value.signum == signal.SIGTERM  # the command exits 143
    monkeypatch.setattr(Trainer, "train_step", original)
    assert (out / "seed1337" / "depth2" / "rung.json").is_file() and not (out / "seed1337" / "depth3" / "rung.json").exists()
    finished = (out / "seed1337" / "depth1" / "rung.json").stat().st_mtime_ns

    trained = []
    real_train_rung = scaling.train_rung
    monkeypatch.setattr(scaling, "train_rung", lambda cfg, rung, run_dir: trained.append(rung.depth)
                        or real_train_rung(cfg, rung, run_dir))
    resumed = run_ladder(options, out, progress=False)
    assert trained == [3, 4]  # depths 1 and 2 were read back, not trained again
    assert (out / "seed1337" / "depth1" / "rung.json").stat().st_mtime_ns == finished
    loss = {r["depth"]: r["val_loss"] for r in resumed["ladders"][0]["rungs"]}
    assert loss == {r["depth"]: r["val_loss"] for r in ladder["rungs"]}  # the resumed rung continued exactly
    assert resumed["ladders"][0]["prediction"] == p
    assert json.loads((out / "scaling.json").read_text())["ladders"][0]["prediction"] == p
    other = ScalingOptions(config=config, depths=[1, 2, 3], predict=4, overrides=["train.tokens_per_param=2"])
    message = one_line(UsageError, run_ladder, other, out, progress=False)  # not another ladder's rungs
    assert "depth1/rung.json was trained with other settings (tokens " in message
    assert message.endswith("); pass a new --out for this ladder")


def test_scaling_options_check_how_depths_and_prediction_go_together():
    """Each depth's and seed's own range is the argparse type's check; the options check the ladder's shape."""
    with pytest.raises(UsageError, match="give at least three distinct depths"):
        ScalingOptions(depths=[2, 3, 3])
    with pytest.raises(UsageError, match="--predict 5: predict a rung deeper than the ladder's last, 5"):
        ScalingOptions(depths=[3, 4, 5], predict=5)


@pytest.mark.slow
def test_bench_scaling_cli_says_what_to_fix_in_one_line(tmp_path):
    r = run_cli(*["bench", "scaling", "--depths", "2,x"])
    assert r.returncode == 2 and "give depths as comma-separated whole numbers" in r.stderr
    r = run_cli(*["bench", "scaling", "--set", f"data.dir={tmp_path / 'none'}", "--out", str(tmp_path / "o")])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert f"make the ladder's corpus first: gpt2train prepare markov --chars 20000000 --val-tokens 500000 --out " \
        f"{tmp_path / 'none'}" in r.stderr  # it named prepare shakespeare, which is not the ladder's corpus


@pytest.mark.slow
def test_a_floor_no_data_can_have_is_refused_before_any_rung_trains(char_data, tmp_path):
    """ln(vocab) bounds every text's entropy; a floor above it would fail the fit only after the ladder."""
    vocab = json.loads((char_data / "meta.json").read_text())["vocab_size"]
    out = tmp_path / "ladder"
    r = run_cli("bench", "scaling", "--out", str(out), "--floor", "9", "--set", f"data.dir={char_data}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"error: loss floor 9 (from --floor) is above ln({vocab}) = {math.log(vocab):.4f}, "
                                "a uniform guess's loss over the data's vocabulary; give one below it")
    assert not out.exists()
    scaling.check_floor({"value": math.log(vocab), "from": "--floor"}, vocab)  # at ln V exactly: uniform data


@pytest.mark.slow
def test_bench_scaling_runs_the_shipped_preset_shrunk(char_data, tmp_path):
    """scaling-cpu as a user runs it (Muon, rotary, the dial), with one-layer-sized rungs and a small budget."""
    out = tmp_path / "ladder"
    shrink = ["model.aspect_ratio=8", "model.head_dim=8", "model.block_size=32", "train.seq_len=32",
              "train.micro_batch=4", "train.tokens_per_param=1", "eval.val_batches=2", f"data.dir={char_data}"]
    r = run_cli("bench", "scaling", "--depths", "1,2,3", "--predict", "4", "--out", str(out), "--floor", "0.5",
                *[a for kv in shrink for a in ("--set", kv)])
    assert r.returncode == 0, r.stderr
    assert "seed 1337: depth 4 predicted " in r.stdout and f"wrote {out}/scaling.md" in r.stdout
    result = json.loads((out / "scaling.json").read_text())
    assert result["floor"] == {"value": 0.5, "from": "--floor"}
    assert all(f["E"] >= 0.5 for f in result["ladders"][0]["fits"].values())
    assert "Fits of L = E + A x^-alpha with E at least 0.5000 (loss floor: --floor)." in r.stdout
    assert [x["depth"] for x in result["ladders"][0]["rungs"]] == [1, 2, 3, 4]
    saved = load_config(out / "seed1337" / "depth4" / "config.toml")
    assert (saved.train.optimizer, saved.model.position, saved.model.n_embd) == ("muon", "rotary", 32)



@pytest.mark.parametrize("budget", [["train.time_budget=1e300", "train.tokens_per_s=1e300"],
                                    ["train.tokens_per_param=1.7e308", "model.depth=40"]])
def test_a_budget_of_more_tokens_than_a_float_holds_is_one_line(budget):
    """Bug: each factor is in range but their product is inf, and the dial's int(tokens) raised OverflowError
    ('an internal error', exit 1) instead of a usage error naming the keys."""
    message = one_line(ConfigError, dial, None, ["model.depth=2", *budget])
    assert message.startswith("the run's length in tokens (") and "is more than a number holds" in message
