"""fsdp_strategies: large-scale training strategies and callbacks for an unmodified Lightning Trainer.

``import fsdp_strategies`` registers every strategy name with Lightning's ``StrategyRegistry``
(see :data:`STRATEGY_NAMES`); built-in names are never shadowed.
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from fsdp_strategies.callbacks.activation_checkpointing import ActivationCheckpointing
from fsdp_strategies.callbacks.garbage_collection import GarbageCollection
from fsdp_strategies.callbacks.mfu import MFUMonitor
from fsdp_strategies.callbacks.straggler import StragglerDetector
from fsdp_strategies.checkpoint.export import export_consolidated
from fsdp_strategies.checkpoint.verify import verify_checkpoint
from fsdp_strategies.ft.strategy import FTHSDPStrategy
from fsdp_strategies.hf.export import export_hf
from fsdp_strategies.parallel import parallelize
from fsdp_strategies.protocols import LocalAveragingSwitch, QuorumMember
from fsdp_strategies.runtime.clean_exit import register_clean_exit
from fsdp_strategies.runtime.preemption import PREEMPT_EXIT_CODE
from fsdp_strategies.strategies import DDPHooksStrategy, FSDP2Strategy, HSDPStrategy

__version__ = "0.1.0"

_REGISTERED = {
    "fsdp2": (FSDP2Strategy, "FSDP2 (fully_shard) per transformer block, on a 1-D mesh"),
    "hsdp": (HSDPStrategy, "FSDP2 on a 2-D (replicate, shard) DeviceMesh"),
    "ft_hsdp": (FTHSDPStrategy, "fault-tolerant HSDP: FSDP2 in a replica group, torchft across groups"),
    "ddp_hooks": (
        DDPHooksStrategy,
        "DDP with comm hooks (compression, PowerSGD, post-local / hierarchical SGD)",
    ),
}
STRATEGY_NAMES: tuple[str, ...] = tuple(_REGISTERED)


def _register(name: str, cls: type, description: str) -> None:
    existing = StrategyRegistry.get(name) if name in StrategyRegistry else None
    if existing is not None and existing.get("strategy") is not cls:
        raise RuntimeError(
            f"Strategy name {name!r} is already registered by {existing.get('strategy')}; not shadowing it."
        )
    StrategyRegistry.register(name, cls, description=description, override=True)


for _name, (_cls, _description) in _REGISTERED.items():
    _register(_name, _cls, _description)

# gloo's worker threads must finish before the interpreter finalizes (see fsdp_strategies.runtime.clean_exit)
register_clean_exit()

__all__ = ["PREEMPT_EXIT_CODE", "STRATEGY_NAMES", "ActivationCheckpointing", "DDPHooksStrategy",
           "FSDP2Strategy",
           "FTHSDPStrategy", "GarbageCollection", "HSDPStrategy", "LocalAveragingSwitch", "MFUMonitor",
           "QuorumMember", "StragglerDetector",
           "export_consolidated", "export_hf", "parallelize", "verify_checkpoint"]
