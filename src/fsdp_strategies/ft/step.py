"""``ft_hsdp``'s step protocol: one object that owns the quorum / commit state of the step in flight.

Why an object: torchft's ``Manager`` has a call order (``start_quorum`` -> ``allreduce`` ... ->
``should_commit``, once per optimizer step) that Lightning's hooks must follow whatever the number of
micro-batches and whatever the mode: every step, rounds (``sync="local_sgd"|"diloco"``), or the
``straggler_sync`` switch between them. Spread over the strategy's hooks as flags, that order was implicit;
here each method states its place in it, and a call out of order raises :class:`StepOrderError` (a bug in
the caller) instead of training on silently.

Per optimizer step, on every rank of the group:

1. :meth:`FTStep.begin` -- before each micro-batch's forward (``on_train_batch_start``; also earlier, in
   ``batch_to_device``, when the batch depends on the quorum: ``redistribute``, ``straggler_sync``). The first
   call of a step begins it, the later ones return at once, so the step's micro-batches share one quorum and
   one timer. Every step: the heal-state snapshot, ``Manager.start_quorum()`` (asynchronous; synchronous with
   ``straggler_sync``, where a healing group learns the mode there and, healed into a semi-synchronous
   phase, first finishes that phase's outer sync with the others). Rounds: no quorum; the start of a round
   is marked (where a discarded outer sync rolls the LR schedulers back to).
2. :meth:`FTStep.wait_quorum` -- any number of times, before the step's first cross-group byte (the
   all-reduce hook, ``NonFiniteGuard``'s agreement, ``redistribute``); waits once per step.
3. :meth:`FTStep.finish` -- inside Lightning's ``optimizer_step``: forward + backward (Lightning's closure),
   the deferred cross-group reduction, ``should_commit`` (the optimizer steps only on commit), the
   accounting (:mod:`fsdp_strategies.ft.accounting`), once. In rounds: the inner optimizer step, then the
   outer sync when it ends the round. The step is over when it returns.

Outside Lightning's step: :meth:`FTStep.first_sync` (rounds: the outer sync before the first inner step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from fsdp_strategies.ft.accounting import StepAccounting, StepInFlight
from fsdp_strategies.ft.cross_group import CrossGroupReduce
from fsdp_strategies.ft.data import StepAlignedData
from fsdp_strategies.ft.heal_state import HealState, SchedulerRollback
from fsdp_strategies.ft.manager import QuorumView
from fsdp_strategies.ft.nonfinite import leave_step_if_nonfinite
from fsdp_strategies.ft.semi_sync import SemiSync

__all__ = ["FTStep", "StepOrderError"]

#: the optimizer step proper, given the closure it runs (the strategy's parent's ``optimizer_step``)
OptimizerStep = Callable[[Callable[[], Any]], Any]


class StepOrderError(RuntimeError):
    """A method of :class:`FTStep` called out of the protocol's order: a bug in the caller, not a fault."""


