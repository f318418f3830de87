"""Exact mid-epoch resume for ordinary (non-stateful) map-style training DataLoaders.

Why: Lightning 2.6 restores the loop counters of a checkpoint written in the middle of an epoch,
but restores the *position* of a training dataloader only when the loader is ``_Stateful``
(e.g. torchdata's ``StatefulDataLoader``). With a plain ``DataLoader`` the resumed epoch starts
again from its first batch: batches already trained are replayed and the epoch's last batches
are never seen, so "stop and resume" does not give the run that "never stopped" would have.

:func:`skip_consumed_batches` fixes this for the common case. The strategies of this package call
it from ``Strategy.on_train_start`` (:class:`ResumePositionMixin`), which Lightning runs after the checkpoint
restore and after ``FitLoop.setup_data()``, and before the first batch of the resumed epoch is fetched. It
swaps each training DataLoader for a copy (rebuilt the way Lightning injects its distributed sampler) whose
sampler skips, for its next iteration only, the indices of the batches the epoch already
completed. Nothing is loaded for the skipped batches, ``set_epoch`` still reaches the original
(e.g. distributed) sampler, and later iterations/epochs are unchanged.

Limits: the skip is exact for samplers whose order depends only on their seed and ``set_epoch``
(``SequentialSampler``, ``DistributedSampler``, the one Lightning injects); a ``RandomSampler``
draws a new order after a restart (warned). Custom batch samplers and ``IterableDataset`` loaders
are not fast-forwarded (warned). Once every loader is fast-forwarded, Lightning's own
"not resumable" warning is silenced by a ``warnings`` filter for that exact message.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies import _torch_seam
from fsdp_strategies.runtime import data_position

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ResumePositionMixin", "skip_consumed_batches"]

_FIX_HINT = (
    "To resume exactly, return a stateful loader from `train_dataloader()` (e.g. torchdata's "
    "`StatefulDataLoader`, whose position Lightning saves and restores itself), or a map-style "
    "`DataLoader` built with `batch_size=` (not a custom `batch_sampler=`), or save checkpoints only at "
    "epoch ends."
)
# Lightning's own warning for non-stateful loaders; wrong once the loaders were fast-forwarded here.
_LIGHTNING_NOT_RESUMABLE = r"You're resuming from a checkpoint that ended before the epoch ended"


class _SkipFirstIterationSampler(Sampler[Any]):
    """Yields ``sampler``'s indices, dropping the first ``skip`` of them in the next iteration only.

    ``len`` stays the full length so the epoch keeps its size for Lightning's counters. Every other
    attribute (``set_epoch``, ``epoch``, ``num_replicas``...) is the wrapped sampler's.
    """

    def __init__(self, sampler: Sampler[Any], skip: int) -> None:
        self.sampler = sampler
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    @property
    def resume_wrapped(self) -> Sampler[Any]:
        return self.sampler

    def __getattr__(self, name: str) -> Any:
        if name in ("sampler", "skip") or name.startswith("__"):  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.sampler, name)


def _consumed_per_loader(mode: str, done: int, lengths: list[int | float]) -> list[int]:
    """Batches each loader's *current* iterator has yielded after ``done`` combined batches."""
    if mode == "min_size":
        return [done] * len(lengths)
    if mode == "max_size":  # exhausted loaders stay exhausted (they yield None)
        return [int(min(done, n)) for n in lengths]
    # max_size_cycle: a shorter loader is restarted when exhausted, so it sits inside its current cycle
    return [int(done % n) if n != float("inf") else done for n in lengths]


def _why_not_skippable(dl: object) -> str | None:
    """Reason why the position of ``dl`` cannot be restored at the sampler level, None if it can."""
    if not isinstance(dl, DataLoader):
        return f"it is a `{type(dl).__qualname__}`, not a torch `DataLoader`"
    if isinstance(dl.dataset, IterableDataset):
        return "it iterates an `IterableDataset` (no sampler to fast-forward)"
    if dl.batch_sampler is not None and (type(dl.batch_sampler) is not BatchSampler or dl.batch_size is None):
        # a user batch sampler may group indices in any way: the indices of N batches are unknown
        return f"it uses a custom `batch_sampler` ({type(dl.batch_sampler).__qualname__})"
    return None


