"""A ``save_pretrained`` folder (safetensors) read straight into a sharded model: each rank reads its own
shards.

The model was built on the meta device, sharded (every parameter a DTensor holding this rank's piece) and
materialised (:mod:`fsdp_strategies.hf.materialize`). Its sharded ``state_dict`` is then filled by
``torch.distributed.checkpoint.load`` through DCP's ``HuggingFaceStorageReader``: each read request is a slice
of one safetensors tensor (``safe_open(...).get_slice``, memory-mapped), so a rank touches only the bytes of
its own shards, and a bf16 file lands in fp32 parameters by ``copy_`` (or the reverse). No rank ever holds
the full model.

Keys are matched before anything is read:

* the file's keys are those of the HF model (``model.layers.0...``); the module's are prefixed by the
  attribute that holds it (``model.`` in ``self.model = ...``): the prefix is stripped;
* tied parameters (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) are one tensor: the name the file
  has is loaded, its aliases need no entry;
* a checkpoint of the task model loaded into its base model (or the reverse) differs by ``base_model_prefix``
  (``model.``, ``transformer.``), as ``transformers`` accepts;
* buffers not in the file keep their initialised values (rotary tables are not saved);
* any other parameter missing from the file, or tensor of the file the model lacks, is a
  :class:`PretrainedMismatchError` listing them -- or, with ``strict=False`` (what ``from_pretrained`` itself
  does), a warning naming the parameters left at their fresh initialisation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_strategies._options import listing
from fsdp_strategies.checkpoint.key_mismatch import KeyMismatch, StateMismatchError
from fsdp_strategies.checkpoint.load_into_fsdp import clean_name
from fsdp_strategies.checkpoint.location import is_url
from fsdp_strategies.hf.materialize import hf_models

__all__ = ["PretrainedFolderError", "PretrainedFolderNotFoundError", "PretrainedMismatchError",
           "PretrainedSource",
           "check_folder", "file_shapes", "load_pretrained", "resolve_prefix", "safetensors_keys"]

_SHOW = 8
INDEX_FILE = "model.safetensors.index.json"


class PretrainedMismatchError(StateMismatchError):
    """The pretrained folder's tensors do not match the model they are loaded into (names or shapes). An
    option error: one line from the CLI."""

    option_error = True


@dataclass
class PretrainedSource:
    """Where a module's pretrained weights come from.

    Args:
        path: a local ``save_pretrained`` folder with ``*.safetensors`` files.
        prefix: the module's attribute path to the HF model, ending with ``.`` (``""``: the module itself);
            None: found by :func:`resolve_prefix` at load time.
        strict: a key mismatch is an error (True) or a warning naming what stays freshly initialised (False).
        origin: who asked for it, for messages (``"pretrained=..."``, ``"LlamaForCausalLM.from_pretrained"``).
        target: the HF model object the weights are for (the ``from_pretrained`` route), to find its prefix.
    """

    path: str
    prefix: str | None = None
    strict: bool = True
    origin: str = "pretrained"
    target: nn.Module | None = field(default=None, repr=False)


class PretrainedFolderError(OSError):
    """A ``pretrained`` folder that cannot be read as a ``save_pretrained`` folder (a damaged or truncated
    safetensors file, an index naming a missing shard, no or an unparsable ``config.json``): the message names
    the file and the problem. An option error: one line from the CLI (:mod:`fsdp_strategies.cli`)."""

    option_error = True


class PretrainedFolderNotFoundError(PretrainedFolderError, FileNotFoundError):
    """The ``pretrained`` path is not a local folder, or holds no ``*.safetensors`` file."""


def check_folder(path: str | Path, option: str) -> Path:
    """The folder as a Path, or one clear error naming ``option``, the file and the problem: no folder, no
    safetensors in it, no or a broken ``config.json``, an index that names a missing file, or a safetensors
    file whose header safetensors itself cannot read (truncated, damaged). Reads headers only (no tensor
    data), so it runs where the option is given, before any process group exists."""
    if is_url(path):
        raise PretrainedFolderNotFoundError(
            f"{option}={str(path)!r} is a URL: pretrained folders are read from a local or mounted file "
            "system only. Fix: copy the folder locally (e.g. `aws s3 sync URL DIR`) and pass DIR.")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        hint = ("It looks like a Hub id: download it first (`hf download ID --local-dir DIR`) and pass DIR."
                if "/" in str(path) and not folder.exists() and not str(path).startswith(("/", ".", "~")) else
                "Fix: pass the folder `save_pretrained` wrote (config.json + *.safetensors).")
        raise PretrainedFolderNotFoundError(f"{option}={str(path)!r} is not a local folder. {hint}")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        legacy = sorted(p.name for p in folder.glob("*.bin"))
        fix = (
            f"it holds {legacy}: legacy pickle weights are not read (they can run code). Fix: convert once "
            "with `AutoModel...from_pretrained(DIR).save_pretrained(NEW_DIR)` (writes safetensors) and pass "
            "NEW_DIR."
            if legacy
            else "Fix: pass the folder `save_pretrained` wrote (config.json + *.safetensors)."
        )
        raise PretrainedFolderNotFoundError(f"{option}={str(path)!r} has no *.safetensors file: {fix}")
    where = f"{option}={str(path)!r}"
    _check_json(folder / "config.json", where, "the model's configuration")
    index = folder / INDEX_FILE
    if index.exists():
        weight_map = _check_json(index, where, "which file holds each tensor").get("weight_map")
        if not isinstance(weight_map, dict):
            raise PretrainedFolderError(
                f"{where}: {index} has no 'weight_map'. Fix: copy the folder again, or "
                f"delete {INDEX_FILE} if the folder has one *.safetensors file."
            )
        absent = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if absent:
            raise PretrainedFolderError(
                f"{where}: {INDEX_FILE} names {len(absent)} file(s) the folder lacks: "
                f"{_show(absent)}. Fix: copy the missing shard files into {folder}."
            )
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as fh:
                fh.keys()
        except Exception as exc:  # safetensors' own reading of the header: truncated, not safetensors, ...
            raise PretrainedFolderError(
                f"{where}: {file} ({file.stat().st_size:,} bytes) "
                f"is damaged: safetensors cannot read it ({exc}); "
                "a copy cut short or overwritten. Fix: copy or "
                "download that file again (compare its size with the "
                "source's)."
            ) from None
    return folder


def _check_json(file: Path, where: str, holds: str) -> dict[str, Any]:
    if not file.is_file():
        raise PretrainedFolderError(f"{where}: {file} is missing ({holds}); the folder is not a complete "
                                    "save_pretrained folder. Fix: copy "
                                    "that file from the source, or save the "
                                    "model again with save_pretrained.")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PretrainedFolderError(
            f"{where}: {file} is not valid JSON ({exc}). Fix: copy that file again from "
            "the source, or save the model again with save_pretrained."
        ) from None
    if not isinstance(data, dict):
        raise PretrainedFolderError(
            f"{where}: {file} holds a {type(data).__name__}, not a JSON object. Fix: copy "
            "that file again from the source."
        )
    return data


def file_shapes(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor of the folder's safetensors files -> (file name, shape), from the headers (no tensor
    data)."""
    from safetensors import safe_open

    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            names = fh.keys()  # a safetensors handle, not a dict
            for key in names:
                out[key] = (file.name, tuple(fh.get_slice(key).get_shape()))
    return out


