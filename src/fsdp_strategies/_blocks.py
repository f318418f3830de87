"""Find the transformer blocks of an unmodified model.

Strategies (one FSDP unit per block) and the activation-checkpointing callback (one
checkpoint region per block) must agree on what a "block" is, so both use this module.

Rule: if ``block_class_names`` is given, every submodule whose class name is in it is a block
(the outermost match wins; nested matches are ignored). Otherwise the heuristic is: the
largest ``nn.ModuleList``/``nn.Sequential`` whose children are at least two instances of one
class that holds parameters -- the ``self.layers = nn.ModuleList([Block(...) for _ in ...])``
pattern of Llama, GPT, ViT and most transformer code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

__all__ = ["BlockNotFoundError", "find_transformer_blocks"]


class BlockNotFoundError(ValueError):
    """The model has no submodule matching the requested block classes."""


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _blocks_by_class(model: nn.Module, names: set[str]) -> list[nn.Module]:
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # pre-order: parents come before their children
        if id(module) in inside:
            continue
        if type(module).__name__ in names and module is not model:
            blocks.append(module)
            inside.update(id(m) for m in module.modules())
    return blocks


def _blocks_by_heuristic(model: nn.Module) -> list[nn.Module]:
    best: list[nn.Module] = []
    best_params = 0
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        params = _num_params(container)
        if params > best_params:
            best, best_params = children, params
    return best


def find_transformer_blocks(
    model: nn.Module, block_class_names: Sequence[str] | None = None, *, option: str = "block_class_names"
) -> list[nn.Module]:
    """Return the model's transformer blocks in forward order (module registration order).

    Raises :class:`BlockNotFoundError` naming ``option`` when explicit class names match nothing.
    Returns an empty list when the heuristic finds no repeated block (the caller decides).
    """
    if block_class_names:
        names = set(block_class_names)
        blocks = _blocks_by_class(model, names)
        if not blocks:
            present = sorted({type(m).__name__ for m in model.modules() if _num_params(m) > 0})
            raise BlockNotFoundError(
                f"{option}={sorted(names)} matches no submodule of {type(model).__name__}. "
                f"Classes with parameters in this model: {present}. "
                f"Fix: set {option} to the class name of your transformer block, or leave it empty "
                "to use the heuristic (the repeated children of an nn.ModuleList)."
            )
        return blocks
    return _blocks_by_heuristic(model)


def class_names(modules: Iterable[nn.Module]) -> list[str]:
    """Sorted distinct class names, for log messages."""
    return sorted({type(m).__name__ for m in modules})
