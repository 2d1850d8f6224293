"""The argument types and help texts that several commands share: a number's type carries its range (ranges.py),
a path to write is checked before any work, a list is parsed whole; --config and --set of the commands that
resolve a config. Each type turns a bad value into argparse's one-line usage error (exit 2)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpt2train.ranges import DEVICE_NAMES, SEEDS, Range, above, at_least, between, is_device_name


def ranged(kind: type, allowed: Range):
    """An argparse type: text -> int or float within `allowed`, else argparse's one-line usage error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{text} is out of range; it must be {allowed}")
        return value
    parse.__name__ = kind.__name__
    return parse


# The argument types, defined once: each carries its range.
COUNT = ranged(int, at_least(0))  # 0 usually means "all" or "the default"
POSITIVE_INT = ranged(int, at_least(1))
POSITIVE = ranged(float, above(0))
SEED = ranged(int, SEEDS)
SHARE = ranged(float, between(0, 1, low_open=True, high_open=True))  # a part of the whole, never all of it
PROBABILITY_MASS = ranged(float, between(0, 1, low_open=True))  # top-p, MFU
WORKERS = ranged(int, between(1, 1024))  # processes or threads: more than any machine's cores floods it
# A BPE's vocabulary: 256 bytes, a merge, EOT at least; at most 2^24, where the trainer's tables already take a GB
BPE_VOCAB_SIZE = ranged(int, between(258, 2**24))


def output_path(kind: str):
    """An argparse type for --out: a path to write, a "folder" or a "file". Refused before any work: an empty path
    (it would write into the current folder) and a path that is the other kind on disk."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError("give a path: an empty one would write into the current folder")
        path = Path(text)
        if kind == "folder" and path.exists() and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a file; give a folder to write into")
        if kind == "file" and path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder; give the file to write")
        if kind == "file" and path.exists() and not path.is_file():  # the atomic rename would replace the node itself
            raise argparse.ArgumentTypeError(f"{text} is not a regular file (a device, a pipe or a socket); give the "
                                             "path of a file to write")
        blocking = next((p for p in path.parents if p.exists()), None)  # the nearest existing folder above it
        if blocking is not None and not blocking.is_dir():
            raise argparse.ArgumentTypeError(f"{blocking} is a file, so nothing can be written under it; give "
                                             f"another {kind}")
        return text
    parse.__name__ = f"output {kind}"
    return parse


OUT_FOLDER, OUT_FILE = output_path("folder"), output_path("file")


def named_folder(text: str) -> tuple[str, str]:
    """--roots: NAME=FOLDER, an existing folder under a name."""
    name, _, folder = text.partition("=")
    if not name or not folder:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=FOLDER, e.g. myproject=src/myproject")
    if not Path(folder).is_dir():
        raise argparse.ArgumentTypeError(f"{folder} is not a folder; give NAME=FOLDER with a folder of .py files")
    return name, folder


def device_name(text: str) -> str:
    """The --device of a command that runs the model (whether this machine has that device is checked later)."""
    if not is_device_name(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {DEVICE_NAMES}")
    return text


def batch_size_list(text: str) -> list[int]:
    """--batch-sizes: positive integers separated by commas."""
    try:
        return [POSITIVE_INT(part.strip()) for part in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: give batch sizes of at least 1 separated by commas, e.g. 1,8 "
                                         f"({e})") from None


def seed_list(text: str) -> list[int]:
    """--seeds: distinct seeds separated by commas, each within SEEDS."""
    seeds = [SEED(part.strip()) for part in text.split(",")]
    if len(set(seeds)) < len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r} repeats a seed")
    return seeds


def depth_list(text: str) -> list[int]:
    try:
        depths = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        depths = []
    if not depths or min(depths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give depths as comma-separated whole numbers of 1 or more, e.g. 2,3,4,5")
    return depths


CONFIG_HELP = "TOML config file, or a preset name (`gpt2train config list`)"
NO_CONFIG_HELP = CONFIG_HELP + "; without it, the built-in defaults: GPT-2 124M (`gpt2train config show` prints them)"
# What --dtype auto runs: runtime.resolve_dtype's rule, said once for every command that takes --dtype.
AUTO_DTYPE_HELP = "auto: bf16 on GPUs that have it, fp16 on older GPUs, bf16 on CPUs with native bf16, else fp32"
AUTO_COMPILE_HELP = "auto: on CUDA, as a CUDA graph; eager on a CPU, where it is faster"


def config_options() -> argparse.ArgumentParser:
    """--config and --set of the commands that resolve a config (train, plan, memory, config show)."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--config", help=NO_CONFIG_HELP)
    options.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                         help="override a config key (repeatable; default: none, the config as written)")
    return options
