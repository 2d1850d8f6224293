"""Stop requests from the outside: SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C).

The first signal only sets `received`: the trainer finishes its step, saves, and exits. A second one stops
at once (KeyboardInterrupt); the previous checkpoint stays valid. The handlers are put back on exit.
"""

from __future__ import annotations

import signal


class StopSignal:
    def __init__(self):
        self.received: int | None = None  # the first signal's number
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, the run stops only when it ends
                pass
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        return False
