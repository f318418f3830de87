"""Worker: the example Llama trained under ``fsdp2`` / ``hsdp`` with its checkpoints on object storage.

    torchrun --nproc_per_node=2 tests/workers/object_store_train.py --dirpath s3://bucket/run --phase first \
        --stop-at 4 --out OUT

``ModelCheckpoint(dirpath=URL, every_n_train_steps=2, save_last=True, save_top_k=2)``; ``--resume URL``
resumes from a checkpoint URL. Rank 0 writes ``OUT/<phase>.json``: the loss of every optimizer step (exact
floats) and the steps it ran. ``--kill-in-save N`` SIGKILLs rank 1 inside its N-th checkpoint write, after its
shards are written and before the commit (the other rank is then stopped by the launcher); ``--sigterm-at
N`` SIGTERMs every rank after step N (a preemption: the strategy's checkpoint goes to
``<dirpath>/last-preempt.ckpt`` and the ranks exit with status 75). Endpoint and
credentials come from the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from typing_extensions import override  # noqa: E402

from fsdp_strategies import DDPHooksStrategy, FSDP2Strategy, HSDPStrategy  # noqa: E402
from fsdp_strategies.checkpoint import object_store  # noqa: E402
from llama import LlamaLM, MarkovDataModule  # noqa: E402
from workers.resume_train import TINY_DATA, TINY_MODEL, StopAt  # noqa: E402


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses[trainer.global_step] = float(outputs["loss"].detach())


class SigtermAt(pl.Callback):
    """What a scheduler's preemption does: SIGTERM to every rank, here after optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class KillInSave(pl.Callback):
    """From the first training step on (after a resume's verification, which hashes objects too): SIGKILL
    process ``pid`` (this rank by default; the S3 server) when this rank hashes the shards of its ``nth`` save
    -- written, not committed."""

    def __init__(self, nth: int, pid: int | None = None) -> None:
        self.nth = nth
        self.pid = pid

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        real = object_store._digest
        calls = {"saves": 0}

        def digest_then_kill(ckpt: Any, path: str) -> tuple[int, str]:
            if path.endswith(".distcp"):
                calls["saves"] += 1
                if calls["saves"] == self.nth:
                    os.kill(self.pid or os.getpid(), signal.SIGKILL)
            return real(ckpt, path)

        object_store._digest = digest_then_kill  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="fsdp2", choices=["fsdp2", "hsdp", "ddp_hooks", "fsdp2_full"])
    parser.add_argument("--dirpath", required=True)
    parser.add_argument("--phase", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--kill-in-save", type=int, default=None)
    parser.add_argument("--sigterm-at", type=int, default=None)
    parser.add_argument("--stop-server-in-save", type=int, default=None)
    parser.add_argument("--async-checkpoint", default="off", choices=["off", "thread", "process"])
    args = parser.parse_args()
    killer = (
        [KillInSave(args.kill_in_save)] if args.kill_in_save and int(os.environ.get("RANK", "0")) == 1 else []
    )
    if args.stop_server_in_save and int(os.environ.get("RANK", "0")) == 0:
        # the server dies inside rank 0's save: every later request of every rank meets a closed port
        killer.append(KillInSave(args.stop_server_in_save, pid=int(os.environ["FSDP_TESTS_S3_PID"])))
    pl.seed_everything(0)
    common = {"async_checkpoint": args.async_checkpoint, "checkpoint_on_preempt": args.sigterm_at is not None}
    strategy = {
        "fsdp2": lambda: FSDP2Strategy(**common),
        "fsdp2_full": lambda: FSDP2Strategy(**common, save_distributed_checkpoint=False),
        "hsdp": lambda: HSDPStrategy(replicate_degree=2, shard_degree=2, **common),
        "ddp_hooks": lambda: DDPHooksStrategy(**common),
    }[args.strategy]()
    losses = Losses()
    devices = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[
            losses,
            ModelCheckpoint(
                dirpath=args.dirpath,
                every_n_train_steps=2,
                save_last=True,
                save_top_k=2,
                monitor="step",
                mode="max",
            ),
            *([StopAt(args.stop_at)] if args.stop_at else []),
            *([SigtermAt(args.sigterm_at)] if args.sigterm_at else []),
            *killer,
        ],
    )
    data = MarkovDataModule(**{**TINY_DATA, "num_train": 256})
    trainer.fit(LlamaLM(**TINY_MODEL), data, ckpt_path=args.resume)
    if trainer.is_global_zero:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        record = {
            "losses": {str(k): v for k, v in sorted(losses.losses.items())},
            "global_step": trainer.global_step,
        }
        (Path(args.out) / f"{args.phase}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
