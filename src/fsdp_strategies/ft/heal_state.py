"""What a recovering replica group fetches from a live peer, and the LR-scheduler bookkeeping around it.

Heal state (the manager's ``state_dict``/``load_state_dict`` callbacks; keys ``model``, ``optimizers``,
``lr_schedulers`` -- a wire format: every group of a job must agree on it):

* :meth:`HealState.capture` takes *references* (no copies) to this rank's model shards -- DTensors reduced
  to their local tensors, since the transfer sends plain tensors -- on the main thread at the start of a
  step (or before an outer sync's quorum), while every FSDP unit is resharded. The model's part is kept
  from one step to the next while the model holds the same tensors (its ``state_dict`` -- FSDP2's hooks on
  every unit, the larger part of a capture -- is taken again only when one was replaced, or every step if
  the ``state_dict`` holds anything but parameters and buffers); whether one was is told without walking
  the model (the same tensors' local tensors, and no registration since: ``_Registrations``). torchft's
  quorum thread sends that snapshot to a healing peer (:meth:`HealState.state_dict`), with the optimizers'
  and LR schedulers' state read then; the tensors are the live ones, which the optimizer only changes
  after ``should_commit``, i.e. after the transfer.
* :meth:`HealState.load` copies a received state into this rank's shards (the local tensor of each
  DTensor parameter; optimizer moments are rebuilt as DTensors with the parameter's layout).

LR schedulers (:class:`SchedulerRollback`): Lightning steps the ``interval="step"`` schedulers after
every optimizer step, committed or not. A discarded step (or a discarded outer sync, which rolls back
its round) must not move them, so the strategy snapshots them and restores the snapshot before the next
step. A group that heals inside an outer sync receives schedulers its peer captured *before* Lightning
stepped them for the step that ends at that sync, so it steps them once itself
(:meth:`SchedulerRollback.restep_after_heal`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies import _torch_seam
from fsdp_strategies.checkpoint.key_mismatch import KeyMismatch, StateMismatchError
from fsdp_strategies.checkpoint.verify import verify_checkpoint
from fsdp_strategies.ft.protocol import resume_file

if TYPE_CHECKING:
    from torch.optim import Optimizer

__all__ = ["HealState", "HealStateMismatchError", "SchedulerRollback", "TrainingState", "local",
           "resume_from_handed"]


def local(value: Any) -> Any:
    """This rank's shard of a DTensor; other values unchanged (the heal transfer sends plain tensors)."""
    return _torch_seam.local_shard(value) if isinstance(value, DTensor) else value


class HealStateMismatchError(StateMismatchError, RuntimeError):
    """A live peer's state has other keys than this rank's model (a ``RuntimeError``, as it was before)."""


class TrainingState(NamedTuple):
    """The objects a heal reads and writes (they exist only once Lightning has set the model up)."""

    model: nn.Module
    optimizers: Sequence[Optimizer]
    #: Lightning's ``trainer.lr_scheduler_configs`` (``.scheduler``, ``.interval``)
    lr_scheduler_configs: Sequence[Any]


class _Registrations:
    """How many parameters, buffers and modules were registered or assigned to any module of this process
    since :meth:`install` (torch's global registration hooks, installed once: they count and change
    nothing)."""

    _count = 0
    _installed = False

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        from torch.nn.modules.module import (
            register_module_buffer_registration_hook,
            register_module_module_registration_hook,
            register_module_parameter_registration_hook,
        )

        for register in (register_module_buffer_registration_hook, register_module_module_registration_hook,
                         register_module_parameter_registration_hook):
            register(cls._saw)
        cls._installed = True

    @classmethod
    def _saw(cls, *_: Any) -> None:
        cls._count += 1

    @classmethod
    def seen(cls) -> int:
        return cls._count


