"""A module built on the meta device made real after sharding, Hugging Face models through their own init.

Lightning's materialisation (``to_empty`` on the root, then ``reset_parameters`` on every submodule that has
one) leaves what a module has no ``reset_parameters`` for as uninitialised memory. Hugging Face models are
made of such modules: ``LlamaRMSNorm``, and the rotary embedding whose ``inv_freq`` is a *non-persistent*
buffer -- never in a checkpoint file, so loading pretrained weights cannot repair it, and a model run with it
is silently wrong. ``transformers`` itself initialises a model through ``PreTrainedModel.initialize_weights``
(each sub-model with its own ``_init_weights``; rotary tables recomputed from the config). Here every
outermost ``PreTrainedModel`` the module holds is initialised that way, on its shards (DTensor
``normal_``/``copy_`` act on each rank's local shard), and everything else as Lightning does.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from itertools import chain

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies.checkpoint.load_into_fsdp import clean_name
from fsdp_strategies.parallel.sharded_init import full_then_shard_random
from fsdp_strategies.parallel.ties import retie, tied_slots

__all__ = ["hf_models", "materialize", "pretrained_model_class"]

_INIT_FLAG = "_is_hf_initialized"


def pretrained_model_class() -> type | None:
    """``transformers.PreTrainedModel`` if its modelling code is loaded (else no module can hold an HF model).

    Never imports anything."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return getattr(modeling, "PreTrainedModel", None) if modeling is not None else None


def hf_models(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(prefix, model) of every outermost ``PreTrainedModel`` in ``module``; the prefix ends with ``.`` (root:
    "")."""
    base = pretrained_model_class()
    if base is None:
        return
    inside: set[int] = set()
    for name, sub in module.named_modules():
        if id(sub) in inside or not isinstance(sub, base):
            continue
        inside.update(id(m) for m in sub.modules())
        cleaned = clean_name(name + ".") if name else ""
        yield cleaned, sub


def _has_own_tensors(module: nn.Module) -> bool:
    return any(True for _ in chain(module.parameters(recurse=False), module.buffers(recurse=False)))


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate the meta tensors of ``module`` on ``device`` and initialise them (see the module docstring).

    Tied weights (GPT-2's head and embedding) are one tensor again afterwards, also where ``to_empty`` split
    them. Random draws on sharded parameters are those of the unsharded model on every device
    (:func:`~fsdp_strategies.parallel.sharded_init.full_then_shard_random`)."""
    if not seam.has_meta_tensors(module):
        return
    with full_then_shard_random():
        _materialize(module, device)


def _materialize(module: nn.Module, device: torch.device) -> None:
    ties = tied_slots(module)
    models = [model for _, model in hf_models(module)]
    if not models:
        seam.materialize_meta_module(module, device)
        retie(ties)
        return
    module.to_empty(device=device)
    retie(ties)
    covered = {id(m) for model in models for m in model.modules()}
    uninitialized = set()
    for sub in module.modules():
        if id(sub) in covered or not _has_own_tensors(sub):
            continue
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            uninitialized.add(type(sub).__name__)
    for model in models:
        for sub in model.modules():  # a fresh init: flags from the meta construction would skip modules
            sub.__dict__.pop(_INIT_FLAG, None)
            for tensor in chain(sub.parameters(recurse=False), sub.buffers(recurse=False)):
                tensor.__dict__.pop(_INIT_FLAG, None)
        with torch.no_grad():
            model.initialize_weights()
    if uninitialized:
        rank_zero_warn(
            "Parameter initialization incomplete: these modules "
            "outside the Hugging Face models have parameters or "
            "buffers but no reset_parameters(), so their memory "
            f"is uninitialised: {', '.join(sorted(uninitialized))}. "
            "Fix: give them a reset_parameters(), load weights "
            "into them, or build them outside configure_model."
        )
