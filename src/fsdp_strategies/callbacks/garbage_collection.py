"""Python's garbage collector on a schedule: the same steps on every rank, timed, never left disabled.

Why: CPython's automatic collector starts a collection whenever allocations outnumber deallocations by a
threshold, so in data-parallel training each rank pauses at its own moments. In a synchronous step every
other rank then waits for the paused one inside the next collective: with many ranks some rank pauses in
almost every step, and the whole job runs at the speed of its slowest pause (torchtitan's ``gc_freq`` and
Megatron's ``--manual-gc`` exist for this reason). This callback turns the automatic collector off for
``fit`` and collects at chosen optimizer steps instead, on all ranks at once, so the pauses overlap.

How:

* ``on_train_start`` remembers whether automatic collection was on, turns it off (``gc.disable()``, with
  ``disable_automatic``) and runs one full collection, so the garbage of setup is not carried into training.
* ``on_train_batch_end``, when ``trainer.global_step`` reached a multiple of ``every_n_steps`` that was not
  collected yet, collects generation ``generation`` (generation 2, a full collection, at multiples of
  ``full_every_n_steps``). The step is decided from ``global_step`` alone, which counts optimizer steps and is
  equal on every rank of a synchronous job, so no collective is needed; under gradient accumulation the
  collection happens once, after the optimizer step. Why there: the step's activations and gradients have
  been released, so what the step left behind is collectable; and the pause lies between the optimizer step
  and the next step's data loading, outside forward and backward, whose collectives would otherwise make the
  other ranks wait in the middle of a step.
* Every collection is timed (``time.perf_counter``) and recorded in :attr:`GarbageCollection.collections`
  as ``(step, generation, seconds, collected)``; rank 0 logs ``gc/seconds``, ``gc/collected``,
  ``gc/generation`` and ``gc/seconds_total`` to the Trainer's loggers at the collection's step, whatever
  ``log_every_n_steps``; each rank's numbers stay in its own ``collections``.
* The time is also offered to other callbacks as a
  :class:`~fsdp_strategies.protocols.HostPauseSource`: :class:`~fsdp_strategies.callbacks.StragglerDetector`
  subtracts it from the rank's self time of the step it fell in, so a collection is not blamed on a slow host.
* The previous automatic-collection state is restored in ``on_train_end``, ``on_exception`` (an exception or
  ``KeyboardInterrupt`` inside ``fit``) and ``teardown``; restoring is idempotent. A user who had disabled
  automatic collection before ``fit`` keeps it disabled. ``validate``, ``test`` and ``predict`` run on their
  own are left alone; inside ``fit`` the collector stays off during validation (no collections are made
  there), and is still on during the sanity-check validation that runs before training starts.

Limits: only CPython's cyclic collector is scheduled; memory freed by reference counting is freed at once as
always. Objects that are only reachable through cycles accumulate until the next collection, so a very large
``every_n_steps`` trades pauses for host memory. Collections in other threads (a data loader thread calling
``gc.collect``) are not controlled.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from fsdp_strategies._options import OptionError, check_bool, check_int

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Collection", "GarbageCollection"]


class Collection(NamedTuple):
    """One collection made by :class:`GarbageCollection`."""

    step: int
    """``trainer.global_step`` when it ran (the start-of-training collection has the step training started
    at)."""
    generation: int
    """The generation collected (2 = full)."""
    seconds: float
    """Its duration on this rank."""
    collected: int
    """Unreachable objects found (``gc.collect``'s return value)."""


class GarbageCollection(Callback):
    """Disables automatic garbage collection during ``fit`` and collects on every rank at the same steps.

    Args:
        every_n_steps: collect generation ``generation`` every this many optimizer steps
            (``trainer.global_step`` a multiple of it), after the optimizer step.
        generation: the generation collected every ``every_n_steps`` steps: 0 (youngest objects only,
            fastest), 1 (default) or 2 (full collection).
        full_every_n_steps: a full (generation 2) collection every this many steps instead; a multiple of
            ``every_n_steps``. ``None``: no full collections after the one at the start of training.
        disable_automatic: turn Python's automatic collection off during ``fit`` (restored afterwards).
            ``False`` keeps it on and only adds the scheduled collections.
    """

    def __init__(self, every_n_steps: int = 50, generation: int = 1, full_every_n_steps: int | None = 1000,
                 disable_automatic: bool = True) -> None:
        super().__init__()
        check_int("every_n_steps", every_n_steps, 1)
        check_int("generation", generation, 0, 2, fix="0, 1 or 2 (2 = a full collection).")
        check_int("full_every_n_steps", full_every_n_steps, 1, optional=True)
        if full_every_n_steps is not None and full_every_n_steps % every_n_steps:
            below = full_every_n_steps // every_n_steps * every_n_steps
            near = " or ".join(str(v) for v in sorted({max(below, every_n_steps), below + every_n_steps}))
            raise OptionError(
                f"full_every_n_steps={full_every_n_steps!r} is "
                "invalid: it must be a multiple of every_n_steps="
                f"{every_n_steps} (a full collection replaces one "
                f"of the regular ones). Fix: e.g. {near}, or null "
                "for no full collections after the one at the start of training."
            )
        check_bool("disable_automatic", disable_automatic)
        self.every_n_steps, self.generation = every_n_steps, generation
        self.full_every_n_steps, self.disable_automatic = full_every_n_steps, disable_automatic
        #: every collection made on this rank, in order
        self.collections: list[Collection] = []
        # the automatic state before fit, while this callback holds it off
        self._was_enabled: bool | None = None
        self._last_step: int | None = None
        self._pause_s = 0.0  # collection seconds not yet taken by take_host_pause_s

    # ------------------------------------------------------------------ the automatic collector
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.disable_automatic and self._was_enabled is None:
            self._was_enabled = gc.isenabled()
            gc.disable()
        self._last_step = trainer.global_step
        self._collect(trainer, 2)

    def _restore(self) -> None:
        if self._was_enabled is not None:
            if self._was_enabled:
                gc.enable()
            self._was_enabled = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()
        if self.collections:
            total = sum(c.seconds for c in self.collections)
            rank_zero_info(
                f"GarbageCollection: {len(self.collections)} collections, {total:.3f} s in all, the longest "
                f"{max(c.seconds for c in self.collections):.3f} s (rank 0)."
            )

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    # ------------------------------------------------------------------ scheduled collections
    def generation_at(self, step: int) -> int | None:
        """The generation collected after optimizer step ``step``, or ``None`` when no collection is due."""
        if step <= 0 or step % self.every_n_steps:
            return None
        if self.full_every_n_steps is not None and step % self.full_every_n_steps == 0:
            return 2
        return self.generation

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # accumulating, or no optimizer step in this batch
            return
        self._last_step = step
        generation = self.generation_at(step)
        if generation is not None:
            self._collect(trainer, generation)

    def _collect(self, trainer: pl.Trainer, generation: int) -> None:
        t0 = time.perf_counter()
        collected = gc.collect(generation)
        seconds = time.perf_counter() - t0
        self._pause_s += seconds
        record = Collection(trainer.global_step, generation, seconds, collected)
        self.collections.append(record)
        if trainer.is_global_zero and trainer.loggers:
            total = sum(c.seconds for c in self.collections)
            metrics = {"gc/seconds": seconds, "gc/collected": float(collected),
                       "gc/generation": float(generation), "gc/seconds_total": total}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=record.step)

    def take_host_pause_s(self) -> float:
        """Seconds spent in collections since the previous call (the
        :class:`~fsdp_strategies.protocols.HostPauseSource` protocol)."""
        seconds, self._pause_s = self._pause_s, 0.0
        return seconds
