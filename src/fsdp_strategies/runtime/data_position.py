"""The epoch's data position as a count of global samples, so a resume at another width stays exact.

Why: the batches a checkpoint counts (Lightning's ``batch_progress``) are *per-rank* batches. Skipping
that many batches on every rank is right only while the data-parallel size is unchanged: a job grown
from 2 to 4 ranks would skip twice the samples the stopped job trained, a job shrunk from 4 to 2 half
of them (a third of an epoch lost or repeated in the issue's measurement).

What is recorded (:func:`record`, under :data:`KEY` in every checkpoint of this package's strategies):
the data-parallel size, and for each training loader what defines its epoch order -- the sampler's
kind, ``num_replicas``, ``shuffle``, ``seed``, ``drop_last``, the dataset length and the per-rank
batch size. The position itself is Lightning's batch count times the old per-rank batch size times
the old data-parallel size.

What a resume at another data-parallel size does (:func:`resumed_epoch_sampler`): the epoch's global
order is rebuilt with torch's own ``DistributedSampler`` (one replica: its order before it splits the
epoch among ranks), the samples before the position are the ones trained, and the rest of the epoch
is split among the new ranks the way ``DistributedSampler`` splits an epoch -- padded with the first
samples of the remainder to a multiple of the new size (or, with the sampler's ``drop_last=True``,
its last samples dropped). Every sample of the epoch is trained exactly once, up to that padding /
drop rule. Later epochs are the new sampler's own. Loaders whose position cannot be recomputed
(stateful, iterable, custom samplers or batch samplers, several training loaders,
``limit_train_batches``) are refused with :class:`DataPositionError` instead of resuming wrong.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from fsdp_strategies import _lightning_seam as seam

__all__ = ["KEY", "DataPositionError", "ResumedEpochSampler", "record", "resumed_epoch_sampler"]

#: the checkpoint key of the record
KEY = "fsdp_strategies.data_position"
_ORDERED = ("distributed", "sequential")  # sampler kinds whose epoch order can be rebuilt from the record


class DataPositionError(RuntimeError):
    """A mid-epoch resume at another data-parallel size whose data position cannot be recomputed exactly."""


def _inner_sampler(sampler: Any) -> Any:
    """The user's / Lightning's sampler under the wrappers a resume puts around it."""
    while hasattr(sampler, "resume_wrapped"):
        sampler = sampler.resume_wrapped
    return sampler


def describe_loader(dl: object) -> dict[str, Any]:
    """What defines ``dl``'s epoch order (``kind`` says whether it can be rebuilt)."""
    if seam.is_stateful_loader(dl):
        return {"kind": "stateful"}
    if not isinstance(dl, DataLoader):
        return {"kind": "other", "type": type(dl).__qualname__}
    if isinstance(dl.dataset, IterableDataset):
        return {"kind": "iterable"}
    if dl.batch_size is None or type(dl.batch_sampler) is not BatchSampler:
        return {"kind": "batch_sampler", "type": type(dl.batch_sampler).__qualname__}
    sampler = _inner_sampler(dl.sampler)
    out: dict[str, Any] = {
        "dataset_len": len(dl.dataset),  # type: ignore[arg-type]
        "batch_size": int(dl.batch_size),
    }
    if type(sampler) is DistributedSampler:
        out.update(
            kind="distributed",
            num_replicas=int(sampler.num_replicas),
            shuffle=bool(sampler.shuffle),
            seed=int(sampler.seed),
            drop_last=bool(sampler.drop_last),
        )
    elif type(sampler) is SequentialSampler:
        out.update(kind="sequential", num_replicas=1, shuffle=False, seed=0, drop_last=False)
    elif type(sampler) is RandomSampler:
        out.update(kind="random", num_replicas=1)
    else:
        out.update(kind="sampler", type=type(sampler).__qualname__)
    if (
        isinstance(dl.sampler, ResumedEpochSampler) and dl.sampler.resuming
    ):  # the count restarts at the resume
        out["resumed_at"] = {
            "epoch": dl.sampler.resumed_epoch,
            "samples": dl.sampler.start,
            "batches": dl.sampler.start_batches,
        }
    return out