def _config_differences(folder: Path, model: nn.Module | None) -> str:
    """``hidden_size: folder 64, model 32; ...`` for the size fields where the folder's config.json and the
    model's own config differ (the usual cause of a shape mismatch); empty when it cannot say."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return ""
    try:
        theirs = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    ours = config.to_dict()
    diff = [f"{k}: folder {theirs[k]!r}, model {ours[k]!r}" for k in sorted(theirs)
            if k in ours and isinstance(theirs[k], int) and not isinstance(theirs[k],
                                                                           bool) and theirs[k] != ours[k]]
    return "; ".join(diff[:_SHOW])


def safetensors_keys(folder: Path) -> set[str]:
    """The tensor names of a safetensors folder (from the index when there is one, else the file headers)."""
    index = folder / INDEX_FILE
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    return set(file_shapes(folder))


def resolve_prefix(module: nn.Module, source: PretrainedSource) -> str:
    """The attribute prefix of the weights' HF model in ``module`` (see :class:`PretrainedSource`)."""
    if source.target is not None:
        for name, sub in module.named_modules():
            if sub is source.target:
                return clean_name(name + ".") if name else ""
        raise RuntimeError(
            f"{source.origin}: the model it built is not part of the LightningModule. Fix: assign "
            "it to an attribute in configure_model (e.g. self.model = ...from_pretrained(...))."
        )
    if source.prefix is not None:
        return source.prefix if not source.prefix or source.prefix.endswith(".") else source.prefix + "."
    found = [prefix for prefix, _ in hf_models(module)]
    if len(found) > 1:
        raise ValueError(f"{source.origin}: the module holds {len(found)} Hugging Face models "
                         f"({', '.join(p.rstrip('.') or '<root>' for p in found)}). "
                         "Fix: set pretrained_prefix to "
                         "the attribute the weights are for, e.g. pretrained_prefix: \"model.\".")
    return found[0] if found else ""


