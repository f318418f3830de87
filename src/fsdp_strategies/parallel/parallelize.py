"""The parallel transforms on a plain ``nn.Module``, and the one function that puts them in order.

Order (written once, here): **activation checkpointing -> compile -> shard**.

* Checkpointing first: it sets an instance ``forward`` on each block; compiling then traces the
  checkpointed forward, and sharding wraps the same object, so FSDP2's all-gather/reduce-scatter
  hooks stay outside the checkpoint region (a recomputation does not all-gather again).
* Compile before shard: ``fully_shard`` hooks the compiled block, so the collectives stay eager
  (graph breaks at FSDP2's hooks are avoided; each block compiles once).
* Shard blocks first, the root last: FSDP2 groups parameters by the innermost ``fully_shard``
  call, so the root unit holds only what no block holds (embeddings, final norm, head).

The strategies (``fsdp2``, ``hsdp``, ``ft_hsdp``) call :func:`parallelize` from
``Strategy.setup`` (activation checkpointing, when wanted, was applied by the
``ActivationCheckpointing`` callback right after ``configure_model``; the strategy passes
``ac=None``); a plain-torch loop calls it with ``ac=`` directly (``benchmarks/workers/torch_loop.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
from fsdp_strategies.parallel.replicated_params import replicate_params, scalar_params

__all__ = ["apply_compile", "apply_fsdp", "buffers_to", "parallelize", "parameter_device"]


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
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
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


def parallelize(
    model: nn.Module,
    mesh: Any,
    *,
    block_class_names: Sequence[str] | None = None,
    ac: Mapping[str, Any] | None = None,
    compile_blocks: bool = False,
    compile_options: Mapping[str, Any] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool | int = True,
    forward_prefetch: int = 0,
    backward_prefetch: int = 1,
) -> list[BlockStack]:
    """Activation checkpointing -> compile -> shard, on ``model``'s transformer blocks, in place.

    Args:
        block_class_names: the blocks' class names; empty: every stack of repeated blocks.
        ac: keyword arguments of :func:`~fsdp_strategies.parallel.activation_checkpointing.apply_activation_checkpointing`
            (e.g. ``{"mode": "full"}``); ``None``: no checkpointing here.
        compile_blocks: ``torch.compile`` each block.
        compile_options: keyword arguments of that ``torch.compile``.
        mp_policy, cpu_offload, reshard_after_forward, forward_prefetch, backward_prefetch: see :func:`apply_fsdp`.

    Returns the block stacks found (empty: the whole model is one FSDP unit). Idempotent.
    """
    names = list(block_class_names or [])
    if ac is not None:
        apply_activation_checkpointing(model, **{"block_class_names": names or None, **dict(ac)})
    stacks = find_block_stacks(model, names)
    blocks = [block for stack in stacks for block in stack.blocks]
    if compile_blocks:
        apply_compile(blocks, compile_options)
    apply_fsdp(model, mesh, blocks, mp_policy=mp_policy, cpu_offload=cpu_offload,
               reshard_after_forward=reshard_after_forward, forward_prefetch=forward_prefetch,
               backward_prefetch=backward_prefetch)
    return stacks
