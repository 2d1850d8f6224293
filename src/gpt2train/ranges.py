"""Ranges of allowed numbers, and the device and dtype names, shared by the config's keys and the CLI's arguments;
UsageError, for a bad argument that only the code running a command can see.

A Range answers `value in allowed` and reads as the phrase an error shows (">= 1", "in [0, 1)"), so a
key and an argument with the same meaning take and refuse the same numbers, in the same words.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# The precisions a run or a command can ask for; "auto" lets runtime.resolve_dtype choose by the device.
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
EXPLICIT_DTYPE_NAMES = DTYPE_NAMES[1:]
# The stored types `export-gguf` writes the weight matrices in (GGML's names; vectors always stay f32).
GGUF_DTYPE_NAMES = ("f32", "f16", "q8_0")
# Whether to compile, as a command line spells it -> as the config holds it (train.compile); "auto" lets
# runtime.resolve_compile choose by the device.
COMPILE_SETTINGS = {"true": True, "false": False, "auto": "auto"}


class UsageError(ValueError):
    """A bad argument that only a command can see (argparse checks the rest): exit status 2, like argparse."""


@dataclass(frozen=True)
class Range:
    """An interval of allowed numbers; `str()` is the phrase an error shows (">= 1", "in [0, 1)")."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is excluded
    high_open: bool = False

    def __contains__(self, value) -> bool:
        if isinstance(value, float) and not math.isfinite(value):  # TOML and float() read nan and inf
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or (value < self.high or (not self.high_open and value == self.high))

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"


def at_least(low: float) -> Range:
    return Range(low)


def above(low: float) -> Range:
    return Range(low, low_open=True)


def between(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Range:
    return Range(low, high, low_open, high_open)


# What train.device and every --device of a model-running command take (torch.device takes more, and
# fails on some of it only later, with its own message).
DEVICE_NAMES = "auto, cpu, cuda, cuda:N or mps"


def is_device_name(name: str) -> bool:
    return re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", name) is not None


# NumPy takes seeds below 2**32; the trainer adds the rank and 1, sampling the sample's index.
SEEDS = between(0, 2**31 - 1)

# Sampling: `sample`'s arguments and the fields of `serve`'s requests take the same numbers.
NEW_TOKENS = at_least(1)
TEMPERATURES = at_least(0)  # 0: greedy
TOP_K = at_least(0)  # 0: no limit
TOP_P = between(0, 1, low_open=True)  # 1: no limit
SAMPLES = between(1, 10_000)
