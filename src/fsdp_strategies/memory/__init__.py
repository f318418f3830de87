"""Activation memory as a budget: what a forward keeps for backward, counted; what to keep, chosen; what to
offload.

* :mod:`~fsdp_strategies.memory.saved_bytes` -- bytes a forward leaves alive for backward, on any device.
* :mod:`~fsdp_strategies.memory.budget` -- ``budget`` checkpointing: profile one block per kind on the real
  batch, keep the op outputs that cost most to recompute per byte within a memory target.
* :mod:`~fsdp_strategies.memory.offload` -- saved activations of the blocks moved to host memory and back.

Above :mod:`fsdp_strategies.parallel` (which checkpoints) and :mod:`fsdp_strategies.flops` (which prices
recomputation); the ``ActivationCheckpointing`` callback is the Lightning glue.
"""

from fsdp_strategies.memory.budget import BudgetChoice, BudgetNotMetError, BudgetPlanner
from fsdp_strategies.memory.offload import apply_activation_offload
from fsdp_strategies.memory.saved_bytes import SavedBytes

__all__ = ["BudgetChoice", "BudgetNotMetError", "BudgetPlanner", "SavedBytes", "apply_activation_offload"]
