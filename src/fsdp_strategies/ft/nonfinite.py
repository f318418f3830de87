"""``NonFiniteGuard`` under ``ft_hsdp``: a replica group whose loss is not finite leaves the step's average.

Why: under ``ft_hsdp`` the gradients are averaged across replica groups inside the backward pass (the FSDP
all-reduce hook), so one group's ``NaN`` reaches every group before any optimizer step could be skipped. The
failure is one group's batch; it should cost that group's share of one step, like a group that failed, not
the step of every group (nor the run).

How: :class:`~fsdp_strategies.callbacks.NonFiniteGuard` sees each rank's loss before its backward
(``on_before_backward``) and hands the verdict to the strategy
(:class:`~fsdp_strategies.protocols.NonFiniteLossSink`). :func:`leave_step_if_nonfinite` then

1. agrees inside the group (one all-reduce ``max`` of a flag on the group's own process group): inside a
   group FSDP's reduce-scatter mixes every rank's gradient, so one rank's ``NaN`` is the group's;
2. agrees across the groups of the step's quorum (one fault-tolerant all-reduce of ``2 x groups`` numbers:
   each finite group's samples in this step, and which groups were not finite);
3. sets this group's weight for the step's cross-group reduction, which becomes a *sum*: a finite group
   scales its gradient by its share ``n / N`` of the finite groups' samples, a non-finite one contributes
   zeros. The result, identical on every group, is the mean gradient over the finite groups' samples --
   the step a fault-free run of those groups would take -- and every group (the excluded one too) applies
   it, so the replicas stay bit-identical.

If no group is finite, nothing is changed: every group then sees the non-finite average and
``NonFiniteGuard`` skips the step on every group alike. A non-finite *gradient* under a finite loss is
caught the same way after the reduction (the step is skipped on every group). The accounting
(:mod:`fsdp_strategies.ft.accounting`) counts an excluded group's batch as not trained, in either
``data_on_failure`` mode. Cost while it is on: two small all-reduces and one host sync per step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed import ReduceOp

from fsdp_strategies.ft.accounting import StepInFlight

__all__ = ["leave_step_if_nonfinite"]


def leave_step_if_nonfinite(loss_nonfinite: bool, *, step: StepInFlight, link: Any, group_id: int,
                            groups: int, device: torch.device, step_number: int) -> None:
    """Decide this group's weight in the step's cross-group sum (see the module docstring).

    Call on every rank of every group in the step, after the quorum, before the backward pass (under
    gradient accumulation: once, after the last); ``link``: the group's ``torchft`` manager. The group's
    weight counts this rank's samples in the step (its micro-batches plus redistributed ones; 1 when the
    data position is not step-aligned).
    """
    samples = (step.own_samples if step.position is not None else 1) + step.extra_samples
    flag = torch.tensor([float(loss_nonfinite)], device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the group's ranks agree
    bad = bool(flag.item() > 0)
    votes = torch.zeros(2 * groups, device=device, dtype=torch.float64)
    votes[group_id if not bad else groups + group_id] = 1.0 if bad else float(samples)
    link.allreduce(votes, reduce_op=ReduceOp.SUM).wait()  # healing groups contribute zeros
    total = float(votes[:groups].sum())
    excluded = [g for g in range(groups) if votes[groups + g] > 0.5]
    if not excluded or total <= 0.0:
        return  # all finite (the plain average), or none (the guard skips the step on every group)
    step.excluded, step.excluded_groups = bad, len(excluded)
    step.sum_scale = 0.0 if bad else samples / total
    rank_zero_warn(f"ft_hsdp: step {step_number}: replica group(s) {excluded} had a non-finite loss and left "
                   "the step's cross-group average (their batches are not trained); the step averages the "
                   f"other groups' {int(total)} samples per rank slot.")
