"""Single-process reference runs of the example on the same global batch (no strategy, no sharding)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

from llama import LlamaLM, MarkovSequences
from workers.fsdp_train import MODEL, data_module


def _global_batches(datamodule, global_batch: int) -> DataLoader:  # type: ignore[no-untyped-def]
    # Lightning always shuffles the training DistributedSampler (seed = PL_GLOBAL_SEED). With one
    # replica the same sampler yields the whole permutation, so consecutive global batches here are
    # the union of the ranks' batches there.
    dataset = MarkovSequences(datamodule.train_data)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=1234)
    return DataLoader(dataset, batch_size=global_batch, sampler=sampler, drop_last=True)


def reference_run(
    global_batch: int, steps: int, num_train: int, clip: float = 0.0
) -> dict[str, torch.Tensor]:
    """Train the plain model in this process on the same global batches as a W-rank run."""
    pl.seed_everything(1234, verbose=False)
    model = LlamaLM(**MODEL)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=clip or None,
                         enable_progress_bar=False, logger=False, enable_checkpointing=False,
                         limit_val_batches=0, enable_model_summary=False, num_sanity_val_steps=0)
    dm = data_module(global_batch, num_train)
    dm.setup("fit")
    trainer.fit(model, train_dataloaders=_global_batches(dm, global_batch))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)
