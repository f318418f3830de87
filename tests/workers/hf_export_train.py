"""Worker for tests/test_hf_export.py: fine-tune pretrained HF models, checkpoint them, record their logits.

Started with torchrun (2 ranks, gloo). For every run in ``RUNS``: a LightningModule loads a tiny
``save_pretrained`` folder (written by the test) with ``from_pretrained`` into ``self.model``, trains a few
steps under the run's strategy, saves a checkpoint (a sharded folder or a full file), then computes the
logits of the trained module on a fixed batch through its own forward (every rank; FSDP2 gathers the
shards) and rank 0 writes them next to the checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from fsdp_strategies import DDPHooksStrategy, FSDP2Strategy
from matrix.models import SEQ, Pairs, TokenSequences

#: name -> (pretrained model, strategy, sharded checkpoint)
RUNS: dict[str, tuple[str, str, bool]] = {
    "llama_fsdp2_sharded": ("llama", "fsdp2", True),
    "gpt2_fsdp2_sharded": ("gpt2", "fsdp2", True),
    "t5_fsdp2_sharded": ("t5", "fsdp2", True),
    "llama_fsdp2_full": ("llama", "fsdp2", False),
    "t5_ddp_hooks_full": ("t5", "ddp_hooks", False),
    "gpt2_ddp_full": ("gpt2", "ddp", False),
}
SEQ2SEQ = {"t5"}
STEPS = 3


def probe_batch(model: str) -> dict[str, torch.Tensor]:
    """The fixed batch whose logits are compared after the export."""
    x = TokenSequences(n=3, seed=7).data
    return {"input_ids": x, "decoder_input_ids": x.flip(1)} if model in SEQ2SEQ else {"input_ids": x}


class FineTune(pl.LightningModule):
    """What a user writes: the pretrained HF model under ``self.model``, its loss as the training loss."""

    def __init__(self, folder: str, seq2seq: bool) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

        self.seq2seq = seq2seq
        self.model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(folder)

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**inputs).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.seq2seq:
            inputs, targets = batch
            return self.model(input_ids=inputs, labels=targets).loss
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def strategy(name: str, sharded: bool) -> Any:
    if name == "fsdp2":
        return FSDP2Strategy(save_distributed_checkpoint=sharded)
    if name == "ddp_hooks":
        return DDPHooksStrategy()
    return "ddp"


def run(name: str, work: Path) -> None:
    model_name, strategy_name, sharded = RUNS[name]
    pl.seed_everything(0, verbose=False)
    module = FineTune(str(work / "pretrained" / model_name), model_name in SEQ2SEQ)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy(strategy_name, sharded),
                         max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    data = Pairs(n=32, seq=SEQ) if model_name in SEQ2SEQ else TokenSequences(n=32, seq=SEQ)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=4, shuffle=False))
    trainer.save_checkpoint(work / "runs" / f"{name}.ckpt")
    module.eval()
    with torch.no_grad():
        logits = module(**probe_batch(model_name))
    if trainer.is_global_zero:
        torch.save(logits.detach().clone(), work / "runs" / f"{name}.logits.pt")
    trainer.strategy.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--runs", nargs="+", default=list(RUNS))
    args = parser.parse_args()
    for name in args.runs:
        run(name, args.work)


if __name__ == "__main__":
    main()
