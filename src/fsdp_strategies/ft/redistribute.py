"""``data_on_failure="redistribute"``: the groups in a step also train the missing groups' batches of that
step.

With the step-aligned data of :mod:`fsdp_strategies.ft.data`, the batch of every group at committed step
``s`` is known to every group (shard ``rank + world_size * group`` of the same sampler). When the quorum
of step ``s`` lacks some groups, the members learn which with one all-reduce of a participation mask
(healing groups contribute zeros, so they count as missing). Rank ``r`` of the ``j``-th participating
group takes the ``j``-th of ``p`` near-equal chunks of the missing groups' rank-``r`` batches.

torchft averages over the ``p`` participants, so a group that trained ``n`` of the step's ``N`` samples
(per rank slot) scales its gradient by ``n * p / N``: the average is then the mean over all ``N``
samples, as in a fault-free step (the loss must be a per-sample mean, as for DDP). The strategy applies
that weight in its cross-group all-reduce hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed import ReduceOp

from fsdp_strategies.ft.accounting import StepInFlight
from fsdp_strategies.ft.data import StepAlignedData

__all__ = ["Redistributed", "add_missing_groups", "redistribute", "warn_unless_sharded"]


class Redistributed(NamedTuple):
    """The batch to train, the missing groups' samples it holds (per rank), this group's gradient weight, and
    the groups in the step (``None``: not asked, nobody was missing)."""

    batch: Any
    extra_samples: int
    grad_scale: float
    live: list[int] | None = None


def warn_unless_sharded(data: StepAlignedData | None) -> None:
    """Redistribution needs the groups' batches to be shards of one sampler (else it is off: batches are
    skipped)."""
    if data is not None and not data.sharded:
        rank_zero_warn("ft_hsdp: data_on_failure='redistribute' needs the groups' data sharded by a "
                       "DistributedSampler; this loader is not, so a missing group's batches are skipped. "
                       "Fix: keep Trainer(use_distributed_sampler=True).")


def redistribute(batch: Any, step: int, *, data: StepAlignedData, manager: Any, replica_group_id: int,
                 num_replica_groups: int, rank: int, world_size: int, device: torch.device,
                 prepare: Callable[[Any], Any], live: list[int] | None = None) -> Redistributed:
    """Add this rank's share of the missing groups' batches at data position ``step`` (the quorum must have
    been formed).

    ``batch`` is this rank's own batch there; ``prepare`` does to a collated batch what Lightning's loop
    does to a loader's batch before ``batch_to_device``. Nothing changes when every group is in the step, or
    when this group is healing (it contributes zeros). ``live``: the groups in the step, as an earlier
    micro-batch of the same optimizer step learnt them (one mask all-reduce per step, not per micro-batch).
    """
    unchanged = Redistributed(batch, 0, 1.0)
    groups = num_replica_groups
    participants = int(manager.num_participants())
    if participants >= groups or participants < 1:
        return unchanged
    if live is None:
        mask = torch.zeros(groups, device=device)
        mask[replica_group_id] = 1.0
        manager.allreduce(mask, reduce_op=ReduceOp.SUM).wait()  # zeros from healing groups
        live = [g for g in range(groups) if mask[g].item() > 0.5]
    if replica_group_id not in live or not manager.is_participating():
        return Redistributed(batch, 0, 1.0, live)  # healing: contributes zeros, nothing to add
    missing = [g for g in range(groups) if g not in live]
    pool = [i for g in missing for i in data.indices_of(step, rank + world_size * g)]
    j, p = live.index(replica_group_id), len(live)
    lo, hi = (len(pool) * j) // p, (len(pool) * (j + 1)) // p
    own = data.indices_of(step)
    extra = pool[lo:hi]
    return Redistributed(prepare(data.collate(own + extra)), len(extra),
                         (len(own) + len(extra)) * p / (len(own) * groups), live)


def add_missing_groups(step: StepInFlight, batch: Any, *, data: StepAlignedData, manager: Any,
                       replica_group_id: int, num_replica_groups: int, rank: int, world_size: int,
                       device: torch.device, prepare: Callable[[Any], Any]) -> Any:
    """:func:`redistribute` for the micro-batch ``step`` took last; notes in ``step`` the samples added,
    this micro-batch's gradient weight and the step's groups (asked once per step). Returns the batch."""
    assert step.position is not None
    more = redistribute(batch, step.position + step.micro_batches - 1, data=data, manager=manager,
                        replica_group_id=replica_group_id, num_replica_groups=num_replica_groups, rank=rank,
                        world_size=world_size, device=device, prepare=prepare, live=step.live)
    step.grad_scale, step.live = more.grad_scale, more.live
    step.micro_scales.append(more.grad_scale)
    step.extra_samples += more.extra_samples
    return more.batch
