"""``hsdp``: FSDP2 on a 2-D ``("replicate", "shard")`` DeviceMesh.

Parameters are sharded within a shard group (by default one node) and replicated across shard
groups; gradients are reduce-scattered within and all-reduced across. Everything else
(wrapping, precision, checkpoints) is the ``fsdp2`` strategy's.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from typing_extensions import override

from fsdp_strategies._async_checkpoint import AsyncCheckpointMode
from fsdp_strategies._mesh import (
    HSDPDegrees,
    check_torchrun_layout,
    resolve_hsdp_degrees,
    validate_degree_option,
)
from fsdp_strategies._preemption import DEFAULT_PREEMPT_GRACE_S
from fsdp_strategies.strategies.fsdp import FSDP2Strategy

__all__ = ["HSDPStrategy"]


class HSDPStrategy(FSDP2Strategy):
    """Hybrid sharded data parallel (FSDP2 on a 2-D mesh).

    Args:
        replicate_degree: number of replica groups; ``"auto"`` = world size / ``shard_degree``.
        shard_degree: ranks that shard one copy of the model; ``"auto"`` = devices per node.
        **kwargs: every ``fsdp2`` option (see :class:`FSDP2Strategy`).
    """

    strategy_name = "hsdp"

    def __init__(
        self,
        replicate_degree: int | str = "auto",
        shard_degree: int | str = "auto",
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
    ) -> None:
        validate_degree_option("replicate_degree", replicate_degree)
        validate_degree_option("shard_degree", shard_degree)
        super().__init__(
            block_class_names=block_class_names,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch,
            compile_blocks=compile_blocks,
            compile_options=compile_options,
            meta_init=meta_init,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            output_dtype=output_dtype,
            autocast=autocast,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
            checkpoint_on_preempt=checkpoint_on_preempt,
            preempt_grace_s=preempt_grace_s,
            async_checkpoint=async_checkpoint,
        )
        self.replicate_degree = replicate_degree
        self.shard_degree = shard_degree

    @override
    def _mesh_degrees(self) -> HSDPDegrees:
        check_torchrun_layout(self.num_nodes, self.num_processes, "hsdp's shard and replicate groups")
        return resolve_hsdp_degrees(
            world_size=self.num_nodes * self.num_processes,
            devices_per_node=self.num_processes,
            replicate_degree=self.replicate_degree,
            shard_degree=self.shard_degree,
        )
