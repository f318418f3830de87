"""A checkpoint save that runs out of disk space: recognised, measured and reported in one message.

Why: a save that fills the disk fails deep inside a writer, and what reaches the user depends on the
writer. DCP's synchronous save raises ``CheckpointException`` (a ``BaseException`` whose text is every
rank's formatted traceback, ~200 lines); its ``"process"`` writer reports torch's zip writer's
``[enforce fail at inline_container.cc:...] unexpected pos``; only deep in the chain is the
``OSError: [Errno 28] No space left on device``. None of them says how much space was missing or which
checkpoint is still good.

How a full disk is recognised (:func:`disk_full_evidence`), on every rank that failed, while its partial
temp is still on disk: the exception chain is walked -- ``__cause__``/``__context__``, DCP's per-rank
``failures`` (``{rank: (exception, traceback)}``) and exception groups. An ``OSError`` with errno
``ENOSPC`` (or ``EDQUOT``, a full quota) is proof. Text alone ("No space left on device", torch's zip
writer's "unexpected pos" / "file write failed", which is what crosses a process boundary) counts only
when :func:`free_bytes` (``os.statvfs``) confirms it: fewer bytes free than the save needs.

How big the save is (:func:`state_bytes`): the bytes of the tensors in what is saved -- a ``DTensor``
counted once at its global size (DCP writes each shard once, whatever the replication), a plain tensor
at its own size -- and (callers) at least the size of the last good checkpoint (:func:`path_bytes`),
which includes the file overhead the tensors do not.

The message (:func:`disk_full_message`) names the checkpoint, "no space left on device", the bytes
needed and free on that filesystem (measured after the partial temp was removed), the last good
checkpoint, and ends with a "Fix:". The agreement between ranks and the removal of the temp are
:mod:`fsdp_strategies.checkpoint.atomic`'s; this module imports nothing of the package.

Limits: a filesystem whose free space changes for other reasons (other jobs writing) makes the figures
approximate; a text-only failure on a disk that has space again by the time it is checked (another
process freed some) is reported as the writer's own error.
"""

from __future__ import annotations

import errno
import gc
import os
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointDiskFullError",
    "describe_error",
    "disk_full_evidence",
    "disk_full_message",
    "free_bytes",
    "let_go",
    "path_bytes",
    "state_bytes",
]

_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
#: texts a full disk produces where the errno is lost (torch's zip writer, a writer in another process)
_DISK_FULL_TEXTS = ("no space left on device", "disk quota exceeded", "unexpected pos", "file write failed")
FIX = ("Fix: free space on that filesystem (e.g. delete old checkpoints), use a larger disk, keep fewer "
       "checkpoints (ModelCheckpoint(save_top_k=...)), or save "
       "to another filesystem (ModelCheckpoint(dirpath=...)).")


class CheckpointDiskFullError(OSError):
    """A checkpoint save ran out of disk space; raised with the same message on every rank.

    ``errno`` is ``ENOSPC``. Attributes: ``path`` (the checkpoint that was not written), ``needed`` and
    ``free`` (bytes), ``last_good`` (the checkpoint still intact, or None).
    """

    def __init__(self, message: str, *, path: Path | None = None, needed: int = 0, free: int = 0,
                 last_good: Path | None = None) -> None:
        super().__init__(errno.ENOSPC, message)
        self.path, self.needed, self.free, self.last_good = path, needed, free, last_good

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> Any:  # picklable with its keyword arguments (OSError's own reduce drops them)
        return (_rebuild, (type(self), str(self.strerror), self.path, self.needed, self.free, self.last_good))


def _rebuild(cls: type[CheckpointDiskFullError], message: str, path: Path | None, needed: int, free: int,
             last_good: Path | None) -> CheckpointDiskFullError:
    return cls(message, path=path, needed=needed, free=free, last_good=last_good)


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err`` and every exception behind it: causes, contexts, DCP's per-rank failures, exception groups."""
    seen: set[int] = set()
    stack: list[Any] = [err]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple) and item:  # DCP's WRAPPED_EXCEPTION: (exception, traceback summary)
            item = item[0]
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            stack.extend(failures.values())
        stack.extend(getattr(item, "exceptions", None) or ())
        stack.extend(e for e in (item.__cause__, item.__context__) if e is not None)


def let_go(err: BaseException) -> None:
    """Drop the local variables of the frames behind ``err`` (tracebacks keep file lines, not locals), then
    collect: a writer that failed mid-write (torch's zip writer) leaves its file open in those frames, and
    an unlinked file that is still open keeps its blocks -- the partial temp would be removed but its
    space not freed, and the free bytes reported would be wrong."""
    for item in _chain(err):
        traceback.clear_frames(item.__traceback__)
    gc.collect()


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``directory`` (``os.statvfs``;
    the nearest existing parent is asked if it does not exist)."""
    probe = Path(directory)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    stats = os.statvfs(probe)
    return int(stats.f_bavail * stats.f_frsize)


def disk_full_evidence(err: BaseException, directory: Path, needed: int) -> bool:
    """Whether ``err`` is a full disk: an ``ENOSPC``/``EDQUOT`` errno anywhere in its chain, or a full-disk
    text confirmed by ``os.statvfs`` (fewer than ``needed`` bytes free in ``directory``). Call it before the
    partial temp is removed."""
    text_only = False
    for item in _chain(err):
        if isinstance(item, OSError) and item.errno in _DISK_FULL_ERRNOS:
            return True
        text_only = text_only or any(t in str(item).lower() for t in _DISK_FULL_TEXTS)
    if not text_only:
        return False
    try:
        return free_bytes(directory) < max(needed, 1)
    except OSError:
        return False


def describe_error(err: BaseException, rank: int | None = None) -> str:
    """One line naming the rank and the error; for DCP's ``CheckpointException`` (the same on every rank: DCP
    gathered it), the first failed rank's error instead of every rank's traceback."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first_rank, wrapped = sorted(failures.items(), key=lambda kv: kv[0])[0]
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        more = f" (and on {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
        return f"{describe_error(cause, first_rank)}{more}"
    text = " ".join(str(err).split())
    where = f"rank {rank}: " if rank is not None else ""
    return f"{where}{type(err).__name__}: {text[:400]}" if text else f"{where}{type(err).__name__}"


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: a ``DTensor`` at its global size, once."""
    if isinstance(obj, torch.Tensor):
        return int(obj.numel()) * obj.element_size()  # a DTensor's numel() is its global numel
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(state_bytes(v) for v in obj)
    return 0


def path_bytes(path: Path | None) -> int:
    """Bytes of a checkpoint file or folder on disk (0 if it does not exist)."""
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _bytes(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:.1f} MiB)"


def disk_full_message(path: Path, *, needed: int, free: int, last_good: Path | None, temp_removed: Path,
                      cause: str) -> str:
    """The one message every rank raises (see the module docstring)."""
    keeps = (
        (
            f"The last good checkpoint is {last_good}; it is "
            "untouched (check it with `fsdp-strategies-verify "
            f"{last_good}`)."
        )
        if last_good is not None
        else f"There is no earlier checkpoint in {path.parent}."
    )
    kept = (
        " while the previous checkpoint stays on disk until the new one is complete"
        if last_good == path
        else ""
    )
    return (f"Checkpoint {path} was not saved: no space left "
            f"on device. It needs about {_bytes(needed)}{kept}; "
            f"{_bytes(free)} are free on the filesystem of {path.parent} (after removing the partial "
            f"{temp_removed.name}). {keeps} (Cause: {cause}.) {FIX}")
