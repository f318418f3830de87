"""The torch / torchft / numpy / stdlib seam: every private name of those this package relies on.

The same rule as :mod:`fsdp_strategies._lightning_seam`: one small function or constant per
access, its docstring naming the private name; ``tests/test_lightning_seam.py`` checks each one
against the installed versions (torch >= 2.11: ``make test-torch-range`` runs them on 2.11.0 and 2.14.1,
``make test`` on 2.13.0; torchft 0.2.x).
"""

from __future__ import annotations

import atexit
import collections
import functools
import os
import pathlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # no public alias; what FlopCounterMode builds on
from torch.utils.flop_counter import FlopCounterMode

__all__ = [
    "DCP_METADATA_FILE",
    "HookedFlopCounter",
    "TorchDispatchMode",
    "dcp_metadata_globals",
    "default_stager_reusable",
    "dtensor_rng_per_shard",
    "flight_recorder_json",
    "fsdp_gradient_holders",
    "fsdp_lazy_init",
    "fsspec_storage",
    "inside_autograd_backward",
    "is_compiled_module",
    "is_op_overload",
    "live_storage",
    "loader_iterator",
    "local_shard",
    "numpy_pickle_globals",
    "op_schema",
    "queue_backward_callback",
    "quorum_id",
    "quorum_started",
    "raw_tensor_formula",
    "run_exit_handlers",
    "sdpa_backward_flop_count",
    "sdpa_flop_count",
    "shutdown_loader_workers",
    "tensor_version",
    "tree_leaves",
]


