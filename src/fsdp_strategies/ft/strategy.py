"""``ft_hsdp``: fault-tolerant HSDP on torchft -- replica groups are the unit of failure.

Each replica group is an ordinary Lightning job (``devices`` = ranks in the group) that shards the model with
FSDP2 over its own 1-D mesh. Across groups, the gradients are averaged by torchft's fault-tolerant all-reduce
(``Manager.allreduce``'s rules on its process group; :mod:`~fsdp_strategies.ft.cross_group`: per FSDP unit in
the backward pass, or once after the last micro-batch under gradient accumulation), whose membership is
re-decided every step by a ``torchft.Manager`` talking to a lighthouse. When a group dies the others go on;
the restarted group heals from a live peer (the manager's checkpoint transport), not from a checkpoint.

Lightning's step, bridged to torchft's protocol (nothing in the LightningModule changes; the order is
:class:`~fsdp_strategies.ft.step.FTStep`'s, each hook below one call into it):

* ``on_train_batch_start``: snapshot this rank's shards (a healer fetches them), ``Manager.start_quorum()``.
* forward + backward: the all-reduce hook waits for the quorum and reduces across groups (errors recorded);
  with ``accumulate_grad_batches`` the step's micro-batches share one quorum, one reduction and one commit.
* ``optimizer_step``: ``Manager.should_commit()`` (applies a healed state first, then votes); the optimizer
  steps only on commit. A discarded step leaves parameters, optimizer state and LR schedulers untouched on
  every member. Lightning's progress counters follow the manager's committed step: ``Trainer.global_step``
  is the quorum's step on every group (a healed group jumps forward) and ``max_steps`` stops all alike.

Data: sharded over ``num_replica_groups x ranks`` (``torchft.data.DistributedSampler``'s layout), the batch
follows the committed step (:mod:`~fsdp_strategies.ft.data`), after a heal or a discard too; a down group's
batches are missed (``data_on_failure="skip"``) or trained by the others (``"redistribute"``). Rounds
(``sync="local_sgd"|"diloco"``) and the straggler switch: :mod:`~fsdp_strategies.ft.semi_sync`.

This class is the Lightning glue (options, the hooks above, leaving, checkpoint writing); the parts live in
their own modules: ``options``, ``manager``, ``step`` (the step protocol), ``heal_state``, ``semi_sync``,
``redistribute``, ``nonfinite`` (a group with a non-finite loss leaves the step's average), ``accounting``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies import _torch_seam
from fsdp_strategies._options import check_degree
from fsdp_strategies.ft import resume_width
from fsdp_strategies.ft.accounting import StepAccounting
from fsdp_strategies.ft.data import StepAlignedData
from fsdp_strategies.ft.heal_state import HealState, SchedulerRollback, TrainingState, resume_from_handed
from fsdp_strategies.ft.leave import exit_if_unfixable, leave_now
from fsdp_strategies.ft.manager import (
    CountedManager,
    LighthouseUnreachableError,
    check_lighthouse,
    create_manager,
    release_manager,
)
from fsdp_strategies.ft.options import (
    DataOnFailure,
    Transport,
    check_ft_options,
    check_group_size,
    check_training,
    resolve_placement,
)
from fsdp_strategies.ft.outer_sync import SyncMode
from fsdp_strategies.ft.protocol import LEAVE_EXIT_CODE, EventLog, FTEnvironment, wait_for_activation
from fsdp_strategies.ft.redistribute import add_missing_groups, warn_unless_sharded
from fsdp_strategies.ft.semi_sync import SemiSync
from fsdp_strategies.ft.step import FTStep
from fsdp_strategies.ft.straggler_switch import StragglerSync
from fsdp_strategies.parallel.mesh import ParallelDims
from fsdp_strategies.parallel.replicated_params import set_all_reduce_hook
from fsdp_strategies.strategies.fsdp2 import FSDP2Strategy

__all__ = ["LEAVE_EXIT_CODE", "FTHSDPStrategy", "LighthouseUnreachableError"]


class FTHSDPStrategy(FSDP2Strategy):
    """HSDP whose replication runs across jobs: FSDP2 inside a replica group, torchft's fault-tolerant
    all-reduce across replica groups. Inside each group's job the mesh is ``fsdp2``'s 1-D one over the
    group's ranks (no ``replicate_degree``: the replication is torchft's, across jobs), hence the parent.

    Args:
        lighthouse_addr: ``http://host:port`` of the torchft lighthouse; default ``$TORCHFT_LIGHTHOUSE``.
        replica_group_id: this group's id in ``[0, num_replica_groups)``; default ``$REPLICA_GROUP_ID``.
            It names the manager (``ft_hsdp_<id>``, torchft appends a uuid) and picks the data shard.
        num_replica_groups: the most groups that will ever train at once (data is sharded over
            them); default ``$NUM_REPLICA_GROUPS``.
        min_replica_size: fewest groups that must take part for a step to commit.
        shard_degree: ranks per replica group (``"auto"`` = nodes x devices of this job); a number
            is checked against that.
        checkpoint_transport: how a healing group fetches the live state: ``"pg"`` (send/recv over
            the cross-group process group) or ``"http"`` (torchft's HTTP server).
        timeout_s: cross-group collectives, ``should_commit`` and the heal transfer; ``None``: 60 s.
        quorum_timeout_s: longest wait for a quorum; ``None``: derived from N, the lighthouse's timeouts and a
            round.
        connect_timeout_s: connecting to the lighthouse and peers' managers; ``None``: min(10 s, quorum
            timeout).
        init_sync: at step 0 every group copies the weights of one group. With torchft 0.2.0 the copying
            groups contribute zero gradients to that first step while the average still divides by every
            group, so set ``False`` when all groups are seeded identically (``seed_everything``): no
            transfer, and the first step equals ``hsdp``'s.
        max_retries: raise after this many consecutive discarded steps (``None`` = never).
        hostname: the address other groups use to reach this group's manager (default: this host).
        events_file: JSON-lines file written by each group's rank 0, one line per step (default
            ``$FSDP_STRATEGIES_FT_EVENTS``; ``{replica_group_id}`` is substituted).
        data_on_failure: what happens to a down group's data. ``"skip"``: its shard's batches for the steps it
            is down are not trained (reported as ``ft/missed_samples`` and in the events file); the other
            groups' positions are unchanged and a healed group resumes at the committed step's batch.
            ``"redistribute"``: in a step that some groups miss, the participating groups also train the
            missing groups' batches of that step (split evenly), and each group's gradient is weighted by its
            share of the step's samples, so the step averages over the same global batch as a fault-free
            step. In this mode every step waits for its quorum before the forward pass (no overlap of the
            quorum with compute), and a step with missing groups runs larger per-rank batches.
        sync: how the groups combine their training. ``"every_step"``: gradients are averaged across groups
            every step (fully synchronous). ``"local_sgd"``: each group takes ``sync_every`` inner steps
            alone, then the groups average their parameters. ``"diloco"``: the same rounds, then an outer
            Nesterov SGD step on the averaged pseudo-gradient (``outer_lr``, ``outer_momentum``). Built on
            torchft's ``DiLoCo``; an outer step is committed or discarded (rolled back to the last one) on
            every group. See :mod:`fsdp_strategies.ft.outer_sync`.
        sync_every: inner steps per round (``local_sgd``/``diloco``); ``max_steps`` must be a multiple of it.
        outer_lr: learning rate of the outer optimizer (``diloco``).
        outer_momentum: Nesterov momentum of the outer optimizer (``diloco``; 0 = plain SGD).
        num_fragments: streaming DiLoCo: the parameters are split into this many fragments and one fragment
            syncs every ``sync_every / num_fragments`` steps (1 = all at once).
        straggler_sync: ``"off"``, or the semi-synchronous mode (``"local_sgd"``/``"diloco"``) to fall back to
            while stragglers cost more than ``StragglerDetector(action="semi_sync", switch_threshold=...)``
            allows; the run starts with ``sync="every_step"`` and comes back to it.
            ``sync_every``/``outer_lr``/``outer_momentum`` describe the fallback. Needs that callback,
            ``num_fragments=1``, ``data_on_failure="skip"`` and a ``max_steps`` multiple of ``sync_every``.
            See :mod:`fsdp_strategies.ft.straggler_switch`.
        accumulation: what the non-final micro-batches of ``accumulate_grad_batches`` do inside a group, as
            for ``fsdp2``: ``"sharded"`` reduce-scatters each one (a shard's gradient memory), ``"no_sync"``
            keeps the unsharded gradients until the last. Across groups, either way: one all-reduce per step,
            after the last micro-batch. ``"no_sync"`` with ``data_on_failure="redistribute"`` is refused.
        **kwargs: every ``fsdp2`` option (see :class:`~fsdp_strategies.strategies.fsdp2.FSDP2Strategy`).
    """

    strategy_name = "ft_hsdp"
    data_width_change = "strategy"  # another number of groups / group size: ft/resume_width.py
    def __init__(
        self,
        lighthouse_addr: str | None = None,
        replica_group_id: int | None = None,
        num_replica_groups: int | None = None,
        min_replica_size: int = 1,
        shard_degree: int | str = "auto",
        checkpoint_transport: Transport = "pg",
        timeout_s: float | None = None,
        quorum_timeout_s: float | None = None,
        connect_timeout_s: float | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        hostname: str | None = None,
        events_file: str | None = None,
        data_on_failure: DataOnFailure = "skip",
        sync: SyncMode = "every_step",
        sync_every: int = 1, outer_lr: float = 1.0,
        outer_momentum: float = 0.0, num_fragments: int = 1,
        straggler_sync: StragglerSync = "off",
        accumulation: Literal["sharded", "no_sync"] = "sharded",
        **kwargs: Any,
    ) -> None:
        check_degree("shard_degree", shard_degree)
        super().__init__(accumulation=accumulation, **kwargs)
        self.shard_degree = shard_degree  # checked against the group's ranks in validate_options
        where = resolve_placement(lighthouse_addr, replica_group_id, num_replica_groups, events_file)
        limits = check_ft_options(
            num_replica_groups=where.num_replica_groups, min_replica_size=min_replica_size, sync=sync,
            checkpoint_transport=checkpoint_transport, timeout_s=timeout_s, quorum_timeout_s=quorum_timeout_s,
            connect_timeout_s=connect_timeout_s, data_on_failure=data_on_failure, sync_every=sync_every,
            outer_lr=outer_lr, outer_momentum=outer_momentum, num_fragments=num_fragments,
            straggler_sync=straggler_sync)
        self.straggler_sync, self.data_on_failure = straggler_sync, data_on_failure
        self.sync, self.sync_every, self.num_fragments = sync, sync_every, num_fragments
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.lighthouse_addr, self.replica_group_id = where.lighthouse_addr, where.replica_group_id
        self.num_replica_groups = where.num_replica_groups
        self._preemption.checkpoint_name = f"last-preempt-group{self.replica_group_id}.ckpt"  # one per group
        self.min_replica_size, self.checkpoint_transport = min_replica_size, checkpoint_transport
        self.timeout_s, self.quorum_timeout_s, self.connect_timeout_s = (
            limits.timeout_s,
            limits.quorum_timeout_s,
            limits.connect_timeout_s,
        )
        self.init_sync, self.max_retries, self.hostname = init_sync, max_retries, hostname
        self.events_file = where.events_file
        self._events = EventLog(self.events_file) if self.events_file else None

        # the parts, each with one job (see their modules)
        self._accounting = StepAccounting(
            self.replica_group_id, self.num_replica_groups, data_on_failure, self._events
        )
        #: cumulative counters of this process (also logged as ``ft/*``), see
        #: :mod:`fsdp_strategies.ft.accounting`
        self.ft_stats = self._accounting.stats
        self._semi = SemiSync(sync=sync, straggler_sync=straggler_sync, sync_every=sync_every,
                              outer_lr=self.outer_lr,
                              outer_momentum=self.outer_momentum, num_fragments=num_fragments,
                              replica_group_id=self.replica_group_id,
                              num_replica_groups=self.num_replica_groups)
        state = self._training_state
        self._heal = HealState(state)
        #: the step protocol: the quorum / commit state of the step in flight (see ft/step.py)
        self._step = FTStep(self._semi, self._heal, SchedulerRollback(state), self._accounting,
                            group_id=self.replica_group_id, groups=self.num_replica_groups,
                            progress=self._set_global_step, module=lambda: self.lightning_module)
        self.peer_wait_s = self._step.inflight.peer_wait_s  # protocols.PeerWaitSource (HangWatchdog reads it)
        self._data: StepAlignedData | None = None
        self._saved_layout: dict[str, Any] | None = None  # the resumed checkpoint's data layout
        self._manager: Any = None
        self._cross_pg: Any = None
        self._lighthouse_checked = False

    # ------------------------------------------------------------------ what callers read
    @property
    def manager(self) -> Any:
        """The ``torchft.Manager`` of this replica group (``None`` before ``setup_environment``)."""
        return self._manager

    @property
    def cross_group_pg(self) -> Any:
        """torchft's cross-group process group, which the manager reconfigures at each quorum change and every
        cross-group all-reduce runs on (``None`` before ``setup_environment``)."""
        return self._cross_pg

    @property
    def last_step_committed(self) -> bool | None:
        """Whether the last step (or outer sync) committed; ``None`` before the first."""
        return self._accounting.last_step_committed

    @property
    def last_step_data(self) -> dict[str, Any]:
        """The data of the last step (keys:
        :attr:`fsdp_strategies.ft.accounting.StepAccounting.last_step_data`)."""
        return self._accounting.last_step_data

    # ------------------------------------------------------------------ validation (no process group yet)
    @override
    def _mesh_degrees(self) -> ParallelDims:
        """A 1-D mesh over the group's ranks: the replication is torchft's, across groups (jobs)."""
        return ParallelDims.fsdp(self.num_nodes * self.num_processes, self.num_processes,
                                 self.tensor_parallel_degree, replica_groups=self.num_replica_groups)

    @override
    def validate_options(self) -> None:
        super().validate_options()
        check_group_size(self.shard_degree, self.num_nodes, self.num_processes)
        if not self._lighthouse_checked:  # once per process (a TCP connection)
            check_lighthouse(self.lighthouse_addr, self.connect_timeout_s)
            self._lighthouse_checked = True

    # ------------------------------------------------------------------ set-up: the manager, the sampler, the
    # hook
    @override
    def setup_environment(self) -> None:
        # a warm spare (fsdp-strategies-ft --warm-spares) has imported and built everything up to here; it
        # joins nothing (no process group, no lighthouse) until the launcher activates it
        env = FTEnvironment.from_env()
        if env.standby_file:
            waited = wait_for_activation(env)
            rank_zero_info(f"ft_hsdp: warm spare of replica group {self.replica_group_id} activated after "
                           f"{waited:.1f} s on standby (incarnation {env.restart_count})")
        super().setup_environment()  # in-group process group + this group's 1-D mesh
        self._manager, self._cross_pg = create_manager(
            device=self.root_device, rank=self.global_rank, world_size=self.world_size,
            replica_group_id=self.replica_group_id, lighthouse_addr=self.lighthouse_addr,
            min_replica_size=self.min_replica_size, checkpoint_transport=self.checkpoint_transport,
            timeout_s=self.timeout_s, quorum_timeout_s=self.quorum_timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            init_sync=self.init_sync, max_retries=self.max_retries, hostname=self.hostname,
            # torchft's DiLoCo needs the synchronous quorum (straggler_sync builds it in every mode)
            use_async_quorum=self.sync == "every_step" and not self._semi.switchable,
            state_dict=self._heal.state_dict, load_state_dict=self._load_heal_state)
        self._step.bind(self._manager, CountedManager(self._manager, self.ft_stats, self._cross_pg),
                        device=self.root_device, world_size=self.data_parallel_size,
                        writes_events=self.global_rank == 0)
        rank_zero_info(
            f"ft_hsdp: replica group {self.replica_group_id}/{self.num_replica_groups} "
            f"({self.world_size} ranks), "
            f"lighthouse {self.lighthouse_addr}, min_replica_size={self.min_replica_size}, "
            f"transport={self.checkpoint_transport}"
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # torchft.data.DistributedSampler's layout: shard = group_rank + group_size * replica_group_id.
        return self._mesh_degrees().sampler_kwargs(self.global_rank, self.replica_group_id)

    @override
    def shard_module(self, module: nn.Module) -> nn.Module:
        module = super().shard_module(module)
        if self.sync != "every_step":  # inner steps: only the group's own FSDP collectives
            return module
        set_all_reduce_hook(module, self._step.cross.hook, self._step.cross.unit_hook)  # + the replicated 0-d
        return module

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """A non-final micro-batch: accumulated in the group (``accumulation``); groups reduce after."""
        with self._step.cross.micro_batch(), super().block_backward_sync():
            yield None

    def leave_step_if_nonfinite(self, loss_nonfinite: bool) -> None:
        """protocols.NonFiniteLossSink (NonFiniteGuard, before each backward): see ``ft/nonfinite.py``."""
        self._step.record_nonfinite(loss_nonfinite)

    # ------------------------------------------------------------------ heal state
    def _training_state(self) -> TrainingState:
        assert self.model is not None and self.lightning_module is not None
        return TrainingState(self.model, self.optimizers, self.lightning_module.trainer.lr_scheduler_configs)

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        """Apply a live peer's state (torchft calls it in ``should_commit``, or in the synchronous quorum)."""
        t0 = time.perf_counter()
        self._heal.load(state)
        self._step.inflight.healed = True
        self.ft_stats["heals"] += 1
        rank_zero_info(f"ft_hsdp: replica group {self.replica_group_id} healed from a live peer "
                       f"in {time.perf_counter() - t0:.3f}s (apply)")

    # ------------------------------------------------------------------ train start
    @override
    def setup(self, trainer: Any) -> None:
        check_training(self.accumulation, self.data_on_failure, trainer.accumulate_grad_batches,
                       trainer.lightning_module.automatic_optimization)
        super().setup(trainer)
        resume_from_handed(trainer, self.events_file, self.storage_options)  # no live peer ahead: not step 0

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._manager is None or self.lightning_module is None:
            return
        # a resumed Lightning checkpoint sets global_step; the quorum's step must agree
        trainer = self.lightning_module.trainer
        self._manager.load_state_dict(
            {"step": trainer.global_step, "batches_committed": self._manager.batches_committed()}
        )
        self._data = self._step.data = StepAlignedData.install(trainer, self._saved_layout)
        if self.data_on_failure == "redistribute":
            warn_unless_sharded(self._data)
        if self.sync == "every_step" and not self._semi.switchable:
            return
        assert self.model is not None
        self._semi.start(manager=self._step.link, model=self.model, optimizers=self.optimizers,
                         device=self.root_device, max_steps=trainer.max_steps,
                         global_step=trainer.global_step,
                         before_quorum=self._heal.capture, stats=self.ft_stats,
                         events=self._events if self.global_rank == 0 else None)
        if self.sync == "every_step":
            return
        self._step.first_sync()  # before the first inner step (a restarted group heals here from a peer)
        outer = self._semi.outer
        assert outer is not None
        rank_zero_info(f"ft_hsdp: sync={self.sync!r} every {self.sync_every} inner steps"
                       f"{f' ({self.num_fragments} fragments)' if self.num_fragments > 1 else ''}; "
                       "starting at "
                       f"step {outer.step} ({outer.last_participants} groups in the first sync)")

    def _committed_step(self) -> int:
        """The step every group agrees on (see :meth:`fsdp_strategies.ft.step.FTStep.committed_step`)."""
        return self._step.committed_step()

    # ------------------------------------------------------------------ straggler_sync: the SyncModeSwitch
    # protocol (fsdp_strategies.protocols.SyncModeSwitch): implemented by the rounds' object, SemiSync;
    # forwarded to it
    @property
    def sync_switch_available(self) -> bool:
        return self._semi.sync_switch_available

    @property
    def semi_sync_active(self) -> bool:
        return self._semi.semi_sync_active

    @property
    def sync_switch_events(self) -> list[dict[str, Any]]:
        return self._semi.sync_switch_events

    def configure_sync_switch(self, threshold: float, patience: int) -> None:
        self._semi.configure_sync_switch(threshold, patience)

    def sync_cost_counters(self) -> tuple[float, float]:
        return self._semi.sync_cost_counters()

    def report_sync_cost(self, cost: float) -> None:
        self._semi.report_sync_cost(cost)

    # ------------------------------------------------------------------ the step protocol
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Train the batch of the committed step (see :mod:`fsdp_strategies.ft.data`), then move it."""
        module = self.lightning_module
        if (
            self._data is not None
            and self._manager is not None
            and module is not None
            and module.trainer.training
        ):
            # synchronous quorum: heal (and learn the mode) before picking the batch
            if self._semi.switchable:
                self._step.begin()
            data, trainer = self._data, module.trainer

            def prepare(raw: Any) -> Any:  # what Lightning's loop did to the loader's batch before this hook
                raw = trainer.precision_plugin.convert_input(raw)
                return seam.before_batch_transfer(module, raw, dataloader_idx)

            step = self._step.inflight
            batch = data.take_for(step, batch, self._committed_step(), prepare)
            self._accounting.last_step_data = {"position": step.position, "rebuilt": step.rebuilt}
            if self.data_on_failure == "redistribute" and data.sharded:
                self._step.begin()  # the quorum decides which groups are missing
                self._step.wait_quorum()
                batch = add_missing_groups(
                    step, batch, data=data, manager=self._manager, prepare=prepare,
                    replica_group_id=self.replica_group_id, num_replica_groups=self.num_replica_groups,
                    rank=self.data_parallel_rank, world_size=self.data_parallel_size, device=self.root_device)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._manager is not None:
            self._step.begin()  # once per step: the step's other micro-batches share its quorum

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        if self._manager is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def step(closure: Callable[[], Any]) -> Any:  # the optimizer step proper (commit, or an inner step)
            return super(FTHSDPStrategy, self).optimizer_step(optimizer, closure, model, **kwargs)

        assert self.model is not None
        return self._step.finish(closure, step, self.model)

    def _set_global_step(self, target: int, pending: int) -> None:
        """Make Lightning's optimizer-step counter (``global_step``) equal the quorum's committed step.

        ``pending``: 1 inside ``optimizer_step`` (Lightning increments after it returns), 0 outside a step.
        """
        assert self.lightning_module is not None
        seam.set_optimizer_step_count(self.lightning_module.trainer, target, pending=pending)

    # ------------------------------------------------------------------ leaving and shutting down
    def leave_quorum(self, reason: str) -> None:
        """Make this replica group leave the job now (e.g. evicted as a straggler); the launcher restarts it
        and it heals. Every rank exits with :data:`LEAVE_EXIT_CODE` without waiting on peers; call it on every
        rank of the group at the same step (as ``StragglerDetector(action="evict")`` does)."""
        step = self._committed_step() if self._manager is not None else None
        leave_now(self._manager, self._events if self.global_rank == 0 else None, group=self.replica_group_id,
                  rank=self.global_rank, step=step, reason=reason)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        # tell the launcher at once (teardown takes seconds): a group restarted now must not start over alone
        if self._events is not None and self.global_rank == 0 and self._manager is not None:
            self._events.write_finished(self.replica_group_id, self._committed_step())

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # a restart would meet it again: the launcher must not retry
        exit_if_unfixable(exception, self._manager)

    @override
    def teardown(self) -> None:
        super().teardown()
        self._semi.outer = None  # bound to this fit's manager
        if self._events is not None:
            self._events.close()
        if self._manager is not None:
            release_manager(self._manager, self.global_rank)
            self._manager = self._cross_pg = None
            self._step.unbind()

    # ------------------------------------------------------------------ checkpoints: one group writes
    def _is_checkpoint_writer(self) -> bool:
        """The group ranked 0 in the quorum writes (all hold the same state); at a preemption, every group."""
        if self._preemption.is_saving():
            return True
        if self._manager is None or not _torch_seam.quorum_started(self._manager):
            return self.replica_group_id == 0
        return self._manager.participating_rank() == 0

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: seam.PATH, storage_options: Any | None = None
    ) -> None:
        if self._is_checkpoint_writer():
            if self._data is not None:  # how the steps map to samples: a resume at another width follows it
                checkpoint[resume_width.KEY] = self._data.layout().to_dict()
            super().save_checkpoint(checkpoint, filepath, storage_options)
            if self._events is not None and self.global_rank == 0:  # for a group restarted with no peer
                self._events.write_checkpoint(self.replica_group_id, int(checkpoint.get("global_step", 0)),
                                              str(filepath))

    @override
    def restored_data_position(self, checkpoint: dict[str, Any]) -> None:
        super().restored_data_position(checkpoint)
        self._saved_layout = checkpoint.get(resume_width.KEY)

    @override
    def remove_checkpoint(self, filepath: seam.PATH) -> None:
        if self._is_checkpoint_writer():
            super().remove_checkpoint(filepath)
