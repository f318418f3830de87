"""Strategies: pass their registry name to ``Trainer(strategy=...)`` or use them by class."""

from fsdp_strategies.ft.strategy import FTHSDPStrategy
from fsdp_strategies.strategies.ddp_hooks import DDPHooksStrategy
from fsdp_strategies.strategies.fsdp2 import FSDP2Strategy
from fsdp_strategies.strategies.hsdp import HSDPStrategy

__all__ = ["DDPHooksStrategy", "FSDP2Strategy", "FTHSDPStrategy", "HSDPStrategy"]
