"""Worker for tests/test_scalar_params.py: a model with 0-d parameters trained under several strategies.

Run by torchrun (``--runs ddp,fsdp2``: the runs share one process-group start, as the real-models matrix
does) or, with ``--ft``, per replica group by ``fsdp-strategies-ft``. The model has a learned temperature at
the root, a 0-d gate inside each block (so block units ignore parameters too) and a frozen 0-d offset.

Each run records, on rank 0 into ``--out`` (JSON), every rank's losses and final 0-d parameter values (the
test checks the ranks agree), and under ``ddp`` the gradient norms before clipping; ``--ckpt`` adds a sharded
checkpoint at step 2 and a run resumed from it, recording the 0-d parameters and their optimizer state right
after the resume and right after step 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fsdp_strategies

STEPS, BATCH, DIM, CLIP = 6, 4, 16, 0.05
SCALARS = ["temperature", "layers.0.gate", "layers.1.gate", "offset"]


class GatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.gate = nn.Parameter(torch.tensor(0.5))

    def reset_parameters(self) -> None:
        # a user who seeds each rank differently draws a different gate on each rank: the strategy
        # must start every rank from one value (rank 0's), as ddp does when it wraps the model
        self.gate.data.fill_(float(torch.rand(())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * torch.tanh(self.fc(x))


class ScalarNet(pl.LightningModule):
    def __init__(self, in_configure_model: bool = False) -> None:
        super().__init__()
        self.in_configure_model = in_configure_model
        if not in_configure_model:
            self._build()

    def _build(self) -> None:
        self.embed = nn.Linear(8, DIM)
        self.layers = nn.ModuleList([GatedBlock() for _ in range(2)])
        self.head = nn.Linear(DIM, 4)
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.offset = nn.Parameter(torch.tensor(0.25), requires_grad=False)

    def reset_parameters(self) -> None:  # the root's own parameters, after a meta-device build
        self.temperature.data.fill_(1.5)
        self.offset.data.fill_(0.25)

    def configure_model(self) -> None:
        if self.in_configure_model and not hasattr(self, "embed"):
            self._build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h) * self.temperature + self.offset

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=5e-2)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x @ torch.randn(8, 4, generator=g)).argmax(-1)
    return TensorDataset(x, y)


def _plain(t: torch.Tensor) -> Any:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().cpu().double().tolist()


def scalar_state(module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The 0-d parameters and their optimizer state (values as Python floats, exact in double)."""
    named = dict(module.named_parameters())
    out: dict[str, Any] = {"values": {n: _plain(named[n]) for n in SCALARS}, "types": {
        n: type(named[n]).__name__ for n in SCALARS}}
    out["optimizer"] = {
        n: {k: _plain(v) for k, v in optimizer.state.get(named[n], {}).items()} for n in SCALARS
    }
    return out


class Record(pl.Callback):
    """Losses; the 0-d state after the resume (train start) and after step ``at_step``."""

    def __init__(self, at_step: int = 2) -> None:
        self.losses: list[float] = []
        self.at_step = at_step
        self.start: dict[str, Any] | None = None
        self.after: dict[str, Any] | None = None
        self.grad_norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # type: ignore[no-untyped-def]
        # before clipping; plain gradients (ddp) only: the test checks that clipping was active
        grads = [
            p.grad
            for p in pl_module.parameters()
            if p.grad is not None and not hasattr(p.grad, "full_tensor")
        ]
        if len(grads) == len([p for p in pl_module.parameters() if p.requires_grad]):
            self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = scalar_state(pl_module, trainer.optimizers[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))
        if trainer.global_step == self.at_step and self.after is None:
            self.after = scalar_state(pl_module, trainer.optimizers[0])


