"""The Lightning hooks every strategy of the package overrides the same way, delegating to the parts it holds.

A strategy holds three parts, as Lightning's strategies hold a ``CheckpointIO`` or a precision plugin: one
:class:`~fsdp_strategies._distributed.AgreementGroup` (the training-thread "did any rank ...?" group), a
:class:`~fsdp_strategies.runtime.preemption.PreemptionGuard` and an
:class:`~fsdp_strategies.runtime.async_checkpointing.AsyncCheckpointing`. It creates them in ``__init__``
(:meth:`LifecycleHooks._init_parts`) and hands the agreement group to both, and the guard to the async part
(which asks it whether a preemption save is under way and whether this step has an agreement point). The
hooks below only call into the parts, in the order the parts need: they are written once here instead of in
``fsdp2`` and ``ddp_hooks`` each. Nothing here reads another module's attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from fsdp_strategies._distributed import AgreementGroup
from fsdp_strategies.checkpoint.async_writer import AsyncCheckpointer
from fsdp_strategies.runtime.async_checkpointing import AsyncCheckpointing
from fsdp_strategies.runtime.preemption import PreemptionGuard

if TYPE_CHECKING:
    import torch

__all__ = ["LifecycleHooks"]


class LifecycleHooks:
    """Strategy mixin (listed before the Lightning base class): the hooks that delegate to the held parts.

    The strategy calls :meth:`_init_parts` from ``__init__`` (after its Lightning base's ``__init__``), asks
    ``self._async.use_background()`` at the start of a save and writes through :attr:`async_checkpointer`.
    """

    _preemption: PreemptionGuard
    _async: AsyncCheckpointing

    def _init_parts(self, *, checkpoint_on_preempt: bool, preempt_grace_s: float, async_checkpoint: Any,
                    full_file: bool, name: str, timeout: timedelta | None,
                    check_due: Callable[[], bool] | None = None) -> None:
        """Create the agreement group, the preemption guard and the async checkpointing (options checked)."""
        agreement = AgreementGroup(timeout)
        self._preemption = PreemptionGuard(self,  # type: ignore[arg-type]  # a mixin of a ParallelStrategy
                                           checkpoint_on_preempt, preempt_grace_s, agreement=agreement,
                                           check_due=check_due)
        self._async = AsyncCheckpointing(async_checkpoint, full_file=full_file, name=name, timeout=timeout,
                                         agreement=agreement, preemption=self._preemption)

    # ------------------------------------------------------------------ the options, as the user set them
    @property
    def checkpoint_on_preempt(self) -> bool:
        return self._preemption.checkpoint_on_preempt

    @property
    def preempt_grace_s(self) -> float:
        return self._preemption.preempt_grace_s

    @property
    def async_checkpoint(self) -> str:
        return self._async.mode

    @property
    def async_checkpointer(self) -> AsyncCheckpointer:
        """The background writer of this strategy (created on first use)."""
        return self._async.writer

    # ------------------------------------------------------------------ Lightning's hooks
    def connect(self, model: Any) -> None:
        self._async.check_io(self.checkpoint_io)  # type: ignore[attr-defined]
        super().connect(model)  # type: ignore[misc]
        # the start of every fit/validate/test/predict on every rank, before any process group exists
        self._preemption.arm()

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._preemption.install_if_armed()
        super().barrier(*args, **kwargs)  # type: ignore[misc]

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        self._preemption.on_train_start()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        self._async.poll_if_due()

    def on_train_end(self) -> None:
        self._preemption.restore_epoch_loop()
        self._async.finish()
        super().on_train_end()  # type: ignore[misc]

    def on_validation_start(self) -> None:
        super().on_validation_start()  # type: ignore[misc]
        self._preemption.install()

    def on_test_start(self) -> None:
        super().on_test_start()  # type: ignore[misc]
        self._preemption.install()

    def on_predict_start(self) -> None:
        super().on_predict_start()  # type: ignore[misc]
        self._preemption.install()

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        self._preemption.agree_before_batch()
        return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # type: ignore[misc]
        self._preemption.on_exception(exception)

    def teardown(self) -> None:
        self._preemption.restore_epoch_loop()
        self._async.close()
        super().teardown()  # type: ignore[misc]
        self._preemption.disarm()

    def remove_checkpoint(self, filepath: Any) -> None:
        remove_now = super().remove_checkpoint  # type: ignore[misc]
        self._async.remove_when_safe(filepath, lambda: remove_now(filepath))
