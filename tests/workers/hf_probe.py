"""A callback for the pretrained-HF tests: each rank's first batch and first loss, and its weights' digest.

Listed with ``--trainer.callbacks+=hf_probe.FirstStepProbe --trainer.callbacks.init_args.out DIR`` (the test
puts tests/workers on PYTHONPATH); writes ``DIR/<group>_<rank>.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


class FirstStepProbe(pl.Callback):
    """Records rank-wise: the first training batch and its loss; whether tied weights are still one tensor."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.done = False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.done:  # the first batch (under ft_hsdp a step may not commit: global_step is not the cue)
            return
        self.done = True
        model = pl_module.model
        tied = None
        if hasattr(model, "lm_head") and hasattr(model, "get_input_embeddings"):
            tied = model.lm_head.weight is model.get_input_embeddings().weight
        group = os.environ.get("REPLICA_GROUP_ID", "x")
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"batch": batch.tolist(), "loss": float(outputs["loss"]), "tied": tied,
                  "group": group, "rank": trainer.global_rank, "dtype": str(next(model.parameters()).dtype)}
        (self.out / f"{group}_{trainer.global_rank}.json").write_text(json.dumps(record))
