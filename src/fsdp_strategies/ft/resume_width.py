"""``ft_hsdp`` resumed at another width: the data position is a count of global samples, not of steps.

Without a change, committed step ``s`` trains positions ``s * A`` to ``s * A + A - 1`` and position ``q`` is
batch ``q mod B`` of data epoch ``q // B`` of each shard (:mod:`fsdp_strategies.ft.data`). That arithmetic
holds only while every step since step 0 ran with today's layout: the data-parallel width ``R`` (replica
groups x ranks per group), the per-rank batch and ``accumulate_grad_batches``. A checkpoint written with
another layout -- a job restarted with 3 replica groups instead of 2, or another group size -- continues at
the checkpoint's global sample position instead:

* the checkpoint's committed step and :class:`Layout` (written by every ``ft_hsdp`` checkpoint) give the
  data epoch ``e`` it stopped in and the ``n`` samples of that epoch's global order it had trained;
* from the resumed run's first position ``q0`` (its committed step x its ``A``) on, the rest of epoch ``e``
  (the global order after ``n``) is split over the new ``R`` shards the way ``DistributedSampler`` splits an
  epoch (padded with its first samples to a multiple of ``R``, or cut with the sampler's ``drop_last``:
  :func:`fsdp_strategies.runtime.data_position.split_remainder`), in batches of the new per-rank size;
  epochs ``e + 1, ...`` are the new sampler's own.

That :class:`Rest` is part of the resumed run's layout, so its own checkpoints carry it: a later resume at
the same layout keeps the mapping, one at another layout computes the next rest from it. Every sample of an
epoch is trained once up to the sampler's padding / drop rule, across any number of width changes. A
replica group restarted inside the resumed job loads the same checkpoint (the launcher's arguments) and
so the same mapping. Loaders whose order cannot be rebuilt are refused
(:class:`~fsdp_strategies.runtime.data_position.DataPositionError`), never resumed silently wrong.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from fsdp_strategies.runtime.data_position import DataPositionError, epoch_order, split_remainder

__all__ = ["KEY", "Layout", "Rest", "locate", "rest_after", "trained_before"]

#: the checkpoint key of an ``ft_hsdp`` run's data layout
KEY = "fsdp_strategies.ft_data_layout"


@dataclass(frozen=True)
class Rest:
    """The rest of data epoch ``epoch`` after a width change: from position ``start`` on, its global order
    after ``trained`` samples, split over ``width`` shards in ``batches`` batches of ``batch_size`` each."""

    start: int
    epoch: int
    trained: int
    width: int
    batch_size: int
    drop_last: bool
    batches: int


@dataclass(frozen=True)
class Layout:
    """What maps a run's positions to samples: the data-parallel ``width`` (shards), the per-rank
    ``batch_size``, the batches per epoch ``per_epoch``, ``accumulate`` (positions per step), the order
    (``dataset_len``, ``shuffle``, ``seed``, ``drop_last`` of the sampler) and the run's :class:`Rest`."""

    width: int
    batch_size: int
    per_epoch: int
    accumulate: int
    dataset_len: int
    shuffle: bool
    seed: int
    drop_last: bool
    rest: Rest | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Layout:
        rest = record.get("rest")
        return cls(**{**record, "rest": None if rest is None else Rest(**rest)})

    def order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s global sample order (before its split over the shards)."""
        return epoch_order({"kind": "distributed", "dataset_len": self.dataset_len, "shuffle": self.shuffle,
                            "seed": self.seed}, epoch)

    def same_order(self, other: Layout) -> bool:
        """Whether both have the same epoch orders (the global order of every epoch)."""
        return (self.dataset_len, self.shuffle, self.seed) == (other.dataset_len, other.shuffle, other.seed)


def locate(position: int, per_epoch: int, rest: Rest | None) -> tuple[int, int, bool]:
    """``(epoch, i, in_rest)``: ``position`` is batch ``i`` of data epoch ``epoch`` -- of the resumed epoch's
    rest when ``in_rest``, else of the sampler's own epoch."""
    if rest is not None and position >= rest.start:
        j = position - rest.start
        if j < rest.batches:
            return rest.epoch, j, True
        epoch, i = divmod(j - rest.batches, per_epoch)
        return rest.epoch + 1 + epoch, i, False
    epoch, i = divmod(position, per_epoch)
    return epoch, i, False


def trained_before(layout: Layout, position: int) -> tuple[int, int]:
    """``(epoch, n)``: the data epoch of ``position`` under ``layout`` and the samples of its global order
    trained before it (by all shards)."""
    epoch, i, in_rest = locate(position, layout.per_epoch, layout.rest)
    if in_rest:
        assert layout.rest is not None
        return epoch, layout.rest.trained + i * layout.rest.batch_size * layout.rest.width
    return epoch, i * layout.batch_size * layout.width


def rest_after(saved: Layout, step: int, now: Layout, loader_drop_last: bool) -> Rest | None:
    """The :class:`Rest` of a run with layout ``now`` resumed at committed ``step`` from a checkpoint with
    layout ``saved`` (``None``: the checkpoint stopped at an epoch's end, nothing to split)."""
    if not saved.same_order(now):
        raise DataPositionError(
            "ft_hsdp cannot resume at another data-parallel "
            "layout here: the checkpoint's epoch order (dataset "
            f"of {saved.dataset_len} samples, shuffle={saved.shuffle}, seed={saved.seed}) differs from this "
            f"run's ({now.dataset_len}, shuffle={now.shuffle}, seed={now.seed}), so the samples already "
            "trained cannot be recomputed. Fix: resume with the checkpoint's dataset and sampler seed, or at "
            f"its layout ({saved.width} shards of batch {saved.batch_size})."
        )
    epoch, trained = trained_before(saved, step * saved.accumulate)
    if trained >= saved.dataset_len:
        epoch, trained = epoch + 1, 0
    if trained == 0:  # an epoch boundary: the new sampler's epochs from there, offset to this position
        return Rest(start=step * now.accumulate, epoch=epoch - 1, trained=0, width=now.width,
                    batch_size=now.batch_size, drop_last=now.drop_last, batches=0)
    left = len(split_remainder(list(range(saved.dataset_len - trained)), now.width, 0, now.drop_last))
    batches = left // now.batch_size if loader_drop_last else -(-left // now.batch_size)
    return Rest(start=step * now.accumulate, epoch=epoch, trained=trained, width=now.width,
                batch_size=now.batch_size, drop_last=now.drop_last, batches=batches)
