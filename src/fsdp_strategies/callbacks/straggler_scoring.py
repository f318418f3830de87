"""Straggler scores: one window of gathered per-rank step timings in, scores and decisions out (no Lightning).

Every rank gathers the same window (per rank: the sums in :data:`HEADER_COLUMNS` and each measured step's
self time) and feeds it to its own :class:`StragglerScorer`, so every rank reaches the same decisions.

* *relative* score: a rank's median self time over the window / the median of the other ranks' medians
  (with two ranks: the other one's);
* *individual* score: a rank's median self time / its own best window;
* both smoothed with an EWMA (``ewma_alpha`` = weight of the newest window). A window is *slow* for a rank
  when its raw and smoothed relative scores are above ``threshold`` and it needs at least ``min_excess_s``
  more than the others; after ``patience`` consecutive slow windows the rank is a persistent straggler, and
  after ``patience`` normal windows it is cleared (hysteresis).
* *transient stalls*: single steps above ``stall_factor`` x the other ranks' time for the same step (and
  ``min_excess_s`` more), counted, never persistent on their own.
* *lost time*: per step, what the slowest rank needed beyond the others when that is a clear slowdown
  (``threshold`` x and ``min_excess_s``), summed; its fraction of the window's step time drives the
  ``hierarchical_sgd`` switch of :class:`~fsdp_strategies.callbacks.StragglerDetector`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["HEADER", "HEADER_COLUMNS", "StragglerScorer"]

#: What each rank sums over a window, in the order of a gathered window's header columns (``pause``:
#: deliberate host pauses reported by a :class:`~fsdp_strategies.protocols.HostPauseSource`, already left out
#: of ``self``)
HEADER_COLUMNS: tuple[str, ...] = ("n", "data", "compute", "optimizer", "step", "self", "wait", "pause")
HEADER = len(HEADER_COLUMNS)


@dataclass
class _RankTrack:
    """One rank's scores and hysteresis state across windows."""

    ewma: float = 1.0
    best: float = math.inf
    slow_streak: int = 0
    normal_streak: int = 0
    persistent: bool = False
    first_flagged_step: int | None = None
    stalls: int = 0
    slow_windows: int = 0
    relative: float = 1.0
    individual: float = 1.0


@dataclass
class StragglerScorer:
    """Turns one window of gathered per-rank numbers into scores and decisions (pure; testable alone).

    One instance per run, fed every window by :meth:`update`; ``tracks`` holds each rank's state across
    windows, ``lost_s`` / ``wait_s`` the run's totals and ``lost_ewma`` the smoothed lost fraction.
    """

    world_size: int
    threshold: float = 1.5
    patience: int = 2
    ewma_alpha: float = 0.5
    stall_factor: float = 3.0
    min_excess_s: float = 0.01
    tracks: list[_RankTrack] = field(default_factory=list)
    windows: int = 0
    lost_s: float = 0.0
    wait_s: float = 0.0
    lost_ewma: float = 0.0

    def __post_init__(self) -> None:
        if not self.tracks:
            self.tracks = [_RankTrack() for _ in range(self.world_size)]

    @staticmethod
    def _others_median(values: np.ndarray) -> np.ndarray:
        """For each rank, the median over the *other* ranks (with 2 ranks: the other one)."""
        n = values.shape[0]
        if n == 1:
            return values.copy()
        out = np.empty_like(values)
        for r in range(n):
            out[r] = np.nanmedian(np.delete(values, r, axis=0), axis=0)
        return out

    def update(self, header: np.ndarray, self_steps: np.ndarray, step: int) -> dict[str, Any]:
        """Score one window and decide which ranks became / stopped being persistent stragglers at ``step``.

        ``header``: (ranks, :data:`HEADER`) window sums in :data:`HEADER_COLUMNS` order; ``self_steps``:
        (ranks, window) per-step self time (NaN = unmeasured). Returns the window's record (``measured``
        False when a rank measured nothing).
        """
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns of unmeasured slots
            return self._update(header, self_steps, step)

    def _update(self, header: np.ndarray, self_steps: np.ndarray, step: int) -> dict[str, Any]:
        self.windows += 1
        n = header[:, 0]
        if (n <= 0).any() or np.isnan(self_steps).all():
            return {"measured": False}
        mean_step = header[:, 4] / n
        mean_self = header[:, 5] / n
        med_self = np.nanmedian(self_steps, axis=1)
        ref = self._others_median(med_self)
        relative = med_self / np.maximum(ref, 1e-9)
        # transient stalls: single steps far above what the other ranks needed for the same step
        ref_steps = self._others_median(self_steps)
        excess = self_steps - ref_steps
        stalls = (self_steps > self.stall_factor * ref_steps) & (excess > self.min_excess_s)
        # estimated job time lost to stragglers: per step, what the slowest rank needed beyond the others,
        # counted only when that is a clear slowdown (threshold x and min_excess_s), not jitter
        valid = ~np.isnan(self_steps).any(axis=0)
        lost = 0.0
        if valid.any():
            cols, refs = self_steps[:, valid], ref_steps[:, valid]
            slowest, j = np.argmax(cols, axis=0), np.arange(cols.shape[1])
            top, ref_top = cols[slowest, j], refs[slowest, j]
            clear = (top > self.threshold * ref_top) & (top - ref_top > self.min_excess_s)
            lost = float(np.sum(np.where(clear, top - ref_top, 0.0)))
        wait = float(np.mean(header[:, 6]))
        base = float(np.median(mean_step) * np.median(n))
        lost_frac = lost / max(base, 1e-9)
        self.lost_s += lost
        self.wait_s += wait
        self.lost_ewma = self.ewma_alpha * lost_frac + (1 - self.ewma_alpha) * (
            self.lost_ewma if self.windows > 1 else lost_frac
        )
        newly, cleared = [], []
        for r, track in enumerate(self.tracks):
            track.relative = float(relative[r])
            track.best = min(track.best, float(med_self[r]))
            track.individual = float(med_self[r] / max(track.best, 1e-9))
            track.ewma = self.ewma_alpha * track.relative + (1 - self.ewma_alpha) * track.ewma
            track.stalls += int(stalls[r].sum())
            slow = (track.relative > self.threshold and track.ewma > self.threshold
                    and med_self[r] - ref[r] > self.min_excess_s)
            if slow:
                track.slow_windows += 1
                track.slow_streak += 1
                track.normal_streak = 0
                if not track.persistent and track.slow_streak >= self.patience:
                    track.persistent = True
                    track.first_flagged_step = step
                    newly.append(r)
            else:
                track.slow_streak = 0
                track.normal_streak += 1
                if track.persistent and track.normal_streak >= self.patience:
                    track.persistent = False
                    cleared.append(r)
        return {
            "measured": True, "step": step, "relative": relative.tolist(),
            "individual": [t.individual for t in self.tracks],
            "ewma": [t.ewma for t in self.tracks], "mean_step": mean_step.tolist(),
            "mean_self": mean_self.tolist(),
            "step_min": float(mean_step.min()), "step_median": float(np.median(mean_step)),
            "step_max": float(mean_step.max()),
            "data": (header[:, 1] / n).tolist(), "compute": (header[:, 2] / n).tolist(),
            "optimizer": (header[:, 3] / n).tolist(), "pause": (header[:, 7] / n).tolist(),
            "pause_s": header[:, 7].tolist(), "stalls": stalls.sum(axis=1).tolist(), "lost_s": lost,
            "lost_frac": lost_frac, "wait_s": wait, "newly_persistent": newly, "cleared": cleared,
            "persistent": [r for r, t in enumerate(self.tracks) if t.persistent],
        }
