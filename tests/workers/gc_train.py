"""Worker: GarbageCollection (and the StragglerDetector next to it) in real processes, from a YAML config.

    python tests/workers/gc_train.py --out DIR --config CONFIG [LightningCLI overrides...]

Runs the config through LightningCLI (Lightning's launcher re-executes this script once per rank), then
``validate``; every rank writes ``DIR/rank<N>.json``: its collections, whether automatic collection was on
before ``fit``, during training and validation (a probe callback), after ``fit`` and after ``validate``, and
the StragglerDetector's report (gathered, the same numbers on every rank).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from fsdp_strategies.callbacks import GarbageCollection, StragglerDetector  # noqa: E402
from fsdp_strategies.cli import ArgumentParser  # noqa: E402
from llama import LlamaLM, MarkovDataModule  # noqa: E402


class GCStateProbe(pl.Callback):
    """Records whether automatic collection is on at each training and validation batch."""

    def __init__(self) -> None:
        self.train: list[bool] = []
        self.val: list[bool] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.train.append(gc.isenabled())

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        self.val.append(gc.isenabled())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", required=True)
    args, overrides = parser.parse_known_args()
    out = Path(args.out)
    cli = LightningCLI(LlamaLM, MarkovDataModule, run=False, save_config_callback=None,
                       parser_class=ArgumentParser, args=["--config", args.config, *overrides])
    trainer, model = cli.trainer, cli.model
    probe = GCStateProbe()
    trainer.callbacks.append(probe)
    collector = next(c for c in trainer.callbacks if isinstance(c, GarbageCollection))
    detector = next(c for c in trainer.callbacks if isinstance(c, StragglerDetector))
    detector.report_path = str(out / "straggler.json")
    before = gc.isenabled()
    trainer.fit(model, cli.datamodule)
    after_fit = gc.isenabled()
    trainer.validate(model, datamodule=cli.datamodule, verbose=False)
    report = detector.report()
    result = {
        "rank": trainer.global_rank, "world": trainer.world_size, "strategy": type(trainer.strategy).__name__,
        "global_step": trainer.global_step, "collections": [list(c) for c in collector.collections],
        "enabled_before": before, "enabled_in_train": probe.train, "enabled_in_val": probe.val,
        "enabled_after_fit": after_fit, "enabled_after_validate": gc.isenabled(),
        "pause_s": report["pause_s"], "persistent": report["persistent"], "windows": len(report["windows"]),
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():  # gloo subgroups left to interpreter exit can abort the process (SIGABRT)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
