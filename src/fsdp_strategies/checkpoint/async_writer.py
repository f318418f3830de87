"""Asynchronous, still-atomic checkpoints: the ``async_checkpoint`` option of every strategy.

``async_checkpoint="thread"`` or ``"process"``: a save copies ("stages") this rank's part of the
checkpoint into CPU memory on the training thread and returns; the write runs in the background
and training goes on. ``"off"`` (the default) keeps the synchronous save. This module writes the files and
knows no Lightning strategy; when a run's save goes to it, and its per-step check, are decided by the part the
strategy holds (:mod:`fsdp_strategies.runtime.async_checkpointing`).

How each guarantee of the synchronous save is kept:

* Sharded checkpoints (``fsdp2``, ``hsdp``, ``ft_hsdp``): :func:`torch.distributed.checkpoint.async_save`
  with DCP's own ``DefaultStager`` (kept for the run, so the CPU copies are allocated once; pinned
  memory on CUDA, shared memory for ``"process"``) writes every rank's shards into ``<name>.tmp``.
  Its collectives (planning, and the coordinator's ``.metadata`` write) run on the writer's own gloo
  group (:mod:`~fsdp_strategies._distributed`: the background group), never on the training group,
  so they cannot interleave with the training collectives.
  ``"thread"`` writes from a thread of the training process; ``"process"`` hands the staged copy to
  DCP's checkpoint daemon process (started at the first save, it lives as long as the process).
* When a rank's DCP write returns, every rank's shards and the metadata are on disk (DCP ends with a
  collective after the coordinator's metadata write). Then, still in the background, each rank hashes
  its share of the files, the hashes are gathered (on the same background group), rank 0 writes the
  checksum manifest and renames ``<name>.tmp`` to ``<name>`` (the same :func:`~.atomic.hash_share` and
  :func:`~.atomic.commit_sharded` as the synchronous save), and broadcasts the outcome: every rank's
  background job ends with the same result. A checkpoint therefore appears under its final name only when
  every rank's write is complete; a crash or SIGKILL before that leaves ``<name>.tmp`` (removed by a later
  save) and the previous checkpoint, untouched.
* Full-file checkpoints (``ddp_hooks``, ``fsdp2`` with ``save_distributed_checkpoint=False``): rank 0
  stages the checkpoint dict the same way, and a background thread runs the synchronous
  :func:`~.atomic.atomic_save_full` on it (digest, ``torch.save`` to the temp file, rename into place).
  ``"process"`` is refused there (no DCP writer).
* ``ModelCheckpoint`` bookkeeping: a ``remove_checkpoint`` that arrives while a write is in flight (the
  previous ``last`` or the k+1-th best, which Lightning removes right after the new save returns) is
  deferred until that write has committed, and dropped if it fails. ``save_last="link"`` is not covered:
  Lightning creates that link itself, to a name that appears only at the commit.
* At most one write in flight: a save that finds one still running waits for it (and says so once).
* Errors: at one fixed point of every training step (the strategy's ``on_train_batch_start``) while a
  write is in flight, one all-reduce on the strategy's training-thread agreement group (shared with
  preemption's per-step check, see :mod:`~fsdp_strategies._distributed`) tells every rank whether every
  rank's job has finished and whether any failed. A failure raises :class:`AsyncCheckpointError` on
  every rank at that same step; nothing is lost silently. With ``ddp_hooks`` under local SGD the check
  runs only on the steps where the ranks meet anyway (the preemption guard's ``check_due``).
* End of fit: ``on_train_end`` waits for the write (and raises its error); ``teardown`` and an ``atexit``
  hook wait for a write still running after an exception, so the process does not exit before the job
  has committed or failed (bounded by the process-group timeout; a failure is printed to stderr).
* A preemption checkpoint (``checkpoint_on_preempt``) is written synchronously, after any write in flight.

Limits: the staged copy costs CPU memory of the size of this rank's shards (model + optimizer
state). On CPU-only machines the background write competes with training for cores. A ``"process"``
daemon whose training process was SIGKILLed finishes the write it had started into the (abandoned)
``.tmp`` folder before it notices.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from fsdp_strategies import _torch_seam
from fsdp_strategies._distributed import AgreementGroup, is_multi_rank, rank_and_world
from fsdp_strategies.checkpoint.atomic import (
    LIGHTNING_META_FILE,
    SAVE_ERRORS,
    SaveFailure,
    agree_on_save,
    atomic_save_full,
    commit_sharded,
    failure_report,
    hash_share,
    prepare_save,
    remove_path,
    run_agreed,
    temp_path,
)
from fsdp_strategies.checkpoint.disk_full import (
    CheckpointDiskFullError,
    describe_error,
    disk_full_evidence,
    let_go,
    state_bytes,
)

if TYPE_CHECKING:
    from fsdp_strategies.checkpoint.object_store import RemoteCheckpoint

__all__ = [
    "ASYNC_CHECKPOINT_MODES",
    "AsyncCheckpointDiskFullError",
    "AsyncCheckpointError",
    "AsyncCheckpointMode",
    "AsyncCheckpointer",
    "validate_async_checkpoint",
]

#: the ``async_checkpoint`` option: a type name, or a bool (YAML reads ``off`` as ``false``; ``true`` =
#: ``"thread"``)
AsyncCheckpointMode = Literal["off", "thread", "process"] | bool
#: valid values of the ``async_checkpoint`` option
ASYNC_CHECKPOINT_MODES: tuple[str, ...] = ("off", "thread", "process")


class AsyncCheckpointError(RuntimeError):
    """A background checkpoint write failed; the previous checkpoint is untouched."""


class AsyncCheckpointDiskFullError(CheckpointDiskFullError, AsyncCheckpointError):
    """A background checkpoint write ran out of disk space: the one clear full-disk error (an ``OSError``,
    ``ENOSPC``), still caught by ``except AsyncCheckpointError``."""


def validate_async_checkpoint(value: Any, *, full_file: bool = False, strategy: str = "") -> str:
    """Check the ``async_checkpoint`` option at ``__init__`` (before any process group); return it."""
    if value is None or value is False:
        return "off"
    if value is True:
        return "thread"
    if value not in ASYNC_CHECKPOINT_MODES:
        raise ValueError(
            f"async_checkpoint={value!r} is not a valid value. Fix: one of {list(ASYNC_CHECKPOINT_MODES)} "
            "('thread' or true: background thread, 'process': "
            "DCP's checkpoint process, 'off' or false: synchronous)."
        )
    if value == "process" and full_file:
        raise ValueError(
            "async_checkpoint='process' needs a sharded (DCP) "
            f"checkpoint, but {strategy or 'this strategy'} writes one "
            "full file from rank 0. Fix: async_checkpoint: thread "
            "(or save_distributed_checkpoint: true under fsdp2)."
        )
    return str(value)


@dataclass
class _Write:
    """One checkpoint write in flight on this rank (every rank of the group has one, symmetric)."""

    path: Path | str  # a local folder or file, or a URL (object storage)
    started: float
    thread: threading.Thread | None = None
    error: str | None = None  # set by the background job; the same on every rank once it finished
    failure: SaveFailure | None = None  # what the ranks agreed on (a full disk: the one clear error)
    needed: int = 0  # bytes of the checkpoint, for a full-disk report
    removals: list[Callable[[], None]] = field(default_factory=list)  # run on rank 0 once committed

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


def _name(path: Path | str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


_LIVE: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()
_atexit_registered = False


def _wait_all_at_exit() -> None:
    """``atexit``: a write still running (e.g. a save after ``fit``) finishes before the interpreter does."""
    for checkpointer in list(_LIVE):
        checkpointer.close(reason="the end of the program")


class AsyncCheckpointer:
    """The background-write engine of one strategy instance (see the module docstring).

    Protocol: every rank of the strategy's (default) process group calls :meth:`save_sharded` /
    :meth:`save_full`, :meth:`poll` and :meth:`finish` at the same points; :meth:`defer_removal` and
    :meth:`close` are local. ``agreement``: the training-thread group of the per-step check (the strategy's
    own, shared with preemption); the background collectives get a group of their own.
    """

    def __init__(self, mode: str, name: str = "fsdp_strategies", timeout: timedelta | None = None,
                 agreement: AgreementGroup | None = None) -> None:
        self.mode = mode
        self.name = name
        self.timeout = timeout
        self._write: _Write | None = None
        self._stager: Any = None
        self._background = AgreementGroup(timeout)  # DCP's and the background job's collectives
        self._agreement = agreement if agreement is not None else AgreementGroup(timeout)
        self._told_wait = False
        #: seconds the training thread spent in each save call (staging included), for the benchmark
        self.last_save_s = 0.0
        self.last_write_s = 0.0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def in_flight(self) -> bool:
        return self._write is not None

    def _get_stager(self) -> Any:
        """DCP's ``DefaultStager``, kept for the run where torch allows it: its CPU copies are allocated at
        the first save and reused (safe: a save starts only after the previous write finished); a new one per
        save where a stager stages only once (torch 2.11, see
        :func:`~fsdp_strategies._torch_seam.default_stager_reusable`). Synchronous: the copy is complete when
        the save returns, so the optimizer may change the parameters right after."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is not None and not _torch_seam.default_stager_reusable():
            self._release_stager()  # torch 2.11: a stager stages once (the previous write has finished)
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda,
                                                        use_shared_memory=self.mode == "process",
                                                        use_async_staging=False, use_non_blocking_copy=False))
        return self._stager

    def _register_exit_wait(self) -> None:
        global _atexit_registered
        _LIVE.add(self)
        if not _atexit_registered:
            atexit.register(_wait_all_at_exit)  # registered after the gloo quiesce hook: runs before it
            _atexit_registered = True

    # ------------------------------------------------------------------ saving
    def _before_save(self) -> None:
        if self._write is None:
            return
        if self._write.running() and not self._told_wait:
            self._told_wait = True
            rank_zero_info(
                f"{self.name}: async_checkpoint: the previous checkpoint ({_name(self._write.path)}) is "
                "still being written; this save waits for it (at most one write in flight). Said once; "
                "checkpoint less often to avoid waiting."
            )
        self.finish()

    def save_sharded(
        self, tensors: dict[str, Any], metadata: dict[str, Any], path: Path, *, is_rank_zero: bool
    ) -> None:
        """Every rank: stage this rank's shards, start DCP's async save into ``<path>.tmp``, return."""
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        t0 = time.perf_counter()
        self._before_save()
        tmp = temp_path(path)
        needed = state_bytes(tensors)

        def prepare() -> None:
            if is_rank_zero:
                prepare_save(path)
                tmp.mkdir(parents=True, exist_ok=True)
                torch.save(metadata, tmp / LIGHTNING_META_FILE)  # small; part of the manifest like the shards

        run_agreed(path, prepare, needed=needed, is_rank_zero=is_rank_zero)  # stands for the barrier
        distributed = is_multi_rank()
        # on the training thread: every rank creates it at this point (a gloo group at world size 1 too: DCP's
        # async_save refuses a default group without a CPU backend, e.g. NCCL alone on one GPU)
        bg_group = self._background.group(single_rank=True)
        kind = AsyncCheckpointerType.PROCESS if self.mode == "process" else AsyncCheckpointerType.THREAD
        future = dcp.async_save(tensors, storage_writer=dcp.FileSystemWriter(tmp), process_group=bg_group,
                                async_checkpointer_type=kind, async_stager=self._get_stager(),
                                no_dist=not distributed)
        if hasattr(future, "upload_completion"):  # an AsyncSaveResponse (asynchronous staging)
            future = future.upload_completion
        write = _Write(path=path, started=time.perf_counter(), needed=needed)
        write.thread = threading.Thread(target=self._finish_sharded,
                                        args=(write, future, tmp, is_rank_zero, bg_group),
                                        name=f"{self.name}-checkpoint-commit", daemon=False)
        self._write = write
        self._register_exit_wait()
        write.thread.start()
        self.last_save_s = time.perf_counter() - t0

    def _finish_sharded(self, write: _Write, future: Any, tmp: Path, is_rank_zero: bool, group: Any) -> None:
        """Background, every rank: wait for DCP, hash this rank's share, agree (a failure: rank 0 removes the
        temp), rank 0 commits, agree again: every rank ends with the same outcome."""
        error: BaseException | None = None
        share: dict[str, tuple[int, str]] = {}
        rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
        agreed = {"needed": write.needed, "is_rank_zero": is_rank_zero, "group": group}
        try:
            share = hash_share(tmp, future.result(), rank, world)
        except BaseException as err:
            error = err
        try:
            shares, failure = agree_on_save(write.path, error, payload=share, **agreed)
            if failure is None:
                try:
                    if is_rank_zero:
                        commit_sharded(write.path, shares)
                except SAVE_ERRORS as err:
                    error = err
                _, failure = agree_on_save(write.path, error, **agreed)
            write.failure = failure
            write.error = None if failure is None else failure.message
        except BaseException as err:
            write.error = describe_error(error or err, rank)

    def save_sharded_remote(self, tensors: dict[str, Any], metadata: dict[str, Any], ckpt: RemoteCheckpoint,
                            *, is_rank_zero: bool) -> None:
        """Every rank: stage this rank's shards, start DCP's async save of a new version on object storage,
        return; the background job hashes and commits it by its manifest, as the synchronous
        :func:`~fsdp_strategies.checkpoint.object_store.save_sharded_remote` does (its phases, on the
        background group)."""
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        from fsdp_strategies.checkpoint import object_store

        t0 = time.perf_counter()
        self._before_save()
        version = object_store.new_version(is_rank_zero)  # training thread: a broadcast on the default group
        bg_group = self._background.group(single_rank=True)
        kind = AsyncCheckpointerType.PROCESS if self.mode == "process" else AsyncCheckpointerType.THREAD
        future = dcp.async_save(tensors, storage_writer=object_store.version_writer(ckpt, version),
                                process_group=bg_group, async_checkpointer_type=kind,
                                async_stager=self._get_stager(), no_dist=not is_multi_rank())
        if hasattr(future, "upload_completion"):
            future = future.upload_completion

        def finish() -> None:  # background, every rank: the same phases as the synchronous save
            shares = object_store.write_shares(ckpt, version, future.result, is_rank_zero=is_rank_zero,
                                               group=bg_group)
            object_store.commit_version(ckpt, version, metadata, shares, is_rank_zero=is_rank_zero,
                                        group=bg_group)

        write = _Write(path=ckpt.url, started=time.perf_counter())
        write.thread = threading.Thread(target=self._run_remote, args=(write, finish), daemon=False,
                                        name=f"{self.name}-checkpoint-commit")
        self._write = write
        self._register_exit_wait()
        write.thread.start()
        self.last_save_s = time.perf_counter() - t0

    @staticmethod
    def _run_remote(write: _Write, finish: Callable[[], None]) -> None:
        try:
            finish()  # its failures are agreed: every rank ends with the same error
        except BaseException as err:
            write.error = str(err) or type(err).__name__

    def save_full(self, checkpoint: dict[str, Any], path: Path | RemoteCheckpoint, *,
                  is_rank_zero: bool) -> None:
        """Every rank (rank 0 writes): stage the checkpoint dict, then digest + ``torch.save`` + rename in a
        thread (or, at a URL, the upload of one object:
        :func:`~fsdp_strategies.checkpoint.object_store.write_full`)."""
        t0 = time.perf_counter()
        self._before_save()
        write = _Write(path=path if isinstance(path, Path) else path.url, started=time.perf_counter(),
                       needed=state_bytes(checkpoint) if is_rank_zero else 0)
        if is_rank_zero:
            staged = self._get_stager().stage(checkpoint)
            write.thread = threading.Thread(target=self._finish_full, args=(write, staged, path),
                                            daemon=False, name=f"{self.name}-checkpoint-write")
        self._write = write
        self._register_exit_wait()
        if write.thread is not None:
            write.thread.start()
        self.last_save_s = time.perf_counter() - t0

    @staticmethod
    def _finish_full(write: _Write, staged: dict[str, Any], target: Path | RemoteCheckpoint) -> None:
        """Background, rank 0 only: digest + ``torch.save`` + rename; a failure removes the temp (the other
        ranks learn it at the next agreement point, :meth:`_fail`)."""
        from fsdp_strategies.checkpoint import object_store

        try:
            if isinstance(target, Path):
                atomic_save_full(staged, target)
            else:
                object_store.write_full(staged, target)
        except BaseException as err:
            let_go(err)  # its open temp file would keep the space after the removal
            if not isinstance(target, Path):  # nothing was committed: the upload is one object or none
                write.error = describe_error(err, 0)
                return
            write.failure = failure_report(
                target, [(describe_error(err, 0), disk_full_evidence(err, target.parent, write.needed))],
                write.needed)
            write.error = write.failure.message

    # ------------------------------------------------------------------ ModelCheckpoint bookkeeping
    def defer_removal(self, filepath: Any, remove: Callable[[], None] | None = None) -> bool:
        """True if a write is in flight: ``remove`` (default: remove the local file or folder) then runs (on
        rank 0) once it has committed."""
        if self._write is None:
            return False
        if str(filepath) != str(self._write.path):
            self._write.removals.append(remove or (lambda: remove_path(Path(str(filepath)))))
        return True

    # ------------------------------------------------------------------ agreement points
    def poll(self) -> None:
        """Every rank, at the same point of a step: finish the bookkeeping of a completed write, raise its
        error."""
        write = self._write
        if write is None:
            return
        running, failed = self._agreement.agree_any(write.running(), write.error is not None)
        if failed:
            self._fail(write)
        if not running:
            self._completed(write)

    def finish(self) -> None:
        """Every rank: wait for the write in flight (if any), then as :meth:`poll`."""
        write = self._write
        if write is None:
            return
        if write.thread is not None:
            write.thread.join()
        self.poll()

    def _fail(self, write: _Write) -> None:
        gathered = self._agreement.all_gather_object((write.error, write.failure))
        first = next((e for e, _ in gathered if e), "unknown error")
        self._write = None  # the deferred removals are dropped: the previous checkpoints stay
        disk_full = next((f for _, f in gathered if f is not None and f.disk_full), None)
        if disk_full is not None:  # the one clear error, the same on every rank
            raise AsyncCheckpointDiskFullError(disk_full.message, path=write.path, needed=disk_full.needed,
                                               free=disk_full.free, last_good=disk_full.last_good)
        raise AsyncCheckpointError(
            f"{self.name}: the background write of checkpoint "
            f"{write.path} failed ({first}). It was not committed: "
            "the previous checkpoint is untouched. Fix: check "
            "the checkpoint directory (space, permissions) and "
            "resume from the last complete checkpoint, or set "
            "async_checkpoint: off to see the error synchronously."
        )

    def _completed(self, write: _Write) -> None:
        self._write = None
        self.last_write_s = time.perf_counter() - write.started
        if write.removals and rank_and_world()[0] == 0:
            for remove in write.removals:
                remove()

    def close(self, reason: str = "teardown") -> None:
        """Local, no collective: wait for a job still running (bounded by the group timeout); report a
        failure."""
        write = self._write
        if write is None:
            self._release_stager()
            return
        if write.thread is not None and write.thread.is_alive():
            limit = self.timeout.total_seconds() if self.timeout is not None else None
            print(f"{self.name}: waiting for the background write of {write.path} before {reason}.",
                  file=sys.stderr, flush=True)
            write.thread.join(limit)
        self._write = None
        if write.thread is not None and write.thread.is_alive():
            print(f"{self.name}: ERROR: the background write of "
                  f"{write.path} did not finish; it is not committed "
                  "(the previous checkpoint is untouched).", file=sys.stderr, flush=True)
        elif write.error is not None:
            print(f"{self.name}: ERROR: the background write of "
                  f"{write.path} failed ({write.error}); it is not "
                  "committed (the previous checkpoint is untouched).", file=sys.stderr, flush=True)
        self._release_stager()

    def _release_stager(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None

