"""``fsdp_strategies.parallel.parallelize`` outside Lightning: tensor parallelism -> checkpoint -> compile ->
shard on one module.

One process (gloo, world size 1, a file store): the composed model must compute exactly what the plain
model computes (loss and gradients), with every transform applied once and ``state_dict`` keys unchanged;
tensor parallelism also on two ranks (the planned layers split across them). The multi-rank behaviour is
covered through the strategies (tests/test_fsdp_hsdp.py, tests/test_tensor_parallel.py) and the benchmarks'
plain-torch FSDP2 loop (tests/test_benchmarks.py), which call the same function.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from fsdp_strategies import _torch_seam
from fsdp_strategies.parallel import parallelize
from fsdp_strategies.parallel.activation_checkpointing import is_checkpointed


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.layers = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


@pytest.mark.parametrize("mode", ["full", "selective_op"])
def test_parallelize_applies_checkpoint_compile_shard_once_and_computes_the_same(
    mode: str, tmp_path: Path
) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = Net()
        model = copy.deepcopy(plain)
        keys = list(model.state_dict())
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        stacks = parallelize(model, mesh, ac={"mode": mode}, compile_blocks=True,
                             compile_options={"backend": "eager"})
        assert [len(s.blocks) for s in stacks] == [2]
        for block in model.layers:
            assert (
                is_checkpointed(block)
                and _torch_seam.is_compiled_module(block)
                and isinstance(block, FSDPModule)
            )
        assert isinstance(model, FSDPModule)
        parallelize(model, mesh, ac={"mode": mode}, compile_blocks=True)  # idempotent: nothing applied twice

        x = torch.randn(3, 4)
        plain(x).pow(2).sum().backward()
        model(x).pow(2).sum().backward()
        assert list(model.state_dict()) == keys  # nothing replaced: the same names
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            assert torch.allclose(p.grad, q.grad.full_tensor(), atol=1e-6), name
    finally:
        dist.destroy_process_group()


class ScaledNet(Net):
    """Net with 0-d parameters: a learned temperature at the root and a 0-d gate in the first block."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.layers[0].gate = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * self.layers[0].gate) * self.temperature


def test_parallelize_keeps_0d_params_whole_and_hooks_their_gradients(tmp_path: Path) -> None:
    # fully_shard alone raises "fully_shard doesn't support scalar parameters"; parallelize leaves them whole
    from fsdp_strategies.parallel.replicated_params import replicated_params, set_all_reduce_hook

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = ScaledNet()
        model = copy.deepcopy(plain)
        keys = list(model.state_dict())
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        parallelize(model, mesh)
        parallelize(model, mesh)  # idempotent
        assert isinstance(model, FSDPModule) and isinstance(model.layers[0], FSDPModule)
        assert type(model.temperature) is nn.Parameter and type(model.layers[0].gate) is nn.Parameter
        replicated = replicated_params(model)
        assert replicated is not None and sorted(replicated.names) == ["layers.0.gate", "temperature"]
        seen: list[float] = []
        set_all_reduce_hook(model, lambda grad: seen.append(float(grad.sum())) if grad.ndim == 0 else None)

        x = torch.randn(3, 4)
        plain(x).pow(2).sum().backward()
        model(x).pow(2).sum().backward()
        assert list(model.state_dict()) == keys
        assert sorted(seen) == sorted([float(plain.temperature.grad), float(plain.layers[0].gate.grad)])
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            got = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
            assert torch.allclose(p.grad, got, atol=1e-6), name
    finally:
        dist.destroy_process_group()


