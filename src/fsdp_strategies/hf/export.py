"""A checkpoint as a Hugging Face ``save_pretrained`` folder; the ``fsdp-strategies-export`` command.

:func:`export_hf` turns any checkpoint this package (or Lightning's ``ddp``) writes -- a sharded DCP folder
of any strategy and world size, or a full single file -- into what ``transformers`` loads with
``AutoModelFor...from_pretrained(OUT)``:

* ``model.safetensors``, or above ``max_shard_size`` ``model-0000i-of-0000N.safetensors`` plus
  ``model.safetensors.index.json``, written by torch DCP's ``HuggingFaceStorageWriter`` (one process, no
  process group); keys are the HF model's own (the LightningModule attribute prefix stripped, only that
  model's keys), each tied weight written once under the name ``save_pretrained`` keeps;
* ``config.json`` (``architectures`` and ``dtype`` set as ``save_pretrained`` sets them) and
  ``generation_config.json`` for models that generate.

Which model: the checkpoint's record (:mod:`~fsdp_strategies.hf.metadata`), or ``hf_config`` (a folder with
the model's ``config.json``, e.g. the pretrained folder) for checkpoints without one (Lightning's ``ddp``).
The class is built on the meta device to learn the keys, shapes and ties it expects; any difference is an
error listing the missing, unexpected and reshaped keys, before anything is written.

Safety: the checkpoint is verified against its checksums and read with the restricted unpicklers
(:func:`~fsdp_strategies.checkpoint.export.open_checkpoint`); the folder is written to ``<OUT>.tmp`` and
renamed into place, so a failure leaves nothing at ``OUT``. ``main`` is the console script; its default
``--format torch`` is :func:`~fsdp_strategies.checkpoint.export.export_consolidated`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from fsdp_strategies._options import DTYPE_NAMES, listing
from fsdp_strategies.checkpoint.atomic import abandon_save, commit_save, prepare_save
from fsdp_strategies.checkpoint.export import VerifiedCheckpoint, export_consolidated, open_checkpoint
from fsdp_strategies.checkpoint.key_mismatch import KeyMismatch, Shape, StateMismatchError
from fsdp_strategies.checkpoint.location import local_checkpoint_path, url_or_none
from fsdp_strategies.checkpoint.object_store import check_writable, require_empty, upload_folder
from fsdp_strategies.hf.metadata import hf_model_records

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "DTYPES", "HFExportError", "HFExportMismatchError", "export_hf", "main",
           "parse_size"]

DEFAULT_MAX_SHARD_SIZE = "5GB"  # what transformers' save_pretrained uses
DTYPES = {name: DTYPE_NAMES[name] for name in ("bf16", "fp16", "fp32")}  # the short names of the one map
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class HFExportError(ValueError):
    """The checkpoint cannot be written as the chosen Hugging Face model (which one, keys, options)."""


class HFExportMismatchError(HFExportError, StateMismatchError):
    """The checkpoint's keys or shapes are not the chosen Hugging Face model's."""


def parse_size(value: int | str, option: str = "max_shard_size") -> int:
    """Bytes in ``value``: an int, or a string such as ``"5GB"`` (10**9) / ``"500MiB"`` (2**20), as
    transformers reads it."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", str(value), flags=re.IGNORECASE)
    unit = match and match.group(2).upper()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise HFExportError(
            f"{option}={value!r} is not a size. Fix: give a positive size such as 5GB, 500MB, "
            "2GiB or a number of bytes."
        )
    return int(float(match.group(1)) * _UNITS[unit])


# ----------------------------------------------------------------------------------- which model, which
# config
def _model_class(name: str, where: str) -> type:
    import transformers

    cls = getattr(transformers, name, None)
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise HFExportError(
            f"{where} names the model class {name!r}, which transformers {transformers.__version__} "
            "does not provide. Fix: pass --hf-config DIR with a config.json whose 'architectures' "
            "names a transformers class."
        )
    return cls


def _config_from_folder(folder: Path) -> Any:
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise HFExportError(
            f"hf_config={str(folder)!r} has no config.json. Fix: pass the folder the model was "
            "loaded from (its save_pretrained folder), which holds config.json."
        )
    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


