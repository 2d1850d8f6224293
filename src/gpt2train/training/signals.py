"""Stop requests from the outside: SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C).

The first signal only sets `received`: the trainer finishes its step, saves, and exits. A second one stops
at once (`Interrupted`, a KeyboardInterrupt); the previous checkpoint stays valid. The handlers are put back on
exit. Either way the command exits with the shell's status for the signal, 128 + its number (130, 143), so
that `gpt2train train ... && next` does not go on with a run that was stopped.
"""

from __future__ import annotations

import signal


class Interrupted(KeyboardInterrupt):
    """A second stop signal: the run stops at once, in the middle of whatever it was doing."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(signum: int) -> int:
    """The status a shell reports for a process a signal stopped: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignal:
    def __init__(self):
        self.received: int | None = None  # the first signal's number
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.received is not None:
            raise Interrupted(signum)
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


def agreed_signal(any_rank: bool, any_sigterm: bool) -> int | None:
    """The one stop signal every rank of a run acts on: SIGTERM if any rank got it (a scheduler stopping the
    job), else SIGINT if any rank got a signal, else None; so every rank exits with the same status."""
    if not any_rank:
        return None
    return signal.SIGTERM if any_sigterm else signal.SIGINT


def ignore_from_now_on():
    """For a rank of a stopped run that is about to exit 130/143: once one rank has exited non-zero torchrun sends
    SIGTERM to the others, which would end a rank still leaving by the signal (-15) instead of its own status."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
