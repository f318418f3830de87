"""The measurement side of :class:`~fsdp_strategies.callbacks.StragglerDetector`: each optimizer step's parts
timed at Lightning's hooks and summed into the window a rank sends to the others, and the detector's own cost.

Why these parts (see :mod:`fsdp_strategies.callbacks.straggler`): ``data`` (end of the previous step to the
batch start) contains no collective, so it is the rank's own time; of ``compute`` (forward + backward) and
``optimizer`` only the *busy* part is: process CPU time on CPU devices (time blocked in a collective is not
CPU time), CUDA-event time on GPUs (recorded every step without synchronising, resolved once per window).
Deliberate host pauses reported by a :class:`~fsdp_strategies.protocols.HostPauseSource` are subtracted and
kept apart. Under gradient accumulation one step is all of its micro-batches.

A window is :data:`~fsdp_strategies.callbacks.straggler_scoring.HEADER_COLUMNS` sums followed by each measured
step's self time (NaN for unmeasured slots), the layout :class:`~fsdp_strategies.callbacks.straggler_scoring.
StragglerScorer` reads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import torch

from fsdp_strategies.callbacks.straggler_scoring import HEADER
from fsdp_strategies.protocols import HostPauseSource

__all__ = ["OwnCost", "StepTimer"]


def _cuda_event() -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepTimer:
    """Times each optimizer step at the detector's hooks and keeps the current window's numbers.

    Call order per optimizer step: :meth:`batch_start` and :meth:`batch_end` around every micro-batch,
    :meth:`before_optimizer_step` in the last one; :meth:`step_done` once the detector's own work after the
    step is over (that work is not part of the next step's ``data``). :meth:`take_window` at the end of a
    window.
    """

    def __init__(self, window: int, skip_first: int) -> None:
        self.window, self.skip_first = window, skip_first
        self.cuda = False  # CUDA-event timing (set at setup from the strategy's device)
        self.pause_sources: list[HostPauseSource] = []
        self.steps = 0  # optimizer steps seen
        self.skip_next = True  # the next step is not measured (the first, after validation or a checkpoint)
        self.in_step = False  # between an optimizer step's first micro-batch start and its end
        self._t_prev_end: float | None = None
        # the optimizer step in progress: its parts so far, the current micro-batch's, the optimizer's start
        self._data = self._compute = self._optim = self._busy = 0.0
        self._t_start = self._c_start = 0.0
        self._t_opt: float | None = None
        self._ev_start: Any = None
        self._ev_opt: Any = None
        self._reset_window()

    def _reset_window(self) -> None:
        self._sums = np.zeros(HEADER, dtype=np.float64)
        self._self_steps = np.full(self.window, np.nan, dtype=np.float64)
        # CUDA-timed steps, resolved at the window's end
        self._events: list[tuple[int, float, Any, Any, Any, float, float]] = []
        self._slot = 0

    def train_start(self, pause_sources: list[HostPauseSource]) -> None:
        self.pause_sources = pause_sources
        self._t_prev_end = None
        self.in_step = False

    def batch_start(self) -> None:
        now = time.perf_counter()
        gap = (now - self._t_prev_end) if self._t_prev_end is not None else math.nan
        if self.in_step:  # a later micro-batch of the same (accumulating) step
            self._data += gap  # loading the next micro-batch is data time too
        else:  # the first (or only) micro-batch of an optimizer step
            self.in_step = True
            self._data, self._compute, self._optim, self._busy = gap, 0.0, 0.0, 0.0
            self._ev_start = _cuda_event() if self.cuda else None
            self._t_opt = None
        self._t_start, self._c_start = now, time.process_time()

    def before_optimizer_step(self) -> None:
        if self._t_opt is None and self.in_step:
            self._t_opt = time.perf_counter()
            self._ev_opt = _cuda_event() if self.cuda else None

    def batch_end(self, accumulating: bool) -> bool:
        """The end of a micro-batch (call only :attr:`in_step`); True when it ended the optimizer step."""
        t_end, c_end = time.perf_counter(), time.process_time()
        t_opt = self._t_opt if self._t_opt is not None else t_end
        self._compute += t_opt - self._t_start  # this micro-batch's forward + backward
        self._optim += t_end - t_opt
        self._busy += c_end - self._c_start
        if accumulating:  # a non-final micro-batch: the optimizer step is not over yet
            return False
        self.in_step = False
        ev_end = _cuda_event() if self.cuda else None
        # taken every step, measured or not
        pause = sum(source.take_host_pause_s() for source in self.pause_sources)
        compute, optim = self._compute, self._optim
        measured = not (self.skip_next or self.steps < self.skip_first or math.isnan(self._data))
        if measured and self._slot < self.window:
            if self.cuda:
                ev_opt = self._ev_opt if self._t_opt is not None else ev_end
                self._events.append((self._slot, self._data, self._ev_start, ev_opt, ev_end, pause,
                                     compute + optim))
            else:
                self._record(self._slot, self._data, compute, optim, self._busy, pause)
            self._slot += 1
        self.skip_next = False
        self.steps += 1
        return True

    def step_done(self) -> None:
        """The detector's work after a micro-batch is over: the next ``data`` part starts now."""
        self._t_prev_end = time.perf_counter()

    def _record(self, slot: int, data: float, compute: float, optim: float, busy: float,
                pause: float) -> None:
        step = data + compute + optim
        # a reported pause is not the rank's slowness
        own = max(0.0, data + min(busy, compute + optim) - pause)
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

    def take_window(self) -> np.ndarray:
        """This rank's window (sums, then per-step self times) and a fresh window started."""
        if self.cuda:
            self._resolve_cuda()
        local = np.concatenate([self._sums, self._self_steps])
        self._reset_window()
        return local


class OwnCost:
    """What the detector itself costs, for its report: wall time in its hooks (``hook_s``: timing;
    ``gather_s``:
    windows gathered, scored and acted on), its thread's CPU time, and the training time they are a part
    of."""

    def __init__(self) -> None:
        self.seconds = {"hook": 0.0, "gather": 0.0}
        self.cpu_s = 0.0  # CPU time of the detector's own code (this thread), excluding waiting for a core
        self.train_s = 0.0
        self._t_train_start: float | None = None

    @contextmanager
    def charged(self, part: Literal["hook", "gather"]) -> Iterator[None]:
        """Charge the block's wall time to ``part`` (``hook`` or ``gather``) and its CPU time to ``cpu_s``."""
        cpu0, t0 = time.thread_time(), time.perf_counter()
        yield
        self.seconds[part] += time.perf_counter() - t0
        self.cpu_s += time.thread_time() - cpu0

    def train_start(self) -> None:
        self._t_train_start = time.perf_counter()

    def train_end(self) -> None:
        if self._t_train_start is not None:
            self.train_s = time.perf_counter() - self._t_train_start

    def report(self) -> dict[str, Any]:
        gather_s, hook_s, train_s = self.seconds["gather"], self.seconds["hook"], self.train_s
        return {"detector_gather_s": gather_s, "detector_hook_s": hook_s, "train_s": train_s,
                "detector_overhead_frac": (gather_s + hook_s) / train_s if train_s else None,
                "detector_cpu_s": self.cpu_s, "detector_cpu_frac": self.cpu_s / train_s if train_s else None}