def _generation_from_folder(folder: Path) -> Any:
    from transformers import GenerationConfig

    if (folder / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    return None


def _choose(records: list[dict[str, str]], prefix: str | None, hf_config: Path | None,
            source: Path) -> tuple[type, Any, Any, str | None]:
    """(model class, config, generation config or None, prefix or None = infer from the keys)."""
    from transformers import GenerationConfig

    chosen: dict[str, str] | None = None
    if records:
        matching = [r for r in records if prefix is None or r["prefix"] == prefix]
        if prefix is None and len(records) > 1:
            raise HFExportError(
                f"{source} holds {len(records)} Hugging Face models, under the prefixes "
                f"{', '.join(repr(r['prefix']) for r in records)}. Fix: choose one with --prefix."
            )
        if not matching and hf_config is None:
            raise HFExportError(f"prefix={prefix!r}: {source} records Hugging Face models under "
                                f"{', '.join(repr(r['prefix']) for r in records)} "
                                "only. Fix: pass one of these, or "
                                "--hf-config DIR for a model the checkpoint does not record.")
        chosen = matching[0] if matching else None
    if hf_config is not None:
        config = _config_from_folder(hf_config)
        names = list(getattr(config, "architectures", None) or []) or (
            [chosen["class_name"]] if chosen else []
        )
        if not names:
            raise HFExportError(
                f"hf_config={str(hf_config)!r}: its config.json names no 'architectures'. Fix: add "
                '"architectures": ["<the model class, e.g. LlamaForCausalLM>"] to it.'
            )
        cls = _model_class(names[0], f"{hf_config / 'config.json'}")
        generation = _generation_from_folder(hf_config)
        return cls, config, generation, prefix if prefix is not None else (chosen["prefix"]
                                                                           if chosen else None)
    if chosen is None:
        raise HFExportError(
            f"{source} records no Hugging Face model (it was written by a strategy that does not "
            "record one, e.g. Lightning's ddp). Fix: pass --hf-config DIR, a folder with the model's "
            "config.json (e.g. the pretrained folder), and --prefix if the module holds several."
        )
    cls = _model_class(chosen["class_name"], f"{source}'s record")
    config = cls.config_class.from_dict(json.loads(chosen["config"]))
    generation = (GenerationConfig.from_dict(json.loads(chosen["generation_config"]))
                  if chosen.get("generation_config") else None)
    return cls, config, generation, chosen["prefix"]


# ----------------------------------------------------------------------------------- keys, ties, checks
def _expected(cls: type, config: Any) -> tuple[Any, dict[str, torch.Tensor], list[list[str]]]:
    """The model on the meta device, its state_dict (meta tensors) and its groups of names sharing one tensor
    (the first name of a group is the one ``save_pretrained`` writes)."""
    with torch.device("meta"):
        model = cls(config)
    expected = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        groups.setdefault(id(tensor), []).append(name)
    return model, expected, list(groups.values())


def _infer_prefix(keys: list[str], groups: list[list[str]], cls: type, source: Path) -> str:
    """The prefix under which ``keys`` hold every tensor the model needs (one name of each tied group)."""
    if not groups:
        return ""
    have = set(keys)
    candidates = {k[: len(k) - len(n)] for n in groups[0] for k in keys if k.endswith(n)}
    candidates = {p for p in candidates if p == "" or p.endswith(".")}
    covered = {p: sum(any(p + n in have for n in g) for g in groups) for p in candidates}
    complete = sorted(p for p, c in covered.items() if c == len(groups))
    if len(complete) > 1:
        raise HFExportError(f"{source} holds the keys of {cls.__name__} under several prefixes "
                            f"({', '.join(map(repr, complete))}). Fix: choose one with --prefix.")
    return complete[0] if complete else max(covered, key=lambda p: covered[p], default="")


def _select(state: dict[str, torch.Tensor], prefix: str, expected: dict[str, torch.Tensor],
            groups: list[list[str]], cls: type, source: Path) -> dict[str, torch.Tensor]:
    """The tensors to write, by HF name, in the model's order; tied names once; any mismatch raises."""
    found = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    missing: list[str] = []
    reshaped: list[tuple[str, Shape, Shape]] = []
    untied: list[str] = []
    out: dict[str, torch.Tensor] = {}
    for group in groups:
        present = [n for n in group if n in found]
        if not present:
            missing.append(group[0])
            continue
        value = found[present[0]]
        if any(not torch.equal(found[n], value) for n in present[1:]):
            untied.append("=".join(present))
        if tuple(value.shape) != tuple(expected[group[0]].shape):
            reshaped.append((group[0], tuple(value.shape), tuple(expected[group[0]].shape)))
        out[group[0]] = value
    mismatch = KeyMismatch(tuple(missing), tuple(k for k in found if k not in expected), tuple(reshaped))
    if mismatch:
        raise HFExportMismatchError(
            f"{source} does not hold the weights of {cls.__name__} under the prefix {prefix!r}: "
            f"{mismatch.describe()}. Fix: pass --prefix with the attribute path that holds the model "
            "(e.g. 'model.'), and --hf-config with the config of the model that was trained.")
    if untied:
        raise HFExportError(f"{source}: {cls.__name__} ties {listing(untied)}, but the checkpoint holds "
                            "different values under these names (the tie was broken during training). Fix: "
                            "export with --hf-config DIR whose config.json unties them (e.g. "
                            "\"tie_word_embeddings\": false).")
    return out


# ----------------------------------------------------------------------------------- writing
def _shard_mapping(tensors: dict[str, torch.Tensor], max_bytes: int) -> dict[str, int]:
    """File index (1..N) per name, in order: a new file when the next tensor would pass ``max_bytes``."""
    mapping, index, size = {}, 1, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > max_bytes:
            index, size = index + 1, 0
        mapping[name] = index
        size += nbytes
    return mapping


def _write_safetensors(folder: Path, tensors: dict[str, torch.Tensor], max_bytes: int) -> int:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    mapping = _shard_mapping(tensors, max_bytes)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(folder), fqn_to_index_mapping=mapping),
                 no_dist=True)
    files = max(mapping.values(), default=1)
    if files == 1:  # transformers' layout below the threshold: one model.safetensors, no index
        os.replace(folder / "model-00001-of-00001.safetensors", folder / SINGLE_FILE)
        (folder / INDEX_FILE).unlink()
    return files


