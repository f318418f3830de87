"""Sharded checkpoints on object storage -- any fsspec URL (``s3://``, ``gs://``, ``az://``...): a commit
without a rename.

Object stores have no rename of a folder (s3fs copies and deletes, object by object), so the local commit
(``<name>.tmp`` renamed into place, :mod:`fsdp_strategies.checkpoint.atomic`) cannot be used. Here a
checkpoint at ``URL`` is

* ``URL/<version>/``: DCP's files (written by torch's fsspec storage writer, every rank its shards) and
  Lightning's ``meta.pt``; ``<version>`` is new for every save (``v-<UTC time>-<random>``);
* ``URL/fsdp_strategies_manifest.json``: written last, in one PUT, by rank 0 once every rank's shards are
  complete: the version it commits and the size and SHA-256 of every object under it, read back from the
  store (each rank hashes a share).

**The rule: a checkpoint is valid if and only if its manifest exists and every object it names matches.** A
reader reads the manifest first and loads nothing else; one PUT replaces an object atomically on S3, GCS and
Azure, so a reader sees the previous manifest or the new one, never half of one. A save interrupted at any
point (a killed rank, a lost server) leaves a version the manifest does not name: it is ignored, and the next
successful save removes every version but the one it committed. Saving over an existing checkpoint (``last``)
therefore keeps the previous one loadable until the new manifest is written. Removing a checkpoint deletes its
manifest first. What is *not* atomic: the moment between the manifest's PUT and the removal of the previous
version (both are loadable then, the manifest decides), and two runs writing the same URL at once (the last
manifest wins; a run's own saves are ordered).

A full-file checkpoint (``ddp_hooks``, ``save_distributed_checkpoint=False``) at ``URL`` is one object named
``URL`` (:func:`write_full`): its digest is embedded as in a local file, and the object, uploaded in one
``put``, appears complete or not at all; it is verified when read (:func:`read_full`).

The save runs in phases -- :func:`new_version`, DCP's write through :func:`version_writer` plus the hashing
(:func:`write_shares`), :func:`commit_version` -- each ending with an agreement of every rank, so a failure
anywhere is the same error on every rank. :func:`save_sharded_remote` runs them in turn;
``async_checkpoint`` (:mod:`fsdp_strategies.checkpoint.async_writer`) runs the last two in the background,
on its own group, after DCP's ``async_save``.

Credentials and endpoint are fsspec's: the standard variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``...) or ``storage_options`` on the strategy. :func:`check_writable` writes and
removes one small object under each checkpoint directory before training starts, so an unreachable endpoint, a
missing bucket or a denied write is one error naming the URL, not a failure at the first save.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies import _torch_seam as tseam
from fsdp_strategies._distributed import all_gather_object, is_multi_rank
from fsdp_strategies.checkpoint.atomic import SAVE_ERRORS
from fsdp_strategies.checkpoint.integrity import (
    MANIFEST_FILE,
    CheckpointIntegrityError,
    VerifyResult,
    embed_digest,
    manifest_text,
    parse_manifest,
    verify_files,
)
from fsdp_strategies.checkpoint.location import CheckpointLocationError

__all__ = [
    "CheckpointNotCommittedError",
    "RemoteCheckpoint",
    "check_remote_checkpoint_dir",
    "check_writable",
    "open_remote",
    "read_full",
    "read_remote_meta",
    "remove_remote",
    "require_empty",
    "save_full_remote",
    "save_sharded_remote",
    "upload_file",
    "upload_folder",
    "verify_remote",
]

#: the manifest field naming the version folder it commits
DATA_FIELD = "data"
VERSION_PREFIX = "v-"
_CHUNK = 8 << 20


class CheckpointNotCommittedError(FileNotFoundError):
    """A URL holds no committed checkpoint: no manifest (nothing saved there, or only an interrupted save)."""


@dataclass(frozen=True)
class RemoteCheckpoint:
    """One checkpoint URL: ``fs`` (the fsspec file system), ``root`` (its path there, no trailing ``/``)."""

    url: str
    fs: Any
    root: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.url

    def is_full_file(self) -> bool:
        """Whether ``url`` is one object -- a full-file checkpoint (:func:`write_full`) -- not a prefix."""
        self.fs.invalidate_cache()
        return bool(self.fs.isfile(self.root))

    def path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def url_of(self, *parts: str) -> str:
        return self.fs.unstrip_protocol(self.path(*parts))


def open_remote(url: str, what: str, storage_options: Mapping[str, Any] | None = None) -> RemoteCheckpoint:
    """``url`` as a :class:`RemoteCheckpoint`; a URL fsspec cannot open raises
    :class:`~fsdp_strategies.checkpoint.location.CheckpointLocationError` naming ``what`` and the URL."""
    import fsspec

    scheme = url.split("://", 1)[0]
    try:
        fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as err:
        raise CheckpointLocationError(
            f"{what}={url!r}: fsspec needs a package for {scheme}:// that is not installed ({err}). Fix: "
            "pip install "
            "'fsdp_strategies[remote]' for s3:// (s3fs), or the fsspec package of that scheme (gcsfs for "
            "gs://, "
            "adlfs for az://)."
        ) from None
    except ValueError as err:
        raise CheckpointLocationError(
            f"{what}={url!r}: fsspec does not know the scheme {scheme}:// ({err}). Fix: a local path, or a "
            "URL of a "
            "file system fsspec knows (s3://, gs://, az://, ...)."
        ) from None
    return RemoteCheckpoint(url, fs, root.rstrip("/"), dict(storage_options or {}))


# ------------------------------------------------------------------------------ reading and verifying
@dataclass
class RemoteFiles:
    """:class:`~fsdp_strategies.checkpoint.integrity.CheckpointFiles` of a committed checkpoint: the manifest
    at ``URL/``, the objects under the version it names."""

    ckpt: RemoteCheckpoint
    _text: str | None = None
    _version: str | None = None

    def __post_init__(self) -> None:
        self.ckpt.fs.invalidate_cache()
        try:
            self._text = self.ckpt.fs.cat_file(self.ckpt.path(MANIFEST_FILE)).decode()
        except FileNotFoundError:
            return
        data, _ = parse_manifest(self._text)
        version = (data or {}).get(DATA_FIELD)
        if isinstance(version, str) and version.startswith(VERSION_PREFIX) and "/" not in version:
            self._version = version

    @property
    def where(self) -> str:
        return self.ckpt.url

    @property
    def version(self) -> str:
        """The committed version (raises :class:`CheckpointNotCommittedError` when there is no manifest)."""
        if self._text is None:
            raise CheckpointNotCommittedError(
                f"{self.ckpt.url}: no committed checkpoint there (no {MANIFEST_FILE}). A save writes it "
                "last, so an "
                "interrupted save leaves none and is never loaded. Fix: resume from a checkpoint whose save "
                "completed "
                "(`fsdp-strategies-verify URL` says which are)."
            )
        if self._version is None:
            raise CheckpointIntegrityError(
                f"{self.ckpt.url}: its {MANIFEST_FILE} names no version folder; it cannot "
                "be trusted. Fix: resume from another checkpoint."
            )
        return self._version

    def manifest_text(self) -> str | None:
        return self._text

    def sizes(self) -> dict[str, int]:
        if self._version is None:
            return {}
        return _listing(self.ckpt, self._version)

    def digest(self, name: str) -> str:
        return _digest(self.ckpt, self.ckpt.path(self.version, name))[1]


def _listing(ckpt: RemoteCheckpoint, version: str) -> dict[str, int]:
    base = ckpt.path(version) + "/"
    ckpt.fs.invalidate_cache()
    found = ckpt.fs.find(ckpt.path(version), detail=True)
    return {
        name[len(base) :]: int(info["size"])
        for name, info in found.items()
        if name.startswith(base) and info.get("type", "file") == "file"
    }


def _digest(ckpt: RemoteCheckpoint, path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with ckpt.fs.open(path, "rb", block_size=_CHUNK, cache_type="none") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def verify_remote(
    ckpt: RemoteCheckpoint,
    *,
    rank: int = 0,
    world_size: int = 1,
    all_gather: Callable[[Any], list[Any]] | None = None,
) -> tuple[VerifyResult, RemoteFiles]:
    """Check the committed checkpoint at ``ckpt`` (every rank hashes a share when ``all_gather`` is given);
    the result and what was read (its ``version``). No manifest is ``NO_MANIFEST``: callers that load refuse
    it (:attr:`RemoteFiles.version` raises), unlike a local folder of an older version."""
    found = RemoteFiles(ckpt)
    kwargs: dict[str, Any] = {"rank": rank, "world_size": world_size}
    if all_gather is not None:
        kwargs["all_gather"] = all_gather
    return verify_files(found, **kwargs), found


def read_version_metadata(ckpt: RemoteCheckpoint, version: str, name: str | None = None) -> Any:
    """DCP's ``.metadata`` of ``version``, read with the restricted unpickler (``name`` labels it in errors:
    the object's URL by default)."""
    from fsdp_strategies.checkpoint.safe_load import DCP_METADATA_FILE, load_dcp_metadata_stream

    with ckpt.fs.open(ckpt.path(version, DCP_METADATA_FILE), "rb") as fh:
        return load_dcp_metadata_stream(fh, name or ckpt.url_of(version, DCP_METADATA_FILE))


