"""Activation offload: what autograd saves inside the transformer blocks goes to host memory, and comes back
for backward.

Each block instance gets a ``forward`` attribute that runs the block's forward under
``torch.autograd.graph.saved_tensors_hooks``: a tensor autograd saves is copied to host memory (pinned,
asynchronous on CUDA: both copies are queued on the current stream, so no kernel reads a buffer before
its copy lands) and copied back when backward needs it. Left where they are: parameters and their
views (FSDP2 re-gathers those itself), tensor subclasses (DTensor), tensors smaller than ``min_bytes``.

Offload and checkpointing split the blocks between them: a checkpointed block keeps only its input (and,
with selective checkpointing, the op outputs its policy keeps, which stay on the device: torch implements
its ``CPU_OFFLOAD`` policy only under ``torch.compile``), so only the blocks that are *not* checkpointed
are wrapped: every block with ``mode="none"``, the blocks between checkpointed ones with
``selective_layer``. Checkpointed blocks are skipped, so apply checkpointing first. Gradients are
unchanged; on CPU the copies cost time and save nothing.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_strategies import _torch_seam
from fsdp_strategies.memory.saved_bytes import plain_tensors, storage_key
from fsdp_strategies.parallel.activation_checkpointing import is_checkpointed
from fsdp_strategies.parallel.blocks import find_transformer_blocks

__all__ = ["OffloadStats", "apply_activation_offload", "is_offloaded"]

_MARK = "_fsdp_strategies_offload"  # on a block: its OffloadStats
_INNER = "_fsdp_strategies_offload_inner"  # on a block: the forward that runs under the hooks


class OffloadStats:
    """Counters of one :func:`apply_activation_offload` call: blocks wrapped, tensors and bytes sent to host
    memory."""

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self.blocks = 0
        self.tensors = 0
        self.bytes = 0


class _OnHost:
    """A saved tensor's host copy and the device it came from."""

    __slots__ = ("device", "host")

    def __init__(self, device: torch.device, host: torch.Tensor) -> None:
        self.device, self.host = device, host


def _pack(params: set[int], stats: OffloadStats,
          copies: dict[tuple[Any, ...], tuple[StorageWeakRef, _OnHost]], tensor: torch.Tensor) -> Any:
    if (type(tensor) is not torch.Tensor or tensor.is_sparse or tensor.device.type == "meta"
            or tensor.numel() * tensor.element_size() < stats.min_bytes or storage_key(tensor) in params):
        # left on the device (a detached alias: the values are all backward needs, and a graph dropped without
        # a backward then frees it -- the tensor itself would tie a saved output to its own grad_fn)
        return tensor.detach()
    # several ops save the same tensor (q, k and v projections all save their input): one host copy serves
    # them (unless it was modified in place in between: the version counter is part of the key)
    # The storage is named by its identity, and the weak reference kept with the copy stops that identity from
    # being reused by a later tensor of this forward (without it, a freed storage's address went to a new
    # tensor of the same shape, which then got the old tensor's host copy -- seen under bf16 autocast)
    ref = StorageWeakRef(tensor.untyped_storage())
    key = (int(ref.cdata), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype,
           _torch_seam.tensor_version(tensor))
    known = copies.get(key)
    if known is not None:
        return known[1]
    pinned = tensor.device.type == "cuda"
    host = torch.empty_like(tensor, device="cpu", pin_memory=pinned)
    host.copy_(tensor, non_blocking=pinned)
    stats.tensors += 1
    stats.bytes += tensor.numel() * tensor.element_size()
    packed = _OnHost(tensor.device, host)
    copies[key] = (ref, packed)
    return packed


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, _OnHost):
        return packed.host.to(packed.device, non_blocking=packed.device.type == "cuda")
    return packed


def _offloaded_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    stats: OffloadStats = getattr(self, _MARK)
    # unsharded now, under FSDP2
    params = {storage_key(t) for p in self.parameters() for t in plain_tensors(p)}
    # this forward's host copies, by their tensor
    copies: dict[tuple[Any, ...], tuple[StorageWeakRef, _OnHost]] = {}
    with torch.autograd.graph.saved_tensors_hooks(functools.partial(_pack, params, stats, copies), _unpack):
        return getattr(self, _INNER)(*args, **kwargs)


def is_offloaded(module: nn.Module) -> bool:
    """Whether ``module`` is a block whose saved activations :func:`apply_activation_offload` offloads."""
    return getattr(module, _MARK, None) is not None


def apply_activation_offload(model: nn.Module, *, block_class_names: Sequence[str] | None = None,
                             min_bytes: int = 1 << 20) -> OffloadStats:
    """Offload what autograd saves in ``model``'s transformer blocks that are not checkpointed to host memory
    (in place, idempotent).

    Apply after activation checkpointing and before sharding/compiling (the callback does). Returns the
    counters the blocks share (the existing ones if applied already); ``blocks`` is 0 when every block is
    checkpointed.

    Args:
        model: the module whose blocks to wrap.
        block_class_names: class names of the blocks; empty: the same heuristic as the strategies.
        min_bytes: saved tensors smaller than this stay on the device (copies of tiny tensors cost more than
            they free).
    """
    for module in model.modules():
        if is_offloaded(module):
            return getattr(module, _MARK)
    stats = OffloadStats(min_bytes)
    object.__setattr__(model, _MARK, stats)  # applied once, also when no block was wrapped
    for block in find_transformer_blocks(model, block_class_names):
        if is_checkpointed(block):
            continue
        stats.blocks += 1
        object.__setattr__(block, _INNER, block.forward)
        object.__setattr__(block, _MARK, stats)
        object.__setattr__(block, "forward", types.MethodType(_offloaded_forward, block))
    return stats
