"""``TRAIN_SCRIPT`` of the SLURM tests: ``examples/train_llama.py``'s LightningCLI plus a probe callback.

Every rank appends JSON lines to ``$SLURM_TEST_OUT/rank<global rank>[-group<replica group>].jsonl``:

* ``start``: what SLURM and torchrun told this rank (``SLURMD_NODENAME``, ``SLURM_JOB_ID``,
  ``SLURM_RESTART_COUNT``, ``RANK``, ...), the strategy's mesh as global ranks, and the step it starts at
  (a resumed run starts after the checkpointed step);
* ``step`` after every optimizer step: the step, this rank's loss, under ``ft_hsdp`` whether it committed,
  with how many groups, and the healing count;
* ``exception`` when the fit is stopped by one (the preemption's ``Preempted``);
* ``end`` after a fit that ran to ``max_steps``: :func:`fsdp_strategies.testing.state_digest` over this
  rank's parameter and optimizer-state shards;
* ``exit`` at interpreter exit (not written if the preemption watchdog had to end the process).

``SLURM_TEST_HANG`` (``RANK:STEP:TIMEOUT``): a ``HangWatchdog(timeout_s=TIMEOUT, poll_s=1)`` on every rank,
and in the job's first run (``SLURM_RESTART_COUNT`` unset or 0) global rank RANK sleeps forever when it starts
step STEP.

``SLURM_TEST_CKPT`` (a folder): a ``ModelCheckpoint`` there with ``save_last`` (the folder the preemption
checkpoint goes to, and where ``--ckpt_path last`` looks). ``SLURM_TEST_STEP_SLEEP``: seconds to sleep after
each step (so that a test can signal a run in the middle of training).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "examples")]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

import fsdp_strategies  # noqa: E402
from fsdp_strategies.cli import ArgumentParser  # noqa: E402
from fsdp_strategies.testing import HangInjector, state_digest  # noqa: E402
from llama import LlamaLM, MarkovDataModule  # noqa: E402

ENV_KEYS = ("SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "SLURM_NODEID", "RANK",
            "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS",
            "TORCHFT_LIGHTHOUSE")


def _ranks(group: Any) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


class SlurmProbe(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.path: Path | None = None
        self.sleep = float(os.environ.get("SLURM_TEST_STEP_SLEEP", "0"))

    def write(self, **record: Any) -> None:
        if self.path is None:
            return
        with self.path.open("a") as fh:
            fh.write(json.dumps({"t": time.time(), **record}) + "\n")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        group = os.environ.get("REPLICA_GROUP_ID")
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / (
            f"rank{trainer.global_rank}" + (f"-group{group}" if group is not None else "") + ".jsonl"
        )
        atexit.register(lambda: self.write(event="exit"))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        record: dict[str, Any] = {"event": "start", "env": {k: os.environ.get(k) for k in ENV_KEYS},
                                  "global_rank": trainer.global_rank, "global_step": trainer.global_step,
                                  "strategy": type(strategy).__name__}
        mesh = getattr(strategy, "device_mesh", None)
        if mesh is not None:
            names = list(mesh.mesh_dim_names or ())
            record["mesh"] = {"names": names, "shape": list(mesh.shape),
                              "groups": {name: _ranks(mesh.get_group(name)) for name in names}}
        self.write(**record)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        record: dict[str, Any] = {"event": "step", "global_step": trainer.global_step,
                                  "loss": float(outputs["loss"]) if isinstance(outputs, dict) else None}
        strategy = trainer.strategy
        if isinstance(strategy, fsdp_strategies.FTHSDPStrategy):
            record["committed"] = strategy.last_step_committed
            record["participants"] = int(strategy.manager.num_participants())
            record["heals"] = int(strategy.ft_stats["heals"])
        self.write(**record)
        if self.sleep:
            time.sleep(self.sleep)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.write(event="exception", type=type(exception).__name__, message=str(exception)[:300],
                   global_step=trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        tensors = {f"param.{name}": p for name, p in pl_module.named_parameters()}
        for i, optimizer in enumerate(trainer.optimizers):
            for j, state in enumerate(optimizer.state.values()):
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"opt{i}.{j}.{key}"] = value
        self.write(
            event="end", global_step=trainer.global_step, digest=state_digest(tensors), tensors=len(tensors)
        )


def main() -> None:
    callbacks: list[pl.Callback] = [SlurmProbe(Path(os.environ["SLURM_TEST_OUT"]))]
    hang = os.environ.get("SLURM_TEST_HANG")
    if hang:
        from fsdp_strategies.callbacks import HangWatchdog

        rank, step, timeout = hang.split(":")
        callbacks.insert(0, HangWatchdog(timeout_s=float(timeout), poll_s=1.0,
                                         stacks_dir=os.path.join(os.environ["SLURM_TEST_OUT"], "hang")))
        callbacks.insert(1, HangInjector(int(rank), int(step)))  # first run only
    if os.environ.get("SLURM_TEST_CKPT"):
        callbacks.append(ModelCheckpoint(dirpath=os.environ["SLURM_TEST_CKPT"], save_last=True, save_top_k=0,
                                         every_n_train_steps=1000))
    LightningCLI(LlamaLM, MarkovDataModule, trainer_defaults={"callbacks": callbacks},
                 save_config_callback=None, parser_class=ArgumentParser)
    if dist.is_initialized():  # as examples/train_llama.py
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
