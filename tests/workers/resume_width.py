"""Worker (torchrun, one process per rank): train part of an epoch, or resume it, recording every sample
trained.

One phase of a stop / resume chain whose data-parallel width, mesh or strategy changes between phases:

    torchrun --nproc_per_node=N tests/workers/resume_width.py --strategy fsdp2 --out DIR --phase a \\
        [--tp 2] [--replicate 2] [--stop-at STEP] [--resume CKPT] [--shuffle 0|1] [--samples 200]

The model is an HF ``LlamaForCausalLM`` from a tiny random config (tests/matrix/models.py), the data a
map-style dataset behind a plain ``DataLoader(batch_size=...)``, into which Lightning injects its
``DistributedSampler``. The dataset logs each index it serves; a callback assigns the indices served since the
previous batch to the batch being trained, so ``DIR/<phase>-rank<r>.json`` holds the sample ids each rank
trained, batch by batch, and its data-parallel rank (tensor-parallel peers train the same samples).
``ModelCheckpoint(every_n_train_steps=1, save_last=True)`` writes ``DIR/ckpt-<phase>/last.ckpt`` after every
step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from fsdp_strategies import DDPHooksStrategy, FSDP2Strategy, HSDPStrategy  # noqa: E402
from matrix.models import MODELS, TokenSequences  # noqa: E402


class LoggedSamples(Dataset):
    """``TokenSequences`` that logs the index of every sample it serves (``num_workers=0``: in this
    process)."""

    def __init__(self, n: int) -> None:
        self.rows = TokenSequences(n)
        self.served: list[int] = []

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        self.served.append(int(i))
        return self.rows[i]


class Data(pl.LightningDataModule):
    def __init__(self, n: int, batch_size: int, shuffle: bool) -> None:
        super().__init__()
        self.dataset = LoggedSamples(n)
        self.batch_size, self.shuffle = batch_size, shuffle

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenSequences(8, seed=1), batch_size=self.batch_size)


def _validating(module: pl.LightningModule) -> pl.LightningModule:
    """The module with a ``validation_step`` (its training loss), as a user's module would have one."""

    class Validating(type(module)):  # type: ignore[misc]
        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            return self.training_step(batch, batch_idx)

    module.__class__ = Validating
    return module


class TrainedIds(pl.Callback):
    """Per trained batch: the sample ids the dataset served for it; written at the end of the fit."""

    def __init__(self, dataset: LoggedSamples, out: Path, phase: str) -> None:
        self.dataset, self.out, self.phase, self.seen = dataset, out, phase, 0
        self.batches: list[list[int]] = []  # epoch 0
        self.later: list[list[int]] = []  # epoch 1
        self.validations: list[list[int]] = []  # [epoch, batches trained in this phase] at each validation

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        ids = self.dataset.served[self.seen:]
        self.seen = len(self.dataset.served)
        assert len(ids) == batch.shape[0], (len(ids), batch.shape)
        (self.batches if trainer.current_epoch == 0 else self.later).append(ids)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.validations.append([trainer.current_epoch, len(self.batches) + len(self.later)])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        kwargs = trainer.strategy.distributed_sampler_kwargs
        (self.out / f"{self.phase}-rank{trainer.global_rank}.json").write_text(json.dumps({
            "rank": trainer.global_rank, "dp_rank": kwargs["rank"], "dp_size": kwargs["num_replicas"],
            "batches": self.batches, "later": self.later, "validations": self.validations,
            "global_step": trainer.global_step, "epoch": trainer.current_epoch,
            "num_training_batches": trainer.num_training_batches,
        }))


class StopAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _strategy(args: argparse.Namespace) -> Any:
    if args.strategy == "fsdp2":
        return FSDP2Strategy(tensor_parallel_degree=args.tp)
    if args.strategy == "hsdp":
        return HSDPStrategy(replicate_degree=args.replicate)
    if args.strategy == "ddp_hooks":
        return DDPHooksStrategy()
    return args.strategy  # Lightning's own, e.g. "ddp"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--replicate", type=int, default=2)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--shuffle", type=int, default=1)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--val", type=int, default=0, help="1: validate at each epoch end (one batch)")
    parser.add_argument("--phase", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    pl.seed_everything(0)
    data = Data(args.samples, args.batch_size, bool(args.shuffle))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=_strategy(args), max_epochs=args.epochs,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=args.val,
        callbacks=[
            TrainedIds(data.dataset, out, args.phase),
            ModelCheckpoint(dirpath=str(out / f"ckpt-{args.phase}"), every_n_train_steps=1, save_last=True,
                            save_top_k=0),
            *([StopAt(args.stop_at)] if args.stop_at else []),
        ],
    )
    module = MODELS["hf_llama"].build()
    trainer.fit(_validating(module) if args.val else module, data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
