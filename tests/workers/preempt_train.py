"""Worker for the SIGTERM / preemption trials: one rank of a tiny Llama fit under a strategy of the package.

Started by Lightning's launcher (``python preempt_train.py --devices 2 ...``: the script re-executes itself
per rank), by ``torchrun`` or by ``fsdp-strategies-ft``. Every rank appends JSON lines to
``<root>/events-rank<R>.jsonl``: ``start``, one ``step`` record per optimizer step (global step, this
rank's loss, wall time), ``save_start`` / ``save_end`` around every checkpoint write, ``val`` per
validation batch and, after a fit that ran to ``max_steps``, ``end``; the final parameters of this rank
(its shards under FSDP2) go to ``<root>/params-rank<R>.pt``. ``--resume`` continues from
``ckpt_path="last"`` (the newest of ``last.ckpt`` and the preemption checkpoint ``last-preempt.ckpt``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from typing_extensions import override  # noqa: E402

from fsdp_strategies import DDPHooksStrategy, FSDP2Strategy, FTHSDPStrategy, HSDPStrategy  # noqa: E402
from llama import LlamaLM, MarkovDataModule  # noqa: E402

STRATEGIES = ("fsdp2", "hsdp", "ddp_hooks", "ft_hsdp")
TINY_MODEL = {"vocab_size": 64, "dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32, "lr": 1e-2,
              "warmup_steps": 2}
TINY_DATA = {"vocab_size": 64, "seq_len": 32, "batch_size": 4, "num_val": 16, "num_train": 256}


def make_strategy(name: str, grace_s: float, checkpoint: bool) -> pl.strategies.Strategy:
    common = {"checkpoint_on_preempt": checkpoint, "preempt_grace_s": grace_s}
    blocks = {"block_class_names": ["TransformerBlock"]}
    if name == "fsdp2":
        return FSDP2Strategy(**blocks, **common)
    if name == "hsdp":  # 2 ranks: 2 replicas of 1 shard, so the cross-replica all-reduce runs every step
        return HSDPStrategy(replicate_degree=2, shard_degree=1, **blocks, **common)
    if name == "ddp_hooks":  # local SGD: the SIGTERM agreement runs only right after a global averaging
        return DDPHooksStrategy(comm_hook="post_local_sgd", local_sgd_warmup=2, local_sgd_period=2,
                                local_group_size=1, **common)
    if name == "ft_hsdp":  # the lighthouse and group ids come from the environment (fsdp-strategies-ft)
        return FTHSDPStrategy(init_sync=False, timeout_s=10, connect_timeout_s=5, **blocks, **common)
    raise ValueError(f"--strategy {name!r}: one of {STRATEGIES}")


class Events(pl.Callback):
    """Per-rank JSON lines: steps with losses, checkpoint writes, validation batches."""

    def __init__(self, root: Path, step_sleep: float) -> None:
        self.root = root
        self.step_sleep = step_sleep
        self.path: Path | None = None

    def write(self, **record: Any) -> None:
        assert self.path is not None
        with self.path.open("a") as fh:
            fh.write(json.dumps({"t": time.time(), **record}) + "\n")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.path = self.root / f"events-rank{trainer.global_rank}.jsonl"
        strategy = trainer.strategy
        save = strategy.save_checkpoint

        def timed_save(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            self.write(event="save_start", path=str(filepath), step=trainer.global_step)
            save(checkpoint, filepath, storage_options)
            self.write(event="save_end", path=str(filepath), step=trainer.global_step)

        strategy.save_checkpoint = timed_save  # type: ignore[method-assign]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(event="start", step=trainer.global_step, pid=os.getpid())

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.write(event="step", step=trainer.global_step, loss=float(loss), batch_idx=batch_idx)
        if self.step_sleep:
            time.sleep(self.step_sleep)

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        self.write(event="val", step=trainer.global_step, batch_idx=batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--devices", default="2", help="ranks (per replica group); the same under torchrun")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--val-every", type=int, default=8)
    parser.add_argument(
        "--step-sleep", type=float, default=0.0, help="pace training (seconds after each step)"
    )
    parser.add_argument("--grace", type=float, default=25.0)
    parser.add_argument("--no-checkpoint-on-preempt", action="store_true")
    parser.add_argument("--resume", action="store_true", help="ckpt_path='last'")
    parser.add_argument("--also-reference", type=Path, default=None,
                        help="then run the uninterrupted fit in the "
                             "same processes, writing under this folder")
    args = parser.parse_args()
    try:
        fit(args, args.root, resume=args.resume)
    except SystemExit as stop:  # the preemption (Preempted is a SystemExit): record this rank's exit status
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        with (args.root / f"events-rank{rank}.jsonl").open("a") as fh:
            fh.write(json.dumps({"t": time.time(), "event": "exit", "code": stop.code}) + "\n")
        raise
    if args.also_reference is not None:
        fit(args, args.also_reference, resume=False)


def fit(args: argparse.Namespace, root: Path, resume: bool) -> None:
    root.mkdir(parents=True, exist_ok=True)
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    pl.seed_everything(7)
    events = Events(root, args.step_sleep)
    ckpt = ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=make_strategy(args.strategy, args.grace,
                                                                   not args.no_checkpoint_on_preempt),
        max_steps=args.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, val_check_interval=args.val_every, limit_val_batches=2,
        callbacks=[events, ckpt], default_root_dir=str(root))
    trainer.fit(LlamaLM(**TINY_MODEL), MarkovDataModule(**TINY_DATA), ckpt_path="last" if resume else None)
    events.write(event="end", step=trainer.global_step)
    state = trainer.lightning_module.state_dict()
    torch.save({k: getattr(v, "to_local", lambda v=v: v)().detach().clone() for k, v in state.items()},
               root / f"params-rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
