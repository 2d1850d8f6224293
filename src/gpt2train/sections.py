"""A config section: a dataclass that remembers which of its keys were written, and can be sealed read-only.

The one rule for "the user set this key" is that it was written: in the config file, with --set, or in code
after the section was made (`cfg.train.lr = 3e-4`). The defaults a section is built with are not writes. A
resolved run's config (runconfig.py) is sealed: a write raises, so nothing changes a run after it was
resolved; a deep copy is an ordinary, writable section again.
"""

from __future__ import annotations

import copy
import dataclasses


class Section:
    """Base of the config dataclasses (GPTConfig and config.py's sections)."""

    def __post_init__(self):
        object.__setattr__(self, "_written", set())  # the fields __init__ just set are defaults, not writes
        object.__setattr__(self, "_sealed", False)

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_sealed"):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {name}: a resolved run config is read-only; change the config (or a copy.deepcopy of "
                "this one) and resolve it again")
        super().__setattr__(name, value)
        if "_written" in self.__dict__:  # absent while __init__ runs
            self._written.add(name)

    def written(self) -> frozenset[str]:
        """The keys written since the section was made."""
        return frozenset(self.__dict__.get("_written", ()))

    def seal(self) -> None:
        object.__setattr__(self, "_sealed", True)

    def __deepcopy__(self, memo):
        """A copy is yours to change: unsealed, with the same record of written keys."""
        fields = {f.name: copy.deepcopy(getattr(self, f.name), memo) for f in dataclasses.fields(self) if f.init}
        new = type(self)(**fields)
        object.__setattr__(new, "_written", set(self.written()))
        return new
