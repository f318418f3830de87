"""Models and a worker for the activation-memory tests (``budget`` checkpointing, offload).

Importable (``build``, ``loss_of``, ``run_variant``) for the in-process tests; as a torchrun script it runs
every variant under FSDP2 on the ranks it is started with and writes ``OUT/rank<R>.json``:

    torchrun --nproc_per_node 2 memory_fsdp.py --out DIR [--models example_llama,hf_llama,hf_qwen2] \\
        [--steps 3]

Each variant starts from the same weights (seeded build) and sees the same rank-dependent batches; per step it
records the loss, the bytes the forward left alive for backward (``SavedBytes``, weights excluded; on CPU that
includes offload's host copies), the bytes offload moved to the host and, after the first backward, a checksum
of this rank's gradient shards. ``budget`` variants also record the planner's
report. The models are ones nobody here wrote (Hugging Face Llama and Qwen2 from tiny random configs) and the
example's Llama.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]

from fsdp_strategies.memory import BudgetPlanner, SavedBytes, apply_activation_offload  # noqa: E402
from fsdp_strategies.parallel.activation_checkpointing import apply_activation_checkpointing  # noqa: E402

VOCAB, SEQ, DIM, HEADS, FFN, LAYERS, BATCH = 128, 64, 64, 4, 256, 3, 2

#: label -> (checkpointing mode or None, memory budget, offload)
VARIANTS: dict[str, tuple[str | None, float | None, bool]] = {
    "none": (None, None, False),
    "full": ("full", None, False),
    "selective_op": ("selective_op", None, False),
    "selective_layer": ("selective_layer", None, False),
    "budget_0.25": ("budget", 0.25, False),
    "budget_0.5": ("budget", 0.5, False),
    "budget_0.75": ("budget", 0.75, False),
    "offload": (None, None, True),
    "offload_full": ("full", None, True),
    "offload_selective_op": ("selective_op", None, True),
    "offload_selective_layer": ("selective_layer", None, True),
    "offload_budget_0.5": ("budget", 0.5, True),
}


def build(name: str) -> nn.Module:
    """The model ``name`` with weights from seed 0 (the same on every rank and in every variant)."""
    torch.manual_seed(0)
    if name == "example_llama":
        from llama import Llama

        return Llama(VOCAB, DIM, LAYERS, HEADS, 2, FFN, SEQ)
    if name == "hf_llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN,
                             num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=SEQ,
                             use_cache=False)
        return LlamaForCausalLM(config)
    if name == "hf_qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN,
                             num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=SEQ,
                             use_cache=False)
        return Qwen2ForCausalLM(config)
    raise ValueError(name)


def loss_of(name: str, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    if name == "example_llama":
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    return model(input_ids=tokens, labels=tokens).loss


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def prepare(
    name: str, label: str, agree: Any = None, offload_min_bytes: int = 0
) -> tuple[nn.Module, BudgetPlanner | None]:
    mode, budget, offload = VARIANTS[label]
    model = build(name)
    if mode is not None:
        apply_activation_checkpointing(model, mode)  # type: ignore[arg-type]
    if offload:
        apply_activation_offload(model, min_bytes=offload_min_bytes)
    planner = BudgetPlanner(model, budget, agree=agree) if mode == "budget" else None
    return model, planner


def step(
    name: str, model: nn.Module, planner: BudgetPlanner | None, tokens: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """One forward (the planner around it), the bytes it left alive for backward, then backward."""
    from fsdp_strategies.memory.saved_bytes import plain_tensors, storage_key

    # DTensor: local shard
    weights = {storage_key(t) for t in plain_tensors([*model.parameters(), *model.buffers()])}
    kept = SavedBytes()
    with kept, planner.forward() if planner is not None else contextlib.nullcontext():
        loss = loss_of(name, model, tokens)
    alive = kept.alive(weights)
    loss.backward()
    return loss.detach(), alive


def _grad_checksum(model: nn.Module) -> list[float]:
    from torch.distributed.tensor import DTensor

    total, absolute = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            total += g.double().sum()
            absolute += g.double().abs().sum()
    return [float(total), float(absolute)]


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_strategies.parallel.blocks import find_transformer_blocks

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="example_llama,hf_llama,hf_qwen2")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def agree(result: Any) -> Any:
        box = [result]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    record: dict[str, Any] = {"rank": rank, "world": world, "runs": {}}
    for name in args.models.split(","):
        for label in args.variants.split(","):
            model, planner = prepare(name, label, agree=agree)
            for block in find_transformer_blocks(model):
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            # applied already: its counters
            stats = apply_activation_offload(model) if VARIANTS[label][2] else None
            run: dict[str, Any] = {"losses": [], "kept": [], "offloaded": []}
            for i in range(args.steps):
                before = stats.bytes if stats is not None else 0
                loss, alive = step(name, model, planner, batch(i, rank))
                run["losses"].append(float(loss))
                run["kept"].append(alive)
                run["offloaded"].append((stats.bytes if stats is not None else 0) - before)
                if i == 0:
                    run["grad_checksum"] = _grad_checksum(model)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if planner is not None:
                run["budget"] = planner.report()
            record["runs"][f"{name}/{label}"] = run
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
