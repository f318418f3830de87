"""The atomic commit of every checkpoint, and the save steps the synchronous and background writers share.

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

One sequence, two writers: :func:`prepare_save` -> write -> (:func:`hash_share` on every rank,
:func:`commit_sharded`) or :func:`atomic_save_full` -> :func:`commit_save`, or :func:`abandon_save` after a
failure. :func:`atomic_save_sharded` / :func:`atomic_save_full` run it on the training thread; the
background writer (:mod:`fsdp_strategies.checkpoint.async_writer`) runs the same functions on its thread.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies._distributed import rank_and_world
from fsdp_strategies.checkpoint.agreement import all_gather_object
from fsdp_strategies.checkpoint.integrity import embed_digest, hash_files, write_manifest

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "abandon_save",
    "atomic_save_full",
    "atomic_save_sharded",
    "commit_save",
    "commit_sharded",
    "hash_share",
    "prepare_save",
    "remove_path",
    "resolve_checkpoint_path",
    "temp_path",
]

TMP_SUFFIX = ".tmp"
LIGHTNING_META_FILE = seam.LIGHTNING_META_FILE  # "meta.pt": what Lightning's own ModelParallelStrategy reads back
OLD_SUFFIX = ".old"
LOCK_WAIT_S = 120.0
_LOCK_NAME = re.compile(r"^\.(?P<tmp>.+\.tmp)\.lock$")
_held_locks: dict[Path, int] = {}  # temp path -> fd of its lock, for saves this process is writing


def remove_path(path: Path) -> None:
    """Remove a file, link or folder if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def temp_path(path: Path) -> Path:
    """``<path>.tmp``: where the checkpoint for ``path`` is written before the commit."""
    return _sibling(path, TMP_SUFFIX)


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
                remove_path(tmp)
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
    old, tmp = _sibling(path, OLD_SUFFIX), temp_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _acquire_save_lock(tmp)
    if not path.exists() and old.exists():
        old.rename(path)
    remove_path(old)
    remove_path(tmp)
    clean_stale_temps(path.parent, keep=tmp)
    return tmp


def commit_save(path: Path) -> None:
    """Rank 0, after the temp checkpoint is complete: move it into place and release the temp's lock."""
    tmp, old = temp_path(path), _sibling(path, OLD_SUFFIX)
    if path.is_file() and tmp.is_file():
        os.replace(tmp, path)  # atomic for files
    else:
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        remove_path(old)
    _release_save_lock(tmp)


def abandon_save(path: Path) -> None:
    """Rank 0, after a failed write: remove the partial temp and release its lock (``path`` is untouched)."""
    tmp = temp_path(path)
    try:
        remove_path(tmp)
    except OSError:
        pass  # a later save removes it (its lock is free)
    _release_save_lock(tmp)


def hash_share(tmp: Path, written: object, rank: int, world: int) -> dict[str, tuple[int, str]]:
    """Every rank, once DCP has written ``tmp``: ``{name: (size, sha256)}`` of this rank's share of the files
    named in ``written`` (the metadata ``dcp.save`` returns), shared out by sorted name."""
    storage = getattr(written, "storage_data", None) or {}
    names = sorted({info.relative_path for info in storage.values() if hasattr(info, "relative_path")})
    return hash_files(tmp, names[rank::world])


def commit_sharded(path: Path, shares: Iterable[dict[str, tuple[int, str]]]) -> None:
    """Rank 0, once every rank's shards are in ``<path>.tmp``: write the manifest (from every rank's
    :func:`hash_share`; what nobody hashed is hashed here) and commit."""
    write_manifest(temp_path(path), {name: entry for share in shares for name, entry in share.items()})
    commit_save(path)


def atomic_save_sharded(
    tensors: dict[str, Any], metadata: dict[str, Any], path: Path, *, is_rank_zero: bool, barrier: Any
) -> None:
    """Write a DCP checkpoint folder (every rank its shard) plus Lightning's ``meta.pt`` and a checksum
    manifest, atomically. Each rank hashes a share of the shard files right after DCP wrote them."""
    tmp = temp_path(path)
    if is_rank_zero:
        prepare_save(path)
    barrier()
    written = dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp))
    rank, world = rank_and_world()
    shares = all_gather_object(hash_share(tmp, written, rank, world))
    if is_rank_zero:
        torch.save(metadata, tmp / LIGHTNING_META_FILE)
        commit_sharded(path, shares)
    barrier()


def atomic_save_full(checkpoint: dict[str, Any], path: Path) -> None:
    """Rank 0 only: one ``torch.save`` file carrying its own digest, written to a temp file and renamed into place."""
    tmp = prepare_save(path)
    torch.save(embed_digest(checkpoint), tmp)
    commit_save(path)
