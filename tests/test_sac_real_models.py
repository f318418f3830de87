"""ActivationCheckpointing on a Hugging Face Llama with its defaults (``use_cache=True``), single device."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from fsdp_strategies.callbacks import ActivationCheckpointing
from fsdp_strategies.parallel.activation_checkpointing import (
    RecomputationMismatchError,
    apply_activation_checkpointing,
)
from fsdp_strategies.testing import KeptBytes
from matrix.models import MODELS, TokenSequences

pytest.importorskip("transformers")


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.use_cache_in_validation: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.losses.append(float(outputs["loss"]))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):  # type: ignore[no-untyped-def]
        self.use_cache_in_validation.append(pl_module.model.config.use_cache)


class LlamaWithValidation(MODELS["hf_llama"].build().__class__):  # type: ignore[misc]
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)


def _fit(callbacks: list[pl.Callback]) -> tuple[Recorder, pl.LightningModule]:
    from matrix.models import _llama

    pl.seed_everything(0, verbose=False)
    model = LlamaWithValidation(_llama)
    assert model.model.config.use_cache is True  # the HF default, left as it is
    recorder = Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, val_check_interval=2, limit_val_batches=1,
                         callbacks=[recorder, *callbacks], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    data = DataLoader(TokenSequences(), batch_size=4)
    trainer.fit(model, train_dataloaders=data, val_dataloaders=data)
    return recorder, model


@pytest.mark.parametrize("mode", ["selective_op", "full", "selective_layer"])
def test_defaults_train_hf_llama_with_its_cache_on_and_match_no_checkpointing(mode: str) -> None:
    plain, _ = _fit([])
    sac = ActivationCheckpointing() if mode == "selective_op" else ActivationCheckpointing(mode=mode)  # type: ignore[arg-type]
    checkpointed, model = _fit([sac])
    assert len(sac.checkpointed) == (2 if mode != "selective_layer" else 1)
    assert checkpointed.losses == pytest.approx(plain.losses, rel=1e-6)
    # The cache is off for training steps only: on in validation, and as the user left it after fit.
    assert checkpointed.use_cache_in_validation == [True, True]
    assert model.model.config.use_cache is True


def _kept_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    pinned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept = KeptBytes()
    with kept:
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
    result = kept.alive(pinned)
    loss.backward()
    return result


def test_saved_bytes_none_above_selective_op_above_full_on_hf_llama() -> None:
    torch.manual_seed(0)
    base = MODELS["hf_llama"].build().model
    tokens = TokenSequences(n=4, seq=64).data
    kept = {}
    for mode in ("none", "selective_op", "full"):
        model = copy.deepcopy(base)
        if mode != "none":
            assert len(apply_activation_checkpointing(model, mode)) == 2  # type: ignore[arg-type]
        kept[mode] = _kept_bytes(model, tokens)
    assert kept["none"] > kept["selective_op"] > kept["full"], kept


class Counter(nn.Module):
    """A block whose forward depends on global state: a step counter that changes in every call."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Counter.calls += 1
        h = self.a(x)
        return self.b(h.relu()) if Counter.calls % 2 else self.b(h.tanh()) * 2


class CounterModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Counter(), Counter()])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = batch.float()[:, :8]
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_forward_that_changes_between_forward_and_recompute_gets_a_clear_error() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[ActivationCheckpointing()],
                         logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RecomputationMismatchError,
                       match=r"recomputing Counter in backward did not replay its forward.*"
                                                      r"global state.*Fix:"):
        trainer.fit(CounterModule(), train_dataloaders=DataLoader(TokenSequences(), batch_size=4))
