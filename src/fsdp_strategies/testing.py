"""Helpers for tests and benchmarks -- public so they can be imported from both; not for production runs.

* Memory a rank really holds (local shards): :func:`param_bytes`, :func:`grad_bytes`,
  :func:`optimizer_state_bytes`, :func:`fsdp_gradient_bytes` (every gradient FSDP2 keeps, by kind) and
  :class:`KeptBytes` (activation memory kept for backward).
* A stall model: :class:`StragglerInjection` (what to delay) and :class:`StallInjector` (a callback that
  delays chosen ranks, nothing else). A benchmark uses it alone; a detection test or demo lists it before
  :class:`~fsdp_strategies.callbacks.StragglerDetector`, so both share one implementation of a stall.
* A stuck rank: :class:`HangInjector` (sleeps forever at a chosen rank and step).
* A slow link between replica groups: :class:`SlowLink` (which groups, how slow, when) and
  :class:`SlowLinkInjector` (a callback that delays that group's cross-group all-reduces under ``ft_hsdp`` by
  wrapping its torchft manager's ``allreduce``; the strategy has no hook for it).
* :func:`state_digest`: a hash of this rank's tensors (shards of DTensors), to compare states across
  processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from fsdp_strategies import _torch_seam
from fsdp_strategies.callbacks.straggler import StragglerDetector
from fsdp_strategies.ft.heal_state import local
from fsdp_strategies.memory.saved_bytes import SavedBytes

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["SLOW_LINK_ENV", "HangInjector", "KeptBytes", "SlowLink", "SlowLinkInjector", "StallInjector",
           "StragglerInjection", "fsdp_gradient_bytes", "grad_bytes", "hang_forever", "optimizer_state_bytes",
           "param_bytes", "state_digest"]

#: JSON of a :class:`SlowLink` (e.g.
#: ``{"groups": [1], "seconds_per_mb": 2.0, "start_step": 8, "end_step": 40}``), read by
#: ``SlowLinkInjector()`` when it is given no link
SLOW_LINK_ENV = "FSDP_STRATEGIES_SLOW_LINK"


# ---------------------------------------------------------------------------------------------- memory
def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:  # dedupe on the (long-lived) tensor itself: to_local() returns fresh views
        local = t.to_local() if hasattr(t, "to_local") else t
        if id(t) in seen or local.device.type == "meta":
            continue
        seen.add(id(t))
        total += local.numel() * local.element_size()
    return total


def param_bytes(module: nn.Module) -> int:
    return _bytes(module.parameters())


def grad_bytes(module: nn.Module) -> int:
    return _bytes(p.grad for p in module.parameters() if p.grad is not None)


def fsdp_gradient_bytes(module: nn.Module) -> dict[str, int]:
    """Gradient bytes this rank holds in FSDP2's own state now, by kind: ``sharded`` (``param.grad``
    shards), ``unsharded`` (whole gradients kept between backwards) and ``pending_all_reduce``
    (reduce-scattered, waiting for the cross-replica all-reduce); see
    :func:`fsdp_strategies._torch_seam.fsdp_gradient_holders`."""
    held = {"sharded": 0, "unsharded": 0, "pending_all_reduce": 0}
    seen: set[int] = set()
    for kind, tensor in _torch_seam.fsdp_gradient_holders(module):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            held[kind] += tensor.numel() * tensor.element_size()
    return held


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _bytes(
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    )


class KeptBytes(SavedBytes):
    """Bytes of every storage an op creates during forward that is still alive afterwards (weights excluded by
    the caller): :class:`fsdp_strategies.memory.SavedBytes` under the name the tests and benchmarks use."""


# ---------------------------------------------------------------------------------------------- stalls
InjectionKind = Literal["sleep", "busy_wait", "spin"]
_INJECTION_KINDS: tuple[str, ...] = get_args(InjectionKind)


@dataclass
class StragglerInjection:
    """Delays chosen ranks, for tests and benchmarks (configured from YAML).

    Attributes:
        ranks: ranks to delay; ``None`` = every rank independently (random stalls on random ranks).
        delay_s: length of one delay in seconds.
        probability: chance that a given step of a chosen rank is delayed (1.0 = persistent, every
            step; e.g. 0.02 = rare transient stalls).
        start_step: first global step in which delays happen.
        end_step: delays happen before this global step (None = until the end).
        kind: ``sleep`` (a host stall before the step: time the rank is away), ``busy_wait`` (the same
            stall spent in a busy loop: on a CPU host shared by several ranks the stalled rank keeps its
            share of the cores, so the others do not speed up while it is away, as on separate
            machines) or ``spin`` (a busy loop of ``delay_s`` CPU time inside forward+backward: a slow
            device that burns compute).
        seed: random stream per rank is seeded with ``seed + rank``.
    """

    ranks: list[int] | None = None
    delay_s: float = 0.0
    probability: float = 1.0
    start_step: int = 0
    end_step: int | None = None
    kind: InjectionKind = "sleep"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.delay_s < 0:
            raise ValueError(f"inject.delay_s={self.delay_s!r} is negative. Fix: seconds >= 0.")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(
                f"inject.probability={self.probability!r} is not in [0, 1]. Fix: e.g. 1.0 (persistent) "
                "or 0.02 (rare stalls)."
            )
        if self.kind not in _INJECTION_KINDS:
            raise ValueError(f"inject.kind={self.kind!r} is unknown. Fix: one of {list(_INJECTION_KINDS)}.")
        if self.end_step is not None and self.end_step <= self.start_step:
            raise ValueError(
                f"inject.end_step={self.end_step} must be after inject.start_step={self.start_step}."
            )


class StallInjector(Callback):
    """Delays the ranks and steps a :class:`StragglerInjection` chooses; measures nothing, no collective.

    A benchmark's stall model (e.g. the cost of stragglers under ``ddp`` vs local SGD), and the slow rank
    of the straggler tests and of ``configs/straggler.yaml``. ``sleep`` / ``busy_wait`` stall at batch start
    (the rank is away before its step), ``spin`` before the step's backward (a slow device burning compute
    inside forward + backward); one draw per training batch.

    With a :class:`~fsdp_strategies.callbacks.StragglerDetector`, list this callback *before* the detector
    (checked at setup): Lightning runs callbacks in list order, and a stall at batch start must end before
    the detector starts timing the step, or the detector would book it as compute time instead of as the
    rank's own (data) time.
    """

    def __init__(self, inject: StragglerInjection | dict[str, Any]) -> None:
        super().__init__()
        self.inject = StragglerInjection(**inject) if isinstance(inject, dict) else inject
        self._rng: random.Random | None = None
        self._in_step_due = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        callbacks = list(getattr(trainer, "callbacks", ()))
        detectors = [i for i, c in enumerate(callbacks) if isinstance(c, StragglerDetector)]
        if self in callbacks and detectors and detectors[0] < callbacks.index(self):
            raise ValueError(
                "StallInjector is listed after StragglerDetector "
                "in trainer.callbacks, so its stalls would fall "
                "inside the step the detector times. Fix: list fsdp_strategies.testing.StallInjector before "
                "fsdp_strategies.callbacks.StragglerDetector."
            )
        self._rng = random.Random(self.inject.seed + trainer.global_rank)

    def _due(self, trainer: pl.Trainer) -> bool:
        """Whether this rank stalls in the step starting now (one draw per step, whatever the outcome)."""
        inj = self.inject
        if inj.delay_s <= 0 or self._rng is None:
            return False
        step = trainer.global_step
        chosen = inj.ranks is None or trainer.global_rank in inj.ranks
        draw = self._rng.random()  # drawn every step so the stream does not depend on the schedule
        if not chosen or step < inj.start_step or (inj.end_step is not None and step >= inj.end_step):
            return False
        return draw < inj.probability

    def _stall(self) -> None:
        inj = self.inject
        if inj.kind == "sleep":
            time.sleep(inj.delay_s)
        else:  # busy_wait: delay_s of wall time; spin: of CPU time (more work, however busy the host is)
            clock = time.perf_counter if inj.kind == "busy_wait" else time.process_time
            end = clock() + inj.delay_s
            while clock() < end:
                pass

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        due = self._due(trainer)
        if self.inject.kind == "spin":
            self._in_step_due = due  # spent inside the step, before its backward
        elif due:
            self._stall()  # the rank is away before its step

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self._in_step_due:  # the batch's first backward (manual optimization may call several)
            self._in_step_due = False
            self._stall()


class HangInjector(Callback):
    """Global rank ``rank`` stops making progress when it starts step ``step``: it sleeps forever inside
    :func:`hang_forever` (a stuck rank, for :class:`~fsdp_strategies.callbacks.HangWatchdog`'s tests). List it
    after the watchdog, which then sees the batch start. ``only_first_run``: not in a restarted process
    (``FT_RESTART_COUNT`` / ``SLURM_RESTART_COUNT`` > 0), so that a restart or requeue gets past the step."""

    def __init__(self, rank: int, step: int, only_first_run: bool = True) -> None:
        super().__init__()
        self.rank, self.step, self.only_first_run = rank, step, only_first_run

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        restarted = any(os.environ.get(v, "0") != "0" for v in ("FT_RESTART_COUNT", "SLURM_RESTART_COUNT"))
        if trainer.global_rank == self.rank and trainer.global_step == self.step and not (
                self.only_first_run and restarted):
            print(f"HangInjector: rank {self.rank} hangs at step {self.step}", flush=True)
            hang_forever()


def hang_forever() -> None:
    """The frame a :class:`HangInjector` rank sleeps in (its stack dump names it)."""
    time.sleep(10**6)


# ---------------------------------------------------------------------------------------------- slow links
@dataclass
class SlowLink:
    """A persistently slow replica group, modelled as a slow link: every cross-group all-reduce of a chosen
    group is delayed by ``latency_s + seconds_per_mb * MB`` (a host that sleeps: the link is slow, not the
    CPU).

    Attributes:
        groups: replica group ids whose link is slow.
        seconds_per_mb: delay per MB (1e6 bytes) sent; FSDP's per-step gradient all-reduces and an outer
            sync's pseudo-gradient all-reduces move the same bytes, so the model charges both alike.
        latency_s: delay per all-reduce call.
        start_step: first committed step (``Trainer.global_step`` during the step) in which the link is slow.
        end_step: the link is slow before this committed step (None = until the end).
    """

    groups: list[int]
    seconds_per_mb: float = 0.0
    latency_s: float = 0.0
    start_step: int = 0
    end_step: int | None = None

    def __post_init__(self) -> None:
        if self.seconds_per_mb < 0 or self.latency_s < 0:
            raise ValueError(
                f"slow_link: seconds_per_mb={self.seconds_per_mb!r}, latency_s={self.latency_s!r} must be "
                ">= 0. Fix: e.g. seconds_per_mb=2.0."
            )
        if self.end_step is not None and self.end_step <= self.start_step:
            raise ValueError(
                f"slow_link.end_step={self.end_step} must be after start_step={self.start_step}. Fix: a "
                "larger end_step, or null."
            )

    def delay_s(self, nbytes: int, step: int) -> float:
        if step < self.start_step or (self.end_step is not None and step >= self.end_step):
            return 0.0
        return self.latency_s + self.seconds_per_mb * nbytes / 1e6


class SlowLinkInjector(Callback):
    """Puts a :class:`SlowLink` under the cross-group all-reduces of the chosen ``ft_hsdp`` replica groups.

    ``link=None`` reads :data:`SLOW_LINK_ENV`; when that is unset too, it does nothing (off by default). At
    ``setup`` (after the strategy has built its ``torchft.Manager``, before the model is sharded) it wraps
    ``allreduce`` of the strategy's cross-group process group (``cross_group_pg``) on this process, which
    every cross-group all-reduce of the strategy runs on (FSDP's gradient reductions, the outer sync's
    pseudo-gradients, the switch vote; through torchft's ``Manager.allreduce`` or not): the delay happens on
    every rank of the group, before the all-reduce starts, so the other groups wait for it. Nothing in the
    strategy knows about it. ``delayed_s`` sums this rank's delays.
    """

    def __init__(self, link: SlowLink | dict[str, Any] | None = None) -> None:
        super().__init__()
        if link is None and os.environ.get(SLOW_LINK_ENV):
            link = json.loads(os.environ[SLOW_LINK_ENV])
        self.link = SlowLink(**link) if isinstance(link, dict) else link
        self.delayed_s = 0.0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if self.link is None or getattr(strategy, "replica_group_id", None) not in self.link.groups:
            return
        pg = getattr(strategy, "cross_group_pg", None)
        if pg is None or not callable(getattr(pg, "allreduce", None)):
            raise ValueError(
                f"SlowLinkInjector needs ft_hsdp (a torchft process group whose cross-group all-reduces it "
                f"delays); the strategy is {type(strategy).__name__}. Fix: strategy: ft_hsdp, or remove "
                "the callback."
            )
        link, allreduce = self.link, pg.allreduce

        def slow_allreduce(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            seconds = link.delay_s(nbytes, trainer.global_step)
            if seconds > 0:
                self.delayed_s += seconds
                time.sleep(seconds)
            return allreduce(tensors, *args, **kwargs)

        pg.allreduce = slow_allreduce


# ---------------------------------------------------------------------------------------------- states
def state_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-1 over the bytes of this rank's tensors (shards of DTensors), in key order -- for equality
    checks."""
    h = hashlib.sha1()
    for key in sorted(tensors):
        t = local(tensors[key]).detach().contiguous().cpu().reshape(-1)
        h.update(key.encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
