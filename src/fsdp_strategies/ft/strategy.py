"""``ft_hsdp``: fault-tolerant HSDP on torchft -- replica groups are the unit of failure.

Each replica group is an ordinary Lightning job (``devices`` = ranks in the group) that shards
the model with FSDP2 over its own 1-D mesh. Across groups, every FSDP unit's reduce-scatter
output is averaged by torchft's fault-tolerant all-reduce (``FSDPModule.set_all_reduce_hook``
through ``torchft.process_group.ManagedProcessGroup``), whose membership is re-decided every
step by a ``torchft.Manager`` talking to a lighthouse. When a group dies the others keep going
(after the lighthouse's heartbeat timeout); the restarted group heals from a live peer through
the manager's checkpoint transport instead of reloading a global checkpoint.

Lightning's step, bridged to torchft's protocol (nothing in the LightningModule changes):

* ``on_train_batch_start``: snapshot references to this rank's shards (the state a healing
  peer may fetch) and ``Manager.start_quorum()`` (asynchronous).
* the optimizer closure (forward + backward): the all-reduce hook waits for the quorum and
  reduces across groups; errors are recorded by the manager, not raised.
* ``optimizer_step``: ``Manager.should_commit()`` (applies a healed state first, then votes);
  the optimizer steps only on commit. A discarded step leaves parameters, optimizer state and
  LR schedulers untouched on every member and training goes on. Lightning's progress counters
  are set to the manager's committed step, so ``Trainer.global_step`` is the quorum's step on
  every group (it jumps forward on a group that just healed) and ``max_steps`` stops all groups
  at the same committed step.

Data: the sampler shards over ``num_replica_groups x ranks`` (the layout of
``torchft.data.DistributedSampler``), and the data position follows the committed step: at committed
step ``s`` every group trains batch ``s mod B`` of data epoch ``s // B`` of its own shard (``B`` =
training batches per epoch), also right after a heal (the healed group receives the step with the
heal state and derives its position from it) and after a discarded step (the same batch is trained
again). See :mod:`fsdp_strategies.ft.data`. ``data_on_failure="skip"``: while a group is down (or
healing, which contributes zeros), its shard's batches for those steps are not trained; each
participating group reports how many samples the step missed (``ft/missed_samples`` metric, the
events file, and a ``rank_zero_info`` line when a stretch of missed steps starts and ends).
``data_on_failure="redistribute"``: the groups in a step also train the missing groups' batches of that
step, weighted so the step's gradient is the mean over the full global batch (see ``_redistribute``).

``straggler_sync="local_sgd"|"diloco"`` (with ``sync="every_step"`` and ``StragglerDetector(action="semi_sync")``):
the manager uses the synchronous quorum (started in ``batch_to_device``, so a healing group has the peer's state
and step before it picks its batch) and the outer sync of :mod:`fsdp_strategies.ft.outer_sync` is built at train start
in every mode, dormant while the groups reduce every step (its heal-state keys exist on every group). Every
``sync_every`` committed steps the groups' costs are all-reduced inside the step (after backward, before
``should_commit``; in rounds: inside the outer sync) and the agreed decision applies only if that step commits:
every-step -> rounds at that step (DiLoCo's backup = the current, identical, parameters; the FSDP hook stays
registered and skips the cross-group all-reduce), rounds -> every-step after a committed outer sync (the inner
optimizer states are averaged in the same sync). Mode, streak and step offset are heal state; a group restarted
during rounds heals in the others' outer sync and joins it (``_join_outer_sync``). See :mod:`fsdp_strategies.ft.straggler_switch`.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args
from urllib.parse import urlparse

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from typing_extensions import override

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies import _torch_seam
from fsdp_strategies._options import check_choice, check_int, check_number
from fsdp_strategies.ft.data import StepAlignedData
from fsdp_strategies.ft.outer_sync import OuterSync, SyncMode, validate_sync_options
from fsdp_strategies.ft.protocol import (
    LEAVE_EXIT_CODE,
    LIGHTHOUSE_ENV,
    NUM_GROUPS_ENV,
    REPLICA_GROUP_ENV,
    EventLog,
    FTEnvironment,
    wait_for_activation,
)
from fsdp_strategies.ft.straggler_switch import STATE_KEY as SWITCH_STATE_KEY
from fsdp_strategies.ft.straggler_switch import (
    CostClock,
    StragglerSync,
    SwitchState,
    decide,
    validate_straggler_sync,
)
from fsdp_strategies.parallel.mesh import HSDPDegrees
from fsdp_strategies.strategies.hsdp import HSDPStrategy

if TYPE_CHECKING:
    from torch.optim import Optimizer

__all__ = ["LEAVE_EXIT_CODE", "FTHSDPStrategy", "LighthouseUnreachableError"]

Transport = Literal["pg", "http"]
DataOnFailure = Literal["skip", "redistribute"]
TRANSPORTS: tuple[str, ...] = get_args(Transport)
#: valid values of ``data_on_failure``
DATA_ON_FAILURE: tuple[str, ...] = get_args(DataOnFailure)

_HOW_TO_START = (
    "Start one with `torchft_lighthouse --min_replicas 1 --bind [::]:29510` (then export "
    "TORCHFT_LIGHTHOUSE=http://<host>:29510), or launch the job through `fsdp-strategies-ft`, which "
    "starts a lighthouse and the replica groups for you."
)


class LighthouseUnreachableError(ConnectionError):
    """The torchft lighthouse is not listening where the strategy was told to find it."""


def _lighthouse_host_port(address: str) -> tuple[str, int]:
    parsed = urlparse(address if "://" in address else f"http://{address}")
    if not parsed.hostname or not parsed.port:
        raise ValueError(
            f"lighthouse_addr={address!r} is not an address. Fix: give 'http://<host>:<port>' "
            f"(e.g. http://localhost:29510) or set {LIGHTHOUSE_ENV}. {_HOW_TO_START}"
        )
    return parsed.hostname, parsed.port


def _local(value: Any) -> Any:
    """This rank's shard of a DTensor; other values unchanged (the heal transfer sends plain tensors)."""
    return value.to_local() if isinstance(value, DTensor) else value


