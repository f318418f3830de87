"""``ft_hsdp``'s cross-group gradient reduction: once per optimizer step, also under gradient accumulation.

Inside a replica group FSDP2 reduce-scatters the gradients; across groups they are averaged by torchft's
fault-tolerant all-reduce (``Manager.allreduce``), whose membership the step's quorum decides.

* **A step of one micro-batch** (no accumulation): :meth:`CrossGroupReduce.hook` is FSDP2's all-reduce hook
  (``FSDPModule.set_all_reduce_hook``, and the replicated 0-d parameters'): each FSDP unit's reduce-scatter
  output is averaged across groups as soon as it exists, inside the backward pass.
* **A step of several micro-batches** (``accumulate_grad_batches``): the non-final micro-batches run inside
  :meth:`CrossGroupReduce.micro_batch`. From then on until the step ends the hook communicates nothing (it
  only weights each micro-batch's gradient by that micro-batch's share, ``data_on_failure="redistribute"``);
  FSDP2 accumulates the group's gradients -- sharded under ``accumulation="sharded"`` (a reduce-scatter per
  micro-batch, the memory of a shard), unsharded until the last backward under ``"no_sync"`` -- and after the
  last backward :meth:`CrossGroupReduce.reduce_accumulated` averages the accumulated gradients across groups
  in **one** bucketed all-reduce per dtype: one quorum, one cross-group reduction and one commit per
  optimizer step, whatever the number of micro-batches. A group that dies mid-accumulation loses its step
  in flight only (the others' all-reduce fails or their quorum leaves it out; nothing was committed).

The quorum is waited for before the first cross-group byte moves; a healing group contributes zeros (torchft).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from fsdp_strategies import _torch_seam
from fsdp_strategies.ft.accounting import StepInFlight
from fsdp_strategies.parallel.replicated_params import replicated_params

__all__ = ["CrossGroupReduce"]


class CrossGroupReduce:
    """The cross-group average of one replica group's gradients (see the module docstring).

    Args:
        step: the step in flight (its weights, timers and peer-wait mark).
        wait_quorum: waits for this step's quorum (once per step).
        paused: ``True`` while the groups train alone (a ``straggler_sync`` semi-synchronous phase).
    """

    def __init__(
        self, step: StepInFlight, wait_quorum: Callable[[], None], paused: Callable[[], bool]
    ) -> None:
        self.step = step
        self.wait_quorum = wait_quorum
        self.paused = paused
        #: the manager with its all-reduces counted (set once it exists)
        self.link: Any = None
        #: a micro-batch of this step left its gradients unreduced across groups: the step's reduction is
        #: :meth:`reduce_accumulated`, after its last backward
        self.deferred = False

    @contextmanager
    def micro_batch(self) -> Generator[None, None, None]:
        """A non-final micro-batch of gradient accumulation: no cross-group traffic until the step's last
        backward has run (then :meth:`reduce_accumulated`). Not while :attr:`paused` (no cross-group
        traffic)."""
        self.deferred = self.deferred or not self.paused()
        yield None

    def end_step(self) -> None:
        """The step is over (committed, discarded or trained alone): the next one starts undeferred."""
        self.deferred = False

    def _weights(self) -> tuple[float, ReduceOp]:
        step = self.step  # NonFiniteGuard left a group out: a weighted sum; redistribute: this group's share
        return (step.grad_scale, ReduceOp.AVG) if step.sum_scale is None else (step.sum_scale, ReduceOp.SUM)

    def hook(self, reduce_output: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: average one unit's reduce-scatter output over the step's groups (in
        place).

        Deferred (accumulation): only this micro-batch's ``redistribute`` weight is applied here.
        """
        if self.paused():  # straggler_sync's semi-synchronous phase: the hook stays, the traffic stops
            return
        if self.deferred:
            if self.step.grad_scale != 1.0:
                _scale(reduce_output, self.step.grad_scale)
            return
        scale, op = self._weights()
        if scale != 1.0:
            _scale(reduce_output, scale)
        self._all_reduce(reduce_output, op)

    def reduce_accumulated(self, model: nn.Module) -> None:
        """After the last backward of a deferred step: average every accumulated gradient across the groups
        (one all-reduce per dtype; the ``redistribute`` weights were applied per micro-batch by :meth:`hook`,
        a ``NonFiniteGuard`` weight is applied here)."""
        step = self.step
        sum_scale = step.sum_scale
        if sum_scale is not None and step.micro_scales:  # the hook weighted each micro-batch already: the
            applied = sum(step.micro_scales) / len(step.micro_scales)  # step's weight replaces it (exact when
            sum_scale = sum_scale / applied  # its micro-batches are alike, as all but an epoch's last are)
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for tensors in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            if sum_scale is not None and sum_scale != 1.0:
                _scale(flat, sum_scale)
            self._all_reduce(flat, ReduceOp.AVG if sum_scale is None else ReduceOp.SUM)
            at = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[at:at + n].view_as(t))
                at += n
        replicated = replicated_params(model)
        if replicated is not None:  # every rank of the group takes its first rank's result (see that module)
            replicated.agree([p.grad for p in replicated.params if p.grad is not None])

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        assert self.link is not None
        t0 = time.perf_counter()
        with self.step.waiting_for_peers():
            self.wait_quorum()
            with self.step.timed("allreduce"):
                self.link.allreduce(tensor, reduce_op=op).wait()  # an error -> no commit
        self.step.cross_s += time.perf_counter() - t0


def _scale(tensor: torch.Tensor, scale: float) -> None:
    tensor.mul_(scale) if scale else tensor.zero_()  # zero_: NaN * 0 is NaN


def _local(grad: Any) -> torch.Tensor:
    """The tensor a rank holds of a gradient: a DTensor's local shard (no autograd view), else the
    gradient."""
    return _torch_seam.local_shard(grad) if isinstance(grad, DTensor) else grad
