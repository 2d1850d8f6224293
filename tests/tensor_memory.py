"""Memory measured on any device (the CPU included): the reference the memory estimator is tested against
(tests/test_memory.py) and the numbers of docs/benchmarks.md, "How well it matches"."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only


class TensorMemoryTracker(TorchDispatchMode):
    """Counts the bytes of tensor storages created by ops while active, and their peak, on any device.

    A storage is counted from the op that creates it until it is freed (a weak reference tells), so
    `current` after a forward is what autograd and the caller keep, and `peak` is the step's high-water
    mark, the CPU analogue of torch.cuda.max_memory_allocated. Storages that existed before (parameters,
    optimizer states) are not counted; views count once. Allocator rounding and workspaces are not seen.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.known: set[int] = set()
        self.current = 0
        self.peak = 0

    def ignore(self, tensors):
        """Storages that already exist and must not be counted when an op returns a view of them."""
        for t in tensors:
            self.known.add(t.untyped_storage().data_ptr())
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        self.peak = max(self.peak, self.current)
        return out

    def _track(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.live or key in self.known:
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int):
        self.current -= self.live.pop(key, 0)
