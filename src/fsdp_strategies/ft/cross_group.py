"""``ft_hsdp``'s cross-group gradient reduction: once per optimizer step, also under gradient accumulation.

Inside a replica group FSDP2 reduce-scatters the gradients; across groups they are averaged on torchft's
cross-group process group with ``Manager.allreduce``'s rules (``CountedManager.gradient_allreduce`` in
:mod:`fsdp_strategies.ft.manager`), whose membership the step's quorum decides.

* **A step of one micro-batch** (no accumulation): :meth:`CrossGroupReduce.unit_hook` is each FSDP unit's
  all-reduce hook (``FSDPModule.set_all_reduce_hook``; :meth:`CrossGroupReduce.hook` the replicated 0-d
  parameters'): each unit's reduce-scatter output starts its cross-group average as soon as it exists and the
  backward goes on; the backward's end (a callback queued with the autograd engine, after FSDP2's own) waits
  for them all, before any ``on_after_backward`` hook, clipping or optimizer sees a gradient. That holds
  where FSDP2 leaves the tensor alone after the hook -- the unit's gradients become views of it -- which
  ``_can_overlap`` checks per call; elsewhere (gradients kept from an earlier backward to add into, a
  reduce dtype other than the parameters', CPU offload, fp16's division after the reduction) the hook waits.
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
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from fsdp_strategies import _torch_seam
from fsdp_strategies.ft.accounting import StepInFlight
from fsdp_strategies.ft.manager import QuorumView
from fsdp_strategies.parallel.replicated_params import replicated_params

__all__ = ["CrossGroupReduce"]


class CrossGroupReduce:
    """The cross-group average of one replica group's gradients (see the module docstring).

    Args:
        step: the step in flight (its weights, timers and peer-wait mark).
        wait_quorum: waits for this step's quorum (once per step) and returns it
            (:class:`~fsdp_strategies.ft.manager.QuorumView`).
        paused: ``True`` while the groups train alone (a ``straggler_sync`` semi-synchronous phase).
    """

    def __init__(
        self, step: StepInFlight, wait_quorum: Callable[[], QuorumView], paused: Callable[[], bool]
    ) -> None:
        self.step = step
        self.wait_quorum = wait_quorum
        self.paused = paused
        #: the manager with its all-reduces counted (set once it exists)
        self.link: Any = None
        #: a micro-batch of this step left its gradients unreduced across groups: the step's reduction is
        #: :meth:`reduce_accumulated`, after its last backward
        self.deferred = False
        #: this backward's cross-group all-reduces still running (waited for when the backward ends)
        self.pending: list[Any] = []

    @contextmanager
    def micro_batch(self) -> Generator[None, None, None]:
        """A non-final micro-batch of gradient accumulation: no cross-group traffic until the step's last
        backward has run (then :meth:`reduce_accumulated`). Not while :attr:`paused` (no cross-group
        traffic)."""
        self.deferred = self.deferred or not self.paused()
        yield None

    def end_step(self) -> None:
        """The step is over (committed, discarded or trained alone): the next one starts undeferred (and
        with no all-reduce of a failed backward still running)."""
        self.wait_pending()
        self.deferred = False

    def _weights(self) -> tuple[float, ReduceOp]:
        step = self.step  # NonFiniteGuard left a group out: a weighted sum; redistribute: this group's share
        return (step.grad_scale, ReduceOp.AVG) if step.sum_scale is None else (step.sum_scale, ReduceOp.SUM)

    def unit_hook(self, params: Sequence[nn.Parameter]) -> Callable[[torch.Tensor], None]:
        """FSDP2's all-reduce hook for one FSDP unit sharding ``params``: :meth:`hook`, its all-reduce run
        behind the rest of the backward where FSDP2 leaves the tensor alone until then (``_can_overlap``)."""
        def unit(reduce_output: torch.Tensor) -> None:
            self.hook(reduce_output, overlap=_can_overlap(reduce_output, params))
        return unit

    def hook(self, reduce_output: torch.Tensor, overlap: bool = False) -> None:
        """FSDP2's all-reduce hook: average one unit's reduce-scatter output over the step's groups (in
        place).

        Deferred (accumulation): only this micro-batch's ``redistribute`` weight is applied here.
        ``overlap``: start the all-reduce and return; the backward's end waits for it.
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
        self._all_reduce(reduce_output, op, wait=not overlap)

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

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, wait: bool = True) -> None:
        assert self.link is not None
        t0 = time.perf_counter()
        with self.step.waiting_for_peers():
            quorum = self.wait_quorum()
            with self.step.timed("allreduce"):
                work = self.link.gradient_allreduce(tensor, reduce_op=op, quorum=quorum)
                if wait:
                    work.wait()  # an error -> no commit
                else:
                    if not self.pending:
                        _torch_seam.queue_backward_callback(self.wait_pending)
                    self.pending.append(work)
        self.step.cross_s += time.perf_counter() - t0

    def wait_pending(self) -> None:
        """Wait for the all-reduces started behind the backward (at its end; again, harmlessly, before the
        commit)."""
        if not self.pending:
            return
        t0 = time.perf_counter()
        with self.step.waiting_for_peers(), self.step.timed("allreduce"):
            for work in self.pending:
                work.wait()  # an error -> no commit
        self.pending.clear()
        self.step.cross_s += time.perf_counter() - t0


def _can_overlap(reduce_output: torch.Tensor, params: Sequence[nn.Parameter]) -> bool:
    """Whether FSDP2 leaves ``reduce_output`` alone until the backward ends once the hook returns: the unit's
    gradients become views of it -- no earlier gradient to add it into, no cast to the parameters' dtype, no
    copy to their device (CPU offload) -- and nothing divides it after the hook (fp32 / bf16; FSDP2 divides
    fp16 after the reduction)."""
    dtype, device = reduce_output.dtype, reduce_output.device
    return dtype in (torch.float32, torch.bfloat16) and all(
        p.grad is None and p.dtype == dtype and p.device == device for p in params)


def _scale(tensor: torch.Tensor, scale: float) -> None:
    tensor.mul_(scale) if scale else tensor.zero_()  # zero_: NaN * 0 is NaN


def _local(grad: Any) -> torch.Tensor:
    """The tensor a rank holds of a gradient: a DTensor's local shard (no autograd view), else the
    gradient."""
    return _torch_seam.local_shard(grad) if isinstance(grad, DTensor) else grad
