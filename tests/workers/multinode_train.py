"""Worker of ``tests/test_multinode.py`` (and the Lightning-range smoke): the example's LightningCLI with a
probe.

The arguments are one or more LightningCLI argument lists separated by ``::``; each runs as one
``fit`` in the same processes, one after the other (the second reuses the process group, so one
launch of the simulated two-node job checks two strategies). For every fit the probe writes
``$MN_OUT/<fit index>_rank<global rank>.json``: what torchrun and Lightning say about the
topology, the mesh / averaging groups the strategy built (as global ranks), and after every step a
digest of this rank's parameters. ``MN_AGENT`` (set per agent by the test) names the simulated node.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.cli import LightningCLI

import fsdp_strategies
from llama import LlamaLM, MarkovDataModule

ENV_KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
            "ROLE_WORLD_SIZE", "MN_AGENT", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS")


def _ranks(group: Any) -> list[int]:
    return (
        sorted(dist.get_process_group_ranks(group))
        if group is not None
        else list(range(dist.get_world_size()))
    )


def _digest(module: torch.nn.Module) -> str:
    """This rank's parameters (its shards under FSDP2), as bytes."""
    h = hashlib.sha1()
    for _, p in sorted(module.named_parameters()):
        local = p.to_local() if hasattr(p, "to_local") else p
        h.update(local.detach().contiguous().float().numpy().tobytes())
    return h.hexdigest()[:16]


class MultinodeProbe(pl.Callback):
    def __init__(self, index: int) -> None:
        self.index = index
        self.record: dict[str, Any] = {"steps": []}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        rec = self.record
        rec["env"] = {k: os.environ.get(k) for k in ENV_KEYS}
        rec["lightning"] = {"global_rank": trainer.global_rank, "local_rank": trainer.local_rank,
                            "node_rank": trainer.node_rank, "world_size": trainer.world_size,
                            "num_nodes": trainer.num_nodes, "num_devices": trainer.num_devices,
                            "cluster_environment": type(strategy.cluster_environment).__name__}
        rec["strategy"] = type(strategy).__name__
        if isinstance(strategy, fsdp_strategies.FTHSDPStrategy | fsdp_strategies.HSDPStrategy):
            mesh = strategy.device_mesh
            names = list(mesh.mesh_dim_names or ())
            rec["mesh"] = {"names": names, "shape": list(mesh.shape),
                           "groups": {name: _ranks(mesh.get_group(name)) for name in names}}
            param = next(pl_module.parameters())
            rec["param"] = {
                "placements": [str(p) for p in param.placements],
                "local": list(param.to_local().shape),
                "full": list(param.shape),
            }
        if isinstance(strategy, fsdp_strategies.DDPHooksStrategy):
            rec["hierarchy_levels"] = {str(k): v for k, v in (strategy.hierarchy_levels or {}).items()}
            rec["local_group_size"] = strategy.local_group_size
            # torch's PostLocalSGDOptimizer.averager
            averager = getattr(trainer.optimizers[0], "averager", None)
            groups = getattr(averager, "period_process_group_dict", {})  # torch's HierarchicalModelAverager
            rec["averager_groups"] = {str(period): _ranks(group) for period, group in groups.items()}
        if isinstance(strategy, fsdp_strategies.FTHSDPStrategy):
            rec["replica_group_id"] = strategy.replica_group_id
            rec["num_replica_groups"] = strategy.num_replica_groups

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step: dict[str, Any] = {"global_step": trainer.global_step, "params": _digest(pl_module),
                                "loss": float(outputs["loss"]) if isinstance(outputs, dict) else None}
        strategy = trainer.strategy
        if isinstance(strategy, fsdp_strategies.FTHSDPStrategy):
            step["committed"] = strategy.last_step_committed
            step["participants"] = int(strategy.manager.num_participants())
        self.record["steps"].append(step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        out = Path(os.environ["MN_OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{self.index}_rank{trainer.global_rank}.json").write_text(json.dumps(self.record))


def main(argv: list[str]) -> None:
    expected = os.environ.get("FSDP_STRATEGIES_EXPECT_LIGHTNING")  # set by `make test-lightning-range`
    if expected and lightning.__version__ != expected:
        raise SystemExit(
            f"multinode_train.py: expected lightning {expected}, imported {lightning.__version__} "
            f"({lightning.__file__})"
        )
    fits: list[list[str]] = [[]]
    for arg in argv:
        if arg == "::":
            fits.append([])
        else:
            fits[-1].append(arg)
    sys.argv = sys.argv[:1]  # the arguments go in through ``args``
    for index, args in enumerate(fits):
        # no config.yaml written to the working directory (the repository root)
        LightningCLI(LlamaLM, MarkovDataModule, args=args,
                     trainer_defaults={"callbacks": [MultinodeProbe(index)]}, save_config_callback=None)
    if dist.is_initialized():  # as examples/train_llama.py: no gloo subgroups left to interpreter exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
