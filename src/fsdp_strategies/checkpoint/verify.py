"""Verification before use: every rank before a resume, one process for the ``fsdp-strategies-verify``
command.

:mod:`~fsdp_strategies.checkpoint.integrity` computes and compares checksums; this module applies it to
a checkpoint on disk:

* before a resume, on every rank of the default group: :func:`verify_folder_before_load` (the ranks
  share the hashing of a sharded folder) and :func:`load_full_file` (restricted load of a single file,
  checked against its digest by rank 0). A failure on any rank is raised on every rank, so none is left
  waiting in a collective; a checkpoint without checksums loads with one warning.
* in a single process: :func:`verify_checkpoint` checks the checksums and then that a verified folder's
  ``.metadata`` parses (restricted) and names only byte ranges that exist; :func:`verify_main` is the
  ``fsdp-strategies-verify PATH...`` command (exit status 0 verified, 1 corrupted/unreadable, 2 no manifest).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from fsdp_strategies._distributed import all_gather_object, rank_and_world
from fsdp_strategies.checkpoint.atomic import resolve_checkpoint_path
from fsdp_strategies.checkpoint.integrity import (
    FIX_CORRUPT,
    MANIFEST_FILE,
    CheckpointIntegrityError,
    VerifyResult,
    VerifyStatus,
    verify_folder,
    verify_loaded,
)
from fsdp_strategies.checkpoint.location import CheckpointLocationError, url_or_none
from fsdp_strategies.checkpoint.object_store import (
    RemoteCheckpoint,
    open_remote,
    read_full,
    read_version_metadata,
    verify_remote,
)
from fsdp_strategies.checkpoint.safe_load import (
    DCP_METADATA_FILE,
    UnsafeCheckpointError,
    load_dcp_metadata,
    load_file_checkpoint,
)

__all__ = ["load_full_file", "verify_checkpoint", "verify_folder_before_load", "verify_main"]


def _before_load(result: VerifyResult) -> None:
    if (unverified := result.require_intact()) is not None:
        rank_zero_warn(f"{unverified}. Loading it unverified.")


def verify_folder_before_load(path: Path) -> None:
    """Every rank of the default group, before a sharded checkpoint is read: check the manifest (the ranks
    share the hashing) and raise the same :class:`CheckpointIntegrityError` on every rank on a mismatch;
    warn once if there is no manifest. Nothing is unpickled before this passes."""
    rank, world = rank_and_world()
    _before_load(verify_folder(path, rank=rank, world_size=world, all_gather=all_gather_object))


def load_full_file(path: Path | RemoteCheckpoint, *, mmap: bool = True) -> dict[str, Any]:
    """Every rank of the default group: restricted ``torch.load`` (mmap) of a single-file checkpoint (or of
    one object on object storage), checked against its embedded digest by rank 0. Any rank's failure is
    raised on every rank, so none is left waiting in a collective."""
    rank, _ = rank_and_world()
    loaded: Any = None
    error: BaseException | None = None
    try:
        loaded = read_full(path) if isinstance(path, RemoteCheckpoint) else load_file_checkpoint(
            path, mmap=mmap)
    except (CheckpointIntegrityError, UnsafeCheckpointError) as err:
        error = err
    result = verify_loaded(loaded, path) if rank == 0 and error is None else None
    gathered = all_gather_object(
        (None if error is None else (isinstance(error, UnsafeCheckpointError), str(error)), result))
    failures = [g[0] for g in gathered if g[0] is not None]
    if failures:
        unsafe, message = failures[0]
        raise (UnsafeCheckpointError if unsafe else CheckpointIntegrityError)(message)
    _before_load(gathered[0][1])
    return loaded


def verify_checkpoint(path: str | os.PathLike[str],
                      storage_options: Mapping[str, Any] | None = None) -> VerifyResult:
    """Single-process check of a checkpoint folder or file, or of a committed checkpoint on object storage (an
    fsspec URL: its manifest, then every object; ``storage_options``: fsspec's, for the URL), what
    ``fsdp-strategies-verify`` runs."""
    if (url := url_or_none(path)) is not None:
        return _verify_url(url, storage_options)
    p = resolve_checkpoint_path(path)
    if p.is_dir():
        result = verify_folder(p)
        if result.ok:  # the bytes are the ones written; now check they parse and reference existing files
            structural = _structural_problems(p)
            return _inconsistent(str(p), structural) if structural else result
        return result
    if p.is_file():
        try:
            loaded = load_file_checkpoint(p)
        except (CheckpointIntegrityError, UnsafeCheckpointError) as err:
            return VerifyResult(VerifyStatus.CORRUPT, str(err))
        return verify_loaded(loaded, p)
    return VerifyResult(VerifyStatus.CORRUPT, f"{p}: no such checkpoint file or folder")


def _inconsistent(where: str, structural: list[str]) -> VerifyResult:
    fix = "" if "Fix:" in structural[0] else f". {FIX_CORRUPT}"
    return VerifyResult(VerifyStatus.CORRUPT, f"checkpoint {where} is inconsistent: {structural[0]}{fix}",
                        tuple(structural))


def _verify_url(url: str, storage_options: Mapping[str, Any] | None = None) -> VerifyResult:
    ckpt = open_remote(url, "PATH", storage_options)
    if ckpt.is_full_file():  # one object: its embedded digest
        try:
            return verify_loaded(read_full(ckpt), url)
        except (CheckpointIntegrityError, UnsafeCheckpointError) as err:
            return VerifyResult(VerifyStatus.CORRUPT, str(err))
    result, found = verify_remote(ckpt)
    if found.manifest_text() is None:
        return VerifyResult(VerifyStatus.CORRUPT,
                            f"{url}: no committed checkpoint there (no {MANIFEST_FILE}: "
                            "never saved, or a save that did not complete)")
    if not result.ok:
        return result
    version = found.version
    sizes = found.sizes()

    label = f"{url}/{DCP_METADATA_FILE}"
    structural = _structural(lambda: read_version_metadata(ckpt, version, label), sizes)
    return _inconsistent(url, structural) if structural else result


def _structural_problems(folder: Path) -> list[str]:
    """After the manifest matched: ``.metadata`` parses (restricted) and every byte range it names exists."""
    sizes = {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    return _structural(lambda: load_dcp_metadata(folder), sizes)


def _structural(metadata: Callable[[], Any], sizes: Mapping[str, int]) -> list[str]:
    if DCP_METADATA_FILE not in sizes:
        return [f"{DCP_METADATA_FILE}: missing (not a DCP checkpoint folder)"]
    try:
        loaded = metadata()
    except UnsafeCheckpointError as err:
        return [str(err)]
    except Exception as err:
        return [f"{DCP_METADATA_FILE}: unreadable ({type(err).__name__}: {err})"]
    problems = []
    for info in (getattr(loaded, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        if rel not in sizes:
            problems.append(f"{rel}: referenced by {DCP_METADATA_FILE} but missing")
        elif info.offset + info.length > sizes[rel]:
            problems.append(f"{rel}: {DCP_METADATA_FILE} reads bytes beyond its end")
    return sorted(set(problems))


def verify_main(argv: list[str] | None = None) -> int:
    """Console script ``fsdp-strategies-verify PATH...``: rc 0 verified, 2 no manifest, 1 corrupt or
    unreadable."""
    parser = argparse.ArgumentParser(
        prog="fsdp-strategies-verify",
        description="Check checkpoints written by fsdp_strategies "
        "against the checksums saved with them, without "
        "unpickling anything first. Exit status: 0 verified, 1 corrupted/unreadable, 2 no manifest.",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="checkpoint folder (sharded) or file, or an fsspec URL (s3://...) of a sharded "
                             "checkpoint")
    args = parser.parse_args(argv)
    statuses = []
    for path in args.paths:
        try:
            result = verify_checkpoint(path)
        except CheckpointLocationError as err:  # a URL: one line, status 1 (unreadable)
            result = VerifyResult(VerifyStatus.CORRUPT, str(err))
        statuses.append(result.status)
        print(f"{result.status.tag}: {result.message}")
    return VerifyStatus.worst(statuses).exit_code
