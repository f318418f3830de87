"""Export: any checkpoint of this package as one plain ``state_dict`` file
(``fsdp-strategies-export --format torch``).

A sharded (DCP) folder, a committed sharded checkpoint on object storage (an fsspec URL such as ``s3://...``:
its manifest and objects, :mod:`fsdp_strategies.checkpoint.object_store`; fsspec's credentials from the
environment) or a full single file is verified against its checksums, read without running
code from it (restricted unpicklers, in one process with no process group: DCP's ``no_dist`` load into
full-size tensors), and its ``state_dict`` is written with ``torch.save`` to a temp file renamed into place.
The result loads into the plain model with ``model.load_state_dict(torch.load(output))``, no package needed.
:func:`open_checkpoint` (verify, then read the non-tensor entries; tensors on demand) is shared with the
Hugging Face export (:mod:`fsdp_strategies.hf.export`, whose ``main`` is the console script for both formats).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from fsdp_strategies._atomic_file import write_atomically
from fsdp_strategies.checkpoint.atomic import LIGHTNING_META_FILE, TMP_SUFFIX, resolve_checkpoint_path
from fsdp_strategies.checkpoint.integrity import verify_folder, verify_loaded
from fsdp_strategies.checkpoint.location import local_checkpoint_path, url_or_none
from fsdp_strategies.checkpoint.safe_load import (
    DCP_METADATA_FILE,
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_dcp_metadata,
    load_file_checkpoint,
    safe_fsspec_reader,
    safe_torch_load,
)

__all__ = ["VerifiedCheckpoint", "export_consolidated", "open_checkpoint", "read_sharded_state_dict"]


@dataclass(frozen=True)
class DCPSource:
    """Where a sharded checkpoint's DCP files are read from -- a local folder, or a committed version on
    object storage: its metadata and a restricted storage reader, both read without running code from the
    files."""

    name: str
    metadata: Callable[[], Any]
    reader: Callable[[], Any]

    @staticmethod
    def folder(folder: Path) -> DCPSource:
        return DCPSource(str(folder), lambda: load_dcp_metadata(folder), lambda: SafeFileSystemReader(folder))


def read_sharded_state_dict(
    folder: Path | DCPSource, key: str = "state_dict", prefix: str = ""
) -> dict[str, Any]:
    """Single process: the full tensors under ``key`` of a DCP folder (or any :class:`DCPSource`), read with
    the restricted reader/planner (only the entries whose name starts with ``prefix``, when one is given)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source = folder if isinstance(folder, DCPSource) else DCPSource.folder(folder)
    metadata = source.metadata()
    target: dict[str, Any] = {}
    has_key = False
    for flat, meta in metadata.state_dict_metadata.items():
        where = tuple((metadata.planner_data or {}).get(flat) or flat.split(".", 1))
        if not where or where[0] != key:
            continue
        has_key = True
        if prefix and not (len(where) > 1 and str(where[1]).startswith(prefix)):
            continue
        node = target
        for part in where[:-1]:
            node = node.setdefault(part, {})
        node[where[-1]] = (torch.empty(meta.size, dtype=meta.properties.dtype)
                           if isinstance(meta, TensorStorageMetadata) else None)
    if not has_key:
        raise ValueError(f"{source.name} holds no {key!r} entry: not a checkpoint written by a Lightning "
                         "strategy.")
    if key not in target:
        return {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(target, storage_reader=source.reader(), planner=SafeLoadPlanner(), no_dist=True)
    return target[key]


def _warn_unverified(unverified: str | None) -> None:
    if unverified is not None:
        rank_zero_warn(f"{unverified}. Exporting it unverified.")


@dataclass
class VerifiedCheckpoint:
    """A checkpoint whose bytes were checked against its checksums; tensors are read on demand.

    Attributes:
        path: the checkpoint folder or file (after :func:`resolve_checkpoint_path`).
        extras: its non-tensor entries: a folder's ``meta.pt``, a file's dict without ``state_dict``.
    """

    path: Path | str  # a URL for a checkpoint on object storage
    extras: dict[str, Any]
    loaded_state: dict[str, Any] | None = field(default=None, repr=False)  # a full file's state_dict
    source: DCPSource | None = field(default=None, repr=False)  # a sharded checkpoint's files

    def keys(self) -> list[str]:
        """The names in the module's ``state_dict``, without reading a tensor."""
        if self.loaded_state is not None:
            return list(self.loaded_state)
        metadata = self._source().metadata()
        paths = (tuple((metadata.planner_data or {}).get(flat) or flat.split(".", 1))
                 for flat in metadata.state_dict_metadata)
        return [str(where[1]) for where in paths if len(where) > 1 and where[0] == "state_dict"]

    def state_dict(self, prefix: str = "") -> dict[str, Any]:
        """The module's full tensors whose names start with ``prefix`` (all of them by default)."""
        if self.loaded_state is None:
            state = read_sharded_state_dict(self._source(), prefix=prefix)
        else:
            state = {k: v for k, v in self.loaded_state.items() if k.startswith(prefix)}
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}

    def _source(self) -> DCPSource:
        return self.source if self.source is not None else DCPSource.folder(Path(self.path))