class HealState:
    """The snapshot a healing peer fetches from this rank, and the application of one received from a peer.

    ``parts`` returns the live :class:`TrainingState` (called at capture and at load time).
    """

    def __init__(self, parts: Callable[[], TrainingState]) -> None:
        self._parts = parts
        self._snapshot: dict[str, Any] | None = None
        self._model_refs: dict[str, Any] = {}
        self._model_held: tuple[int, ...] | None = None  # ids of the tensors the cached references came from
        self._held_model: nn.Module | None = None  # ... the model, its tensors (parameters, buffers) ...
        self._held_tensors: list[torch.Tensor] = []
        self._held_registrations = -1  # ... and the registrations seen then

    def capture(self) -> None:
        """References (no copies) to this rank's model shards; taken on the main thread while every unit is
        resharded. The optimizers' and LR schedulers' part is read when a peer asks (:meth:`state_dict`)."""
        self._snapshot = {"model": self._model_state(self._parts().model)}

    def _model_state(self, model: nn.Module) -> dict[str, Any]:
        """``{key: local tensor}`` of the model's ``state_dict``, reused while the model holds the same
        parameter and buffer tensors (a replaced one, or a DTensor given a new local tensor: taken again).

        Checked without walking the model each step (that walk was most of a capture, ~0.1 ms for the example
        and ~0.35 ms for a 16-layer model): the tensors of the last walk still have the same local tensors,
        and no parameter, buffer or module was registered or assigned anywhere since
        (:class:`_Registrations`; FSDP2's own swaps between a unit's sharded and unsharded parameters do
        not register anything). Not seen: a parameter deleted from its module, or one replaced by
        ``model.to(...)`` under ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` --
        neither fires a registration hook, and neither FSDP2 nor Lightning does either between steps.
        """
        tensors = self._held_tensors
        if (self._model_held is not None and self._held_model is model
                and self._held_registrations == _Registrations.seen()
                and tuple(id(local(t)) for t in tensors) == self._model_held):
            return self._model_refs
        _Registrations.install()
        registrations = _Registrations.seen()
        tensors = list(itertools.chain(model.parameters(), model.buffers()))
        held = tuple(id(local(t)) for t in tensors)
        live = {k: local(v) for k, v in model.state_dict(keep_vars=True).items()}
        ids = set(held)  # anything else in the state_dict (extra state) may change: taken every step
        self._model_held = held if all(id(v) in ids for v in live.values()) else None
        self._held_model, self._held_tensors, self._held_registrations = model, tensors, registrations
        self._model_refs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in live.items()}
        return self._model_refs

    def state_dict(self) -> dict[str, Any]:
        """The last capture's model references, with the optimizers' and LR schedulers' state as they are now
        (torchft calls this on its quorum thread when a peer heals from this group: during the step's
        forward/backward, which change neither; they change in the optimizer step, after ``should_commit``,
        i.e. after the transfer). Read here rather than at every capture: an optimizer's ``state_dict`` with
        its shards' local tensors cost each step a third of the capture, for the rare step a peer heals in."""
        assert self._snapshot is not None, "ft_hsdp: heal state requested before the first step"
        _, optimizers, schedulers = self._parts()
        return {
            "model": self._snapshot["model"],
            "optimizers": [
                {"state": {i: {k: local(v) for k, v in s.items()} for i, s in sd["state"].items()},
                 "param_groups": sd["param_groups"]}
                for sd in (opt.state_dict() for opt in optimizers)
            ],
            "lr_schedulers": [cfg.scheduler.state_dict() for cfg in schedulers],
        }

    @torch.no_grad()
    def load(self, state: dict[str, Any]) -> None:
        """Apply a live peer's state to this rank's shards, optimizers and LR schedulers."""
        model, optimizers, schedulers = self._parts()
        own = model.state_dict()
        mismatch = KeyMismatch.between(list(own), list(state["model"]))  # keys: shapes are local shards
        if mismatch:
            raise HealStateMismatchError(
                "ft_hsdp: the healed state does not match this model: "
                f"{mismatch.describe('healed state', shown=5)}. Fix: every replica group of a job must build "
                "the same model (same code and config).")
        for key, value in own.items():
            local(value).copy_(state["model"][key])
        for opt, received in zip(optimizers, state["optimizers"]):
            _load_optimizer_shards(opt, received)
        for cfg, sched_state in zip(schedulers, state["lr_schedulers"]):
            cfg.scheduler.load_state_dict(sched_state)


