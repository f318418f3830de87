"""The models of the real-models matrix, as an ordinary user would write them for Lightning.

Each is an unmodified, plain LightningModule around a model nobody here wrote: Hugging Face
``transformers`` classes with tiny random configs (built from a config, nothing downloaded),
Lightning's own demo ``LightningTransformer``, and this repo's example ``LlamaLM``. Dropout is
set to 0 so that every strategy can be compared step for step with Lightning's ``ddp``.

``MODELS[name]`` gives a :class:`ModelSpec`: how to build the module, a deterministic dataset,
the block class every sharded strategy must wrap (with the count per stack), and the numbers
the analytic FLOP formula needs (where one exists).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB, SEQ, DIM, HEADS, FFN, LAYERS = 128, 16, 64, 4, 128, 2
LR = 1e-2


class TokenSequences(Dataset):
    """Learnable token sequences: x[t+1] = (a * x[t] + b) % VOCAB with a per-sample (a, b)."""

    def __init__(self, n: int = 64, seq: int = SEQ, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n,), generator=g)
        a = torch.randint(1, 4, (n,), generator=g)
        rows = [start]
        for _ in range(seq - 1):
            rows.append((a * rows[-1] + 1) % VOCAB)
        self.data = torch.stack(rows, dim=1)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> Any:
        return self.data[i]


class Pairs(TokenSequences):
    """(input, target) pairs for seq2seq models: the target is the input reversed."""

    def __getitem__(self, i: int) -> Any:
        x = self.data[i]
        return x, x.flip(0)


class Images(Dataset):
    """16x16 RGB images whose class is the brightest of 10 fixed patterns."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 10, (n,), generator=g)
        patterns = torch.randn(10, 3, 16, 16, generator=g)
        self.images = patterns[self.labels] + 0.5 * torch.randn(n, 3, 16, 16, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Any:
        return self.images[i], self.labels[i]


class ImageCaptions(Images):
    """(image, caption) pairs for contrastive models: the caption is a token pattern of the image's class,
    ending with the end-of-text token ``VOCAB - 1`` (where CLIP's text tower pools)."""

    def __getitem__(self, i: int) -> Any:
        label = int(self.labels[i])
        caption = (label * 7 + 3 * torch.arange(SEQ // 2)) % (VOCAB - 1)
        caption[-1] = VOCAB - 1
        return self.images[i], caption


def provide_demo_text(folder: str | os.PathLike[str]) -> None:
    """Lightning's demo ``LightningTransformer`` downloads WikiText2 in ``prepare_data`` unless
    ``./data/wikitext-2.txt`` exists; there is no network here, so a small local text stands in (the
    module itself is unchanged). Call from the process's working folder ``folder`` (made the cwd)."""
    os.chdir(folder)
    path = os.path.join("data", "wikitext-2.txt")
    os.makedirs("data", exist_ok=True)
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        with open(path + f".{os.getpid()}", "w") as f:
            f.write("the quick brown fox jumps over the lazy dog\n" * 50)
        os.replace(path + f".{os.getpid()}", path)


def _no_dropout(module: nn.Module) -> nn.Module:
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
    return module


class _HFModule(pl.LightningModule):
    """What a user writes around a Hugging Face model: build it in ``__init__``, return ``.loss``."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.model = _no_dropout(build())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


class HFCausalLM(_HFModule):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss


class HFMaskedLM(_HFModule):
    MASK = 3

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        positions = torch.arange(batch.shape[1], device=batch.device) % 4 == 1
        inputs = batch.masked_fill(positions, self.MASK)
        labels = batch.masked_fill(~positions, -100)
        return self.model(input_ids=inputs, labels=labels).loss


class HFSeq2Seq(_HFModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return self.model(input_ids=inputs, labels=targets).loss


class HFImageClassifier(_HFModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return self.model(pixel_values=images, labels=labels).loss


class HFContrastive(_HFModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, captions = batch
        return self.model(input_ids=captions, pixel_values=images, return_loss=True).loss


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN,
                                        num_hidden_layers=LAYERS,
                                        num_attention_heads=HEADS, num_key_value_heads=2,
                                        max_position_embeddings=64))


def _qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN,
                                        num_hidden_layers=LAYERS,
                                        num_attention_heads=HEADS, num_key_value_heads=2,
                                        max_position_embeddings=64,
                                        use_sliding_window=True, sliding_window=8, max_window_layers=1))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=DIM, n_layer=LAYERS, n_head=HEADS,
                                      n_positions=64,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN,
                                      num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, max_position_embeddings=64,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=DIM, d_kv=DIM // HEADS, d_ff=FFN,
                                               num_layers=2,
                                               num_decoder_layers=3, num_heads=HEADS, dropout_rate=0.0,
                                               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=DIM,
                                               intermediate_size=FFN,
                                               num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                               num_labels=10,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _clip() -> nn.Module:
    # two towers and a 0-d parameter (``logit_scale``), which fully_shard cannot shard
    from transformers import CLIPConfig, CLIPModel

    text = {"vocab_size": VOCAB, "hidden_size": DIM, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "max_position_embeddings": SEQ, "attention_dropout": 0.0,
            "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": VOCAB - 1}
    vision = {"image_size": 16, "patch_size": 4, "hidden_size": DIM, "intermediate_size": FFN,
              "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "attention_dropout": 0.0}
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32))


def _lightning_demo() -> pl.LightningModule:
    from lightning.pytorch.demos.transformer import LightningTransformer

    return _no_dropout(LightningTransformer(vocab_size=VOCAB))


def _example_llama() -> pl.LightningModule:
    from llama import LlamaLM

    return LlamaLM(
        vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=HEADS, max_seq_len=SEQ, lr=LR, warmup_steps=1
    )


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[[], pl.LightningModule]
    dataset: Callable[[], Dataset]
    #: block class name -> number of blocks of that class every sharded strategy must wrap
    blocks: dict[str, int]
    #: for the analytic FLOP formula: (layers, attention width); None: no formula for this model
    attention: tuple[int, int] | None = None
    #: tokens in one sample (for the formula)
    seq: int = SEQ
    #: the strategy whose losses are the reference (the one the module was written for)
    reference: str = "ddp"
    #: the model builds its layers in configure_model: sharded strategies build them on the meta device
    #: and materialise them with ``reset_parameters``, which draws other random weights than an eager
    #: build, so only training (finite, falling losses) is compared, not step-for-step equality
    meta_init: bool = False


MODELS: dict[str, ModelSpec] = {
    "hf_llama": ModelSpec(lambda: HFCausalLM(_llama), TokenSequences, {"LlamaDecoderLayer": LAYERS},
                          (LAYERS, DIM)),
    "hf_qwen2": ModelSpec(lambda: HFCausalLM(_qwen2), TokenSequences, {"Qwen2DecoderLayer": LAYERS},
                          (LAYERS, DIM)),
    "hf_gpt2": ModelSpec(lambda: HFCausalLM(_gpt2), TokenSequences, {"GPT2Block": LAYERS}, (LAYERS, DIM)),
    "hf_bert": ModelSpec(lambda: HFMaskedLM(_bert), TokenSequences, {"BertLayer": LAYERS}, (LAYERS, DIM)),
    "hf_t5": ModelSpec(lambda: HFSeq2Seq(_t5), Pairs, {"T5Block": 5}),
    "hf_vit": ModelSpec(lambda: HFImageClassifier(_vit), Images, {"ViTLayer": LAYERS}),
    "hf_clip": ModelSpec(lambda: HFContrastive(_clip), ImageCaptions, {"CLIPEncoderLayer": 2 * LAYERS}),
    "lightning_demo": ModelSpec(_lightning_demo, Pairs,
                                {"TransformerEncoderLayer": 2, "TransformerDecoderLayer": 2}),
    "example_llama": ModelSpec(_example_llama, TokenSequences, {"TransformerBlock": LAYERS}, (LAYERS, DIM)),
}


def matmul_weight_params(module: nn.Module) -> int:
    """Parameters of every matmul weight (nn.Linear, HF Conv1D): the N of ``6 * N * tokens``."""
    return sum(m.weight.numel() for m in module.modules()
               if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")


class ModelParallelStyleLM(pl.LightningModule):
    """A ``configure_model`` written for Lightning's ``ModelParallelStrategy``: it calls ``fully_shard``
    itself, per block and on the network its step calls, on ``self.device_mesh["data_parallel"]``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _example_llama()
        self.inner.configure_model()  # built and initialised here; configure_model only shards

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.inner.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.inner.model, mesh=mesh)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.inner._loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


MODELS["mps_style_llama"] = ModelSpec(ModelParallelStyleLM, TokenSequences, {"TransformerBlock": LAYERS},
                                      (LAYERS, DIM), seq=SEQ - 1, reference="lightning_mp")
MODELS["example_llama"] = ModelSpec(
    _example_llama, TokenSequences, {"TransformerBlock": LAYERS}, (LAYERS, DIM), seq=SEQ - 1, meta_init=True
)