def record(trainer: Any) -> dict[str, Any]:
    """``{KEY: ...}`` for a checkpoint's top level: the data-parallel size and each training loader's
    order."""
    combined = seam.training_combined_loader(trainer)
    if combined is None:
        return {}
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return {
        KEY: {
            "version": 1,
            "data_parallel_size": int(kwargs.get("num_replicas", 1)),
            "loaders": [describe_loader(dl) for dl in combined.flattened],
        }
    }


def data_parallel_size(trainer: Any) -> int:
    """How many ranks train distinct samples now (the sampler's ``num_replicas`` Lightning injects)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1))


def needs_new_split(saved: dict[str, Any] | None, trainer: Any, epoch: int) -> bool:
    """Whether the per-rank batch count cannot place this resume: another width, or a split made by a
    resume."""
    if not saved:
        return False
    resumed = [rec.get("resumed_at") for rec in saved["loaders"]]
    return int(saved["data_parallel_size"]) != data_parallel_size(trainer) or any(
        r is not None and r["epoch"] == epoch for r in resumed
    )


def trained_samples(loader: dict[str, Any], done: int, epoch: int) -> int:
    """Global samples of the epoch's order trained after ``done`` per-rank batches of the recorded loader."""
    base = loader.get("resumed_at")
    per_batch = int(loader["batch_size"]) * int(loader["num_replicas"])
    if base is not None and base["epoch"] == epoch:
        return int(base["samples"]) + (done - int(base["batches"])) * per_batch
    return done * per_batch


def epoch_order(loader: dict[str, Any], epoch: int) -> list[int]:
    """The epoch's global sample order of a recorded ``distributed`` / ``sequential`` loader (before its
    split)."""
    n = int(loader["dataset_len"])
    if loader["kind"] == "sequential":
        return list(range(n))
    whole = DistributedSampler(
        range(n),
        num_replicas=1,
        rank=0,
        shuffle=loader["shuffle"],  # type: ignore[arg-type]
        seed=loader["seed"],
        drop_last=False,
    )
    whole.set_epoch(epoch)
    return list(whole)


def split_remainder(rest: list[int], num_replicas: int, rank: int, drop_last: bool) -> list[int]:
    """``rank``'s share of ``rest``, split as ``DistributedSampler`` splits an epoch (pad, or drop the
    tail)."""
    if drop_last:
        rest = rest[: len(rest) // num_replicas * num_replicas]
    elif rest and len(rest) % num_replicas:
        pad = num_replicas - len(rest) % num_replicas
        rest = rest + (rest * (pad // len(rest) + 1))[:pad]
    return rest[rank::num_replicas]


class ResumedEpochSampler(Sampler[Any]):
    """During the resumed epoch: this rank's share of the samples not yet trained; afterwards the wrapped
    sampler.

    ``len`` counts the batches the resumed epoch already trained as well (``skipped`` samples at this loader's
    batch size), so the epoch's length in Lightning's counters is the old position plus this rank's share.
    """

    def __init__(
        self, sampler: Sampler[Any], epoch: int, indices: list[int], done: int, batch_size: int, start: int
    ) -> None:
        self.resume_wrapped = sampler
        self.resumed_epoch = epoch
        self.indices = indices
        self.skipped = done * batch_size
        #: the global position the resume continued at, and the per-rank batch count at that point
        self.start = start
        self.start_batches = done
        #: Lightning's epoch length and validation interval for the epochs after this one
        self.restore: tuple[Any, Any] | None = None
        self._epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        if callable(getattr(self.resume_wrapped, "set_epoch", None)):
            self.resume_wrapped.set_epoch(epoch)  # type: ignore[attr-defined]

    @property
    def resuming(self) -> bool:
        return self._epoch == self.resumed_epoch

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self.indices)) if self.resuming else iter(self.resume_wrapped)

    def __len__(self) -> int:
        return (
            self.skipped + len(self.indices)
            if self.resuming
            else len(self.resume_wrapped)  # type: ignore[arg-type]
        )

    def __getattr__(self, name: str) -> Any:
        if name in ("resume_wrapped", "indices") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.resume_wrapped, name)


