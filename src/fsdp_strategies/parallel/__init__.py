"""Parallel transforms on a plain ``nn.Module`` (no Lightning): tensor parallelism, activation checkpointing,
compile, FSDP2.

:func:`parallelize` applies them in their one order (tensor parallelism -> checkpoint -> compile -> shard);
the strategies are Lightning glue over it, and plain-torch loops can call it too.

* :mod:`~fsdp_strategies.parallel.blocks` -- which submodules are the transformer blocks (checkpoint
  regions and FSDP units alike);
* :mod:`~fsdp_strategies.parallel.mesh` -- device meshes for FSDP2 / HSDP;
* :mod:`~fsdp_strategies.parallel.activation_checkpointing` -- full / selective checkpointing of the blocks;
* :mod:`~fsdp_strategies.parallel.ops` -- op names (attention kernels, matmuls) shared with the FLOP counter;
* :mod:`~fsdp_strategies.parallel.tensor_parallel` -- tensor parallelism from a plan;
* :mod:`~fsdp_strategies.parallel.parallelize` -- compile, ``fully_shard`` and :func:`parallelize`;
* :mod:`~fsdp_strategies.parallel.replicated_params` -- 0-d parameters ``fully_shard`` cannot shard, kept
  whole on every rank with data-parallel gradients.
"""

from fsdp_strategies.parallel.activation_checkpointing import apply_activation_checkpointing, is_recomputing
from fsdp_strategies.parallel.parallelize import (
    apply_compile,
    apply_fsdp,
    buffers_to,
    parallelize,
    parameter_device,
)

__all__ = ["apply_activation_checkpointing", "apply_compile", "apply_fsdp", "buffers_to", "is_recomputing",
           "parallelize", "parameter_device"]