def _load_optimizer_shards(opt: Optimizer, received: dict[str, Any]) -> None:
    """Load an optimizer state whose tensors are local shards: moments shaped like a DTensor parameter's shard
    become DTensors with that parameter's mesh and placements."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for idx, pstate in received["state"].items():
        param = params[int(idx)]
        entry = {}
        for key, value in pstate.items():
            if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0 \
                    and value.shape == param.to_local().shape:
                value = DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                                           run_check=False, shape=param.shape, stride=param.stride())
            entry[key] = value
        state[int(idx)] = entry
    opt.load_state_dict({"state": state, "param_groups": received["param_groups"]})


class SchedulerRollback:
    """Keep the LR schedulers (and the optimizers' non-parameter group values) where the committed steps put
    them.

    ``parts`` as for :class:`HealState`. :meth:`discard_step` / :meth:`discard_round` arm a snapshot that the
    next :meth:`restore_pending` (the start of the next step) loads back: Lightning steps the schedulers in
    between, after the optimizer step it does not know was discarded.
    """

    def __init__(self, parts: Callable[[], TrainingState]) -> None:
        self._parts = parts
        self._pending: list[Any] | None = None
        self._round: list[Any] | None = None

    def _snapshot(self) -> list[Any]:
        _, optimizers, schedulers = self._parts()
        return [
            [cfg.scheduler.state_dict() for cfg in schedulers],
            [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers],
        ]

    def discard_step(self) -> None:
        """The optimizer step that just ended was discarded (every-step): keep the schedulers as they are
        now."""
        self._pending = self._snapshot()

    def mark_round_start(self) -> None:
        """The first inner step of a semi-synchronous round begins: the point a discarded outer sync rolls
        back to."""
        self._round = self._snapshot()

    def discard_round(self) -> None:
        """The outer sync that just ended was discarded: its round's inner steps are rolled back, so are the
        schedulers."""
        self._pending = self._round

    def restore_pending(self) -> None:
        """Load the armed snapshot, if any (call at the start of a step)."""
        if self._pending is None:
            return
        snapshot, self._pending = self._pending, None
        _, optimizers, schedulers = self._parts()
        for cfg, state in zip(schedulers, snapshot[0]):
            cfg.scheduler.load_state_dict(state)
        for opt, groups in zip(optimizers, snapshot[1]):
            for group, saved in zip(opt.param_groups, groups):
                group.update(saved)

    def restep_after_heal(self) -> None:
        """After healing inside an outer sync: the peer's schedulers were captured inside its optimizer step,
        before Lightning stepped them, so step the per-step ones once."""
        for cfg in self._parts().lr_scheduler_configs:
            if cfg.interval == "step":
                cfg.scheduler.step()


def resume_from_handed(trainer: Any, events_file: str | None,
                       storage_options: Mapping[str, Any] | None = None) -> str | None:
    """A restarted group with checkpoints handed by the launcher
    (:func:`~fsdp_strategies.ft.protocol.resume_file`) restores the newest that verifies, unless the run was
    given its own ``ckpt_path``; returns its path. A live peer ahead of it heals it further at the first
    quorum; without one the group goes on from the checkpoint instead of step 0. Called at the end of the
    strategy's ``setup`` (model and optimizers exist), on every rank. A handed URL (object storage) is read
    with ``storage_options`` (the strategy's)."""
    if events_file is None or trainer.ckpt_path is not None or trainer.state.fn != "fit":
        return None
    handed = resume_file(events_file)
    if not handed.exists():
        return None
    for path in handed.read_text().split():
        if verify_checkpoint(path, storage_options).ok:
            seam.restore_checkpoint(trainer, path)
            rank_zero_info(
                f"ft_hsdp: this restarted replica group resumes from {path} (a live peer ahead heals it)"
            )
            return path
    return None
