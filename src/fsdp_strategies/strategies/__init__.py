"""Strategies: thin Lightning glue over :mod:`fsdp_strategies.parallel`, :mod:`~fsdp_strategies.checkpoint`
and :mod:`~fsdp_strategies.runtime`. Pass their registry name to ``Trainer(strategy=...)`` or use them by
class.

``ft_hsdp`` builds on :class:`HSDPStrategy` and lives in :mod:`fsdp_strategies.ft` (it depends on this
package, not the other way round).
"""

from fsdp_strategies.strategies.ddp_hooks import DDPHooksStrategy
from fsdp_strategies.strategies.fsdp2 import FSDP2Strategy
from fsdp_strategies.strategies.hsdp import HSDPStrategy

__all__ = ["DDPHooksStrategy", "FSDP2Strategy", "HSDPStrategy"]