class FTStep:
    """The step in flight of one replica group and its call order (see the module docstring).

    Args:
        semi: the rounds and the straggler switch (never active with ``sync="every_step"``).
        heal: the heal-state snapshot taken at the start of an every-step step.
        schedulers: the LR schedulers' rollback on a discarded step or round.
        accounting: counters, ``ft/*`` metrics and the events line of each finished step.
        group_id: this replica group's id; ``groups``: the most groups (``num_replica_groups``).
        progress: ``progress(step, pending)`` sets Lightning's optimizer-step count to ``step``
            (``pending``: 1 inside ``optimizer_step``, where Lightning increments after it returns; 0
            outside a step).
        module: the LightningModule the ``ft/*`` metrics are logged through (``None`` outside a fit).
    """

    def __init__(self, semi: SemiSync, heal: HealState, schedulers: SchedulerRollback,
                 accounting: StepAccounting, *, group_id: int, groups: int,
                 progress: Callable[[int, int], None],
                 module: Callable[[], Any]) -> None:
        self.semi, self.heal, self.schedulers, self.accounting = semi, heal, schedulers, accounting
        self.group_id, self.groups = group_id, groups
        self._progress, self._module = progress, module
        #: the data, timings and weights of the step in flight (the parts below read and write it)
        self.inflight = StepInFlight()
        self.cross = CrossGroupReduce(self.inflight, self.wait_quorum, lambda: semi.active)
        #: the step-aligned data (set at train start when the loader can follow the committed step)
        self.data: StepAlignedData | None = None
        self.manager: Any = None
        self.link: Any = None  # the manager with its all-reduces counted
        self._device = torch.device("cpu")
        self._world_size = 1
        self._writes_events = False
        self._begun = False  # begin() ran in this step and finish() has not
        self._rounds = False  # the step in flight is an inner step of a round
        self._quorum_started = False  # its every-step quorum is started ...
        self._quorum: QuorumView | None = None  # ... and waited for (None: not yet)

    # ------------------------------------------------------------------ set-up
    def bind(self, manager: Any, link: Any, *, device: torch.device, world_size: int,
             writes_events: bool) -> None:
        """This fit's manager (``link``: it with its all-reduces counted), at ``setup_environment``, before
        any step. ``world_size``: the group's data-parallel ranks; ``writes_events``: this rank writes the
        events file (rank 0 of the group)."""
        self.manager, self.link = manager, link
        self.cross.link = link
        self._device, self._world_size, self._writes_events = device, world_size, writes_events

    def unbind(self) -> None:
        """The manager is released (teardown): no step may begin until the next :meth:`bind`."""
        self.manager = self.link = self.cross.link = None
        self._begun = self._quorum_started = False
        self._quorum = None

    def committed_step(self) -> int:
        """The step every group agrees on: the quorum's (every step; plus the inner steps of earlier
        ``straggler_sync`` phases) or the inner-step position (rounds)."""
        return self.semi.committed_step(int(self.manager.current_step()))

    # ------------------------------------------------------------------ 1. begin
    def begin(self) -> None:
        """Begin the step in flight; call before every micro-batch's forward (the first call of a step
        begins it, the later calls of the same step do nothing). See the module docstring for what it starts.

        Raises :class:`StepOrderError` before :meth:`bind`.
        """
        if self.manager is None:
            raise StepOrderError("ft_hsdp step protocol: begin() before bind() (no torchft manager yet)")
        if self._begun:
            return
        self.schedulers.restore_pending()
        while not self.semi.active:
            self._start_quorum()
            if not self.semi.active:
                break
            # healed (straggler_sync's synchronous quorum) from groups in a semi-synchronous phase: finish
            # their outer sync with them; if that sync switched back to every step, this step is one
            self._join_outer_sync()
        self._rounds = self.semi.active
        if self._rounds:  # an inner step: no quorum
            assert self.semi.outer is not None
            if self.semi.outer.pending == 0:
                self.schedulers.mark_round_start()
            self.inflight.begin()
        self._begun = True

    def _start_quorum(self) -> None:
        step = self.inflight
        step.begin()
        with step.timed("capture"):
            self.heal.capture()
        self._quorum = None
        with step.timed("quorum_start"):  # synchronous with straggler_sync (heals here)
            self.manager.start_quorum()
        self._quorum_started = True
        if self.semi.switchable:  # the synchronous quorum is cross-group time
            step.cross_s += time.perf_counter() - step.t0

    # ------------------------------------------------------------------ 2. the quorum
    def wait_quorum(self) -> QuorumView:
        """Wait for this step's quorum (once per step, timed) and return it; call before the step's first
        cross-group byte.

        Raises :class:`StepOrderError` unless :meth:`begin` started an every-step quorum for this step (rounds
        have none: nothing crosses the groups in an inner step).
        """
        if not self._quorum_started:
            raise StepOrderError("ft_hsdp step protocol: wait_quorum() with no quorum started in this step "
                                 "(call begin() first; an inner step of a round has no quorum)")
        if self._quorum is not None:
            return self._quorum
        t0 = time.perf_counter()
        self._quorum = QuorumView.of(self.manager)
        self.inflight.quorum_wait_s += time.perf_counter() - t0
        return self._quorum

    def record_nonfinite(self, loss_nonfinite: bool) -> None:
        """``NonFiniteGuard``'s verdict on this rank's loss, before each backward (see ``ft/nonfinite.py``):
        agreed across the groups at once, or, when the step's reduction is deferred (accumulation), once by
        :meth:`finish` after the last backward. Nothing in rounds (a group's inner steps are its own)."""
        if self.manager is None or self.semi.active:
            return
        if self.cross.deferred:
            self.inflight.nonfinite = bool(self.inflight.nonfinite) or loss_nonfinite
        else:
            self._agree_nonfinite(loss_nonfinite)

    def _agree_nonfinite(self, loss_nonfinite: bool) -> None:
        self.wait_quorum()
        leave_step_if_nonfinite(loss_nonfinite, step=self.inflight, link=self.link, device=self._device,
                                group_id=self.group_id, groups=self.groups, step_number=self.committed_step())

    # ------------------------------------------------------------------ 3. finish
    def finish(self, closure: Callable[[], Any], optimizer_step: OptimizerStep, model: nn.Module) -> Any:
        """End the step inside Lightning's ``optimizer_step``; return what that returns (the loss if
        discarded).

        ``closure``: Lightning's (forward + backward of the step's last micro-batch);
        ``optimizer_step(closure)``: the optimizer step proper; ``model``: the sharded model (the deferred
        reduction's gradients).

        Raises :class:`StepOrderError` unless :meth:`begin` ran in this step, or if the mode changed since.
        """
        if not self._begun:
            raise StepOrderError("ft_hsdp step protocol: finish() with no step begun (call begin() before "
                                 "the step's first forward)")
        if self._rounds != self.semi.active:
            raise StepOrderError("ft_hsdp step protocol: the sync mode changed inside a step (a switch "
                                 "applies only when a step or outer sync ends)")
        if self._rounds:
            return self._finish_inner(closure, optimizer_step)
        return self._finish_synchronous(closure, optimizer_step, model)

    def _finish_synchronous(self, closure: Callable[[], Any], optimizer_step: OptimizerStep,
                            model: nn.Module) -> Any:
        step, manager = self.inflight, self.manager
        loss = closure()  # forward + backward; the all-reduce hook reduces across groups
        self.cross.wait_pending()  # the backward's end waited already (unless it never ran)
        if self.cross.deferred:  # accumulation: the step's one cross-group reduction, after its backward
            if step.nonfinite is not None:  # NonFiniteGuard's verdict over the step's micro-batches
                self._agree_nonfinite(step.nonfinite)
            self.cross.reduce_accumulated(model)
        quorum = self.wait_quorum()
        step.participating = quorum.participating  # False while healing: zeros contributed
        if self.semi.vote_due(self.committed_step()):  # between the quorum and should_commit: commits with it
            t0 = time.perf_counter()
            self.semi.vote()
            step.cross_s += time.perf_counter() - t0
        t1 = time.perf_counter()
        committed = bool(manager.should_commit())  # applies a healed state first
        commit_s = time.perf_counter() - t1
        self._begun = self._quorum_started = False
        self._progress(self.committed_step(), 1)
        if committed:
            out = optimizer_step(lambda: loss)
        else:
            self.schedulers.discard_step()
            out = loss
        self._close(committed, commit_s, participants=quorum.participants)
        self.semi.synchronous_step_ended(committed, step.cross_s + commit_s)
        return out

    def _finish_inner(self, closure: Callable[[], Any], optimizer_step: OptimizerStep) -> Any:
        """Rounds: a local optimizer step, then the outer sync when the round ends."""
        outer, step = self.semi.outer, self.inflight
        assert outer is not None
        out = optimizer_step(closure)
        if self.data is not None and step.position is not None:
            self.semi.round_samples += step.own_samples * self._world_size
        t0 = time.perf_counter()
        committed = outer.after_inner_step()
        sync_s = time.perf_counter() - t0
        self._begun = False
        self._progress(outer.step, 1)
        if committed is not None:
            if not committed:  # the round's inner steps are rolled back: so are the LR schedulers
                self.schedulers.discard_round()
            self._close(committed, time.perf_counter() - t0)
            self.semi.round_samples = 0
        step.position = None
        self.semi.inner_step_ended(committed, sync_s)
        return out

    def _close(self, committed: bool, commit_s: float, log: bool = True,
               participants: int | None = None) -> None:
        """Account a committed / discarded step or outer sync (``log``: its ``ft/*`` metrics, in a step;
        ``participants``: the step's quorum's, else the manager's)."""
        self.cross.end_step()  # the next step starts undeferred
        self.accounting.close_step(
            self.inflight, committed=committed, commit_s=commit_s, manager=self.manager,
            participants=participants,
            committed_step=self.committed_step(), data=self.data, world_size=self._world_size,
            round_of=self.semi.outer if self.semi.active else None, round_samples=self.semi.round_samples,
            write_event=self._writes_events, module=self._module() if log else None)

    # ------------------------------------------------------------------ outer syncs outside Lightning's step
    def first_sync(self) -> bool:
        """Rounds: the outer sync before the first inner step (a restarted group heals here from a peer); call
        once at train start. Raises :class:`StepOrderError` inside a step or without rounds."""
        if self._begun or not self.semi.active:
            raise StepOrderError("ft_hsdp step protocol: first_sync() inside a step or without rounds")
        self.inflight.begin()
        return self._outer_sync_between_steps(join=False)

    def _join_outer_sync(self) -> None:
        """Healed, in the every-step quorum, from groups in a semi-synchronous phase: join their outer sync,
        then continue in rounds (or every step, if that sync switched back)."""
        self._quorum_started, self._quorum = False, None
        committed = self._outer_sync_between_steps(join=True)
        rank_zero_info(f"ft_hsdp: replica group {self.group_id} healed into a {self.semi.mode} phase and "
                       f"joined its outer sync ({'committed' if committed else 'discarded'}); continuing at "
                       f"step {self.committed_step()}")

    def _outer_sync_between_steps(self, join: bool) -> bool:
        """An outer sync outside Lightning's step: the first (train start), or (``join``) the sync of the
        semi-synchronous groups this group healed from in its every-step quorum (it finishes it with them)."""
        outer = self.semi.outer
        assert outer is not None
        t0 = time.perf_counter()
        committed = outer.sync(quorum=False) if join else outer.initial_sync()
        # an events line (the launcher sees the group live from here); no ft/* metrics outside a step
        self._close(committed, time.perf_counter() - t0, log=False)
        self.semi.apply_vote(committed)
        if outer.healed:
            self.schedulers.restep_after_heal()
        self._progress(self.committed_step(), 0)
        return committed