def _tied_aliases(module: nn.Module, prefix: str) -> dict[str, list[str]]:
    """Within ``prefix``: each parameter name -> the other names of the same tensor (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        name = clean_name(name)
        if name.startswith(prefix):
            names.setdefault(id(param), []).append(name[len(prefix):])
    return {n: [o for o in group if o != n] for group in names.values() for n in group}


def _submodule(module: nn.Module, prefix: str) -> nn.Module | None:
    """The submodule at ``prefix`` (a cleaned name: wrappers from compile / checkpointing are looked
    through)."""
    if not prefix:
        return module
    for name, sub in module.named_modules():
        if name and clean_name(name + ".") == prefix:
            return sub
    return None


def _base_prefix(module: nn.Module, prefix: str) -> str:
    base = getattr(_submodule(module, prefix), "base_model_prefix", "") or ""
    return base + "." if base else ""


def _align(file_keys: set[str], wanted: Iterable[str], base: str) -> dict[str, str]:
    """Model key -> file key, trying the keys as they are and across ``base_model_prefix``; the best match."""
    wanted = list(wanted)
    options = [{k: k for k in wanted}]
    if base:
        options.append({k: k[len(base):] for k in wanted if k.startswith(base)})  # task model <- base file
        options.append({k: base + k for k in wanted})  # base model <- task-model file
    scored = [{k: f for k, f in option.items() if f in file_keys} for option in options]
    return max(scored, key=len)


def _show(keys: Iterable[str]) -> str:
    return listing(sorted(keys), _SHOW)


def _ignored(module: nn.Module, prefix: str, attr: str) -> list[re.Pattern[str]]:
    return [re.compile(p) for p in (getattr(_submodule(module, prefix), attr, None) or [])]


def load_pretrained(module: nn.Module, source: PretrainedSource, log_prefix: str = "") -> dict[str, Any]:
    """Fill ``module``'s (sharded, materialised) weights under the source's prefix from its safetensors
    folder.

    Call on every rank, after sharding and materialisation. Returns what was done: ``loaded``, ``missing``
    (left initialised), ``unexpected`` (in the file, unused), ``prefix``."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    folder = check_folder(source.path, source.origin)
    prefix = resolve_prefix(module, source)
    options = StateDictOptions(full_state_dict=False, ignore_frozen_params=False)
    state = {clean_name(k): v for k, v in get_model_state_dict(module, options=options).items()}
    ours = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not ours:
        raise PretrainedMismatchError(
            f"{source.origin}: the module has no weights under prefix {prefix!r}. Fix: set "
            'pretrained_prefix to the attribute that holds the HF model (e.g. "model.").'
        )
    file_keys = safetensors_keys(folder)
    mapping = _align(file_keys, ours, _base_prefix(module, prefix))
    aliases = _tied_aliases(module, prefix)
    param_names = set(aliases)
    covered = set(mapping)
    for name in list(ours):
        if name not in covered and any(alias in covered for alias in aliases.get(name, [])):
            covered.add(name)  # a tied alias of a tensor the file has
    missing = {k for k in ours if k not in covered}
    missing_params = {k for k in missing if k in param_names}
    ignore_missing = _ignored(module, prefix, "_keys_to_ignore_on_load_missing")
    missing_params = {k for k in missing_params if not any(p.search(k) for p in ignore_missing)}
    used = set(mapping.values())
    ignore_unexpected = _ignored(module, prefix, "_keys_to_ignore_on_load_unexpected")
    unexpected = {k for k in file_keys - used if not any(p.search(k) for p in ignore_unexpected)}
    if not mapping:
        raise PretrainedMismatchError(
            f"{source.origin}: none of the {len(file_keys)} tensors "
            f"of {folder} matches the module's weights under "
            f"prefix {prefix!r} (file: {_show(file_keys)}; module: "
            f"{_show(ours)}). Fix: point it at the folder of "
            "this architecture, or set pretrained_prefix to the attribute that holds the HF model."
        )
    if (missing_params or unexpected) and source.strict:
        mismatch = KeyMismatch(missing=tuple(sorted(missing_params)), unexpected=tuple(sorted(unexpected)))
        raise PretrainedMismatchError(
            f"{source.origin}: {folder} does not match the module under prefix {prefix!r}: "
            f"{mismatch.describe('file', 'module', _SHOW)}. Fix: check pretrained_prefix and that the folder "
            "holds this architecture; to start the missing parameters (e.g. a new head) from their fresh "
            "initialisation and ignore the extra tensors, set pretrained_strict: false.")
    if missing_params:
        rank_zero_warn(
            f"{log_prefix}{source.origin}: these parameters are not in {folder} and keep their fresh "
            f"initialisation (train them): {_show(missing_params)}"
        )
    if unexpected:
        rank_zero_warn(
            f"{log_prefix}{source.origin}: these tensors of {folder} are not used: {_show(unexpected)}"
        )
    shapes = file_shapes(folder)
    wrong = [f"{file_key} ({shapes[file_key][0]}): file "
             f"{list(shapes[file_key][1])}, model {list(ours[key].shape)}"
             for key, file_key in sorted(mapping.items())
             if file_key in shapes and tuple(ours[key].shape) != shapes[file_key][1]]
    if wrong:
        differ = _config_differences(folder, _submodule(module, prefix))
        raise PretrainedMismatchError(
            f"{source.origin}: {len(wrong)} tensor(s) of {folder} "
            "have another shape than the module's under prefix "
            f"{prefix!r}: {_show(wrong)}."
            + (f" {folder / 'config.json'} and the model's config "
               f"differ: {differ}. Fix: build the model from the "
               "folder's own config (AutoConfig.from_pretrained(folder)), "
               "or point pretrained at the folder of this "
               "model size." if differ else
               " The model was built with the same config as "
               f"{folder / 'config.json'}, so that file does not "
               "describe the weights (edited, or copied from "
               "another model size). Fix: restore the config.json "
               "saved with these weights, or point pretrained at the folder of this model size."))
    target = {file_key: ours[key] for key, file_key in mapping.items()}
    dcp.load(target, storage_reader=HuggingFaceStorageReader(str(folder)))
    rank_zero_info(f"{log_prefix}{source.origin}: {len(target)} tensors read from {folder} into the shards "
                   f"under {prefix or '<root>'!r} (each rank read only its own shards)")
    return {"loaded": sorted(mapping), "missing": sorted(missing), "unexpected": sorted(unexpected),
            "prefix": prefix}
