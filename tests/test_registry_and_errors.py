"""Registration and early, clear errors (no process group is created in these tests)."""

from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import fsdp_strategies
from conftest import as_torchrun_rank0
from fsdp_strategies import FSDP2Strategy, HSDPStrategy
from fsdp_strategies.parallel.blocks import BlockNotFoundError, find_transformer_blocks
from fsdp_strategies.parallel.mesh import ParallelDims, resolve_hsdp_degrees

README = Path(__file__).resolve().parents[1] / "README.md"
BUILT_IN = {"ddp", "ddp_spawn", "fsdp", "deepspeed", "single_device", "xla"}


def test_names_registered_without_shadowing_and_documented() -> None:
    # the README's table of names: its rows, `name` | `fsdp_strategies.Class` | ...
    rows = dict(re.findall(r"^\| `([a-z0-9_]+)` \| `fsdp_strategies\.(\w+)` \|", README.read_text(), re.M))
    assert set(rows) == set(fsdp_strategies.STRATEGY_NAMES), f"README's table lists {sorted(rows)}"
    for name in fsdp_strategies.STRATEGY_NAMES:
        assert name in StrategyRegistry, name
        assert StrategyRegistry[name]["strategy"].__module__.startswith("fsdp_strategies"), name
        assert name not in BUILT_IN
        assert StrategyRegistry[name]["strategy"].__name__ == rows[name], (name, rows[name])
    # Lightning's own names still resolve to Lightning's classes.
    assert StrategyRegistry["fsdp"]["strategy"].__module__.startswith("lightning")
    assert StrategyRegistry["ddp"]["strategy"].__module__.startswith("lightning")


def test_trainer_accepts_registry_names() -> None:
    trainer = pl.Trainer(strategy="fsdp2", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, FSDP2Strategy)
    trainer = pl.Trainer(strategy="hsdp", accelerator="cpu", devices=4, logger=False)
    assert isinstance(trainer.strategy, HSDPStrategy)
    assert trainer._accelerator_connector.is_distributed


def test_degrees_not_matching_world_size_fail_before_any_process_group() -> None:
    with pytest.raises(
        ValueError, match=r"replicate_degree=3 x shard_degree=2 does not match the world size 4"
    ):
        pl.Trainer(strategy=HSDPStrategy(replicate_degree=3, shard_degree=2), accelerator="cpu", devices=4,
                   logger=False)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match=r"shard_degree=0 is invalid"):
        HSDPStrategy(shard_degree=0)
    with pytest.raises(ValueError, match="shard_degree=3"):
        pl.Trainer(strategy=HSDPStrategy(shard_degree=3), accelerator="cpu", devices=4, logger=False)


def test_auto_degrees_shard_within_node_replicate_across_nodes() -> None:
    assert resolve_hsdp_degrees(16, 8) == resolve_hsdp_degrees(16, 8, "auto", 8)
    d = resolve_hsdp_degrees(16, 8)
    assert (d.replicate, d.shard) == (2, 8)
    d = resolve_hsdp_degrees(4, 4, 2, "auto")
    assert (d.replicate, d.shard) == (2, 2)


