"""Block detection on models nobody here wrote: every stack, nested stacks, explicit names."""

from __future__ import annotations

import pytest
from torch import nn

from fsdp_strategies.parallel.blocks import (
    BlockNotFoundError,
    describe_stacks,
    find_block_stacks,
    find_transformer_blocks,
)
from matrix.models import MODELS

pytest.importorskip("transformers")


def _stacks(model: nn.Module) -> list[tuple[str, str, int]]:
    return [(s.path, s.class_name, len(s.blocks)) for s in find_block_stacks(model)]


def test_every_stack_of_the_matrix_models() -> None:
    expected = {
        "hf_llama": [("model.model.layers", "LlamaDecoderLayer", 2)],
        "hf_gpt2": [("model.transformer.h", "GPT2Block", 2)],
        "hf_bert": [("model.bert.encoder.layer", "BertLayer", 2)],
        "hf_t5": [("model.encoder.block", "T5Block", 2), ("model.decoder.block", "T5Block", 3)],
        "hf_vit": [("model.vit.layers", "ViTLayer", 2)],
        "lightning_demo": [("model.transformer.encoder.layers", "TransformerEncoderLayer", 2),
                           ("model.transformer.decoder.layers", "TransformerDecoderLayer", 2)],
    }
    for name, stacks in expected.items():
        assert _stacks(MODELS[name].build()) == stacks, name


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.experts = nn.ModuleList([Expert() for _ in range(4)])


class VisionLanguage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.ModuleList([MoEBlock() for _ in range(2)])
        self.language = nn.ModuleList([MoEBlock() for _ in range(3)])
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # bare Linears: not a stack
        # < 1% of the largest
        self.tiny = nn.ModuleList([nn.Sequential(nn.Linear(1, 1), nn.ReLU()) for _ in range(2)])


def test_towers_are_found_nested_stacks_stay_inside_their_block_and_bare_layers_are_not_blocks() -> None:
    model = VisionLanguage()
    assert _stacks(model) == [("vision", "MoEBlock", 2), ("language", "MoEBlock", 3)]
    assert describe_stacks(find_block_stacks(model)) == "vision: 2 x MoEBlock; language: 3 x MoEBlock"
    assert len(find_transformer_blocks(model)) == 5


def test_explicit_names_win_and_are_grouped_by_stack() -> None:
    model = VisionLanguage()
    assert [(s.path, len(s.blocks)) for s in find_block_stacks(model, ["Expert"])] == [
        ("vision.0.experts", 4), ("vision.1.experts", 4), ("language.0.experts", 4),
        ("language.1.experts", 4), ("language.2.experts", 4)]
    with pytest.raises(BlockNotFoundError, match=r"block_class_names=\['Nope'\] matches no submodule.*Fix:"):
        find_block_stacks(model, ["Nope"])
