"""Activation memory kept for backward, counted on any device: storages created by ops that are still alive.

:class:`SavedBytes` is a dispatch mode. While it is active it notes every storage an op creates (a weak
reference, so it keeps nothing alive). Read after a forward pass, the storages still alive are what the
forward left for backward: autograd's saved tensors *and* the outputs selective checkpointing caches
(those never pass through ``saved_tensors_hooks``), plus the outputs the caller still holds.

* Storages are told apart by identity (:func:`storage_id`), never by data address: an address freed in
  the forward is soon reused by another tensor (the CPU allocator reuses it at once), and the weak
  references held here keep every noted storage's identity from being reused.
* Sizes are read when asked (:func:`fsdp_strategies._torch_seam.live_storage`), not when created:
  FSDP2 frees all-gathered parameters by resizing their storage to 0 bytes.
* Storages that are not activations are not noted: those made by allocation ops (``empty``,
  ``resize_``...) and by collectives and FSDP's own ops (the all-gather buffers).
* Each storage is tagged with where it was made (``tag()``: e.g. inside a checkpointed block or not),
  so a caller can split the total.
* Tensor subclasses (DTensor) are counted through their inner tensors.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_strategies._torch_seam import TorchDispatchMode, live_storage, tree_leaves
from fsdp_strategies.parallel.ops import op_name

__all__ = ["SavedBytes", "input_tensors", "is_activation_op", "plain_tensors", "storage_id", "storage_key"]

# Ops whose outputs are buffers, not activations: allocations (filled in place later by FSDP's copy-out)
# and communication. Activations made by ``empty`` + an in-place fill are missed: a model detail we accept.
_NOT_ACTIVATIONS = frozenset({"aten.empty", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
                              "aten.resize_", "aten.set_"})
_NOT_ACTIVATION_NAMESPACES = ("fsdp.", "_c10d_functional.", "c10d.", "c10d_functional.", "_dtensor.")


def plain_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The plain tensors in an op's output (tuples/lists walked; a tensor subclass by its inner tensors)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from plain_tensors(item)
    elif isinstance(value, torch.Tensor):
        if type(value) in (torch.Tensor, torch.nn.Parameter):
            if value.device.type != "meta":
                yield value
        elif hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from plain_tensors(getattr(value, name))


def input_tensors(args: Any, kwargs: Any) -> Iterator[torch.Tensor]:
    """The plain tensors among an op's arguments."""
    return plain_tensors([*tree_leaves(args), *tree_leaves(kwargs or {})])


def storage_key(tensor: torch.Tensor) -> int:
    """A tensor's data address (weights are excluded by it; compare live tensors only)."""
    return int(tensor.untyped_storage().data_ptr())


def storage_id(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage object (``StorageWeakRef.cdata``): the same for every view of it, and
    not reused for another storage while a weak reference to it is held."""
    return int(StorageWeakRef(tensor.untyped_storage()).cdata)


def is_activation_op(func: Any) -> bool:
    """Whether ``func``'s outputs can be activations (not allocations, not communication buffers)."""
    name = op_name(func)
    return name not in _NOT_ACTIVATIONS and not name.startswith(_NOT_ACTIVATION_NAMESPACES)


class SavedBytes(TorchDispatchMode):
    """Notes the storages ops create while active; :meth:`alive` tells how many bytes of them are still alive.

    Args:
        tag: called at each op; its value is stored with the storages the op creates (default: no tag).
    """

    def __init__(self, tag: Callable[[], str] | None = None) -> None:
        super().__init__()
        self._tag = tag
        self.refs: dict[int, tuple[StorageWeakRef, str]] = {}

    def note(self, tensors: Iterable[torch.Tensor], inputs: Iterable[torch.Tensor] = ()) -> list[int]:
        """Note these tensors' storages (first time only), except those of ``inputs`` (a view makes no
        storage); returns the :func:`storage_id` of each storage newly noted."""
        tag = self._tag() if self._tag is not None else ""
        old = {storage_id(t) for t in inputs}
        new = []
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue
            ref = StorageWeakRef(storage)
            key = int(ref.cdata)
            if key in old or key in self.refs:
                continue
            self.refs[key] = (ref, tag)
            new.append(key)
        return new

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if is_activation_op(func):
            self.note(plain_tensors(out), input_tensors(args, kwargs))
        return out

    def alive(
        self, exclude: Iterable[int] = (), tag: str | None = None, ids: Iterable[int] | None = None
    ) -> int:
        """Bytes of the noted storages still alive now.

        Args:
            exclude: data addresses (:func:`storage_key`) of live storages to leave out (e.g. the weights).
            tag: count only storages noted with this tag.
            ids: count only these storages (:func:`storage_id`).
        """
        gc.collect()
        skip = set(exclude)
        wanted = None if ids is None else set(ids)
        total = 0
        for key, (ref, t) in self.refs.items():
            if (tag is not None and t != tag) or (wanted is not None and key not in wanted):
                continue
            storage = live_storage(ref)
            if storage is not None and int(storage.data_ptr()) not in skip:
                total += storage.nbytes()
        return total
