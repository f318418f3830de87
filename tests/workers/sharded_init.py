"""Worker for tests/test_sharded_init.py: models built on the meta device, sharded, then materialised.

    python -m torch.distributed.run --nproc_per_node 2 sharded_init.py OUT

Each rank writes ``OUT/rank<R>.pt``: for every case, the full tensors of the materialised sharded model
(``full_tensor``), this rank's local shards, and the same model built eagerly with the same seed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdp_strategies.hf.materialize import materialize

SEED = 1234


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
        self.emb = nn.Embedding(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.emb(x))))


def _tp(model: nn.Module, mesh: object) -> None:
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _fsdp(model: nn.Module, mesh: object) -> None:
    fully_shard(model, mesh=mesh)


def _hf(model: nn.Module, mesh: object) -> None:
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _build(case: str) -> nn.Module:
    if case != "hf_llama_fsdp":
        return Mlp()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


CASES = {"tp_colwise_rowwise": ((2,), _tp), "fsdp": ((2,), _fsdp), "replicate_x_shard": ((2, 1), _fsdp),
         "hf_llama_fsdp": ((2,), _hf)}


def main() -> None:
    dist.init_process_group("gloo")
    out: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for case, (shape, shard) in CASES.items():
        torch.manual_seed(SEED)
        eager = _build(case)
        with torch.device("meta"):
            model = _build(case)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        shard(model, mesh)
        torch.manual_seed(SEED)
        materialize(model, torch.device("cpu"))
        params = dict(model.named_parameters())
        out[case] = {
            "full": {k: v.full_tensor() if isinstance(v, DTensor) else v.detach() for k, v in params.items()},
            "local": {k: v.to_local().clone() for k, v in params.items() if isinstance(v, DTensor)},
            "eager": {k: v.detach() for k, v in eager.named_parameters()},
        }
    torch.save(out, Path(sys.argv[1]) / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
