"""``fsdp2``: FSDP2 (``torch.distributed.fsdp.fully_shard``) applied to an unmodified LightningModule.

Subclasses Lightning's ``ModelParallelStrategy`` (so the Trainer's connectors treat it as
distributed: launcher, distributed sampler, ``sync_dist``) and overrides only what differs:
the mesh, the wrapping, precision, gradient accumulation and atomic checkpoints.

Gradient accumulation (``accumulation``): under ``"sharded"`` (the default) every micro-batch's backward
reduce-scatters as usual, so FSDP2 adds each micro-batch's *sharded* gradient into ``param.grad`` and no
unsharded gradient outlives its backward. On a mesh with a replicate dimension (``hsdp``) the non-final
micro-batches run under ``FSDPModule.set_requires_all_reduce(False)``: FSDP2 keeps their reduce-scattered
sum (a shard-sized buffer) and all-reduces it across replicas once, with the last micro-batch's gradient.
``set_is_last_backward`` stays at its default (``True``): every backward ends by waiting for its
reduce-scatters and releasing their input buffers, which a deferred finalisation would keep alive.
``"no_sync"`` is FSDP2's ``set_requires_gradient_sync(False)`` (the equivalent of FSDP1's ``no_sync``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from typing_extensions import override

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies import _torch_seam as tseam
from fsdp_strategies._options import OptionError, check_choice, check_dtype, check_int
from fsdp_strategies.checkpoint.async_writer import AsyncCheckpointMode
from fsdp_strategies.checkpoint.atomic import (
    atomic_save_full_agreed,
    atomic_save_sharded,
    resolve_checkpoint_path,
)
from fsdp_strategies.checkpoint.load_into_fsdp import (
    PARAM_NAMES_KEY,
    load_into_sharded_model,
    load_remote_into_sharded_model,
    optimizer_param_names,
)
from fsdp_strategies.checkpoint.location import check_checkpoint_locations, local_checkpoint_path, url_or_none
from fsdp_strategies.checkpoint.object_store import (
    RemoteCheckpoint,
    check_remote_checkpoint_dir,
    open_remote,
    remove_remote,
    save_full_remote,
    save_sharded_remote,
)
from fsdp_strategies.hf.from_pretrained import defer_from_pretrained
from fsdp_strategies.hf.materialize import materialize
from fsdp_strategies.hf.metadata import hf_checkpoint_metadata
from fsdp_strategies.hf.pretrained import PretrainedSource, check_folder, load_pretrained
from fsdp_strategies.parallel import buffers_to, parallelize, parameter_device
from fsdp_strategies.parallel.blocks import describe_stacks, find_block_stacks
from fsdp_strategies.parallel.mesh import ParallelDims, build_mesh, check_tensor_parallel_degree
from fsdp_strategies.parallel.outside_calls import GatherOnOutsideCall
from fsdp_strategies.parallel.tensor_parallel import clip_grad_norm
from fsdp_strategies.runtime import data_position
from fsdp_strategies.runtime.preemption import DEFAULT_PREEMPT_GRACE_S
from fsdp_strategies.runtime.resume_position import ResumePositionMixin
from fsdp_strategies.strategies.lifecycle import LifecycleHooks
from fsdp_strategies.strategies.precision import ShardedMixedPrecision

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["AccumulationMode", "FSDP2Strategy"]

AccumulationMode = Literal["sharded", "no_sync"]  # non-final micro-batches of accumulate_grad_batches
# the Trainer's precision flags this strategy takes
PrecisionFlag = Literal["32-true", "bf16-mixed", "bf16-true"]
SUPPORTED_PRECISION: tuple[str, ...] = get_args(PrecisionFlag)


class FSDP2Strategy(ResumePositionMixin, LifecycleHooks, ModelParallelStrategy):
    """Fully sharded data parallel on FSDP2, one FSDP unit per transformer block plus the root.

    Args:
        block_class_names: class names of the transformer blocks (e.g. ``["TransformerBlock"]``).
            Empty: every stack of repeated blocks (one ``nn.ModuleList`` of modules of one class).
        reshard_after_forward: free gathered parameters after forward (``True``, ZeRO-3), keep them
            (``False``, ZeRO-2), or reshard to a smaller group of this many ranks (``int``).
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU.
        forward_prefetch: how many following blocks to all-gather ahead in forward (0 = FSDP2 default).
        backward_prefetch: how many preceding blocks to all-gather ahead in backward (1 = FSDP2 default).
        compile_blocks: ``torch.compile`` each block (in place) before sharding it.
        compile_options: keyword arguments for ``torch.compile`` (e.g. ``{"mode": "max-autotune"}``).
        meta_init: build modules created in ``configure_model`` on the meta device and materialise
            them shard by shard after wrapping (``to_empty`` + ``reset_parameters``).
        param_dtype: explicit ``MixedPrecisionPolicy.param_dtype`` (``bf16``, ``fp32``...); overrides what
            the Trainer's ``precision`` implies.
        reduce_dtype: explicit ``MixedPrecisionPolicy.reduce_dtype``; overrides the ``precision`` default.
        output_dtype: explicit ``MixedPrecisionPolicy.output_dtype``; overrides the ``precision`` default.
        autocast: with ``precision="bf16-mixed"``, also run each step under ``torch.autocast`` (bf16), so
            models with fp32 buffers or fp32 islands train as they do under Lightning's ``ddp``;
            ``False``: the ``MixedPrecisionPolicy`` alone (for models known to keep activations bf16).
        save_distributed_checkpoint: sharded DCP folder (default) or one full file written by rank 0.
        process_group_backend: ``nccl``/``gloo``; default from the device.
        timeout: collective timeout.
        checkpoint_on_preempt: on SIGTERM, write an atomic checkpoint (``last-preempt.ckpt`` in the
            ``ModelCheckpoint`` folder) before stopping; every rank stops at the same step either way
            and exits with status 75 (requeue). See :mod:`fsdp_strategies.runtime.preemption`.
        preempt_grace_s: the most seconds from the first SIGTERM to the exit (the scheduler's SIGTERM
            to SIGKILL time, minus a margin); a save that cannot finish in time is abandoned (atomic).
        async_checkpoint: ``"off"`` (synchronous saves), ``"thread"`` or ``"process"``: stage this rank's
            shards in CPU memory and write them in the background with DCP's ``async_save`` (a thread, or
            DCP's checkpoint process); still atomic, see :mod:`fsdp_strategies.checkpoint.async_writer`.
        pretrained: a local Hugging Face ``save_pretrained`` folder (``*.safetensors``) whose weights start
            the training: after sharding, every rank reads only its own shards of it (see
            :mod:`fsdp_strategies.hf.pretrained`). For modules whose ``configure_model`` builds the HF model
            with ``from_config``; ``from_pretrained`` in ``configure_model`` needs no option. A fit that
            resumes from a checkpoint (``ckpt_path``) reads it too, then the checkpoint's weights replace it.
        pretrained_prefix: the attribute path of the HF model in the LightningModule, e.g. ``"model."`` for
            ``self.model``; ``""`` for the module itself. Default: the one ``PreTrainedModel`` it holds.
        pretrained_strict: a parameter missing from ``pretrained``, or a tensor of it the model lacks, is an
            error (``True``) or a warning naming what keeps its fresh initialisation (``False``: e.g. a new
            head).
        tensor_parallel_degree: ranks that split each planned layer (tensor parallelism, inside a node); the
            mesh becomes (data-parallel dims..., ``tensor_parallel``) and FSDP shards over the data-parallel
            dims. 1: none. See :mod:`fsdp_strategies.parallel.tensor_parallel`.
        tp_plan: with ``tensor_parallel_degree > 1``: ``"auto"`` (the model's own plan: Hugging Face models
            whose config defines ``base_model_tp_plan``, e.g. Llama, Qwen2, Mistral) or a dict of module glob
            -> style (``colwise``, ``rowwise``, ``colwise_gather_output``, ``embedding_rowwise``). Not applied
            when ``configure_model`` applied a plan itself (``parallelize_module`` on
            ``device_mesh["tensor_parallel"]``).
        accumulation: what the non-final micro-batches of ``accumulate_grad_batches`` do. ``"sharded"``:
            reduce-scatter every micro-batch and accumulate the sharded gradients, so a rank holds 1/N of the
            gradients (N = the shard degree) at every point; costs one reduce-scatter per FSDP unit per
            micro-batch. Under ``hsdp`` the cross-replica all-reduce still runs once per optimizer step, on
            the last micro-batch. ``"no_sync"``: no communication on non-final micro-batches (one reduction
            per optimizer step), but every rank keeps the full, unsharded gradient of every parameter between
            micro-batches (N times the gradient memory): for models with memory to spare and a slow network.
            Without accumulation both are the same.
        storage_options: fsspec's options for checkpoint URLs (a ``ModelCheckpoint`` ``dirpath``, a
            ``ckpt_path``: ``s3://bucket/run``), e.g. ``{"endpoint_url": "http://host:8333", "key": ...}``
            for s3fs; ``None``: fsspec's defaults and the environment (``AWS_ENDPOINT_URL``,
            ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``). Committed by a manifest written last (a full
            file: one object): see :mod:`fsdp_strategies.checkpoint.object_store`.
    """

    strategy_name = "fsdp2"

    def __init__(
        self,
        block_class_names: list[str] | None = None,
        reshard_after_forward: bool | int = True,
        cpu_offload: bool = False,
        forward_prefetch: int = 0,
        backward_prefetch: int = 1,
        compile_blocks: bool = False,
        compile_options: dict[str, Any] | None = None,
        meta_init: bool = True,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        output_dtype: str | None = None,
        autocast: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        checkpoint_on_preempt: bool = False,
        preempt_grace_s: float = DEFAULT_PREEMPT_GRACE_S,
        async_checkpoint: AsyncCheckpointMode = "off",
        pretrained: str | None = None,
        pretrained_prefix: str | None = None,
        pretrained_strict: bool = True,
        tensor_parallel_degree: int = 1,
        tp_plan: str | dict[str, str] = "auto",
        accumulation: AccumulationMode = "sharded",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        check_choice("accumulation", accumulation, AccumulationMode)
        self.storage_options = dict(storage_options or {})
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_parts(checkpoint_on_preempt=checkpoint_on_preempt, preempt_grace_s=preempt_grace_s,
                         async_checkpoint=async_checkpoint, full_file=not save_distributed_checkpoint,
                         name=self.strategy_name, timeout=timeout)
        if isinstance(block_class_names, str):
            block_class_names = [block_class_names]
        if not isinstance(reshard_after_forward, bool):
            check_int("reshard_after_forward", reshard_after_forward, 1,
                      fix="True, False, or a positive number of "
                      "ranks that divides the shard degree.")
        for name, value in (("forward_prefetch", forward_prefetch), ("backward_prefetch", backward_prefetch)):
            check_int(name, value, 0, fix="a block count >= 0.")
        self.block_class_names = list(block_class_names or [])
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.forward_prefetch = forward_prefetch
        self.backward_prefetch = backward_prefetch
        self.compile_blocks = compile_blocks
        self.compile_options = dict(compile_options or {})
        self.meta_init = meta_init
        self.autocast = autocast
        self._explicit_dtypes = {
            "param_dtype": check_dtype("param_dtype", param_dtype),
            "reduce_dtype": check_dtype("reduce_dtype", reduce_dtype),
            "output_dtype": check_dtype("output_dtype", output_dtype),
        }
        self._mp_policy = MixedPrecisionPolicy()
        self._step_calls_root: dict[str, bool] = {}
        if pretrained is not None:
            check_folder(pretrained, "pretrained")
        elif pretrained_prefix is not None:
            raise OptionError(
                f"pretrained_prefix={pretrained_prefix!r} without pretrained. Fix: set pretrained to the "
                "save_pretrained folder, or drop pretrained_prefix."
            )
        check_tensor_parallel_degree(tensor_parallel_degree)
        if not (tp_plan == "auto" or isinstance(tp_plan, dict)):
            raise OptionError(
                f"tp_plan={tp_plan!r}: give 'auto' or a dict of module glob -> style. Fix: tp_plan: auto."
            )
        self.tensor_parallel_degree = tensor_parallel_degree
        self.tp_plan = tp_plan
        self.accumulation = accumulation
        self.pretrained = pretrained
        self.pretrained_prefix = pretrained_prefix
        self.pretrained_strict = pretrained_strict
        # from_pretrained calls seen in configure_model
        self._deferred_pretrained: list[PretrainedSource] = []
        self._activation_checkpointing: Callable[[nn.Module], object] | None = None  # from the callback

    # ------------------------------------------------------------------ validation (no process group yet)
    def _mesh_degrees(self) -> ParallelDims:
        """A 1-D shard mesh over the world (x tensor parallel). Subclasses return 2-D degrees."""
        return ParallelDims.fsdp(self.num_nodes * self.num_processes, self.num_processes,
                                 self.tensor_parallel_degree)

    def _precision_flag(self) -> str:
        return str(getattr(self.precision_plugin, "precision", "32-true"))

    def _validate_precision(self) -> None:
        flag = self._precision_flag()
        if flag not in SUPPORTED_PRECISION and not isinstance(self.precision_plugin, ShardedMixedPrecision):
            raise OptionError(
                f"precision={flag!r} is not supported by the {self.strategy_name} strategy. Fix: use one of "
                f"{SUPPORTED_PRECISION} ('bf16-mixed' = bf16 compute, fp32 master weights and fp32 reduce)."
            )
        if isinstance(self.precision_plugin, ShardedMixedPrecision):
            return  # validated already (this runs at Trainer construction and again in every process)
        implied: dict[str, torch.dtype | None] = {
            "param_dtype": None,
            "reduce_dtype": None,
            "output_dtype": None,
        }
        if flag == "bf16-mixed":
            implied = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": None}
            self.precision_plugin = ShardedMixedPrecision(flag, autocast=self.autocast)
        for key, value in self._explicit_dtypes.items():
            if value is not None:
                implied[key] = value
        self._mp_policy = MixedPrecisionPolicy(**implied)  # type: ignore[arg-type]

    def _validate_block_classes(self, model: nn.Module) -> None:
        """Fail early on a typo in ``block_class_names`` unless the blocks appear in ``configure_model``."""
        from lightning.pytorch.utilities.model_helpers import is_overridden

        if not self.block_class_names or (
            isinstance(model, nn.Module) and is_overridden("configure_model", model)  # type: ignore[arg-type]
        ):
            return
        find_block_stacks(model, self.block_class_names)

    @override
    def connect(self, model: pl.LightningModule) -> None:  # type: ignore[override]
        self._validate_block_classes(model)
        super().connect(model)

    def validate_options(self) -> None:
        """Checks that need devices, nodes and precision: precision, mesh degrees (subclasses add theirs)."""
        self._validate_precision()
        self._mesh_degrees()

    @override
    def set_world_ranks(self) -> None:
        # Public hook used for its call order: Lightning's accelerator connector calls it once devices,
        # num_nodes and the precision plugin are set, before the launcher exists and before any process
        # starts (and again in every process, before the process group): bad options fail there.
        super().set_world_ranks()
        if self.cluster_environment is not None and self.parallel_devices is not None:
            self.validate_options()

    # ------------------------------------------------------------------ process group and mesh
    @override
    def setup_environment(self) -> None:
        seam.init_process_group(self)
        mesh = build_mesh(self.root_device, self._mesh_degrees())
        if isinstance(self.precision_plugin, ShardedMixedPrecision):
            self.precision_plugin.device_type = self.root_device.type
        assert self.lightning_module is not None
        seam.set_device_mesh(self, mesh)  # strategy.device_mesh and LightningModule.device_mesh

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The mesh ``fully_shard`` uses (1-D here, 2-D for HSDP): the whole data-parallel mesh."""
        return self.device_mesh["data_parallel"]

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel index: the ranks of one tensor-parallel group share it (and their
        batch)."""
        return self._mesh_degrees().data_parallel_rank(self.global_rank)

    @property
    def data_parallel_size(self) -> int:
        """How many distinct batches the ranks of this job train per step (world size / TP degree)."""
        return self._mesh_degrees().data_parallel_size

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self._mesh_degrees().sampler_kwargs(self.global_rank)

    # ------------------------------------------------------------------ meta-device construction
    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        if self.meta_init:
            with torch.device("meta"), defer_from_pretrained(self._deferred_pretrained):
                yield
        else:
            yield

    def _pretrained_sources(self) -> list[PretrainedSource]:
        sources = list(self._deferred_pretrained)
        if self.pretrained is not None:
            sources.append(PretrainedSource(self.pretrained, self.pretrained_prefix, self.pretrained_strict,
                                            origin=f"pretrained={self.pretrained!r}"))
        return sources

    def load_pretrained_weights(self) -> None:
        """Read every pretrained source (the ``pretrained`` option, ``from_pretrained`` calls) into the
        shards."""
        assert self.model is not None
        sources = self._pretrained_sources()
        if not sources:
            return
        for source in sources:
            load_pretrained(self.model, source, log_prefix=f"{self.strategy_name}: ")

    # ------------------------------------------------------------------ wrapping
    def set_activation_checkpointing(self, apply: Callable[[nn.Module], object]) -> None:
        """protocols.ActivationCheckpointingTarget (the ``ActivationCheckpointing`` callback, in ``setup``):
        :meth:`shard_module` checkpoints the model with ``apply``, in its place in the transforms' order."""
        self._activation_checkpointing = apply

    def shard_module(self, module: nn.Module) -> nn.Module:
        """:func:`fsdp_strategies.parallel.parallelize` with this strategy's options: tensor parallelism
        (``tp_plan``), the callback's activation checkpointing, compile, shard. Idempotent."""
        if any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules()):
            raise TypeError(
                "The model contains FSDP1 (FullyShardedDataParallel) "
                f"modules; the {self.strategy_name} strategy "
                "uses FSDP2. Fix: remove the FSDP1 wrapping, or use Lightning's strategy='fsdp'."
            )
        if self.tensor_parallel_degree > 1:
            self._clip_per_mesh()
        stacks = parallelize(
            module, self.device_mesh, tp_plan=self.tp_plan if self.tensor_parallel_degree > 1 else None,
            ac=self._activation_checkpointing, block_class_names=self.block_class_names,
            compile_blocks=self.compile_blocks, compile_options=self.compile_options,
            mp_policy=self._mp_policy, cpu_offload=self.cpu_offload,
            reshard_after_forward=self.reshard_after_forward, forward_prefetch=self.forward_prefetch,
            backward_prefetch=self.backward_prefetch,
            log=lambda line: rank_zero_info(f"{self.strategy_name}: {line}"),
        )
        blocks = [block for stack in stacks for block in stack.blocks]
        if not blocks:
            rank_zero_warn(
                f"{self.strategy_name}: no transformer blocks "
                "found (no nn.ModuleList of repeated modules, and "
                "block_class_names is empty). The whole model "
                "is one FSDP unit: memory is sharded at rest but "
                "fully gathered in forward. Fix: set block_class_names."
            )
        rank_zero_info(
            f"{self.strategy_name}: sharded {len(blocks)} blocks ({describe_stacks(stacks)}) + root "
            "over mesh "
            f"{dict(zip(self.device_mesh.mesh_dim_names or (), self.device_mesh.shape, strict=False))}, "
            f"mp_policy(param={self._mp_policy.param_dtype}, reduce={self._mp_policy.reduce_dtype})"
        )
        return module

    def _clip_per_mesh(self) -> None:
        # gradients will live on two meshes (TP-planned and data-parallel-only): clip them per mesh
        seam.route_norm_clipping(self.precision_plugin, clip_grad_norm)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # ModelParallelStrategy.setup's steps, reordered: it requires a user configure_model that shards,
        # and converts precision after materialising; here the strategy shards, and bf16-true casts first.
        assert self.model is not None
        assert self.accelerator is not None
        # a URL this run cannot write (or an option object storage does not support) fails here, not at a save
        check_checkpoint_locations(trainer, remote=self._check_remote_location)
        self.accelerator.setup(trainer)
        if not isinstance(self.model, FSDPModule):
            if not isinstance(self.precision_plugin, ShardedMixedPrecision):
                # bf16-true: cast before sharding
                self.model = self.precision_plugin.convert_module(self.model)
            place = parameter_device(self.root_device, self.cpu_offload)
            if not seam.has_meta_tensors(self.model):
                self.model.to(place)
            self.shard_module(self.model)
            materialize(self.model, place)
            if self.cpu_offload:
                buffers_to(self.model, self.root_device)
            self.load_pretrained_weights()
            if isinstance(self.model, FSDPModule):
                # the root is initialised now, so that a call of a sub-unit before the first step does not
                # claim the root role (FSDP2 makes the first module whose forward runs the root); submodules
                # called outside the steps (self.model(...) in a hook, generate() in a callback) gather the
                # root's part
                tseam.fsdp_lazy_init(self.model)
                GatherOnOutsideCall(self.model)
        elif self._activation_checkpointing is not None:  # configure_model sharded the model itself
            self._activation_checkpointing(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # offloaded shards: their optimizer state stays on the CPU too
        if trainer.state.fn == TrainerFn.FITTING:
            seam.optimizers_to_device(self.optimizers, parameter_device(self.root_device, self.cpu_offload))

    # ------------------------------------------------------------------ steps: run through the root's hooks
    def _redirect(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # Lightning calls training_step, not forward; FSDP2's root hooks live on forward, so the step
        # is routed through the root's __call__ -- unless the step calls self(...) itself: nesting the
        # root's forward makes FSDP2 free the root's parameters after forward and gather them again at
        # the start of backward (found by profiling). Which case applies is seen on the first call.
        assert self.model is not None and self.lightning_module is not None
        if self._step_calls_root.get(method):
            return getattr(self.lightning_module, method)(*args, **kwargs)
        calls = 0

        def count(*_: Any) -> None:
            nonlocal calls
            calls += 1

        handle = self.model.register_forward_pre_hook(count)
        try:
            return seam.forward_redirection(self, self.model, self.lightning_module, method, *args, **kwargs)
        finally:
            handle.remove()
            self._step_calls_root[method] = calls > 1

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._redirect("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """A non-final micro-batch of gradient accumulation (``accumulation`` option, module docstring).

        ``"sharded"``: only the cross-replica all-reduce is deferred (a no-op on a mesh without a replicate
        dimension: the reduce-scatter runs); ``"no_sync"``: no gradient reduction at all. Set on every FSDP
        unit (the calls recurse from the root) and set back after the micro-batch.
        """
        if not isinstance(self.model, FSDPModule):
            yield None
            return
        if self.accumulation == "no_sync":
            requires_sync = self.model.set_requires_gradient_sync
        else:
            requires_sync = self.model.set_requires_all_reduce
        requires_sync(False)
        try:
            yield None
        finally:
            requires_sync(True)

    # ------------------------------------------------------------------ checkpoints
    def _remote(self, url: str, what: str, storage_options: Any | None = None) -> RemoteCheckpoint:
        return open_remote(url, what, {**self.storage_options, **dict(storage_options or {})})

    def _check_remote_location(self, url: str, what: str) -> None:
        check_remote_checkpoint_dir(url, what, storage_options=self.storage_options,
                                    is_rank_zero=self.is_global_zero, broadcast=self.broadcast)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: seam.PATH, storage_options: Any | None = None
    ) -> None:
        target = self.broadcast(str(filepath))
        url = url_or_none(target)  # object storage: committed by its manifest (sharded), or one object (full)
        if url is None and storage_options is not None:
            raise TypeError(f"save_checkpoint(storage_options=...) is for URLs; {target!r} is a local path.")
        remote = None if url is None else self._remote(url, "the checkpoint path", storage_options)
        path = None if url is not None else local_checkpoint_path(target, "the checkpoint path")
        if self.lightning_module is not None:  # which HF class + config the weights are, for --format hf
            checkpoint.update(hf_checkpoint_metadata(self.lightning_module))
            # for a resume at any width
            checkpoint.update(data_position.record(self.lightning_module.trainer))
        background = self._async.use_background()
        if seam.saves_distributed_checkpoint(self):
            tensors = {"state_dict": checkpoint.pop("state_dict")}
            tensors.update(
                {f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))}
            )
            if remote is not None:
                save = self.async_checkpointer.save_sharded_remote if background else save_sharded_remote
                save(tensors, checkpoint, remote, is_rank_zero=self.is_global_zero)
            elif background:
                self.async_checkpointer.save_sharded(
                    tensors, checkpoint, path, is_rank_zero=self.is_global_zero
                )
            else:  # a failure (e.g. a full disk) is raised on every rank, the partial temp removed
                atomic_save_sharded(tensors, checkpoint, path, is_rank_zero=self.is_global_zero)
        else:
            if self.is_global_zero:
                assert self.model is not None
                # Lightning numbers this file's optimizer state by module order: record the names behind it
                checkpoint[PARAM_NAMES_KEY] = optimizer_param_names(self.model, self.optimizers)
            if background:
                self.async_checkpointer.save_full(checkpoint, remote or path,
                                                  is_rank_zero=self.is_global_zero)
                self.barrier()
            elif remote is not None:  # one object, uploaded by rank 0; every rank learns the outcome
                save_full_remote(checkpoint, remote, is_rank_zero=self.is_global_zero)
            else:  # rank 0 writes; every rank learns its outcome (no rank left in a barrier if it fails)
                atomic_save_full_agreed(checkpoint, path, is_rank_zero=self.is_global_zero)

    @override
    def remove_checkpoint(self, filepath: seam.PATH) -> None:
        url = url_or_none(filepath)
        if url is None:
            super().remove_checkpoint(filepath)
        else:  # rank 0, after a write in flight; manifest first: it stops being valid before its objects go
            self._async.remove_when_safe(url, lambda: remove_remote(self._remote(url, "the old checkpoint")))

    @override
    def load_checkpoint(self, checkpoint_path: seam.PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Verify, then load a sharded folder or a full file (e.g. from ``ddp``: converted to shards), or a
        committed checkpoint on object storage (an fsspec URL).

        Files are always read with restricted unpicklers (``weights_only`` cannot turn that off; extra
        types can be allowed with ``torch.serialization.add_safe_globals``).
        """
        target = self.broadcast(str(checkpoint_path))
        assert self.model is not None and self.lightning_module is not None
        options = {"strict": self.lightning_module.strict_loading, "target": self.strategy_name}
        if (url := url_or_none(target)) is not None:
            remote = self._remote(url, "ckpt_path")
            checkpoint = load_remote_into_sharded_model(self.model, self.optimizers, remote, **options)
        else:
            checkpoint = load_into_sharded_model(
                self.model, self.optimizers, resolve_checkpoint_path(target), **options
            )
        self.restored_data_position(checkpoint)
        return checkpoint
