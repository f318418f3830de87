"""The model called outside the routed steps, as users do: ``self.model(...)`` in ``on_validation_epoch_end``
and ``on_train_end``, ``pl_module.model.generate(...)`` in a callback, then ``trainer.validate`` and
``trainer.predict`` after ``fit``.

``python outside_calls.py STRATEGY OUT FOLDER`` (``STRATEGY``: ``ddp``, ``fsdp2``, ``hsdp``, ``fsdp2_tp``,
``ft_hsdp``; ranks from torchrun / the FT launcher). At every call the sharded model's output is compared with
a plain ``transformers`` model on CPU holding the same (gathered) weights: logits to 1e-5, generated tokens
equal. Each rank appends ``{"where", "max_diff", "tokens_equal"}`` lines to ``OUT/rank<R>.jsonl``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[2]

import fsdp_strategies  # noqa: E402  (registers the strategies)
from finetune_hf import CountingSequences, PretrainedCausalLM  # noqa: E402

IDS = torch.arange(1, 9).reshape(1, 8)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in model.state_dict().items()}


def _plain(module: pl.LightningModule) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(module.hparams.pretrained),
                                             dtype=torch.float32)
    plain.load_state_dict(_full_state(module.model), strict=False)  # rotary tables: not in the state dict
    return plain.eval()


def _record(module: pl.LightningModule, where: str, generate: bool = False) -> None:
    out = Path(os.environ["OUTSIDE_OUT"])
    device = next(module.model.parameters()).device
    ids = IDS.to(device)
    with torch.no_grad():
        got = module.model(input_ids=ids).logits  # the inner model, outside any step
        tokens = module.model.generate(ids, max_new_tokens=4, do_sample=False) if generate else None
    plain = _plain(module)  # gathers every parameter: a collective, called on every rank at the same place
    with torch.no_grad():
        want = plain(input_ids=IDS).logits
        want_tokens = plain.generate(IDS, max_new_tokens=4, do_sample=False) if generate else None
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    record = {"where": where, "training": module.training, "max_diff": float((got.cpu() - want).abs().max()),
              "tokens_equal": None if tokens is None else bool(torch.equal(tokens.cpu(), want_tokens))}
    with (out / f"rank{module.global_rank}.jsonl").open("a") as fh:
        fh.write(json.dumps(record) + "\n")


class Module(PretrainedCausalLM):
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch).logits.argmax(-1)

    def on_validation_epoch_end(self) -> None:
        _record(self, f"on_validation_epoch_end@{self.global_step}")

    def on_train_end(self) -> None:
        _record(self, "on_train_end")


class GenerateSamples(pl.Callback):
    """What a sample-logging callback does: ``pl_module.model.generate`` at the end of each training epoch."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _record(pl_module, f"callback_generate@{trainer.global_step}", generate=True)


def _strategy(name: str) -> Any:
    if name == "hsdp":
        return fsdp_strategies.HSDPStrategy(replicate_degree=2, shard_degree=1)
    if name == "fsdp2_tp":
        return fsdp_strategies.FSDP2Strategy(tensor_parallel_degree=2, tp_plan="auto")
    if name == "ft_hsdp":
        return fsdp_strategies.FTHSDPStrategy(min_replica_size=1, timeout_s=30, connect_timeout_s=10)
    return name


def main() -> None:
    name, out, folder = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    out.mkdir(parents=True, exist_ok=True)
    os.environ["OUTSIDE_OUT"] = str(out)
    pl.seed_everything(0)
    data = DataLoader(CountingSequences(128, 16, 16), batch_size=4)
    trainer = pl.Trainer(strategy=_strategy(name), accelerator="cpu",
                         devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                         max_steps=4, val_check_interval=2, limit_val_batches=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[GenerateSamples()])
    module = Module(folder, init="from_pretrained", lr=1e-3)
    trainer.fit(module, train_dataloaders=data, val_dataloaders=data)
    trainer.validate(module, dataloaders=data, verbose=False)
    preds = trainer.predict(module, dataloaders=DataLoader(CountingSequences(128, 16, 4), batch_size=4))
    assert preds and preds[0].shape[-1] == 16, preds
    _record(module, "after_fit", generate=True)


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