# ------------------------------------------------------------------------------ torch
def tree_leaves(tree: Any) -> list[Any]:
    """Leaves of a nested container (``torch.utils._pytree.tree_leaves``)."""
    from torch.utils._pytree import tree_leaves as leaves

    return list(leaves(tree))


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` (``_compiled_call_impl``) or ``torch.compile(module)`` (``_orig_mod``)
    applies."""
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")


def is_op_overload(op: Any) -> bool:
    """Whether ``op`` is one overload (``torch.ops.aten.mm.default``), not a packet
    (``torch._ops.OpOverload``)."""
    return isinstance(op, torch._ops.OpOverload)


def op_schema(packet: Any) -> Any:
    """The schema of an op packet's default overload (``OpOverload._schema``): argument names and defaults."""
    return packet.default._schema


def live_storage(ref: Any) -> torch.UntypedStorage | None:
    """The storage a ``torch.multiprocessing.reductions.StorageWeakRef`` points to, ``None`` once it was freed
    (``torch.UntypedStorage._new_with_weak_ptr``: a storage from the weak reference's ``cdata``).

    Its size and address are read now, not when the reference was taken: FSDP2 frees its all-gathered
    parameters by resizing their storage to 0 bytes, which a size recorded at creation would miss.
    """
    if ref.expired():
        return None
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata)


def tensor_version(tensor: torch.Tensor) -> int:
    """How often ``tensor`` was modified in place (``Tensor._version``, autograd's version counter)."""
    return int(tensor._version)


def inside_autograd_backward() -> bool:
    """Whether the autograd engine is running a backward pass now
    (``torch._C._current_graph_task_id() != -1``)."""
    return torch._C._current_graph_task_id() != -1


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass has finished, after the callbacks queued before it
    (FSDP2's end-of-backward among them) (``torch.autograd.Variable._execution_engine.queue_callback``;
    call it from inside a backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def raw_tensor_formula(formula: Callable[..., int]) -> Callable[..., int]:
    """Mark a ``FlopCounterMode`` custom formula to receive tensors instead of shapes (``_get_raw``)."""
    formula._get_raw = True  # type: ignore[attr-defined]
    return formula


def _kv_heads_as_query_heads(query_shape: Any, kv_shape: Any) -> Any:
    """A key/value shape ``(b, h_kv, s, d)`` with the query's heads when ``h_kv`` divides them (GQA)."""
    b, h_kv, s, d = kv_shape
    h_q = query_shape[1]
    return (b, h_q, s, d) if h_kv != h_q and h_kv and h_q % h_kv == 0 else kv_shape


def sdpa_flop_count(query_shape: Any, key_shape: Any, value_shape: Any) -> int:
    """``torch.utils.flop_counter.sdpa_flop_count``, grouped-query attention included on every torch here.

    torch 2.11 asserts that key and value have the query's heads; newer torch counts fewer key/value heads
    (the kernel broadcasts them) as the query's heads. Here the key/value shapes are given the query's heads
    first, which is that same count on every version.
    """
    from torch.utils import flop_counter

    return flop_counter.sdpa_flop_count(query_shape, _kv_heads_as_query_heads(query_shape, key_shape),
                                        _kv_heads_as_query_heads(query_shape, value_shape))


def sdpa_backward_flop_count(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any) -> int:
    """``torch.utils.flop_counter.sdpa_backward_flop_count``, grouped-query attention included (see
    :func:`sdpa_flop_count`: torch 2.11 asserts equal heads)."""
    from torch.utils import flop_counter

    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape,
                                                 _kv_heads_as_query_heads(query_shape, key_shape),
                                                 _kv_heads_as_query_heads(query_shape, value_shape))


class HookedFlopCounter(FlopCounterMode):
    """``FlopCounterMode`` that reports every op's FLOPs to :meth:`on_flops` as they are counted.

    Overrides ``FlopCounterMode._count_flops`` (private), the one place each op's count is added.
    """

    def on_flops(self, func_packet: Any, flops: int, args: Any) -> None:
        """Called after ``flops`` (> 0) were counted for ``func_packet`` with these ``args``."""

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        before = self.flop_counts["Global"].get(func_packet, 0)
        result = super()._count_flops(func_packet, out, args, kwargs)
        delta = self.flop_counts["Global"].get(func_packet, 0) - before
        if delta:
            self.on_flops(func_packet, delta, args)
        return result


def fsdp_gradient_holders(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in which FSDP2 holds a gradient of ``module``'s FSDP units now, with its kind.

    ``"sharded"``: ``param.grad`` (this rank's shard, a DTensor's local tensor). ``"unsharded"``: a whole
    parameter's gradient kept between backwards (``FSDPParam._unsharded_param.grad`` and
    ``FSDPParam.unsharded_accumulated_grad``, what ``set_requires_gradient_sync(False)`` leaves).
    ``"pending_all_reduce"``: a reduce-scattered gradient waiting for the cross-replica all-reduce
    (``FSDPParamGroup._partial_reduce_output``, what ``set_requires_all_reduce(False)`` leaves under HSDP).
    Reached through ``FSDPModule._get_fsdp_state()`` and ``FSDPState._fsdp_param_groups``
    (``_fsdp_param_group``, one group, in older torch), all private. From torch 2.15,
    ``unsharded_accumulated_grad`` is a property returning ``_unsharded_param.grad``: counted once.
    """
    from torch.distributed.fsdp import FSDPModule

    found: list[tuple[str, torch.Tensor]] = []
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [single] if single is not None else []
        for group in groups:
            pending = getattr(group, "_partial_reduce_output", None)
            if pending is not None:
                found.append(("pending_all_reduce", pending))
            for fsdp_param in group.fsdp_params:
                grad = fsdp_param.sharded_param.grad
                if grad is not None:
                    found.append(("sharded", grad.to_local() if hasattr(grad, "to_local") else grad))
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                whole = unsharded.grad if unsharded is not None else None
                if whole is not None:
                    found.append(("unsharded", whole))
                accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
                if accumulated is not None and accumulated is not whole:  # 2.15: a property -> that grad
                    found.append(("unsharded", accumulated))
    return found


def dtensor_rng_per_shard(mesh: Any) -> bool:
    """Whether DTensor gives each shard of ``mesh`` its own random stream (CUDA-like devices, not CPU):
    ``torch.distributed.tensor._random.is_rng_supported_mesh``, without the warning it prints for a CPU
    mesh."""
    import warnings

    from torch.distributed.tensor._random import is_rng_supported_mesh

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(is_rng_supported_mesh(mesh))


def fsdp_lazy_init(module: torch.nn.Module) -> None:
    """Make ``module`` (an ``FSDPModule``) the FSDP2 root now, as its first forward would
    (``FSDPModule._get_fsdp_state()._lazy_init()``, private): afterwards its sub-units may be called on their
    own (FSDP2 names as root the first module whose forward runs, and refuses a root above an initialised
    unit)."""
    module._get_fsdp_state()._lazy_init()  # type: ignore[operator]


def loader_iterator(dataloader: Any) -> Any:
    """A ``DataLoader``'s kept iterator with ``persistent_workers`` (``DataLoader._iterator``); else
    ``None``."""
    return getattr(dataloader, "_iterator", None)


def shutdown_loader_workers(iterator: Any) -> None:
    """Stop a multi-process loader iterator's workers now
    (``_MultiProcessingDataLoaderIter._shutdown_workers``)."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    if isinstance(iterator, _MultiProcessingDataLoaderIter):
        iterator._shutdown_workers()


@functools.cache
def default_stager_reusable() -> bool:
    """Whether one DCP ``DefaultStager`` can ``stage()`` more than once (a behaviour, not a private name).

    torch 2.11's ``DefaultStager.stage`` closes its ``StateDictStager`` after every call, which clears that
    stager's copy table: the next ``stage`` raises ``KeyError: <class 'type'>``. Newer torch (2.13) keeps it.
    Found by staging a one-tensor dict twice with a throw-away stager (CPU memory, once per process).
    """
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
    except KeyError:
        return False
    finally:
        stager.close()
    return True


def _dcp_metadata_file() -> str:
    from torch.distributed.checkpoint import filesystem

    return str(getattr(filesystem, "_metadata_fn", ".metadata"))


#: The pickled metadata file of a DCP folder (``torch.distributed.checkpoint.filesystem._metadata_fn``).
DCP_METADATA_FILE: str = _dcp_metadata_file()


def fsspec_storage(kind: str) -> type:
    """DCP's storage writer or reader for fsspec URLs (``torch.distributed.checkpoint._fsspec_filesystem``:
    ``FsspecWriter`` for ``kind="writer"``, ``FsspecReader`` for ``"reader"``; not exported by
    ``torch.distributed.checkpoint``). Both take ``(url, **storage_options)``."""
    from torch.distributed.checkpoint import _fsspec_filesystem

    return {"writer": _fsspec_filesystem.FsspecWriter, "reader": _fsspec_filesystem.FsspecReader}[kind]


def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` of every class a DCP ``.metadata`` pickle refers to.

    Includes DCP's private ``_MEM_FORMAT_ENCODING`` and ``filesystem._StorageInfo`` and
    ``torch.serialization._get_layout`` (how layouts pickle).
    """
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {}
    for mod, names in (
        (metadata, ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                    "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
        (filesystem, ("_StorageInfo",)),
    ):
        for name in names:
            if hasattr(mod, name):
                allowed[(mod.__name__, name)] = getattr(mod, name)
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        allowed[(cls.__module__, cls.__name__)] = cls
    return allowed


def local_shard(dtensor: Any) -> torch.Tensor:
    """This rank's shard of a DTensor as the tensor it holds (``DTensor._local_tensor``): what ``to_local()``
    gives without autograd, at no cost (``to_local()`` with grad enabled builds a view and an autograd node
    per call, which ``ft_hsdp``'s per-step heal snapshot paid for every parameter and optimizer moment)."""
    return dtensor._local_tensor


# ------------------------------------------------------------------------------ numpy
def numpy_pickle_globals() -> list[Any]:
    """What a pickled numpy scalar/array refers to: ``multiarray.scalar``, ``multiarray._reconstruct``,
    ``ndarray``, ``dtype`` and the ``numpy.dtypes`` classes (``np._core`` on numpy 2, ``np.core`` on 1)."""
    import numpy as np

    multiarray = getattr(np, "_core", None) or np.core
    found: list[Any] = [multiarray.multiarray.scalar, multiarray.multiarray._reconstruct, np.ndarray,
                        np.dtype]
    found += [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return found


# ------------------------------------------------------------------------------ torchft
def quorum_id(manager: Any) -> int:
    """The id of the manager's current quorum (``torchft.Manager._quorum_id``); -1 if unknown."""
    return int(getattr(manager, "_quorum_id", -1))


def diloco_fragments(diloco: Any) -> list[Any]:
    """The fragments of a ``torchft.local_sgd.DiLoCo`` (``DiLoCo._fragments``), to drive their
    ``prepare_sync``/``perform_sync`` from the strategy and learn whether each outer step committed."""
    return list(diloco._fragments)


def quorum_started(manager: Any) -> bool:
    """Whether the manager has started a quorum yet (``torchft.Manager._quorum_future`` is set)."""
    return getattr(manager, "_quorum_future", None) is not None


def flight_recorder_json() -> bytes | None:
    """torch's flight recorder, every process group of this process, as JSON
    (``torch._C._distributed_c10d._dump_fr_trace_json``); ``None`` where this torch has none or it is off."""
    size = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"))
    if int(size or 0) <= 0:
        return None
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    try:
        return None if dump is None else dump()
    except RuntimeError:  # no process group recorded anything
        return None


# ------------------------------------------------------------------------------ stdlib
def run_exit_handlers() -> None:
    """Run the ``atexit`` handlers now (``atexit._run_exitfuncs``).

    A process forked from the forkserver ends with ``os._exit``, which skips them; torch,
    Lightning and the user's script register cleanup there that a normal interpreter exit runs.
    """
    atexit._run_exitfuncs()
