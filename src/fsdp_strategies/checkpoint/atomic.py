"""Checkpoint I/O shared by every strategy: atomic DCP/full saves with checksums, and a consolidated export.

Atomicity: a checkpoint is first written completely to ``<path>.tmp`` (a sharded DCP folder
or a single file), then moved into place by rank 0. A folder cannot be swapped atomically,
so the old one is first renamed to ``<path>.old``; if a crash lands between the two renames,
:func:`resolve_checkpoint_path` finds ``<path>.old`` and the next save restores it before
writing. At no moment is the last complete checkpoint missing from disk.

Integrity (:mod:`fsdp_strategies.checkpoint.integrity`): a folder gets a SHA-256 manifest of every file, written before
the rename; a single file carries a digest of its contents. Both are part of the atomic write.

Stale temps: while rank 0 writes ``<name>.tmp`` it holds an exclusive ``flock`` on
``.<name>.tmp.lock`` next to it. Any later save in the same directory removes a ``*.tmp`` whose
lock it can take (its writer is gone: a crash mid-save) and leaves alone one whose lock is held
(another run or another ft_hsdp replica group writing right now). Entries without such a lock
file are not this package's and are never touched. (Without ``fcntl``, e.g. on Windows, only the
save's own temp is cleaned.)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies.checkpoint.integrity import (
    CheckpointIntegrityError,
    VerifyResult,
    embed_digest,
    hash_files,
    load_file_checkpoint,
    verify_folder,
    verify_loaded,
    write_manifest,
)
from fsdp_strategies.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    load_dcp_metadata,
)

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "atomic_save_full",
    "atomic_save_sharded",
    "export_consolidated",
    "resolve_checkpoint_path",
]

TMP_SUFFIX = ".tmp"
LIGHTNING_META_FILE = seam.LIGHTNING_META_FILE  # "meta.pt": what Lightning's own ModelParallelStrategy reads back
OLD_SUFFIX = ".old"
LOCK_WAIT_S = 120.0
_LOCK_NAME = re.compile(r"^\.(?P<tmp>.+\.tmp)\.lock$")
_held_locks: dict[Path, int] = {}  # temp path -> fd of its lock, for saves this process is writing


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _lock_path(tmp: Path) -> Path:
    return tmp.with_name(f".{tmp.name}.lock")


def _try_lock(lock: Path, *, create: bool) -> int | None:
    """An fd holding an exclusive flock on ``lock``, or None if someone else holds it (or it vanished)."""
    assert fcntl is not None
    try:
        fd = os.open(lock, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        same = os.stat(lock).st_ino == os.fstat(fd).st_ino  # not unlinked by a finished writer meanwhile
    except OSError:
        same = False
    if not same:
        os.close(fd)
        return None
    return fd


def _release(lock: Path, fd: int) -> None:
    try:
        lock.unlink()
    except FileNotFoundError:
        pass
    os.close(fd)


def _acquire_save_lock(tmp: Path) -> None:
    if fcntl is None or tmp in _held_locks:
        return
    lock = _lock_path(tmp)
    deadline = time.monotonic() + LOCK_WAIT_S
    while (fd := _try_lock(lock, create=True)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"Another process has been writing {tmp} for over {LOCK_WAIT_S:.0f} s (it holds {lock}). Fix: give "
                "each run its own checkpoint directory, or stop the other run."
            )
        time.sleep(0.2)
    _held_locks[tmp] = fd


def _release_save_lock(tmp: Path) -> None:
    fd = _held_locks.pop(tmp, None)
    if fd is not None:
        _release(_lock_path(tmp), fd)


def clean_stale_temps(directory: Path, keep: Path | None = None) -> list[Path]:
    """Remove ``*.tmp`` checkpoints in ``directory`` whose writer is gone (its lock is free); return them."""
    if fcntl is None or not directory.is_dir():
        return []
    removed = []
    for lock in sorted(directory.iterdir()):
        match = _LOCK_NAME.match(lock.name)
        if match is None:
            continue
        tmp = directory / match["tmp"]
        if tmp == keep or tmp in _held_locks:
            continue
        fd = _try_lock(lock, create=False)
        if fd is None:
            continue  # a live writer (another run / replica group) holds it
        try:
            if tmp.exists() or tmp.is_symlink():
                _remove(tmp)
                removed.append(tmp)
        finally:
            _release(lock, fd)
    if removed:
        rank_zero_warn(f"Removed {len(removed)} checkpoint temp(s) left by interrupted saves: "
                       f"{', '.join(p.name for p in removed)}")
    return removed


def resolve_checkpoint_path(path: str | os.PathLike[str]) -> Path:
    """The complete checkpoint for ``path``, recovering from a crash between the two renames."""
    path = Path(path)
    old = _sibling(path, OLD_SUFFIX)
    if not path.exists() and old.exists():
        rank_zero_warn(f"Checkpoint {path} is missing but {old} is complete (a save was interrupted); using it.")
        return old
    return path


def prepare_save(path: Path) -> Path:
    """Rank 0, before a save: lock the temp, undo an interrupted swap, drop partial temps; return the temp path."""
    old, tmp = _sibling(path, OLD_SUFFIX), _sibling(path, TMP_SUFFIX)
    path.parent.mkdir(parents=True, exist_ok=True)
    _acquire_save_lock(tmp)
    if not path.exists() and old.exists():
        old.rename(path)
    _remove(old)
    _remove(tmp)
    clean_stale_temps(path.parent, keep=tmp)
    return tmp


def commit_save(path: Path) -> None:
    """Rank 0, after the temp checkpoint is complete: move it into place and release the temp's lock."""
    tmp, old = _sibling(path, TMP_SUFFIX), _sibling(path, OLD_SUFFIX)
    if path.is_file() and tmp.is_file():
        os.replace(tmp, path)  # atomic for files
    else:
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        _remove(old)
    _release_save_lock(tmp)


