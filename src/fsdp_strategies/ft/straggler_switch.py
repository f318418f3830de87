"""``ft_hsdp(straggler_sync=...)``: switch between every-step cross-group reduction and local_sgd/diloco, and
back.

Why: with ``sync="every_step"`` every step waits for the slowest replica group's cross-group traffic; a
persistently slow group (or the link to it) costs every group that wait on every step. Semi-synchronous
rounds (:mod:`fsdp_strategies.ft.outer_sync`) pay it once per ``sync_every`` steps. ``straggler_sync`` starts
synchronous and falls back to the configured semi-synchronous mode only while the stragglers cost more
than ``switch_threshold`` of the step time, then comes back (synchronous training converges per step as a
single large-batch job; rounds of local steps do not).

This module holds the pieces that do not touch torchft or Lightning (unit-tested alone):

* :func:`validate_straggler_sync` -- option checks, before any process group exists.
* :class:`SwitchState` -- the agreed state: current mode, step offset, threshold/patience streak. It is
  part of the manager's heal state (key :data:`STATE_KEY`) so a healed group decides identically.
* :func:`decide` -- threshold/patience with hysteresis (switch to local rounds while the cost is above
  the threshold for ``patience`` boundaries; back when below half of it for ``patience`` boundaries).
* :class:`CostClock` -- the cost estimator (see its docstring for what it measures and what it assumes).

The agreement (the vote inside a step or outer sync) and the switch itself are
:mod:`fsdp_strategies.ft.semi_sync`'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from fsdp_strategies.ft.outer_sync import validate_sync_options

__all__ = ["STATE_KEY", "STRAGGLER_SYNC_MODES", "CostClock", "StragglerSync", "SwitchState", "decide",
           "validate_straggler_sync"]

StragglerSync = Literal["off", "local_sgd", "diloco"]
#: valid values of ``straggler_sync``
STRAGGLER_SYNC_MODES: tuple[str, ...] = get_args(StragglerSync)
#: the manager state-dict key of the switch's part of the heal state
STATE_KEY = "fsdp_strategies_switch"


def validate_straggler_sync(straggler_sync: str, sync: str, sync_every: int, outer_lr: float,
                            outer_momentum: float, num_fragments: int, data_on_failure: str) -> None:
    """Raise ``ValueError`` naming the option, its value and the fix (before any process group exists)."""
    if straggler_sync not in STRAGGLER_SYNC_MODES:
        raise ValueError(f"ft_hsdp: straggler_sync={straggler_sync!r} is not a valid value. Fix: set "
                         f"strategy.init_args.straggler_sync to one of {STRAGGLER_SYNC_MODES}.")
    if straggler_sync == "off":
        return
    if sync != "every_step":
        raise ValueError(
            f"ft_hsdp: straggler_sync={straggler_sync!r} with sync={sync!r}: the switch starts synchronous "
            "and falls back to straggler_sync's mode. Fix: sync='every_step' (sync_every, outer_lr, "
            "outer_momentum then describe the fallback), or straggler_sync='off'."
        )
    if data_on_failure == "redistribute":
        raise ValueError(
            f"ft_hsdp: data_on_failure='redistribute' with straggler_sync={straggler_sync!r}: the "
            "semi-synchronous phases form a quorum only at outer syncs. Fix: data_on_failure='skip', or "
            "straggler_sync='off'."
        )
    if isinstance(num_fragments, bool) or num_fragments != 1:
        raise ValueError(
            f"ft_hsdp: num_fragments={num_fragments!r} with straggler_sync={straggler_sync!r}: switching "
            "back to every-step reduction needs every parameter synced at the same step, which streaming "
            "DiLoCo never does. Fix: num_fragments=1."
        )
    validate_sync_options(
        straggler_sync, sync_every, outer_lr, outer_momentum, num_fragments, data_on_failure
    )


@dataclass
class SwitchState:
    """What every group must agree on; travels with the heal state.

    ``semi``: a semi-synchronous phase is active. ``offset``: committed inner steps minus the manager's step
    (the manager counts every-step steps and outer syncs; the data position counts inner steps).
    ``streak``: consecutive boundaries that voted for the other mode. ``switches``: switches so far.
    """

    semi: bool = False
    offset: int = 0
    streak: int = 0
    switches: int = 0

    def save(self) -> dict[str, int]:
        return {k: int(v) for k, v in asdict(self).items()}

    def load(self, state: dict[str, Any]) -> None:
        self.semi = bool(state["semi"])
        self.offset, self.streak, self.switches = (
            int(state["offset"]),
            int(state["streak"]),
            int(state["switches"]),
        )


def decide(semi: bool, streak: int, cost: float, threshold: float, patience: int) -> tuple[bool, int]:
    """``(semi after this boundary, new streak)`` from the agreed ``cost`` of one boundary.

    Synchronous: a boundary with ``cost > threshold`` extends the streak; ``patience`` in a row switch to the
    semi-synchronous mode. Semi-synchronous: ``cost < threshold / 2`` extends it; ``patience`` switch back.
    Any other boundary resets the streak (hysteresis: no flapping around one threshold).
    """
    wants_other = cost > threshold if not semi else cost < threshold / 2
    streak = streak + 1 if wants_other else 0
    if streak >= patience:
        return not semi, 0
    return semi, streak


class CostClock:
    """What cross-group traffic costs this rank, as a fraction of the step time *if every step reduced across
    groups*.

    Measured by the strategy, per Lightning step:

    * synchronous phases: the seconds this rank spends in cross-group operations -- the quorum (with
      ``straggler_sync`` the quorum is synchronous, so this is the wait for the slowest group to arrive),
      every FSDP unit's cross-group all-reduce, the switch vote and ``should_commit``. A slow group (or
      link) shows up on *every* group: the others wait for it inside these operations.
    * semi-synchronous phases: inner steps have no such traffic, so the every-step cost is *estimated* from
      the last outer sync: ``quorum_s / round_steps + (sync_s - quorum_s)`` per step. The quorum is where the
      groups wait for the slowest one to finish its round; a group slower by ``d`` per step makes the others
      wait ``round_steps * d`` there, which every-step reduction would pay as ``d`` per step. The rest of the
      sync (pseudo-gradient all-reduces of all parameters, vote, ``should_commit``) moves the same bytes as
      one every-step step (gradients of the same parameters) through the same commit, so every step would pay
      it. Each step's wall time is replaced by ``wall - actual cross-group time + estimate``. Limits: random
      (non-persistent) skew between groups accumulates over a round less than linearly, so dividing the
      quorum wait by ``round_steps`` under-estimates it; the quorum's own fixed cost (lighthouse round trip)
      is divided too; the overlap of the quorum with compute that ``use_async_quorum`` gives synchronous
      steps is ignored (it is off with ``straggler_sync``: torchft's DiLoCo needs the synchronous quorum).

    :meth:`counters` returns cumulative ``(cross_s, extra_s)``: every-step-equivalent cross-group seconds,
    and seconds to add to the measured wall time to get the every-step-equivalent wall time. A window's
    cost is ``d(cross_s) / (d(wall) + d(extra_s))`` (``StragglerDetector(action="semi_sync")`` computes it).
    """

    def __init__(self) -> None:
        self.cross_s = 0.0
        self.extra_s = 0.0
        #: the every-step-equivalent cross-group seconds per step: of the last synchronous step / outer sync
        self.per_step_s = 0.0

    def synchronous_step(self, cross_s: float) -> None:
        self.cross_s += cross_s
        self.per_step_s = cross_s

    def sync_step(self, sync_s: float, quorum_s: float, round_steps: int) -> None:
        """A semi-synchronous step that ended with an outer sync of ``sync_s`` seconds (``quorum_s`` of them
        in the quorum) covering ``round_steps`` inner steps."""
        self.per_step_s = quorum_s / max(round_steps, 1) + max(sync_s - quorum_s, 0.0)
        self.cross_s += self.per_step_s
        self.extra_s += self.per_step_s - sync_s

    def inner_step(self) -> None:
        """A semi-synchronous step without cross-group traffic: charged the last estimate."""
        self.cross_s += self.per_step_s
        self.extra_s += self.per_step_s

    def counters(self) -> tuple[float, float]:
        return self.cross_s, self.extra_s
