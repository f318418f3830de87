"""Random initialisation of sharded parameters that draws what an unsharded model would, on any device.

A model built on the meta device is initialised after sharding: ``reset_parameters`` (or a Hugging Face
``_init_weights``) runs ``normal_`` / ``uniform_`` on DTensor parameters, which DTensor runs on each rank's
local shard. On CUDA-like devices DTensor's offset-based RNG tracker makes every shard draw its own part of
one stream. On CPU there is no such tracker: every rank draws from the same seeded generator, so **every shard
of a weight gets the same values** -- the two tensor-parallel halves of a projection are copies, a weight
sharded over N FSDP ranks repeats every 1/N of its rows, and training never breaks that symmetry (the
tensor-parallel halves of attention then stay equal forever).

:func:`full_then_shard_random` is the fix: inside it, an in-place random op on a DTensor whose mesh has no
DTensor RNG draws the *full* tensor from the generator (every rank the same draws, in the same order) and
keeps this rank's part of it (``distribute_tensor`` with ``src_data_rank=None``: no communication). A seeded
model built on the meta device then starts with the values an unsharded model draws for the same sequence of
ops, and replicated mesh dimensions hold equal values. Peak memory: one full parameter at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from fsdp_strategies import _torch_seam

__all__ = ["full_then_shard_random", "is_random_init"]

#: the in-place random tensor methods
RANDOM_METHODS = frozenset({
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.exponential_,
    torch.Tensor.random_, torch.Tensor.cauchy_, torch.Tensor.log_normal_, torch.Tensor.geometric_,
})
#: the random ``torch.nn.init`` functions, by name: they dispatch as one torch function (the methods they call
#: inside are not seen separately), and ``transformers`` swaps in same-named wrappers of its own while it
#: initialises a model (``transformers.initialization``)
RANDOM_INIT_FUNCTIONS = frozenset({
    "uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
    "xavier_normal_", "orthogonal_", "sparse_",
})
_INIT_MODULES = frozenset({"torch.nn.init", "transformers.initialization"})


def is_random_init(func: Any) -> bool:
    """Whether ``func`` (as a torch function mode sees it) fills its first argument with random values."""
    if func in RANDOM_METHODS:
        return True
    return (
        getattr(func, "__module__", None) in _INIT_MODULES
        and getattr(func, "__name__", "") in RANDOM_INIT_FUNCTIONS
    )


def _target(args: tuple, kwargs: dict) -> Any:
    """The tensor an init op fills: its first argument (``nn.init`` may pass it as ``tensor=``)."""
    return args[0] if args else kwargs.get("tensor")


class _FullThenShard(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = _target(args, kwargs)
        if not is_random_init(func) or not isinstance(target, DTensor) \
                or _torch_seam.dtensor_rng_per_shard(target.device_mesh):
            return func(*args, **kwargs)
        local = target.to_local()
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        if args:
            func(full, *args[1:], **kwargs)
        else:
            func(**{**kwargs, "tensor": full})
        with torch.no_grad():
            part = distribute_tensor(
                full, target.device_mesh, target.placements, src_data_rank=None
            ).to_local()
            local.copy_(part)
        return target


@contextmanager
def full_then_shard_random() -> Iterator[None]:
    """Inside: in-place random ops on DTensors without DTensor RNG draw the full tensor and keep this rank's
    part."""
    with _FullThenShard():
        yield
