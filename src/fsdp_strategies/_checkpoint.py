"""Checkpoint I/O shared by every strategy: atomic DCP/full saves and a consolidated export.

Atomicity: a checkpoint is first written completely to ``<path>.tmp`` (a sharded DCP folder
or a single file), then moved into place by rank 0. A folder cannot be swapped atomically,
so the old one is first renamed to ``<path>.old``; if a crash lands between the two renames,
:func:`resolve_checkpoint_path` finds ``<path>.old`` and the next save restores it before
writing. At no moment is the last complete checkpoint missing from disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = [
    "atomic_save_full",
    "atomic_save_sharded",
    "export_consolidated",
    "resolve_checkpoint_path",
]

TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def resolve_checkpoint_path(path: str | os.PathLike[str]) -> Path:
    """The complete checkpoint for ``path``, recovering from a crash between the two renames."""
    path = Path(path)
    old = _sibling(path, OLD_SUFFIX)
    if not path.exists() and old.exists():
        rank_zero_warn(f"Checkpoint {path} is missing but {old} is complete (a save was interrupted); using it.")
        return old
    return path


def prepare_save(path: Path) -> Path:
    """Rank 0, before a save: undo an interrupted swap, drop a partial temp; return the temp path."""
    old, tmp = _sibling(path, OLD_SUFFIX), _sibling(path, TMP_SUFFIX)
    if not path.exists() and old.exists():
        old.rename(path)
    _remove(old)
    _remove(tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def commit_save(path: Path) -> None:
    """Rank 0, after the temp checkpoint is complete: move it into place."""
    tmp, old = _sibling(path, TMP_SUFFIX), _sibling(path, OLD_SUFFIX)
    if path.is_file() and tmp.is_file():
        os.replace(tmp, path)  # atomic for files
        return
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    _remove(old)


def atomic_save_sharded(
    tensors: dict[str, Any], metadata: dict[str, Any], path: Path, *, is_rank_zero: bool, barrier: Any
) -> None:
    """Write a DCP checkpoint folder (every rank its shard) plus Lightning's ``meta.pt``, atomically."""
    tmp = _sibling(path, TMP_SUFFIX)
    if is_rank_zero:
        prepare_save(path)
    barrier()
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp))
    if is_rank_zero:
        torch.save(metadata, tmp / _METADATA_FILENAME)
        commit_save(path)
    barrier()


def atomic_save_full(checkpoint: dict[str, Any], path: Path) -> None:
    """Rank 0 only: one ``torch.save`` file, written to a temp file and renamed into place."""
    tmp = prepare_save(path)
    torch.save(checkpoint, tmp)
    commit_save(path)


def export_consolidated(checkpoint: str | os.PathLike[str], output: str | os.PathLike[str], strip_prefix: str = "") -> Path:
    """Turn a sharded (DCP) or full checkpoint into one plain ``state_dict`` file.

    Runs in a single process without a process group. The result loads with
    ``model.load_state_dict(torch.load(output))`` into the plain model, no package needed.
    ``strip_prefix`` (e.g. ``"model."``) drops a LightningModule attribute prefix.
    """
    src = resolve_checkpoint_path(checkpoint)
    if src.is_dir():
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        state = _load_state_dict_from_keys(keys={"state_dict"}, checkpoint_id=str(src))["state_dict"]
    else:
        state = torch.load(src, map_location="cpu", weights_only=False)["state_dict"]
    plain = {
        (k[len(strip_prefix) :] if strip_prefix and k.startswith(strip_prefix) else k): (
            v.full_tensor() if hasattr(v, "full_tensor") else v
        )
        for k, v in state.items()
    }
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(out, TMP_SUFFIX)
    torch.save(plain, tmp)
    os.replace(tmp, out)
    return out


def export_main(argv: list[str] | None = None) -> None:
    """Console script ``fsdp-strategies-export CHECKPOINT OUTPUT [--strip-prefix model.]``."""
    parser = argparse.ArgumentParser(description=export_consolidated.__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint written by an fsdp_strategies strategy (folder or file)")
    parser.add_argument("output", help="where to write the consolidated state_dict (.pt)")
    parser.add_argument("--strip-prefix", default="", help="drop this prefix from every key, e.g. 'model.'")
    args = parser.parse_args(argv)
    out = export_consolidated(args.checkpoint, args.output, args.strip_prefix)
    print(f"wrote {out}")