def open_checkpoint(checkpoint: str | os.PathLike[str]) -> VerifiedCheckpoint:
    """Verify a sharded (DCP) folder or a full file and read its non-tensor entries, without running code from
    it.

    Single process, no process group. A checkpoint without checksums is read with one warning; a damaged one
    raises :class:`~fsdp_strategies.checkpoint.integrity.CheckpointIntegrityError` before anything is
    unpickled.
    """
    if (url := url_or_none(os.fspath(checkpoint))) is not None:
        return _open_remote(url)
    src = resolve_checkpoint_path(checkpoint)
    if src.is_dir():
        unverified = verify_folder(src).require_intact()
        if unverified is not None and not (src / DCP_METADATA_FILE).is_file():
            raise ValueError(
                f"{src} is a folder but not a checkpoint: it has no DCP '{DCP_METADATA_FILE}' file."
            )
        _warn_unverified(unverified)
        meta = src / LIGHTNING_META_FILE
        extras = safe_torch_load(meta, name=str(meta)) if meta.is_file() else {}
        return VerifiedCheckpoint(src, extras if isinstance(extras, dict) else {})
    if src.is_file():
        return _full_file(load_file_checkpoint(src), src)
    raise FileNotFoundError(f"{src}: no such checkpoint file or folder.")


def _full_file(loaded: Any, src: Path | str) -> VerifiedCheckpoint:
    """A full (single-file) checkpoint read with the restricted loader: checked against its digest."""
    unverified = verify_loaded(loaded, src).require_intact()
    if not isinstance(loaded, dict) or not isinstance(loaded.get("state_dict"), dict):
        raise ValueError(f"{src} has no 'state_dict' entry: not a checkpoint written by a Lightning "
                         "strategy.")
    _warn_unverified(unverified)
    extras = {k: v for k, v in loaded.items() if k != "state_dict"}
    return VerifiedCheckpoint(src, extras, loaded["state_dict"])


def _open_remote(url: str) -> VerifiedCheckpoint:
    """A committed checkpoint on object storage (fsspec's credentials and endpoint from the environment):
    every object verified against its manifest first; no manifest is not committed, never read."""
    from fsdp_strategies.checkpoint.object_store import (
        open_remote,
        read_full,
        read_remote_meta,
        read_version_metadata,
        verify_remote,
    )

    ckpt = open_remote(url, "CHECKPOINT")
    if ckpt.is_full_file():
        return _full_file(read_full(ckpt), url)
    result, found = verify_remote(ckpt)
    version = found.version  # no manifest: CheckpointNotCommittedError
    result.require_intact()
    data_url = ckpt.url_of(version)
    source = DCPSource(data_url, lambda: read_version_metadata(ckpt, version),
                       lambda: safe_fsspec_reader(data_url, ckpt.storage_options))
    extras = read_remote_meta(ckpt, version)
    return VerifiedCheckpoint(url, extras if isinstance(extras, dict) else {}, source=source)


def export_consolidated(checkpoint: str | os.PathLike[str], output: str | os.PathLike[str],
                        strip_prefix: str = "") -> Path | str:
    """Turn a sharded (DCP) or full checkpoint into one plain ``state_dict`` file.

    Runs in a single process without a process group. The result loads with
    ``model.load_state_dict(torch.load(output))`` into the plain model, no package needed.
    ``strip_prefix`` (e.g. ``"model."``) drops a LightningModule attribute prefix. The checkpoint is
    verified against its checksums first and read without running code from it (restricted
    unpicklers); on any failure nothing is left at ``output`` or ``<output>.tmp``. ``output`` may be an
    object-storage URL (``s3://bucket/model.pt``; credentials and endpoint from the environment, as fsspec
    reads them): the file is written in a local temporary folder and put as one object, whole or not at all.
    Returns the file written (the URL for one).
    """
    url = url_or_none(output)
    if url is not None:  # before reading anything: the store takes writes there
        from fsdp_strategies.checkpoint.object_store import check_writable

        check_writable(url, "output", beside=True)
    out = local_checkpoint_path(output, "output") if url is None else None
    state = open_checkpoint(checkpoint).state_dict()
    plain = {
        (k[len(strip_prefix) :] if strip_prefix and k.startswith(strip_prefix) else k): v
        for k, v in state.items()
    }
    if url is not None:
        from fsdp_strategies.checkpoint.object_store import upload_file

        with tempfile.TemporaryDirectory(prefix="fsdp-strategies-export-") as staging:
            torch.save(plain, Path(staging) / "state_dict.pt")
            upload_file(Path(staging) / "state_dict.pt", url, "output")
        return url
    assert out is not None
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(out, lambda tmp: torch.save(plain, tmp), TMP_SUFFIX)
