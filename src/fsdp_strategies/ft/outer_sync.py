"""Semi-synchronous ``ft_hsdp``: ``sync="local_sgd"`` / ``"diloco"`` on torchft's ``DiLoCo``, with FSDP2 in a
group.

Why: with ``sync="every_step"`` every FSDP unit's gradient crosses the replica groups every step; over
slow links between groups that is the bottleneck. Here each group trains ``sync_every`` *inner* steps
alone (only its own FSDP collectives), then the groups average, fault-tolerantly, the *pseudo-gradient*
``backup - local`` (backup = the parameters of the last committed outer step) and apply it with an
*outer* optimizer: ``diloco`` = Nesterov SGD (``outer_lr``, ``outer_momentum``), ``local_sgd`` = plain
model averaging (SGD with lr 1 and no momentum: ``backup - mean(backup - local) = mean(local)``).

Built on torchft 0.2.0 (nothing is hand-rolled): ``torchft.local_sgd.DiLoCo`` holds the backup
(``extract_local_tensor``: this rank's DTensor shard, so each rank of a group backs up and reduces only
its own shard, and rank ``r`` of every group meets rank ``r`` of the others in the manager's process
group), the outer optimizers, the per-fragment all-reduce through ``Manager.allreduce`` and the
commit through ``Manager.should_commit``; its fragments register their state (backup parameters and
outer-optimizer state, keys ``StreamingDiLoCoFragment_<i>``) with the manager, so the live heal sends
them next to the strategy's own heal state (parameters, inner-optimizer state, LR schedulers).

What this module adds around it (torchft#171 -- DiLoCo with several ranks in a group -- is open upstream):

* **The driver.** The strategy calls :meth:`OuterSync.after_inner_step` after each inner optimizer step
  and :meth:`OuterSync.initial_sync` once at train start. A sync = ``Manager.start_quorum()`` (torchft's
  DiLoCo requires the synchronous quorum: a healing group applies the peer's state there, before it
  computes its pseudo-gradient) then ``prepare_sync()`` / ``perform_sync()`` of the fragment whose turn it
  is (the same choice DiLoCo makes: ``manager step mod fragments``). We call them ourselves instead of
  through DiLoCo's optimizer hooks so that (1) we learn whether the outer step committed, (2) a group
  that (re)starts syncs *before* its first inner step: it heals from a live peer at once instead of
  training a round from stale weights, and its inner steps are in phase with the other groups'.
* **Committed inner steps.** The manager's step counts outer syncs. The strategy's step (Lightning's
  ``global_step``, the data position of :mod:`fsdp_strategies.ft.data`) is :attr:`OuterSync.step` =
  inner steps covered by committed outer steps + inner steps since the last sync. It is part of the heal
  state (key ``fsdp_strategies_sync``), so a healed group continues at the quorum's position.
* **Discard = roll back.** ``perform_sync`` always restores the backup and applies the outer step only on
  commit, on every member alike (``should_commit`` is a vote). On a discarded sync the inner steps since
  the last sync are gone from the parameters, so :attr:`step` falls back by that much and those batches
  are trained again (the strategy also rolls the LR schedulers back to the round's start). The inner
  optimizer's moments are not rolled back (as in torchft).
* **Preemption.** The per-step SIGTERM agreement of :mod:`fsdp_strategies.runtime.preemption` is an all-reduce
  on the group's *own* gloo group (each replica group is its own ``torch.distributed`` world), not cross-group
  traffic, so it keeps running every inner step (no ``check_due`` given to its guard): every rank of a group
  stops at the same inner step; for the other groups that group is then absent, as after a kill.
* **Counting.** The strategy hands in its :class:`fsdp_strategies.ft.manager.CountedManager`, so every
  cross-group all-reduce of DiLoCo is counted (``cross_group_allreduces`` / ``cross_group_bytes`` in
  ``ft_stats``) like the FSDP hook's.

Limits (torchft 0.2.0): a group that heals at a sync contributes a copy of its source peer's
pseudo-gradient to that sync (the synchronous quorum makes it a participant), so that peer's round counts
twice in the average; its own shard's batches of that round are missed (reported). Streaming DiLoCo
(``num_fragments > 1``) works with FSDP2 shards (fragments are partitions of the sharded parameters);
its overlap option ``fragment_sync_delay`` is not offered: torchft then keeps the inner steps taken while
the fragment's all-reduce is in flight only as ``fragment_update_alpha`` mixes them, so no step count
says which batches the model holds. The lighthouse must wait for a live group to reach its sync:
``join_timeout_ms`` >= one round (``sync_every`` inner steps), or a restarting group may form a quorum
alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
from torch import nn

from fsdp_strategies import _torch_seam

__all__ = ["SYNC_MODES", "OuterSync", "SyncMode", "validate_sync_options"]

SyncMode = Literal["every_step", "local_sgd", "diloco"]
#: valid values of ``sync``
SYNC_MODES: tuple[str, ...] = get_args(SyncMode)
#: the manager state-dict key of this module's part of the heal state
STATE_KEY = "fsdp_strategies_sync"


def validate_sync_options(sync: str, sync_every: int, outer_lr: float, outer_momentum: float,
                          num_fragments: int, data_on_failure: str) -> None:
    """Raise ``ValueError`` naming the option, its value and the fix (before any process group exists)."""
    if sync not in SYNC_MODES:
        raise ValueError(
            f"ft_hsdp: sync={sync!r} is not a valid value. Fix: set strategy.init_args.sync to one of "
            f"{SYNC_MODES}."
        )
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(
            f"ft_hsdp: sync_every={sync_every!r} is invalid. Fix: a positive integer (inner steps "
            "between outer syncs)."
        )
    if sync == "every_step":
        if sync_every != 1 or num_fragments != 1:
            raise ValueError(
                f"ft_hsdp: sync_every={sync_every}, num_fragments={num_fragments} need a semi-synchronous "
                "mode. Fix: set strategy.init_args.sync to 'local_sgd' or 'diloco', or leave sync_every=1 "
                "and num_fragments=1."
            )
        return
    if isinstance(num_fragments, bool) or not isinstance(num_fragments, int) or num_fragments < 1:
        raise ValueError(
            f"ft_hsdp: num_fragments={num_fragments!r} is invalid. Fix: a positive integer (1 = plain "
            "DiLoCo, >1 = streaming DiLoCo)."
        )
    if sync_every % num_fragments:
        raise ValueError(
            f"ft_hsdp: sync_every={sync_every} is not a multiple of num_fragments={num_fragments} (each "
            "fragment syncs every sync_every steps, one fragment every sync_every/num_fragments steps). "
            f"Fix: set sync_every to a multiple of {num_fragments}."
        )
    if not (isinstance(outer_lr, (int, float)) and not isinstance(outer_lr, bool) and outer_lr > 0):
        raise ValueError(
            f"ft_hsdp: outer_lr={outer_lr!r} is invalid. Fix: a positive number (DiLoCo uses 0.7)."
        )
    if not (isinstance(outer_momentum, (int, float)) and not isinstance(outer_momentum, bool)
            and 0 <= outer_momentum < 1):
        raise ValueError(
            f"ft_hsdp: outer_momentum={outer_momentum!r} is invalid. Fix: a number in [0, 1) (DiLoCo uses "
            "0.9; 0 = plain SGD on the pseudo-gradient)."
        )
    if sync == "local_sgd" and (outer_lr != 1.0 or outer_momentum != 0.0):
        raise ValueError(f"ft_hsdp: outer_lr={outer_lr!r}, outer_momentum={outer_momentum!r} do not apply to "
                         "sync='local_sgd' (plain model averaging). Fix: "
                         "use sync='diloco' for an outer optimizer, or "
                         "leave outer_lr=1.0 and outer_momentum=0.0.")
    if data_on_failure == "redistribute":
        raise ValueError(
            f"ft_hsdp: data_on_failure='redistribute' needs a quorum every step, but sync={sync!r} forms one "
            "only at outer syncs. Fix: data_on_failure='skip' with sync='local_sgd'/'diloco', or "
            "sync='every_step'."
        )


def _fragments(model: nn.Module, n: int) -> list[nn.Module]:
    """``n`` modules holding contiguous runs of ``model``'s parameters (near-equal sizes); ``[model]`` for
    1."""
    if n == 1:
        return [model]
    params = [p for p in model.parameters() if p.requires_grad]
    if len(params) < n:
        raise ValueError(
            f"ft_hsdp: num_fragments={n} but the model has {len(params)} trainable parameter tensors. "
            f"Fix: num_fragments <= {len(params)}."
        )
    total = sum(p.numel() for p in params)
    holders = [nn.Module() for _ in range(n)]
    sizes = [0] * n
    seen, k = 0, 0
    for i, p in enumerate(params):
        # move on when this fragment has its share (keep at least one tensor for each remaining fragment)
        while k < n - 1 and sizes[k] and (seen >= total * (k + 1) / n or len(params) - i <= n - 1 - k):
            k += 1
        holders[k].register_parameter(f"p{i}", p)
        sizes[k] += 1
        seen += p.numel()
    return holders


class OuterSync:
    """torchft ``DiLoCo`` driven from the strategy's step (see the module docstring).

    Protocol: build it in ``on_train_start`` (after the optimizer exists, before any inner step) with the
    manager created with ``use_async_quorum=False``; call :meth:`initial_sync` once, then
    :meth:`after_inner_step` after every inner optimizer step, on every rank of the group.
    ``manager`` is what DiLoCo all-reduces through (the strategy's counted manager).
    ``before_quorum`` is called right before each quorum (refresh the strategy's heal state),
    ``after_quorum`` (optional) right after it, before the fragment's all-reduces (the strategy's switch vote:
    inside the sync, so the sync's commit decides whether the vote applies).
    """

    def __init__(self, manager: Any, model: nn.Module, optimizer: torch.optim.Optimizer, *, mode: str,
                 sync_every: int, outer_lr: float, outer_momentum: float, num_fragments: int,
                 before_quorum: Callable[[], None], stats: dict[str, float],
                 after_quorum: Callable[[], None] | None = None) -> None:
        from torchft.local_sgd import DiLoCo

        self.mode = mode
        self.sync_every = sync_every
        self.interval = sync_every // num_fragments
        self._manager = manager
        self._before_quorum = before_quorum
        self.stats = stats
        for key in ("syncs", "syncs_discarded"):
            stats.setdefault(key, 0)
        fragments = _fragments(model, num_fragments)
        lr, momentum = (1.0, 0.0) if mode == "local_sgd" else (outer_lr, outer_momentum)
        outer = [
            torch.optim.SGD(f.parameters(), lr=lr, momentum=momentum, nesterov=momentum > 0)
            for f in fragments
        ]
        self._after_quorum = after_quorum
        # DiLoCo backs up this rank's shards now and registers each fragment's state with the manager
        self._diloco = DiLoCo(manager, fragments, optimizer, outer, sync_every=sync_every, pin_memory=False)
        #: inner steps covered by committed outer steps, and inner steps since the last sync
        self.committed = 0
        self.pending = 0
        #: result of the last sync (``None`` before the first)
        self.last_committed: bool | None = None
        #: participants of the last sync and whether this group healed in it
        self.last_participants = 0
        self.healed = False
        #: inner steps the last committed sync covered; seconds its quorum took (the wait for the other
        #: groups)
        self.last_round = 0
        self.last_quorum_s = 0.0
        manager.register_state_dict_fn(STATE_KEY, self._load, self._save)

    # -------------------------------------------------------------- heal state
    def _save(self) -> dict[str, int]:
        return {"committed": self.committed, "pending": self.pending}

    def _load(self, state: dict[str, int]) -> None:
        self.committed, self.pending = int(state["committed"]), int(state["pending"])
        self.healed = True

    # -------------------------------------------------------------- the step
    @property
    def step(self) -> int:
        """This group's position in inner steps: committed ones plus those since the last sync."""
        return self.committed + self.pending

    def after_inner_step(self) -> bool | None:
        """Count the inner step; sync when it ends a round. ``None`` = no sync, else whether it committed."""
        self.pending += 1
        if self.pending % self.interval:
            return None
        return self.sync()

    def initial_sync(self) -> bool:
        """Sync before the first inner step of this process: heal from a live peer / agree on the start."""
        return self.sync()

    def rebase(self, step: int) -> None:
        """Start rounds from the current parameters at committed inner step ``step`` (``straggler_sync``: the
        switch from every-step reduction, where every group holds the same parameters): they become DiLoCo's
        backup (the point a discarded sync rolls back to and the pseudo-gradient's origin)."""
        for fragment in _torch_seam.diloco_fragments(self._diloco):
            fragment.save_parameters()
        self.committed, self.pending = step, 0
        self.healed = False

    def sync(self, quorum: bool = True) -> bool:
        """One outer step of the fragment whose turn it is; committed or discarded on every member.

        ``quorum=False``: the caller already formed this sync's quorum (``straggler_sync``: a group that
        healed in its every-step quorum from groups that are in a semi-synchronous phase joins their outer
        sync).
        """
        self.last_quorum_s = 0.0
        if quorum:
            self._before_quorum()
            self.healed = False
            t0 = time.perf_counter()
            # synchronous: a healing group has applied the peer's state on return
            self._manager.start_quorum()
            self.last_quorum_s = time.perf_counter() - t0
        if self._after_quorum is not None:
            self._after_quorum()
        fragments = _torch_seam.diloco_fragments(self._diloco)
        fragment = fragments[self._manager.current_step() % len(fragments)]
        fragment.prepare_sync()
        committed = bool(fragment.perform_sync())  # restores the backup; outer step only on commit
        self.last_participants = int(self._manager.num_participants())
        self.stats["syncs"] += 1
        if committed:
            self.last_round = self.pending
            self.committed += self.pending
        else:
            self.stats["syncs_discarded"] += 1
            self.last_round = 0
        self.pending = 0
        self.last_committed = committed
        return committed