def test_one_degrees_object_derives_the_mesh_and_the_data_layout() -> None:
    # HSDP over 2 nodes x 4 devices with TP 2 inside a node: 2 replicas x 2 shards x 2 TP ranks
    dims = ParallelDims.hsdp(8, 4, "auto", "auto", tensor_parallel=2)
    assert (dims.replicate, dims.shard, dims.tensor_parallel, dims.world_size) == (2, 2, 2, 8)
    assert dims.mesh_shape == (2, 2, 2) and dims.mesh_dim_names == ("replicate", "shard", "tensor_parallel")
    assert dims.data_parallel_size == 4 and [dims.data_parallel_rank(r) for r in (0, 1, 5)] == [0, 0, 2]
    # ft_hsdp: a 4-rank group with TP 2 among 3 replica groups; rank 3 of group 2 trains shard 1 + 2 * 2
    group = ParallelDims.fsdp(4, 4, 2, replica_groups=3)
    assert group.mesh_shape == (2, 2) and group.mesh_dim_names == ("shard", "tensor_parallel")
    assert group.sampler_kwargs(3, replica_group_id=2) == {"num_replicas": 6, "rank": 5}
    assert ParallelDims.fsdp(4, 4).sampler_kwargs(3) == {"num_replicas": 4, "rank": 3}
    with pytest.raises(ValueError, match=r"tensor_parallel_degree=3 does not divide the 4 devices"):
        ParallelDims.fsdp(4, 4, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_degree=0 is invalid\. Fix: 1 \(no tensor"):
        ParallelDims.hsdp(4, 4, tensor_parallel=0)
    # the strategies read it: their sampler layout is the object's
    trainer = pl.Trainer(accelerator="cpu", devices=4, logger=False,
                         strategy=HSDPStrategy(shard_degree=1, tensor_parallel_degree=2))
    strategy = trainer.strategy
    assert isinstance(strategy, HSDPStrategy) and strategy.distributed_sampler_kwargs == {"num_replicas": 2,
                                                                                            "rank": 0}
    assert strategy._mesh_degrees() == ParallelDims(2, 1, 2)


def test_unsupported_precision_is_rejected_early() -> None:
    with pytest.raises(
        ValueError, match=r"precision='64-true' is not supported by the fsdp2 strategy.*bf16-mixed"
    ):
        pl.Trainer(strategy="fsdp2", accelerator="cpu", devices=2, precision="64-true", logger=False)
    assert not torch.distributed.is_initialized()


def test_bad_options_name_option_value_and_fix() -> None:
    with pytest.raises(ValueError, match=r"reshard_after_forward=0 is invalid"):
        FSDP2Strategy(reshard_after_forward=0)
    with pytest.raises(ValueError, match=r"forward_prefetch=-1 is invalid"):
        FSDP2Strategy(forward_prefetch=-1)
    with pytest.raises(ValueError, match=r"param_dtype='bf17'.*Fix"):
        FSDP2Strategy(param_dtype="bf17")
    for cls in (FSDP2Strategy, HSDPStrategy):
        message = "accumulation='zero' is invalid. Fix: one of ['sharded', 'no_sync']"
        with pytest.raises(ValueError, match=re.escape(message)):
            cls(accumulation="zero")
    assert HSDPStrategy().accumulation == "sharded"
    # ft_hsdp takes both (across groups: one all-reduce per optimizer step either way), sharded by default
    ft = {"lighthouse_addr": "http://localhost:1", "replica_group_id": 0, "num_replica_groups": 2}
    with pytest.raises(ValueError, match=r"accumulation='gather' is invalid.*Fix"):
        fsdp_strategies.FTHSDPStrategy(accumulation="gather", **ft)  # type: ignore[arg-type]
    assert fsdp_strategies.FTHSDPStrategy(**ft).accumulation == "sharded"
    assert fsdp_strategies.FTHSDPStrategy(accumulation="no_sync", **ft).accumulation == "no_sync"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block(), Block()])
        self.head = nn.Linear(4, 1)


def test_unknown_block_class_fails_at_fit_before_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 0 of a 2-rank torchrun job: Lightning's own launcher would start a rank 1 that re-runs this pytest
    # session
    as_torchrun_rank0(monkeypatch, world_size=2, local_world_size=2)
    trainer = pl.Trainer(strategy=FSDP2Strategy(block_class_names=["TransformerBlock"]), accelerator="cpu",
                         devices=2, logger=False)
    assert trainer.strategy.cluster_environment.creates_processes_externally  # no child process is started
    with pytest.raises(
        BlockNotFoundError, match=r"block_class_names=\['TransformerBlock'\] matches no submodule.*'Block'"
    ):
        trainer.fit(Plain())
    assert not torch.distributed.is_initialized()


def test_block_heuristic_and_class_names() -> None:
    model = Plain()
    assert find_transformer_blocks(model) == list(model.layers)
    assert find_transformer_blocks(model, ["Block"]) == list(model.layers)
    assert find_transformer_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []  # no repeated class
