"""Process-group setup under torchrun, device choice, and wrapping a plain model in DDP or FSDP2.

The model never imports anything from here: parallelism is applied from the outside.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpt2train.ranges import DEVICE_NAMES, UsageError, is_device_name


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str = "auto") -> torch.device:
    """auto: cuda, then mps, then cpu. One-line ValueError for a name or a GPU this machine cannot use."""
    if not is_device_name(name):
        raise ValueError(f"device {name!r} is not one of {DEVICE_NAMES}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} needs CUDA, which is not available here; use auto or cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} GPU(s), cuda:0 to "
                         f"cuda:{torch.cuda.device_count() - 1}")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"device {name!r} needs Apple's MPS, which is not available here; use auto or cpu")
    return device


def local_world_size() -> int:
    """LOCAL_WORLD_SIZE as torchrun exported it (the ranks on this machine), 1 without torchrun."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        raise UsageError(f"LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']!r} is not an integer (torchrun sets it); "
                         "launch with torchrun, or unset it") from None


def launch_env() -> tuple[int, int, int]:
    """(RANK, LOCAL_RANK, WORLD_SIZE) as torchrun exported them, (0, 0, 1) without torchrun.

    Variables set by hand, partly or out of range, are a UsageError naming the variable, said before any
    process group: the rendezvous would otherwise wait for ranks that never come, or fail deep inside torch."""
    env = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    if env["RANK"] is None and env["WORLD_SIZE"] is None:
        return 0, 0, 1
    if env["RANK"] is None or env["WORLD_SIZE"] is None:
        given, missing = ("RANK", "WORLD_SIZE") if env["WORLD_SIZE"] is None else ("WORLD_SIZE", "RANK")
        raise UsageError(f"{given} is set but {missing} is not; torchrun sets both: launch with torchrun, or unset "
                         f"{given} to run in one process")
    numbers = {}
    for name, text in env.items():
        if text is not None:
            try:
                numbers[name] = int(text)
            except ValueError:
                raise UsageError(f"{name}={text!r} is not an integer (torchrun sets it); launch with torchrun, or "
                                 "unset RANK and WORLD_SIZE to run in one process") from None
    rank, local_rank, world_size = numbers["RANK"], numbers.get("LOCAL_RANK", 0), numbers["WORLD_SIZE"]
    if world_size < 1:
        raise UsageError(f"WORLD_SIZE={world_size} must be >= 1 (the number of processes torchrun started)")
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank)):
        if not 0 <= value < world_size:
            raise UsageError(f"{name}={value} must be in [0, {world_size - 1}] for WORLD_SIZE={world_size}; "
                             "launch with torchrun, which numbers the ranks itself")
    port = numbers.get("MASTER_PORT")
    if world_size > 1 and port is not None and not 1 <= port <= 65535:
        raise UsageError(f"MASTER_PORT={port} must be a TCP port in [1, 65535]")
    return rank, local_rank, world_size


