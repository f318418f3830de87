"""Device-mesh degrees: validated before any process group exists, built after.

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

import os
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from fsdp_strategies._options import OptionError

__all__ = ["DATA_PARALLEL", "TENSOR_PARALLEL", "DataParallelNamedMesh", "HSDPDegrees", "build_mesh",
           "check_tensor_parallel_degree", "check_torchrun_layout", "resolve_hsdp_degrees"]

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
                f"device_mesh[{names!r}]: this strategy has no tensor-parallel dim (its mesh is {dims}). Fix: set "
                "the strategy's tensor_parallel_degree (e.g. 2), or shard with device_mesh['data_parallel'] only."
            )
        return super().__getitem__(names)


@dataclass(frozen=True)
class HSDPDegrees:
    replicate: int
    shard: int


def check_torchrun_layout(num_nodes: int, devices: int, what: str) -> None:
    """Under torchrun, ``num_nodes`` x ``devices`` must be torchrun's nodes x ranks per node, not just their product.

    Lightning checks only the product against ``WORLD_SIZE``. A layout derived from the Trainer's
    split (``what``: HSDP's ``auto`` shard groups, hierarchical SGD's node level) would otherwise group
    ranks of different nodes silently, e.g. ``num_nodes=1, devices=4`` under two agents of 2 ranks.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    nodes, per_node = os.environ.get("GROUP_WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if nodes and per_node and (int(nodes), int(per_node)) != (num_nodes, devices):
        raise OptionError(
            f"trainer num_nodes={num_nodes} x devices={devices} does not match torchrun's {nodes} node(s) x {per_node} "
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
    return HSDPDegrees(replicate=replicate, shard=shard)


def check_tensor_parallel_degree(degree: int, world_size: int, devices_per_node: int) -> None:
    """The tensor-parallel degree divides the ranks of a node (TP stays inside a node) and the world size."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise OptionError(f"tensor_parallel_degree={degree!r} is not a positive integer. Fix: 1 (no tensor "
                         "parallelism) or the number of ranks of a node that split each layer, e.g. 2.")
    if degree > 1 and (devices_per_node % degree or world_size % degree):
        choices = [d for d in range(1, devices_per_node + 1) if devices_per_node % d == 0]
        raise OptionError(
            f"tensor_parallel_degree={degree} does not divide the {devices_per_node} devices per node (world size "
            f"{world_size}): a tensor-parallel group must sit inside one node, where its per-layer collectives run "
            f"on the fast links. Fix: choose tensor_parallel_degree from {choices}.")


def build_mesh(device: torch.device, degrees: HSDPDegrees | None, world_size: int,
               tensor_parallel: int = 1) -> DeviceMesh:
    """The FSDP (1-D) or HSDP (2-D) mesh, plus a last ``tensor_parallel`` dim when ``tensor_parallel > 1``.

    Every mesh answers to ``"data_parallel"``; see the module docstring."""
    tp = (tensor_parallel,) if tensor_parallel > 1 else ()
    tp_names = (TENSOR_PARALLEL,) if tensor_parallel > 1 else ()
    if degrees is None:
        shape, names = (world_size // tensor_parallel, *tp), ("shard", *tp_names)
    else:
        shape, names = (degrees.replicate, degrees.shard, *tp), ("replicate", "shard", *tp_names)
    # what init_device_mesh does (ranks row-major over the shape), with the class that also answers to
    # "data_parallel"; the mesh tensor is built on the CPU whatever the default device is
    ranks = torch.arange(world_size, dtype=torch.int, device="cpu").view(shape)
    return DataParallelNamedMesh(device.type, ranks, mesh_dim_names=names)
