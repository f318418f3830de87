"""Fine-tune a pretrained Hugging Face causal LM under ``fsdp2`` with LightningCLI, then export it back to HF.

    python examples/finetune_hf.py --make-tiny outputs/tiny-llama        # tiny HF folder, no download
    python examples/finetune_hf.py fit --config configs/finetune_hf.yaml  # fine-tune it on 2 CPU ranks
    fsdp-strategies-export outputs/finetune_hf/checkpoints/epoch=0-step=20.ckpt outputs/finetune_hf/hf \\
        --format hf
    python -c "import transformers as t; t.AutoModelForCausalLM.from_pretrained('outputs/finetune_hf/hf')"

The LightningModule is written as for Lightning's ``ddp``: ``from_pretrained`` in ``configure_model``. Under
``fsdp2``/``hsdp``/``ft_hsdp`` that call builds the model on the meta device and each rank reads only its own
shards of the safetensors files. ``--model.init from_config`` builds it from the config instead, for projects
that name the weights in the strategy's YAML (``pretrained: DIR``). Point ``--model.pretrained`` at any local
``save_pretrained`` folder of a causal LM (download a Hub model first with
``hf download ID --local-dir DIR``).
"""

from __future__ import annotations

import sys
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset

import fsdp_strategies  # noqa: F401  (registers the strategy names)
from fsdp_strategies.cli import ArgumentParser


class PretrainedCausalLM(pl.LightningModule):
    """A Hugging Face causal LM fine-tuned with next-token loss.

    Args:
        pretrained: the local ``save_pretrained`` folder to start from.
        init: ``from_pretrained`` (the usual idiom) or ``from_config`` (random weights; the strategy's
            ``pretrained`` option then loads the folder).
        lr: AdamW learning rate.
    """

    def __init__(self, pretrained: str, init: Literal["from_pretrained", "from_config"] = "from_pretrained",
                 lr: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.hparams.init == "from_pretrained":
            self.model = AutoModelForCausalLM.from_pretrained(self.hparams.pretrained, dtype=torch.float32)
        else:
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.hparams.pretrained),
                                                          dtype=torch.float32)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class CountingSequences(Dataset):
    """Token sequences x[t+1] = (x[t] + step) % vocab with a per-sample start and step: learnable,
    deterministic."""

    def __init__(self, vocab_size: int, seq_len: int, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.data = (start + step * torch.arange(seq_len)) % vocab_size

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class SequenceData(pl.LightningDataModule):
    """Synthetic token sequences within the pretrained model's vocabulary.

    Args:
        vocab_size: tokens are drawn below this (at most the model's vocabulary).
        seq_len: tokens per sequence.
        batch_size: sequences per batch and rank.
        num_train: sequences in the training set.
    """

    def __init__(
        self, vocab_size: int = 128, seq_len: int = 32, batch_size: int = 4, num_train: int = 256
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        return DataLoader(CountingSequences(h.vocab_size, h.seq_len, h.num_train), batch_size=h.batch_size)


def make_tiny(folder: str, arch: str = "llama", seed: int = 0) -> str:
    """Write a tiny randomly initialised ``save_pretrained`` folder (``llama`` or ``gpt2``); nothing is
    downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2,
                                             max_position_embeddings=64, tie_word_embeddings=False))
    model.save_pretrained(folder)
    return folder


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(PretrainedCausalLM, SequenceData, args=args, save_config_kwargs={"overwrite": True},
                        parser_class=ArgumentParser)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--make-tiny":
        print(f"wrote {make_tiny(sys.argv[2], *(sys.argv[3:4] or []))}")
        sys.exit(0)
    main()
    import torch.distributed as dist

    if dist.is_initialized():  # gloo subgroups left to interpreter exit can abort the process (SIGABRT)
        dist.destroy_process_group()
