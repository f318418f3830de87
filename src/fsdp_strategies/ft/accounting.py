"""What each ``ft_hsdp`` step (or outer sync) did: counters, ``ft/*`` metrics, the events line, trained/missed
data.

The step protocol (:mod:`fsdp_strategies.ft.step`) fills a :class:`StepInFlight` while a step runs (timings,
whether this group healed in it, the data position of its batch) and hands it to
:meth:`StepAccounting.close_step` when the step is committed or discarded. :class:`StepAccounting` then

* updates the cumulative counters of this process (``ft_stats``: committed/discarded steps, heals, seconds
  in quorums and in recovery -- a discarded step, a heal and the step after a discard --, missed samples;
  the cross-group all-reduce counters are added by :class:`fsdp_strategies.ft.manager.CountedManager`);
* accounts the step's data (``data_on_failure="skip"``): the layout is fixed (equal shards, the same
  position on every group), so every group missing from a committed step missed exactly as many samples
  as this group trained; a stretch of such steps is announced when it starts and summed when all groups
  train again. With ``"redistribute"`` the groups in the step trained those samples, so none are missed.
  In a semi-synchronous round the unit is the round: a group absent from an outer sync missed the whole
  round, and a group that healed in it contributed its peer's pseudo-gradient, not its own batches;
* returns the ``ft/*`` metrics and writes the step's line to the events file (rank 0 of the group).

Keys of the events records and of ``last_step_data`` are read by the launcher and by tests; they are a
format (see :class:`fsdp_strategies.ft.protocol.EventLog`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies import _torch_seam
from fsdp_strategies.ft.protocol import EventLog

if TYPE_CHECKING:
    from fsdp_strategies.ft.data import StepAlignedData
    from fsdp_strategies.ft.outer_sync import OuterSync

__all__ = ["COST_PARTS", "StepAccounting", "StepInFlight"]

#: the parts of a step's fault-tolerance work that :class:`StepInFlight` times (events ``cost_<part>_s``; the
#: quorum wait and the commit vote are the events' ``quorum_s`` and ``commit_s``)
COST_PARTS = {
    "batch": "taking the committed step's batch (the data position follows the quorum)",
    "capture": "snapshotting the references a healing peer would fetch",
    "quorum_start": "starting the quorum (asynchronous: the request, not the wait)",
    "allreduce": "the cross-group all-reduces of the step (the FSDP hook, or one per dtype after the last "
                 "micro-batch under accumulation), waited for",
    "account": "the previous step's accounting: counters, events line, ft/* metrics (written one step late)",
}


@dataclass
class StepInFlight:
    """The step in progress: its start, cross-group seconds, heal flag and the data it took."""

    t0: float = 0.0
    #: seconds waiting for the quorum / in any cross-group operation (``straggler_sync``'s cost)
    quorum_wait_s: float = 0.0
    cross_s: float = 0.0
    #: this group applied a live peer's state in this step
    healed: bool = False
    #: this group's gradients count in the step (``False`` while healing: it contributes zeros)
    participating: bool = True
    #: data position of the batch taken (``None``: not step-aligned, or already accounted)
    position: int | None = None
    #: samples of this rank's own shard in the step (all its micro-batches)
    own_samples: int = 0
    #: micro-batches taken in the step (``accumulate_grad_batches``; positions ``position`` onwards)
    micro_batches: int = 0
    #: samples of missing groups this rank trains in the step (``data_on_failure="redistribute"``)
    extra_samples: int = 0
    #: weight of this group's gradient -- of the current micro-batch's -- in the cross-group average
    #: (``redistribute``)
    grad_scale: float = 1.0
    #: a batch of the step was built from the dataset (the loader was not at its position)
    rebuilt: bool = False
    #: the ``redistribute`` weights the step's micro-batches got so far (under accumulation)
    micro_scales: list[float] = field(default_factory=list)
    #: the groups in the step, learnt by the first micro-batch's redistribution (``None``: not yet)
    live: list[int] | None = None
    #: ``NonFiniteGuard`` under accumulation: whether any micro-batch's loss was not finite (``None``: no
    #: verdict yet); the group's verdict is agreed once, after the step's last backward
    nonfinite: bool | None = None
    #: ``NonFiniteGuard``: this group's weight in a cross-group *sum* (its share of the finite groups'
    #: samples; 0 when its loss was not finite), ``None``: the plain average
    sum_scale: float | None = None
    #: this group's loss was not finite: it left the step's cross-group average (its batch is not trained)
    excluded: bool = False
    #: groups of this step's quorum that left its average because their loss was not finite
    excluded_groups: int = 0
    #: seconds of this step's fault-tolerance work by part (:meth:`timed`), written with its events line as
    #: ``cost_<part>_s`` and replaced there by the accounting's own (:meth:`StepAccounting.close_step`):
    #: where ``ft_hsdp``'s fault-free cost goes (see ``COST_PARTS``)
    costs: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the seconds spent inside to ``costs[part]``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.costs[part] = self.costs.get(part, 0.0) + time.perf_counter() - t0

    def begin(self) -> None:
        """Reset the timings at the start of a step (the data fields are set when the batch is taken)."""
        self.t0 = time.perf_counter()
        self.quorum_wait_s = 0.0
        self.cross_s = 0.0
        self.healed = False
        self.sum_scale, self.excluded, self.excluded_groups, self.nonfinite = None, False, 0, None

    #: ``time.monotonic()`` when this rank began waiting for other replica groups (``None``: not waiting)
    peer_wait_since: float | None = None

    @contextmanager
    def waiting_for_peers(self) -> Iterator[None]:
        """Mark a wait on the other groups (quorum, cross-group all-reduce): bounded by torchft's timeouts, so
        :class:`~fsdp_strategies.callbacks.HangWatchdog` does not call it a hang of this group."""
        self.peer_wait_since = time.monotonic()
        try:
            yield
        finally:
            self.peer_wait_since = None

    def peer_wait_s(self) -> float | None:
        since = self.peer_wait_since
        return None if since is None else time.monotonic() - since

    def take_batch(self, position: int, own_samples: int, first: bool, rebuilt: bool) -> None:
        """Micro-batch ``position`` (``own_samples`` of this rank's shard; ``rebuilt`` from the dataset) is
        trained in this step; ``first``: the step's first micro-batch (the data fields start over)."""
        if first:
            self.position, self.own_samples, self.extra_samples, self.micro_batches = position, 0, 0, 0
            self.live, self.rebuilt, self.micro_scales = None, False, []
        self.rebuilt = self.rebuilt or rebuilt
        self.own_samples += own_samples
        self.micro_batches += 1
        self.grad_scale = 1.0


class StepAccounting:
    """Counters, metrics and events of one replica group's steps (see the module docstring)."""

    def __init__(self, replica_group_id: int, num_replica_groups: int, data_on_failure: str,
                 events: EventLog | None) -> None:
        self.replica_group_id = replica_group_id
        self.num_replica_groups = num_replica_groups
        self.data_on_failure = data_on_failure
        self.events = events
        #: cumulative counters of this process (also logged as ``ft/*``)
        self.stats: dict[str, float] = {"committed": 0, "discarded": 0, "heals": 0, "recovery_s": 0.0,
                                        "quorum_s": 0.0, "missed_samples": 0, "cross_group_allreduces": 0,
                                        "cross_group_bytes": 0}
        self.last_step_committed: bool | None = None
        #: the data of the last step: ``step`` (the quorum's), ``position`` (of the batch used; = ``step``
        #: when
        #: ``participating``; a healing group used a stale one and contributed zeros), ``participating``,
        #: ``samples`` (this group's, all ranks), ``missed_samples`` (of the groups not in the step),
        #: ``redistributed_samples`` (of those, trained here), ``rebuilt`` (batch built from the dataset: the
        #: loader was not at the step)
        self.last_step_data: dict[str, Any] = {}
        self._after_discard = False
        self._missed_since: int | None = None
        self._missed_run = 0
        self._counted = (0.0, 0.0)  # cross-group all-reduce calls and bytes at the last events line

    def finish(self, step: StepInFlight, *, committed: bool, committed_step: int, participants: int,
               quorum_id: int, commit_s: float, data: dict[str, Any], write_event: bool) -> dict[str, float]:
        """Count a finished step; write its events line (``write_event``: rank 0); return its ``ft/*``
        metrics.

        ``data``: from :meth:`step_data` / :meth:`round_data` (``{}`` when the data position is not aligned).
        """
        step_s = time.perf_counter() - step.t0
        stats = self.stats
        stats["committed" if committed else "discarded"] += 1
        stats["quorum_s"] += step.quorum_wait_s
        if (not committed) or step.healed or self._after_discard:
            stats["recovery_s"] += step_s
        self._after_discard = not committed
        self.last_step_committed = committed
        metrics = {
            "ft/participants": float(participants),
            "ft/quorum_id": float(quorum_id),
            "ft/committed": float(committed),
            "ft/committed_steps": float(stats["committed"]),
            "ft/discarded_steps": float(stats["discarded"]),
            "ft/heal": float(step.healed),
            "ft/heals": float(stats["heals"]),
            "ft/quorum_s": float(step.quorum_wait_s),
            "ft/commit_s": float(commit_s),
            "ft/recovery_s": float(stats["recovery_s"]),
        }
        if data.get("missed_samples") is not None:
            metrics["ft/missed_samples"] = float(data["missed_samples"])
            metrics["ft/missed_samples_total"] = float(stats["missed_samples"])
        costs = {f"cost_{k}_s": round(v, 6) for k, v in step.costs.items()}
        calls, sent = stats["cross_group_allreduces"], stats["cross_group_bytes"]
        costs.update(allreduces=int(calls - self._counted[0]), allreduce_bytes=int(sent - self._counted[1]))
        self._counted = (calls, sent)
        if self.events is not None and write_event:
            self.events.write_step(
                self.replica_group_id, committed_step, committed, participants=participants,
                quorum_id=quorum_id,
                healed=step.healed, step_s=step_s, quorum_s=step.quorum_wait_s, commit_s=commit_s,
                pid=os.getpid(), **costs, **{f"data_{k}": v for k, v in data.items()})
        return metrics

    def close_step(self, step: StepInFlight, *, committed: bool, commit_s: float, manager: Any,
                   committed_step: int, data: StepAlignedData | None, round_of: OuterSync | None,
                   round_samples: int, world_size: int, write_event: bool,
                   module: Any = None, participants: int | None = None) -> dict[str, float]:
        """Account a committed / discarded step or outer sync (:meth:`data_record`, then :meth:`finish`) with
        the quorum's view from ``manager`` (``participants``: its groups, when the caller read them already),
        :meth:`log` its ``ft/*`` metrics through ``module`` (unless ``None``) and return them.

        ``step.costs`` (the parts of the step's fault-tolerance work) went into this step's events line; they
        are replaced by this accounting's own seconds, which go into the next step's line.
        """
        t0 = time.perf_counter()
        if participants is None:
            participants = int(manager.num_participants())
        record = self.data_record(step, committed=committed, participants=participants, data=data,
                                  round_of=round_of, round_samples=round_samples,
                                  quorum_step=committed_step - int(committed), world_size=world_size)
        metrics = self.finish(step, committed=committed, committed_step=committed_step,
                              participants=participants, quorum_id=_torch_seam.quorum_id(manager),
                              commit_s=commit_s, data=record, write_event=write_event)
        if module is not None:
            self.log(module, metrics)
        step.costs = {"account": time.perf_counter() - t0}
        return metrics

    def log(self, module: Any, metrics: dict[str, float]) -> None:
        """Hand ``metrics`` to the Trainer inside a Lightning hook: through ``module.log_dict`` where
        :meth:`shown_now` (``trainer.callback_metrics`` shows them), else straight to the Trainer's loggers at
        the steps they write (``log_every_n_steps``; Lightning's own step value and ``epoch``).

        Lightning's ``self.log`` costs ~0.3 ms of CPU per metric (it moves its metric object to the device on
        every call): for all ten metrics every ``log_every_n_steps`` steps, more than the rest of the step's
        accounting (``benchmarks/suites/ft_overhead.py``). Writing to the loggers is what the logging steps
        need; :attr:`stats` and :attr:`last_step_data` are current every step.
        """
        if not seam.in_lightning_hook(module):
            return
        trainer = module.trainer
        try:
            if self.shown_now(metrics, trainer):
                module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1, sync_dist=False)
            elif seam.logs_this_step(trainer):
                seam.write_to_loggers(trainer, metrics)
        except Exception as err:  # never let logging break a committed step
            rank_zero_warn(f"ft_hsdp: could not log ft/* metrics ({err})")

    def shown_now(self, metrics: dict[str, float], trainer: Any) -> bool:
        """Whether this step's ``ft/*`` metrics go through Lightning's ``self.log`` (so that
        ``trainer.callback_metrics`` -- what callbacks and the progress bar read -- shows them at once, and
        the loggers receive them at a logging step): every step that did not go as
        planned (discarded, healed, a group missing or left out), the last step (``max_steps``) and the last
        batch of an epoch (so that they are there when ``fit`` returns).
        """
        if 0 < trainer.max_steps <= metrics["ft/committed_steps"] or trainer.is_last_batch:
            return True
        missing = metrics["ft/participants"] < self.num_replica_groups
        return not metrics["ft/committed"] or bool(metrics["ft/heal"]) or missing \
            or bool(metrics.get("ft/missed_samples"))

    def data_record(self, step: StepInFlight, *, committed: bool, participants: int,
                    data: StepAlignedData | None,
                    round_of: OuterSync | None, round_samples: int, quorum_step: int,
                    world_size: int) -> dict[str, Any]:
        """The data part of a finished step's record: ``{}`` when the data position is not step-aligned
        (``data`` is ``None``), :meth:`round_data` for an outer sync that ended a round (``round_of``), else
        :meth:`step_data`."""
        if data is None:
            return {}
        if round_of is not None:
            return self.round_data(committed=committed, participants=participants,
                                   round_samples=round_samples,
                                   healed=round_of.healed, committed_steps=round_of.committed,
                                   round_steps=round_of.last_round)
        return self.step_data(step, committed=committed, quorum_step=quorum_step, participants=participants,
                              batch_size=step.own_samples, world_size=world_size, sharded=data.sharded)

    def step_data(self, step: StepInFlight, *, committed: bool, quorum_step: int, participants: int,
                  batch_size: int, world_size: int, sharded: bool) -> dict[str, Any]:
        """What an every-step step trained and missed; ``{}`` when the position is not aligned.

        ``quorum_step``: the quorum's step (a healing group's jumps); ``batch_size``: one rank's samples in
        the step (its micro-batches from ``position`` on: ``micro_batches`` of them); ``sharded``: the loader
        shards over the groups (redistribution possible).
        """
        if step.position is None:
            return {}
        position, step.position = step.position, None
        done = committed and step.participating and not step.excluded
        data: dict[str, Any] = {"step": quorum_step, "position": position,
                                "micro_batches": step.micro_batches, "participating": step.participating,
                                "rebuilt": self.last_step_data.get("rebuilt", False),
                                "samples": (batch_size + step.extra_samples) * world_size if done else 0,
                                "missed_samples": None,
                                "redistributed_samples": step.extra_samples * world_size if committed else 0}
        if done:
            absent = self.num_replica_groups - participants
            redistribute = self.data_on_failure == "redistribute" and sharded
            per_group = batch_size * world_size
            # a group that left the step's average (non-finite loss) trained nothing, in either mode
            missed = (0 if redistribute else absent * per_group) + step.excluded_groups * per_group
            data["missed_samples"] = missed
            self.stats["missed_samples"] += missed
            self._announce_missed(position, absent, per_group, redistribute)
        self.last_step_data = data
        return data

    def _announce_missed(self, position: int, absent: int, per_group: int, redistribute: bool) -> None:
        """One info line when a stretch of steps with missing groups starts, one with its total when it
        ends."""
        what = "trained by the groups in the step" if redistribute else "skipped"
        if absent and self._missed_since is None:
            self._missed_since, self._missed_run = position, 0
            rank_zero_info(
                f"ft_hsdp: from step {position}, {absent} of {self.num_replica_groups} replica groups are "
                f"not in the step: their shards' batches ({absent * per_group} samples per step) are "
                f"{what} (data_on_failure={self.data_on_failure!r})"
            )
        if absent:
            self._missed_run += absent * per_group
        elif self._missed_since is not None:
            rank_zero_info(f"ft_hsdp: all {self.num_replica_groups} replica "
                           f"groups train again from step {position}; "
                           f"in steps {self._missed_since}-{position - 1}, {self._missed_run} samples of the "
                           f"missing groups' shards were {what}")
            self._missed_since = None

    def round_data(self, *, committed: bool, participants: int, round_samples: int, healed: bool,
                   committed_steps: int, round_steps: int) -> dict[str, Any]:
        """What an outer sync's round trained and missed (the groups absent from it missed the whole round).

        ``round_samples``: this group's samples in the round (all ranks); ``healed``: this group healed in the
        sync (it contributed its source peer's pseudo-gradient -- torchft's synchronous heal --, not its own
        batches: it reports ``participating=False`` and no samples); ``committed_steps``/``round_steps``: the
        outer sync's committed inner steps and the inner steps its last committed round covered.
        """
        participating = not healed
        done = committed and participating
        absent = self.num_replica_groups - participants
        data: dict[str, Any] = {"step": committed_steps - (round_steps if committed else 0),
                                "round_steps": round_steps, "participating": participating,
                                "samples": round_samples if done else 0,
                                "missed_samples": absent * round_samples if done else None,
                                "redistributed_samples": 0,
                                "rebuilt": self.last_step_data.get("rebuilt", False)}
        if done:
            self.stats["missed_samples"] += absent * round_samples
        self.last_step_data = data
        return data