def _why_refused(saved: dict[str, Any], loaders: list[Any], limits: list[Any] | None) -> str | None:
    if len(loaders) != 1 or len(saved["loaders"]) != 1:
        return f"there are {len(loaders)} training dataloaders (one is supported)"
    old, now = saved["loaders"][0], describe_loader(loaders[0])
    kinds = {
        "stateful": "is a stateful loader (its saved state is per rank)",
        "iterable": "iterates an `IterableDataset`",
        "batch_sampler": "uses a custom `batch_sampler`",
        "random": "shuffles with a `RandomSampler` (an order that is not a function of seed and epoch)",
        "sampler": "uses a custom sampler",
        "other": "is not a torch `DataLoader`",
    }
    for when, rec in (("the checkpoint's", old), ("the current", now)):
        if rec["kind"] in kinds and not (when == "the current" and rec["kind"] == "random"):
            return f"{when} training dataloader {kinds[rec['kind']]}"
    if now["kind"] not in (*_ORDERED, "random"):
        return f"the current training dataloader's sampler is a {now.get('type')}"
    if old["dataset_len"] != now["dataset_len"]:
        return f"the dataset has {now['dataset_len']} samples, the checkpoint's had {old['dataset_len']}"
    if limits is not None and limits[0] < float(len(loaders[0])):
        return "`limit_train_batches` limits the epoch"
    return None


def resumed_epoch_sampler(
    trainer: Any, saved: dict[str, Any], done: int, epoch: int
) -> tuple[ResumedEpochSampler, str]:
    """The sampler that continues ``epoch`` at the saved global position on this rank, and the log line.

    ``done``: per-rank batches the checkpoint's run trained in this epoch. Raises :class:`DataPositionError`
    when the position cannot be recomputed (it names the sizes and the fix).
    """
    combined = seam.training_combined_loader(trainer)
    loaders = list(combined.flattened)
    old_size, new_size = int(saved["data_parallel_size"]), data_parallel_size(trainer)
    reason = _why_refused(saved, loaders, combined.limits)
    if reason is not None:
        raise DataPositionError(
            f"Cannot resume in the middle of epoch {epoch} at data-parallel size {new_size}: the checkpoint "
            f"was written at data-parallel size {old_size} after {done} batches per rank, and {reason}, so "
            f"the samples already trained cannot be recomputed for {new_size} ranks. Fix: resume at "
            f"data-parallel size {old_size}, or resume from a checkpoint saved at an epoch end, or use one "
            "map-style `DataLoader` with `batch_size=` and Lightning's injected `DistributedSampler` (or no "
            "shuffle)."
        )
    old = saved["loaders"][0]
    dl = loaders[0]
    start = trained_samples(old, done, epoch)
    sampler = _inner_sampler(dl.sampler)
    if type(sampler) is DistributedSampler:
        replicas, rank, drop_last = int(sampler.num_replicas), int(sampler.rank), bool(sampler.drop_last)
    else:
        replicas, rank, drop_last = 1, 0, False
    order = epoch_order(old, epoch)
    mine = split_remainder(order[start:], replicas, rank, drop_last)
    size = int(dl.batch_size)
    line = (
        f"Resuming mid-epoch {epoch} at global sample {start} of {len(order)}: the checkpoint's "
        f"data-parallel size {old_size} (global batch {int(old['batch_size']) * old_size}) -> now {new_size} "
        f"(global batch {size * new_size}); the {len(order) - start} samples left in the epoch's order are "
        f"split over {replicas} rank(s), {len(mine)} each ({-(-len(mine) // size)} batches)"
    )
    return ResumedEpochSampler(dl.sampler, epoch, mine, done, size, start), line
