"""The `gpt2train` command: the entry point. It builds the parser from each command group's builders, runs the
chosen command's handler, and turns any failure into one line. Each group keeps its commands' arguments beside
their handlers: prepare.py (prepare, tokenizer), train.py, use.py (sample, chat, serve), exports.py (import-hf,
export-hf, export-gguf), evaluate.py (eval), tools.py (report, plan, doctor, ckpt, memory, config), bench.py, pipeline.py;
arguments.py holds the argument types they share. A handler calls the library and prints what it returns.

Every argument has a type and a range (arguments.py) and every config key too (config.RANGES), both checked
before any work starts. A failure prints one line on stderr, `error: ...`, after any progress bar has been
closed, and exits with
  2  a usage error: a bad argument, config file, config key or value (argparse's errors and ConfigError);
  1  a failure found while working: a missing or damaged file, a full disk, a missing package, a lost rank ...
  130, 143  stopped by SIGINT (Ctrl-C) or SIGTERM; a training run saves first and says how to resume
  141  stdout's reader went away (SIGPIPE), as other Unix tools
`--debug` (or GPT2TRAIN_DEBUG=1) shows the traceback instead. `doctor` keeps 1 and 2 for its findings
(docs/plan-and-doctor.md); a run directory it cannot read is a usage error there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import warnings

from gpt2train.cli.arguments import AUTO_DTYPE_HELP
from gpt2train.cli.bench import add_bench
from gpt2train.cli.evaluate import add_eval
from gpt2train.cli.exports import add_export_gguf, add_export_hf, add_import_hf
from gpt2train.cli.pipeline import add_pipeline
from gpt2train.cli.prepare import add_prepare, add_tokenizer
from gpt2train.cli.tools import add_ckpt, add_config, add_doctor, add_memory, add_plan, add_report
from gpt2train.cli.train import add_train
from gpt2train.cli.use import add_chat, add_sample, add_serve
from gpt2train.ranges import COMPILE_SETTINGS, UsageError
from gpt2train.training.signals import exit_status

# The entry point, the one-line error and warning helpers, and what tests read of the arguments' rules.
__all__ = ["AUTO_DTYPE_HELP", "COMPILE_SETTINGS", "build_parser", "main", "one_line_warnings", "show_warning_line"]


class OneLineErrors(argparse.ArgumentParser):
    """Usage mistakes as one line, like every other error (subcommand parsers inherit this class), and `--debug`
    in any position (`gpt2train train ... --debug`): every parser of this class takes it. A subcommand's default
    is SUPPRESS, so one that is not given the flag leaves the top level's value alone instead of resetting it."""

    def __init__(self, *args, debug_default=argparse.SUPPRESS, **kwargs):
        super().__init__(*args, **kwargs)
        shown = "show the traceback of an error (any position)" if debug_default is False else argparse.SUPPRESS
        self.add_argument("--debug", action="store_true", default=debug_default, help=shown)

    def error(self, message: str):
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")


def version_line() -> str:
    """`gpt2train --version`: torch's version from its package metadata, since importing torch takes seconds."""
    from importlib.metadata import PackageNotFoundError, version

    import gpt2train

    try:
        torch_version = version("torch")
    except PackageNotFoundError:  # a torch built from source may carry no metadata
        torch_version = "unknown"
    return f"gpt2train {gpt2train.__version__} (torch {torch_version}, Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="gpt2train", description="Pretrain GPT-2-family models from scratch. Exit status: "
                           "0 done, 1 a failure while working, 2 a usage error (bad argument or config).",
                           debug_default=False)
    parser.add_argument("--version", action="version", version=version_line(),
                        help="the versions of gpt2train and torch (for a bug report), and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # one builder per command or group of commands, in the order `gpt2train --help` lists them
    for add_commands in (add_prepare, add_tokenizer, add_train, add_sample, add_chat, add_serve, add_import_hf,
                         add_export_hf, add_export_gguf, add_report, add_eval, add_plan, add_doctor, add_ckpt, add_bench,
                         add_memory, add_config, add_pipeline):
        add_commands(sub)
    return parser


# What a user can cause and fix from the message alone; anything else is a bug, and its line says so.
EXPECTED_ERRORS = (ValueError, OSError, ImportError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = args.debug or bool(os.environ.get("GPT2TRAIN_DEBUG"))
    try:
        with contextlib.nullcontext() if debug else one_line_warnings():
            return args.func(args)
    except KeyboardInterrupt as e:  # Ctrl-C, or a second stop signal during training (signals.Interrupted)
        close_progress_bars()
        return exit_status(getattr(e, "signum", signal.SIGINT))
    except BrokenPipeError:  # stdout's reader left (`gpt2train ckpt inspect RUN | head -2`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again
        return 141  # 128 + SIGPIPE, the status of a tool that SIGPIPE ended
    except Exception as e:  # noqa: BLE001 - every failure ends as one line unless --debug asks for more
        close_progress_bars()  # the error line must not land on the end of a bar
        if debug:
            raise
        # the newline in the same write as the text: the ranks of a torchrun that fail together would interleave
        print(f"error: {error_line(e)}\n", end="", file=sys.stderr)
        return 2 if is_usage_error(e) else 1


@contextlib.contextmanager
def one_line_warnings():
    """While a command runs, every Python warning prints as one line, `warning: MESSAGE` on stderr, without the
    category, file and source line Python adds (`--debug` keeps Python's form). A DeprecationWarning is for the
    developers of the code that raises it, not for a user of the command: it is not shown, whatever the filters
    (a test runner turns them all on)."""
    with warnings.catch_warnings():  # restores the filters and showwarning
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.showwarning = show_warning_line
        yield


def show_warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    text = "warning: " + " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    # The line and its newline in one write, as the error line: warnings of ranks that warn together stay whole.
    tqdm = sys.modules.get("tqdm")
    if tqdm is not None:  # above an open progress bar, which tqdm redraws below the line
        tqdm.tqdm.write(text + "\n", file=file or sys.stderr, end="")
    else:
        print(text + "\n", end="", file=file or sys.stderr)


def is_usage_error(e: Exception) -> bool:
    from gpt2train.config import ConfigError  # here, not at the top: the config module loads torch

    return isinstance(e, (ConfigError, UsageError))


def error_line(e: Exception) -> str:
    message = str(e).splitlines()[0] if str(e).strip() else ""
    if isinstance(e, EXPECTED_ERRORS) and message:
        return message
    return f"{type(e).__name__}: {message} (an internal error; rerun with --debug for the traceback)"


def close_progress_bars():
    """Close the progress bars an exception left open, so that each ends its line before the error is printed."""
    from gpt2train.progress import close_open_bars

    close_open_bars()