def _strategy(name: str, world: int, init_sync: bool = True) -> Any:
    if name == "ddp":
        return "ddp"
    if name in ("fsdp2", "fsdp2_meta"):
        return fsdp_strategies.FSDP2Strategy(block_class_names=["GatedBlock"], timeout=timedelta(seconds=120))
    if name == "hsdp":
        return fsdp_strategies.HSDPStrategy(replicate_degree=2, shard_degree=world // 2,
                                            block_class_names=["GatedBlock"], timeout=timedelta(seconds=120))
    if name == "ft_hsdp":
        # init_sync (the default): the first step heals every group from a peer chosen per rank
        return fsdp_strategies.FTHSDPStrategy(
            block_class_names=["GatedBlock"], timeout_s=20, connect_timeout_s=10, init_sync=init_sync
        )
    raise ValueError(name)


def fit(name: str, world: int, *, accumulate: int = 1, ckpt_dir: Path | None = None,
        resume: str | None = None, init_sync: bool = True) -> tuple[pl.Trainer, Record]:
    meta = name == "fsdp2_meta"
    # fsdp2_meta: built on the meta device in configure_model, materialised by reset_parameters, with each
    # rank seeded differently
    pl.seed_everything(dist.get_rank() if meta and dist.is_initialized() else 0, verbose=False)
    model = ScalarNet(in_configure_model=meta)
    record = Record()
    callbacks: list[pl.Callback] = [record]
    if ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=ckpt_dir, filename="ckpt-{step}", every_n_train_steps=2, save_top_k=-1)
        )
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=_strategy(name, world, init_sync),
                         max_steps=STEPS, accumulate_grad_batches=accumulate, gradient_clip_val=CLIP,
                         callbacks=callbacks, logger=False, enable_checkpointing=ckpt_dir is not None,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0)
    trainer.fit(
        model, train_dataloaders=DataLoader(dataset(), batch_size=BATCH, shuffle=False), ckpt_path=resume
    )
    return trainer, record


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run(name: str, world: int, tmp: Path, ckpt: bool, accumulate: int) -> dict[str, Any]:
    ckpt_dir = tmp / f"ckpt-{name}" if ckpt else None
    if ckpt_dir is not None and dist.get_rank() == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    dist.barrier()
    trainer, record = fit(name, world, accumulate=accumulate, ckpt_dir=ckpt_dir)
    final = scalar_state(trainer.lightning_module, trainer.optimizers[0])
    result: dict[str, Any] = {"losses": _gather(record.losses), "final": _gather(final["values"]),
                              "types": final["types"], "global_step": trainer.global_step,
                              "grad_norms": record.grad_norms,
                              "start": _gather(record.start and record.start["values"])}
    if ckpt_dir is not None:
        dist.barrier()
        step2 = sorted(
            str(p) for p in ckpt_dir.iterdir() if "step=2" in p.name and not p.name.endswith(".tmp")
        )
        result["checkpoint"] = step2
        result["saved"] = record.after
        _, resumed = fit(name, world, accumulate=accumulate, resume=step2[0])
        result["restored"] = _gather(resumed.start)
        result["resumed_losses"] = _gather(resumed.losses)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default="ddp,fsdp2")
    parser.add_argument(
        "--ckpt", default="", help="runs that also save a sharded checkpoint and resume from it"
    )
    parser.add_argument(
        "--accumulate", type=int, default=1, help="accumulate_grad_batches of the torchrun runs"
    )
    parser.add_argument("--ft", action="store_true", help="one ft_hsdp run in this replica group")
    parser.add_argument("--no-init-sync", action="store_true", help="ft_hsdp's init_sync=False")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    if args.ft:  # started by fsdp-strategies-ft: this group's ranks; Lightning starts the process group
        trainer, record = fit(
            "ft_hsdp", int(os.environ.get("WORLD_SIZE", "1")), init_sync=not args.no_init_sync
        )
        final = scalar_state(trainer.lightning_module, trainer.optimizers[0])
        group = os.environ.get("REPLICA_GROUP_ID", "0")
        out.mkdir(parents=True, exist_ok=True)
        (out / f"group{group}_rank{trainer.global_rank}.json").write_text(json.dumps(
            {"losses": record.losses, "final": final["values"], "types": final["types"],
             "global_step": trainer.global_step}))
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    world = dist.get_world_size()
    results = {name: run(name, world, out.parent, name in args.ckpt.split(","), args.accumulate)
               for name in args.runs.split(",")}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
