"""One ``ft_hsdp`` cell of the real-models matrix, run per replica group by ``fsdp-strategies-ft``.

Usage: ``fsdp-strategies-ft --groups 2 ... -- tests/matrix/ft_worker.py --model hf_llama --out DIR [...]``.

Trains the model with ``FTHSDPStrategy`` and the given callbacks/precision for ``--steps`` committed
steps. While a group trains alone it sleeps ``--sleep-alone`` seconds per step, so that a killed
peer's restart overlaps training (it then heals live instead of finding nobody). At the end each
rank writes ``group<G>_rank<R>.json``: its global and committed step, heals, every committed loss,
the sharded fraction of the expected blocks, and a digest of the full parameters, which must be
equal across groups.

For the independent reference (``ft_replay.py``), every incarnation of a group also writes, as it goes (a
SIGKILLed group keeps what it wrote): the batch it trains at each step (``batch_g<G>_s<P>.pt``, P = the
committed step when the step began), and after the step a line of ``steps_g<G>.jsonl`` (position, committed
step after it, committed?, participating?, participants, loss); group 0 saves its initial weights and its
final weights (``init.pt``, ``final_g<G>.pt``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from fsdp_strategies import FTHSDPStrategy
from matrix.models import MODELS, provide_demo_text
from matrix.worker import BATCH, LossRecorder, _block_fractions, _callbacks


class PaceWhenAlone(pl.Callback):
    def __init__(self, seconds: float, groups: int) -> None:
        self.seconds, self.groups = seconds, groups
        self.manager_step = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        strategy = trainer.strategy
        assert isinstance(strategy, FTHSDPStrategy)
        self.manager_step = int(strategy.manager.current_step())
        if int(strategy.manager.num_participants()) < self.groups:
            time.sleep(self.seconds)


def _full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in module.state_dict().items()}


class StepRecorder(pl.Callback):
    """What each step trained and how it ended, written as it goes (see the module docstring)."""

    def __init__(self, out: Path, group: int) -> None:
        self.out, self.group, self.position = out, group, -1

    def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        if self.group == 0 and trainer.strategy.manager.current_step() == 0:
            torch.save(_full_state(pl_module), self.out / "init.pt")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        # the batch is already the committed step's
        self.position = int(trainer.strategy.manager.current_step())
        torch.save(batch, self.out / f"batch_g{self.group}_s{self.position}.pt")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        manager = trainer.strategy.manager
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        line = {"group": self.group, "pid": os.getpid(), "position": self.position,
                "step_after": int(manager.current_step()), "committed": trainer.strategy.last_step_committed,
                "participating": bool(manager.is_participating()),
                "participants": int(manager.num_participants()), "loss": float(loss.detach().float())}
        with open(self.out / f"steps_g{self.group}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def on_train_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        torch.save(_full_state(pl_module), self.out / f"final_g{self.group}.pt")


def _digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        t = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--callbacks", default="")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sleep-alone", type=float, default=1.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "2"))
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    spec = MODELS[args.model]
    pl.seed_everything(0, verbose=False)
    model = spec.build()
    recorder = LossRecorder()
    pace = PaceWhenAlone(args.sleep_alone, groups)
    extra = _callbacks([c for c in args.callbacks.split(",") if c])
    strategy = FTHSDPStrategy(timeout_s=20, connect_timeout_s=10)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    steps = StepRecorder(out, int(os.environ.get("REPLICA_GROUP_ID", "0")))
    provide_demo_text(out)  # also makes the output folder the working folder
    trainer = pl.Trainer(accelerator="cpu", devices=ranks, strategy=strategy, precision=args.precision,
                         # where callbacks write their files (e.g. the straggler report)
                         default_root_dir=out,
                         max_steps=args.steps, callbacks=[recorder, pace, steps, *extra.values()],
                         logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    dataset = spec.dataset()
    trainer.fit(model, train_dataloaders=DataLoader(dataset, batch_size=BATCH, shuffle=False))
    record: dict[str, Any] = {
        "global_step": trainer.global_step, "manager_step": pace.manager_step,
        "losses": recorder.losses, "blocks": {n: _block_fractions(model, n) for n in spec.blocks},
        "digest": _digest(model), "replica_group": os.environ.get("REPLICA_GROUP_ID"),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"group{record['replica_group']}_rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
