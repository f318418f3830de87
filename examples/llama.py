"""A Llama-style decoder LM as a plain LightningModule, and a learnable synthetic dataset.

Nothing here knows about fsdp_strategies: this is the "existing Lightning project" that the
strategies and callbacks must scale without changes.

Model: token embedding -> N x TransformerBlock (RMSNorm, causal SDPA attention with rotary
embeddings and grouped-query heads, RMSNorm, SwiGLU MLP) -> RMSNorm -> LM head. Blocks live in
``self.model.layers`` (an ``nn.ModuleList``). The network is built in ``configure_model`` so a
sharding strategy can construct it on the meta device; every module has ``reset_parameters``, and
that is where the initialisation lives (normal with ``init_std``, output projections scaled by
1/sqrt(2 * n_layers)): a strategy that materialises meta modules calls exactly these, so the
model starts from the same distribution whether it is built eagerly or on the meta device.

Data: sequences from a fixed random Markov chain over ``vocab_size`` tokens (each context of
the last ``order`` tokens has ``branching`` possible successors; ``order=2`` needs attention). It needs no
download, is generated identically on every rank from a seed, and its loss falls from ln(vocab) towards
the chain's entropy rate, which the DataModule reports.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    """cos/sin tables as non-persistent buffers, rebuilt by ``reset_parameters`` after meta init."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.cos.device.type == "meta":
            return
        with torch.no_grad():
            inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32,
                                                     device=self.cos.device) / self.head_dim))
            angles = torch.outer(
                torch.arange(self.max_seq_len, dtype=torch.float32, device=self.cos.device), inv
            )
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, heads, seq, head_dim)
        seq = x.shape[-2]
        cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class _NormalInit:
    """``reset_parameters`` draws the weight from N(0, std) when ``std`` is set (else the layer's default)."""

    std: float | None
    weight: torch.Tensor

    def reset_parameters(self) -> None:
        if self.std is None:
            super().reset_parameters()  # type: ignore[misc]
        else:
            nn.init.normal_(self.weight, std=self.std)


class Linear(_NormalInit, nn.Linear):
    def __init__(self, in_features: int, out_features: int, std: float | None = None) -> None:
        self.std = std
        super().__init__(in_features, out_features, bias=False)


