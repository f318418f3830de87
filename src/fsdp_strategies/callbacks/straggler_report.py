"""What :class:`~fsdp_strategies.callbacks.StragglerDetector` tells: the scored windows and events of a run,
the warnings when a rank becomes or stops being a persistent straggler, the per-window metrics for the
Trainer's loggers, and the JSON report rank 0 writes.

Why one object: the actions add events to it and must write it before a process ends on purpose (``evict``,
``stop``), and the report names ranks by host, which every rank learns at setup.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from fsdp_strategies._atomic_file import write_text_atomically
from fsdp_strategies._distributed import in_process_group

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from fsdp_strategies.callbacks.straggler_scoring import StragglerScorer

__all__ = ["StragglerReport"]


class StragglerReport:
    """The run's record: ``hosts`` (one per rank), ``history`` (every scored window) and ``events``.

    ``contents`` builds the whole JSON report (the detector's
    :meth:`~fsdp_strategies.callbacks.StragglerDetector. report`), so that whoever writes it, at the end or
    before leaving, writes all of it.
    """

    def __init__(self, contents: Callable[[], dict[str, Any]], top_k: int) -> None:
        self.contents, self.top_k = contents, top_k
        self.hosts: list[str] = []
        self.history: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.file: Path | None = None  # resolved at setup

    def setup(self, trainer: pl.Trainer, report_path: str | None) -> None:
        """Learn every rank's host name and where the report goes (on every rank: both are collectives)."""
        world, host = trainer.world_size, socket.gethostname()
        if world > 1 and in_process_group():
            hosts: list[Any] = [None] * world
            dist.all_gather_object(hosts, host)
            self.hosts = [str(h) for h in hosts]
        else:
            self.hosts = [host]
        # resolved here, on every rank: ``trainer.log_dir`` is a collective (a broadcast)
        group = getattr(trainer.strategy, "replica_group_id", None)  # ft_hsdp: one report per replica group
        if report_path:
            self.file = Path(report_path.replace("{replica_group_id}", str(group)))
        else:
            base = trainer.log_dir or trainer.default_root_dir
            self.file = Path(base) / ("straggler_report.json" if group is None
                                      else f"straggler_report_group{group}.json")

    @property
    def path(self) -> Path:
        """Where the report goes (before setup: the working directory)."""
        return self.file or Path("straggler_report.json")

    def add(self, trainer: pl.Trainer, result: dict[str, Any], scorer: StragglerScorer) -> None:
        """Keep one scored window (with its ``worst`` ranks) and log it."""
        result["worst"] = self._worst(result)
        self.history.append(result)
        self._log(trainer, result, scorer)

    def note_changes(self, result: dict[str, Any]) -> None:
        """Events and warnings for the ranks that became, or stopped being, persistent stragglers."""
        step = result["step"]
        for r in result["newly_persistent"]:
            self.events.append({"step": step, "event": "persistent", "rank": r, "host": self.hosts[r],
                                "relative": result["relative"][r]})
            rank_zero_warn(f"StragglerDetector: rank {r} on {self.hosts[r]} is a persistent straggler at "
                           f"step {step} (relative score {result['relative'][r]:.2f}, "
                           f"smoothed {result['ewma'][r]:.2f}).")
        for r in result["cleared"]:
            self.events.append({"step": step, "event": "cleared", "rank": r, "host": self.hosts[r]})
            rank_zero_info(f"StragglerDetector: rank {r} on {self.hosts[r]} is no longer straggling "
                           f"(step {step}).")

    def _worst(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        order = sorted(range(len(result["relative"])), key=lambda r: -result["ewma"][r])[: self.top_k]
        return [{"rank": r, "host": self.hosts[r] if r < len(self.hosts) else "?",
                 "relative": result["relative"][r], "ewma": result["ewma"][r],
                 "individual": result["individual"][r]} for r in order]

    def _log(self, trainer: pl.Trainer, result: dict[str, Any], scorer: StragglerScorer) -> None:
        """Every window to the Trainer's loggers (rank 0), at the window's step, whatever
        ``log_every_n_steps``."""
        if not trainer.is_global_zero or not trainer.loggers:
            return
        metrics = {"straggler/step_time_min": result["step_min"],
                   "straggler/step_time_median": result["step_median"],
                   "straggler/step_time_max": result["step_max"], "straggler/lost_frac": result["lost_frac"],
                   "straggler/lost_s_total": scorer.lost_s, "straggler/wait_s_total": scorer.wait_s,
                   "straggler/persistent_count": float(len(result["persistent"])),
                   "straggler/pause_s_max": max(result["pause_s"])}
        for i, worst in enumerate(result["worst"]):
            metrics[f"straggler/worst{i + 1}_rank"] = float(worst["rank"])
            metrics[f"straggler/worst{i + 1}_score"] = float(worst["ewma"])
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=result["step"])
            logger.save()

    def summary(self, scorer: StragglerScorer | None) -> dict[str, Any]:
        """The report's windows, events and per-rank totals."""
        tracks = scorer.tracks if scorer else []
        return {
            "windows": self.history, "events": self.events,
            "persistent": [r for r, t in enumerate(tracks) if t.persistent],
            "first_flagged_step": [t.first_flagged_step for t in tracks],
            "stalls": [t.stalls for t in tracks], "slow_windows": [t.slow_windows for t in tracks],
            "lost_s": scorer.lost_s if scorer else 0.0, "wait_s": scorer.wait_s if scorer else 0.0,
            "pause_s": [sum(w["pause_s"][r] for w in self.history) for r in range(len(tracks))],
        }

    def write(self) -> None:
        """Write the whole report (rank 0's job), atomically: a reader never sees half of it."""
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(
            path, json.dumps(self.contents(), indent=1, default=float), f".tmp{os.getpid()}"
        )