def _check_output(out: Path) -> None:
    if out.is_file() or out.is_symlink() or (out.is_dir() and any(out.iterdir())):
        raise HFExportError(
            f"output={str(out)!r} already exists and is not an empty folder. Fix: choose a new "
            "folder, or remove this one first (nothing in it is overwritten)."
        )


def export_hf(
    checkpoint: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    hf_config: str | os.PathLike[str] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: str | None = None,
) -> Path | str:
    """Write a checkpoint as a Hugging Face ``save_pretrained`` folder that ``from_pretrained(output)`` loads.

    Args:
        checkpoint: a sharded (DCP) folder or a full file written by an fsdp_strategies strategy or Lightning.
        output: the folder to write (must not exist, or be empty); written to ``<output>.tmp`` and renamed.
            An object-storage URL (``s3://bucket/model``; credentials and endpoint from the environment, as
            fsspec reads them) is a prefix that must hold no objects: the folder is written in a local
            temporary folder, then uploaded file by file, ``config.json`` last -- ``from_pretrained`` reads it
            first, so a copy cut short has none.
        prefix: the attribute path of the HF model in the LightningModule (``"model."``; a missing final dot
            is added). Default: the recorded model's prefix, or inferred from the keys with ``hf_config``.
        hf_config: a folder with the model's ``config.json`` (and ``generation_config.json``), e.g. the
            pretrained folder; required when the checkpoint records no HF model (Lightning's ``ddp``).
        max_shard_size: above this many bytes (``"5GB"``, ``"500MiB"``, an int) the weights are split into
            ``model-0000i-of-0000N.safetensors`` files with ``model.safetensors.index.json``.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"`` to cast floating-point weights; default: the checkpoint's.

    Returns:
        The output folder (the URL for one).
    """
    max_bytes = parse_size(max_shard_size)
    if dtype is not None and dtype not in DTYPES:
        raise HFExportError(
            f"dtype={dtype!r} is not supported. Fix: use one of {', '.join(DTYPES)}, or leave it "
            "unset to keep the checkpoint's dtype."
        )
    if prefix is not None and prefix and not prefix.endswith("."):
        prefix += "."
    url = url_or_none(output)
    if url is not None:  # before reading anything: the store takes writes there and the prefix is empty
        require_empty(url, "output")
        check_writable(url, "output")
        with tempfile.TemporaryDirectory(prefix="fsdp-strategies-export-") as staging:
            export_hf(checkpoint, Path(staging) / "model", prefix=prefix, hf_config=hf_config,
                      max_shard_size=max_shard_size, dtype=dtype)
            upload_folder(Path(staging) / "model", url, "output", last=("config.json",))
        return url
    out = local_checkpoint_path(output, "output")
    _check_output(out)
    ckpt: VerifiedCheckpoint = open_checkpoint(checkpoint)
    records = hf_model_records(ckpt.extras, str(ckpt.path))
    cls, config, generation, chosen_prefix = _choose(
        records, prefix, None if hf_config is None else Path(hf_config), ckpt.path
    )
    model, expected, groups = _expected(cls, config)
    if chosen_prefix is None:
        chosen_prefix = _infer_prefix(ckpt.keys(), groups, cls, ckpt.path)
    tensors = _select(ckpt.state_dict(chosen_prefix), chosen_prefix, expected, groups, cls, ckpt.path)
    if dtype is not None:
        tensors = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in tensors.items()}
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    floating = next((v.dtype for v in tensors.values() if v.is_floating_point()), None)
    config.architectures = [cls.__name__]
    if floating is not None:
        config.dtype = floating
    if generation is None and model.can_generate():
        generation = model.generation_config
    tmp = prepare_save(out)
    try:
        _write_safetensors(tmp, tensors, max_bytes)
        config.save_pretrained(str(tmp))
        if generation is not None:
            generation.save_pretrained(str(tmp))
        _check_output(out)
        commit_save(out)
    except BaseException:
        abandon_save(out)
        raise
    return out