def test_cpu_offload_placement_keeps_parameters_on_cpu_and_moves_buffers() -> None:
    # FSDP2's CPUOffloadPolicy refuses parameters on the accelerator (the first GPU run: "FSDP parameters
    # should be materialized on CPU"); buffers, which FSDP2 does not manage, must still reach the compute
    # device. "meta" stands in for the accelerator here.
    from fsdp_strategies.parallel import buffers_to, parameter_device

    accel = torch.device("meta")
    assert parameter_device(accel, cpu_offload=True) == torch.device("cpu")
    assert parameter_device(accel, cpu_offload=False) == accel
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[0].register_buffer("rope", torch.ones(3), persistent=False)
    keys = set(model.state_dict())
    buffers_to(model, accel)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(b.device == accel for b in model.buffers()) and len(list(model.buffers())) == 4
    assert set(model.state_dict()) == keys and "0.rope" not in keys  # registrations (persistence) unchanged


PLAN = {"layers.*.a": "colwise", "layers.*.b": "rowwise"}


def _tp_ac_fsdp_step(rank: int, world: int, store_path: str) -> None:
    """One rank of a plain torch loop: ``parallelize(model, mesh, tp_plan=..., ac=...)`` on a
    (1, ``world``) ("shard", "tensor_parallel") mesh, then a step compared with the plain model's."""
    from torch.distributed.tensor import DTensor, Shard

    from fsdp_strategies.parallel.activation_checkpointing import apply_activation_checkpointing

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        plain = Net()
        model = copy.deepcopy(plain)
        keys = list(model.state_dict())
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("shard", "tensor_parallel"))
        seen_by_ac: list[bool] = []

        def ac(module: nn.Module) -> None:  # checkpointing sees the tensor-parallel model (the order)
            seen_by_ac.append(isinstance(module.layers[0].a.weight, DTensor))
            apply_activation_checkpointing(module, "full")

        lines: list[str] = []
        stacks = parallelize(model, mesh, tp_plan=PLAN, ac=ac, log=lines.append)
        assert seen_by_ac == [True] and [len(s.blocks) for s in stacks] == [2]
        assert "tensor parallel over" in lines[0] and "4 modules (colwise, rowwise)" in lines[0], lines
        for block in model.layers:
            assert is_checkpointed(block) and isinstance(block, FSDPModule)
            for p in (block.a.weight, block.b.weight):  # split on the TP dim, sharded by FSDP on the other
                assert p.device_mesh.mesh_dim_names == ("shard", "tensor_parallel")
                assert isinstance(p.placements[-1], Shard)
        assert model.inp.weight.device_mesh.mesh_dim_names == ("shard",)  # not planned: FSDP only
        assert isinstance(model, FSDPModule)
        parallelize(model, mesh, tp_plan=PLAN, ac=ac, log=lines.append)  # idempotent: nothing applied twice
        assert seen_by_ac == [True, True] and "not applied on top" in lines[-1]

        x = torch.randn(3, 4)
        plain(x).pow(2).sum().backward()
        model(x).pow(2).sum().backward()
        assert list(model.state_dict()) == keys
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            assert torch.allclose(p.grad, q.grad.full_tensor(), atol=1e-6), name
    finally:
        dist.destroy_process_group()


def test_a_plain_torch_loop_gets_tensor_parallel_then_checkpointing_then_fsdp(tmp_path: Path) -> None:
    _tp_ac_fsdp_step(0, 1, str(tmp_path / "store"))


@pytest.mark.multiprocess
def test_a_plain_torch_loop_on_two_ranks_splits_the_planned_layers(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_tp_ac_fsdp_step, args=(2, str(tmp_path / "store")), nprocs=2, start_method="spawn")


def test_a_tp_plan_needs_a_tensor_parallel_dim() -> None:
    from types import SimpleNamespace

    from fsdp_strategies.parallel.tensor_parallel import TensorParallelPlanError

    with pytest.raises(TensorParallelPlanError, match=r"has no 'tensor_parallel' dim\. Fix: add one"):
        parallelize(Net(), SimpleNamespace(mesh_dim_names=("shard",)), tp_plan=PLAN)
    with pytest.raises(TensorParallelPlanError, match="no data-parallel dim for FSDP"):
        parallelize(Net(), SimpleNamespace(mesh_dim_names=("tensor_parallel",)), tp_plan=PLAN)