def _ranks() -> tuple[int, int, Callable[[Any], list[Any]]]:
    """(rank, world size, all_gather of a picklable object) of the default process group, or a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, lambda obj: [obj]
    world = dist.get_world_size()

    def all_gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, obj)
        return out

    return dist.get_rank(), world, all_gather


def atomic_save_sharded(
    tensors: dict[str, Any], metadata: dict[str, Any], path: Path, *, is_rank_zero: bool, barrier: Any
) -> None:
    """Write a DCP checkpoint folder (every rank its shard) plus Lightning's ``meta.pt`` and a checksum
    manifest, atomically. Each rank hashes a share of the shard files right after DCP wrote them."""
    tmp = _sibling(path, TMP_SUFFIX)
    if is_rank_zero:
        prepare_save(path)
    barrier()
    written = dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp))
    rank, world, all_gather = _ranks()
    storage = getattr(written, "storage_data", None) or {}
    names = sorted({info.relative_path for info in storage.values() if hasattr(info, "relative_path")})
    shares = all_gather(hash_files(tmp, names[rank::world]))
    if is_rank_zero:
        torch.save(metadata, tmp / LIGHTNING_META_FILE)
        write_manifest(tmp, {name: entry for share in shares for name, entry in share.items()})
        commit_save(path)
    barrier()


def atomic_save_full(checkpoint: dict[str, Any], path: Path) -> None:
    """Rank 0 only: one ``torch.save`` file carrying its own digest, written to a temp file and renamed into place."""
    tmp = prepare_save(path)
    torch.save(embed_digest(checkpoint), tmp)
    commit_save(path)


def _agree(result: VerifyResult) -> None:
    if result.status == "corrupt":
        raise CheckpointIntegrityError(result.message)
    if result.status == "no_manifest":
        rank_zero_warn(f"{result.message}. Loading it unverified.")


def verify_folder_before_load(path: Path) -> None:
    """Every rank of the default group, before a sharded checkpoint is read: check the manifest (the ranks
    share the hashing) and raise the same :class:`CheckpointIntegrityError` on every rank on a mismatch;
    warn once if there is no manifest. Nothing is unpickled before this passes."""
    rank, world, all_gather = _ranks()
    _agree(verify_folder(path, rank=rank, world_size=world, all_gather=all_gather))


def load_full_file(path: Path, *, mmap: bool = True) -> dict[str, Any]:
    """Every rank of the default group: restricted ``torch.load`` (mmap) of a single-file checkpoint,
    checked against its embedded digest by rank 0. Any rank's failure is raised on every rank, so
    none is left waiting in a collective."""
    rank, _, all_gather = _ranks()
    loaded: Any = None
    error: BaseException | None = None
    try:
        loaded = load_file_checkpoint(path, mmap=mmap)
    except (CheckpointIntegrityError, UnsafeCheckpointError) as err:
        error = err
    result = verify_loaded(loaded, path) if rank == 0 and error is None else None
    gathered = all_gather((None if error is None else (isinstance(error, UnsafeCheckpointError), str(error)), result))
    failures = [g[0] for g in gathered if g[0] is not None]
    if failures:
        unsafe, message = failures[0]
        raise (UnsafeCheckpointError if unsafe else CheckpointIntegrityError)(message)
    _agree(gathered[0][1])
    return loaded


def read_sharded_state_dict(folder: Path, key: str = "state_dict") -> dict[str, Any]:
    """Single process: the full tensors under ``key`` of a DCP folder, read with the restricted reader/planner."""
    import warnings

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = load_dcp_metadata(folder)
    target: dict[str, Any] = {}
    for flat, meta in metadata.state_dict_metadata.items():
        where = tuple((metadata.planner_data or {}).get(flat) or flat.split(".", 1))
        if not where or where[0] != key:
            continue
        node = target
        for part in where[:-1]:
            node = node.setdefault(part, {})
        node[where[-1]] = (torch.empty(meta.size, dtype=meta.properties.dtype)
                           if isinstance(meta, TensorStorageMetadata) else None)
    if key not in target:
        raise ValueError(f"{folder} holds no {key!r} entry: not a checkpoint written by a Lightning strategy.")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(target, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(), no_dist=True)
    return target[key]


def _warn_unverified(message: str) -> None:
    rank_zero_warn(f"{message}. Exporting it unverified.")


def export_consolidated(checkpoint: str | os.PathLike[str], output: str | os.PathLike[str], strip_prefix: str = "") -> Path:
    """Turn a sharded (DCP) or full checkpoint into one plain ``state_dict`` file.

    Runs in a single process without a process group. The result loads with
    ``model.load_state_dict(torch.load(output))`` into the plain model, no package needed.
    ``strip_prefix`` (e.g. ``"model."``) drops a LightningModule attribute prefix. The checkpoint is
    verified against its checksums first and read without running code from it (restricted
    unpicklers); on any failure nothing is left at ``output`` or ``<output>.tmp``.
    """
    src = resolve_checkpoint_path(checkpoint)
    if src.is_dir():
        result = verify_folder(src)
        if result.status == "corrupt":
            raise CheckpointIntegrityError(result.message)
        if result.status == "no_manifest":
            if not (src / ".metadata").is_file():
                raise ValueError(f"{src} is a folder but not a checkpoint: it has no DCP '.metadata' file.")
            _warn_unverified(result.message)
        state = read_sharded_state_dict(src)
    elif src.is_file():
        loaded = load_file_checkpoint(src)
        result = verify_loaded(loaded, src)
        if result.status == "corrupt":
            raise CheckpointIntegrityError(result.message)
        if not isinstance(loaded.get("state_dict"), dict):
            raise ValueError(f"{src} has no 'state_dict' entry: not a checkpoint written by a Lightning strategy.")
        if result.status == "no_manifest":
            _warn_unverified(result.message)
        state = loaded["state_dict"]
    else:
        raise FileNotFoundError(f"{src}: no such checkpoint file or folder.")
    plain = {
        (k[len(strip_prefix) :] if strip_prefix and k.startswith(strip_prefix) else k): (
            v.full_tensor() if hasattr(v, "full_tensor") else v
        )
        for k, v in state.items()
    }
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(out, TMP_SUFFIX)
    try:
        torch.save(plain, tmp)
        os.replace(tmp, out)
    finally:
        _remove(tmp)
    return out


def export_main(argv: list[str] | None = None) -> int:
    """Console script ``fsdp-strategies-export CHECKPOINT OUTPUT [--strip-prefix model.]``: rc 0 written, 1 failed."""
    parser = argparse.ArgumentParser(prog="fsdp-strategies-export", description=export_consolidated.__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint written by an fsdp_strategies strategy (folder or file)")
    parser.add_argument("output", help="where to write the consolidated state_dict (.pt)")
    parser.add_argument("--strip-prefix", default="", help="drop this prefix from every key, e.g. 'model.'")
    args = parser.parse_args(argv)
    try:
        out = export_consolidated(args.checkpoint, args.output, args.strip_prefix)
    except Exception as err:  # one line for the user, not a traceback
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"fsdp-strategies-export: error: {message}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
