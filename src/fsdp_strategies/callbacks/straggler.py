"""Straggler detection and mitigation for any Lightning strategy (this package's and Lightning's own).

Why a rank's *self time*: in a synchronous strategy every rank's step takes as long as the slowest
one, because the fast ranks wait inside the gradient collective. Wall-clock step times are therefore
equal and cannot name the straggler. Each step is split at Lightning hooks into

* ``data``: from the end of the previous step to ``on_train_batch_start`` (loading, host work;
  never contains a collective, so it is the rank's own time),
* ``compute`` (forward + backward): ``on_train_batch_start`` to ``on_before_optimizer_step``,
* ``optimizer``: ``on_before_optimizer_step`` to ``on_train_batch_end``,

and a rank's self time is ``data`` plus the *busy* time of ``compute`` and ``optimizer``: process
CPU time on CPU devices (time blocked in a collective is not CPU time), CUDA-event time on GPUs
(recorded every step without synchronising; resolved once per window). On GPUs that event time
includes waits the compute stream has on the communication stream, so under synchronous DDP/FSDP a
slow GPU is visible in the relative scores only as far as its compute stream is slower.

A *step* is one optimizer step. Under gradient accumulation (``accumulate_grad_batches=K``) it is all K
micro-batches: ``data`` is the loading time before each of them, ``compute`` their forward + backward
passes, ``optimizer`` the last one's optimizer step; ``window``, ``skip_first``, stall detection, the
reported step times (``step_time_*``, ``lost_s``) and every action count and time optimizer steps, and
an action (``stop``'s checkpoint, a switch, an eviction) happens only between two optimizer steps, never
between the micro-batches of one. (Under DDP's ``no_sync`` the ranks meet once per optimizer step, so a
rank slow in one micro-batch and fast in the next has lost nobody any time: per-step sums score that.)

Deliberate host pauses are not slowness: callbacks that implement
:class:`~fsdp_strategies.protocols.HostPauseSource` (e.g.
:class:`~fsdp_strategies.callbacks.GarbageCollection`) are asked at the end of every step how long they paused
since the previous step, and that time is subtracted from the step's self time (whether the pause fell into
the step's ``data`` part, when the source is listed after the detector, or into its ``optimizer`` part, when
listed before). It is reported per rank as ``pause`` (seconds per step, each window) and ``pause_s`` (run
total), and is neither self time nor waiting. A pause from anything else (an unscheduled collection, a stall)
counts as the rank's own time.

Every ``window`` steps one fixed-size ``all_gather`` exchanges the window's per-rank numbers; it is
started without waiting and read one step later, so no rank blocks on the detector. Every rank scores
the same gathered window with :class:`~fsdp_strategies.callbacks.straggler_scoring.StragglerScorer`
(relative and individual scores, hysteresis, transient stalls, time lost), so every rank reaches the
same decisions and the actions (``warn``, ``hierarchical_sgd``, ``semi_sync``, ``evict``, ``stop``)
happen in lock-step without a further collective.

The callback composes its parts, each in a module named after what it does: the measurement
(:mod:`~fsdp_strategies.callbacks.straggler_timing`), the window's gather
(:mod:`~fsdp_strategies.callbacks.straggler_gather`), the scores
(:mod:`~fsdp_strategies.callbacks.straggler_scoring`), one object per ``action``
(:mod:`~fsdp_strategies.callbacks.straggler_actions`, chosen once at construction) and the record and report
(:mod:`~fsdp_strategies.callbacks.straggler_report`).

Tests and demos make a rank slow with :class:`fsdp_strategies.testing.StallInjector`, a separate callback
listed before this one; the detector itself only measures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies._options import OptionError, check_choice, check_int
from fsdp_strategies.callbacks.straggler_actions import Action, ActionOptions, StragglerAction, make_action
from fsdp_strategies.callbacks.straggler_gather import WindowGather
from fsdp_strategies.callbacks.straggler_report import StragglerReport
from fsdp_strategies.callbacks.straggler_scoring import HEADER, StragglerScorer
from fsdp_strategies.callbacks.straggler_timing import OwnCost, StepTimer
from fsdp_strategies.protocols import HostPauseSource

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["StragglerDetector"]


class StragglerDetector(Callback):
    """Detects slow ranks from per-step timings and optionally mitigates them.

    Args:
        window: optimizer steps per measurement window; one small asynchronous ``all_gather`` per window,
            scored at the next step.
        skip_first: optimizer steps ignored at the start (warm-up, allocator, compilation).
        threshold: relative score (self time / the other ranks' median) above which a window is slow.
        patience: consecutive slow windows before a rank is a persistent straggler, and normal
            windows before it is cleared again (hysteresis).
        ewma_alpha: weight of the newest window in the smoothed scores.
        stall_factor: a single (optimizer) step counts as a transient stall when it takes this many times the
            other ranks' time for that step.
        min_excess_s: a window is slow, and a step a stall, only if the rank also needs at least this
            many seconds more than the others (ignores jitter of fast steps).
        top_k: worst ranks logged and reported.
        action: ``warn`` (default), ``hierarchical_sgd`` (with the ``ddp_hooks`` strategy and
            ``comm_hook: post_local_sgd | hierarchical_sgd``: train synchronously, switch to local
            averaging once the estimated straggler loss exceeds ``switch_threshold`` for ``patience``
            windows, switch back after ``patience`` windows below half of it), ``semi_sync`` (``ft_hsdp`` with
            ``straggler_sync: local_sgd | diloco``, a :class:`~fsdp_strategies.protocols.SyncModeSwitch`:
            every window, this group's cost -- the largest fraction of the every-step-equivalent wall time a
            rank of the group spent in cross-group operations, from the strategy's ``sync_cost_counters`` --
            is reported to the strategy, which switches every group to its semi-synchronous mode at the same
            committed step once the maximum over groups exceeds ``switch_threshold`` for ``patience``
            boundaries, and back below half of it; switches are listed in the report's ``events``), ``evict``
            (strategies with ``leave_quorum(reason)``, e.g. ``ft_hsdp``: when a rank becomes a persistent
            straggler, every rank of its replica group leaves the quorum at the same step, deciding from the
            same gathered window; the launcher restarts the group, which heals from the others), ``stop``
            (save a checkpoint, write the straggling hosts to ``hosts_file`` and exit with
            ``stop_exit_code``).
        switch_threshold: fraction of the step time lost to stragglers (``hierarchical_sgd``) or spent in
            cross-group operations (``semi_sync``) that triggers the switch.
        report_path: JSON report written by rank 0 (default ``<log_dir>/straggler_report.json``; under
            ``ft_hsdp`` ``straggler_report_group<id>.json``, and ``{replica_group_id}`` in the path is
            replaced).
        hosts_file: file with straggling host names for ``stop`` (default next to the report).
        stop_exit_code: exit status of the ``stop`` action.

    To make ranks slow in a test or demo, list the callback :class:`fsdp_strategies.testing.StallInjector`
    (configured by a :class:`fsdp_strategies.testing.StragglerInjection`) before this one.
    """

    def __init__(
        self,
        window: int = 20,
        skip_first: int = 2,
        threshold: float = 1.5,
        patience: int = 2,
        ewma_alpha: float = 0.5,
        stall_factor: float = 3.0,
        min_excess_s: float = 0.01,
        top_k: int = 3,
        action: Action = "warn",
        switch_threshold: float = 0.1,
        report_path: str | None = None,
        hosts_file: str | None = None,
        stop_exit_code: int = 3,
    ) -> None:
        super().__init__()
        for name, value, low in (("window", window, 2), ("skip_first", skip_first, 0),
                                 ("patience", patience, 1), ("top_k", top_k, 1)):
            check_int(name, value, low)
        if threshold <= 1.0:
            raise OptionError(
                f"threshold={threshold!r} must be above 1.0 (1.0 = as fast as the others). Fix: e.g. 1.5."
            )
        if not 0.0 < ewma_alpha <= 1.0:
            raise OptionError(f"ewma_alpha={ewma_alpha!r} is not in (0, 1]. Fix: e.g. 0.5.")
        check_choice("action", action, Action)
        if switch_threshold <= 0:
            raise OptionError(
                f"switch_threshold={switch_threshold!r} must be positive. Fix: e.g. 0.1 (10% of step time)."
            )
        self.window, self.skip_first, self.top_k = window, skip_first, top_k
        self.action, self.switch_threshold = action, switch_threshold
        self.report_path, self.hosts_file, self.stop_exit_code = report_path, hosts_file, stop_exit_code
        self._scorer_kwargs = {"threshold": threshold, "patience": patience, "ewma_alpha": ewma_alpha,
                               "stall_factor": stall_factor, "min_excess_s": min_excess_s}
        self.scorer: StragglerScorer | None = None  # built at setup, for the world size
        # the parts, each with its own state: measurement, exchange, response, record, own cost
        self.timer = StepTimer(window, skip_first)
        self.gather = WindowGather()
        self.handler: StragglerAction = make_action(action, ActionOptions(
            switch_threshold=switch_threshold, patience=patience, skip_first=skip_first,
            hosts_file=hosts_file, stop_exit_code=stop_exit_code))
        self.run_report = StragglerReport(self.report, top_k)
        self.cost = OwnCost()

    # ------------------------------------------------------------------ what the report holds
    @property
    def hosts(self) -> list[str]:
        """Each rank's host name (learnt at setup)."""
        return self.run_report.hosts

    @hosts.setter
    def hosts(self, hosts: list[str]) -> None:
        self.run_report.hosts = hosts

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every scored window of this run, in order."""
        return self.run_report.history

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every persistent / cleared rank and every action taken, in order."""
        return self.run_report.events

    @property
    def switched(self) -> bool:
        """Whether the action's switch (local averaging, semi-synchronous rounds) is on now."""
        return self.handler.switched

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.handler.setup(trainer.strategy)
        self.scorer = StragglerScorer(world_size=trainer.world_size, **self._scorer_kwargs)
        self.gather = WindowGather(trainer.world_size, trainer.strategy)
        self.run_report.setup(trainer, self.report_path)
        self.timer.cuda = trainer.strategy.root_device.type == "cuda"

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sources = [c for c in trainer.callbacks if isinstance(c, HostPauseSource) and c is not self]
        self.timer.train_start(sources)
        self.cost.train_start()
        self.handler.train_start(trainer.strategy)

    # ------------------------------------------------------------------ timing
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        with self.cost.charged("hook"):
            self.timer.batch_start()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        with self.cost.charged("hook"):
            self.timer.before_optimizer_step()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.timer.in_step:
            return
        with self.cost.charged("hook"):
            step_ended = self.timer.batch_end(seam.accumulating_gradients(trainer))
        if step_ended:
            with self.cost.charged("gather"):
                if self.gather.pending:  # the previous window's gather ran during this step: score it now
                    self._finish_window(trainer)
                self.handler.step_end(trainer.strategy, self.timer.steps, self.run_report)
                if self.timer.steps % self.window == 0:
                    local = self.timer.take_window()
                    extra = self.handler.window_columns(trainer.strategy)
                    self.gather.start(np.concatenate([local, extra]), trainer.global_step)
        self.timer.step_done()  # the detector's own time is not part of the next step

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.timer.skip_next = True

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self.timer.skip_next = True

    # ------------------------------------------------------------------ the window
    def _finish_window(self, trainer: pl.Trainer, final: bool = False) -> None:
        """Score the gathered window (at the step after it ended), log it, act on it."""
        assert self.scorer is not None
        gathered, step = self.gather.finish()
        gathered, extra = self.handler.split_gathered(gathered, trainer.strategy)
        result = self.scorer.update(gathered[:, :HEADER], gathered[:, HEADER:], step)
        if not result["measured"]:
            return
        result.update(extra)
        self.run_report.add(trainer, result, self.scorer)
        self._act(trainer, result, final=final)

    def _act(self, trainer: pl.Trainer, result: dict[str, Any], final: bool = False) -> None:
        self.run_report.note_changes(result)
        self.handler.act(trainer, result, self.run_report, final)

    # ------------------------------------------------------------------ report and state
    def report(self) -> dict[str, Any]:
        """Everything measured in this run (written as JSON by rank 0 at the end)."""
        return {
            "hosts": self.hosts, "window": self.window, "action": self.action,
            "settings": {**self._scorer_kwargs, "switch_threshold": self.switch_threshold},
            **self.run_report.summary(self.scorer), **self.cost.report(),
            "local_sgd_switched_on": self.switched,
            "sync_switches": [e for e in self.events if e.get("event") == "switch"],
        }

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.gather.pending:
            with self.cost.charged("gather"):
                self._finish_window(trainer, final=True)
        self.cost.train_end()
        if trainer.is_global_zero and self.scorer is not None:
            self.run_report.write()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"switched": self.handler.switched}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.handler.switched = bool(state_dict.get("switched", False))
