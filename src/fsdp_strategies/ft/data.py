"""Data position = committed step, for ``ft_hsdp``: every replica group trains batch ``s`` of its shard at
step ``s``.

Why: Lightning's training loop advances its dataloader once per batch it runs, whatever happens to
the step. Under torchft that drifts: a discarded step consumes a batch without training it, and a
restarted replica group starts its shard at the beginning of an epoch while the quorum is at step
``s``. The groups then train batches out of phase, so a sample can be trained twice in an epoch
and another never.

The fix derives the data position from the quorum's committed step (which every group agrees on,
and which a healing group receives with the heal state), so nothing about the loader needs to be
transferred: with the fixed global batch layout of ``ft_hsdp`` (the sampler shards over
``num_replica_groups x ranks``), committed step ``s`` means batch ``s mod B`` of data epoch
``s // B`` of this rank's shard, ``B`` being the number of training batches per epoch.

Mechanism (:class:`StepAlignedData`): the training ``DataLoader`` is replaced, once, by one over
*positions*: its sampler yields global batch positions ``q`` from a cursor, and its dataset builds
the batch of position ``q`` (indices ``[i*bs, (i+1)*bs)`` of the original sampler's order for epoch
``q // B``, ``set_epoch`` on a private copy, collated with the loader's ``collate_fn``), so workers,
pinning and collation work as before. The positions the sampler handed out are remembered in order
(loaders return batches in sampler order), so each batch's position is known when
``Strategy.batch_to_device`` sees it. There the strategy asks for the batch of its committed step:

* the loader's batch when its position is the step (the normal case: no extra work);
* a batch the loader delivered earlier for that position (after a discarded step the loader is one
  batch ahead);
* otherwise (just after a heal, or after Lightning ended an epoch early) the batch is built from the
  dataset for that position, and the cursor is moved so the loader's next batches are in phase again.

Lightning's own ``current_epoch``/``batch_idx`` keep counting the batches its loop ran (discarded ones
included, and from 0 on a restarted group), so they can differ from the data epoch ``s // B``; stop
fault-tolerant runs with ``max_steps``.

Limits: one map-style training ``DataLoader`` with automatic batching (``batch_size=``, no custom
``batch_sampler``), whose sampler's order depends only on its seed and ``set_epoch``
(``DistributedSampler`` -- the one Lightning injects -- or ``SequentialSampler``); no gradient
accumulation unless ``accumulate_grad_batches`` divides the batches per epoch (committed step ``s`` trains
positions ``s * A`` to ``s * A + A - 1``); no ``reload_dataloaders_every_n_epochs``. Anything else gets a
warning and the old,
unaligned behaviour. A torchdata ``StatefulDataLoader`` is handled like a ``DataLoader`` (replaced by
a plain one over positions; its saved position is not needed, the step is).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    SequentialSampler,
)

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies.ft.resume_width import Layout, Rest, locate, rest_after
from fsdp_strategies.runtime.data_position import (
    DataPositionError,
    data_parallel_size,
    split_remainder,
)
from fsdp_strategies.runtime.resume_position import _install, _SkipFirstIterationSampler

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["StepAlignedData"]


class _PositionSampler(Sampler[int]):
    """Yields global batch positions from ``cursor`` (``length`` per iteration) and remembers them in
    order."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.cursor = 0
        self.issued: deque[int] = deque()

    def __len__(self) -> int:
        return self.length

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the position (from the committed step) decides the epoch of the data."""

    def __iter__(self) -> Iterator[int]:
        self.issued.clear()  # a new iterator: positions handed to an abandoned one will never arrive
        for _ in range(self.length):
            q = self.cursor
            self.cursor += 1
            self.issued.append(q)
            yield q


def _identity(batch: Any) -> Any:
    return batch


class _PositionBatches(Dataset[Any]):
    """Item ``q`` = the collated batch at global position ``q`` of the original loader (picklable for
    workers)."""

    def __init__(self, dataset: Any, sampler: Sampler[Any], batch_size: int, per_epoch: int,
                 collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = batch_size
        self.per_epoch = per_epoch
        self.collate_fn = collate_fn
        #: a resume at another layout: the rest of the epoch it stopped in (:mod:`.resume_width`)
        self.rest: Rest | None = None
        self._orders: dict[tuple[int, int | None], list[Any]] = {}

    def layout(self, accumulate: int = 1) -> Layout:
        """This loader's :class:`~fsdp_strategies.ft.resume_width.Layout` (with its rest)."""
        s = self.sampler
        sharded = isinstance(s, DistributedSampler)
        return Layout(width=int(s.num_replicas) if sharded else 1, batch_size=self.batch_size,
                      per_epoch=self.per_epoch, accumulate=accumulate, dataset_len=len(self.dataset),
                      shuffle=bool(s.shuffle) if sharded else False, seed=int(s.seed) if sharded else 0,
                      drop_last=bool(s.drop_last) if sharded else False, rest=self.rest)

    def _rest_indices(self, rest: Rest, j: int, shard: int | None) -> list[Any]:
        key = (-1 - rest.epoch, shard)  # (negative: not an epoch of the sampler's own)
        if key not in self._orders:
            s = self.sampler
            rank = (int(s.rank) if shard is None else shard) if isinstance(s, DistributedSampler) else 0
            order = self.layout().order(rest.epoch)
            self._orders[key] = split_remainder(order[rest.trained:], rest.width, rank, rest.drop_last)
        return self._orders[key][j * self.batch_size:(j + 1) * self.batch_size]

    def indices(self, q: int, shard: int | None = None) -> list[Any]:
        """Indices of position ``q`` of this loader's shard, or of shard ``shard`` of a
        ``DistributedSampler``."""
        epoch, i, in_rest = locate(q, self.per_epoch, self.rest)
        if in_rest:
            assert self.rest is not None
            return self._rest_indices(self.rest, i, shard)
        key = (epoch, shard)
        if key not in self._orders:
            if len(self._orders) >= 8:
                self._orders.clear()
            sampler = copy.copy(self.sampler)  # never touch the original's epoch
            if shard is not None:
                assert isinstance(sampler, DistributedSampler), "other shards need a DistributedSampler"
                sampler.rank = shard
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            self._orders[key] = list(sampler)
        return self._orders[key][i * self.batch_size:(i + 1) * self.batch_size]

    def __getitem__(self, q: int) -> Any:
        return self.collate_fn([self.dataset[i] for i in self.indices(q)])

    def __len__(self) -> int:
        return self.per_epoch


