"""Runs many cells of the real-models matrix inside one process-group start (torchrun, gloo, CPU).

Usage:
``torchrun --nproc_per_node W tests/matrix/worker.py --cells cells.json --out results.jsonl --tmp DIR``.

A cell is ``{"model", "strategy", "callbacks", "precision", "resume"}``. For each, every rank builds
the model with the same seed, trains ``STEPS`` steps with a fresh ``Trainer`` and the given
strategy/callbacks/precision, and rank 0 appends one JSON line with what the test checks: every
rank's losses, the sharded fraction of every expected block, ``state_dict`` keys against a fresh
build, MFU's counted FLOPs with the analytic formula's inputs, and (``resume``) the losses of a run
resumed from a mid-epoch checkpoint. An exception becomes ``{"error": ...}`` for that cell and the
loop goes on (the process group's timeout bounds a cell that fails on one rank only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import fsdp_strategies  # noqa: F401  (registers the strategy names)
from fsdp_strategies import ActivationCheckpointing, DDPHooksStrategy, FSDP2Strategy, HSDPStrategy, MFUMonitor
from fsdp_strategies.callbacks.straggler import StragglerDetector
from matrix.models import MODELS, matmul_weight_params, provide_demo_text

STEPS = 4
BATCH = 2


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach().float()))


def _strategy(name: str, world: int, eager_init: bool = False) -> Any:
    if name == "fsdp2":
        return FSDP2Strategy(timeout=timedelta(seconds=120), meta_init=not eager_init)
    if name == "hsdp":
        return HSDPStrategy(replicate_degree=2, shard_degree=world // 2, timeout=timedelta(seconds=120),
                            meta_init=not eager_init)
    if name == "ddp_hooks":
        return DDPHooksStrategy(timeout=timedelta(seconds=120))
    if name == "ddp":
        return "ddp"
    if name == "lightning_mp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(
            data_parallel_size=world, tensor_parallel_size=1, timeout=timedelta(seconds=120)
        )
    raise ValueError(f"unknown strategy {name!r}")


def _callbacks(names: list[str]) -> dict[str, pl.Callback]:
    out: dict[str, pl.Callback] = {}
    for name in names:
        if name.startswith("sac_"):
            out[name] = ActivationCheckpointing(mode=name[len("sac_"):])  # type: ignore[arg-type]
        elif name == "mfu":
            out[name] = MFUMonitor(window=2, warmup_steps=1, peak_flops=1e12, prog_bar=False)
        elif name == "straggler":
            out[name] = StragglerDetector(window=2, skip_first=0)
        else:
            raise ValueError(f"unknown callback {name!r}")
    return out


def _fit(cell: dict[str, Any], world: int, *, max_steps: int, ckpt_dir: Path | None = None,
         ckpt_path: str | None = None) -> tuple[pl.Trainer, pl.LightningModule, LossRecorder,
                                                dict[str, pl.Callback]]:
    spec = MODELS[cell["model"]]
    pl.seed_everything(0, verbose=False)
    model = spec.build()
    recorder = LossRecorder()
    extra = _callbacks(cell["callbacks"])
    callbacks: list[pl.Callback] = [recorder, *extra.values()]
    if ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=ckpt_dir, filename="ckpt-{step}", every_n_train_steps=2, save_top_k=-1)
        )
    trainer = pl.Trainer(
        accelerator="cpu", devices=world,
        strategy=_strategy(cell["strategy"], world, cell.get("eager_init", False)),
        precision=cell["precision"],
        max_steps=max_steps, callbacks=callbacks, logger=False, enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=True,
    )
    loader = DataLoader(spec.dataset(), batch_size=BATCH, shuffle=False)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    return trainer, model, recorder, extra


def _block_fractions(module: torch.nn.Module, class_name: str) -> list[dict[str, Any]]:
    out = []
    for m in module.modules():
        if type(m).__name__ not in (class_name, f"FSDP{class_name}"):
            continue
        local = full = 0
        for p in m.parameters():
            full += p.numel()
            local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        out.append({"fsdp_unit": isinstance(m, FSDPModule), "fraction": local / full if full else 0.0})
    return out


def run_cell(cell: dict[str, Any], world: int, tmp: Path) -> dict[str, Any]:
    spec = MODELS[cell["model"]]
    fresh = spec.build()
    if is_overridden("configure_model", fresh) and not any(True for _ in fresh.parameters()):
        fresh.configure_model()  # a model that builds its layers there (not one that only shards there)
    fresh_keys = sorted(fresh.state_dict())
    analytic_inputs = None
    if spec.attention is not None:
        analytic_inputs = {"matmul_params": matmul_weight_params(fresh), "layers": spec.attention[0],
                           "attn_width": spec.attention[1], "seq": spec.seq, "samples": BATCH}
    del fresh

    ckpt_dir = tmp / "ckpt" if cell.get("resume") else None
    if ckpt_dir is not None and dist.get_rank() == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    dist.barrier()
    start = time.perf_counter()
    trainer, model, recorder, extra = _fit(cell, world, max_steps=STEPS, ckpt_dir=ckpt_dir)
    result: dict[str, Any] = {
        "seconds": round(time.perf_counter() - start, 2),
        "global_step": trainer.global_step,
    }
    result["losses"] = [recorder.losses]
    result["blocks"] = {name: _block_fractions(model, name) for name in spec.blocks}
    keys = sorted(model.state_dict())
    result["state_dict_keys_equal"] = keys == fresh_keys
    result["state_dict_keys_diff"] = sorted(set(keys) ^ set(fresh_keys))[:10]
    if "mfu" in extra:
        mfu: MFUMonitor = extra["mfu"]  # type: ignore[assignment]
        assert mfu.flops is not None
        result["mfu"] = {"model_flops": mfu.flops.model, "hardware_flops": mfu.flops.hardware,
                         "analytic_inputs": analytic_inputs}
    sac = [c for c in extra.values() if isinstance(c, ActivationCheckpointing)]
    if sac:
        result["sac_checkpointed"] = len(sac[0].checkpointed)
    cfg = getattr(getattr(model, "model", None), "config", None)
    result["use_cache_after_fit"] = getattr(cfg, "use_cache", None)
    if ckpt_dir is not None:
        dist.barrier()
        step2 = sorted(
            str(p) for p in ckpt_dir.iterdir() if "step=2" in p.name and not p.name.endswith(".tmp")
        )
        if not step2:
            raise RuntimeError(f"no step-2 checkpoint in {sorted(p.name for p in ckpt_dir.iterdir())}")
        _, _, resumed, _ = _fit(cell, world, max_steps=STEPS, ckpt_path=step2[0])
        result["resumed_losses"] = [resumed.losses]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tmp", required=True)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    cells = json.loads(Path(args.cells).read_text())
    tmp = Path(args.tmp).resolve()
    tmp.mkdir(parents=True, exist_ok=True)
    out = Path(args.out).resolve()
    provide_demo_text(tmp)
    dist.barrier()
    for cell in cells:
        try:
            result = run_cell(cell, world, tmp)
        except Exception as err:  # recorded per cell; the test decides whether it was expected
            result = {
                "error": f"{type(err).__name__}: {err}"[:2000],
                "traceback": traceback.format_exc()[-3000:],
            }
            print(f"[rank {rank}] cell {cell} failed:\n{result['traceback']}", file=sys.stderr, flush=True)
        for key in ("losses", "resumed_losses"):  # every rank gathers both, whatever happened to it
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, result[key][0] if key in result else None)
            if key in result:
                result[key] = gathered
        if rank == 0:
            with open(out, "a") as f:
                f.write(json.dumps({"cell": cell, "world": world, **result}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
