"""Skip an optimizer step whose gradients are not finite, on every rank at once, instead of poisoning weights.

Why: one micro-batch that produces an ``inf``/``NaN`` gradient (a loss spike, a bad sample, a flaky device)
makes the optimizer write ``NaN`` into every parameter on every rank, and the run is lost from that step on,
silently, until someone reads the loss curve. Lightning's ``detect_anomaly`` is far too slow to leave on.

How (``on_before_optimizer_step``, after the last micro-batch's backward, before gradient clipping and the
optimizer step):

* Each rank checks its own gradients (the local shard of a sharded parameter) with one fused pass; the ranks
  then agree with one all-reduce (``max`` of a flag, through the strategy) so that no rank steps alone.
* If any rank found a non-finite gradient, every rank drops its gradients (``zero_grad(set_to_none=True)``):
  the optimizer then has nothing to apply (torch's optimizers skip parameters without a gradient: parameters
  and optimizer state, step counts included, stay bitwise as they were) and the step-interval LR schedulers
  of that optimizer skip their next ``step()`` (the schedule does not advance). ``global_step`` still counts
  the step (Lightning counts the optimizer call), so a resumed run and the loggers see the same step numbers.
* Skipped steps are counted (:attr:`NonFiniteGuard.skipped`, saved in checkpoints) and logged as
  ``nonfinite/skipped_steps``; each skip warns once on rank 0 with the step and the ranks. After
  ``max_consecutive`` skipped steps in a row the run stops with :class:`NonFiniteGradientError`, naming the
  step, the ranks and each one's first non-finite parameter gradient.
* The culprit: the reduction of data parallelism spreads one rank's non-finite gradient to every rank, so the
  gradients tell *that* a step is bad; each rank's own loss (``on_before_backward``) tells *where* it began.
  The ranks named are those whose loss was non-finite, else those whose gradients were.

Where it works: ``fsdp2``, ``hsdp``, ``ddp_hooks``, Lightning's ``ddp`` / single device, and ``ft_hsdp``,
automatic optimization. Under ``ft_hsdp`` (a :class:`~fsdp_strategies.protocols.NonFiniteLossSink`) a
replica group whose loss is not finite leaves that step's cross-group average before its backward pass,
and the other groups' step is applied on every group (:mod:`fsdp_strategies.ft.nonfinite`). Refused at
set-up (with the reason and the fix): manual optimization (the module steps its optimizers). Under
``ddp_hooks`` with ``post_local_sgd`` / ``hierarchical_sgd`` the periodic model averaging after the step
still runs (it averages the unchanged parameters across ranks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from fsdp_strategies._options import OptionError, check_int
from fsdp_strategies.protocols import NonFiniteLossSink

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["NonFiniteGradientError", "NonFiniteGuard"]


class NonFiniteGradientError(RuntimeError):
    """Too many optimizer steps in a row had non-finite gradients (raised on every rank)."""


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor's shard on this rank


def _finite_flags(named_grads: list[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
    """One bool per gradient, on its device (no host sync): whether it is all finite."""
    return torch.stack([torch.isfinite(g).all() for _, g in named_grads]) if named_grads else None


def _first_nonfinite(named_grads: list[tuple[str, torch.Tensor]], finite: torch.Tensor | None) -> str | None:
    """Name of the first parameter (in module order) whose local gradient holds an inf or NaN."""
    if finite is None:
        return None
    bad = (~finite).nonzero().cpu()
    return named_grads[int(bad[0])][0] if len(bad) else None


class _SkipOnce:
    """Stands in for a scheduler's ``step`` for one call, then puts the original back."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        del self.scheduler.step  # the instance attribute: the class's step is back