def skip_consumed_batches(
    trainer: pl.Trainer, saved: dict[str, Any] | None = None, new_width: str = "split"
) -> int:
    """When resuming in the middle of an epoch, make the training loaders skip the batches already trained.

    Call from ``Strategy.on_train_start``. Returns the number of batches of the current epoch that
    were skipped (0 when not resuming mid-epoch or nothing could be skipped). Loaders Lightning
    restores itself (``_Stateful``) are left alone; loaders that cannot be fast-forwarded get one
    warning that the resume replays data, saying what to do instead.

    ``saved``: the checkpoint's :func:`~fsdp_strategies.runtime.data_position.record` (``None``: a checkpoint
    without one, e.g. Lightning's own strategies': its data-parallel size is taken to be unchanged). When the
    data-parallel size changed, ``new_width="split"`` continues at the saved global sample position
    (:func:`~fsdp_strategies.runtime.data_position.resumed_epoch_sampler`), ``"refuse"`` raises
    :class:`~fsdp_strategies.runtime.data_position.DataPositionError`.
    """
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    combined = seam.training_combined_loader(trainer)
    if combined is None or not fit_loop.restarting or not fit_loop.restarted_mid_epoch:
        return 0
    progress = epoch_loop.batch_progress
    # the count `TrainingEpochLoop.reset()` is about to restore as `current.ready`: a checkpoint written in
    # `on_train_batch_end` has not counted its last batch as completed yet
    done = progress.current.completed + int(epoch_loop.restarted_on_train_batch_end)
    epoch = fit_loop.epoch_progress.current.processed
    if done > 0 and not progress.is_last_batch and data_position.needs_new_split(saved, trainer, epoch):
        assert saved is not None
        return _split_at_saved_position(trainer, combined, saved, done, epoch, new_width)
    if (
        saved is None
        and done > 0
        and not progress.is_last_batch
        and data_position.data_parallel_size(trainer) > 1
    ):
        rank_zero_info(
            "The checkpoint does not record its data-parallel size (not written by this package's "
            "strategies): the mid-epoch position assumes it is unchanged."
        )
    if done <= 0 or progress.is_last_batch or done >= trainer.num_training_batches:
        return 0  # nothing trained yet in this epoch, or Lightning moves on to the next epoch

    loaders = list(combined.flattened)
    lengths: list[int | float] = [float("inf") if (n := sized_len(dl)) is None else n for dl in loaders]
    consumed = _consumed_per_loader(seam.combined_loader_mode(combined), done, lengths)
    problems: list[str] = []
    random_order: list[int] = []
    replaced: dict[int, DataLoader] = {}
    already = False
    for i, (dl, skip) in enumerate(zip(loaders, consumed)):
        if seam.is_stateful_loader(dl) or skip == 0:
            continue  # Lightning has restored its position itself / a fresh iterator is already right
        sampler = getattr(dl, "sampler", None)
        if isinstance(sampler, _SkipFirstIterationSampler):
            if sampler.skip:  # a second call in the same fit: the loaders are already fast-forwarded
                already = True
                continue
            sampler = sampler.sampler  # a loader reused from an earlier fit: wrap the original again
        reason = _why_not_skippable(dl)
        if reason is None:
            assert isinstance(dl, DataLoader)
            per_batch = 1 if dl.batch_sampler is None else int(dl.batch_size)  # type: ignore[arg-type]
            wrapper = _SkipFirstIterationSampler(sampler, skip * per_batch)  # type: ignore[arg-type]
            try:
                new_dl = seam.rebuild_loader_with_sampler(dl, wrapper)
            except Exception as err:  # any failure to rebuild: fall back to the warning
                reason = f"it could not be rebuilt with a new sampler ({type(err).__name__}: {err})"
            else:
                replaced[i] = new_dl
                if isinstance(sampler, RandomSampler):
                    random_order.append(i)
        if reason is not None:
            problems.append(f"training dataloader {i}: {reason}")

    if problems:
        rank_zero_warn(
            f"Resuming in the middle of epoch {epoch} after "
            f"{done} batches, but the position of some training "
            "dataloaders cannot be restored, so this resume "
            "replays data those batches already used and skips "
            f"the end of the epoch ({'; '.join(problems)}). {_FIX_HINT}",
            category=PossibleUserWarning,
        )
    if not replaced:
        return done if already else 0

    if not _install(trainer, combined, replaced, epoch):
        rank_zero_warn(
            f"Resuming in the middle of epoch {epoch} after "
            f"{done} batches, but the training iterators cannot be "
            "restarted without losing the position of the stateful dataloaders, so this resume replays data. "
            f"{_FIX_HINT}",
            category=PossibleUserWarning,
        )
        return 0
    if not problems:
        warnings.filterwarnings("ignore", message=_LIGHTNING_NOT_RESUMABLE, category=PossibleUserWarning)
    if random_order:
        rank_zero_warn(
            f"Training dataloader(s) {random_order} shuffle with a `RandomSampler`, whose order cannot be "
            f"reproduced after a restart: the {done} skipped "
            "batches are right in number, but not the same samples "
            "as before the restart. For an exact resume, shuffle "
            "with a sampler whose order depends only on its "
            "seed and `set_epoch` (e.g. `DistributedSampler`, "
            "which Lightning injects on multiple devices), or "
            "use a `StatefulDataLoader`.",
            category=PossibleUserWarning,
        )
    if done % trainer.accumulate_grad_batches:
        rank_zero_warn(
            f"The checkpoint was written after {done} batches, "
            "in the middle of a gradient accumulation window "
            f"of {trainer.accumulate_grad_batches}: the gradients "
            "accumulated since the last optimizer step are not "
            "in the checkpoint, so the next step uses fewer batches than the uninterrupted run did.",
            category=PossibleUserWarning,
        )
    rank_zero_info(
        f"Resuming mid-epoch: training dataloaders skip the {done} batches of epoch {epoch} already trained."
    )
    return done


