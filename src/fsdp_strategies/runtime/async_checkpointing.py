"""The ``async_checkpoint`` option as a part a strategy holds: when a save goes to the background writer.

:mod:`fsdp_strategies.checkpoint.async_writer` writes the files (stage, write, hash, commit, agree); it knows
no Lightning strategy. This module is the strategy's side of it, the decisions tied to a training run:

* whether a save goes to the background: not while the preemption guard writes its checkpoint (that one is
  synchronous, after the write in flight has finished: the job is about to exit);
* when the per-step check runs: at the strategy's ``on_train_batch_start``, on the steps the preemption
  guard's ``check_due`` allows (under local SGD the ranks meet only after a global averaging);
* a checkpoint removal that arrives while a write is in flight waits for its commit;
* a ``CheckpointIO`` plugin the full-file writer would bypass is refused when the strategy connects.

What it needs from the preemption guard is two questions, asked through the guard object the strategy hands
it: :meth:`~fsdp_strategies.runtime.preemption.PreemptionGuard.is_saving` and
:meth:`~fsdp_strategies.runtime.preemption.PreemptionGuard.check_due`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from fsdp_strategies._distributed import AgreementGroup
from fsdp_strategies.checkpoint.async_writer import AsyncCheckpointer, validate_async_checkpoint
from fsdp_strategies.runtime.preemption import PreemptionGuard

__all__ = ["AsyncCheckpointing"]


class AsyncCheckpointing:
    """The ``async_checkpoint`` option of one strategy instance (see the module docstring).

    Args:
        mode: the option's value (checked here, at the strategy's ``__init__``, before any process group).
        full_file: the strategy writes one full file from rank 0 (``"process"`` is refused then).
        name: the strategy's name, for messages.
        timeout: the strategy's collective timeout (bounds the wait for a write at teardown).
        agreement: the strategy's training-thread agreement group (shared with the preemption guard).
        preemption: the strategy's preemption guard, asked :meth:`~PreemptionGuard.is_saving` and
            :meth:`~PreemptionGuard.check_due`.
    """

    def __init__(self, mode: Any, *, full_file: bool, name: str, timeout: timedelta | None,
                 agreement: AgreementGroup, preemption: PreemptionGuard) -> None:
        self.mode = validate_async_checkpoint(mode, full_file=full_file, strategy=name)
        self.full_file = full_file
        self.name = name
        self.timeout = timeout
        self._agreement = agreement
        self._preemption = preemption
        self._writer: AsyncCheckpointer | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def writer(self) -> AsyncCheckpointer:
        """The background writer (created on first use)."""
        if self._writer is None:
            self._writer = AsyncCheckpointer(self.mode, self.name, self.timeout, agreement=self._agreement)
        return self._writer

    def use_background(self) -> bool:
        """Whether this save goes to the background (every rank, at the start of a save). A preemption
        checkpoint is written synchronously, after the write in flight (if any) has finished."""
        if not self.enabled:
            return False
        if self._preemption.is_saving():
            self.writer.finish()
            return False
        return True

    def remove_when_safe(self, filepath: Any, remove: Callable[[], None]) -> None:
        """``remove`` now, or (rank 0) once the write in flight has committed (dropped if it fails)."""
        if self._writer is None or not self._writer.defer_removal(filepath, remove):
            remove()

    def poll_if_due(self) -> None:
        """Every rank, at the strategy's ``on_train_batch_start``: the per-step check of a write in flight."""
        if self._writer is not None and self._writer.in_flight and self._preemption.check_due():
            self._writer.poll()

    def finish(self) -> None:
        """Every rank, at the end of training: wait for the write in flight and raise its error."""
        if self._writer is not None:
            self._writer.finish()

    def close(self) -> None:
        """Local, at teardown: wait for a write still running after an exception; report a failure."""
        if self._writer is not None:
            self._writer.close()

    def check_io(self, checkpoint_io: Any) -> None:
        """Refuse a ``CheckpointIO`` plugin that a background full-file write would bypass."""
        if not (self.enabled and self.full_file):
            return
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        if checkpoint_io is not None and type(checkpoint_io) is not TorchCheckpointIO:
            raise ValueError(
                f"async_checkpoint={self.mode!r} writes the checkpoint file itself (torch.save to a temp "
                f"file, then an atomic rename) and would bypass the CheckpointIO plugin "
                f"{type(checkpoint_io).__name__}. Fix: remove the plugin, or set async_checkpoint: off."
            )
