"""Worker for the tensor-parallel tests: a model nobody here wrote, a few steps, every rank's facts as JSON.

    python tp_train.py --model hf_llama --strategy fsdp2 --tp 2 --devices 4 --out DIR [--steps 3] [--clip 1.0]
        [--save-at 3,6 --ckpt-dir D] [--resume CKPT] [--full-file] [--accumulate 2] [--precision bf16-mixed]
        [--ac full|selective_op|budget [--memory-budget F]] [--compile] [--mfu]

Models come from the real-models matrix (tests/matrix/models.py; HF models built in ``__init__`` from tiny
random configs with the same seed everywhere, so every strategy starts from the same weights). Each rank
writes ``DIR/rank<R>.json``: its data-parallel rank, its losses, and for every parameter the DTensor
placements, mesh dims and local/global element counts; the global step after each loss; with ``--mfu`` the
FLOPs per batch the ``MFUMonitor`` counted on this rank. ``--save-at`` writes ``D/step<N>`` (a sharded folder,
or one file with ``--full-file``) after optimizer step N; ``--resume`` starts from a checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import fsdp_strategies  # noqa: F401
from fsdp_strategies import FSDP2Strategy, HSDPStrategy, _torch_seam
from matrix.models import MODELS


class Probe(pl.Callback):
    def __init__(self, out: Path, save_at: tuple[int, ...] = (), ckpt_dir: Path | None = None) -> None:
        self.out, self.losses, self.steps = out, [], []
        self.save_at, self.ckpt_dir = save_at, ckpt_dir

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        self.steps.append(trainer.global_step)
        if trainer.global_step in self.save_at and trainer.global_step not in self.steps[:-1]:
            assert self.ckpt_dir is not None
            trainer.save_checkpoint(self.ckpt_dir / f"step{trainer.global_step}")
            # the trained module's logits on a fixed batch (every rank: collectives). The FSDP root is the
            # LightningModule: its own parameters (embedding, head, norm) are gathered by hand around the call
            pl_module.unshard()
            with torch.no_grad():
                logits = pl_module.model(input_ids=LOGITS_BATCH).logits
            pl_module.reshard()
            if trainer.global_rank == 0:
                torch.save(logits, self.ckpt_dir / f"logits_step{trainer.global_step}.pt")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        params = {}
        for name, p in pl_module.named_parameters():
            if isinstance(p, DTensor):
                params[name] = {"placements": [str(x) for x in p.placements],
                                "mesh": list(p.device_mesh.mesh_dim_names),
                                "local": p.to_local().numel(), "global": p.numel()}
            else:
                params[name] = {"placements": None, "mesh": None, "local": p.numel(), "global": p.numel()}
        kwargs = (
            trainer.strategy.distributed_sampler_kwargs
            if hasattr(trainer.strategy, "distributed_sampler_kwargs")
            else {}
        )
        record = {"rank": trainer.global_rank, "dp_rank": (kwargs or {}).get("rank", trainer.global_rank),
                  "losses": self.losses, "steps": self.steps, "params": params,
                  "compiled": sum(_torch_seam.is_compiled_module(m) for m in pl_module.modules())}
        inner = getattr(pl_module, "model", None)
        if hasattr(inner, "lm_head") and hasattr(inner, "get_input_embeddings"):
            record["tied"] = inner.lm_head.weight is inner.get_input_embeddings().weight
        from fsdp_strategies.callbacks import ActivationCheckpointing, MFUMonitor

        ac = next((c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)), None)
        if ac is not None and ac.budget_report:
            record["budget"] = ac.budget_report

        mfu = next((c for c in trainer.callbacks if isinstance(c, MFUMonitor)), None)
        if mfu is not None and mfu.flops is not None:
            record["flops"] = {"model": mfu.flops.model, "hardware": mfu.flops.hardware,
                               "samples": mfu._counted_samples, "credited_samples": mfu._total.samples,
                               "credited_tokens": mfu._total.tokens, "measured_steps": mfu._total.steps}
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


#: ``--save-at`` also writes the module's logits on these tokens (HF causal LMs), to compare exports with
LOGITS_BATCH = torch.arange(32).reshape(2, 16) * 7 % 128

#: the example's own plan, as a user writes it for tp_plan (module globs of the LightningModule)
EXAMPLE_PLAN = {"model.layers.*.attention.wq": "colwise", "model.layers.*.attention.wk": "colwise",
                "model.layers.*.attention.wv": "colwise", "model.layers.*.attention.wo": "rowwise",
                "model.layers.*.mlp.w1": "colwise", "model.layers.*.mlp.w3": "colwise",
                "model.layers.*.mlp.w2": "rowwise", "model.embed": "embedding_rowwise",
                "model.head": "colwise_gather_output"}


class OwnPlanLM(pl.LightningModule):
    """A ``configure_model`` written for Lightning's ``ModelParallelStrategy``: it applies its own TP plan
    with ``parallelize_module`` on ``device_mesh["tensor_parallel"]``, then ``fully_shard`` on
    ``["data_parallel"]``."""

    def __init__(self) -> None:
        super().__init__()
        from matrix.models import _example_llama

        self.inner = _example_llama()
        # built and initialised here (same weights everywhere); configure_model shards
        self.inner.configure_model()

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for block in self.inner.model.layers:
            parallelize_module(block, tp,
                               {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                                           "attention.wv": ColwiseParallel(),
                                           "attention.wo": RowwiseParallel(),
                                           "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
                                           "mlp.w2": RowwiseParallel()})
            fully_shard(block, mesh=dp)
        fully_shard(self.inner.model, mesh=dp)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.inner._loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def tied_llama() -> pl.LightningModule:
    """The matrix's HF Llama with its LM head tied to the embedding (one tensor, vocab-parallel in both
    roles)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from matrix.models import DIM, FFN, HEADS, LAYERS, VOCAB, HFCausalLM

    return HFCausalLM(lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="hf_llama")
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="per data-parallel rank")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument(
        "--plan", default=None, help="a JSON dict plan, 'example' (EXAMPLE_PLAN); default: auto"
    )
    parser.add_argument(
        "--save-at", default="", help="comma-separated optimizer steps to save a checkpoint after"
    )
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from (ckpt_path)")
    parser.add_argument("--full-file", action="store_true", help="fsdp2: save_distributed_checkpoint=False")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--ac", default=None, help="ActivationCheckpointing mode (full, selective_op, ...)")
    parser.add_argument("--memory-budget", type=float, default=None, help="with --ac budget")
    parser.add_argument("--compile", action="store_true", help="fsdp2/hsdp: compile_blocks=True")
    parser.add_argument("--mfu", action="store_true", help="an MFUMonitor counting the first batch's FLOPs")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pl.seed_everything(0)
    spec = MODELS[{"own_plan": "example_llama", "hf_llama_tied": "hf_llama"}.get(args.model, args.model)]
    module = (
        OwnPlanLM()
        if args.model == "own_plan"
        else tied_llama()
        if args.model == "hf_llama_tied"
        else spec.build()
    )
    plan = EXAMPLE_PLAN if args.plan == "example" else json.loads(args.plan) if args.plan else "auto"
    if args.strategy == "fsdp2":
        strategy: Any = FSDP2Strategy(tensor_parallel_degree=args.tp, tp_plan=plan,
                                      compile_blocks=args.compile,
                                      save_distributed_checkpoint=not args.full_file)
    elif args.strategy == "lightning_mp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(
            data_parallel_size=args.devices // args.tp, tensor_parallel_size=args.tp
        )
    elif args.strategy == "hsdp":
        strategy = HSDPStrategy(replicate_degree=1, tensor_parallel_degree=args.tp, tp_plan=plan,
                                compile_blocks=args.compile)
    else:
        strategy = args.strategy
    save_at = tuple(int(s) for s in args.save_at.split(",") if s)
    callbacks: list[pl.Callback] = [
        Probe(Path(args.out), save_at, Path(args.ckpt_dir) if args.ckpt_dir else None)
    ]
    if args.ac:
        from fsdp_strategies.callbacks import ActivationCheckpointing

        callbacks.append(ActivationCheckpointing(mode=args.ac, memory_budget=args.memory_budget))
    if args.mfu:
        from fsdp_strategies.callbacks import MFUMonitor

        callbacks.append(MFUMonitor(window=1, warmup_steps=1, peak_flops=1e12, prog_bar=False))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, gradient_clip_val=args.clip, callbacks=callbacks,
                         accumulate_grad_batches=args.accumulate, precision=args.precision)
    loader = DataLoader(spec.dataset(), batch_size=args.batch, shuffle=False)
    trainer.fit(module, loader, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
