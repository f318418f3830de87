"""Worker for the ft_hsdp data-accounting test: a tiny model on a dataset that returns its own indices.

Started per replica group by ``fsdp-strategies-ft`` (torchrun, 1 rank per group). A callback records,
per step, the sample ids this rank trained, the committed step, the commit decision and whether the
group took part (a healing group contributes zeros), so the test can count every sample per data epoch.
Under gradient accumulation a record holds the step's micro-batches.

    FT_DATA_OUT        folder for the records (required)
    FT_DATA_STEPS      max_steps
    FT_DATA_SLEEP      seconds to sleep after each step (paces training so restarts overlap it)
    FT_DATA_SLEEP_ALONE  seconds to sleep after a step committed by fewer groups than NUM_REPLICA_GROUPS
    FT_DATA_MODE       data_on_failure (default skip)
    FT_DATA_ACCUMULATE accumulate_grad_batches (default 1); a record is written per optimizer step, its
                       ``ids`` one list per micro-batch
    FT_DATA_CKPT       folder: a ModelCheckpoint writes ``step=N.ckpt`` there every FT_DATA_CKPT_EVERY steps
    FT_DATA_RESUME     checkpoint to resume from (``fit(ckpt_path=...)``)
    FT_DATA_HEAL_KILL  "GROUP:INCARNATION,...": that incarnation of the group SIGKILLs itself (torchrun +
                       ranks) while applying the state it fetched from a live peer (a kill during heal)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from group_kill import kill_own_group
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from fsdp_strategies.ft import FTHSDPStrategy

NUM_SAMPLES, BATCH = 96, 4


class IndexDataset(Dataset):
    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        return {"idx": i, "x": torch.randn(8, generator=g), "y": torch.randn(1, generator=g)}


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexDataset(), batch_size=BATCH, shuffle=True)


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.out = Path(os.environ["FT_DATA_OUT"])
        self.out.mkdir(parents=True, exist_ok=True)
        self.incarnation = int(os.environ.get("FT_RESTART_COUNT", "0"))
        self.sleep = float(os.environ.get("FT_DATA_SLEEP", "0"))
        self.sleep_alone = float(os.environ.get("FT_DATA_SLEEP_ALONE", "0"))
        self.groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
        self.accumulate = int(os.environ.get("FT_DATA_ACCUMULATE", "1"))
        self._micro: list[list[int]] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.path = self.out / f"group{os.environ['REPLICA_GROUP_ID']}_rank{trainer.global_rank}.jsonl"

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._micro.append(batch["idx"].tolist())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if (batch_idx + 1) % self.accumulate:  # a non-final micro-batch: the step is not over
            return
        strategy = trainer.strategy
        assert isinstance(strategy, FTHSDPStrategy)
        data = strategy.last_step_data
        ids, self._micro = self._micro, []
        record = {"incarnation": self.incarnation, "ids": ids, "committed": strategy.last_step_committed,
                  "step_after": int(strategy.manager.current_step()), "epoch": trainer.current_epoch,
                  "batch_idx": batch_idx, "participants": int(strategy.manager.num_participants()), **data}
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.sleep:
            time.sleep(self.sleep)
        if self.sleep_alone and record["participants"] < self.groups:
            time.sleep(self.sleep_alone)


class HealKillingFTHSDP(FTHSDPStrategy):
    """Kills its own replica group while applying a healed state, in the incarnations FT_DATA_HEAL_KILL
    names."""

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        incarnation = int(os.environ.get("FT_RESTART_COUNT", "0"))
        victims = [tuple(int(x) for x in item.split(":"))
                   for item in os.environ.get("FT_DATA_HEAL_KILL", "").split(",") if item]
        if (self.replica_group_id, incarnation) in victims:
            print(f"FT_DATA: group {self.replica_group_id} kills itself during its heal", flush=True)
            out = (
                Path(os.environ["FT_DATA_OUT"]) / f"group{self.replica_group_id}_rank{self.global_rank}.jsonl"
            )
            with out.open("a") as fh:
                fh.write(json.dumps({"incarnation": incarnation, "killed_in_heal": True,
                                     "step": int(self.manager.current_step())}) + "\n")
            kill_own_group()  # torchrun agent + every rank of this group
            time.sleep(60)
        super()._load_heal_state(state)


def main() -> None:
    pl.seed_everything(7)
    strategy = HealKillingFTHSDP(timeout_s=10, connect_timeout_s=5, init_sync=False,
                                 data_on_failure=os.environ.get("FT_DATA_MODE", "skip"))
    callbacks: list[pl.Callback] = [Recorder()]
    ckpt = os.environ.get("FT_DATA_CKPT")
    if ckpt:
        callbacks.append(ModelCheckpoint(dirpath=ckpt, filename="{step}", save_top_k=-1,
                                         every_n_train_steps=int(os.environ.get("FT_DATA_CKPT_EVERY", "1"))))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy,
                         max_steps=int(os.environ["FT_DATA_STEPS"]),
                         accumulate_grad_batches=int(os.environ.get("FT_DATA_ACCUMULATE", "1")), logger=False,
                         enable_checkpointing=bool(ckpt), enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    trainer.fit(Tiny(), ckpt_path=os.environ.get("FT_DATA_RESUME") or None)


if __name__ == "__main__":
    main()