class Embedding(_NormalInit, nn.Embedding):
    def __init__(self, num_embeddings: int, dim: int, std: float | None = None) -> None:
        self.std = std
        super().__init__(num_embeddings, dim)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, max_seq_len: int, std: float | None = None,
                 out_std: float | None = None) -> None:
        super().__init__()
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"dim={dim} must divide by n_heads={n_heads}, and n_heads by n_kv_heads={n_kv_heads}"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = Linear(dim, n_heads * self.head_dim, std)
        self.wk = Linear(dim, n_kv_heads * self.head_dim, std)
        self.wv = Linear(dim, n_kv_heads * self.head_dim, std)
        self.wo = Linear(n_heads * self.head_dim, dim, out_std)
        self.rope = RotaryEmbedding(self.head_dim, max_seq_len)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # heads from the projections' widths (-1), not n_heads: under tensor parallelism each rank holds a
        # slice
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = self.rope(q), self.rope(k)
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, std: float | None = None, out_std: float | None = None) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden, std)
        self.w3 = Linear(dim, hidden, std)
        self.w2 = Linear(hidden, dim, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, mlp_hidden: int, max_seq_len: int,
                 std: float | None = None, out_std: float | None = None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads, max_seq_len, std, out_std)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, mlp_hidden, std, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(
        self, vocab_size: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, mlp_hidden: int,
        max_seq_len: int, init_std: float | None = None,
    ) -> None:
        super().__init__()
        out_std = None if init_std is None else init_std / math.sqrt(2 * n_layers)
        self.embed = Embedding(vocab_size, dim, init_std)
        self.layers = nn.ModuleList(
            TransformerBlock(dim, n_heads, n_kv_heads, mlp_hidden, max_seq_len, init_std, out_std)
            for _ in range(n_layers)
        )
        self.norm = RMSNorm(dim)
        self.head = Linear(dim, vocab_size, init_std)
        self.n_layers = n_layers

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class LlamaLM(pl.LightningModule):
    """Next-token prediction with AdamW and linear warm-up + cosine decay, sized from YAML.

    Sizes: ~3M parameters with the defaults (CPU); ``dim=2048, n_layers=16, n_heads=16,
    mlp_hidden=5632, vocab_size=32000`` is ~1.1B (GPU).
    """

    def __init__(
        self,
        vocab_size: int = 128,
        dim: int = 256,
        n_layers: int = 4,
        n_heads: int = 8,
        n_kv_heads: int | None = None,
        mlp_hidden: int | None = None,
        max_seq_len: int = 128,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Llama | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        h = self.hparams
        mlp_hidden = h.mlp_hidden or int(8 * h.dim / 3 / 64 + 0.999) * 64
        # The init lives in the modules' reset_parameters: applied here when built eagerly, and again by a
        # strategy that builds on the meta device and materialises shard by shard.
        self.model = Llama(h.vocab_size, h.dim, h.n_layers, h.n_heads, h.n_kv_heads or h.n_heads, mlp_hidden,
                           h.max_seq_len, init_std=h.init_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=False)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        h = self.hparams
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": h.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=h.lr,
            betas=(0.9, 0.95),
            foreach=True,
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = min(h.warmup_steps, total)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return h.min_lr_ratio + (1 - h.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class MarkovSequences(Dataset):
    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return self.data.size(0)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


def markov_chain(
    vocab_size: int, branching: int, concentration: float, seed: int, order: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Successor tokens and their probabilities for each context of the last ``order`` tokens.

    Shapes: ``(V,) * order + (branching,)``.
    """
    g = torch.Generator().manual_seed(seed)
    shape = (vocab_size,) * order + (branching,)
    successors = torch.randint(0, vocab_size, shape, generator=g)
    # Dirichlet(concentration) via normalised Gamma draws from numpy's seeded generator: the data
    # must not depend on (or disturb) the global RNG that seeds the model's initialisation.
    gamma = np.random.default_rng(seed).gamma(concentration, size=shape)
    probs = torch.from_numpy(gamma / gamma.sum(-1, keepdims=True)).float()
    return successors, probs


def sample_sequences(
    successors: torch.Tensor, probs: torch.Tensor, n: int, length: int, seed: int
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    vocab, order = successors.size(0), successors.dim() - 1
    out = torch.empty(n, length, dtype=torch.long)
    out[:, :order] = torch.randint(0, vocab, (n, order), generator=g)
    for t in range(order, length):
        context = tuple(out[:, t - order + i] for i in range(order))
        choice = torch.multinomial(probs[context], 1, generator=g).squeeze(1)
        out[:, t] = successors[context][torch.arange(n), choice]
    return out


class MarkovDataModule(pl.LightningDataModule):
    """Learnable token sequences, generated at run time from ``seed`` (identical on every rank)."""

    def __init__(
        self,
        vocab_size: int = 128,
        seq_len: int = 128,
        num_train: int = 8192,
        num_val: int = 256,
        batch_size: int = 16,
        branching: int = 4,
        concentration: float = 0.5,
        order: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_data: torch.Tensor | None = None
        self.val_data: torch.Tensor | None = None

    def setup(self, stage: str) -> None:
        if self.train_data is not None:
            return
        h = self.hparams
        successors, probs = markov_chain(h.vocab_size, h.branching, h.concentration, h.seed, h.order)
        data = sample_sequences(successors, probs, h.num_train + h.num_val, h.seq_len + 1, h.seed + 1)
        self.train_data, self.val_data = data[: h.num_train], data[h.num_train :]
        # entropy rate of the chain (nats/token, averaged over contexts): the loss floor
        self.entropy_floor = float(-(probs * probs.clamp_min(1e-12).log()).sum(-1).mean())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            MarkovSequences(self.train_data),
            batch_size=self.hparams.batch_size,
            shuffle=self.hparams.shuffle,
            num_workers=self.hparams.num_workers,
            drop_last=True,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            MarkovSequences(self.val_data),
            batch_size=self.hparams.batch_size,
            num_workers=self.hparams.num_workers,
        )
