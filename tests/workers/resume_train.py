"""Harness + worker: an uninterrupted fit vs the same fit stopped mid-epoch, checkpointed and resumed.

Imported by tests/test_resume.py for the in-process (single device) cases, and run as a script for
the real 2-rank case (Lightning's launcher re-executes it per rank, gloo):

    python tests/workers/resume_train.py --out OUT.pt --devices 2 --steps 16 --stop-at 8

Both halves use the same ``max_steps`` (the first is stopped by ``trainer.should_stop``), so the LR
schedule is the same as in the uninterrupted run. Every run records the batches it trained on.
"""

from __future__ import annotations

import argparse
import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset  # noqa: E402
from typing_extensions import override  # noqa: E402

from fsdp_strategies import DDPHooksStrategy, FSDP2Strategy  # noqa: E402
from fsdp_strategies.runtime.resume_position import skip_consumed_batches  # noqa: E402
from llama import LlamaLM, MarkovDataModule, MarkovSequences  # noqa: E402

TINY_MODEL = {"vocab_size": 64, "dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32, "lr": 1e-2,
              "warmup_steps": 2}
TINY_DATA = {"vocab_size": 64, "seq_len": 32, "batch_size": 8, "num_val": 8}


class SkipSingleDevice(SingleDeviceStrategy):
    """What every strategy of the package does: fast-forward the loaders once the checkpoint is restored.

    ``calls=2`` checks that a second call (a subclass calling it again) changes nothing.
    """

    skipped: int | None = None

    def __init__(self, *args: Any, calls: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = calls

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        for _ in range(self.calls):
            self.skipped = skip_consumed_batches(self.lightning_module.trainer)


class SkipDDP(DDPStrategy):
    skipped: int | None = None

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.skipped = skip_consumed_batches(self.lightning_module.trainer)


class CountingSequences(MarkovSequences):
    """Counts the samples actually loaded, in DataLoader worker processes too (shared counter)."""

    def __init__(self, data: torch.Tensor) -> None:
        super().__init__(data)
        self._loaded = multiprocessing.Value("l", 0)

    @property
    def loaded(self) -> int:
        return int(self._loaded.value)

    def __getitem__(self, index: int) -> torch.Tensor:
        with self._loaded.get_lock():
            self._loaded.value += 1
        return super().__getitem__(index)


class Rows(IterableDataset):
    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __iter__(self) -> Any:
        return iter(self.data)


class StatefulLoader(DataLoader):
    """A loader Lightning treats as resumable (``state_dict``/``load_state_dict``): it saves and restores
    it."""

    loaded_states: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"marker": 1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        StatefulLoader.loaded_states.append(state_dict)


class ResumeData(MarkovDataModule):
    """``sampler``: "default" (the DataModule's own loader), "seeded" (a shuffling sampler whose order depends
    only on its seed and ``set_epoch``), "two" (a dict of two loaders of different lengths), "iterable" (an
    IterableDataset), "stateful" (a loader Lightning restores itself)."""

    def __init__(self, sampler: str = "default", **kwargs: Any) -> None:
        super().__init__(**{**TINY_DATA, **kwargs})
        self.sampler = sampler
        self.datasets: list[CountingSequences] = []

    def _loader(self, data: torch.Tensor, **kwargs: Any) -> DataLoader:
        ds = CountingSequences(data)
        self.datasets.append(ds)
        return DataLoader(ds, batch_size=self.hparams.batch_size, drop_last=True,
                          num_workers=self.hparams.num_workers, **kwargs)

    @override
    def train_dataloader(self) -> Any:
        assert self.train_data is not None
        if self.sampler == "seeded":
            ds_len = self.train_data.size(0)
            sampler = DistributedSampler(range(ds_len), num_replicas=1, rank=0, shuffle=True, seed=3)
            return self._loader(self.train_data, sampler=sampler)
        if self.sampler == "iterable":
            return DataLoader(Rows(self.train_data), batch_size=self.hparams.batch_size)
        if self.sampler == "stateful":
            return StatefulLoader(CountingSequences(self.train_data), batch_size=self.hparams.batch_size)
        if self.sampler == "two":
            n_b = self.train_data.size(0) * 2 // 3
            return {"a": self._loader(self.train_data, shuffle=False),
                    "b": self._loader(self.train_data[:n_b].flip(0), shuffle=False)}
        return self._loader(self.train_data, shuffle=self.hparams.shuffle)


class TwoLoaderLM(LlamaLM):
    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch["a"]) + self._loss(batch["b"])


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.batches: list[Any] = []
        self.batch_idx: list[int] = []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        items = [batch[k] for k in sorted(batch)] if isinstance(batch, dict) else [batch]
        self.batches.append(torch.stack([t.detach().clone() for t in items]))
        self.batch_idx.append(batch_idx)


