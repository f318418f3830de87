"""The parallel transforms on a plain ``nn.Module``, and the one function that puts them in order.

Order (written once, here, in :func:`parallelize`): **tensor parallelism -> activation checkpointing ->
compile -> replicated 0-d parameters -> shard (blocks, then the root)**.

* Tensor parallelism first: its plan names modules by their paths in the model as written, and it swaps the
  planned layers' parameters for DTensors on the mesh's ``tensor_parallel`` dim. Everything after it works on
  that distributed model: checkpointing sets the forward of a block whose layers are distributed already (the
  recomputation runs their collectives again, as the forward did), and ``fully_shard`` shards those DTensors
  further on the data-parallel dims (2-D parameters; FSDP2 composes with tensor parallelism applied before
  it, not after).
* Checkpointing before compile and shard: it sets an instance ``forward`` on each block; compiling then
  traces the checkpointed forward, and sharding wraps the same object, so FSDP2's all-gather/reduce-scatter
  hooks stay outside the checkpoint region (a recomputation does not all-gather again).
* Compile before shard: ``fully_shard`` hooks the compiled block, so the collectives stay eager
  (graph breaks at FSDP2's hooks are avoided; each block compiles once).
* 0-d parameters, which ``fully_shard`` cannot shard, are set aside (replicated, data-parallel gradients)
  before the first ``fully_shard`` call, which must be told to leave them out.
* Shard blocks first, the root last: FSDP2 groups parameters by the innermost ``fully_shard``
  call, so the root unit holds only what no block holds (embeddings, final norm, head).

The strategies (``fsdp2``, ``hsdp``, ``ft_hsdp``) call :func:`parallelize` from ``Strategy.setup`` with their
``tp_plan`` and the checkpointing the ``ActivationCheckpointing`` callback handed them
(:class:`fsdp_strategies.protocols.ActivationCheckpointingTarget`); a plain-torch loop calls it the same way
(``benchmarks/workers/torch_loop.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from fsdp_strategies import _torch_seam
from fsdp_strategies.parallel.activation_checkpointing import apply_activation_checkpointing
from fsdp_strategies.parallel.blocks import BlockStack, find_block_stacks
from fsdp_strategies.parallel.mesh import TENSOR_PARALLEL
from fsdp_strategies.parallel.replicated_params import replicate_params, scalar_params
from fsdp_strategies.parallel.tensor_parallel import (
    TensorParallelPlanError,
    apply_tensor_parallel,
    is_tensor_parallel,
)

__all__ = ["apply_compile", "apply_fsdp", "apply_tp", "buffers_to", "parallelize", "parameter_device",
           "split_mesh"]


def parameter_device(device: torch.device, cpu_offload: bool) -> torch.device:
    """Where the parameters are put (or materialised) before sharding: the CPU with ``cpu_offload`` -- FSDP2's
    ``CPUOffloadPolicy`` refuses parameters on the accelerator ("FSDP parameters should be materialized on
    CPU"), found on the first GPU run -- else ``device``."""
    return torch.device("cpu") if cpu_offload else device


def buffers_to(module: nn.Module, device: torch.device) -> None:
    """Move every buffer of ``module`` (not its parameters) to ``device``, each keeping its registration.

    With ``cpu_offload`` the parameters stay on the CPU (FSDP2 copies them in for each block), but FSDP2
    does not manage buffers (e.g. RoPE tables): the forward needs them on the compute device."""
    for sub in module.modules():
        for name, buf in list(sub.named_buffers(recurse=False)):
            if buf is not None and buf.device != device:
                setattr(sub, name, buf.to(device))  # nn.Module.__setattr__ keeps it a (non-)persistent buffer


def apply_compile(blocks: Sequence[nn.Module], options: Mapping[str, Any] | None = None) -> None:
    """``torch.compile`` each block in place (``nn.Module.compile``); blocks compiled already are skipped."""
    for block in blocks:
        if not _torch_seam.is_compiled_module(block):
            block.compile(**dict(options or {}))


def apply_fsdp(
    model: nn.Module,
    mesh: Any,
    blocks: Sequence[nn.Module],
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool | int = True,
    forward_prefetch: int = 0,
    backward_prefetch: int = 1,
) -> None:
    """``fully_shard`` each block, then the root, over ``mesh`` (1-D: FSDP, 2-D: HSDP). Idempotent.

    ``forward_prefetch`` / ``backward_prefetch``: how many following / preceding blocks to all-gather
    ahead (0 / 1 = FSDP2's defaults). 0-d parameters, which ``fully_shard`` cannot shard, are left out of
    every unit (``ignored_params``) and kept replicated with data-parallel gradients
    (:mod:`fsdp_strategies.parallel.replicated_params`).
    """
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    )
    mp_policy = mp_policy or MixedPrecisionPolicy()
    common: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload}
    scalars = [p for _, p in scalar_params(model)]
    if scalars and not isinstance(model, FSDPModule):
        common["ignored_params"] = set(scalars)
        replicate_params(model, mesh, scalars, reduce_dtype=mp_policy.reduce_dtype)
    for block in blocks:
        if not isinstance(block, FSDPModule):
            fully_shard(block, reshard_after_forward=reshard_after_forward, **common)
    if not isinstance(model, FSDPModule):
        fully_shard(model, **common)
    fsdp_blocks = [b for b in blocks if isinstance(b, FSDPModule)]
    for i, block in enumerate(fsdp_blocks):
        if forward_prefetch > 0 and i + 1 < len(fsdp_blocks):
            block.set_modules_to_forward_prefetch(fsdp_blocks[i + 1 : i + 1 + forward_prefetch])
        if backward_prefetch > 1 and i > 0:
            block.set_modules_to_backward_prefetch(fsdp_blocks[max(0, i - backward_prefetch) : i][::-1])


