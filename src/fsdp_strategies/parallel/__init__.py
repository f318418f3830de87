"""Parallel transforms on a plain ``nn.Module`` (no Lightning): activation checkpointing, compile, FSDP2.

:func:`parallelize` applies them in their one order (checkpoint -> compile -> shard); the
strategies are Lightning glue over it, and plain-torch loops can call it too.
"""

from fsdp_strategies.parallel.activation_checkpointing import apply_activation_checkpointing, is_recomputing
from fsdp_strategies.parallel.parallelize import apply_compile, apply_fsdp, parallelize

__all__ = ["apply_activation_checkpointing", "apply_compile", "apply_fsdp", "is_recomputing", "parallelize"]
