"""What a checkpoint records about the Hugging Face models a LightningModule holds, so it can be exported.

A Lightning checkpoint holds the LightningModule's ``state_dict``: the HF model's keys behind the attribute
that holds it (``model.lm_head.weight``), and nothing that says which ``transformers`` class and config
they belong to. :func:`hf_checkpoint_metadata` records, for every ``transformers.PreTrainedModel`` at the
module's outermost level (a ``T5Stack`` inside a ``T5ForConditionalGeneration`` is part of it, not a model
of its own), the prefix its keys carry in the checkpoint, its class name, its ``config.json`` and its
generation config. The strategies merge the result into the checkpoint dict before a save; in a sharded
folder it travels in Lightning's ``meta.pt`` with the other non-tensor entries, in a full file at the top
level. :mod:`~fsdp_strategies.hf.export` reads it back to write a ``save_pretrained`` folder.

Only plain types (``str``, ``list``, ``dict``) go in, so the package's restricted unpicklers read it back.

Limits: the class is recorded by name; a model class that ``transformers`` does not export (remote code,
a user subclass) is recorded but needs ``--hf-config`` with a known architecture to be exported.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fsdp_strategies.hf.materialize import pretrained_model_class

__all__ = ["HF_METADATA_KEY", "hf_checkpoint_metadata", "hf_model_records"]

#: The checkpoint dict's entry that holds the records (a list of dicts, one per HF model).
HF_METADATA_KEY = "fsdp_strategies_hf_models"


def _outermost(module: nn.Module, base: type) -> list[tuple[str, nn.Module]]:
    """``(path, model)`` for every ``base`` instance not nested inside another one, in module order."""
    found: list[tuple[str, nn.Module]] = []
    for path, sub in module.named_modules():  # parents before children; a shared module once
        if isinstance(sub, base) and not any(p == "" or path.startswith(p + ".") for p, _ in found):
            found.append((path, sub))
    return found


def _key_prefix(outer: dict[str, Any], inner: dict[str, Any], path: str) -> str:
    """The prefix the model's keys carry in the outer module's ``state_dict``.

    Found by identity (the same tensor under ``prefix + key``), so wrapper tokens the outer state dict keeps
    (``_orig_mod.`` of ``torch.compile``) are kept and those a state-dict hook strips
    (``_checkpoint_wrapped_module.``) are not; the module path is the fallback for a model without tensors.
    """
    for key, value in inner.items():
        for outer_key, outer_value in outer.items():
            if outer_value is value and outer_key.endswith(key):
                return outer_key[: len(outer_key) - len(key)]
    return f"{path}." if path else ""


def hf_checkpoint_metadata(module: nn.Module) -> dict[str, Any]:
    """The entry to merge into a Lightning checkpoint dict that records the HF models ``module`` holds.

    Args:
        module: the LightningModule (or any ``nn.Module``) being checkpointed.

    Returns:
        ``{HF_METADATA_KEY: [record, ...]}`` with one record per outermost ``transformers.PreTrainedModel``
        (``prefix``, ``class_name``, ``config`` as JSON, ``generation_config`` as JSON when the model has
        one), or ``{}`` when ``transformers`` is not loaded or the module holds no HF model.
    """
    base = pretrained_model_class()
    if base is None:
        return {}
    models = _outermost(module, base)
    if not models:
        return {}
    outer = module.state_dict(keep_vars=True)
    records: list[dict[str, str]] = []
    for path, model in models:
        record = {
            "prefix": _key_prefix(outer, model.state_dict(keep_vars=True), path),
            "class_name": type(model).__name__,
            "config": model.config.to_json_string(),
        }
        generation = getattr(model, "generation_config", None)
        if generation is not None and model.can_generate():
            record["generation_config"] = generation.to_json_string()
        records.append(record)
    return {HF_METADATA_KEY: records}


def hf_model_records(checkpoint_extras: dict[str, Any], source: str) -> list[dict[str, str]]:
    """The records :func:`hf_checkpoint_metadata` left in a checkpoint's non-tensor entries, checked for
    shape.

    Args:
        checkpoint_extras: the checkpoint dict (a full file) or its ``meta.pt`` (a sharded folder).
        source: the checkpoint's path, for the error message.

    Returns:
        The records, ``[]`` when the checkpoint has none.
    """
    records = checkpoint_extras.get(HF_METADATA_KEY, [])
    fields = ("prefix", "class_name", "config")
    if not isinstance(records, list) or not all(
        isinstance(r, dict) and all(isinstance(r.get(f), str) for f in fields) for r in records
    ):
        raise ValueError(
            f"{source}: its '{HF_METADATA_KEY}' entry is malformed (expected a list of records with "
            f"{', '.join(fields)}). Fix: export with --hf-config DIR (the model's config.json folder)."
        )
    return records
