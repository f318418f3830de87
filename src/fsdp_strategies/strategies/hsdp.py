"""``hsdp``: FSDP2 on a 2-D ``("replicate", "shard")`` DeviceMesh.

Parameters are sharded within a shard group (by default one node) and replicated across shard
groups; gradients are reduce-scattered within and all-reduced across. Everything else
(wrapping, precision, checkpoints) is the ``fsdp2`` strategy's.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from fsdp_strategies._options import check_degree
from fsdp_strategies.parallel.mesh import HSDPDegrees, check_torchrun_layout, resolve_hsdp_degrees
from fsdp_strategies.strategies.fsdp2 import FSDP2Strategy

__all__ = ["HSDPStrategy"]


class HSDPStrategy(FSDP2Strategy):
    """Hybrid sharded data parallel (FSDP2 on a 2-D mesh).

    Args:
        replicate_degree: number of replica groups; ``"auto"`` = world size / ``shard_degree``.
        shard_degree: ranks that shard one copy of the model; ``"auto"`` = devices per node.
        **kwargs: every ``fsdp2`` option (see :class:`FSDP2Strategy`).
    """

    strategy_name = "hsdp"

    def __init__(self, replicate_degree: int | str = "auto", shard_degree: int | str = "auto", **kwargs: Any) -> None:
        check_degree("replicate_degree", replicate_degree)
        check_degree("shard_degree", shard_degree)
        super().__init__(**kwargs)
        self.replicate_degree = replicate_degree
        self.shard_degree = shard_degree

    @override
    def _mesh_degrees(self) -> HSDPDegrees:
        check_torchrun_layout(self.num_nodes, self.num_processes, "hsdp's shard and replicate groups")
        tp = self.tensor_parallel_degree  # the data-parallel dims span the ranks of one TP rank
        return resolve_hsdp_degrees(
            world_size=self.num_nodes * self.num_processes // tp,
            devices_per_node=self.num_processes // tp,
            replicate_degree=self.replicate_degree,
            shard_degree=self.shard_degree,
        )
