"""``hsdp``: FSDP2 on a 2-D ``("replicate", "shard")`` DeviceMesh.

Parameters are sharded within a shard group (by default one node) and replicated across shard
groups; gradients are reduce-scattered within and all-reduced across. Everything else
(wrapping, precision, checkpoints) is the ``fsdp2`` strategy's.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from fsdp_strategies._options import check_degree
from fsdp_strategies.parallel.mesh import ParallelDims, check_torchrun_layout
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

    def __init__(
        self, replicate_degree: int | str = "auto", shard_degree: int | str = "auto", **kwargs: Any
    ) -> None:
        check_degree("replicate_degree", replicate_degree)
        check_degree("shard_degree", shard_degree)
        super().__init__(**kwargs)
        self.replicate_degree = replicate_degree
        self.shard_degree = shard_degree

    @override
    def _mesh_degrees(self) -> ParallelDims:
        check_torchrun_layout(self.num_nodes, self.num_processes, "hsdp's shard and replicate groups")
        return ParallelDims.hsdp(self.num_nodes * self.num_processes, self.num_processes,
                                 self.replicate_degree, self.shard_degree, self.tensor_parallel_degree)