def _split_at_saved_position(
    trainer: pl.Trainer, combined: Any, saved: dict[str, Any], done: int, epoch: int, new_width: str
) -> int:
    """Continue ``epoch`` at the checkpoint's global sample position, split over this run's ranks."""
    loader = combined.flattened[0]
    placed = getattr(loader, "sampler", None)
    if (
        isinstance(placed, data_position.ResumedEpochSampler)
        and placed.resumed_epoch == epoch
        and placed.resuming
    ):
        return done  # a second call in the same fit: already placed
    if new_width == "strategy":
        return 0  # the strategy places the data itself (ft_hsdp: the positions follow the committed step)
    if new_width == "refuse":
        raise data_position.DataPositionError(
            f"{type(trainer.strategy).__name__} cannot resume in the middle of epoch {epoch} at another "
            f"data-parallel size (the checkpoint's: {saved['data_parallel_size']}, now: "
            f"{data_position.data_parallel_size(trainer)}). Fix: resume at the checkpoint's data-parallel "
            "size (ft_hsdp: its number of replica groups and group size), or from a checkpoint saved at an "
            "epoch end."
        )
    sampler, line = data_position.resumed_epoch_sampler(trainer, saved, done, epoch)
    new_dl = seam.rebuild_loader_with_sampler(loader, sampler)
    if not _install(trainer, combined, {0: new_dl}, epoch):
        raise data_position.DataPositionError(
            f"Cannot resume in the middle of epoch {epoch}: the training iterators cannot be restarted."
        )
    length = len(new_dl)
    sampler.restore = (trainer.fit_loop.max_batches, trainer.val_check_batch)
    if combined.limits is not None:  # in place: the running mode iterator holds the same list
        combined.limits[0] = max(combined.limits[0], length)
    trainer.fit_loop.max_batches = length
    seam.set_training_fetcher_length(trainer, length)
    if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch not in (None, float("inf")):
        trainer.val_check_batch = max(1, int(length * trainer.val_check_interval))
    warnings.filterwarnings("ignore", message=_LIGHTNING_NOT_RESUMABLE, category=PossibleUserWarning)
    rank_zero_info(f"{line}; this epoch has {length} batches per rank.")
    return done


