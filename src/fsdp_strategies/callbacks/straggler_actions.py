"""What :class:`~fsdp_strategies.callbacks.StragglerDetector` does about stragglers: one object per value of
its ``action`` option, chosen once when the detector is built.

Why objects: each action needs something different of the strategy (a protocol of
:mod:`fsdp_strategies.protocols`, checked at ``setup`` with an error that names the fix), at different moments
(training start, every optimizer step, every window's gathered numbers, every scored window), and keeps its
own state (a switch's streak, the cost clock's base). Each class holds exactly that; the detector calls every
hook of :class:`StragglerAction` and never asks which action it has.

Every rank calls the same hooks with the same gathered window, so every rank acts at the same step without a
further collective (the protocols require calls on every rank at the same step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from fsdp_strategies._options import OptionError
from fsdp_strategies.protocols import LocalAveragingSwitch, QuorumMember, SyncModeSwitch

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from fsdp_strategies.callbacks.straggler_report import StragglerReport

__all__ = ["ACTIONS", "Action", "ActionOptions", "Evict", "HierarchicalSGD", "SemiSync", "Stop",
           "StragglerAction", "Warn", "make_action"]

Action = Literal["warn", "hierarchical_sgd", "semi_sync", "evict", "stop"]


@dataclass(frozen=True)
class ActionOptions:
    """The detector's options the actions use (documented on
    :class:`~fsdp_strategies.callbacks.StragglerDetector`)."""

    switch_threshold: float = 0.1
    patience: int = 2
    skip_first: int = 2
    hosts_file: str | None = None
    stop_exit_code: int = 3


class StragglerAction:
    """The detector's response to scored windows; the base class does nothing beyond the detector's warnings.

    ``switched`` is whether a mode switch is on now (local averaging, semi-synchronous rounds); it is the
    detector's checkpointed state and the report's ``local_sgd_switched_on``.
    """

    name: ClassVar[str]

    def __init__(self, options: ActionOptions) -> None:
        self.options = options
        self.switched = False

    def setup(self, strategy: Any) -> None:
        """Check that the strategy can do this action (before training, on every rank)."""

    def train_start(self, strategy: Any) -> None:
        """Training starts (after the detector's own timers)."""

    def step_end(self, strategy: Any, steps: int, report: StragglerReport) -> None:
        """Optimizer step number ``steps`` (1-based) ended and the previous window, if any, was scored."""

    def window_columns(self, strategy: Any) -> np.ndarray:
        """Numbers of this rank that travel with the window's timings in the same gather (appended)."""
        return np.zeros(0)

    def split_gathered(self, gathered: np.ndarray, strategy: Any) -> tuple[np.ndarray, dict[str, Any]]:
        """Take :meth:`window_columns`' columns off the gathered window: (the timings, entries for the
        result)."""
        return gathered, {}

    def act(self, trainer: pl.Trainer, result: dict[str, Any], report: StragglerReport, final: bool) -> None:
        """Respond to one scored window (``final``: the last one, at the end of training: no step follows)."""


class Warn(StragglerAction):
    """``warn``: the detector's warnings, log lines and report are all it does."""

    name = "warn"


class HierarchicalSGD(StragglerAction):
    """``hierarchical_sgd``: synchronous DDP until the straggler loss exceeds ``switch_threshold`` for
    ``patience`` windows, then local (hierarchical) averaging, back below half of it (a
    :class:`~fsdp_strategies.protocols.LocalAveragingSwitch`)."""

    name = "hierarchical_sgd"

    def __init__(self, options: ActionOptions) -> None:
        super().__init__(options)
        self.streak = 0  # consecutive windows that want the other mode

    def setup(self, strategy: Any) -> None:
        if isinstance(strategy, LocalAveragingSwitch) and strategy.local_sgd_available:
            return
        comm_hook = getattr(strategy, "comm_hook", None)
        raise OptionError(
            f"action='hierarchical_sgd' needs the ddp_hooks strategy with comm_hook post_local_sgd or "
            f"hierarchical_sgd (a LocalAveragingSwitch), but the strategy is {type(strategy).__name__}"
            f"{' with comm_hook=' + repr(comm_hook) if comm_hook is not None else ''}. "
            "Fix: strategy: {class_path: fsdp_strategies.DDPHooksStrategy, init_args: {comm_hook: "
            "hierarchical_sgd}}, or another action.")

    def train_start(self, strategy: Any) -> None:
        if not self.switched:
            assert isinstance(strategy, LocalAveragingSwitch)
            strategy.set_local_sgd(False, average=False)

    def act(self, trainer: pl.Trainer, result: dict[str, Any], report: StragglerReport, final: bool) -> None:
        if final:  # no step is left to switch for
            return
        step, lost = trainer.global_step, result["lost_frac"]  # this window; the patience streak smooths
        threshold = self.options.switch_threshold
        want = lost > threshold if not self.switched else lost > threshold / 2
        self.streak = self.streak + 1 if want != self.switched else 0
        if self.streak < self.options.patience:
            return
        self.switched, self.streak = want, 0
        strategy = trainer.strategy
        assert isinstance(strategy, LocalAveragingSwitch)
        strategy.set_local_sgd(want)
        report.events.append({"step": step, "event": "local_sgd_on" if want else "local_sgd_off",
                              "lost_frac": lost})
        rank_zero_info(f"StragglerDetector: "
                       f"{'local (hierarchical) averaging on' if want else 'back to synchronous DDP'}"
                       f" at step {step}: straggler loss {lost:.1%} of the step time.")


class SemiSync(StragglerAction):
    """``semi_sync``: every window, this group's cross-group cost goes to the strategy (a
    :class:`~fsdp_strategies.protocols.SyncModeSwitch`), which decides the switch; its switches are copied
    into the report's events.

    The cost is the largest fraction of the every-step-equivalent wall time a rank of the group spent in
    cross-group operations: each rank appends its (cross-group seconds, every-step-equivalent wall seconds) of
    the window to the gathered timings, so every rank computes the same number.
    """

    name = "semi_sync"

    def __init__(self, options: ActionOptions) -> None:
        super().__init__(options)
        # (wall, cross_s, extra_s) at the window's start
        self.cost_base: tuple[float, float, float] | None = None
        self.seen_switches = 0

    def setup(self, strategy: Any) -> None:
        if not (isinstance(strategy, SyncModeSwitch) and strategy.sync_switch_available):
            mode = getattr(strategy, "straggler_sync", None)
            raise OptionError(
                "action='semi_sync' needs ft_hsdp with straggler_sync local_sgd or diloco "
                f"(a SyncModeSwitch), but the strategy is {type(strategy).__name__}"
                f"{'' if mode is None else f' with straggler_sync={mode!r}'}. "
                "Fix: strategy: {class_path: fsdp_strategies.FTHSDPStrategy, init_args: "
                "{straggler_sync: diloco}}, or another action.")
        strategy.configure_sync_switch(self.options.switch_threshold, self.options.patience)

    def _restart_cost_clock(self, strategy: SyncModeSwitch) -> None:
        self.cost_base = (time.perf_counter(), *strategy.sync_cost_counters())

    def train_start(self, strategy: Any) -> None:
        self._restart_cost_clock(strategy)

    def step_end(self, strategy: Any, steps: int, report: StragglerReport) -> None:
        """Copy the strategy's switches (decided and logged there) into the report; restart the cost clock
        after
        the warm-up."""
        assert isinstance(strategy, SyncModeSwitch)
        events = strategy.sync_switch_events
        report.events.extend(dict(event) for event in events[self.seen_switches:])
        self.seen_switches = len(events)
        self.switched = strategy.semi_sync_active
        if steps == self.options.skip_first:  # warm-up (the first quorum waits for every group to start)
            self._restart_cost_clock(strategy)

    def window_columns(self, strategy: Any) -> np.ndarray:
        """This rank's (cross-group seconds, every-step-equivalent wall seconds) of the window ending now."""
        now, (cross, extra) = time.perf_counter(), strategy.sync_cost_counters()
        base = self.cost_base or (now, cross, extra)
        self.cost_base = (now, cross, extra)
        return np.array([cross - base[1], (now - base[0]) + (extra - base[2])])

    def split_gathered(self, gathered: np.ndarray, strategy: Any) -> tuple[np.ndarray, dict[str, Any]]:
        timings, cost = gathered[:, :-2], gathered[:, -2:]
        # the group's cost: its worst rank (every rank computes the same number from the same gathered window)
        sync_cost = float(np.max(cost[:, 0] / np.maximum(cost[:, 1], 1e-9)))
        assert isinstance(strategy, SyncModeSwitch)
        strategy.report_sync_cost(sync_cost)
        return timings, {"sync_cost": sync_cost}


class Evict(StragglerAction):
    """``evict``: when a rank becomes a persistent straggler, every rank of its replica group leaves the
    quorum at the same step (a :class:`~fsdp_strategies.protocols.QuorumMember`); the launcher restarts the
    group.

    Why every rank and no extra collective: the detector's world is the strategy's own process group, which
    under ``ft_hsdp`` is one replica group; every rank of it scored the same gathered window with the same
    code, so every rank reaches this point at the same step with the same ``newly_persistent`` list. A rank
    left behind would block in the group's next FSDP collective until torchrun tore the group down; leaving
    together makes the exit immediate and its cause visible (``LEAVE_EXIT_CODE``).
    """

    name = "evict"

    def setup(self, strategy: Any) -> None:
        if not isinstance(strategy, QuorumMember):
            raise OptionError(
                f"action='evict' needs a fault-tolerant strategy with leave_quorum(reason) (e.g. ft_hsdp), "
                f"but the strategy is {type(strategy).__name__}. "
                "Fix: strategy: ft_hsdp, or action: warn / stop.")

    def act(self, trainer: pl.Trainer, result: dict[str, Any], report: StragglerReport, final: bool) -> None:
        if not result["newly_persistent"] or final:
            return
        hosts = report.hosts
        named = ", ".join(f"rank {r} on {hosts[r]} (relative score {result['relative'][r]:.2f})"
                          for r in result["newly_persistent"])
        report.events.append({"step": result["step"], "event": "evict",
                              "ranks": list(result["newly_persistent"]), "left_at_step": trainer.global_step})
        if trainer.is_global_zero:  # the report would be lost with the process otherwise
            report.write()
        strategy = trainer.strategy
        assert isinstance(strategy, QuorumMember)
        strategy.leave_quorum(f"persistent straggler in this group at step {trainer.global_step}: {named}")


class Stop(StragglerAction):
    """``stop``: once a rank is a persistent straggler, save a checkpoint, write the straggling hosts to
    ``hosts_file`` (default: next to the report) and exit with ``stop_exit_code`` on every rank, so a
    scheduler
    can restart the job without those hosts."""

    name = "stop"

    def act(self, trainer: pl.Trainer, result: dict[str, Any], report: StragglerReport, final: bool) -> None:
        if not result["persistent"]:
            return
        hosts = sorted({report.hosts[r] for r in result["persistent"]})
        where = report.path
        hosts_file = (Path(self.options.hosts_file) if self.options.hosts_file
                      else where.with_name("straggling_hosts.txt"))
        ckpt = where.with_name("straggler_stop.ckpt")
        report.events.append({"step": result["step"], "event": "stop", "hosts": hosts,
                              "checkpoint": str(ckpt)})
        trainer.save_checkpoint(str(ckpt))
        if trainer.is_global_zero:
            hosts_file.parent.mkdir(parents=True, exist_ok=True)
            hosts_file.write_text("".join(f"{h}\n" for h in hosts))
            report.write()
        trainer.strategy.barrier("straggler_stop")
        rank_zero_warn(f"StragglerDetector: stopping at step {result['step']}: straggling hosts {hosts} "
                       f"written to {hosts_file}, checkpoint {ckpt}.")
        raise SystemExit(self.options.stop_exit_code)


#: The class of each value of the ``action`` option
ACTIONS: dict[str, type[StragglerAction]] = {
    cls.name: cls for cls in (Warn, HierarchicalSGD, SemiSync, Evict, Stop)}


def make_action(action: str, options: ActionOptions) -> StragglerAction:
    """The object for one (already checked) value of the ``action`` option."""
    return ACTIONS[action](options)