class FTHSDPStrategy(HSDPStrategy):
    """HSDP whose replication runs across jobs: FSDP2 inside a replica group, torchft's fault-tolerant
    all-reduce across replica groups (``replicate_degree`` is 1 inside each group's job).

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
        timeout_s: collectives, ``should_commit`` and checkpoint transfer.
        quorum_timeout_s: longest wait for a quorum.
        connect_timeout_s: connecting to the lighthouse and to peers' managers.
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
        sync: how the groups combine their training. ``"every_step"``: gradients are averaged across groups every
            step (fully synchronous). ``"local_sgd"``: each group takes ``sync_every`` inner steps alone, then the
            groups average their parameters. ``"diloco"``: the same rounds, then an outer Nesterov SGD step on the
            averaged pseudo-gradient (``outer_lr``, ``outer_momentum``). Built on torchft's ``DiLoCo``; an outer step
            is committed or discarded (rolled back to the last one) on every group. See :mod:`fsdp_strategies.ft.outer_sync`.
        sync_every: inner steps per round (``local_sgd``/``diloco``); ``max_steps`` must be a multiple of it.
        outer_lr: learning rate of the outer optimizer (``diloco``).
        outer_momentum: Nesterov momentum of the outer optimizer (``diloco``; 0 = plain SGD).
        num_fragments: streaming DiLoCo: the parameters are split into this many fragments and one fragment syncs
            every ``sync_every / num_fragments`` steps (1 = all at once).
        straggler_sync: ``"off"``, or the semi-synchronous mode (``"local_sgd"``/``"diloco"``) to fall back to while
            stragglers cost more than ``StragglerDetector(action="semi_sync", switch_threshold=...)`` allows; the run
            starts with ``sync="every_step"`` and comes back to it. ``sync_every``/``outer_lr``/``outer_momentum``
            describe the fallback. Needs that callback, ``num_fragments=1``, ``data_on_failure="skip"`` and a
            ``max_steps`` multiple of ``sync_every``. See :mod:`fsdp_strategies.ft.straggler_switch`.
        **kwargs: every ``fsdp2`` option (see :class:`~fsdp_strategies.strategies.fsdp2.FSDP2Strategy`).
    """

    strategy_name = "ft_hsdp"

    def __init__(
        self,
        lighthouse_addr: str | None = None,
        replica_group_id: int | None = None,
        num_replica_groups: int | None = None,
        min_replica_size: int = 1,
        shard_degree: int | str = "auto",
        checkpoint_transport: Transport = "pg",
        timeout_s: float = 60.0,
        quorum_timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        init_sync: bool = True,
        max_retries: int | None = None,
        hostname: str | None = None,
        events_file: str | None = None,
        data_on_failure: DataOnFailure = "skip",
        sync: SyncMode = "every_step",
        sync_every: int = 1,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        num_fragments: int = 1,
        straggler_sync: StragglerSync = "off",
        **kwargs: Any,
    ) -> None:
        super().__init__(replicate_degree=1, shard_degree=shard_degree, **kwargs)
        env = FTEnvironment.from_env()
        lighthouse_addr = lighthouse_addr or env.lighthouse_addr
        if lighthouse_addr is None:
            raise ValueError(
                f"ft_hsdp needs a torchft lighthouse: lighthouse_addr is not set and {LIGHTHOUSE_ENV} is empty. "
                f"Fix: set strategy.init_args.lighthouse_addr or {LIGHTHOUSE_ENV}=http://<host>:<port>. {_HOW_TO_START}"
            )
        _lighthouse_host_port(lighthouse_addr)
        if replica_group_id is None:
            replica_group_id = env.replica_group_id
        if num_replica_groups is None:
            num_replica_groups = env.num_replica_groups
        if replica_group_id is None:
            raise ValueError(
                f"ft_hsdp: replica_group_id is missing. Fix: set strategy.init_args.replica_group_id or "
                f"{REPLICA_GROUP_ENV}=<0..num_replica_groups-1> for each replica group (fsdp-strategies-ft sets it)."
            )
        fix_groups = (f"set strategy.init_args.num_replica_groups or {NUM_GROUPS_ENV} to the number of replica "
                      "groups (>= 1).")
        if num_replica_groups is None:
            raise ValueError(f"ft_hsdp: num_replica_groups=None is invalid. Fix: {fix_groups}")
        check_int("num_replica_groups", num_replica_groups, 1, fix=fix_groups, prefix="ft_hsdp: ")
        if isinstance(replica_group_id, bool) or not 0 <= replica_group_id < num_replica_groups:
            raise ValueError(
                f"ft_hsdp: replica_group_id={replica_group_id!r} is out of range for num_replica_groups="
                f"{num_replica_groups}. Fix: use an id in [0, {num_replica_groups - 1}]."
            )
        check_int("min_replica_size", min_replica_size, 1, num_replica_groups, prefix="ft_hsdp: ",
                  fix=f"1 <= min_replica_size <= num_replica_groups ({num_replica_groups}).")
        check_choice("checkpoint_transport", checkpoint_transport, Transport)
        for name, value in (("timeout_s", timeout_s), ("quorum_timeout_s", quorum_timeout_s),
                            ("connect_timeout_s", connect_timeout_s)):
            check_number(name, value, fix="a positive number of seconds.")
        check_choice("data_on_failure", data_on_failure, DataOnFailure, prefix="ft_hsdp: ")
        validate_straggler_sync(straggler_sync, sync, sync_every, outer_lr, outer_momentum, num_fragments,
                                data_on_failure)
        if straggler_sync == "off":
            validate_sync_options(sync, sync_every, outer_lr, outer_momentum, num_fragments, data_on_failure)
        self.straggler_sync = straggler_sync
        #: the agreed switch state (``straggler_sync`` on), the vote settings from the detector, the last cost
        #: this group's detector reported, the vote of the step in flight (applied only if it commits)
        self._switch: SwitchState | None = SwitchState() if straggler_sync != "off" else None
        self._switch_cfg: tuple[float, int] | None = None
        self._reported_cost = 0.0
        self._pending_vote: dict[str, Any] | None = None
        self._pending_opt_avg: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._cost = CostClock()
        self._step_cross_s = 0.0
        #: every switch of this process: ``{"step", "event": "switch", "to", "cost", "costs"}``
        self.sync_switch_events: list[dict[str, Any]] = []
        #: tests/benchmarks: called with the byte count before each cross-group all-reduce of this group (a slow
        #: link), see :class:`fsdp_strategies.testing.SlowLinkInjector`; ``None`` in production
        self.cross_group_delay: Callable[[int], None] | None = None
        self.sync, self.sync_every, self.num_fragments = sync, sync_every, num_fragments
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self._outer: OuterSync | None = None
        self._round_schedulers: list[Any] | None = None
        self._round_samples = 0
        self.data_on_failure = data_on_failure
        self.lighthouse_addr = lighthouse_addr
        self.replica_group_id = int(replica_group_id)
        self.num_replica_groups = int(num_replica_groups)
        self.min_replica_size = min_replica_size
        self.checkpoint_transport = checkpoint_transport
        self.timeout_s = timeout_s
        self.quorum_timeout_s = quorum_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.init_sync = init_sync
        self.max_retries = max_retries
        self.hostname = hostname
        events_file = events_file or env.events_file
        self.events_file = events_file.replace("{replica_group_id}", str(self.replica_group_id)) if events_file else None
        self._events = EventLog(self.events_file) if self.events_file else None

        self._manager: Any = None
        self._managed_pg: Any = None
        self._heal_state: dict[str, Any] | None = None
        self._lighthouse_checked = False
        self._quorum_started = False
        self._pending_scheduler_restore: list[Any] | None = None
        self._step_t0 = 0.0
        self._quorum_wait_s = 0.0
        self._waited_quorum = False
        self._healed = False
        self._after_discard = False
        #: cumulative counters of this process (also logged as ``ft/*``)
        self.ft_stats: dict[str, float] = {"committed": 0, "discarded": 0, "heals": 0, "recovery_s": 0.0,
                                           "quorum_s": 0.0, "missed_samples": 0, "cross_group_allreduces": 0,
                                           "cross_group_bytes": 0}
        self.last_step_committed: bool | None = None
        self._data: StepAlignedData | None = None
        self._data_step: int | None = None
        self._extra_samples = 0
        self._grad_scale = 1.0
        self._participating = True
        self._missed_since: int | None = None
        self._missed_run = 0
        #: the data of the last step: ``step`` (the quorum's), ``position`` (of the batch used; = ``step`` when
        #: ``participating``; a healing group used a stale one and contributed zeros), ``participating``, ``samples``
        #: (this group's, all ranks), ``missed_samples`` (of the groups not in the step), ``redistributed_samples``
        #: (of those, trained here), ``rebuilt`` (batch built from the dataset: the loader was not at the step)
        self.last_step_data: dict[str, Any] = {}

    # ------------------------------------------------------------------ validation (no process group yet)
    @override
    def _mesh_degrees(self) -> HSDPDegrees | None:
        """A 1-D mesh over the group's ranks: the replication is torchft's, across groups (jobs)."""
        return None

    @override
    def validate_options(self) -> None:
        super().validate_options()
        group_size = self.num_nodes * self.num_processes
        if self.shard_degree != "auto" and self.shard_degree != group_size:
            raise ValueError(
                f"ft_hsdp: shard_degree={self.shard_degree} does not match the replica group's size {group_size} "
                f"(num_nodes={self.num_nodes} x devices={self.num_processes}). Each replica group shards over all of "
                f"its ranks. Fix: set shard_degree to {group_size} or 'auto', or run each group with "
                f"{self.shard_degree} devices."
            )
        if not self._lighthouse_checked:  # once per process (a TCP connection)
            self._check_lighthouse()
            self._lighthouse_checked = True

    def _check_lighthouse(self) -> None:
        host, port = _lighthouse_host_port(self.lighthouse_addr)
        try:
            with socket.create_connection((host, port), timeout=self.connect_timeout_s):
                pass
        except OSError as err:
            raise LighthouseUnreachableError(
                f"ft_hsdp: no torchft lighthouse answers at {self.lighthouse_addr} (from lighthouse_addr / "
                f"{LIGHTHOUSE_ENV}; {type(err).__name__}: {err}). {_HOW_TO_START}"
            ) from None

    # ------------------------------------------------------------------ process groups and the manager
    @property
    def manager(self) -> Any:
        """The ``torchft.Manager`` of this replica group (``None`` before ``setup_environment``)."""
        return self._manager

    @override
    def setup_environment(self) -> None:
        # a warm spare (fsdp-strategies-ft --warm-spares) has imported and built everything up to here; it joins
        # nothing (no process group, no lighthouse) until the launcher activates it
        env = FTEnvironment.from_env()
        if env.standby_file:
            waited = wait_for_activation(env)
            rank_zero_info(f"ft_hsdp: warm spare of replica group {self.replica_group_id} activated after "
                           f"{waited:.1f} s on standby (incarnation {env.restart_count})")
        super().setup_environment()  # in-group process group + this group's 1-D mesh
        self._manager = self._create_manager()
        from torchft.process_group import ManagedProcessGroup

        self._managed_pg = ManagedProcessGroup(self._manager)
        rank_zero_info(
            f"ft_hsdp: replica group {self.replica_group_id}/{self.num_replica_groups} ({self.world_size} ranks), "
            f"lighthouse {self.lighthouse_addr}, min_replica_size={self.min_replica_size}, "
            f"transport={self.checkpoint_transport}"
        )

    def _create_manager(self) -> Any:
        from torchft.checkpointing import HTTPTransport
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        timeout = timedelta(seconds=self.timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if self.root_device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        if self.checkpoint_transport == "pg":
            transport: Any = PGTransport(pg, timeout=timeout, device=self.root_device)
        else:
            transport = HTTPTransport(timeout=timeout, num_chunks=0)
        kwargs: dict[str, Any] = {}
        if self.hostname:
            kwargs["hostname"] = self.hostname
        return Manager(
            pg=pg,
            load_state_dict=self._load_heal_state,
            state_dict=self._heal_state_dict,
            min_replica_size=self.min_replica_size,
            # torchft's DiLoCo needs the synchronous quorum (straggler_sync builds it in every mode)
            use_async_quorum=self.sync == "every_step" and self._switch is None,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=self.quorum_timeout_s),
            connect_timeout=timedelta(seconds=self.connect_timeout_s),
            rank=self.global_rank,
            world_size=self.world_size,
            store_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=self.lighthouse_addr,
            replica_id=f"ft_hsdp_{self.replica_group_id}",
            checkpoint_transport=transport,
            init_sync=self.init_sync,
            max_retries=self.max_retries,
            **kwargs,
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # torchft.data.DistributedSampler's layout: shard = group_rank + group_size * replica_group_id.
        return {"num_replicas": self.world_size * self.num_replica_groups,
                "rank": self.global_rank + self.world_size * self.replica_group_id}

    # ------------------------------------------------------------------ wrapping: cross-group all-reduce hook
    @override
    def shard_module(self, module: nn.Module) -> nn.Module:
        module = super().shard_module(module)
        if self.sync != "every_step":  # inner steps: only the group's own FSDP collectives
            return module
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.set_all_reduce_hook(self._all_reduce_hook)
        return module

    def _all_reduce_hook(self, reduce_output: torch.Tensor) -> None:
        self._cross_group_all_reduce(reduce_output)

    def _cross_group_all_reduce(self, reduce_output: torch.Tensor) -> None:
        """Average one FSDP unit's reduce-scatter output over the replica groups of this quorum."""
        if self._semi_active():  # straggler_sync in a semi-synchronous phase: the hook stays, the traffic stops
            return
        t_cross = time.perf_counter()
        if not self._waited_quorum:
            t0 = time.perf_counter()
            self._manager.wait_quorum()
            self._quorum_wait_s += time.perf_counter() - t0
            self._waited_quorum = True
        if self._grad_scale != 1.0:  # redistribute: this group's share of the step's samples
            reduce_output.mul_(self._grad_scale)
        self.ft_stats["cross_group_allreduces"] += 1
        self.ft_stats["cross_group_bytes"] += reduce_output.numel() * reduce_output.element_size()
        if self.cross_group_delay is not None:
            self.cross_group_delay(reduce_output.numel() * reduce_output.element_size())
        # errors (a peer died mid all-reduce) are recorded by the manager and make should_commit() False
        self._managed_pg.allreduce([reduce_output], ReduceOp.AVG).wait()
        self._step_cross_s += time.perf_counter() - t_cross

    # ------------------------------------------------------------------ heal state (what a recovering group fetches)
    def _capture_heal_state(self) -> dict[str, Any]:
        """References (no copies) to this rank's shards; taken on the main thread while every unit is resharded."""
        assert self.model is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        return {
            "model": {k: _local(v) for k, v in self.model.state_dict().items()},
            "optimizers": [
                {"state": {i: {k: _local(v) for k, v in s.items()} for i, s in sd["state"].items()},
                 "param_groups": sd["param_groups"]}
                for sd in (opt.state_dict() for opt in self.optimizers)
            ],
            "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
        }

    def _heal_state_dict(self) -> dict[str, Any]:
        # called by torchft on its quorum thread when a peer must heal from us
        assert self._heal_state is not None, "ft_hsdp: heal state requested before the first step"
        return self._heal_state

    @torch.no_grad()
    def _load_heal_state(self, state: dict[str, Any]) -> None:
        """Apply a live peer's state (called by ``should_commit`` on the main thread)."""
        assert self.model is not None and self.lightning_module is not None
        t0 = time.perf_counter()
        own = self.model.state_dict()
        missing = set(own) ^ set(state["model"])
        if missing:
            raise RuntimeError(f"ft_hsdp: healed state does not match this model (keys differ: {sorted(missing)[:5]})")
        for key, value in own.items():
            _local(value).copy_(state["model"][key])
        for opt, received in zip(self.optimizers, state["optimizers"]):
            self._load_optimizer_shards(opt, received)
        trainer = self.lightning_module.trainer
        for cfg, sched_state in zip(trainer.lr_scheduler_configs, state["lr_schedulers"]):
            cfg.scheduler.load_state_dict(sched_state)
        self._healed = True
        self.ft_stats["heals"] += 1
        rank_zero_info(f"ft_hsdp: replica group {self.replica_group_id} healed from a live peer "
                       f"in {time.perf_counter() - t0:.3f}s (apply)")

    @staticmethod
    def _load_optimizer_shards(opt: Optimizer, received: dict[str, Any]) -> None:
        params = [p for group in opt.param_groups for p in group["params"]]
        state: dict[int, dict[str, Any]] = {}
        for idx, pstate in received["state"].items():
            param = params[int(idx)]
            entry = {}
            for key, value in pstate.items():
                if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0 \
                        and value.shape == param.to_local().shape:
                    value = DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                                               run_check=False, shape=param.shape, stride=param.stride())
                entry[key] = value
            state[int(idx)] = entry
        opt.load_state_dict({"state": state, "param_groups": received["param_groups"]})

    # ------------------------------------------------------------------ the step protocol
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization:
            raise TypeError("ft_hsdp supports automatic optimization only (the optimizer step must follow "
                            "should_commit). Fix: remove `self.automatic_optimization = False`.")
        if self._manager is not None:
            # a resumed Lightning checkpoint sets global_step; the quorum's step must agree
            step = self.lightning_module.trainer.global_step
            self._manager.load_state_dict({"step": step, "batches_committed": self._manager.batches_committed()})
            self._data = StepAlignedData.install(self.lightning_module.trainer)
            if self._data is not None and self.data_on_failure == "redistribute" and not self._data.sharded:
                rank_zero_warn("ft_hsdp: data_on_failure='redistribute' needs the groups' data sharded by a "
                               "DistributedSampler; this loader is not, so a missing group's batches are skipped. "
                               "Fix: keep Trainer(use_distributed_sampler=True).")
            if self.sync != "every_step":
                self._start_outer_sync()
            elif self._switch is not None:
                self._start_switchable()

    def _start_outer_sync(self) -> None:
        """``local_sgd``/``diloco``: wrap the optimizer in torchft's DiLoCo and sync once before the first inner step
        (a restarted group heals here from a live peer and continues at the quorum's position)."""
        assert self.lightning_module is not None and self.model is not None
        trainer = self.lightning_module.trainer
        if trainer.max_steps > 0 and trainer.max_steps % self.sync_every:
            raise ValueError(f"ft_hsdp: max_steps={trainer.max_steps} is not a multiple of sync_every={self.sync_every}: "
                             "the last round would end without an outer sync and the groups would differ. Fix: set "
                             f"trainer.max_steps to a multiple of {self.sync_every}.")
        if trainer.max_steps <= 0:
            rank_zero_warn(f"ft_hsdp: sync={self.sync!r} without max_steps: the inner steps after the last outer sync "
                           "are not averaged across groups. Fix: stop with a max_steps multiple of sync_every.")
        if len(self.optimizers) != 1:
            raise ValueError(f"ft_hsdp: sync={self.sync!r} supports one optimizer, got {len(self.optimizers)}. Fix: "
                             "return a single optimizer from configure_optimizers.")
        for sub in self.model.modules():  # a sanity-check validation leaves the root unsharded: DiLoCo needs shards
            if isinstance(sub, FSDPModule):
                sub.reshard()
        if self._outer is None:
            self._outer = OuterSync(self._manager, self.model, self.optimizers[0], mode=self.sync,
                                    sync_every=self.sync_every, outer_lr=self.outer_lr,
                                    outer_momentum=self.outer_momentum, num_fragments=self.num_fragments,
                                    before_quorum=self._refresh_heal_state, stats=self.ft_stats)
            self._outer.committed = trainer.global_step  # a resumed checkpoint's step
        self._round_samples = 0
        self._step_t0 = time.perf_counter()
        self._healed = False
        t0 = time.perf_counter()
        committed = self._outer.initial_sync()
        # an event line (the launcher sees the group live from here); no ft/* metrics inside on_train_start
        self._after_step(committed, time.perf_counter() - t0, log=False)
        if self._outer.healed:
            # the peer's schedulers were captured inside its optimizer step, before Lightning stepped them
            for cfg in trainer.lr_scheduler_configs:
                if cfg.interval == "step":
                    cfg.scheduler.step()
        self._sync_lightning_progress(self._outer.step, pending=0)
        rank_zero_info(f"ft_hsdp: sync={self.sync!r} every {self.sync_every} inner steps"
                       f"{f' ({self.num_fragments} fragments)' if self.num_fragments > 1 else ''}; starting at "
                       f"step {self._outer.step} ({self._outer.last_participants} groups in the first sync)")

    def _refresh_heal_state(self) -> None:
        self._heal_state = self._capture_heal_state()

    def _semi_active(self) -> bool:
        """Whether this step is an inner step of a semi-synchronous round (``sync`` or a ``straggler_sync`` phase)."""
        return self._outer is not None and (self._switch is None or self._switch.semi)

    def _committed_step(self) -> int:
        """The step every group agrees on: the quorum's (``every_step``; plus the inner steps of earlier
        ``straggler_sync`` phases) or the inner-step position (semi-sync)."""
        if self._semi_active():
            assert self._outer is not None
            return self._outer.step
        return int(self._manager.current_step()) + (self._switch.offset if self._switch is not None else 0)

    # ------------------------------------------------------------------ straggler_sync: the SyncModeSwitch protocol
    @property
    def sync_switch_available(self) -> bool:
        """Whether ``straggler_sync`` is on (``StragglerDetector(action="semi_sync")`` drives the switch)."""
        return self._switch is not None

    @property
    def semi_sync_active(self) -> bool:
        """Whether a semi-synchronous phase is active now (the same on every rank of every group)."""
        return self._switch is not None and self._switch.semi

    def configure_sync_switch(self, threshold: float, patience: int) -> None:
        """Vote thresholds (from the detector, the same on every group: the same config). Call before training."""
        self._switch_cfg = (float(threshold), int(patience))

    def sync_cost_counters(self) -> tuple[float, float]:
        """Cumulative ``(cross_s, extra_s)`` of this rank; see :class:`fsdp_strategies.ft.straggler_switch.CostClock`."""
        return self._cost.counters()

    def report_sync_cost(self, cost: float) -> None:
        """This group's latest window cost (identical on every rank of the group: the detector computes it from
        the window all ranks gathered). The next vote boundary uses it."""
        self._reported_cost = float(cost)

    def _start_switchable(self) -> None:
        """``straggler_sync``: build the outer sync now, dormant, so that every group registers the same heal-state
        keys whatever its mode (torchft loads the receiver's keys from the sender's state)."""
        assert self.lightning_module is not None and self.model is not None and self._switch is not None
        trainer = self.lightning_module.trainer
        if self._switch_cfg is None:
            raise ValueError(f"ft_hsdp: straggler_sync={self.straggler_sync!r} needs a StragglerDetector with "
                             "action='semi_sync' (it measures the cost and sets the threshold). Fix: add "
                             "{class_path: fsdp_strategies.callbacks.StragglerDetector, init_args: {action: semi_sync}} "
                             "to trainer.callbacks, or straggler_sync='off'.")
        if trainer.max_steps <= 0 or trainer.max_steps % self.sync_every:
            raise ValueError(f"ft_hsdp: max_steps={trainer.max_steps} with straggler_sync={self.straggler_sync!r}: a "
                             f"semi-synchronous phase must end with an outer sync. Fix: set trainer.max_steps to a "
                             f"multiple of sync_every={self.sync_every}.")
        if len(self.optimizers) != 1:
            raise ValueError(f"ft_hsdp: straggler_sync={self.straggler_sync!r} supports one optimizer, got "
                             f"{len(self.optimizers)}. Fix: return a single optimizer from configure_optimizers.")
        for sub in self.model.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()
        if self._outer is None:
            self._outer = OuterSync(self._manager, self.model, self.optimizers[0], mode=self.straggler_sync,
                                    sync_every=self.sync_every, outer_lr=self.outer_lr,
                                    outer_momentum=self.outer_momentum, num_fragments=1,
                                    before_quorum=self._refresh_heal_state, stats=self.ft_stats,
                                    after_quorum=self._vote, before_allreduce=self._delay_link)
            self._manager.register_state_dict_fn(SWITCH_STATE_KEY, self._switch.load, self._switch.save)
        self._switch.offset = trainer.global_step - int(self._manager.current_step())
        self.ft_stats.setdefault("switch_votes", 0)
        self.ft_stats.setdefault("switches", 0)
        threshold, patience = self._switch_cfg
        rank_zero_info(f"ft_hsdp: straggler_sync={self.straggler_sync!r}: every-step reduction, switching to rounds of "
                       f"{self.sync_every} steps while the cross-group cost > {threshold:.0%} of the step time for "
                       f"{patience} boundaries (every {self.sync_every} committed steps), back below {threshold / 2:.0%}")

    def _delay_link(self, nbytes: int) -> None:
        if self.cross_group_delay is not None:
            self.cross_group_delay(nbytes)

    def _vote_due(self) -> bool:
        """Every-step phase: the step that ends at a multiple of ``sync_every`` (decided after the quorum, so a
        group that just healed has the quorum's step)."""
        return self._switch is not None and self._outer is not None and \
            (self._committed_step() + 1) % self.sync_every == 0

    def _vote(self) -> None:
        """One boundary's vote, inside a step (every-step: after backward, before ``should_commit``; semi: the outer
        sync, after its quorum): the groups' costs are all-reduced through the manager (a vector indexed by replica
        group; a healing group's zeros), every member derives the same decision from the same vector and the heal
        state's streak. Applied by :meth:`_apply_vote` only when the step/sync commits."""
        assert self._switch is not None and self._switch_cfg is not None and self._outer is not None
        t0 = time.perf_counter()
        costs = torch.zeros(self.num_replica_groups, dtype=torch.float32, device=self.root_device)
        costs[self.replica_group_id] = self._reported_cost
        self._outer.counted_manager.allreduce(costs, reduce_op=ReduceOp.SUM).wait()
        self.ft_stats["switch_votes"] += 1
        values = [float(c) for c in costs.cpu()]
        cost = max(values)
        threshold, patience = self._switch_cfg
        semi, streak = decide(self._switch.semi, self._switch.streak, cost, threshold, patience)
        self._pending_vote = {"semi": semi, "streak": streak, "cost": cost, "costs": values}
        if self._switch.semi and not semi:
            # back to every-step: the groups' inner-optimizer states diverged in the rounds; average them in this
            # sync too (applied with it), so that identical parameters stay identical under the same gradients
            self._pending_opt_avg = self._average_optimizer_state()
        self._step_cross_s += time.perf_counter() - t0

    def _average_optimizer_state(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """All-reduce (average) copies of this rank's inner-optimizer state shards across the groups."""
        assert self._outer is not None
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        works = []
        opt = self.optimizers[0]
        for group in opt.param_groups:
            for param in group["params"]:
                for key in sorted(opt.state.get(param, {})):
                    value = _local(opt.state[param][key])
                    if not isinstance(value, torch.Tensor) or value.dim() == 0 or not value.is_floating_point():
                        continue  # step counters are equal on every group
                    copy = value.detach().clone()
                    works.append(self._outer.counted_manager.allreduce(copy, reduce_op=ReduceOp.AVG))
                    pairs.append((value, copy))
        for work in works:
            work.wait()
        return pairs

    def _apply_vote(self, committed: bool) -> None:
        """Apply the vote of the step/sync that just ended, if it committed (identical on every member)."""
        vote, self._pending_vote = self._pending_vote, None
        averaged, self._pending_opt_avg = self._pending_opt_avg, None
        if vote is None or not committed:
            return
        assert self._switch is not None and self._outer is not None
        self._switch.streak = vote["streak"]
        if vote["semi"] == self._switch.semi:
            return
        step = self._committed_step()
        if vote["semi"]:  # every-step -> rounds: the parameters are identical on every group after this step
            self._outer.rebase(step)
        else:  # rounds -> every-step, after a committed outer sync: replicas identical
            with torch.no_grad():
                for value, avg in averaged or []:
                    value.copy_(avg)
            self._switch.offset = step - int(self._manager.current_step())
        self._switch.semi = vote["semi"]
        self._switch.switches += 1
        self.ft_stats["switches"] += 1
        to = self.straggler_sync if vote["semi"] else "every_step"
        event = {"step": step, "event": "switch", "to": to, "cost": vote["cost"], "costs": vote["costs"]}
        self.sync_switch_events.append(event)
        assert self._switch_cfg is not None
        rank_zero_info(f"ft_hsdp: switch to {to} at committed step {step}: cross-group cost {vote['cost']:.0%} of the "
                       f"step time (max over groups; threshold {self._switch_cfg[0]:.0%})")
        if self._events is not None and self.global_rank == 0:
            self._events.write_switch(self.replica_group_id, step, to, vote["cost"], vote["costs"])

    def _join_outer_sync(self) -> None:
        """A group that healed, in its every-step quorum, from groups in a semi-synchronous phase: that quorum was
        their outer sync's. Finish the sync with them as a healing participant, then continue in rounds."""
        assert self._outer is not None and self.lightning_module is not None
        self._quorum_started = False
        self._waited_quorum = False
        t0 = time.perf_counter()
        committed = self._outer.sync(quorum=False)
        self._after_step(committed, time.perf_counter() - t0, log=False)
        self._apply_vote(committed)
        # the peer's schedulers were captured inside its optimizer step, before Lightning stepped them
        for cfg in self.lightning_module.trainer.lr_scheduler_configs:
            if cfg.interval == "step":
                cfg.scheduler.step()
        self._sync_lightning_progress(self._committed_step(), pending=0)
        rank_zero_info(f"ft_hsdp: replica group {self.replica_group_id} healed into a {self.straggler_sync} phase and "
                       f"joined its outer sync ({'committed' if committed else 'discarded'}); continuing at step "
                       f"{self._committed_step()}")

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Train the batch of the committed step (see :mod:`fsdp_strategies.ft.data`), then move it."""
        module = self.lightning_module
        if self._data is not None and self._manager is not None and module is not None and module.trainer.training:
            if self._switch is not None:  # synchronous quorum: heal (and learn the mode) before picking the batch
                self._begin_step()
            step = self._committed_step()
            trainer = module.trainer

            def prepare(raw: Any) -> Any:  # what Lightning's loop did to the loader's batch before this hook
                raw = trainer.precision_plugin.convert_input(raw)
                return seam.before_batch_transfer(module, raw, dataloader_idx)

            batch, rebuilt = self._data.take(batch, step, prepare)
            self._data_step = step
            self._extra_samples = 0
            self._grad_scale = 1.0
            self.last_step_data = {"position": step, "rebuilt": rebuilt}
            if self.data_on_failure == "redistribute" and self._data.sharded:
                batch = self._redistribute(batch, step, prepare)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._manager is None:
            return
        self._begin_step()

    def _begin_step(self) -> None:
        """Snapshot the heal state and start the quorum, once per step (at batch start, or earlier for
        ``redistribute``, which needs the quorum to build the batch)."""
        if self._pending_scheduler_restore is not None:
            self._restore_schedulers(self._pending_scheduler_restore)
            self._pending_scheduler_restore = None
        if not self._semi_active() and not self._quorum_started:
            self._step_t0 = time.perf_counter()
            self._heal_state = self._capture_heal_state()
            self._quorum_wait_s = 0.0
            self._waited_quorum = False
            self._healed = False
            self._step_cross_s = 0.0
            self._manager.start_quorum()  # straggler_sync: synchronous (a healing group has the peer's state now)
            self._quorum_started = True
            if self._switch is not None:
                self._step_cross_s += time.perf_counter() - self._step_t0
                if self._semi_active():  # healed from groups in a semi-synchronous phase: at their outer sync
                    self._join_outer_sync()
                    if not self._semi_active():  # that sync switched back to every-step: this step is one
                        self._begin_step()
                        return
        if self._semi_active():  # semi-sync: no quorum in inner steps
            assert self._outer is not None
            if self._outer.pending == 0:
                self._round_schedulers = self._snapshot_schedulers()
            self._step_t0 = time.perf_counter()
            self._quorum_wait_s = 0.0
            self._healed = False
            self._step_cross_s = 0.0

    def _redistribute(self, batch: Any, step: int, prepare: Callable[[Any], Any]) -> Any:
        """Add this rank's share of the missing groups' batches of ``step``; set the gradient weight.

        The quorum is needed first. When some groups are missing, the members learn which ones with one
        all-reduce of a participation mask (healing groups contribute zeros). Rank ``r`` of the ``j``-th
        participating group takes the ``j``-th of ``p`` near-equal chunks of the missing groups' rank-``r``
        batches. torchft averages over the ``p`` participants, so a group that trained ``n`` of the step's
        ``N`` samples (per rank slot) scales its gradient by ``n * p / N``: the average is then the mean over
        all ``N`` samples, as in a fault-free step (the loss must be a per-sample mean, as for DDP).
        """
        assert self._data is not None
        self._begin_step()
        t0 = time.perf_counter()
        self._manager.wait_quorum()
        self._quorum_wait_s += time.perf_counter() - t0
        self._waited_quorum = True
        groups = self.num_replica_groups
        participants = int(self._manager.num_participants())
        if participants >= groups or participants < 1:
            return batch
        mask = torch.zeros(groups, device=self.root_device)
        mask[self.replica_group_id] = 1.0
        self._manager.allreduce(mask, reduce_op=ReduceOp.SUM).wait()  # zeros from healing groups
        live = [g for g in range(groups) if mask[g].item() > 0.5]
        if self.replica_group_id not in live or not self._manager.is_participating():
            return batch  # healing: contributes zeros, nothing to add
        missing = [g for g in range(groups) if g not in live]
        pool = [i for g in missing for i in self._data.indices_of(step, self.global_rank + self.world_size * g)]
        j, p = live.index(self.replica_group_id), len(live)
        lo, hi = (len(pool) * j) // p, (len(pool) * (j + 1)) // p
        own = self._data.indices_of(step)
        extra = pool[lo:hi]
        self._extra_samples = len(extra)
        self._grad_scale = (len(own) + len(extra)) * p / (len(own) * groups)
        return prepare(self._data.collate(own + extra))

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._manager is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._semi_active():
            return self._inner_step(optimizer, closure, model, **kwargs)
        if not self._quorum_started:  # e.g. a loop that skipped on_train_batch_start
            self.on_train_batch_start(None, -1)
        loss = closure()  # forward + backward; the all-reduce hook reduces across groups
        t0 = time.perf_counter()
        if not self._waited_quorum:
            self._manager.wait_quorum()
            self._quorum_wait_s += time.perf_counter() - t0
            self._waited_quorum = True
        self._participating = bool(self._manager.is_participating())  # False while healing: zeros contributed
        if self._vote_due():  # straggler_sync: between the quorum and should_commit, so it commits with the step
            self._vote()
        t1 = time.perf_counter()
        committed = bool(self._manager.should_commit())  # applies a healed state first
        commit_s = time.perf_counter() - t1
        self._quorum_started = False
        self._sync_lightning_progress()
        if committed:
            out = super().optimizer_step(optimizer, lambda: loss, model, **kwargs)
        else:
            self._pending_scheduler_restore = self._snapshot_schedulers()
            out = loss
        self._after_step(committed, commit_s)
        if self._switch is not None:
            self._cost.synchronous_step(self._step_cross_s + commit_s)
            self._apply_vote(committed)
        return out

    def _inner_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """``local_sgd``/``diloco``: a local optimizer step, then the outer sync when the round ends."""
        assert self._outer is not None
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._data is not None and self._data_step is not None:
            self._round_samples += self._data.batch_size_of(self._data_step) * self.world_size
        t0 = time.perf_counter()
        committed = self._outer.after_inner_step()
        sync_s = time.perf_counter() - t0
        self._sync_lightning_progress(self._outer.step)
        if committed is not None:
            if not committed:  # the round's inner steps are rolled back: so are the LR schedulers
                self._pending_scheduler_restore = self._round_schedulers
            self._after_step(committed, time.perf_counter() - t0)
            self._round_samples = 0
        self._data_step = None
        if self._switch is not None:
            if committed is None:
                self._cost.inner_step()
            else:
                self._cost.sync_step(sync_s, self._outer.last_quorum_s, self.sync_every)
                self._apply_vote(committed)
        return out

    def _sync_lightning_progress(self, target: int | None = None, pending: int = 1) -> None:
        """Make Lightning's optimizer-step counter (``global_step``) equal the quorum's committed step.

        ``pending``: 1 inside ``optimizer_step`` (Lightning increments after it returns), 0 outside a step.
        """
        assert self.lightning_module is not None
        target = self._committed_step() if target is None else target
        seam.set_optimizer_step_count(self.lightning_module.trainer, target, pending=pending)

    def _snapshot_schedulers(self) -> list[Any]:
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        return [
            [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
            [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in self.optimizers],
        ]

    def _restore_schedulers(self, snapshot: list[Any]) -> None:
        """Undo the LR-scheduler step Lightning took after a discarded optimizer step."""
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        for cfg, state in zip(trainer.lr_scheduler_configs, snapshot[0]):
            cfg.scheduler.load_state_dict(state)
        for opt, groups in zip(self.optimizers, snapshot[1]):
            for group, saved in zip(opt.param_groups, groups):
                group.update(saved)

    def _after_step(self, committed: bool, commit_s: float, log: bool = True) -> None:
        step_s = time.perf_counter() - self._step_t0
        stats = self.ft_stats
        stats["committed" if committed else "discarded"] += 1
        stats["quorum_s"] += self._quorum_wait_s
        in_recovery = (not committed) or self._healed or self._after_discard
        if in_recovery:
            stats["recovery_s"] += step_s
        self._after_discard = not committed
        self.last_step_committed = committed
        participants = int(self._manager.num_participants())
        quorum_id = _torch_seam.quorum_id(self._manager)
        data = self._data_accounting(committed, participants)
        metrics = {
            "ft/participants": float(participants),
            "ft/quorum_id": float(quorum_id),
            "ft/committed": float(committed),
            "ft/committed_steps": float(stats["committed"]),
            "ft/discarded_steps": float(stats["discarded"]),
            "ft/heal": float(self._healed),
            "ft/heals": float(stats["heals"]),
            "ft/quorum_s": float(self._quorum_wait_s),
            "ft/commit_s": float(commit_s),
            "ft/recovery_s": float(stats["recovery_s"]),
        }
        if data.get("missed_samples") is not None:
            metrics["ft/missed_samples"] = float(data["missed_samples"])
            metrics["ft/missed_samples_total"] = float(stats["missed_samples"])
        module = self.lightning_module
        if log and seam.in_lightning_hook(module):
            try:
                module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1, sync_dist=False)
            except Exception as err:  # never let logging break a committed step
                rank_zero_warn(f"ft_hsdp: could not log ft/* metrics ({err})")
        if self._events is not None and self.global_rank == 0:
            self._events.write_step(
                self.replica_group_id, self._committed_step(), committed, participants=participants,
                quorum_id=quorum_id, healed=self._healed, step_s=step_s, quorum_s=self._quorum_wait_s,
                commit_s=commit_s, pid=os.getpid(), **{f"data_{k}": v for k, v in data.items()})

    def _data_accounting(self, committed: bool, participants: int) -> dict[str, Any]:
        """What this step trained and missed (``data_on_failure="skip"``); empty when the position is not aligned.

        The layout is fixed (equal shards, the same position on every group), so the groups missing from the
        step each missed exactly as many samples as this group trained.
        """
        if self._semi_active():
            return self._round_accounting(committed, participants)
        if self._data is None or self._data_step is None:
            return {}
        position, self._data_step = self._data_step, None
        samples = (self._data.batch_size_of(position) + self._extra_samples) * self.world_size
        step = self._committed_step() - int(committed)  # the quorum's step (a healing group's jumps)
        data: dict[str, Any] = {"step": step, "position": position, "participating": self._participating,
                                "rebuilt": self.last_step_data.get("rebuilt", False),
                                "samples": samples if committed and self._participating else 0,
                                "missed_samples": None}
        data["redistributed_samples"] = self._extra_samples * self.world_size if committed else 0
        if committed and self._participating:
            absent = self.num_replica_groups - participants
            redistribute = self.data_on_failure == "redistribute" and self._data.sharded
            per_group = self._data.batch_size_of(position) * self.world_size
            missed = 0 if redistribute else absent * per_group
            data["missed_samples"] = missed
            self.ft_stats["missed_samples"] += missed
            what = "trained by the groups in the step" if redistribute else "skipped"
            if absent and self._missed_since is None:
                self._missed_since, self._missed_run = position, 0
                rank_zero_info(f"ft_hsdp: from step {position}, {absent} of {self.num_replica_groups} replica groups are "
                               f"not in the step: their shards' batches ({absent * per_group} samples per step) are "
                               f"{what} (data_on_failure={self.data_on_failure!r})")
            if absent:
                self._missed_run += absent * per_group
            elif self._missed_since is not None:
                rank_zero_info(f"ft_hsdp: all {self.num_replica_groups} replica groups train again from step {position}; "
                               f"in steps {self._missed_since}-{position - 1}, {self._missed_run} samples of the "
                               f"missing groups' shards were {what}")
                self._missed_since = None
        self.last_step_data = data
        return data

    def _round_accounting(self, committed: bool, participants: int) -> dict[str, Any]:
        """Semi-sync: what an outer sync's round trained and missed (the groups absent from it, whole round).

        A group that healed in this sync contributed its source peer's pseudo-gradient (torchft's synchronous
        heal), not its own batches: it reports ``participating=False`` and no samples.
        """
        assert self._outer is not None
        if self._data is None:
            return {}
        own = self._round_samples
        participating = not self._outer.healed
        done = committed and participating
        absent = self.num_replica_groups - participants
        data: dict[str, Any] = {"step": self._outer.committed - (self._outer.last_round if committed else 0),
                                "round_steps": self._outer.last_round, "participating": participating,
                                "samples": own if done else 0, "missed_samples": absent * own if done else None,
                                "redistributed_samples": 0, "rebuilt": self.last_step_data.get("rebuilt", False)}
        if done:
            self.ft_stats["missed_samples"] += absent * own
        self.last_step_data = data
        return data

    # ------------------------------------------------------------------ leaving and shutting down
    def leave_quorum(self, reason: str) -> None:
        """Make this replica group leave the job now (e.g. evicted as a straggler); the launcher restarts it.

        Every rank of the group exits with :data:`LEAVE_EXIT_CODE` without waiting on peers, so the other
        groups go on after the lighthouse's heartbeat timeout and the restarted group heals from them.
        Call it on every rank of the group at the same step (a rank that stays would block in the group's
        collectives until torchrun tears the group down, which also ends in a restart):
        ``StragglerDetector(action="evict")`` does, from the window all ranks of the group gathered.
        """
        step = self._committed_step() if self._manager is not None else None
        msg = (f"ft_hsdp: replica group {self.replica_group_id} rank {self.global_rank} leaves the quorum"
               f"{'' if step is None else f' at committed step {step}'}: {reason}")
        print(msg, file=sys.stderr, flush=True)
        if self._events is not None and self.global_rank == 0:
            self._events.write_left(self.replica_group_id, reason, step)
        if self._manager is not None:
            try:
                self._manager.shutdown(wait=False)
            except Exception:
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(LEAVE_EXIT_CODE)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        # tell the launcher at once (teardown takes seconds): a group restarted now must not start over alone
        if self._events is not None and self.global_rank == 0 and self._manager is not None:
            self._events.write_finished(self.replica_group_id, self._committed_step())

    @override
    def teardown(self) -> None:
        super().teardown()
        self._outer = None  # bound to this fit's manager
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None

    # ------------------------------------------------------------------ checkpoints: one group writes
    def _is_checkpoint_writer(self) -> bool:
        """All committed groups hold the same state; the one ranked 0 in the current quorum writes it.

        A preemption checkpoint is written by every group that stops, each to its own file (groups may
        stop at different steps), see :meth:`_preempt_checkpoint_path`.
        """
        if self._preempt_saving:
            return True
        if self._manager is None or not _torch_seam.quorum_started(self._manager):
            return self.replica_group_id == 0
        return self._manager.participating_rank() == 0

    @override
    def _preempt_checkpoint_path(self, trainer: Any) -> Path:
        path = super()._preempt_checkpoint_path(trainer)
        return path.with_name(f"{path.stem}-group{self.replica_group_id}{path.suffix}")

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: seam.PATH, storage_options: Any | None = None) -> None:
        if self._is_checkpoint_writer():
            super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: seam.PATH) -> None:
        if self._is_checkpoint_writer():
            super().remove_checkpoint(filepath)