def _why_not(trainer: pl.Trainer, loaders: list[Any]) -> str | None:
    if len(loaders) != 1:
        return f"there are {len(loaders)} training dataloaders (one is supported)"
    dl = loaders[0]
    if not isinstance(dl, DataLoader):
        return f"the training dataloader is a `{type(dl).__qualname__}`, not a torch `DataLoader`"
    if isinstance(dl.dataset, IterableDataset):
        return "the training dataloader iterates an `IterableDataset` (no sampler to position)"
    if dl.batch_size is None or type(dl.batch_sampler) is not BatchSampler:
        return "the training dataloader has no `batch_size` or uses a custom `batch_sampler`"
    sampler = dl.sampler.sampler if isinstance(dl.sampler, _SkipFirstIterationSampler) else dl.sampler
    if not isinstance(sampler, (DistributedSampler, SequentialSampler)):
        return (
            f"its sampler is a `{type(sampler).__qualname__}`, whose order is not a function of its seed and "
            "epoch (use Lightning's injected `DistributedSampler`: `use_distributed_sampler=True`)"
        )
    if trainer.reload_dataloaders_every_n_epochs:
        return "reload_dataloaders_every_n_epochs is set"
    per_epoch, accumulate = trainer.num_training_batches, trainer.accumulate_grad_batches
    if not isinstance(per_epoch, int) or per_epoch < 1:
        return f"the number of training batches per epoch is {per_epoch}"
    if per_epoch % accumulate:
        return (f"accumulate_grad_batches={accumulate} does not divide the {per_epoch} training batches per "
                "epoch (Lightning ends an epoch's last step early, so steps and batch positions fall out of "
                "phase; use a divisor, or limit_train_batches / drop_last to a multiple)")
    return None