def read_remote_meta(ckpt: RemoteCheckpoint, version: str) -> dict[str, Any]:
    """Lightning's ``meta.pt`` of a verified version, read with the restricted loader."""
    from fsdp_strategies.checkpoint.safe_load import safe_torch_load

    data = ckpt.fs.cat_file(ckpt.path(version, seam.LIGHTNING_META_FILE))
    return safe_torch_load(io.BytesIO(data), name=ckpt.url_of(version, seam.LIGHTNING_META_FILE))


# ------------------------------------------------------------------------------ saving
def _agreed(
    ckpt: RemoteCheckpoint,
    what: str,
    step: Callable[[], Any],
    *,
    is_rank_zero: bool,
    version: str | None,
    share: bool = False,
    group: Any = None,
) -> Any:
    """Run this rank's ``step``, then agree (over ``group``, the default group when None): a failure on any
    rank removes the partial version (rank 0) and raises the same error on every rank."""
    error: BaseException | None = None
    result: Any = None
    try:
        result = step()
    except SAVE_ERRORS as err:
        error = err
    rank = dist.get_rank(group) if is_multi_rank() else 0
    mine = None if error is None else f"rank {rank}: {type(error).__name__}: {error}"
    gathered = all_gather_object((result if share else None, mine), group)
    failures = [outcome for _, outcome in gathered if outcome is not None]
    if failures:
        if is_rank_zero and version is not None:
            _remove_quietly(ckpt, ckpt.path(version))
        causes = "; ".join(dict.fromkeys(failures))
        raise RuntimeError(
            f"Checkpoint {ckpt.url} was not saved ({what} failed): {causes}. Nothing was committed: the "
            f"previous checkpoint there, if any, is untouched and still the one its {MANIFEST_FILE} names."
        ) from error
    return [payload for payload, _ in gathered] if share else result


