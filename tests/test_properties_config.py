"""Property-based (hypothesis): generated config values and command lines, many of them wrong.

Whatever comes in, `gpt2train` either succeeds (0) or prints exactly one stderr line starting `error:` and
exits non-zero (2 usage, 1 a failure while working); never a traceback, never an internal error, nothing
written outside the test's folder and an existing run directory untouched. Examples are derandomized, so
CI sees the same ones every run.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO, run_here, tiny_config
from gpt2train.config import RANGES, Config, ConfigError, dump_toml, from_dict, to_dict, validate
from gpt2train.runconfig import Environment, resolve_run

CHECKS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
SECTIONS = list(to_dict(Config()))
KEYS = [f"{section}.{key}" for section, values in to_dict(Config()).items() for key in values]

# Values of every kind a TOML override can hold, near the edges of the ranges and far beyond them.
numbers = st.one_of(st.integers(-3, 3), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([2**31, 2**63, -(2**63), 1e-300, 0.999999]))
values = st.one_of(numbers, st.booleans(), st.text(max_size=8), st.sampled_from(["auto", "sdpa", "fsdp", "bar"]),
                   st.lists(st.one_of(st.text(max_size=3), st.integers()), max_size=2))
keys = st.one_of(st.sampled_from(KEYS), st.sampled_from(SECTIONS).map(lambda s: f"{s}.nope"), st.text(max_size=6))


def toml_text(value) -> str:
    """The value as --set text: TOML where it can be written (the override reads TOML first), else as is."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(value), repr(value))
    if isinstance(value, list):
        return "[" + ", ".join(toml_text(v) if not isinstance(v, str) else repr(v) for v in value) + "]"
    return str(value)


def in_range(name: str) -> st.SearchStrategy:
    """A value that RANGES allows for the key, small (a model that a test can afford)."""
    allowed = RANGES[name]
    if isinstance(getattr(getattr(Config(), name.split(".")[0]), name.split(".")[1]), int):
        low = int(allowed.low) + int(allowed.low_open)
        return st.integers(low, low + 8)
    high = allowed.high if allowed.high is not None else allowed.low + 10
    return st.floats(allowed.low, high, exclude_min=allowed.low_open, exclude_max=allowed.high_open)


any_override = st.builds(lambda k, v: f"{k}={toml_text(v)}", keys, values)
good_override = st.sampled_from(sorted(RANGES)).flatmap(lambda k: in_range(k).map(lambda v: f"{k}={toml_text(v)}"))
# Half of them in range, so that whole command lines get past the checks often enough to run.
overrides = st.lists(st.one_of(good_override, any_override), max_size=4)


@pytest.mark.slow
@settings(max_examples=400, **CHECKS)
@given(overrides)
def test_any_override_gives_a_valid_config_or_one_config_error(items):
    try:
        cfg = resolve_run(None, items, Environment()).config  # SpeedNeeded, a time budget's, is a ConfigError too
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)
        return
    validate(cfg)  # what the resolution accepts passes the check every command and the trainer run
    for name, allowed in RANGES.items():
        section, key = name.split(".")
        assert getattr(getattr(cfg, section), key) in allowed


@settings(max_examples=200, **CHECKS)
@given(st.dictionaries(st.sampled_from(SECTIONS + ["nope"]), st.dictionaries(st.sampled_from(
    sorted({k.split(".")[1] for k in KEYS})), values, max_size=4), max_size=3))
def test_any_config_file_gives_a_valid_config_or_one_config_error(data):
    try:
        validate(from_dict(data))
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)


# --- the command line, in-process ------------------------------------------------------------------


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under folder -> a hash of its bytes. The run lock's pid line is left out: a launch that
    stops at a resume check has held the lock, which is what the lock is for."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def world(tmp_path_factory, char_data):
    """A tiny config whose data folder is missing, a trained run (its checkpoint), and an empty working folder."""
    from gpt2train.training.loop import train

    root = tmp_path_factory.mktemp("properties")
    run = root / "run"
    train(tiny_config(char_data, max_steps=2), run)
    missing_data = tiny_config(root / "no-data", max_steps=2)
    (root / "tiny.toml").write_text(dump_toml(missing_data))
    (root / "tiny-data.toml").write_text(dump_toml(tiny_config(char_data, max_steps=2)))
    (root / "cwd").mkdir()
    return root


def run_main(argv: list[str], world: Path) -> tuple[int, list[str]]:
    """cli.main(argv) from an empty working folder: (exit status, stderr lines); checks what it may touch."""
    run_before, repo_before = tree_digest(world / "run"), sorted(p.name for p in REPO.iterdir())
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(world / "cwd")
        r = run_here(*argv)
    status, lines = r.returncode, r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr
    if status != 0:
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, lines)
        assert "internal error" not in lines[0], (argv, lines)  # a bug, not a message for the user
        assert tree_digest(world / "run") == run_before, argv
    assert list((world / "cwd").iterdir()) == [], argv
    assert sorted(p.name for p in REPO.iterdir()) == repo_before, argv
    shutil.rmtree(world / "out", ignore_errors=True)
    return status, lines