def split_mesh(mesh: Any) -> tuple[Any, Any | None]:
    """``(data-parallel mesh, tensor-parallel mesh or None)`` of ``mesh``: FSDP shards over every dim but the
    one named ``tensor_parallel`` (:data:`~fsdp_strategies.parallel.mesh.TENSOR_PARALLEL`), which tensor
    parallelism splits the planned layers over."""
    dims = tuple(mesh.mesh_dim_names or ())
    if TENSOR_PARALLEL not in dims:
        return mesh, None
    data = tuple(d for d in dims if d != TENSOR_PARALLEL)
    if not data:
        raise TensorParallelPlanError(f"parallelize: the mesh {dims} has no data-parallel dim for FSDP. Fix: "
                                      f"a mesh with a dim before {TENSOR_PARALLEL!r}, e.g. ('shard', "
                                      f"{TENSOR_PARALLEL!r}) of shape (1, degree).")
    return mesh[data], mesh[TENSOR_PARALLEL]


def apply_tp(model: nn.Module, tp_mesh: Any, tp_plan: str | Mapping[str, str],
             log: Callable[[str], None] = lambda line: None) -> dict[str, str]:
    """:func:`~fsdp_strategies.parallel.tensor_parallel.apply_tensor_parallel` unless ``model`` holds DTensor
    parameters already: a plan applied before (e.g. by a ``configure_model`` written for Lightning's
    ``ModelParallelStrategy``) is kept, not distributed twice. Returns the module -> style applied."""
    if is_tensor_parallel(model):
        log("the model holds DTensor parameters already (a plan applied in configure_model, or before this "
            "call); tp_plan is not applied on top of them.")
        return {}
    applied = apply_tensor_parallel(model, tp_mesh, tp_plan)
    styles = sorted(set(applied.values()))
    log(f"tensor parallel over {tp_mesh.size()} ranks: {len(applied)} modules ({', '.join(styles)}) from "
        f"tp_plan={tp_plan if isinstance(tp_plan, str) else 'dict'}")
    return applied


def parallelize(
    model: nn.Module,
    mesh: Any,
    *,
    tp_plan: str | Mapping[str, str] | None = None,
    ac: Mapping[str, Any] | Callable[[nn.Module], object] | None = None,
    block_class_names: Sequence[str] | None = None,
    compile_blocks: bool = False,
    compile_options: Mapping[str, Any] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool | int = True,
    forward_prefetch: int = 0,
    backward_prefetch: int = 1,
    log: Callable[[str], None] = lambda line: None,
) -> list[BlockStack]:
    """Tensor parallelism -> activation checkpointing -> compile -> shard, on ``model`` in place (see the
    module docstring for why in this order).

    Args:
        mesh: the device mesh: 1-D (FSDP) or 2-D (``replicate``, ``shard``: HSDP), either one followed by a
            ``tensor_parallel`` dim for ``tp_plan``; FSDP shards over the other dims (:func:`split_mesh`).
        tp_plan: ``"auto"`` or a dict of module glob -> style
            (:mod:`~fsdp_strategies.parallel.tensor_parallel`), applied on the mesh's ``tensor_parallel`` dim;
            ``None``: no tensor parallelism here. A model with DTensor parameters already keeps its own plan.
        ac: a mapping: keyword arguments of
            :func:`~fsdp_strategies.parallel.activation_checkpointing.apply_activation_checkpointing`
            (e.g. ``{"mode": "full"}``); a callable: called with ``model`` to checkpoint it (the
            ``ActivationCheckpointing`` callback's ``apply``, which adds offloading and its logs);
            ``None``: no checkpointing here.
        block_class_names: the blocks' class names; empty: every stack of repeated blocks.
        compile_blocks: ``torch.compile`` each block.
        compile_options: keyword arguments of that ``torch.compile``.
        mp_policy, cpu_offload, reshard_after_forward, forward_prefetch, backward_prefetch: see
            :func:`apply_fsdp`.
        log: called with a line saying what tensor parallelism applied (the strategies log it on rank 0).

    Returns the block stacks found (empty: the whole model is one FSDP unit). Idempotent.
    """
    names = list(block_class_names or [])
    data_mesh, tp_mesh = split_mesh(mesh)
    if tp_plan is not None:
        if tp_mesh is None:
            dims = tuple(mesh.mesh_dim_names or ())
            raise TensorParallelPlanError(
                f"parallelize(tp_plan=...): the mesh {dims} has no {TENSOR_PARALLEL!r} dim. Fix: add one "
                f"last, e.g. init_device_mesh(..., mesh_dim_names=('shard', {TENSOR_PARALLEL!r})), or drop "
                "tp_plan.")
        apply_tp(model, tp_mesh, tp_plan, log)
    if callable(ac):
        ac(model)
    elif ac is not None:
        apply_activation_checkpointing(model, **{"block_class_names": names or None, **dict(ac)})
    stacks = find_block_stacks(model, names)
    blocks = [block for stack in stacks for block in stack.blocks]
    if compile_blocks:
        apply_compile(blocks, compile_options)
    apply_fsdp(model, data_mesh, blocks, mp_policy=mp_policy, cpu_offload=cpu_offload,
               reshard_after_forward=reshard_after_forward, forward_prefetch=forward_prefetch,
               backward_prefetch=backward_prefetch)
    return stacks
