"""Where this process stands in ``torch.distributed``, and how its ranks agree on "did any rank ...?".

Every check in the package asks this module instead of repeating ``dist.is_available() and
dist.is_initialized()`` (and the world-size test that usually follows). Imports nothing from the package.

Agreement: preemption (:mod:`fsdp_strategies.runtime.preemption`: did any rank get SIGTERM?) and the
background checkpoint writer (:mod:`fsdp_strategies.checkpoint.async_writer`: has every rank's write finished,
did one fail?) each need a small collective at a fixed point of every training step. It runs on an
:class:`AgreementGroup`, a gloo group beside the training group: a few-byte all-reduce on the CPU that
cannot interleave with the training collectives (NCCL or gloo) and needs no device.

Groups per strategy instance:

* **One training-thread group**, created by the strategy and handed to both its preemption guard and its
  async checkpointing (the writer's per-step check). Sharing is safe: both run on the training thread at
  points every rank reaches in the same order, and a process group matches collectives by the order they
  are issued.
* **One background group**, owned by the async writer, for DCP's collectives (planning, the metadata
  write) and the writer's hash gather / outcome broadcast. These run on the writer's thread while the
  training thread goes on, so on a shared group the two threads' collectives would be issued in a
  different order on different ranks and pair the wrong tensors (gloo aborts or hangs). It must not be the
  training-thread group, nor the training group.

Creation: ``dist.new_group`` is itself a collective over the default group, so a group is created at its
first use, which every rank reaches at the same point; it is created again when the default group was
replaced (a new fit in the same process). Outside a multi-rank process group nothing is created and every
call answers for this rank alone.

Why this lives in the base layer: the checkpoint files (``checkpoint``), preemption (``runtime``) and the
strategies that hold both use it; below all of them, none has to reach into another for it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AgreementGroup", "all_gather_object", "in_process_group", "is_multi_rank", "rank_and_world"]


def in_process_group() -> bool:
    """Whether a default process group exists (``torch.distributed`` is built and initialised)."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) in the default process group; ``(0, 1)`` outside one."""
    if not in_process_group():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def is_multi_rank() -> bool:
    """Whether a default process group with at least two ranks exists: a collective would reach a peer."""
    return rank_and_world()[1] > 1


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, over ``group`` (the default group when None);
    ``[obj]`` outside a multi-rank process group."""
    if not is_multi_rank():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


class AgreementGroup:
    """A gloo group over every rank of the default group, created at its first use (module docstring)."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        self.timeout = timeout
        self._group: Any = None
        self._world: Any = None

    def group(self, single_rank: bool = False) -> Any:
        """The gloo group (created now if needed: call it at the same point on every rank); None alone.

        ``single_rank``: a group at world size 1 too, whenever a default group exists (DCP's ``async_save``
        requires a process group with a CPU backend then: an NCCL-only default group is refused)."""
        if not is_multi_rank() and not (single_rank and in_process_group()):
            return None
        world = dist.group.WORLD
        if self._group is None or self._world is not world:
            kwargs: dict[str, Any] = {"backend": "gloo"}
            if self.timeout is not None:
                kwargs["timeout"] = self.timeout
            self._group = dist.new_group(**kwargs)
            self._world = world
        return self._group

    def agree_sum(self, *values: int) -> tuple[int, ...]:
        """Each of ``values`` summed over the ranks: one all-reduce."""
        group = self.group()
        if group is None:
            return tuple(int(v) for v in values)
        total = torch.tensor([int(v) for v in values], dtype=torch.int64)
        dist.all_reduce(total, group=group)
        return tuple(int(v) for v in total.tolist())

    def agree_any(self, *flags: bool) -> tuple[bool, ...]:
        """For each of ``flags``: whether it is set on any rank (one all-reduce)."""
        return tuple(total > 0 for total in self.agree_sum(*(int(bool(f)) for f in flags)))

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, over this group."""
        return all_gather_object(obj, self.group())

