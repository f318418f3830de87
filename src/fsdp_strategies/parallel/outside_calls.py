"""Submodules of an FSDP root called on their own, outside the root's ``forward``, gather what the root holds.

FSDP2 gathers a unit's parameters in that unit's forward hooks. The root unit (in Lightning, the
LightningModule) holds the parameters no block unit holds -- embeddings, final norm, head -- and its hooks run
only when the root itself is called. A LightningModule that calls its inner model directly outside a routed
step (``self.model(...)`` in ``on_train_end``, ``pl_module.model.generate(...)`` in a callback, an evaluation
after ``fit``) reaches those modules with the root's parameters still sharded, and torch fails with "got mixed
torch.Tensor and DTensor" (or "different meshes" under tensor parallelism).

:class:`GatherOnOutsideCall` keeps the model as FSDP2 built it (one root unit: the step's communication is
unchanged) and adds a forward pre-hook to each module that owns parameters of the root unit: called while the
root's forward is not running, it gathers the root's parameters first (``FSDPModule.unshard()``, a collective:
every rank calls the model at the same place, as FSDP2 requires of any call). They then stay gathered, as
FSDP2 leaves its root after a forward without backward, until the next step's backward reshards them. Inside a
step the hook only reads a flag. Block units gather themselves as in any forward.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["GatherOnOutsideCall", "nested_unit_params", "root_owned_modules"]


def nested_unit_params(unit: nn.Module) -> set[int]:
    """The ids of the parameters held by the FSDP units nested below ``unit`` (not ``unit``'s own)."""
    return {id(p) for sub in unit.modules() if sub is not unit and isinstance(sub, FSDPModule)
            for p in sub.parameters()}


def root_owned_modules(root: nn.Module) -> list[nn.Module]:
    """The submodules of ``root`` (not ``root`` itself) that own a parameter of ``root``'s unit: a parameter
    set on them that no FSDP unit below ``root`` holds (0-d parameters left out of FSDP excluded: they are
    never sharded)."""
    below = nested_unit_params(root)
    owners = []
    for sub in root.modules():
        if sub is root or isinstance(sub, FSDPModule):
            continue
        if any(id(p) not in below and p.dim() > 0 for p in sub.parameters(recurse=False)):
            owners.append(sub)
    return owners


class GatherOnOutsideCall:
    """Forward pre-hooks that gather ``root``'s parameters when one of their owners is called outside its
    forward.

    Constructing it installs the hooks, for the life of the wrapped model (once per model)."""

    def __init__(self, root: FSDPModule) -> None:
        self._root = root
        self._depth = 0
        module: Any = root
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._leave, always_call=True)
        for owner in root_owned_modules(module):
            owner.register_forward_pre_hook(self._gather)

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._depth += 1

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1

    def _gather(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0:
            self._root.unshard()