# ----------------------------------------------------------------------------------- the command
def main(argv: list[str] | None = None) -> int:
    """Console script ``fsdp-strategies-export CKPT OUT [--format torch|hf] ...``: rc 0 written, 1 failed."""
    parser = argparse.ArgumentParser(
        prog="fsdp-strategies-export",
        description="Export a checkpoint written by fsdp_strategies "
        "(sharded folder or full file): --format torch "
        "(default) writes one plain state_dict file; --format hf writes a Hugging Face save_pretrained "
        "folder (safetensors, config.json) for transformers' from_pretrained.",
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint written by an fsdp_strategies strategy or Lightning (folder or file)"
    )
    parser.add_argument(
        "output", help="--format torch: the .pt file to write; --format hf: the folder to write"
    )
    parser.add_argument(
        "--format", choices=["torch", "hf"], default="torch", help="what to write (default: torch)"
    )
    parser.add_argument(
        "--strip-prefix", default=None, help="torch: drop this prefix from every key, e.g. 'model.'"
    )
    parser.add_argument(
        "--prefix", default=None, help="hf: the LightningModule attribute holding the HF model, e.g. 'model.'"
    )
    parser.add_argument("--hf-config", default=None, metavar="DIR",
                        help="hf: a folder with the model's config.json "
                             "(e.g. the pretrained folder); needed when the "
                             "checkpoint records no HF model (Lightning's ddp)")
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help=f"hf: split the weights above this size (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="hf: cast floating-point weights (default: keep)")
    args = parser.parse_args(argv)
    try:
        if args.format == "torch":
            hf_only = [f"--{n.replace('_', '-')}" for n in ("prefix", "hf_config", "max_shard_size", "dtype")
                       if getattr(args, n) is not None]
            if hf_only:
                raise HFExportError(
                    f"{', '.join(hf_only)}: only for --format hf. Fix: add --format hf, or drop "
                    "it (--format torch takes --strip-prefix)."
                )
            out = export_consolidated(args.checkpoint, args.output, args.strip_prefix or "")
        else:
            if args.strip_prefix is not None:
                raise HFExportError(
                    "--strip-prefix applies to --format torch only. Fix: use --prefix with --format hf."
                )
            out = export_hf(args.checkpoint, args.output, prefix=args.prefix, hf_config=args.hf_config,
                            max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE, dtype=args.dtype)
    except Exception as err:  # one line for the user, not a traceback
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"fsdp-strategies-export: error: {message}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
