"""``ddp_hooks``: Lightning's DDP with torch's communication hooks, post-local SGD and hierarchical SGD.

Lightning's ``DDPStrategy`` registers comm hooks only on CUDA and supports only
``PeriodicModelAverager``. This subclass registers the hook itself right after the DDP wrap (CPU/gloo
and CUDA/NCCL alike), wraps the user's optimizer in torch's ``PostLocalSGDOptimizer`` (so
``configure_optimizers`` stays unmodified), builds the averaging subgroups explicitly, saves the
hook and averager state (and, under local SGD, every rank's optimizer state) in Lightning
checkpoints, and averages parameters before validation and before a checkpoint is written so both
see one consistent model. During local steps it keeps every per-step collective off (DDP's buffer
broadcast, Lightning's SIGTERM broadcast) so a slow rank stalls the others only at an averaging.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager, PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager
from torch.distributed.algorithms.model_averaging.utils import average_parameters as _average_parameters
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from fsdp_strategies._distributed import in_process_group
from fsdp_strategies._lightning_seam import PATH
from fsdp_strategies._options import OptionError, check_choice, check_int, check_number
from fsdp_strategies.checkpoint.async_writer import AsyncCheckpointMode
from fsdp_strategies.checkpoint.atomic import atomic_save_full_agreed, resolve_checkpoint_path
from fsdp_strategies.checkpoint.integrity import embed_digest
from fsdp_strategies.checkpoint.load_into_fsdp import (
    FULL_FORMAT,
    PARAM_NAMES_KEY,
    SHARDED_FORMAT,
    CheckpointMismatchError,
    optimizer_param_names,
)
from fsdp_strategies.checkpoint.location import check_checkpoint_locations, local_checkpoint_path, url_or_none
from fsdp_strategies.checkpoint.object_store import (
    check_remote_checkpoint_dir,
    open_remote,
    save_full_remote,
)
from fsdp_strategies.checkpoint.verify import load_full_file
from fsdp_strategies.hf.metadata import hf_checkpoint_metadata
from fsdp_strategies.parallel.mesh import check_torchrun_layout
from fsdp_strategies.runtime import data_position
from fsdp_strategies.runtime.preemption import DEFAULT_PREEMPT_GRACE_S
from fsdp_strategies.runtime.resume_position import ResumePositionMixin
from fsdp_strategies.strategies.comm_hook_state import LOCAL_SGD_HOOKS, CommHookStateMixin
from fsdp_strategies.strategies.lifecycle import LifecycleHooks

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["COMM_HOOKS", "DDPHooksStrategy", "in_bucket_order"]

CommHook = Literal[
    "allreduce", "bf16_compress", "fp16_compress", "powersgd", "post_local_sgd", "hierarchical_sgd"
]
COMM_HOOKS: tuple[str, ...] = get_args(CommHook)
_NEVER = 2**62  # "start local SGD at this iteration": effectively synchronous DDP


def _buffer_sync_attr(model: DistributedDataParallel) -> str:
    """DDP's per-forward buffer broadcast flag: ``forward_sync_buffers`` in newer torch, ``broadcast_buffers``
    before."""
    return "forward_sync_buffers" if hasattr(model, "forward_sync_buffers") else "broadcast_buffers"


class _ClosurePostLocalSGDOptimizer(PostLocalSGDOptimizer):
    """torch's ``PostLocalSGDOptimizer`` that accepts the closure Lightning's precision plugins always
    pass."""

    @override
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        super().step()
        return loss


def _bf16_compress_gloo(process_group, bucket):  # type: ignore[no-untyped-def]
    """torch's ``bf16_compress_hook`` under another name: DDP's name check only admits it with NCCL.

    Unannotated on purpose: DDP checks the annotations of a hook, and this module's postponed
    (string) annotations would not match ``dist.GradBucket``.
    """
    return default_hooks.bf16_compress_hook(process_group, bucket)


def in_bucket_order(hook: Callable[[Any, dist.GradBucket], torch.futures.Future]) -> Callable[..., Any]:
    """Wrap a DDP comm hook so each bucket's collectives start only after the previous bucket's finished.

    Why: a process group matches collectives by the order they are issued (gloo tags each with a
    per-group sequence number). PowerSGD issues a bucket's first all-reduce from the backward
    thread but its later ones (P, then Q) from ``Future.then`` callbacks, which gloo runs on its
    worker threads; with several buckets those callbacks interleave with the next bucket's
    all-reduce in a timing-dependent order, so ranks pair different tensors: gloo aborts ("Received
    data size doesn't match expected size") or hangs. Waiting for bucket ``i``'s future before
    calling the hook for bucket ``i + 1`` makes the issue order identical on every rank. The wait
    runs on the backward thread while later gradients are still being computed, so a bucket's
    communication still overlaps the backward pass that produces the next bucket. NCCL completes
    these futures when the work is queued (the callbacks run inline), so it needs no wrapper.
    """
    pending: list[torch.futures.Future] = []

    def ordered(state, bucket):  # type: ignore[no-untyped-def]  # unannotated: DDP checks hook annotations
        if pending:
            pending.pop().wait()  # raises here, in backward, if the previous bucket's communication failed
        fut = hook(state, bucket)
        pending.append(fut)
        return fut

    ordered.__qualname__ = ordered.__name__ = f"in_bucket_order({getattr(hook, '__qualname__', repr(hook))})"
    return ordered


class DDPHooksStrategy(CommHookStateMixin, ResumePositionMixin, LifecycleHooks, DDPStrategy):
    """DDP with a communication hook chosen by name, working on CPU/gloo and CUDA/NCCL.

    Args:
        comm_hook: ``allreduce`` (DDP's built-in), ``bf16_compress`` / ``fp16_compress`` (gradients
            all-reduced in 16 bit), ``powersgd`` (low-rank compression with error feedback),
            ``post_local_sgd`` (global gradient all-reduce during warm-up, then local steps with
            parameters averaged every ``local_sgd_period`` steps) or ``hierarchical_sgd`` (the same
            with averaging at several levels, ``hierarchy_levels``).
        powersgd_rank: PowerSGD matrix approximation rank.
        powersgd_start_iter: plain all-reduce for this many iterations first (>= 2: error feedback and
            warm start need it). Every iteration count, period and warm-up here counts optimizer steps: under
            ``accumulate_grad_batches`` Lightning runs the non-final micro-batches under DDP's ``no_sync``,
            where DDP calls no comm hook and the averagers do not step.
        powersgd_min_compression_rate: compress a tensor only when it saves at least this factor.
        powersgd_use_error_feedback: PowerSGD's error feedback (the compression error is added to the next
            step's gradient).
        powersgd_warm_start: PowerSGD's warm start (reuse the previous step's factors).
        local_sgd_period: parameter averaging period of ``post_local_sgd`` (and the first level of the
            default hierarchy).
        local_sgd_warmup: steps of fully synchronous DDP before local SGD starts.
        hierarchy_levels: ``{period: group_size}`` for ``hierarchical_sgd``, e.g. ``{2: 2, 8: 4}``:
            groups of 2 consecutive ranks average every 2 steps, all 4 ranks every 8. Periods and group
            sizes increase, each size divides the next, the last is the world size. Default: groups of
            one node every ``local_sgd_period`` steps and the world every ``4 * local_sgd_period``.
        local_group_size: after warm-up, gradients are still all-reduced every step within groups of
            this many consecutive ranks (torch's post-local SGD); ``1`` = no gradient communication
            between averagings (what hides stragglers). Default: the devices of one node.
        local_sgd_enabled: start with local SGD on (``True``), or synchronous until
            :meth:`set_local_sgd` turns it on (the straggler callback's ``hierarchical_sgd`` action).
        bucket_cap_mb: passed to ``DistributedDataParallel``.
        static_graph: passed to ``DistributedDataParallel``.
        gradient_as_bucket_view: passed to ``DistributedDataParallel``.
        find_unused_parameters: passed to ``DistributedDataParallel``.
        process_group_backend: as in Lightning's ``DDPStrategy``.
        timeout: as in Lightning's ``DDPStrategy``.
        start_method: as in Lightning's ``DDPStrategy``.
        checkpoint_on_preempt: SIGTERM handling, as in
            :class:`~fsdp_strategies.strategies.fsdp2.FSDP2Strategy`. Under local SGD every rank stops at the
            first global averaging after the signal (the ranks meet only there).
        preempt_grace_s: as in :class:`~fsdp_strategies.strategies.fsdp2.FSDP2Strategy`.
        async_checkpoint: ``"off"`` (synchronous) or ``"thread"``: rank 0 copies the checkpoint to CPU memory
            and a background thread writes the file (digest, ``torch.save``, atomic rename); see
            :mod:`fsdp_strategies.checkpoint.async_writer`. ``"process"`` needs a sharded checkpoint
            (fsdp2/hsdp).
    """

    strategy_name = "ddp_hooks"

    def __init__(
        self,
        comm_hook: CommHook = "allreduce",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
        powersgd_min_compression_rate: float = 2.0,
        powersgd_use_error_feedback: bool = True,
        powersgd_warm_start: bool = True,
        local_sgd_period: int = 4,
        local_sgd_warmup: int = 10,
        hierarchy_levels: dict[int, int] | None = None,
        local_group_size: int | None = None,
        local_sgd_enabled: bool = True,
        bucket_cap_mb: float | None = None,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        checkpoint_on_preempt: bool = False,
        preempt_grace_s: float = DEFAULT_PREEMPT_GRACE_S,
        async_checkpoint: AsyncCheckpointMode = "off",
    ) -> None:
        check_choice("comm_hook", comm_hook, CommHook)
        for name, value, low in (
            ("powersgd_rank", powersgd_rank, 1),
            ("powersgd_start_iter", powersgd_start_iter, 2),
            ("local_sgd_period", local_sgd_period, 1),
            ("local_sgd_warmup", local_sgd_warmup, 0),
        ):
            check_int(name, value, low)
        check_int(
            "local_group_size", local_group_size, 1, optional=True, fix="a positive rank count, or null."
        )
        check_number("bucket_cap_mb", bucket_cap_mb, optional=True, fix="a positive size in MB, or null.")
        levels = self._check_levels(hierarchy_levels) if hierarchy_levels else None
        if levels is not None and comm_hook != "hierarchical_sgd":
            raise OptionError(
                f"hierarchy_levels is set but comm_hook={comm_hook!r}. Fix: comm_hook: hierarchical_sgd, "
                "or remove hierarchy_levels."
            )
        ddp_kwargs: dict[str, Any] = {"static_graph": static_graph,
                                      "gradient_as_bucket_view": gradient_as_bucket_view,
                                      "find_unused_parameters": find_unused_parameters}
        if bucket_cap_mb is not None:
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method, **ddp_kwargs)
        self._init_parts(checkpoint_on_preempt=checkpoint_on_preempt, preempt_grace_s=preempt_grace_s,
                         async_checkpoint=async_checkpoint, full_file=True, name=self.strategy_name,
                         timeout=timeout, check_due=self._ranks_meet_this_step)
        self.comm_hook = comm_hook
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter
        self.powersgd_min_compression_rate = powersgd_min_compression_rate
        self.powersgd_use_error_feedback = powersgd_use_error_feedback
        self.powersgd_warm_start = powersgd_warm_start
        self.local_sgd_period = local_sgd_period
        self.local_sgd_warmup = local_sgd_warmup
        self.hierarchy_levels = levels
        self.local_group_size = local_group_size
        self._local_sgd_enabled = local_sgd_enabled
        self._hook_state: Any = None
        self._init_comm_state()
        self._averager: ModelAverager | None = None
        self._subgroups: list[Any] = []
        self._ddp_syncs_buffers = True  # DDP's per-forward buffer broadcast, as configured at wrap time

    # ------------------------------------------------------------------ validation (no process group yet)
    @staticmethod
    def _check_levels(levels: Mapping[Any, Any]) -> OrderedDict[int, int]:
        try:
            items = sorted((int(p), int(s)) for p, s in dict(levels).items())
        except (TypeError, ValueError):
            raise OptionError(
                f"hierarchy_levels={levels!r} is invalid. Fix: a mapping {{period: group_size}} of "
                "positive integers, e.g. {2: 2, 8: 4}."
            ) from None
        for i, (period, size) in enumerate(items):
            if period < 1 or size < 1:
                raise OptionError(
                    f"hierarchy_levels={levels!r}: period {period} / group size {size} must be positive."
                )
            if i and size <= items[i - 1][1]:
                raise OptionError(
                    f"hierarchy_levels={levels!r}: group sizes must grow with the period (a longer period "
                    f"averages a larger group). Fix: e.g. {{2: 2, 8: 4}}."
                )
            if i and size % items[i - 1][1]:
                raise OptionError(
                    f"hierarchy_levels={levels!r}: group size {items[i - 1][1]} does not divide {size}. "
                    "Fix: each level's group must be a union of the groups below it."
                )
        return OrderedDict(items)

    def _resolve_layout(self) -> None:
        """Default and validate group sizes against the world size, before the process group exists."""
        world = self.num_nodes * self.num_processes
        per_node = max(1, self.num_processes)
        if self.comm_hook not in LOCAL_SGD_HOOKS:
            return
        check_torchrun_layout(self.num_nodes, self.num_processes, f"{self.comm_hook}'s per-node groups")
        if self.local_group_size is None:
            self.local_group_size = per_node
        if world % self.local_group_size:
            raise OptionError(
                f"local_group_size={self.local_group_size} does not divide the world size {world}. "
                f"Fix: a divisor of {world} (1 = no gradient all-reduce between averagings)."
            )
        if self.comm_hook == "hierarchical_sgd":
            if self.hierarchy_levels is None:
                levels = {self.local_sgd_period: per_node, 4 * self.local_sgd_period: world}
                if per_node == world:
                    levels = {self.local_sgd_period: world}
                self.hierarchy_levels = self._check_levels(levels)
            sizes = list(self.hierarchy_levels.values())
            if sizes[-1] != world:
                raise OptionError(
                    f"hierarchy_levels={dict(self.hierarchy_levels)}: the last (longest-period) group "
                    f"size must be the world size {world}. Fix: e.g. {{2: {min(2, world)}, 8: {world}}}."
                )
            bad = [s for s in sizes if world % s]
            if bad:
                raise OptionError(
                    f"hierarchy_levels={dict(self.hierarchy_levels)}: group sizes {bad} do not divide "
                    f"the world size {world}."
                )

    @override
    def setup_environment(self) -> None:
        self._resolve_layout()
        super().setup_environment()

    # ------------------------------------------------------------------ hooks
    def _contiguous_subgroup(self, size: int) -> Any:
        """The subgroup of ``size`` consecutive ranks holding this rank; created identically on every rank."""
        world = dist.get_world_size()
        if size == world:
            return dist.group.WORLD
        ranks = [list(range(start, start + size)) for start in range(0, world, size)]
        mine, groups = dist.new_subgroups_by_enumeration(ranks)
        self._subgroups.extend(groups)
        return mine

    @override
    def configure_ddp(self) -> None:
        """Wrap in DDP (Lightning's), then register this strategy's comm hook on any device.

        Lightning's own registration inside ``configure_ddp`` runs on CUDA only and has no hook to
        register here (none is passed to ``DDPStrategy``), so it does nothing.
        """
        super().configure_ddp()
        self._register_comm_hook()

    def _register_comm_hook(self) -> None:
        model = self.model
        assert isinstance(model, DistributedDataParallel)
        self._ddp_syncs_buffers = bool(getattr(model, _buffer_sync_attr(model)))
        hook = self.comm_hook
        if hook == "allreduce":
            return
        if hook == "bf16_compress":
            # DDP refuses torch's bf16 hook by name unless NCCL >= 2.10; gloo all-reduces bf16 fine
            fn = default_hooks.bf16_compress_hook if self.root_device.type == "cuda" else _bf16_compress_gloo
            model.register_comm_hook(None, fn)
        elif hook == "fp16_compress":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook == "powersgd":
            self._hook_state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_iter,
                min_compression_rate=self.powersgd_min_compression_rate,
                use_error_feedback=self.powersgd_use_error_feedback, warm_start=self.powersgd_warm_start,
                random_seed=0)
            inner: Callable[..., Any] = powerSGD_hook.powerSGD_hook
            if dist.get_backend(model.process_group) != "nccl":  # gloo: order the buckets' collectives
                inner = in_bucket_order(inner)
            model.register_comm_hook(self._hook_state, self._powersgd_hook(model, inner))
        else:
            assert self.local_group_size is not None
            subgroup = self._contiguous_subgroup(self.local_group_size) if self.local_group_size > 1 else None
            self._hook_state = PostLocalSGDState(
                process_group=None, subgroup=subgroup, start_localSGD_iter=self.local_sgd_warmup,
                post_local_gradient_allreduce=self.local_group_size > 1)
            model.register_comm_hook(self._hook_state, post_localSGD_hook)
        rank_zero_info(
            f"{self.strategy_name}: registered the {hook!r} communication hook on {self.root_device.type}."
        )

    def _build_averager(self) -> ModelAverager:
        if self.comm_hook == "post_local_sgd":
            return PeriodicModelAverager(period=self.local_sgd_period, warmup_steps=self.local_sgd_warmup)
        assert self.hierarchy_levels is not None
        return HierarchicalModelAverager(
            OrderedDict(self.hierarchy_levels), warmup_steps=self.local_sgd_warmup
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if type(self.checkpoint_io) is TorchCheckpointIO:  # the package's commit path; URLs: one object each
            check_checkpoint_locations(trainer, remote=lambda url, what: check_remote_checkpoint_dir(
                url, what, storage_options=None, is_rank_zero=self.is_global_zero,
                broadcast=self.broadcast))
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING or self.comm_hook not in LOCAL_SGD_HOOKS:
            return
        if self._averager is None:
            self._averager = self._build_averager()
        wrapped = []
        for optimizer in self.optimizers:
            inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            if not isinstance(inner, PostLocalSGDOptimizer):
                inner = _ClosurePostLocalSGDOptimizer(inner, self._averager)
            wrapped.append(inner)
        self.optimizers = wrapped
        self.set_local_sgd(self._local_sgd_enabled, average=False)

    # ------------------------------------------------------------------ local SGD switching (a
    # LocalAveragingSwitch)
    @property
    def local_sgd_available(self) -> bool:
        """Whether :meth:`set_local_sgd` works: ``comm_hook`` is ``post_local_sgd`` or
        ``hierarchical_sgd``."""
        return self.comm_hook in LOCAL_SGD_HOOKS

    @property
    def local_sgd_enabled(self) -> bool:
        """Whether ranks currently take local steps between parameter averagings."""
        return self._local_sgd_enabled

    def set_local_sgd(self, enabled: bool, average: bool = True) -> None:
        """Switch between local SGD (hierarchical / post-local averaging) and synchronous DDP.

        Must be called on every rank at the same step. Turning local SGD off averages the parameters
        first, so synchronous training resumes from one model. The schedules (``PostLocalSGDState.iter``,
        the averager's step) keep counting in both modes.
        """
        if self.comm_hook not in LOCAL_SGD_HOOKS:
            raise RuntimeError(f"set_local_sgd needs comm_hook post_local_sgd or hierarchical_sgd, not "
                               f"{self.comm_hook!r}. Fix: strategy init_args comm_hook: hierarchical_sgd.")
        self._local_sgd_enabled = bool(enabled)
        state, averager = self._hook_state, self._averager
        if state is None or averager is None:
            return  # applied in setup
        if not enabled and average:
            self.average_parameters()
        if enabled:
            state.start_localSGD_iter = max(self.local_sgd_warmup, state.iter)
            averager.warmup_steps = max(self.local_sgd_warmup, averager.step)
        else:
            state.start_localSGD_iter = _NEVER
            averager.warmup_steps = _NEVER

    def average_parameters(self) -> None:
        """Average parameters over all ranks now (torch's averaging utility), outside the schedule.

        Buffers follow DDP's rule (rank 0's values): during local steps DDP does not broadcast them
        every forward (see :meth:`on_train_batch_start`), so they are made consistent here.
        """
        if self.comm_hook not in LOCAL_SGD_HOOKS or not isinstance(self.model, DistributedDataParallel):
            return
        if not in_process_group():
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        if params:
            _average_parameters(iter(params), dist.group.WORLD)  # all of them, not only those with a grad
        if self._ddp_syncs_buffers:
            for buffer in self.model.module.buffers():
                dist.broadcast(buffer, src=0)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        # DDP broadcasts buffers (e.g. rotary tables, norm statistics) from rank 0 in every forward: a
        # collective per step that would tie every rank to the slowest again during local steps.
        model = self.model
        if (
            self._averager is None
            or not isinstance(model, DistributedDataParallel)
            or not self._ddp_syncs_buffers
        ):
            return
        setattr(model, _buffer_sync_attr(model), not self._local_step_now())

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self.average_parameters()

    @override
    def on_train_end(self) -> None:
        self.average_parameters()
        super().on_train_end()

    def _local_step_now(self) -> bool:
        """Whether the step about to run is a local step (no gradient all-reduce)."""
        averager = self._averager
        return averager is not None and self._local_sgd_enabled and averager.step >= averager.warmup_steps

    def _averaged_globally_at(self, step: int) -> bool:
        """Whether the averager averaged over all ranks at averager step ``step`` (the ranks met there)."""
        averager = self._averager
        if averager is None or step < averager.warmup_steps:
            return False
        if isinstance(averager, PeriodicModelAverager):
            return (step - averager.warmup_steps) % averager.period == 0
        assert self.hierarchy_levels is not None
        return step % max(self.hierarchy_levels) == 0

    def _ranks_meet_this_step(self) -> bool:
        """The preemption guard's ``check_due``. The per-step SIGTERM agreement is a collective that makes
        every rank wait for the slowest, which local SGD exists to avoid: during local steps it runs only
        right after a global averaging, where the ranks have just met. A SIGTERM then stops every rank within
        one global period instead of one step.
        """
        averager = self._averager
        return averager is None or not self._local_step_now() or self._averaged_globally_at(averager.step - 1)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # called on every rank while a checkpoint is assembled: one consistent model goes in
        self.average_parameters()
        return super().lightning_module_state_dict()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PATH, storage_options: Any | None = None
    ) -> None:
        # every rank reaches this; the per-rank states (PowerSGD error feedback differs per rank) go to rank 0
        background = self._async.use_background()
        checkpoint = self._with_comm_state(checkpoint)
        if self.is_global_zero:
            assert self.lightning_module is not None
            checkpoint[PARAM_NAMES_KEY] = optimizer_param_names(self.lightning_module, self.optimizers)
            # for `fsdp-strategies-export --format hf`
            checkpoint.update(hf_checkpoint_metadata(self.lightning_module))
            # for a resume at any width
            checkpoint.update(data_position.record(self.lightning_module.trainer))
        own_io = type(self.checkpoint_io) is TorchCheckpointIO
        url = url_or_none(self.broadcast(str(filepath))) if own_io else None
        remote = None if url is None else open_remote(url, "the checkpoint path", storage_options)
        if background:  # the digest is computed by the background writer, on its copy
            path = remote or local_checkpoint_path(self.broadcast(str(filepath)), "the checkpoint path")
            self.async_checkpointer.save_full(checkpoint, path, is_rank_zero=self.is_global_zero)
            return
        if remote is not None:  # one object, uploaded by rank 0; every rank learns the outcome
            save_full_remote(checkpoint, remote, is_rank_zero=self.is_global_zero)
            return
        if type(self.checkpoint_io) is TorchCheckpointIO and storage_options is None:
            # Lightning's own writer saves through a temp file it *copies* onto the target across filesystems
            # (half-written under the final name on a full disk) and raises a raw OSError: the package's
            # commit path instead (temp + fsync + rename, digest inside, one disk-full error on every rank)
            path = local_checkpoint_path(self.broadcast(str(filepath)), "the checkpoint path")
            atomic_save_full_agreed(
                checkpoint if self.is_global_zero else None, path, is_rank_zero=self.is_global_zero
            )
            return
        if self.is_global_zero:  # a CheckpointIO of the user's: its own write path; the digest travels inside
            checkpoint = embed_digest(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Read with the restricted unpickler (never runs code from the file) and check the embedded digest; a
        URL is one object on object storage (``fsspec``'s credentials from the environment)."""
        target = self.broadcast(str(checkpoint_path))
        if (url := url_or_none(target)) is not None:
            remote = open_remote(url, "ckpt_path")
            if not remote.is_full_file():
                raise FileNotFoundError(f"{url}: no single checkpoint object there; {self.strategy_name} "
                                        f"resumes from {FULL_FORMAT} (a sharded one: under fsdp2/hsdp).")
            checkpoint = load_full_file(remote, mmap=False)
            self.restored_data_position(checkpoint)
            return checkpoint
        path = resolve_checkpoint_path(target)
        if path.is_dir():
            raise CheckpointMismatchError(
                f"{path} is {SHARDED_FORMAT}; {self.strategy_name} "
                f"resumes from {FULL_FORMAT}. Fix: resume it under "
                "fsdp2/hsdp (or export the weights with "
                "`fsdp-strategies-export` and load them into the model)."
            )
        # no mmap: a later in-place save must not change loaded state
        checkpoint = load_full_file(path, mmap=False)
        self.restored_data_position(checkpoint)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(self._with_own_optimizer_state(checkpoint))
        self._restore_comm_state(checkpoint)