class NonFiniteGuard(Callback):
    """Skip optimizer steps with non-finite gradients on every rank; stop after ``max_consecutive`` in a row.

    Args:
        max_consecutive: stop the run with :class:`NonFiniteGradientError` when this many optimizer steps in a
            row had non-finite gradients (one bad batch is skipped; a diverged run is stopped). At least 1.
        log: log ``nonfinite/skipped_steps`` (the running count) to the Trainer's loggers at each skip.
    """

    def __init__(self, max_consecutive: int = 5, log: bool = True) -> None:
        super().__init__()
        check_int("max_consecutive", max_consecutive, 1, prefix="NonFiniteGuard: ")
        self.max_consecutive = max_consecutive
        self.log = log
        #: optimizer steps skipped so far in this run (restored from checkpoints)
        self.skipped = 0
        self.consecutive = 0
        self._loss_nonfinite = False  # this rank's loss of a micro-batch of the current step

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        # the culprit: under data parallelism the reduction spreads one rank's NaN gradient to every rank, so
        # the gradients say *that* a step is bad, each rank's own loss says *where* it started
        bad = not bool(torch.isfinite(loss.detach()).all())
        self._loss_nonfinite |= bad
        if isinstance(trainer.strategy, NonFiniteLossSink):  # ft_hsdp: the group leaves the step's average
            trainer.strategy.leave_step_if_nonfinite(bad)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not pl_module.automatic_optimization:
            raise OptionError(
                "NonFiniteGuard: manual optimization is not supported (the module steps its "
                "optimizers itself). Fix: check torch.isfinite on the gradients in training_step "
                "before optimizer.step(), or use automatic optimization."
            )

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        named = [(n, _local(p.grad)) for n, p in pl_module.named_parameters() if p.grad is not None]
        finite = _finite_flags(named)
        device = trainer.strategy.root_device
        flag = torch.zeros((), device=device) if finite is None else (~finite).any().to(device, torch.float32)
        loss_bad, self._loss_nonfinite = self._loss_nonfinite, False
        if float(trainer.strategy.reduce(flag, reduce_op="max")) == 0.0:  # one agreement (the one host sync)
            self.consecutive = 0
            return
        first = _first_nonfinite(named, finite)
        step = trainer.global_step
        found = self._gather((trainer.global_rank, loss_bad, first))
        ranks = sorted(r for r, bad, _ in found if bad) or sorted(
            r for r, _, name in found if name is not None
        )
        what = "a non-finite loss" if any(bad for _, bad, _ in found) else "non-finite gradients"
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            where = "; ".join(f"rank {r}: {name}" for r, _, name in sorted(found) if name is not None)
            raise NonFiniteGradientError(
                f"NonFiniteGuard: {self.consecutive} optimizer steps in a row had non-finite gradients "
                f"(the last at step {step}: {what} on rank(s) {ranks}; first non-finite gradient: {where}). "
                "The run has diverged or its data is bad. Fix: lower the learning rate, clip gradients "
                "(gradient_clip_val), check the batches of these steps, or resume from an earlier checkpoint."
            )
        optimizer.zero_grad(set_to_none=True)
        due = trainer.fit_loop.epoch_loop.batch_idx + 1  # what Lightning's step-interval update tests
        for config in trainer.lr_scheduler_configs:
            sched = config.scheduler
            if (
                config.interval == "step"
                and due % config.frequency == 0
                and getattr(sched, "optimizer", None) is optimizer
                and "step" not in vars(sched)
            ):
                sched.step = _SkipOnce(sched)  # type: ignore[method-assign]
        rank_zero_warn(
            f"NonFiniteGuard: step {step} skipped on every rank: {what} on rank(s) "
            f"{ranks} (skipped so far: {self.skipped}; the run stops after {self.max_consecutive} in a "
            "row)."
        )
        if self.log:
            pl_module.log(
                "nonfinite/skipped_steps",
                float(self.skipped),
                on_step=True,
                on_epoch=False,
                rank_zero_only=True,
            )

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        for config in trainer.lr_scheduler_configs:  # never leave a skip behind (nor in a checkpoint)
            if isinstance(vars(config.scheduler).get("step"), _SkipOnce):
                del config.scheduler.step

    @staticmethod
    def _gather(item: tuple[int, bool, str | None]) -> list[tuple[int, bool, str | None]]:
        """Every rank's (rank, loss non-finite, first non-finite parameter); only on a skipped step."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [item]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, item)
        return out

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))
        self.consecutive = int(state_dict.get("consecutive", 0))
