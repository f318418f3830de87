"""Bytes a rank really holds: local shards of parameters, gradients and optimizer state.

Used by tests (sharding is measured, not assumed) and by the ``memory`` benchmark.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


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