def _remove_quietly(ckpt: RemoteCheckpoint, path: str) -> None:
    try:
        ckpt.fs.rm(path, recursive=True)
    except Exception:  # best effort: the store may be unreachable (botocore's errors are not OSErrors)
        pass  # the next successful save removes it


def new_version(is_rank_zero: bool) -> str:
    """Every rank (a broadcast on the default group): the name of the next save's version, rank 0's."""
    name = [
        f"{VERSION_PREFIX}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"
        if is_rank_zero
        else None
    ]
    if is_multi_rank():
        dist.broadcast_object_list(name, src=0)
    assert name[0] is not None
    return name[0]


def version_writer(ckpt: RemoteCheckpoint, version: str) -> Any:
    """torch's fsspec storage writer for ``version`` under ``ckpt`` (``dcp.save``, ``dcp.async_save``)."""
    return tseam.fsspec_storage("writer")(ckpt.url_of(version), **dict(ckpt.storage_options))


def write_shares(
    ckpt: RemoteCheckpoint, version: str, step: Callable[[], Any], *, is_rank_zero: bool, group: Any = None
) -> list[dict[str, tuple[int, str]]]:
    """Every rank: ``step`` runs (or waits for) DCP's write of ``version`` and returns DCP's result; then this
    rank reads back and hashes its share of the objects DCP wrote. Every rank's share, or the same error on
    every rank (the partial version removed)."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if is_multi_rank() else (0, 1)

    def write() -> dict[str, tuple[int, str]]:
        storage = getattr(step(), "storage_data", None) or {}
        names = sorted({info.relative_path for info in storage.values() if hasattr(info, "relative_path")})
        return {name: _digest(ckpt, ckpt.path(version, name)) for name in names[rank::world]}

    return _agreed(ckpt, "writing the shards", write, is_rank_zero=is_rank_zero, version=version, share=True,
                   group=group)


def commit_version(
    ckpt: RemoteCheckpoint,
    version: str,
    metadata: dict[str, Any],
    shares: list[dict[str, tuple[int, str]]],
    *,
    is_rank_zero: bool,
    group: Any = None,
) -> None:
    """Every rank, once every rank's shares are written and hashed: rank 0 writes Lightning's ``meta.pt`` and
    then the manifest naming ``version`` (the commit), every rank learns the outcome, rank 0 removes the other
    versions."""

    def commit() -> None:
        if is_rank_zero:
            buffer = io.BytesIO()
            torch.save(metadata, buffer)
            ckpt.fs.pipe_file(ckpt.path(version, seam.LIGHTNING_META_FILE), buffer.getvalue())
            hashed = {name: entry for share in shares for name, entry in share.items()}
            present = _listing(ckpt, version)
            if gone := sorted(set(hashed) - set(present)):
                raise CheckpointIntegrityError(
                    f"{ckpt.url_of(version)}: objects vanished while it was written: {gone}"
                )
            hashed.update(
                {name: _digest(ckpt, ckpt.path(version, name)) for name in present if name not in hashed}
            )
            # the commit: one PUT of the manifest naming this version
            ckpt.fs.pipe_file(
                ckpt.path(MANIFEST_FILE), manifest_text(hashed, **{DATA_FIELD: version}).encode()
            )

    # a failed commit leaves the version for the next save to remove: its manifest PUT may have landed
    # although the client saw an error, and then the version is the committed one
    _agreed(ckpt, "the commit", commit, is_rank_zero=is_rank_zero, version=None, group=group)
    if is_rank_zero:
        remove_other_versions(ckpt, keep=version)


def save_sharded_remote(
    tensors: dict[str, Any], metadata: dict[str, Any], ckpt: RemoteCheckpoint, *, is_rank_zero: bool
) -> str:
    """Every rank: write a sharded checkpoint to ``ckpt`` and commit it by its manifest (the module
    docstring); returns the committed version. A failure on any rank raises the same error on every rank.
    (:meth:`~fsdp_strategies.checkpoint.async_writer.AsyncCheckpointer.save_sharded_remote` runs the same
    phases in the background.)"""
    import torch.distributed.checkpoint as dcp

    version = new_version(is_rank_zero)
    writer = version_writer(ckpt, version)
    shares = write_shares(ckpt, version, lambda: dcp.save(tensors, storage_writer=writer),
                          is_rank_zero=is_rank_zero)
    commit_version(ckpt, version, metadata, shares, is_rank_zero=is_rank_zero)
    return version


def write_full(checkpoint: dict[str, Any], ckpt: RemoteCheckpoint) -> None:
    """Rank 0: a full (single-file) checkpoint as one object at ``ckpt.url`` -- its digest embedded, as in
    a local full file -- written with ``torch.save`` to a local temp file and uploaded in one ``put`` (on
    S3, GCS and Azure an object, multipart uploads included, appears complete or not at all: a reader finds
    the previous checkpoint or the new one, never part of one; an interrupted upload leaves no object)."""
    with tempfile.TemporaryDirectory(prefix="fsdp_strategies-upload-") as tmp:
        local = Path(tmp) / "checkpoint.pt"
        torch.save(embed_digest(checkpoint), local)
        ckpt.fs.put_file(str(local), ckpt.root)


def save_full_remote(
    checkpoint: dict[str, Any] | None, ckpt: RemoteCheckpoint, *, is_rank_zero: bool
) -> None:
    """Every rank: rank 0 runs :func:`write_full`; every rank learns its outcome (the same error on every
    rank)."""

    def write() -> None:
        if is_rank_zero and checkpoint is not None:
            write_full(checkpoint, ckpt)

    _agreed(ckpt, "writing the file", write, is_rank_zero=is_rank_zero, version=None)


def read_full(ckpt: RemoteCheckpoint) -> Any:
    """The full-file checkpoint object at ``ckpt.url``, read with the restricted loader (check it with
    :func:`~fsdp_strategies.checkpoint.integrity.verify_loaded`)."""
    from fsdp_strategies.checkpoint.safe_load import load_file_checkpoint

    return load_file_checkpoint(io.BytesIO(ckpt.fs.cat_file(ckpt.root)), mmap=False, name=ckpt.url)


def remove_other_versions(ckpt: RemoteCheckpoint, keep: str) -> list[str]:
    """Rank 0, after a commit: remove every version under ``ckpt`` but ``keep`` (the previous one, and what
    interrupted saves left). Best effort: what stays is removed by the next save."""
    ckpt.fs.invalidate_cache()
    try:
        entries = ckpt.fs.ls(ckpt.root, detail=False)
    except Exception:  # best effort, as _remove_quietly
        return []
    removed = []
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(VERSION_PREFIX) and name != keep:
            _remove_quietly(ckpt, ckpt.path(name))
            removed.append(name)
    return removed


def remove_remote(ckpt: RemoteCheckpoint) -> None:
    """Delete a checkpoint: its manifest first (it stops being valid at once), then every object under it.
    Called by rank 0 alone (``save_top_k``): a store that does not answer is a warning, not an error that
    would stop rank 0 while the others train on -- the checkpoint then stays, complete and valid."""
    try:
        ckpt.fs.rm(ckpt.path(MANIFEST_FILE))
    except FileNotFoundError:
        pass
    except Exception as err:  # botocore's connection errors are not OSErrors
        warnings.warn(f"Could not remove checkpoint {ckpt.url} ({type(err).__name__}: {err}); it stays, "
                      "complete and loadable. Remove it by hand if the space matters.", stacklevel=2)
        return
    _remove_quietly(ckpt, ckpt.root)


def upload_file(local: str | os.PathLike[str], url: str, what: str,
                storage_options: Mapping[str, Any] | None = None) -> None:
    """Write the local file ``local`` as the one object ``url``: an object store puts an object whole or not
    at all, so no reader sees part of it (what ``rename`` gives a file on disk)."""
    ckpt = open_remote(url, what, storage_options)
    ckpt.fs.put_file(os.fspath(local), ckpt.root)


def require_empty(url: str, what: str, storage_options: Mapping[str, Any] | None = None) -> RemoteCheckpoint:
    """``url`` opened, when the prefix holds no objects; else
    :class:`~fsdp_strategies.checkpoint.location.CheckpointLocationError` (nothing there is overwritten)."""
    ckpt = open_remote(url, what, storage_options)
    ckpt.fs.invalidate_cache()
    found = ckpt.fs.find(ckpt.root, detail=True)  # a folder listed with no objects left in it is not one
    if any(info.get("type") != "directory" for info in found.values()):
        raise CheckpointLocationError(f"{what}={url!r} already holds objects. Fix: choose a new prefix, or "
                                      "remove that one first (nothing in it is overwritten).")
    return ckpt


def upload_folder(local: Path, url: str, what: str, storage_options: Mapping[str, Any] | None = None,
                  last: tuple[str, ...] = ()) -> None:
    """Copy every file under the local folder ``local`` to the prefix ``url``, the files named in ``last``
    after all the others (a reader that looks for those first never sees the folder incomplete). A prefix that
    already holds objects raises :class:`~fsdp_strategies.checkpoint.location.CheckpointLocationError`:
    nothing there is overwritten."""
    ckpt = require_empty(url, what, storage_options)
    files = sorted((f for f in local.rglob("*") if f.is_file()), key=lambda f: (f.name in last, str(f)))
    for file in files:
        ckpt.fs.put_file(str(file), ckpt.path(*file.relative_to(local).parts))


def check_writable(url: str, what: str, storage_options: Mapping[str, Any] | None = None,
                   beside: bool = False) -> None:
    """Write, read back and remove one small object under ``url`` (a checkpoint directory; ``beside``: next
    to the object ``url``): an unreachable endpoint, a missing bucket, missing credentials or a denied write
    raise one :class:`~fsdp_strategies.checkpoint.location.CheckpointLocationError` naming the URL."""
    ckpt = open_remote(url, what, storage_options)
    folder = ckpt.root.rsplit("/", 1)[0] if beside else ckpt.root
    probe = f"{folder}/.fsdp_strategies-write-check-{uuid.uuid4().hex[:8]}"
    try:
        ckpt.fs.pipe_file(probe, b"ok")
        ckpt.fs.rm(probe)
    except Exception as err:  # botocore/aiohttp errors are not OSErrors: any failure here is the same answer
        raise CheckpointLocationError(
            f"{what}={url!r}: cannot write there ({type(err).__name__}: {err}). Fix: check the endpoint "
            "(AWS_ENDPOINT_URL or storage_options' endpoint_url), the bucket, the credentials "
            "(AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY or storage_options) and the write permission."
        ) from None


def check_remote_checkpoint_dir(
    url: str,
    what: str,
    *,
    storage_options: Mapping[str, Any] | None,
    is_rank_zero: bool,
    broadcast: Callable[[Any], Any],
) -> None:
    """Every rank, before training: a probe write by rank 0 under a checkpoint directory on object storage,
    with the strategy's ``storage_options`` (``broadcast``: rank 0's object to every rank); every rank raises
    the same :class:`~fsdp_strategies.checkpoint.location.CheckpointLocationError`."""
    problem = None
    if is_rank_zero:
        try:
            check_writable(url, what, storage_options)
        except CheckpointLocationError as err:
            problem = str(err)
    problem = broadcast(problem)
    if problem is not None:
        raise CheckpointLocationError(problem)
