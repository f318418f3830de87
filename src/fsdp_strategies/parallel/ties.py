"""Tied weights (one parameter registered under several names, e.g. GPT-2's head and embedding) kept tied.

``nn.Module.to_empty`` gives every slot of a shared parameter its own tensor, and distributing a module for
tensor parallelism gives its parameter a new object: either silently unties the weights. :func:`tied_slots`
records the slots before such a transform, :func:`retie` shares one tensor among them again afterwards.
"""

from __future__ import annotations

from torch import nn

__all__ = ["retie", "tied_slots"]

Slots = list[list[tuple[nn.Module, str]]]


def tied_slots(module: nn.Module) -> Slots:
    """The (owner, attribute) slots of every parameter registered under more than one name."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        slots.setdefault(id(param), []).append((module.get_submodule(owner), attr))
    return [group for group in slots.values() if len(group) > 1]


def retie(groups: Slots) -> None:
    """Make each group's slots one parameter again: the first distributed (DTensor) one, else the first."""
    from torch.distributed.tensor import DTensor

    for group in groups:
        current = [getattr(owner, attr) for owner, attr in group]
        shared = next((p for p in current if isinstance(p, DTensor)), current[0])
        for owner, attr in group:
            if getattr(owner, attr) is not shared:
                setattr(owner, attr, shared)
