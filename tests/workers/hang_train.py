"""Worker for tests/test_hang_watchdog.py: one rank stops making progress, ``HangWatchdog`` must notice.

    torchrun --nproc_per_node=2 hang_train.py --strategy fsdp2 --hang training_step --hang-rank 1 \
        --hang-step 5 --timeout 5 --stacks DIR

Trains the example Llama with ``HangWatchdog(timeout_s=--timeout, poll_s=1)`` (its warm-up and checkpoint
limits at their defaults). Before the hang, every rank's first step is slow (``--slow-first-step`` seconds: a
long compile or first all-gather) and a checkpoint save at step 2 is slow (``--slow-save`` seconds, while the
checkpoint is written): both longer than ``--timeout``, neither may be called a hang. Then at ``--hang-step``
rank ``--hang-rank`` sleeps forever: inside ``training_step`` (``--hang training_step``) or inside its
dataset's ``__getitem__`` (``--hang data``: a stuck data loader). Without a hang (``--hang none``) the run
ends normally and every rank writes ``OUT.rank<r>.json`` with the watchdog's count of reported hangs."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from fsdp_strategies import FSDP2Strategy, HSDPStrategy
from fsdp_strategies.callbacks import HangWatchdog
from llama import LlamaLM

MODEL = {"vocab_size": 64, "dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32, "lr": 1e-3}
BATCH = 4


#: where the stuck rank writes the wall time its hang began (``<stacks>/hang-began``)
HANG_MARK: list[str] = []


def _mark() -> None:
    with open(HANG_MARK[0], "w") as fh:
        fh.write(str(time.time()))


def sleep_forever_in_training_step() -> None:
    _mark()
    time.sleep(10**6)


def sleep_forever_in_getitem() -> None:
    _mark()
    time.sleep(10**6)


class Tokens(Dataset):
    """Random token rows; on the stuck rank ``__getitem__`` never returns after ``stuck_after`` items."""

    def __init__(self, n: int, stuck_after: int | None) -> None:
        self.rows = torch.randint(
            0, MODEL["vocab_size"], (n, MODEL["max_seq_len"] + 1), generator=torch.Generator().manual_seed(0)
        )
        self.stuck_after, self.served = stuck_after, 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.stuck_after is not None and self.served >= self.stuck_after:
            sleep_forever_in_getitem()
        self.served += 1
        return self.rows[i]


class Hangs(LlamaLM):
    def __init__(self, args: argparse.Namespace, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.args = args

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        a, rank, step = self.args, self.trainer.global_rank, self.trainer.global_step
        if step == 0 and batch_idx == 0:
            time.sleep(a.slow_first_step)
        if a.hang == "training_step" and step == a.hang_step and rank == a.hang_rank:
            sleep_forever_in_training_step()
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        a = self.args
        stuck = a.hang == "data" and self.trainer.global_rank == a.hang_rank
        return DataLoader(
            Tokens(512, a.hang_step * BATCH if stuck else None), batch_size=BATCH, shuffle=False
        )


class SlowSave(Callback):
    """Every rank spends ``seconds`` in the checkpoint save at step ``step`` (slow storage)."""

    def __init__(self, seconds: float, step: int) -> None:
        self.seconds, self.step = seconds, step

    def on_save_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: Any) -> None:
        if trainer.global_step == self.step:
            time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("fsdp2", "hsdp"), default="fsdp2")
    parser.add_argument("--hang", choices=("training_step", "data", "none"), default="training_step")
    parser.add_argument("--hang-rank", type=int, default=1)
    parser.add_argument("--hang-step", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--action", default="exit")
    parser.add_argument("--slow-first-step", type=float, default=0.0)
    parser.add_argument("--slow-save", type=float, default=0.0)
    parser.add_argument("--stacks", required=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    HANG_MARK.append(os.path.join(args.stacks, "hang-began"))
    os.makedirs(args.stacks, exist_ok=True)

    if args.strategy == "fsdp2":
        strategy: Any = FSDP2Strategy(block_class_names=["TransformerBlock"])
    else:
        strategy = HSDPStrategy(replicate_degree=2, shard_degree=1, block_class_names=["TransformerBlock"])
    watchdog = HangWatchdog(timeout_s=args.timeout, action=args.action, poll_s=1.0, stacks_dir=args.stacks)
    pl.seed_everything(3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        default_root_dir=args.stacks,
        callbacks=[
            watchdog,
            SlowSave(args.slow_save, 2),
            ModelCheckpoint(dirpath=os.path.join(args.stacks, "ckpt"), every_n_train_steps=2, save_top_k=-1),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(Hangs(args, **MODEL))
    if args.out:
        with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as fh:
            json.dump({"hangs": watchdog.hangs, "global_step": trainer.global_step}, fh)


if __name__ == "__main__":
    main()