class StepAlignedData:
    """The training loader over positions and the per-step choice of the batch of the committed step."""

    #: most loader batches kept for a later step (a loader ahead of the step), per micro-batch of a step
    MAX_AHEAD = 8

    def __init__(self, loader: DataLoader, per_epoch: int, accumulate: int = 1) -> None:
        sampler = (
            loader.sampler.sampler
            if isinstance(loader.sampler, _SkipFirstIterationSampler)
            else loader.sampler
        )
        assert loader.batch_size is not None
        self.batches = _PositionBatches(loader.dataset, sampler, int(loader.batch_size), per_epoch,
                                        loader.collate_fn)
        self.positions = _PositionSampler(per_epoch)
        kwargs: dict[str, Any] = {
            "num_workers": loader.num_workers, "pin_memory": loader.pin_memory, "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "generator": loader.generator, "persistent_workers": loader.persistent_workers,
        }
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        self.loader = DataLoader(
            self.batches, sampler=self.positions, batch_size=None, collate_fn=_identity, **kwargs
        )
        self.per_epoch = per_epoch
        #: micro-batches per optimizer step (``accumulate_grad_batches``): step ``s`` trains ``s * A + m``
        self.accumulate = accumulate
        self._ahead: dict[int, Any] = {}
        #: batches built from the dataset because the loader had not delivered the step's position
        self.rebuilt = 0

    @classmethod
    def install(cls, trainer: pl.Trainer, saved: dict[str, Any] | None = None) -> StepAlignedData | None:
        """Swap the fit loop's training loader for one over positions; ``None`` (warned) if not possible.

        ``saved``: the resumed checkpoint's layout (:data:`fsdp_strategies.ft.resume_width.KEY`): the
        positions continue its mapping, at another layout from its global sample position (logged); a
        checkpoint of another data-parallel width whose position cannot be followed is refused.
        """
        fit_loop = trainer.fit_loop
        combined = seam.training_combined_loader(trainer)
        loaders = list(combined.flattened) if combined is not None else []
        reason = _why_not(trainer, loaders)
        if reason is None:
            aligned = cls(loaders[0], int(trainer.num_training_batches), int(trainer.accumulate_grad_batches))
            # before the loader's workers copy the mapping
            line = aligned.resume_from(saved, int(trainer.global_step), bool(loaders[0].drop_last))
            epoch = fit_loop.epoch_progress.current.processed
            if _install(trainer, combined, {0: aligned.loader}, epoch):
                if line:
                    rank_zero_info(line)
                return aligned
            reason = "the training iterators could not be restarted"
        width = data_parallel_size(trainer)
        if saved is not None and int(saved["width"]) != width:
            raise DataPositionError(
                f"ft_hsdp cannot resume at data-parallel width {width} from a checkpoint written at width "
                f"{saved['width']} (replica groups x ranks per group): {reason}, so the samples already "
                f"trained cannot be placed. Fix: resume at width {saved['width']}, or use one map-style "
                "DataLoader with `batch_size=` and Lightning's injected DistributedSampler.")
        rank_zero_warn(
            "ft_hsdp: the data position cannot follow the "
            f"committed step because {reason}. A replica group that "
            "heals restarts its shard at the start of an epoch "
            "and a discarded step skips a batch, so groups may "
            "train some samples twice and miss others. Fix: one map-style DataLoader with `batch_size=` and "
            "Lightning's injected DistributedSampler, accumulate_grad_batches dividing the batches per epoch."
        )
        return None

    def layout(self) -> Layout:
        """How this run's positions map to samples (written into every checkpoint)."""
        return self.batches.layout(self.accumulate)

    def resume_from(self, saved: dict[str, Any] | None, step: int, loader_drop_last: bool) -> str | None:
        """Continue the mapping of a checkpoint at committed ``step`` whose layout is ``saved`` (see
        :mod:`fsdp_strategies.ft.resume_width`); the line to log when the layout changed."""
        if saved is None:
            return None
        old, now = Layout.from_dict(saved), self.layout()
        if replace(old, rest=None) == now:  # the same layout: the same mapping, its rest included
            self.batches.rest = old.rest
            return None
        rest = self.batches.rest = rest_after(old, step, now, loader_drop_last)
        where = (f"at the start of data epoch {rest.epoch + 1}" if rest.trained == 0 else
                 f"in data epoch {rest.epoch} at global sample {rest.trained} of {now.dataset_len}: the "
                 f"{now.dataset_len - rest.trained} samples left are split over {now.width} shards, "
                 f"{rest.batches} batches each")
        return (f"ft_hsdp: resuming step {step} with another data layout: the checkpoint's {old.width} "
                f"shards x batch {old.batch_size} x {old.accumulate} micro-batches (global batch "
                f"{old.width * old.batch_size * old.accumulate}) -> now {now.width} x {now.batch_size} x "
                f"{now.accumulate} (global batch {now.width * now.batch_size * now.accumulate}); continuing "
                f"{where}")

    def batch_size_of(self, position: int) -> int:
        """Samples of this rank's batch at ``position`` (the last batch of an epoch may be smaller)."""
        return len(self.batches.indices(position))

    def indices_of(self, position: int, shard: int | None = None) -> list[Any]:
        """Dataset indices of this rank's batch at ``position`` (or of shard ``shard``'s batch there)."""
        return self.batches.indices(position, shard)

    @property
    def sharded(self) -> bool:
        """Whether the groups train disjoint shards (a ``DistributedSampler``), so another group's batch is
        known."""
        return isinstance(self.batches.sampler, DistributedSampler)

    def collate(self, indices: list[Any]) -> Any:
        """One batch of these dataset indices, collated as the loader does."""
        return self.batches.collate_fn([self.batches.dataset[i] for i in indices])

    def take_for(self, step: Any, loader_batch: Any, committed_step: int,
                 prepare: Callable[[Any], Any]) -> Any:
        """The next micro-batch of ``committed_step`` (:meth:`take` at ``committed_step * accumulate + m``,
        ``m`` the micro-batches ``step`` took so far; ``step.position is None``: its first), noted in
        ``step`` (the strategy's :class:`~fsdp_strategies.ft.accounting.StepInFlight`)."""
        first = step.position is None
        position = committed_step * self.accumulate + (0 if first else step.micro_batches)
        with step.timed("batch"):
            batch, rebuilt = self.take(loader_batch, position, prepare)
        step.take_batch(position, self.batch_size_of(position), first, rebuilt)
        return batch

    def take(self, loader_batch: Any, position: int, prepare: Callable[[Any], Any]) -> tuple[Any, bool]:
        """The batch to train at data position ``position`` (micro-batch ``m`` of committed step ``s``:
        ``s * accumulate + m``; ``prepare`` applies Lightning's pre-transfer hooks to a batch built here);
        also re-aims the loader so its next batches are the next positions'. Returns ``(batch, rebuilt)``."""
        issued = self.positions.issued
        if issued:
            self._ahead[issued.popleft()] = loader_batch
        for q in [q for q in self._ahead if q < position]:
            del self._ahead[q]
        if position in self._ahead:
            batch, rebuilt = self._ahead.pop(position), False
        else:
            batch, rebuilt = prepare(self.batches[position]), True
            self.rebuilt += 1
        while len(self._ahead) > self.MAX_AHEAD * self.accumulate:
            del self._ahead[max(self._ahead)]
        # the batches the loader already queued feed positions position+1 .. position+len(issued); what it
        # reads next should be the position after those
        self.positions.cursor = position + 1 + len(issued)
        return batch, rebuilt
