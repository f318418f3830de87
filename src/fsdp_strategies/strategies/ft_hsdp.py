"""``ft_hsdp`` lives in :mod:`fsdp_strategies.ft.strategy` (fault tolerance has one home, :mod:`fsdp_strategies.ft`);
this module keeps the old import path working."""

from fsdp_strategies.ft.strategy import LEAVE_EXIT_CODE, FTHSDPStrategy, LighthouseUnreachableError

__all__ = ["LEAVE_EXIT_CODE", "FTHSDPStrategy", "LighthouseUnreachableError"]
