"""Bytes a rank really holds: local shards of parameters, gradients and optimizer state.

Used by tests (sharding is measured, not assumed) and by the ``memory`` benchmark.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:  # dedupe on the (long-lived) tensor itself: to_local() returns fresh views
        local = _local(t)
        if id(t) in seen or local.device.type == "meta":
            continue
        seen.add(id(t))
        total += local.numel() * local.element_size()
    return total


def param_bytes(module: nn.Module) -> int:
    return _bytes(module.parameters())


def grad_bytes(module: nn.Module) -> int:
    return _bytes(p.grad for p in module.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _bytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


class KeptBytes(TorchDispatchMode):
    """Bytes of every storage an op creates during forward that is still alive afterwards.

    That is what is kept for backward: autograd's saved tensors *and* the outputs selective
    checkpointing caches itself (those never pass through ``saved_tensors_hooks``). Used by the
    activation-checkpointing tests and the ``sac`` benchmark.
    """

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.refs.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        return out

    def alive(self, exclude: set[int]) -> int:
        """Bytes still alive, leaving out storages whose data pointers are in ``exclude`` (weights)."""
        gc.collect()
        return sum(n for ptr, (ref, n) in self.refs.items() if not ref.expired() and ptr not in exclude)
