"""Progress of a long loop, on stderr, for a person or for a log: one rule for every command.

On a terminal, a tqdm bar that redraws in place. Anywhere else (a log file, CI, `nohup`, a pipe) a redraw
would write a carriage return and a new copy of the bar up to ten times a second, so there a plain line with
the same text is printed at most every LINE_EVERY_S seconds, and a last one when the loop ends.

    for batch in show_progress(batches, desc="val", unit="batch"): ...
    with show_progress(desc="tokenizing", unit=" docs") as bar: bar.update(n)
"""

from __future__ import annotations

import sys
import weakref
from time import monotonic

from tqdm import tqdm

LINE_EVERY_S = 5.0  # without a terminal: at most one progress line per this many seconds

_open_bars: weakref.WeakSet = weakref.WeakSet()  # what close_open_bars() ends before an error line


def on_terminal() -> bool:
    """Whether progress goes to a person watching a terminal (stderr is a TTY)."""
    return sys.stderr.isatty()


def show_progress(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it",
                  unit_scale: bool = False, enabled: bool = True):
    """A tqdm bar on a terminal, LogLines elsewhere, nothing when not `enabled` (e.g. ranks other than 0).
    Iterate over it, or use it in a `with` block and call update(n); set_postfix_str and
    set_description work on both."""
    if not enabled:
        return tqdm(iterable, total=total, disable=True)
    if on_terminal():
        return terminal_bar(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale)
    return LogLines(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale)


def terminal_bar(iterable=None, **options) -> tqdm:
    """A tqdm bar on stderr, resized with the terminal; closed by close_open_bars() if an error ends it."""
    bar = tqdm(iterable, file=sys.stderr, dynamic_ncols=True, **options)
    _open_bars.add(bar)
    return bar


def close_open_bars() -> None:
    """End every bar still open (an exception left it so), so that the next line starts a line of its own."""
    for bar in list(_open_bars):
        bar.close()


class LogLines:
    """tqdm's interface for a log: the bar's text (tqdm.format_meter, without the bar) as whole lines, at
    most one per `every_s` seconds when the count, description or postfix changes, and a last line on close."""

    def __init__(self, iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it",
                 unit_scale: bool = False, every_s: float = LINE_EVERY_S):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit, self.unit_scale = iterable, total, desc, unit, unit_scale
        self.every_s, self.n, self.postfix, self.closed = every_s, 0, "", False
        self.start = self.last_line = monotonic()
        _open_bars.add(self)

    def __iter__(self):
        # Closed on exhaustion only: after an exception the caller's `with` block or close_open_bars() ends it.
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._line_when_due()

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc
        self._line_when_due()

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self.postfix = text
        self._line_when_due()

    def write(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line()

    def _line_when_due(self) -> None:
        if not self.closed and monotonic() - self.last_line >= self.every_s:
            self._line()

    def _line(self) -> None:
        self.last_line = monotonic()
        text = tqdm.format_meter(self.n, self.total, self.last_line - self.start, ncols=0, prefix=self.desc,
                                 unit=self.unit, unit_scale=self.unit_scale, postfix=self.postfix or None)
        print(text, file=sys.stderr, flush=True)
