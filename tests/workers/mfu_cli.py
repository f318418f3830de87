"""Worker for the SAC / MFU multi-process tests: the example's LightningCLI, then a dump per rank.

``python mfu_cli.py fit --config configs/X.yaml ...`` runs ``examples/train_llama.py``'s CLI unchanged
(Lightning's launcher re-executes this script once per rank); after ``fit`` it runs ``validate``
(``setup`` again: checkpointing must not be applied twice) and every rank writes
``$MFU_OUT/rank<N>.json`` with what the tests check.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import train_llama
from fsdp_strategies.callbacks import ActivationCheckpointing, MFUMonitor
from fsdp_strategies.parallel.activation_checkpointing import is_checkpointed


def main() -> None:
    cli = train_llama.main(sys.argv[1:])
    trainer, model = cli.trainer, cli.model
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    trainer.validate(model, datamodule=cli.datamodule, verbose=False)
    monitor = next(c for c in trainer.callbacks if isinstance(c, MFUMonitor))
    sac = next((c for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)), None)
    blocks = [m for m in model.modules() if is_checkpointed(m)]
    out = {
        "rank": trainer.global_rank,
        "world": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "metrics": metrics,
        "flops": [monitor.flops.model, monitor.flops.hardware] if monitor.flops else None,
        "source": monitor.source,
        "peak": monitor.peak,
        "local_values": monitor.local_values,
        "gathered": monitor.gathered.tolist() if monitor.gathered is not None else None,
        "sac_mode": sac.mode if sac else None,
        "checkpointed": [type(b).__name__ for b in blocks],
        # applied once: the function run inside each checkpoint is the class's forward, not our wrapper
        "inner_forwards": [b._fsdp_strategies_ac_inner.__func__.__qualname__ for b in blocks],
        "state_dict_keys": sorted(model.state_dict().keys()),
        "loss_finite": math.isfinite(metrics.get("train_loss", float("nan"))),
    }
    Path(os.environ["MFU_OUT"], f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
