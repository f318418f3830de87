"""The atomic commit of every checkpoint, and the save steps the synchronous and background writers share.

Atomicity: a checkpoint is first written completely to ``<path>.tmp`` (a sharded DCP folder
or a single file), then moved into place by rank 0. A folder cannot be swapped atomically,
so the old one is first renamed to ``<path>.old``; if a crash lands between the two renames,
:func:`resolve_checkpoint_path` finds ``<path>.old`` and the next save restores it before
writing. At no moment is the last complete checkpoint missing from disk.

Integrity (:mod:`fsdp_strategies.checkpoint.integrity`): a folder gets a SHA-256 manifest of every file,
written before the rename; a single file carries a digest of its contents. Both are part of the atomic write.

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

Failures (:func:`agree_on_save`): after each step of a save that not every rank does (rank 0's preparation
and commit) or that can fail on one rank only, every rank reports its outcome in one all-gather; if any
rank failed, rank 0 removes the partial temp, and every rank raises the same error -- so no rank waits in a
barrier for a rank that has already raised. A full disk
(:mod:`fsdp_strategies.checkpoint.disk_full`) becomes one :class:`CheckpointDiskFullError` naming the bytes
needed and free and the last good checkpoint (:func:`last_good_checkpoint`), instead of DCP's per-rank
tracebacks.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies._distributed import all_gather_object, is_multi_rank, rank_and_world
from fsdp_strategies.checkpoint.disk_full import (
    CheckpointDiskFullError,
    describe_error,
    disk_full_evidence,
    disk_full_message,
    free_bytes,
    let_go,
    path_bytes,
    state_bytes,
)
from fsdp_strategies.checkpoint.integrity import embed_digest, hash_files, write_manifest
from fsdp_strategies.checkpoint.location import local_checkpoint_path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "CheckpointDiskFullError",
    "SaveFailure",
    "abandon_save",
    "agree_on_save",
    "atomic_save_full",
    "atomic_save_full_agreed",
    "atomic_save_sharded",
    "commit_save",
    "commit_sharded",
    "failure_report",
    "hash_share",
    "last_good_checkpoint",
    "prepare_save",
    "raise_save_failure",
    "remove_path",
    "resolve_checkpoint_path",
    "run_agreed",
    "temp_path",
]

#: what a save step may raise: DCP's CheckpointException is a BaseException, not an Exception
SAVE_ERRORS: tuple[type[BaseException], ...] = (Exception, dcp.CheckpointException)

TMP_SUFFIX = ".tmp"
# "meta.pt": what Lightning's own ModelParallelStrategy reads back
LIGHTNING_META_FILE = seam.LIGHTNING_META_FILE
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
                f"Another process has been writing {tmp} for over "
                f"{LOCK_WAIT_S:.0f} s (it holds {lock}). Fix: give "
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
    """The complete checkpoint for ``path``, recovering from a crash between the two renames (a URL other than
    ``file://`` raises :class:`~fsdp_strategies.checkpoint.location.CheckpointLocationError`)."""
    path = local_checkpoint_path(path, "the checkpoint path")
    old = _sibling(path, OLD_SUFFIX)
    if not path.exists() and old.exists():
        rank_zero_warn(
            f"Checkpoint {path} is missing but {old} is complete (a save was interrupted); using it."
        )
        return old
    return path


def prepare_save(path: Path) -> Path:
    """Rank 0, before a save: lock the temp, undo an interrupted swap, drop partial temps; return the temp
    path."""
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


def last_good_checkpoint(path: Path) -> Path | None:
    """The checkpoint a failed save of ``path`` leaves as the newest good one: ``path`` itself (a save never
    touches it before its commit), else the newest committed checkpoint next to it (not a temp, not hidden,
    a file with the same suffix or a folder); None if there is none."""
    current = resolve_checkpoint_path(path)
    if current.exists():
        return current
    if not path.parent.is_dir():
        return None
    candidates = [p for p in path.parent.iterdir() if not p.name.startswith(".")
                  and not p.name.endswith((TMP_SUFFIX,
                                           OLD_SUFFIX)) and (p.is_dir() or p.suffix == path.suffix)]
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)


@dataclass(frozen=True)
class SaveFailure:
    """What every rank learns about a failed save: the message to raise, and whether the disk was full."""

    message: str
    disk_full: bool = False
    needed: int = 0
    free: int = 0
    last_good: Path | None = None

    def error(self, path: Path) -> BaseException:
        """The exception every rank raises for it."""
        if self.disk_full:
            return CheckpointDiskFullError(self.message, path=path, needed=self.needed, free=self.free,
                                           last_good=self.last_good)
        return RuntimeError(
            f"Checkpoint {path} was not saved: {self.message}. The previous checkpoint is untouched."
        )


