"""Worker: StragglerDetector runs in real processes (Lightning's launcher, gloo), several fits in a row.

    python tests/workers/straggler_train.py --out DIR --devices 2 --runs clean,transient,persistent,stop

Each run writes ``DIR/<run>.json`` (the detector's report, rank 0); ``cli:CONFIG`` runs the YAML through
LightningCLI (extra overrides in ``--cli-extra``). The ``stop`` run ends the script with the detector's
exit code, so it goes last.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from fsdp_strategies.callbacks import StragglerDetector  # noqa: E402
from fsdp_strategies.testing import StallInjector, StragglerInjection  # noqa: E402
from llama import LlamaLM, MarkovDataModule  # noqa: E402

TINY_MODEL = {"vocab_size": 64, "dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32, "lr": 1e-2,
              "warmup_steps": 2}
TINY_DATA = {"vocab_size": 64, "seq_len": 32, "batch_size": 8, "num_train": 1024, "num_val": 16}
# min_excess_s: a rank must need >= 0.06 s per step more than the others before anything counts. Self time is
# CPU time on CPU devices (a rank descheduled by a loaded 2-core machine does not accrue it), so only host
# jitter in the data segment can reach it; every injected stall below is >= 2.5 times larger, so they are
# found even when the machine is busy, and the clean run stays clean.
DETECT = {"window": 6, "patience": 2, "skip_first": 2, "min_excess_s": 0.06}

# run -> (strategy, detector options, the stall a StallInjector listed before the detector makes)
RUNS: dict[str, tuple[str, dict[str, Any], StragglerInjection | None]] = {
    # Lightning's own ddp: no injection, a 2-step burst on rank 1, a persistent 0.15 s delay on rank 1
    "clean": ("ddp", {}, None),
    "transient": ("ddp", {}, StragglerInjection(ranks=[1], delay_s=0.2, start_step=8, end_step=10)),
    "persistent": ("ddp", {}, StragglerInjection(ranks=[1], delay_s=0.15)),
    # a slow device (busy loop inside forward+backward) under this package's fsdp2, then stop
    "stop": ("fsdp2", {"action": "stop"}, StragglerInjection(ranks=[1], delay_s=0.15, kind="spin")),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--runs", required=True)
    parser.add_argument("--cli-extra", default="")
    args = parser.parse_args()
    out = Path(args.out)
    for run in args.runs.split(","):
        pl.seed_everything(1234)
        if run.startswith("cli:"):
            cli = LightningCLI(LlamaLM, MarkovDataModule, run=False, save_config_callback=None,
                               args=["--config", run[4:], *args.cli_extra.split()])
            trainer = cli.trainer
            detector = next(c for c in trainer.callbacks if isinstance(c, StragglerDetector))
            name = Path(run[4:]).stem
            detector.report_path = str(out / f"{name}.json")
            trainer.fit(cli.model, cli.datamodule)
        else:
            name = run
            strategy, options, stall = RUNS[run]
            # "clean" writes its report to the default place, <log_dir>/straggler_report.json
            report = None if run == "clean" else str(out / f"{run}.json")
            detector = StragglerDetector(**DETECT, **options, report_path=report,
                                         hosts_file=str(out / f"{run}_hosts.txt"))
            trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                                 max_steps=args.steps,
                                 logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, limit_val_batches=0,
                                 callbacks=[detector] if stall is None else [StallInjector(stall), detector],
                                 default_root_dir=str(out / run))
            trainer.fit(LlamaLM(**TINY_MODEL), MarkovDataModule(**TINY_DATA))
        extra = {"global_step": trainer.global_step}
        strategy_obj = trainer.strategy
        if hasattr(strategy_obj, "local_sgd_enabled"):
            extra["local_sgd_enabled_at_end"] = strategy_obj.local_sgd_enabled
        if dist.get_rank() == 0:
            (out / f"{name}.extra.json").write_text(json.dumps(extra))


if __name__ == "__main__":
    main()
