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
:class:`~fsdp_strategies.protocols.HostPauseSource` (e.g. :class:`~fsdp_strategies.callbacks.GarbageCollection`)
are asked at the end of every step how long they paused since the previous step, and that time is
subtracted from the step's self time (whether the pause fell into the step's ``data`` part, when the source
is listed after the detector, or into its ``optimizer`` part, when listed before). It is reported per rank
as ``pause`` (seconds per step, each window) and ``pause_s`` (run total), and is neither self time nor
waiting. A pause from anything else (an unscheduled collection, a stall) counts as the rank's own time.

Every ``window`` steps one fixed-size ``all_gather`` exchanges the window's per-rank numbers; it is
started without waiting and read one step later, so no rank blocks on the detector. Every rank scores
the same gathered window with :class:`~fsdp_strategies.callbacks.straggler_scoring.StragglerScorer`
(relative and individual scores, hysteresis, transient stalls, time lost), so every rank reaches the
same decisions and the actions (``warn``, ``hierarchical_sgd``, ``semi_sync``, ``evict``, ``stop``)
happen in lock-step without a further collective.

Tests and demos make a rank slow with :class:`fsdp_strategies.testing.StallInjector`, a separate callback
listed before this one; the detector itself only measures.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies._atomic_file import write_text_atomically
from fsdp_strategies._distributed import in_process_group
from fsdp_strategies._options import OptionError, check_choice, check_int
from fsdp_strategies.callbacks.straggler_scoring import HEADER, StragglerScorer
from fsdp_strategies.protocols import HostPauseSource, LocalAveragingSwitch, QuorumMember, SyncModeSwitch

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["StragglerDetector"]