# A few good values and many bad ones, as the text a shell passes.
def arg_text(good: st.SearchStrategy) -> st.SearchStrategy:
    bad = st.one_of(st.integers(-5, 5).map(str), st.floats().map(str), st.text(max_size=4))
    return st.integers(0, 3).flatmap(lambda pick: bad if pick == 0 else good.map(str))  # good 3 times in 4


def options(**choices) -> st.SearchStrategy:
    """Some of the given options, each with a generated value, as an argv fragment."""
    pairs = st.fixed_dictionaries({}, optional=choices)
    return pairs.map(lambda d: [part for name, value in d.items() for part in (name.replace("_", "-"), value)])


@pytest.mark.slow
@settings(max_examples=150, **CHECKS)
@given(overrides, st.sampled_from([[], ["--resume", "auto"], ["--resume", "nowhere"]]))
def test_train_with_any_overrides_fails_at_the_door_in_one_line(world, items, resume):
    # The config's data folder does not exist, so a launch that passes every check stops at the data (exit 1);
    # --out is the trained run, which must come out untouched.
    argv = ["train", "--config", str(world / "tiny.toml"), "--out", str(world / "run"), *resume]
    status, lines = run_main(argv + [part for item in items for part in ("--set", item)], world)
    assert status in (1, 2)
    if status == 1:
        assert "meta.json" in lines[0] or "no-data" in lines[0], lines


@pytest.mark.slow
@settings(max_examples=150, **CHECKS)
@given(options(__max_new_tokens=arg_text(st.integers(1, 8)), __temperature=arg_text(st.floats(0, 2)),
               __top_k=arg_text(st.integers(0, 70)), __top_p=arg_text(st.floats(0, 1)),
               __seed=arg_text(st.integers(0, 2**31)), __num_samples=arg_text(st.integers(1, 2)),
               __prompt=st.text(max_size=6), __device=st.sampled_from(["cpu", "auto", "cuda:7", "tpu", ""])),
       st.sampled_from(["run", "run/checkpoints/latest", "missing"]))
def test_sample_with_any_arguments_succeeds_or_fails_in_one_line(world, argv, ckpt):
    if any(v.isdigit() and int(v) > 64 for v in argv[1::2]):  # keep each example short: few tokens, few samples
        return
    status, _ = run_main(["sample", "--ckpt", str(world / ckpt), *argv], world)


@pytest.mark.slow
@settings(max_examples=150, **CHECKS)
@given(overrides, options(__device=st.sampled_from(["H100", "a100-40gb", "L4", "TPU", "cuda:3"]),
                          __gpus=arg_text(st.integers(1, 8)), __mfu=arg_text(st.floats(0, 1)),
                          __tokens_per_s=arg_text(st.floats(0, 1e6))))
def test_plan_with_any_config_and_arguments_succeeds_or_fails_in_one_line(world, items, argv):
    # Named devices only: `--device cpu` (and auto here) times real steps, which a generated model may not fit.
    argv = argv if "--device" in argv else [*argv, "--device", "H100"]
    run_main(["plan", "--config", str(world / "tiny.toml"), *argv, *[p for i in items for p in ("--set", i)]], world)


@pytest.mark.slow
@settings(max_examples=150, **CHECKS)
@given(overrides, options(__world_size=arg_text(st.integers(1, 8)), __headroom=arg_text(st.floats(0, 1)),
                          __gpu_memory_gib=arg_text(st.floats(0, 200))), st.booleans())
def test_memory_with_any_config_and_arguments_succeeds_or_fails_in_one_line(world, items, argv, find_batch):
    argv = [*argv, *(["--find-batch"] if find_batch else [])]
    run_main(["memory", "--config", str(world / "tiny.toml"), *argv, *[p for i in items for p in ("--set", i)]], world)


# HellaSwag during training would look for its data set online, max_steps would make a long run, and the
# model's shape keys mostly stop at the door (n_embd / n_head, the data's vocabulary), which the tests above cover.
TRAINER_KEYS = sorted(k for k in RANGES if k not in ("eval.hellaswag_interval", "train.max_steps", "model.n_layer",
                                                     "model.n_head", "model.n_embd", "model.block_size", "model.vocab_size"))


@pytest.mark.slow
@settings(max_examples=50, **CHECKS)
@given(st.lists(st.sampled_from(TRAINER_KEYS).flatmap(lambda k: in_range(k).map(lambda v: f"{k}={toml_text(v)}")),
                min_size=1, max_size=4))
def test_a_real_two_step_run_with_any_in_range_overrides_finishes_or_fails_in_one_line(world, items):
    # Past the door: the trainer itself runs (tiny model, 2 steps), so a value that every check allows but the
    # trainer cannot use shows up here (into a fresh --out, removed afterwards).
    argv = ["train", "--config", str(world / "tiny-data.toml"), "--out", str(world / "out")]
    status, lines = run_main(argv + [part for item in items for part in ("--set", item)], world)
    assert status in (0, 2), lines  # in range yet unusable together (n_embd and n_head, say) is still usage