def init_distributed(device_name: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join the process group when launched by torchrun (RANK/WORLD_SIZE set), else run single-process.

    NCCL between GPUs, gloo on CPU. Each rank takes the GPU of its LOCAL_RANK on its node. A collective that
    waits longer than `timeout_s` for another rank fails (gloo: a RuntimeError, see PeerLost; NCCL: its
    watchdog ends the process) instead of blocking forever.
    """
    if not timeout_s > 0:  # NaN too
        raise ValueError(f"train.collective_timeout_s = {timeout_s} must be > 0 (seconds a rank waits for the others "
                         "in a collective)")
    device = resolve_device(device_name)
    rank, local_rank, world_size = launch_env()
    if world_size == 1:  # not launched by torchrun, or by torchrun with one process
        return DistInfo(device=device)
    if device.type == "cuda":
        check_gpu_for_rank(local_rank, torch.cuda.device_count())
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # NCCL enforces the timeout from a watchdog thread only with async error handling on; torchrun turns
        # it on, another launcher may not, and then a dead peer would leave this rank blocked for good.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except dist.DistError as e:  # the rendezvous: rank 0's store never came up, or the other ranks never joined
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            others = "other rank" if world_size == 2 else f"other {world_size - 1} ranks"
            raise PeerLost(f"rank {rank} could not meet the {others} at {where} ({str(e).splitlines()[0]}); start "
                           f"every rank (torchrun starts them all), or raise train.collective_timeout_s = "
                           f"{timeout_s:g}") from None
    return DistInfo(rank, local_rank, world_size, device)


class PeerLost(ConnectionError):
    """A collective failed because another rank died, hung past train.collective_timeout_s, or closed its
    connection: this rank cannot go on alone. The message is one line for the user."""


# How gloo words a collective whose other side is gone (a closed or reset connection) or silent (a timeout).
_PEER_GONE = ("closed by peer", "connection reset", "broken pipe", "timed out", "timeout")


def peer_gone(error: BaseException) -> str | None:
    """If `error` is a collective failing for want of another rank, its reason in a few words; else None.

    gloo raises a plain RuntimeError ("[.../pair.cc:553] Connection closed by peer [127.0.0.1]:18824. This is
    typically caused by ...", "[.../unbound_buffer.cc:78] Timed out waiting 5000ms for recv ..."), so the
    message decides; torch's own DistError types always mean it."""
    if not (dist.is_initialized() and dist.get_world_size() > 1 and isinstance(error, RuntimeError)):
        return None
    text = str(error).strip()
    if not (isinstance(error, dist.DistError) or any(s in text.lower() for s in _PEER_GONE)):
        return None
    first = text.splitlines()[0] if text else type(error).__name__
    if first.startswith("[") and "] " in first:  # gloo's source location
        first = first.split("] ", 1)[1]
    return first.split(". ")[0]


def check_gpu_for_rank(local_rank: int, gpus: int):
    """One GPU per rank: a LOCAL_RANK with no GPU of its own is a launch error, said before NCCL fails obscurely."""
    if local_rank >= gpus:
        raise ValueError(f"torchrun started LOCAL_RANK {local_rank} but this node has {gpus} GPU(s); launch with "
                         f"--nproc_per_node={gpus} (one process per GPU), or --set train.device=cpu to run the ranks "
                         "on CPU with gloo")


def in_process_group() -> bool:
    """Whether this process has joined a process group already (then a command run inside it, as a pipeline's
    stage is, uses that group and leaves it for its owner to shut down)."""
    return dist.is_available() and dist.is_initialized()


def shutdown_distributed(clean: bool = True):
    """Leave the process group. After an error skip the barrier: the other ranks may never reach it,
    and destroying the group is what lets every process exit instead of hanging."""
    if dist.is_initialized():
        gloo = dist.get_backend() == "gloo"
        if clean:
            dist.barrier()
        dist.destroy_process_group()
        if gloo:
            let_gloo_threads_finish()


def let_gloo_threads_finish(seconds: float = 0.2):
    """Give gloo's worker threads the GIL for a moment before the interpreter shuts down.

    A gloo worker wakes the waiting rank as soon as a collective completes, then drops its own reference
    to the finished work, which frees tensors that Python created and so needs the GIL. If the interpreter
    is already finalizing by then, that thread is torn down mid-destructor and the process aborts
    ("terminate called without an active exception", SIGABRT) after a run that succeeded. Sleeping here
    releases the GIL, so those pending frees run while the interpreter is still alive."""
    time.sleep(seconds)


def wrap_model(model: torch.nn.Module, info: DistInfo, strategy: str,
               compute_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """DDP (replicate, all-reduce grads) or FSDP2 (shard params, grads and optimizer state per block).

    Under FSDP2 a bf16/fp16 run gathers its parameters and reduce-scatters its gradients in that dtype
    (half the bytes on the wire), while the sharded master weights and the optimizer state stay fp32."""
    if not info.enabled:
        return model
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy()  # fp32 throughout
        if compute_dtype != torch.float32:
            policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype)
        for block in model.transformer.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)


def gradient_sync(model: torch.nn.Module, sync: bool):
    """Context in which backward all-reduces gradients only when `sync` (the last micro-batch)."""
    if sync:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        @contextlib.contextmanager
        def no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return no_sync()
    return contextlib.nullcontext()


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def all_gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order (a one-element list when not distributed)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier():
    if dist.is_initialized():
        dist.barrier()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain GPT under DDP's `.module` and torch.compile's `._orig_mod`."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model
