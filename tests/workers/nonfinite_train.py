"""Worker for tests/test_nonfinite_guard.py: a NaN loss on one rank at chosen steps, with ``NonFiniteGuard``.

    torchrun --nproc_per_node=2 nonfinite_train.py --strategy fsdp2 --nan-steps 3 --nan-rank 1 --out OUT

Trains the example Llama (its AdamW + warm-up/cosine LambdaLR, stepped every optimizer step). At each step
in ``--nan-steps`` rank ``--nan-rank`` multiplies its loss by NaN (its gradients become NaN; the other ranks'
stay finite). Every rank snapshots its local parameters (shards), optimizer state and the scheduler's
position at the start of each such step and compares them at its end; it writes ``OUT.rank<r>.json`` with
those comparisons, the guard's counters and whether every parameter is finite at the end. ``--no-guard``
runs without the callback (what the guard prevents).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from fsdp_strategies import DDPHooksStrategy, FSDP2Strategy, HSDPStrategy
from fsdp_strategies.callbacks import NonFiniteGuard
from llama import LlamaLM, MarkovDataModule

MODEL = {
    "vocab_size": 64,
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "max_seq_len": 32,
    "lr": 1e-2,
    "warmup_steps": 2,
}


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


class NaNAt(LlamaLM):
    """The example module; one rank's loss is NaN at the given steps (a bad batch on one rank)."""

    def __init__(self, nan_steps: list[int], nan_rank: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nan_steps, self.nan_rank = set(nan_steps), nan_rank

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step in self.nan_steps and self.trainer.global_rank == self.nan_rank:
            loss = loss * float("nan")
        return loss


class Snapshot(Callback):
    """Parameters, optimizer state and LR schedule around each NaN step, on this rank."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = set(steps)
        self.before: dict[str, Any] | None = None
        self.checks: list[dict[str, Any]] = []

    def _state(self, trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
        opt = trainer.optimizers[0]
        sched = trainer.lr_scheduler_configs[0].scheduler
        return {
            "params": {n: _local(p) for n, p in module.named_parameters()},
            "opt": {
                i: {k: _local(v) for k, v in s.items() if isinstance(v, torch.Tensor)}
                for i, s in enumerate(opt.state[p] for p in module.parameters() if p in opt.state)
            },
            "last_epoch": sched.last_epoch,
            "lr": [g["lr"] for g in opt.param_groups],
        }

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.before = self._state(trainer, module) if trainer.global_step in self.steps else None

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if self.before is None:
            return
        after = self._state(trainer, module)
        b = self.before
        self.checks.append(
            {
                "step": trainer.global_step - 1,
                "params_equal": all(torch.equal(b["params"][n], t) for n, t in after["params"].items()),
                "opt_equal": b["opt"].keys() == after["opt"].keys()
                and all(
                    torch.equal(v, after["opt"][i][k]) for i, s in b["opt"].items() for k, v in s.items()
                ),
                "opt_states": len(after["opt"]),
                "lr_schedule_equal": b["last_epoch"] == after["last_epoch"] and b["lr"] == after["lr"],
            }
        )
        self.before = None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("fsdp2", "hsdp", "ddp_hooks", "ddp"), default="fsdp2")
    parser.add_argument("--nan-steps", type=int, nargs="+", default=[3])
    parser.add_argument("--nan-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-consecutive", type=int, default=5)
    parser.add_argument("--no-guard", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    if args.strategy == "fsdp2":
        strategy: Any = FSDP2Strategy(block_class_names=["TransformerBlock"])
    elif args.strategy == "hsdp":
        strategy = HSDPStrategy(replicate_degree=2, shard_degree=1, block_class_names=["TransformerBlock"])
    elif args.strategy == "ddp_hooks":
        strategy = DDPHooksStrategy()
    else:
        strategy = "ddp"
    snapshot = Snapshot(args.nan_steps)
    guard = None if args.no_guard else NonFiniteGuard(max_consecutive=args.max_consecutive)
    pl.seed_everything(3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        callbacks=[snapshot, *([guard] if guard else [])],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    data = MarkovDataModule(vocab_size=64, seq_len=32, batch_size=4, num_train=64, num_val=8, shuffle=False)
    module = NaNAt(args.nan_steps, args.nan_rank, **MODEL)
    trainer.fit(module, data)
    finite = all(bool(torch.isfinite(_local(p)).all()) for p in module.parameters())
    record = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "checks": snapshot.checks,
        "skipped": guard.skipped if guard else None,
        "finite_at_end": finite,
    }
    with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as fh:
        json.dump(record, fh)


if __name__ == "__main__":
    main()
