"""Loading checkpoint files without running code from them.

``torch.load(weights_only=False)`` and plain ``pickle`` execute whatever a file tells them to
(a ``__reduce__`` naming ``os.system`` runs it). Every load in this package therefore goes through:

* :func:`safe_torch_load`: ``torch.load(weights_only=True)`` -- torch's restricted unpickler -- with
  an explicit allow-list (:data:`CHECKPOINT_SAFE_GLOBALS`) of the non-tensor types Lightning and
  this package put in checkpoints (paths, argparse/jsonargparse namespaces, timedeltas and numpy
  scalars in hyper-parameters or callback state). Types a user registers with
  ``torch.serialization.add_safe_globals`` are accepted too; anything else is refused with
  :class:`UnsafeCheckpointError` naming the file and the global.
* :class:`SafeFileSystemReader` / :class:`SafeLoadPlanner`: DCP's ``FileSystemReader`` unpickles the
  folder's ``.metadata`` with plain ``pickle`` and DCP's planner reads non-tensor items with
  ``torch.load(weights_only=False)`` (torch 2.13 offers no restricted variant). The subclasses read
  ``.metadata`` with a ``pickle.Unpickler`` that resolves only DCP's own metadata classes, torch
  dtypes/layouts and paths, and read non-tensor items with :func:`safe_torch_load`'s rules.

Limits: restricted unpicklers are a strong defence, not a proof (torch's own has had bugs); the
trust model in docs/checkpoints.md still says to treat checkpoint files from others like code.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import pathlib
import pickle
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from fsdp_strategies import _torch_seam
from fsdp_strategies.checkpoint.integrity import FIX_CORRUPT, CheckpointIntegrityError

__all__ = [
    "CHECKPOINT_SAFE_GLOBALS",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpointError",
    "load_dcp_metadata",
    "load_dcp_metadata_stream",
    "load_file_checkpoint",
    "safe_fsspec_reader",
    "safe_globals",
    "safe_torch_load",
]

DCP_METADATA_FILE = _torch_seam.DCP_METADATA_FILE  # ".metadata"


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file references a Python object outside the allow-list (it could run code)."""


def _optional_globals() -> list[Any]:
    """Allow-listed types from packages that may be absent or differ in version."""
    found: list[Any] = []
    try:
        import jsonargparse

        found.append(jsonargparse.Namespace)
    except ImportError:  # pragma: no cover - jsonargparse is a dependency
        pass
    try:
        found += _torch_seam.numpy_pickle_globals()
    except (ImportError, AttributeError):  # pragma: no cover - numpy layout of another version
        pass
    return found


#: Non-tensor types a Lightning checkpoint written through this package may contain, beyond what
#: ``torch.load(weights_only=True)`` accepts by default (containers, primitives, tensors, dtypes).
CHECKPOINT_SAFE_GLOBALS: list[Any] = [
    pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath,
    argparse.Namespace, datetime.timedelta, datetime.datetime, datetime.date,
    *_optional_globals(),
]


@contextmanager
def safe_globals() -> Iterator[None]:
    """Allow :data:`CHECKPOINT_SAFE_GLOBALS` for ``weights_only`` loads inside this block only."""
    with torch.serialization.safe_globals(CHECKPOINT_SAFE_GLOBALS):
        yield


def _refusal(source: str, err: BaseException) -> UnsafeCheckpointError:
    reason = str(err).strip().splitlines()
    detail = next(
        (line.strip().rstrip(".") for line in reason if "Unsupported global" in line or "GLOBAL" in line),
        reason[0] if reason else type(err).__name__,
    )
    return UnsafeCheckpointError(
        f"{source}: refused to load it: it references a Python object that is not checkpoint data "
        f"({detail}); unpickling it could run code. Fix: if you trust this file and the type is plain data, "
        "register it with `torch.serialization.add_safe_globals([TheType])` "
        "before loading; otherwise do not use it."
    )


