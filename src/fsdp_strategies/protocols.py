"""What callbacks need from a strategy, or from another callback, as small protocols: callbacks depend on
these, never on a concrete strategy class or on each other. Any object (this package's or a user's) that has
the methods qualifies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ActivationCheckpointingTarget", "HostPauseSource", "LocalAveragingSwitch", "NonFiniteLossSink",
           "PeerWaitSource", "QuorumMember", "SyncModeSwitch"]


@runtime_checkable
class ActivationCheckpointingTarget(Protocol):
    """A strategy that applies activation checkpointing itself, in its place in the order of the transforms
    (``fsdp2``, ``hsdp``, ``ft_hsdp``: :func:`fsdp_strategies.parallel.parallelize` runs tensor
    parallelism -> checkpointing -> compile -> FSDP).
    :class:`~fsdp_strategies.callbacks.ActivationCheckpointing` hands it its checkpointing instead of applying
    it right after ``configure_model`` (what it does for other strategies, which have no such place: Lightning
    calls no callback hook between ``configure_model`` and ``strategy.setup``).

    Protocol: the callback calls :meth:`set_activation_checkpointing` in ``Callback.setup`` on every rank,
    before ``strategy.setup``; the strategy calls ``apply(module)`` on the LightningModule in its set-up,
    after tensor parallelism and before compile and sharding. ``apply`` is idempotent (checkpointed blocks are
    marked), so a later set-up (validate, test) does not checkpoint a block twice.
    """

    def set_activation_checkpointing(self, apply: Callable[[nn.Module], object]) -> None:
        """Checkpoint the model with ``apply`` when the strategy parallelizes it."""
        ...


@runtime_checkable
class HostPauseSource(Protocol):
    """A callback that pauses this rank's host on purpose and says for how long (e.g.
    :class:`~fsdp_strategies.callbacks.GarbageCollection`'s scheduled collections), so that timing callbacks
    (:class:`~fsdp_strategies.callbacks.StragglerDetector`) do not count the pause as slowness of the rank.

    Protocol: a consumer finds sources in ``trainer.callbacks`` and calls :meth:`take_host_pause_s` once per
    step, at the end of its own timing of the step; the pause belongs to the step whose timing it fell in.
    """

    def take_host_pause_s(self) -> float:
        """Seconds of deliberate pauses on this rank since the previous call (0.0 when none); resets the
        count."""
        ...


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
        """Turn local averaging on (``True``) or back to synchronous steps (``False``, averaging first if
        ``average``)."""
        ...


@runtime_checkable
class NonFiniteLossSink(Protocol):
    """A strategy that averages gradients across replica groups inside the backward pass (``ft_hsdp``),
    where a group whose loss is not finite must leave the step's average before its gradients are reduced.

    Protocol: :class:`~fsdp_strategies.callbacks.NonFiniteGuard` calls :meth:`leave_step_if_nonfinite` on
    every rank before each backward pass (``on_before_backward``) with whether this rank's loss is
    non-finite.
    """

    def leave_step_if_nonfinite(self, loss_nonfinite: bool) -> None:
        """Agree with the other ranks and groups; a non-finite group then contributes nothing to this step."""
        ...


@runtime_checkable
class PeerWaitSource(Protocol):
    """A strategy whose ranks wait, at times, for other replica groups (``ft_hsdp``'s quorum and cross-group
    all-reduce), waits that the strategy bounds itself. :class:`~fsdp_strategies.callbacks.HangWatchdog` does
    not call a group hung while every rank of it waits for the others: the hung one is the group they wait
    for.

    Protocol: :meth:`peer_wait_s` may be called from any thread, at any time.
    """

    def peer_wait_s(self) -> float | None:
        """Seconds this rank has been waiting for other replica groups now; ``None`` when not waiting."""
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


@runtime_checkable
class SyncModeSwitch(Protocol):
    """A strategy that switches, by itself, between every-step cross-group reduction and semi-synchronous
    rounds while stragglers cost too much (``ft_hsdp(straggler_sync=...)``). The decision is the strategy's:
    it is agreed across replica groups inside a step that commits; the callback supplies the policy and the
    measurement.

    Protocol: call :meth:`configure_sync_switch` once before training (``setup``) on every rank; then, after
    each measurement window, :meth:`report_sync_cost` with a value that is identical on every rank of the
    group (e.g. computed from a window all ranks gathered), derived from :meth:`sync_cost_counters`.
    """

    @property
    def sync_switch_available(self) -> bool:
        """Whether this instance is configured to switch."""
        ...

    @property
    def semi_sync_active(self) -> bool:
        """Whether a semi-synchronous phase is active now."""
        ...

    @property
    def sync_switch_events(self) -> list[dict[str, Any]]:
        """Every switch so far (``step``, ``to``, ``cost``)."""
        ...

    def configure_sync_switch(self, threshold: float, patience: int) -> None:
        """Switch to rounds above ``threshold`` (fraction of the step time) for ``patience`` boundaries, back
        below half of it for ``patience`` boundaries."""
        ...

    def sync_cost_counters(self) -> tuple[float, float]:
        """Cumulative ``(cross_s, extra_s)`` of this rank: every-step-equivalent cross-group seconds, and
        seconds to add to the wall time for the every-step-equivalent wall time."""
        ...

    def report_sync_cost(self, cost: float) -> None:
        """This group's latest window cost (fraction of the step time)."""
        ...
