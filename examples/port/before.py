"""A Lightning project as it is before the port: a small causal LM trained with ``ddp``.

    python examples/port/before.py --devices 2
"""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(pl.LightningModule):
    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def data(vocab: int = 128, n: int = 256, length: int = 33) -> DataLoader:
    """Sequences that count up from a random start (mod vocab): easy to learn."""
    start = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset((start + torch.arange(length)) % vocab), batch_size=16, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--max-steps", type=int, default=30)
    args = parser.parse_args()
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=args.strategy,
                         max_steps=args.max_steps, logger=False, enable_checkpointing=False,
                         enable_model_summary=False)
    trainer.fit(TinyLM(), data())
    print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    main()