def restore_epoch_length(trainer: pl.Trainer) -> None:
    """After an epoch resumed at another width: the epoch length (and validation interval) of the new
    loader."""
    combined = seam.training_combined_loader(trainer)
    sampler = getattr(combined.flattened[0], "sampler", None) if combined is not None else None
    if isinstance(sampler, data_position.ResumedEpochSampler) and not sampler.resuming and sampler.restore:
        trainer.fit_loop.max_batches, trainer.val_check_batch = sampler.restore
        sampler.restore = None


def _install(trainer: pl.Trainer, combined: Any, replaced: dict[int, DataLoader], epoch: int) -> bool:
    """Put the rebuilt loaders in the fit loop and restart only their iterators; False if it cannot.

    ``FitLoop.setup_data()`` already created the epoch's iterators (with ``num_workers > 0`` they have
    already queued the first batches' indices, which are dropped here); stateful loaders' iterators
    must be kept, as re-iterating them would lose the position Lightning restored.
    """
    old = list(combined.flattened)
    mode_iterator = seam.combined_loader_iterator(combined)
    iterators = getattr(mode_iterator, "iterators", None)
    in_place = isinstance(iterators, list) and len(iterators) == len(old)
    if mode_iterator is not None and not in_place and any(seam.is_stateful_loader(dl) for dl in old):
        return False  # an iterator layout this code does not know, and restarting all would lose positions
    flattened = list(old)
    for i, dl in replaced.items():
        flattened[i] = dl
        # with workers, creating the iterator reads the sampler at once: set the epoch before, as
        # Lightning does later in `FitLoop.on_advance_start`
        seam.set_sampler_epoch(dl, epoch)
    combined.flattened = flattened
    if mode_iterator is None:
        return True  # not iterated yet: the fit loop will iterate the new loaders
    if in_place:
        mode_iterator.iterables = flattened  # `max_size_cycle` restarts exhausted loaders from here
        for i, dl in replaced.items():
            _torch_seam.shutdown_loader_workers(iterators[i])  # type: ignore[index]
            _torch_seam.shutdown_loader_workers(_torch_seam.loader_iterator(old[i]))  # persistent workers
            iterators[i] = iter(dl)  # type: ignore[index]
        return True
    for dl in old:  # no stateful loader: restarting every iterator loses nothing
        _torch_seam.shutdown_loader_workers(_torch_seam.loader_iterator(dl))
    seam.restart_training_iterators(trainer)
    return True


class ResumePositionMixin:
    """Strategy mixin (listed before the Lightning base class): a mid-epoch resume continues with the next
    unseen sample instead of replaying the epoch (:func:`skip_consumed_batches` in ``on_train_start``).

    The strategy puts :func:`~fsdp_strategies.runtime.data_position.record` in every checkpoint it saves and
    hands the loaded one to :meth:`restored_data_position`.
    """

    #: a mid-epoch resume at another data-parallel size: ``"split"`` (exact), ``"refuse"``, or ``"strategy"``
    #: (the strategy places the data itself)
    data_width_change: str = "split"
    _saved_data_position: dict[str, Any] | None = None

    def restored_data_position(self, checkpoint: dict[str, Any]) -> None:
        """Keep the loaded checkpoint's data-position record for ``on_train_start``."""
        self._saved_data_position = checkpoint.get(data_position.KEY)

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        module = getattr(self, "lightning_module", None)
        assert module is not None
        skip_consumed_batches(module.trainer, self._saved_data_position, self.data_width_change)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        if batch_idx == 0:
            module = getattr(self, "lightning_module", None)
            if module is not None:
                restore_epoch_length(module.trainer)