def failure_report(path: Path, failures: list[tuple[str, bool]], needed: int) -> SaveFailure:
    """Rank 0, once any rank's part of the save of ``path`` failed (``failures``: each failed rank's
    description and full-disk evidence): remove the partial temp, then measure."""
    abandon_save(path)
    causes = "; ".join(dict.fromkeys(cause for cause, _ in failures))
    if not any(full for _, full in failures):
        return SaveFailure(causes)
    last_good = last_good_checkpoint(path)
    needed = max(needed, path_bytes(last_good))
    free = free_bytes(path.parent)
    return SaveFailure(disk_full_message(path, needed=needed, free=free, last_good=last_good,
                                         temp_removed=temp_path(path), cause=causes),
                       disk_full=True, needed=needed, free=free, last_good=last_good)


def agree_on_save(path: Path, error: BaseException | None, *, needed: int, is_rank_zero: bool,
                  payload: Any = None, group: Any = None) -> tuple[list[Any], SaveFailure | None]:
    """Every rank of ``group`` (the default group when None), at the same point of a save of ``path``: share
    this rank's ``payload`` and outcome (``error``, None if its part went well; classified here, while the
    temp is still on disk: ``needed`` is the save's size in bytes). Returns every rank's payload and, if any
    rank failed, the same :class:`SaveFailure` on every rank (rank 0 removed the partial temp first)."""
    rank = dist.get_rank(group) if is_multi_rank() else 0
    if error is not None:
        let_go(error)  # a failed writer's open file would keep the temp's space after its removal
    mine = (
        None
        if error is None
        else (describe_error(error, rank), disk_full_evidence(error, path.parent, needed))
    )
    gathered = all_gather_object((payload, mine), group)
    failures = [outcome for _, outcome in gathered if outcome is not None]
    payloads = [p for p, _ in gathered]
    if not failures:
        return payloads, None
    report: list[Any] = [failure_report(path, failures, needed) if is_rank_zero else None]
    if is_multi_rank():
        dist.broadcast_object_list(report, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
    return payloads, report[0]


def raise_save_failure(path: Path, failure: SaveFailure | None, error: BaseException | None) -> None:
    """Raise what every rank agreed on (nothing if ``failure`` is None). A full disk: the one clear error,
    without the writer's chain (its cause is in the message). Otherwise this rank's own error if it has one
    (its traceback is the useful one), else an error naming the rank that failed."""
    if failure is None:
        return
    if failure.disk_full or error is None:
        raise failure.error(path) from None
    raise error


def run_agreed(
    path: Path, step: Callable[[], Any], *, needed: int, is_rank_zero: bool, share: bool = False
) -> Any:
    """Run this rank's ``step`` of the save, then :func:`agree_on_save`; its result (gathered if
    ``share``)."""
    error: BaseException | None = None
    result: Any = None
    try:
        result = step()
    except SAVE_ERRORS as err:
        error = err
    payloads, failure = agree_on_save(path, error, needed=needed, is_rank_zero=is_rank_zero,
                                      payload=result if share else None)
    raise_save_failure(path, failure, error)
    return payloads if share else result


def atomic_save_sharded(
    tensors: dict[str, Any], metadata: dict[str, Any], path: Path, *, is_rank_zero: bool
) -> None:
    """Write a DCP checkpoint folder (every rank its shard) plus Lightning's ``meta.pt`` and a checksum
    manifest, atomically. Each rank hashes a share of the shard files right after DCP wrote them.

    The ranks agree after each step (:func:`agree_on_save`), which also stands for the barriers: a failure
    anywhere is raised on every rank, after rank 0 removed the partial temp.
    """
    tmp = temp_path(path)
    rank, world = rank_and_world()
    agreed = {"needed": state_bytes(tensors), "is_rank_zero": is_rank_zero}
    run_agreed(path, lambda: prepare_save(path) if is_rank_zero else None, **agreed)
    shares = run_agreed(path,
                        lambda: hash_share(tmp, dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp)),
                                              rank, world), share=True, **agreed)

    def commit() -> None:
        if is_rank_zero:
            torch.save(metadata, tmp / LIGHTNING_META_FILE)
            commit_sharded(path, shares)

    run_agreed(path, commit, **agreed)


def atomic_save_full(checkpoint: dict[str, Any], path: Path) -> None:
    """Rank 0 only: one ``torch.save`` file carrying its own digest, written to a temp file and renamed into
    place."""
    tmp = prepare_save(path)
    torch.save(embed_digest(checkpoint), tmp)
    commit_save(path)


def atomic_save_full_agreed(checkpoint: dict[str, Any] | None, path: Path, *, is_rank_zero: bool) -> None:
    """Every rank: rank 0 runs :func:`atomic_save_full`, then the ranks agree on its outcome (a failure, e.g.
    a full disk, is raised on every rank instead of leaving the others in a barrier)."""
    def write() -> None:
        if is_rank_zero:
            assert checkpoint is not None
            atomic_save_full(checkpoint, path)

    # for a full-disk report
    needed = state_bytes(checkpoint) if is_rank_zero and checkpoint is not None else 0
    run_agreed(path, write, needed=needed, is_rank_zero=is_rank_zero)
