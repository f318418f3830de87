"""The strategy's side of semi-synchronous rounds: ``sync="local_sgd"|"diloco"`` and ``straggler_sync``.

:class:`SemiSync` is what ``FTHSDPStrategy`` composes to run rounds; the mechanisms are elsewhere
(:mod:`fsdp_strategies.ft.outer_sync`: torchft's DiLoCo driven from the step;
:mod:`fsdp_strategies.ft.straggler_switch`: the agreed switch state, the decision, the cost clock).

* **Start** (:meth:`SemiSync.start`, at train start): the checks both modes share (``max_steps`` a
  multiple of ``sync_every``, one optimizer), the FSDP units resharded (a sanity-check validation leaves
  the root unsharded; DiLoCo backs up shards), then the :class:`~fsdp_strategies.ft.outer_sync.OuterSync`.
  With ``straggler_sync`` it is built dormant, in every mode, so every group registers the same heal-state
  keys whatever its mode (torchft loads the receiver's keys from the sender's state), and the switch state
  joins the heal state.
* **Which step** (:meth:`SemiSync.committed_step`): the inner-step position of the outer sync in a round,
  else the manager's step plus the inner steps of earlier ``straggler_sync`` phases (the switch's offset).
* **The vote** (``straggler_sync``): every ``sync_every`` committed steps the groups' costs are all-reduced
  inside the step (every-step phase: after backward, before ``should_commit``; in rounds: inside the outer
  sync, after its quorum) as a vector indexed by replica group (a healing group's zeros); every member
  derives the same decision from the same vector and the heal state's streak. :meth:`SemiSync.apply_vote`
  applies it only when that step/sync commits: every-step -> rounds rebases DiLoCo on the current
  (identical) parameters; rounds -> every-step after a committed outer sync, with the inner optimizers'
  states averaged in the same sync (they diverged in the rounds), so identical parameters stay identical
  under the same gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.fsdp import FSDPModule

from fsdp_strategies.ft.heal_state import local
from fsdp_strategies.ft.outer_sync import OuterSync
from fsdp_strategies.ft.protocol import EventLog
from fsdp_strategies.ft.straggler_switch import STATE_KEY as SWITCH_STATE_KEY
from fsdp_strategies.ft.straggler_switch import CostClock, SwitchState, decide
from fsdp_strategies.protocols import SyncModeSwitch

if TYPE_CHECKING:
    from torch.optim import Optimizer

__all__ = ["SemiSync", "check_rounds"]


def check_rounds(option: str, value: str, *, max_steps: int, sync_every: int, num_optimizers: int,
                 max_steps_required: bool) -> None:
    """Start-up checks of a mode with rounds (``option=value`` names it in the errors).

    ``max_steps`` must end the last round with an outer sync (else the groups' last inner steps differ);
    without ``max_steps`` that is only a warning unless ``max_steps_required`` (``straggler_sync``: a phase
    must end with an outer sync to switch back). One optimizer: DiLoCo wraps one.
    """
    where = f"{option}={value!r}"
    if max_steps <= 0 and not max_steps_required:
        rank_zero_warn(
            f"ft_hsdp: {where} without max_steps: the inner steps after the last outer sync are not "
            "averaged across groups. Fix: stop with a max_steps multiple of sync_every."
        )
    elif max_steps <= 0 or max_steps % sync_every:
        what = "is not set" if max_steps <= 0 else f"is not a multiple of sync_every={sync_every}"
        raise ValueError(
            f"ft_hsdp: max_steps={max_steps} {what} with {where}: the last round would end without an "
            "outer sync and the groups would differ. Fix: set trainer.max_steps to a multiple of "
            f"sync_every={sync_every}."
        )
    if num_optimizers != 1:
        raise ValueError(
            f"ft_hsdp: {where} supports one optimizer, got {num_optimizers}. Fix: return a single "
            "optimizer from configure_optimizers."
        )


class SemiSync(SyncModeSwitch):
    """This group's rounds: the outer sync, and with ``straggler_sync`` the switch (see the module docstring);
    the :class:`~fsdp_strategies.protocols.SyncModeSwitch` that ``StragglerDetector`` drives.

    ``manager`` is the counted manager (:class:`fsdp_strategies.ft.manager.CountedManager`); ``stats`` the
    strategy's ``ft_stats``.
    """

    def __init__(self, *, sync: str, straggler_sync: str, sync_every: int, outer_lr: float,
                 outer_momentum: float,
                 num_fragments: int, replica_group_id: int, num_replica_groups: int) -> None:
        self.switchable = straggler_sync != "off"
        #: the semi-synchronous mode of the rounds (``straggler_sync``'s fallback, or ``sync``)
        self.mode = straggler_sync if self.switchable else sync
        self.sync_every, self.num_fragments = sync_every, num_fragments
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.replica_group_id, self.num_replica_groups = replica_group_id, num_replica_groups
        self.outer: OuterSync | None = None
        #: the agreed switch state (``straggler_sync`` on), the vote settings from the detector, the last cost
        #: this group's detector reported, the vote of the step in flight (applied only if it commits)
        self.switch: SwitchState | None = SwitchState() if self.switchable else None
        self._vote_cfg: tuple[float, int] | None = None
        self._reported_cost = 0.0
        self._pending_vote: dict[str, Any] | None = None
        self._pending_opt_avg: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.cost = CostClock()
        #: every switch of this process: ``{"step", "event": "switch", "to", "cost", "costs"}``
        self._switch_events: list[dict[str, Any]] = []
        #: this group's samples (all ranks) in the round in progress
        self.round_samples = 0
        self._manager: Any = None
        self._optimizer: Optimizer | None = None
        self._device = torch.device("cpu")
        self._stats: dict[str, float] = {}
        self._events: EventLog | None = None

    # ------------------------------------------------------------------ state
    @property
    def active(self) -> bool:
        """Whether steps are inner steps of a round now (``sync`` in rounds, or a ``straggler_sync``
        phase)."""
        return self.outer is not None and (self.switch is None or self.switch.semi)

    def committed_step(self, manager_step: int) -> int:
        """The step every group agrees on, given the manager's (which counts every-step steps and outer
        syncs)."""
        if self.active:
            assert self.outer is not None
            return self.outer.step
        return manager_step + (self.switch.offset if self.switch is not None else 0)

    # ------------------------------------------------------------------ the SyncModeSwitch protocol
    # (fsdp_strategies.protocols.SyncModeSwitch documents it; the strategy forwards it to this object)
    @property
    def sync_switch_available(self) -> bool:
        return self.switchable

    @property
    def semi_sync_active(self) -> bool:
        return self.switch is not None and self.switch.semi

    @property
    def sync_switch_events(self) -> list[dict[str, Any]]:
        return self._switch_events

    def configure_sync_switch(self, threshold: float, patience: int) -> None:
        self._vote_cfg = (float(threshold), int(patience))

    def sync_cost_counters(self) -> tuple[float, float]:
        return self.cost.counters()

    def report_sync_cost(self, cost: float) -> None:
        self._reported_cost = float(cost)

    # ------------------------------------------------------------------ the cost clock and the vote, per step
    def synchronous_step_ended(self, committed: bool, cross_s: float) -> None:
        """An every-step step ended (``cross_s``: its cross-group seconds, quorum and commit included)."""
        if self.switchable:
            self.cost.synchronous_step(cross_s)
            self.apply_vote(committed)

    def inner_step_ended(self, committed: bool | None, sync_s: float) -> None:
        """An inner step ended; ``committed``: that of the outer sync it ended with, in ``sync_s`` (``None``:
        no sync)."""
        if not self.switchable:
            return
        if committed is None:
            self.cost.inner_step()
            return
        assert self.outer is not None
        self.cost.sync_step(sync_s, self.outer.last_quorum_s, self.sync_every)
        self.apply_vote(committed)

    # ------------------------------------------------------------------ start
    def start(self, *, manager: Any, model: nn.Module, optimizers: list[Optimizer], device: torch.device,
              max_steps: int, global_step: int, before_quorum: Callable[[], None], stats: dict[str, float],
              events: EventLog | None) -> None:
        """Check the options against the trainer and build the outer sync (once per process).

        ``events``: where switches are recorded (rank 0 of the group), else ``None``.
        """
        option = "straggler_sync" if self.switchable else "sync"
        if self.switchable and self._vote_cfg is None:
            raise ValueError(f"ft_hsdp: straggler_sync={self.mode!r} needs a StragglerDetector with "
                             "action='semi_sync' (it measures the cost and sets the threshold). Fix: add "
                             "{class_path: fsdp_strategies.callbacks.StragglerDetector, "
                             "init_args: {action: semi_sync}} "
                             "to trainer.callbacks, or straggler_sync='off'.")
        check_rounds(option, self.mode, max_steps=max_steps, sync_every=self.sync_every,
                     num_optimizers=len(optimizers), max_steps_required=self.switchable)
        # a sanity-check validation leaves the root unsharded: DiLoCo needs shards
        for sub in model.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()
        self._manager, self._optimizer, self._device, self._stats = manager, optimizers[0], device, stats
        self._events = events
        if self.outer is None:
            self.outer = OuterSync(manager, model, optimizers[0], mode=self.mode, sync_every=self.sync_every,
                                   outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
                                   num_fragments=self.num_fragments, before_quorum=before_quorum, stats=stats,
                                   after_quorum=self.vote if self.switchable else None)
            if self.switch is not None:
                manager.register_state_dict_fn(SWITCH_STATE_KEY, self.switch.load, self.switch.save)
            else:
                self.outer.committed = global_step  # a resumed checkpoint's step
        self.round_samples = 0
        if self.switch is None:
            return
        self.switch.offset = global_step - int(manager.current_step())
        stats.setdefault("switch_votes", 0)
        stats.setdefault("switches", 0)
        assert self._vote_cfg is not None
        threshold, patience = self._vote_cfg
        rank_zero_info(
            f"ft_hsdp: straggler_sync={self.mode!r}: every-step reduction, switching to rounds of "
            f"{self.sync_every} steps while the cross-group cost > {threshold:.0%} of the step time for "
            f"{patience} boundaries (every {self.sync_every} committed steps), back below {threshold / 2:.0%}"
        )

    # ------------------------------------------------------------------ the switch vote
    def vote_due(self, committed_step: int) -> bool:
        """Every-step phase: the step that ends at a multiple of ``sync_every`` (decided after the quorum, so
        a group that just healed has the quorum's step)."""
        return (
            self.switch is not None and self.outer is not None and (committed_step + 1) % self.sync_every == 0
        )

    def vote(self) -> None:
        """One boundary's vote, inside a step or sync; applied by :meth:`apply_vote` only when that
        commits."""
        assert self.switch is not None and self._vote_cfg is not None
        costs = torch.zeros(self.num_replica_groups, dtype=torch.float32, device=self._device)
        costs[self.replica_group_id] = self._reported_cost
        self._manager.allreduce(costs, reduce_op=ReduceOp.SUM).wait()
        self._stats["switch_votes"] += 1
        values = [float(c) for c in costs.cpu()]
        cost = max(values)
        threshold, patience = self._vote_cfg
        semi, streak = decide(self.switch.semi, self.switch.streak, cost, threshold, patience)
        self._pending_vote = {"semi": semi, "streak": streak, "cost": cost, "costs": values}
        if self.switch.semi and not semi:
            self._pending_opt_avg = self._average_optimizer_state()

    def _average_optimizer_state(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """All-reduce (average) copies of this rank's inner-optimizer state shards across the groups."""
        assert self._optimizer is not None
        opt = self._optimizer
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        works = []
        for group in opt.param_groups:
            for param in group["params"]:
                for key in sorted(opt.state.get(param, {})):
                    value = local(opt.state[param][key])
                    if (
                        not isinstance(value, torch.Tensor)
                        or value.dim() == 0
                        or not value.is_floating_point()
                    ):
                        continue  # step counters are equal on every group
                    copy = value.detach().clone()
                    works.append(self._manager.allreduce(copy, reduce_op=ReduceOp.AVG))
                    pairs.append((value, copy))
        for work in works:
            work.wait()
        return pairs

    def apply_vote(self, committed: bool) -> None:
        """Apply the vote of the step/sync that just ended, if it committed (identical on every member); a
        switch is kept in :attr:`sync_switch_events` and written to the events file."""
        vote, self._pending_vote = self._pending_vote, None
        averaged, self._pending_opt_avg = self._pending_opt_avg, None
        if vote is None or not committed:
            return
        assert self.switch is not None and self.outer is not None and self._vote_cfg is not None
        self.switch.streak = vote["streak"]
        if vote["semi"] == self.switch.semi:
            return
        step = self.committed_step(int(self._manager.current_step()))
        if vote["semi"]:  # every-step -> rounds: the parameters are identical on every group after this step
            self.outer.rebase(step)
        else:  # rounds -> every-step, after a committed outer sync: replicas identical
            with torch.no_grad():
                for value, avg in averaged or []:
                    value.copy_(avg)
            self.switch.offset = step - int(self._manager.current_step())
        self.switch.semi = vote["semi"]
        self.switch.switches += 1
        self._stats["switches"] += 1
        to = self.mode if vote["semi"] else "every_step"
        event = {"step": step, "event": "switch", "to": to, "cost": vote["cost"], "costs": vote["costs"]}
        self._switch_events.append(event)
        rank_zero_info(
            f"ft_hsdp: switch to {to} at committed step {step}: cross-group cost {vote['cost']:.0%} of the "
            f"step time (max over groups; threshold {self._vote_cfg[0]:.0%})"
        )
        if self._events is not None:
            self._events.write_switch(self.replica_group_id, step, to, vote["cost"], vote["costs"])
