"""What callbacks need from a strategy, as small protocols: callbacks depend on these, never on a
concrete strategy class. Any strategy (this package's or a user's) that has the methods qualifies.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["LocalAveragingSwitch", "QuorumMember"]


@runtime_checkable
class LocalAveragingSwitch(Protocol):
    """A strategy that can switch between synchronous data parallel and local (periodic / hierarchical)
    parameter averaging at run time (``ddp_hooks`` with ``comm_hook: post_local_sgd | hierarchical_sgd``).

    Protocol: call :meth:`set_local_sgd` on every rank at the same step.
    """

    @property
    def local_sgd_available(self) -> bool:
        """Whether this instance is configured so that :meth:`set_local_sgd` works."""
        ...

    def set_local_sgd(self, enabled: bool, average: bool = True) -> None:
        """Turn local averaging on (``True``) or back to synchronous steps (``False``, averaging first if ``average``)."""
        ...


@runtime_checkable
class QuorumMember(Protocol):
    """A strategy whose replica group can leave a fault-tolerant quorum and be restarted (``ft_hsdp``).

    Protocol: call :meth:`leave_quorum` on every rank of the group at the same step (decided from data all
    of them share, e.g. a window gathered over the group's own process group); it does not return.
    """

    def leave_quorum(self, reason: str) -> None:
        """Make this replica group leave the job now; the others go on without it."""
        ...