def safe_torch_load(
    source: str | os.PathLike[str] | BinaryIO, *, mmap: bool = False, name: str | None = None
) -> Any:
    """``torch.load(weights_only=True, map_location="cpu")`` with the package's allow-list.

    Raises :class:`UnsafeCheckpointError` for a file that references a non-allow-listed global and
    lets other errors (not a torch file, truncated zip) propagate for the caller to word.
    """
    label = name or str(source)
    kwargs: dict[str, Any] = {"map_location": "cpu", "weights_only": True}
    if mmap and isinstance(source, (str, os.PathLike)) and zipfile.is_zipfile(source):
        kwargs["mmap"] = True  # (only the zip format can be memory-mapped)
    try:
        with safe_globals():
            return torch.load(source, **kwargs)  # type: ignore[arg-type]
    except pickle.UnpicklingError as err:
        if "GLOBAL" in str(err) or "Unsupported global" in str(err):
            raise _refusal(label, err) from None
        raise


def load_file_checkpoint(path: pathlib.Path | BinaryIO, *, mmap: bool = True,
                         name: str | None = None) -> Any:
    """Read a single-file checkpoint (or a stream: ``name`` labels it) with :func:`safe_torch_load`; a file
    torch cannot read at all (truncated, not a torch file) raises
    :class:`~fsdp_strategies.checkpoint.integrity.CheckpointIntegrityError` in one line."""
    try:
        return safe_torch_load(path, mmap=mmap, name=name)
    except UnsafeCheckpointError:
        raise
    except Exception as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0]
        raise CheckpointIntegrityError(
            f"{name or path} is not a readable checkpoint "
            f"(torch.load failed: {type(err).__name__}: {first}). "
            "It is truncated, corrupted or not a file written by torch.save. " + FIX_CORRUPT
        ) from None


# ---------------------------------------------------------------------------------------- DCP metadata
class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP metadata classes, torch dtypes/layouts/sizes, paths and user-registered safe
    globals."""

    def __init__(self, file: BinaryIO, source: str) -> None:
        super().__init__(file)
        self._source = source
        self._allowed = _torch_seam.dcp_metadata_globals()
        for entry in torch.serialization.get_safe_globals():
            obj = entry[0] if isinstance(entry, tuple) else entry
            self._allowed[(getattr(obj, "__module__", ""), getattr(obj, "__qualname__", ""))] = obj

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._allowed:
            return self._allowed[(module, name)]
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._source}: refused to load it: the DCP metadata "
            f"references `{module}.{name}`, which is not a "
            "checkpoint-metadata type; unpickling it could run "
            "code. Fix: do not use this checkpoint folder unless you "
            "trust it (if you do and the type is plain data, register it with "
            "`torch.serialization.add_safe_globals`)."
        )


def load_dcp_metadata(folder: str | os.PathLike[str]) -> Any:
    """Read a DCP folder's ``.metadata`` with the restricted unpickler (no code runs)."""
    path = pathlib.Path(folder) / DCP_METADATA_FILE
    with path.open("rb") as fh:
        return _MetadataUnpickler(fh, str(path)).load()


def load_dcp_metadata_stream(fh: BinaryIO, name: str) -> Any:
    """:func:`load_dcp_metadata` from an open stream (``name`` for messages)."""
    return _MetadataUnpickler(fh, name).load()


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with ``.metadata`` read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = load_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


def safe_fsspec_reader(url: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """DCP's fsspec storage reader for ``url`` with ``.metadata`` read by the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    base = _torch_seam.fsspec_storage("reader")

    class SafeFsspecReader(base):  # type: ignore[misc, valid-type]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            name = self.fs.concat_path(self.path, DCP_METADATA_FILE)
            with self.fs.create_stream(name, "rb") as fh:
                metadata = load_dcp_metadata_stream(fh, f"{url}/{DCP_METADATA_FILE}")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
            return metadata

    return SafeFsspecReader(url, **dict(storage_options or {}))


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with ``weights_only=True`` + the allow-list.

    The item is loaded by the restricted loader first; only the object it produced (allow-listed
    types) is handed on, re-serialised, to the parent's placement logic.
    """

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        value.seek(0)
        obj = safe_torch_load(value, name="a non-tensor item of a DCP checkpoint")
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)
