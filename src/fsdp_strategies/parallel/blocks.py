"""Find the transformer blocks of an unmodified model.

Strategies (one FSDP unit per block) and the activation-checkpointing callback (one
checkpoint region per block) must agree on what a "block" is, so both use this module.

Rule: if ``block_class_names`` is given, every submodule whose class name is in it is a block
(the outermost match wins; nested matches are ignored). Otherwise the heuristic finds every
*stack*: an ``nn.ModuleList``/``nn.Sequential`` whose children are at least two instances of
one class that is itself a composite module (it has submodules with parameters, so a list of
bare ``nn.Linear`` is not a stack). This is the ``self.layers = nn.ModuleList([Block(...) ...])``
pattern of Llama, GPT, BERT and ViT, and it finds both stacks of an encoder-decoder (T5's
``encoder.block`` and ``decoder.block``, ``nn.Transformer``'s encoder and decoder layers) and
both towers of a vision-language model. Stacks nested inside a block of another stack (e.g. a
list of MoE experts inside each decoder layer) are part of that block and not split further.
Stacks holding less than :data:`MIN_STACK_FRACTION` of the largest stack's parameters are
ignored (small repeated heads are not worth their own FSDP units).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["MIN_STACK_FRACTION", "BlockNotFoundError", "BlockStack", "find_block_stacks",
           "find_transformer_blocks"]

#: A stack smaller than this fraction of the largest stack (in parameters) is not sharded per block.
MIN_STACK_FRACTION = 0.01


class BlockNotFoundError(ValueError):
    """The model has no submodule matching the requested block classes."""


@dataclass(frozen=True)
class BlockStack:
    """One stack of repeated blocks: where it lives, the blocks' class, the blocks in forward order."""

    path: str
    class_name: str
    blocks: tuple[nn.Module, ...]

    def describe(self) -> str:
        return f"{self.path or '<root>'}: {len(self.blocks)} x {self.class_name}"


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _is_composite(module: nn.Module) -> bool:
    return any(_num_params(child) > 0 for child in module.children())


def _stacks_by_class(model: nn.Module, names: set[str]) -> list[BlockStack]:
    """Outermost modules whose class name is in ``names``, grouped by their parent container."""
    groups: dict[str, list[nn.Module]] = {}
    inside: set[int] = set()
    for path, module in model.named_modules():  # pre-order: parents come before their children
        if id(module) in inside:
            continue
        if type(module).__name__ in names and module is not model:
            groups.setdefault(path.rpartition(".")[0], []).append(module)
            inside.update(id(m) for m in module.modules())
    return [BlockStack(parent, type(blocks[0]).__name__, tuple(blocks)) for parent, blocks in groups.items()]


def _stacks_by_heuristic(model: nn.Module) -> list[BlockStack]:
    stacks: list[BlockStack] = []
    inside: set[int] = set()
    for path, container in model.named_modules():
        if id(container) in inside or not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        if _num_params(container) == 0 or not _is_composite(children[0]):
            continue
        stacks.append(BlockStack(path, type(children[0]).__name__, tuple(children)))
        inside.update(id(m) for m in container.modules())
    if not stacks:
        return []
    largest = max(_num_params(nn.ModuleList(s.blocks)) for s in stacks)
    return [s for s in stacks if _num_params(nn.ModuleList(s.blocks)) >= MIN_STACK_FRACTION * largest]


def find_block_stacks(
    model: nn.Module, block_class_names: Sequence[str] | None = None, *, option: str = "block_class_names"
) -> list[BlockStack]:
    """Every stack of transformer blocks in ``model``, in module registration order.

    Raises :class:`BlockNotFoundError` naming ``option`` when explicit class names match nothing.
    Returns an empty list when the heuristic finds no repeated block (the caller decides).
    """
    if block_class_names:
        names = set(block_class_names)
        stacks = _stacks_by_class(model, names)
        if not stacks:
            present = sorted({type(m).__name__ for m in model.modules() if _num_params(m) > 0})
            raise BlockNotFoundError(
                f"{option}={sorted(names)} matches no submodule of {type(model).__name__}. "
                f"Classes with parameters in this model: {present}. "
                f"Fix: set {option} to the class name of your transformer block, or leave it empty "
                "to use the heuristic (the repeated children of an nn.ModuleList)."
            )
        return stacks
    return _stacks_by_heuristic(model)


def find_transformer_blocks(
    model: nn.Module, block_class_names: Sequence[str] | None = None, *, option: str = "block_class_names"
) -> list[nn.Module]:
    """All blocks of all stacks of ``model``, in module registration order (see :func:`find_block_stacks`)."""
    return [
        block
        for stack in find_block_stacks(model, block_class_names, option=option)
        for block in stack.blocks
    ]


def describe_stacks(stacks: Iterable[BlockStack]) -> str:
    """``"model.layers: 4 x LlamaDecoderLayer; ..."`` for log lines."""
    return "; ".join(s.describe() for s in stacks) or "-"


def class_names(modules: Iterable[nn.Module]) -> list[str]:
    """Sorted distinct class names, for log messages."""
    return sorted({type(m).__name__ for m in modules})