class StopAt(pl.Callback):
    """Ends the fit after optimizer step ``step`` (same ``max_steps``, hence the same LR schedule)."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _fit(strategy: Strategy, module: pl.LightningModule, data: ResumeData, steps: int, root: Path,
         devices: int, accumulate: int, callbacks: list[pl.Callback], ckpt_path: str | None = None,
         val_check_interval: int | None = None) -> tuple[pl.Trainer, Recorder]:
    rec = Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=1 if val_check_interval else 0,
                         val_check_interval=val_check_interval or 1.0, accumulate_grad_batches=accumulate,
                         callbacks=[rec, *callbacks], default_root_dir=str(root))
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, rec


def _params(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters (its local shard for FSDP2's DTensors)."""
    state = trainer.lightning_module.state_dict()
    return {k: getattr(v, "to_local", lambda v=v: v)().detach().clone() for k, v in state.items()}


def stop_and_resume(root: Path, *, strategy: Callable[[], Strategy], steps: int, stop_at: int,
                    sampler: str = "default",
                    accumulate: int = 1, devices: int = 1, data_kwargs: dict[str, Any] | None = None,
                    uninterrupted: bool = True, val_check_interval: int | None = None) -> dict[str, Any]:
    """Run the uninterrupted fit, then the stopped + resumed pair; return what each saw and its final weights.

    With ``val_check_interval`` the checkpoint is written at the end of the validation run at ``stop_at``
    (instead of in ``on_train_batch_end``), which Lightning restores as a different restart stage.
    """
    val = {"val_check_interval": val_check_interval}
    data_kwargs = data_kwargs or {}
    module_cls = TwoLoaderLM if sampler == "two" else LlamaLM
    out: dict[str, Any] = {}
    if uninterrupted:
        pl.seed_everything(7)
        full, full_rec = _fit(strategy(), module_cls(**TINY_MODEL), ResumeData(sampler, **data_kwargs), steps,
                              root / "full", devices, accumulate, [], **val)
        out = {"full_batches": full_rec.batches, "full_batch_idx": full_rec.batch_idx,
               "full_params": _params(full), "full_global_step": full.global_step}

    pl.seed_everything(7)
    trigger = {} if val_check_interval else {"every_n_train_steps": stop_at}
    ckpt = ModelCheckpoint(dirpath=str(root / "ckpt"), filename="mid", save_top_k=-1, **trigger)
    first, first_rec = _fit(strategy(), module_cls(**TINY_MODEL), ResumeData(sampler, **data_kwargs), steps,
                            root / "first", devices, accumulate, [StopAt(stop_at), ckpt], **val)
    ckpt_path = str(root / "ckpt" / "mid.ckpt")

    pl.seed_everything(7)
    data = ResumeData(sampler, **data_kwargs)
    resumed, resumed_rec = _fit(strategy(), module_cls(**TINY_MODEL), data, steps, root / "resumed", devices,
                                accumulate, [], ckpt_path=ckpt_path, **val)
    return {
        **out, "first_batches": first_rec.batches, "first_global_step": first.global_step,
        "resumed_batches": resumed_rec.batches, "resumed_batch_idx": resumed_rec.batch_idx,
        "resumed_params": _params(resumed), "resumed_global_step": resumed.global_step,
        "skipped": getattr(resumed.strategy, "skipped", None),
        "samples_loaded": sum(ds.loaded for ds in data.datasets),
        "train_loader": resumed.train_dataloader,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--stop-at", type=int, default=8)
    parser.add_argument("--num-train", type=int, default=96)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--strategies", default="ddp,fsdp2")
    args = parser.parse_args()
    factories: dict[str, Callable[[], Strategy]] = {
        # calls it itself
        "ddp": lambda: SkipDDP(), "fsdp2": lambda: FSDP2Strategy(block_class_names=["TransformerBlock"]),
        "ddp_hooks": lambda: DDPHooksStrategy(),  # calls it itself
    }
    results: dict[str, Any] = {}
    for name in args.strategies.split(","):
        # shuffle=True: Lightning injects a DistributedSampler (shuffling by seed and set_epoch) on 2 devices
        result = stop_and_resume(Path(args.out).parent / f"resume_{name}", strategy=factories[name],
                                 steps=args.steps, stop_at=args.stop_at, devices=args.devices,
                                 data_kwargs={"num_train": args.num_train, "shuffle": True,
                                              "num_workers": args.num_workers})
        loader = result.pop("train_loader")
        result["sampler_type"] = type(getattr(loader.sampler, "sampler", loader.sampler)).__name__
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        results[name] = gathered
    if dist.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