Action = Literal["warn", "hierarchical_sgd", "semi_sync", "evict", "stop"]


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
            ``straggler_sync: local_sgd | diloco``, a :class:`~fsdp_strategies.protocols.SyncModeSwitch`: every window,
            this group's cost -- the largest fraction of the every-step-equivalent wall time a rank of the group
            spent in cross-group operations, from the strategy's ``sync_cost_counters`` -- is reported to the
            strategy, which switches every group to its semi-synchronous mode at the same committed step once the
            maximum over groups exceeds ``switch_threshold`` for ``patience`` boundaries, and back below half of it;
            switches are listed in the report's ``events``), ``evict`` (strategies with ``leave_quorum(reason)``, e.g. ``ft_hsdp``:
            when a rank becomes a persistent straggler, every rank of its replica group leaves the quorum
            at the same step, deciding from the same gathered window; the launcher restarts the group,
            which heals from the others), ``stop`` (save a checkpoint, write the
            straggling hosts to ``hosts_file`` and exit with ``stop_exit_code``).
        switch_threshold: fraction of the step time lost to stragglers (``hierarchical_sgd``) or spent in
            cross-group operations (``semi_sync``) that triggers the switch.
        report_path: JSON report written by rank 0 (default ``<log_dir>/straggler_report.json``; under ``ft_hsdp``
            ``straggler_report_group<id>.json``, and ``{replica_group_id}`` in the path is replaced).
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
        for name, value, low in (("window", window, 2), ("skip_first", skip_first, 0), ("patience", patience, 1),
                                 ("top_k", top_k, 1)):
            check_int(name, value, low)
        if threshold <= 1.0:
            raise OptionError(f"threshold={threshold!r} must be above 1.0 (1.0 = as fast as the others). Fix: e.g. 1.5.")
        if not 0.0 < ewma_alpha <= 1.0:
            raise OptionError(f"ewma_alpha={ewma_alpha!r} is not in (0, 1]. Fix: e.g. 0.5.")
        check_choice("action", action, Action)
        if switch_threshold <= 0:
            raise OptionError(f"switch_threshold={switch_threshold!r} must be positive. Fix: e.g. 0.1 (10% of step time).")
        self.window, self.skip_first, self.top_k = window, skip_first, top_k
        self.action, self.switch_threshold = action, switch_threshold
        self.report_path, self.hosts_file, self.stop_exit_code = report_path, hosts_file, stop_exit_code
        self._scorer_kwargs = {"threshold": threshold, "patience": patience, "ewma_alpha": ewma_alpha,
                               "stall_factor": stall_factor, "min_excess_s": min_excess_s}
        self.scorer: StragglerScorer | None = None
        self.hosts: list[str] = []
        self.history: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.switched = False
        self._switch_streak = 0
        self._seen_switches = 0
        self._cost_base: tuple[float, float, float] | None = None  # semi_sync: (wall, cross_s, extra_s) at window start
        self._reset_window()
        self._t_prev_end: float | None = None
        self._skip_next = True
        self._in_step = False  # inside an optimizer step (between its first micro-batch's start and its end)
        self._batches = 0  # optimizer steps seen
        self._gather_s = 0.0
        self._hook_s = 0.0
        self._cpu_s = 0.0  # CPU time of the detector's own code (this thread), excluding waiting for a core
        self._train_s = 0.0
        self._t_train_start: float | None = None
        self._cuda = False
        self._report_file: Path | None = None
        self._pending: tuple[Callable[[], np.ndarray], int] | None = None  # a window's gather in flight
        self._pause_sources: list[HostPauseSource] = []

    # ------------------------------------------------------------------ setup
    def _reset_window(self) -> None:
        self._sums = np.zeros(HEADER, dtype=np.float64)
        self._self_steps = np.full(getattr(self, "window", 2), np.nan, dtype=np.float64)
        self._events: list[tuple[int, float, Any, Any, Any, float, float]] = []
        self._slot = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if self.action == "hierarchical_sgd" and not (
            isinstance(strategy, LocalAveragingSwitch) and strategy.local_sgd_available
        ):
            comm_hook = getattr(strategy, "comm_hook", None)
            raise OptionError(
                f"action='hierarchical_sgd' needs the ddp_hooks strategy with comm_hook post_local_sgd or "
                f"hierarchical_sgd (a LocalAveragingSwitch), but the strategy is {type(strategy).__name__}"
                f"{' with comm_hook=' + repr(comm_hook) if comm_hook is not None else ''}. "
                "Fix: strategy: {class_path: fsdp_strategies.DDPHooksStrategy, init_args: {comm_hook: "
                "hierarchical_sgd}}, or another action.")
        if self.action == "semi_sync":
            if not (isinstance(strategy, SyncModeSwitch) and strategy.sync_switch_available):
                mode = getattr(strategy, "straggler_sync", None)
                raise OptionError(
                    f"action='semi_sync' needs ft_hsdp with straggler_sync local_sgd or diloco (a SyncModeSwitch), but "
                    f"the strategy is {type(strategy).__name__}"
                    f"{'' if mode is None else f' with straggler_sync={mode!r}'}. "
                    "Fix: strategy: {class_path: fsdp_strategies.FTHSDPStrategy, init_args: {straggler_sync: diloco}}, "
                    "or another action.")
            strategy.configure_sync_switch(self.switch_threshold, self._scorer_kwargs["patience"])
        if self.action == "evict" and not isinstance(strategy, QuorumMember):
            raise OptionError(
                f"action='evict' needs a fault-tolerant strategy with leave_quorum(reason) (e.g. ft_hsdp), but the "
                f"strategy is {type(strategy).__name__}. Fix: strategy: ft_hsdp, or action: warn / stop.")
        world = trainer.world_size
        self.scorer = StragglerScorer(world_size=world, **self._scorer_kwargs)
        host = socket.gethostname()
        if world > 1 and in_process_group():
            hosts: list[Any] = [None] * world
            dist.all_gather_object(hosts, host)
            self.hosts = [str(h) for h in hosts]
        else:
            self.hosts = [host]
        self._cuda = trainer.strategy.root_device.type == "cuda"
        # resolved here, on every rank: ``trainer.log_dir`` is a collective (a broadcast)
        self._report_file = self._report_path(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.action == "hierarchical_sgd" and not self.switched:
            strategy = trainer.strategy
            assert isinstance(strategy, LocalAveragingSwitch)
            strategy.set_local_sgd(False, average=False)
        self._pause_sources = [c for c in trainer.callbacks if isinstance(c, HostPauseSource) and c is not self]
        self._t_prev_end = None
        self._in_step = False
        self._t_train_start = time.perf_counter()
        if self.action == "semi_sync":
            self._cost_base = (time.perf_counter(), *trainer.strategy.sync_cost_counters())

    # ------------------------------------------------------------------ timing
    def _busy_clock(self) -> float:
        return time.process_time()

    def _cuda_event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        cpu0, now = time.thread_time(), time.perf_counter()
        gap = (now - self._t_prev_end) if self._t_prev_end is not None else math.nan
        if getattr(self, "_in_step", False):  # a later micro-batch of the same (accumulating) step
            self._data += gap  # loading the next micro-batch is data time too
        else:  # the first (or only) micro-batch of an optimizer step
            self._in_step = True
            self._data, self._compute, self._optim, self._busy = gap, 0.0, 0.0, 0.0
            self._ev_start = self._cuda_event() if self._cuda else None
            self._t_opt: float | None = None
        self._t_start, self._c_start = now, self._busy_clock()
        self._hook_s += time.perf_counter() - now
        self._cpu_s += time.thread_time() - cpu0

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if getattr(self, "_t_opt", None) is None and hasattr(self, "_t_start"):
            cpu0 = time.thread_time()
            self._t_opt, self._c_opt = time.perf_counter(), self._busy_clock()
            self._ev_opt = self._cuda_event() if self._cuda else None
            self._hook_s += time.perf_counter() - self._t_opt
            self._cpu_s += time.thread_time() - cpu0

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not getattr(self, "_in_step", False):
            return
        cpu0 = time.thread_time()
        t_end, c_end = time.perf_counter(), self._busy_clock()
        t_opt = self._t_opt if self._t_opt is not None else t_end
        self._compute += t_opt - self._t_start  # this micro-batch's forward + backward
        self._optim += t_end - t_opt
        self._busy += c_end - self._c_start
        if seam.accumulating_gradients(trainer):  # a non-final micro-batch: the optimizer step is not over yet
            self._hook_s += time.perf_counter() - t_end
            self._cpu_s += time.thread_time() - cpu0
            self._t_prev_end = time.perf_counter()
            return
        self._in_step = False
        ev_end = self._cuda_event() if self._cuda else None
        pause = sum(source.take_host_pause_s() for source in self._pause_sources)  # taken every step, measured or not
        compute, optim = self._compute, self._optim
        measured = not (self._skip_next or self._batches < self.skip_first or math.isnan(self._data))
        if measured and self._slot < self.window:
            if self._cuda:
                self._events.append((self._slot, self._data, self._ev_start, self._ev_opt if self._t_opt else ev_end,
                                     ev_end, pause, compute + optim))
            else:
                self._record(self._slot, self._data, compute, optim, self._busy, pause)
            self._slot += 1
        self._skip_next = False
        self._batches += 1  # optimizer steps seen
        t0 = time.perf_counter()
        self._hook_s += t0 - t_end
        if self._pending is not None:  # the previous window's gather ran during this step: score it now
            self._finish_window(trainer)
        if self.action == "semi_sync":
            self._collect_switches(trainer)
            if self._batches == self.skip_first:  # warm-up (the first quorum waits for every group to start)
                self._cost_base = (time.perf_counter(), *trainer.strategy.sync_cost_counters())
        if self._batches % self.window == 0:
            self._end_window(trainer)
        self._gather_s += time.perf_counter() - t0
        self._cpu_s += time.thread_time() - cpu0
        self._t_prev_end = time.perf_counter()  # the detector's own time is not part of the next step

    def _record(self, slot: int, data: float, compute: float, optim: float, busy: float, pause: float) -> None:
        step = data + compute + optim
        own = max(0.0, data + min(busy, compute + optim) - pause)  # a reported pause is not the rank's slowness
        self._sums += np.array([1.0, data, compute, optim, step, own, max(0.0, step - own - pause), pause])
        self._self_steps[slot] = own

    def _resolve_cuda(self) -> None:
        if not self._events:
            return
        self._events[-1][4].synchronize()
        for slot, data, ev_s, ev_o, ev_e, pause, wall in self._events:
            compute_gpu = ev_s.elapsed_time(ev_o) / 1e3
            opt_gpu = ev_o.elapsed_time(ev_e) / 1e3
            # wall parts are not known separately here; attribute the wall time by the GPU split
            frac = compute_gpu / max(compute_gpu + opt_gpu, 1e-9)
            self._record(slot, data, wall * frac, wall * (1 - frac), compute_gpu + opt_gpu, pause)
        self._events = []

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._skip_next = True

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._skip_next = True

    # ------------------------------------------------------------------ the window
    def _start_gather(self, trainer: pl.Trainer, local: np.ndarray) -> Callable[[], np.ndarray]:
        """Start the window's all_gather without waiting; the returned function waits for it.

        It overlaps the next step, so no rank blocks on the others here: in synchronous training the
        next step's gradient all-reduce would wait for the slowest rank anyway, and with local SGD a
        rank should not be held back by a collective of the detector.
        """
        world = trainer.world_size
        if world == 1 or not in_process_group():
            return lambda: local[None, :]
        device = trainer.strategy.root_device if dist.get_backend() == "nccl" else torch.device("cpu")
        mine = torch.from_numpy(local).to(device)
        out = [torch.empty_like(mine) for _ in range(world)]
        work = dist.all_gather(out, mine, async_op=True)

        def wait() -> np.ndarray:
            assert work is not None and mine is not None  # keep the input alive until the gather is done
            work.wait()
            return torch.stack(out).cpu().numpy()

        return wait

    def _end_window(self, trainer: pl.Trainer) -> None:
        if self._cuda:
            self._resolve_cuda()
        local = np.concatenate([self._sums, self._self_steps, self._cost_window(trainer)])
        self._reset_window()
        self._pending = (self._start_gather(trainer, local), trainer.global_step)

    def _finish_window(self, trainer: pl.Trainer, final: bool = False) -> None:
        """Score the gathered window (at the step after it ended), log it, act on it."""
        assert self._pending is not None and self.scorer is not None
        wait, step = self._pending
        self._pending = None
        gathered = wait()
        if self.action == "semi_sync":
            gathered, cost = gathered[:, :-2], gathered[:, -2:]
            # the group's cost: its worst rank (every rank computes the same number from the same gathered window)
            sync_cost = float(np.max(cost[:, 0] / np.maximum(cost[:, 1], 1e-9)))
            strategy = trainer.strategy
            assert isinstance(strategy, SyncModeSwitch)
            strategy.report_sync_cost(sync_cost)
        result = self.scorer.update(gathered[:, :HEADER], gathered[:, HEADER:], step)
        if not result["measured"]:
            return
        if self.action == "semi_sync":
            result["sync_cost"] = sync_cost
        result["worst"] = self._worst(result)
        self.history.append(result)
        self._log(trainer, result)
        self._act(trainer, result, final=final)

    def _worst(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        order = sorted(range(len(result["relative"])), key=lambda r: -result["ewma"][r])[: self.top_k]
        return [{"rank": r, "host": self.hosts[r] if r < len(self.hosts) else "?", "relative": result["relative"][r],
                 "ewma": result["ewma"][r], "individual": result["individual"][r]} for r in order]

    def _log(self, trainer: pl.Trainer, result: dict[str, Any]) -> None:
        """Every window to the Trainer's loggers (rank 0), at the window's step, whatever ``log_every_n_steps``."""
        if not trainer.is_global_zero or not trainer.loggers:
            return
        metrics = {"straggler/step_time_min": result["step_min"], "straggler/step_time_median": result["step_median"],
                   "straggler/step_time_max": result["step_max"], "straggler/lost_frac": result["lost_frac"],
                   "straggler/lost_s_total": self.scorer.lost_s if self.scorer else 0.0,
                   "straggler/wait_s_total": self.scorer.wait_s if self.scorer else 0.0,
                   "straggler/persistent_count": float(len(result["persistent"])),
                   "straggler/pause_s_max": max(result["pause_s"])}
        for i, worst in enumerate(result["worst"]):
            metrics[f"straggler/worst{i + 1}_rank"] = float(worst["rank"])
            metrics[f"straggler/worst{i + 1}_score"] = float(worst["ewma"])
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=result["step"])
            logger.save()

    # ------------------------------------------------------------------ mitigation
    def _act(self, trainer: pl.Trainer, result: dict[str, Any], final: bool = False) -> None:
        step = result["step"]
        for r in result["newly_persistent"]:
            event = {"step": step, "event": "persistent", "rank": r, "host": self.hosts[r],
                     "relative": result["relative"][r]}
            self.events.append(event)
            rank_zero_warn(f"StragglerDetector: rank {r} on {self.hosts[r]} is a persistent straggler at step {step} "
                           f"(relative score {result['relative'][r]:.2f}, smoothed {result['ewma'][r]:.2f}).")
        for r in result["cleared"]:
            self.events.append({"step": step, "event": "cleared", "rank": r, "host": self.hosts[r]})
            rank_zero_info(f"StragglerDetector: rank {r} on {self.hosts[r]} is no longer straggling (step {step}).")
        if self.action == "hierarchical_sgd":
            if not final:  # no step is left to switch for
                self._maybe_switch(trainer, trainer.global_step)
        elif self.action == "evict" and result["newly_persistent"] and not final:
            self._evict(trainer, result)
        elif self.action == "stop" and result["persistent"]:
            self._stop(trainer, result)

    def _evict(self, trainer: pl.Trainer, result: dict[str, Any]) -> None:
        """Every rank of the group leaves the quorum at this step, not only the straggling one.

        Why no extra collective: the detector's world is the strategy's own process group, which under
        ``ft_hsdp`` is one replica group; every rank of it scored the same gathered window with the same
        code, so every rank reaches this point at the same step with the same ``newly_persistent`` list.
        A rank left behind would block in the group's next FSDP collective until torchrun tore the group
        down; leaving together makes the exit immediate and its cause visible (``LEAVE_EXIT_CODE``).
        """
        step = result["step"]
        named = ", ".join(f"rank {r} on {self.hosts[r]} (relative score {result['relative'][r]:.2f})"
                          for r in result["newly_persistent"])
        self.events.append({"step": step, "event": "evict", "ranks": list(result["newly_persistent"]),
                            "left_at_step": trainer.global_step})
        if trainer.is_global_zero:  # the report would be lost with the process otherwise
            self._write_report(trainer)
        strategy = trainer.strategy
        assert isinstance(strategy, QuorumMember)
        strategy.leave_quorum(f"persistent straggler in this group at step {trainer.global_step}: {named}")

    def _cost_window(self, trainer: pl.Trainer) -> np.ndarray:
        """``semi_sync``: this rank's (cross-group seconds, every-step-equivalent wall seconds) of the window ending now."""
        if self.action != "semi_sync":
            return np.zeros(0)
        now, (cross, extra) = time.perf_counter(), trainer.strategy.sync_cost_counters()
        base = self._cost_base or (now, cross, extra)
        self._cost_base = (now, cross, extra)
        return np.array([cross - base[1], (now - base[0]) + (extra - base[2])])

    def _collect_switches(self, trainer: pl.Trainer) -> None:
        """``semi_sync``: copy the strategy's switches (decided and logged there) into this report."""
        strategy = trainer.strategy
        assert isinstance(strategy, SyncModeSwitch)
        events = strategy.sync_switch_events
        for event in events[self._seen_switches:]:
            self.events.append(dict(event))
        self._seen_switches = len(events)
        self.switched = strategy.semi_sync_active

    def _maybe_switch(self, trainer: pl.Trainer, step: int) -> None:
        assert self.scorer is not None
        strategy = trainer.strategy
        patience = self._scorer_kwargs["patience"]
        lost = self.history[-1]["lost_frac"]  # this window; the patience streak is the smoothing
        want = lost > self.switch_threshold if not self.switched else lost > self.switch_threshold / 2
        self._switch_streak = self._switch_streak + 1 if want != self.switched else 0
        if self._switch_streak >= patience:
            self.switched = want
            self._switch_streak = 0
            assert isinstance(strategy, LocalAveragingSwitch)
            strategy.set_local_sgd(want)
            self.events.append({"step": step, "event": "local_sgd_on" if want else "local_sgd_off", "lost_frac": lost})
            rank_zero_info(f"StragglerDetector: {'local (hierarchical) averaging on' if want else 'back to synchronous DDP'}"
                           f" at step {step}: straggler loss {lost:.1%} of the step time.")

    def _stop(self, trainer: pl.Trainer, result: dict[str, Any]) -> None:
        hosts = sorted({self.hosts[r] for r in result["persistent"]})
        report = self._report_file or Path("straggler_report.json")
        hosts_file = Path(self.hosts_file) if self.hosts_file else report.with_name("straggling_hosts.txt")
        ckpt = report.with_name("straggler_stop.ckpt")
        self.events.append({"step": result["step"], "event": "stop", "hosts": hosts, "checkpoint": str(ckpt)})
        trainer.save_checkpoint(str(ckpt))
        if trainer.is_global_zero:
            hosts_file.parent.mkdir(parents=True, exist_ok=True)
            hosts_file.write_text("".join(f"{h}\n" for h in hosts))
            self._write_report(trainer)
        trainer.strategy.barrier("straggler_stop")
        rank_zero_warn(f"StragglerDetector: stopping at step {result['step']}: straggling hosts {hosts} written to "
                       f"{hosts_file}, checkpoint {ckpt}.")
        raise SystemExit(self.stop_exit_code)

    # ------------------------------------------------------------------ report and state
    def _report_path(self, trainer: pl.Trainer) -> Path:
        group = getattr(trainer.strategy, "replica_group_id", None)  # ft_hsdp: one report per replica group
        if self.report_path:
            return Path(self.report_path.replace("{replica_group_id}", str(group)))
        base = trainer.log_dir or trainer.default_root_dir
        return Path(base) / ("straggler_report.json" if group is None else f"straggler_report_group{group}.json")

    def report(self) -> dict[str, Any]:
        """Everything measured in this run (written as JSON by rank 0 at the end)."""
        scorer = self.scorer
        return {
            "hosts": self.hosts, "window": self.window, "action": self.action,
            "settings": {**self._scorer_kwargs, "switch_threshold": self.switch_threshold},
            "windows": self.history, "events": self.events,
            "persistent": [r for r, t in enumerate(scorer.tracks) if t.persistent] if scorer else [],
            "first_flagged_step": [t.first_flagged_step for t in scorer.tracks] if scorer else [],
            "stalls": [t.stalls for t in scorer.tracks] if scorer else [],
            "slow_windows": [t.slow_windows for t in scorer.tracks] if scorer else [],
            "lost_s": scorer.lost_s if scorer else 0.0, "wait_s": scorer.wait_s if scorer else 0.0,
            "pause_s": [sum(w["pause_s"][r] for w in self.history) for r in range(len(scorer.tracks))] if scorer else [],
            "detector_gather_s": self._gather_s, "detector_hook_s": self._hook_s, "train_s": self._train_s,
            "detector_overhead_frac": (self._gather_s + self._hook_s) / self._train_s if self._train_s else None,
            "detector_cpu_s": self._cpu_s,
            "detector_cpu_frac": self._cpu_s / self._train_s if self._train_s else None,
            "local_sgd_switched_on": self.switched,
            "sync_switches": [e for e in self.events if e.get("event") == "switch"],
        }

    def _write_report(self, trainer: pl.Trainer) -> None:
        path = self._report_file or Path("straggler_report.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(self.report(), indent=1, default=float), f".tmp{os.getpid()}")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is not None:
            cpu0, t0 = time.thread_time(), time.perf_counter()
            self._finish_window(trainer, final=True)
            self._gather_s += time.perf_counter() - t0
            self._cpu_s += time.thread_time() - cpu0
        if self._t_train_start is not None:
            self._train_s = time.perf_counter() - self._t_train_start
        if trainer.is_global_zero and self.scorer is not None:
            self._write_report(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"switched": self.switched}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.switched = bool(state_dict.get("switched", False))
