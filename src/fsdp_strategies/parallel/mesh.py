"""Device-mesh degrees (:class:`ParallelDims`): validated before any process group exists, built after.

One object holds every degree of a run -- replicate x shard x tensor-parallel over the ranks of a job (or
of one ``ft_hsdp`` replica group), and the torchft replica groups above them -- and derives what the
strategies need from it: the mesh's shape and dim names, a rank's data-parallel index, the data shards a
sampler splits over. Why one object: each of these was computed where it was used (the TP degree divided
out in three places), and a layout two strategies disagreed on would split the data wrongly, silently.

Named dims: ``("shard",)`` for FSDP and ``("replicate", "shard")`` for HSDP, each followed by
``"tensor_parallel"`` when the tensor-parallel degree is above 1. Ranks are laid out row-major with the
tensor-parallel dim last (the ranks of one TP group are neighbours, i.e. on one node), so
``global_rank == data_parallel_rank * tp_degree + tp_rank``.

Lightning's ``ModelParallelStrategy`` names its dims ``"data_parallel"`` and ``"tensor_parallel"``, and a
``configure_model`` written for it shards with ``fully_shard(..., mesh=self.device_mesh["data_parallel"])``
(after ``parallelize_module(..., self.device_mesh["tensor_parallel"], plan)``). The meshes built here answer
to both names: ``mesh["data_parallel"]`` is the whole data-parallel mesh (1-D for FSDP; for HSDP the 2-D
replicate x shard mesh, so such a ``configure_model`` gets hybrid sharding unchanged).

The mesh is built as a :class:`DataParallelNamedMesh` (a ``DeviceMesh`` subclass made with DeviceMesh's public
constructor, as ``init_device_mesh`` makes its meshes) rather than given a new class afterwards. torch can
name merged dims only as one flattened 1-D dim (and not publicly), and for HSDP ``"data_parallel"`` must stay
the 2-D replicate x shard mesh.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch
from torch.distributed.device_mesh import DeviceMesh

from fsdp_strategies._options import OptionError, check_int

__all__ = ["DATA_PARALLEL", "TENSOR_PARALLEL", "DataParallelNamedMesh", "HSDPDegrees", "ParallelDims",
           "build_mesh", "check_tensor_parallel_degree", "check_torchrun_layout", "resolve_hsdp_degrees"]

#: The name Lightning's ``ModelParallelStrategy`` gives its data-parallel mesh dim.
DATA_PARALLEL = "data_parallel"
#: The name of the tensor-parallel mesh dim (Lightning's ``ModelParallelStrategy`` uses the same).
TENSOR_PARALLEL = "tensor_parallel"


class DataParallelNamedMesh(DeviceMesh):
    """A DeviceMesh that also answers to Lightning's dim names (see the module docstring)."""

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:  # type: ignore[override]
        key = names[0] if isinstance(names, tuple) and len(names) == 1 else names
        dims = tuple(self.mesh_dim_names or ())
        if key == DATA_PARALLEL:
            data = tuple(d for d in dims if d != TENSOR_PARALLEL)
            return self if data == dims else super().__getitem__(data)
        if key == TENSOR_PARALLEL and TENSOR_PARALLEL not in dims:
            raise KeyError(
                f"device_mesh[{names!r}]: this strategy has no "
                f"tensor-parallel dim (its mesh is {dims}). Fix: set "
                "the strategy's tensor_parallel_degree (e.g. 2), "
                "or shard with device_mesh['data_parallel'] only."
            )
        return super().__getitem__(names)


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a run: ``replicate x shard x tensor_parallel`` ranks, and ``replica_groups`` above them.

    Made by :meth:`fsdp` or :meth:`hsdp`, which check the options against the layout (errors name the option,
    its value and the fix) at Trainer construction, before any process group. Ranks are row-major with the
    tensor-parallel dim last (see the module docstring).

    Args:
        replicate: copies of the model inside the job (HSDP's replicate dim; 1 for FSDP).
        shard: ranks that shard one copy (within one tensor-parallel rank).
        tensor_parallel: ranks that split each planned layer (1: no tensor parallelism).
        hybrid: the data-parallel mesh is 2-D ``("replicate", "shard")`` (HSDP, even at ``replicate=1``), or
            1-D ``("shard",)``.
        replica_groups: torchft's replica groups (``ft_hsdp``: separate jobs, each with these degrees); each
            trains its own shards of the data.
    """

    replicate: int
    shard: int
    tensor_parallel: int = 1
    hybrid: bool = True
    replica_groups: int = 1

    def __post_init__(self) -> None:
        for name in ("replicate", "shard", "tensor_parallel", "replica_groups"):
            check_int(name, getattr(self, name), 1)
        if not self.hybrid and self.replicate != 1:
            raise OptionError(f"replicate={self.replicate} on a 1-D mesh is invalid. Fix: hybrid=True "
                              "(HSDP).")

    @classmethod
    def fsdp(cls, world_size: int, devices_per_node: int, tensor_parallel: int = 1,
             replica_groups: int = 1) -> ParallelDims:
        """FSDP over ``world_size`` ranks (of a job, or of one replica group), TP inside a node."""
        check_tensor_parallel_degree(tensor_parallel, world_size, devices_per_node)
        return cls(1, world_size // tensor_parallel, tensor_parallel, hybrid=False,
                   replica_groups=replica_groups)

    @classmethod
    def hsdp(cls, world_size: int, devices_per_node: int, replicate_degree: int | str | None = "auto",
             shard_degree: int | str | None = "auto", tensor_parallel: int = 1) -> ParallelDims:
        """HSDP: ``"auto"`` degrees filled in (:func:`resolve_hsdp_degrees`) over the ranks of one TP rank."""
        check_tensor_parallel_degree(tensor_parallel, world_size, devices_per_node)
        degrees = resolve_hsdp_degrees(world_size // tensor_parallel, devices_per_node // tensor_parallel,
                                       replicate_degree, shard_degree)
        return replace(degrees, tensor_parallel=tensor_parallel)

    @property
    def world_size(self) -> int:
        """Ranks of the job (of one replica group under ``ft_hsdp``)."""
        return self.replicate * self.shard * self.tensor_parallel

    @property
    def data_parallel_size(self) -> int:
        """Distinct batches the job's ranks train per step: the ranks of one TP group share theirs."""
        return self.replicate * self.shard

    def data_parallel_rank(self, global_rank: int) -> int:
        """``global_rank``'s data-parallel index in its job (row-major mesh, tensor-parallel dim last)."""
        return global_rank // self.tensor_parallel

    @property
    def data_shards(self) -> int:
        """Shards the data is split into: every replica group's data-parallel ranks."""
        return self.data_parallel_size * self.replica_groups

    def data_shard(self, global_rank: int, replica_group_id: int = 0) -> int:
        """The shard ``global_rank`` of replica group ``replica_group_id`` trains (torchft's sampler layout:
        ``group_rank + group_size * replica_group_id``)."""
        return self.data_parallel_rank(global_rank) + self.data_parallel_size * replica_group_id

    def sampler_kwargs(self, global_rank: int, replica_group_id: int = 0) -> dict[str, int]:
        """``DistributedSampler``'s ``num_replicas`` and ``rank`` for ``global_rank``: one layout of the
        data for every strategy (the ranks of a TP group share a shard)."""
        return {"num_replicas": self.data_shards, "rank": self.data_shard(global_rank, replica_group_id)}

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        tp = (self.tensor_parallel,) if self.tensor_parallel > 1 else ()
        return (self.replicate, self.shard, *tp) if self.hybrid else (self.shard, *tp)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        tp = (TENSOR_PARALLEL,) if self.tensor_parallel > 1 else ()
        return ("replicate", "shard", *tp) if self.hybrid else ("shard", *tp)


#: The HSDP degrees' former name (``replicate``, ``shard``), kept for code that imports it.
HSDPDegrees = ParallelDims


def check_torchrun_layout(num_nodes: int, devices: int, what: str) -> None:
    """Under torchrun, ``num_nodes`` x ``devices`` must be torchrun's nodes x ranks per node, not just their
    product.

    Lightning checks only the product against ``WORLD_SIZE``. A layout derived from the Trainer's
    split (``what``: HSDP's ``auto`` shard groups, hierarchical SGD's node level) would otherwise group
    ranks of different nodes silently, e.g. ``num_nodes=1, devices=4`` under two agents of 2 ranks.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    nodes, per_node = os.environ.get("GROUP_WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if nodes and per_node and (int(nodes), int(per_node)) != (num_nodes, devices):
        raise OptionError(
            f"trainer num_nodes={num_nodes} x devices={devices} "
            f"does not match torchrun's {nodes} node(s) x {per_node} "
            f"rank(s) per node (GROUP_WORLD_SIZE, LOCAL_WORLD_SIZE): {what} would group ranks across nodes. "
            f"Fix: set trainer.num_nodes={nodes} and trainer.devices={per_node}."
        )


def resolve_hsdp_degrees(
    world_size: int,
    devices_per_node: int,
    replicate_degree: int | str | None = "auto",
    shard_degree: int | str | None = "auto",
) -> HSDPDegrees:
    """Fill in ``"auto"`` degrees (shard within a node, replicate across nodes) and check the product.

    The error names both options, their values, the world size and a working choice.
    """
    auto_r = replicate_degree in (None, "auto")
    auto_s = shard_degree in (None, "auto")
    if auto_r and auto_s:
        shard = devices_per_node
        replicate = world_size // shard if shard and world_size % shard == 0 else 0
    elif auto_r:
        shard = int(shard_degree)  # type: ignore[arg-type]
        replicate = world_size // shard if world_size % shard == 0 else 0
    elif auto_s:
        replicate = int(replicate_degree)  # type: ignore[arg-type]
        shard = world_size // replicate if world_size % replicate == 0 else 0
    else:
        replicate, shard = int(replicate_degree), int(shard_degree)  # type: ignore[arg-type]
    if replicate < 1 or shard < 1 or replicate * shard != world_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise OptionError(
            f"replicate_degree={replicate_degree!r} x shard_degree={shard_degree!r} does not match the "
            f"world size {world_size} (nodes x devices). Fix: choose shard_degree from {divisors} and "
            f"replicate_degree = {world_size} // shard_degree, or leave both 'auto' "
            f"(shard within a node of {devices_per_node} devices, replicate across nodes)."
        )
    return ParallelDims(replicate=replicate, shard=shard)


def check_tensor_parallel_degree(degree: int, world_size: int | None = None,
                                 devices_per_node: int | None = None) -> None:
    """The tensor-parallel degree is a positive integer (checked alone at the strategy's ``__init__``) that
    divides the ranks of a node (TP stays inside a node) and the world size, once they are known."""
    check_int("tensor_parallel_degree", degree, 1,
              fix="1 (no tensor parallelism) or the number of ranks of a node that split each layer, e.g. 2.")
    if world_size is None or devices_per_node is None:
        return
    if degree > 1 and (devices_per_node % degree or world_size % degree):
        choices = [d for d in range(1, devices_per_node + 1) if devices_per_node % d == 0]
        raise OptionError(
            f"tensor_parallel_degree={degree} does not divide "
            f"the {devices_per_node} devices per node (world size "
            f"{world_size}): a tensor-parallel group must sit "
            "inside one node, where its per-layer collectives run "
            f"on the fast links. Fix: choose tensor_parallel_degree from {choices}."
        )


def build_mesh(device: torch.device, dims: ParallelDims) -> DeviceMesh:
    """The FSDP (1-D) or HSDP (2-D) mesh of ``dims``, plus a last ``tensor_parallel`` dim when TP is on.

    Every mesh answers to ``"data_parallel"``; see the module docstring."""
    # what init_device_mesh does (ranks row-major over the shape), with the class that also answers to
    # "data_parallel"; the mesh tensor is built on the CPU whatever the default device is
    shape = dims.mesh_shape
    ranks = torch.arange(math.prod(shape), dtype=torch.int, device="cpu").view(shape)
    return DataParallelNamedMesh(device.type, ranks, mesh_dim_names=dims.mesh_dim_names)
