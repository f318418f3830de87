"""Strategies: pass their registry name to ``Trainer(strategy=...)`` or use them by class."""

from fsdp_strategies.strategies.fsdp import FSDP2Strategy
from fsdp_strategies.strategies.hsdp import HSDPStrategy

__all__ = ["FSDP2Strategy", "HSDPStrategy"]
