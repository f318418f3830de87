"""Preemption (SIGTERM): every rank stops at the same step, optionally after an atomic checkpoint.

Why Lightning's own SIGTERM handling is replaced: Lightning 2.6's handler broadcasts a flag *from
inside the signal handler*, i.e. at whatever point the main thread has reached -- in the middle of
FSDP2's all-gathers, for instance. A rank that receives SIGTERM (or receives it twice: from the
scheduler and again forwarded by Lightning's launcher) issues a broadcast its peers do not match
there, and the job hangs until the collective timeout. Reproduced with ``fsdp2`` on 2 CPU ranks:
rank 0 waits in FSDP2's ``all_gather_into_tensor`` while rank 1 waits in the handler's broadcast.

The mechanism here:

* The handler only records the signal (and forwards it once to the ranks a Lightning launcher
  started, which is how a SIGTERM to the launcher reaches every rank). It is installed when a
  fit/validate/test/predict starts (before the process group), put back over Lightning's own handler
  once Lightning has registered that one, and delegates to the previous handler once the strategy has
  torn down.
* Agreement: at one fixed point of every training step on every rank -- before the next batch,
  after the previous optimizer step; Lightning's per-step SIGTERM broadcast, replaced -- one
  all-reduce on the strategy's gloo agreement group (:mod:`fsdp_strategies.checkpoint.agreement`, shared
  with the async checkpoint writer's per-step check) tells every rank whether any rank got the signal, so every
  rank stops at the same step and a rank that got no signal learns it there. Validation and test
  batches have the same agreement point (Lightning's samplers give every rank the same number of
  evaluation batches); prediction (whose sampler may give ranks different batch counts) stops at
  once on the rank that got the signal.
* The stop raises :class:`Preempted` (a Lightning ``SIGTERMException``) on every rank. The
  strategy's ``on_exception`` then writes the checkpoint when ``checkpoint_on_preempt`` is set
  (through the strategy's own atomic save, all ranks together; the ranks first agree that there is
  time left), and the process exits with :data:`PREEMPT_EXIT_CODE`.
* A watchdog bounds the whole stop to ``preempt_grace_s`` after the first SIGTERM: if the process
  is still alive then (a save slower than the grace period, a peer that vanished mid-collective),
  it exits with the same status. An interrupted save leaves the previous checkpoint in place (the
  save is atomic), so the job always has a loadable checkpoint to be requeued from.

Limits: a rank blocked in a collective whose peer was SIGKILLed is ended by the collective
timeout, or -- once it got a SIGTERM too -- by the watchdog. With ``ddp_hooks`` under local SGD,
the agreement runs only where the ranks meet anyway (after a global averaging), so a SIGTERM
takes effect within one global averaging period.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies._distributed import rank_and_world
from fsdp_strategies._options import check_bool, check_number
from fsdp_strategies.checkpoint.agreement import AgreementMixin
from fsdp_strategies.checkpoint.location import local_checkpoint_path, url_or_none
from fsdp_strategies.runtime.clean_exit import PREEMPT_EXIT_CODE, register_clean_exit

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "DEFAULT_PREEMPT_GRACE_S",
    "PREEMPT_CHECKPOINT_NAME",
    "PREEMPT_EXIT_CODE",
    "Preempted",
    "PreemptionMixin",
    "validate_preempt_options",
]

#: File name of the preemption checkpoint. It starts with ``last`` so that ``ckpt_path="last"``
#: finds it in the ``ModelCheckpoint`` folder (Lightning picks the newest ``last*.ckpt`` there).
PREEMPT_CHECKPOINT_NAME = "last-preempt.ckpt"
#: Default time from the first SIGTERM to the hard exit: SLURM's ``KillWait``, Kubernetes'
#: ``terminationGracePeriodSeconds`` and torchrun's ``--shutdown-timeout`` all default to 30 s.
DEFAULT_PREEMPT_GRACE_S = 25.0

_STOP_STAGES = (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)


def validate_preempt_options(checkpoint_on_preempt: Any, preempt_grace_s: Any) -> None:
    """Reject bad option values at ``__init__`` time, before any process group exists."""
    check_bool("checkpoint_on_preempt", checkpoint_on_preempt)
    check_number("preempt_grace_s", preempt_grace_s, fix="a positive number of seconds, at most the time your "
                 "scheduler leaves between SIGTERM and SIGKILL (e.g. 25 for SLURM's default KillWait of 30 s).")


class Preempted(SIGTERMException):
    """Raised on every rank at the same point once any rank got SIGTERM; exits with :data:`PREEMPT_EXIT_CODE`."""

    def __init__(self, message: str) -> None:
        super().__init__(PREEMPT_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class _SignalState:
    """What this process knows about SIGTERM: when it first arrived, and the handler ours replaced."""

    requested_at: float | None = None
    previous: Any = signal.SIG_DFL
    watchdog: threading.Thread | None = None


_STATE = _SignalState()


def _is_ours(handler: Any) -> bool:
    return isinstance(getattr(handler, "__self__", None), PreemptionMixin)


class PreemptionMixin(AgreementMixin):
    """Strategy mixin: SIGTERM agreement, preemption checkpoint, requeue exit status.

    Protocol with the strategy class: it lists the mixin before its Lightning base, calls
    :meth:`_init_preemption` from ``__init__``, and its own overrides of the hooks below (``connect``,
    ``barrier``, ``on_*_start``, ``batch_to_device``, ``on_exception``, ``teardown``) call ``super()``. A
    strategy that must skip the per-step agreement on some steps (local SGD) overrides
    :meth:`_preempt_check_due` -- it must answer the same on every rank.
    """

    checkpoint_on_preempt: bool = False
    preempt_grace_s: float = DEFAULT_PREEMPT_GRACE_S
    _preempt_armed: bool = False
    _preempt_loop: Any = None
    _preempt_decided: Preempted | None = None
    _preempt_saving: bool = False

    def _init_preemption(self, checkpoint_on_preempt: bool, preempt_grace_s: float) -> None:
        validate_preempt_options(checkpoint_on_preempt, preempt_grace_s)
        self.checkpoint_on_preempt = checkpoint_on_preempt
        self.preempt_grace_s = float(preempt_grace_s)

    # ------------------------------------------------------------------ the signal handler
    def _preempt_multiprocess(self) -> bool:
        """More than one rank. A single process keeps Lightning's own handler: it broadcasts nothing there."""
        try:
            return int(getattr(self, "num_nodes", 1) or 1) * int(getattr(self, "num_processes", 1) or 1) > 1
        except TypeError:  # devices not set yet
            return False

    def _arm_preemption(self) -> None:
        """Start handling SIGTERM for a run (called when a stage starts)."""
        if not self._preempt_armed:
            self._preempt_armed = True
            self._preempt_decided = None
            self._install_sigterm_handler(capture_previous=True)
        register_clean_exit()

    def _install_sigterm_handler(self, capture_previous: bool = False) -> None:
        """Make this strategy's handler the active SIGTERM handler (idempotent; main thread only).

        ``capture_previous``: remember the handler being replaced (the user's, or the default), to call
        it from ours and to fall back to after the run. Only when arming: later calls replace Lightning's
        handler, which must never run (its broadcast is what hangs).
        """
        if threading.current_thread() is not threading.main_thread() or not self._preempt_multiprocess():
            return
        current = signal.getsignal(signal.SIGTERM)
        if current == self._on_sigterm:
            return
        if capture_previous and not _is_ours(current):
            _STATE.previous = signal.SIG_DFL if current is None else current
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        first = _STATE.requested_at is None
        if first:
            _STATE.requested_at = time.monotonic()
            self._forward_to_launched_ranks(signum)
        if not self._preempt_armed:
            self._delegate_sigterm(signum, frame)
            return
        if first:
            self._start_watchdog()
        previous = _STATE.previous
        if callable(previous) and not _is_ours(previous):
            previous(signum, frame)
        trainer = self._preempt_trainer()
        if trainer is not None and trainer.state.fn == TrainerFn.PREDICTING and self._preempt_decided is None:
            # prediction may give ranks different batch counts: no agreement point, this rank stops now
            self._preempt_decided = Preempted("SIGTERM during predict: this rank stops now.")
            raise self._preempt_decided

    def _forward_to_launched_ranks(self, signum: int) -> None:
        """A SIGTERM to Lightning's launcher process (rank 0) reaches the ranks it started."""
        try:
            seam.forward_signal_to_launched_ranks(self, signum)
        except Exception as err:  # a rank already gone: nothing to forward to
            print(f"fsdp_strategies: could not forward SIGTERM to the launched ranks ({err})", file=sys.stderr)

    @staticmethod
    def _delegate_sigterm(signum: int, frame: FrameType | None) -> None:
        """Outside a run: behave as the handler ours replaced (by default: terminate)."""
        previous = _STATE.previous
        if callable(previous) and not _is_ours(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _start_watchdog(self) -> None:
        """Bound the stop: exit with :data:`PREEMPT_EXIT_CODE` ``preempt_grace_s`` after the first SIGTERM."""
        if _STATE.watchdog is not None:
            return
        started = _STATE.requested_at or time.monotonic()
        grace = self.preempt_grace_s

        def watch() -> None:
            time.sleep(max(0.0, started + grace - time.monotonic()))
            rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "?"))
            print(f"fsdp_strategies: rank {rank} still running {grace:g}s after SIGTERM (preempt_grace_s); exiting "
                  f"with status {PREEMPT_EXIT_CODE}; the last complete checkpoint stays the resume point. Stacks:",
                  file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            os._exit(PREEMPT_EXIT_CODE)

        _STATE.watchdog = threading.Thread(target=watch, name="fsdp_strategies-preempt-watchdog", daemon=True)
        _STATE.watchdog.start()

    def _preempt_trainer(self) -> pl.Trainer | None:
        module = getattr(self, "lightning_module", None)
        try:
            return module.trainer if module is not None else None
        except RuntimeError:  # not attached to a Trainer
            return None

    # ------------------------------------------------------------------ agreement
    def _preempt_check_due(self) -> bool:
        """Whether the per-step agreement runs before this training step (every step by default)."""
        return True

    def _preempt_agreement(self, where: str) -> None:
        """The agreement point: raise :class:`Preempted` on every rank if any rank got SIGTERM."""
        self._install_sigterm_handler()
        (signalled,) = self.agreement.agree_sum(int(_STATE.requested_at is not None))
        if not signalled:
            return
        if _STATE.requested_at is None:  # this rank got no signal: the same bound on its stop
            _STATE.requested_at = time.monotonic()
            self._start_watchdog()
        world = rank_and_world()[1]
        self._preempt_decided = Preempted(f"SIGTERM reached {signalled} of {world} ranks; every rank stops {where}.")
        rank_zero_info(f"fsdp_strategies: {self._preempt_decided}")
        raise self._preempt_decided

    def _preempt_step_check(self) -> None:
        """Stands in for Lightning's per-step SIGTERM broadcast (see :func:`~fsdp_strategies._lightning_seam.replace_sigterm_broadcast`)."""
        if self._preempt_armed and self._preempt_check_due():
            trainer = self._preempt_trainer()
            self._preempt_agreement(f"after step {trainer.global_step if trainer is not None else '?'}")

    # ------------------------------------------------------------------ strategy hooks
    def connect(self, model: Any) -> None:
        super().connect(model)  # type: ignore[misc]
        # the start of every fit/validate/test/predict on every rank, before any process group exists
        self._arm_preemption()

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        # the first barrier of a stage follows Lightning's own handler registration: replace it at once
        if self._preempt_armed:
            self._install_sigterm_handler()
        super().barrier(*args, **kwargs)  # type: ignore[misc]

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        self._install_sigterm_handler()
        trainer = self._preempt_trainer()
        if trainer is not None:
            self._preempt_loop = seam.replace_sigterm_broadcast(trainer, self._preempt_step_check)

    def on_train_end(self) -> None:
        self._restore_epoch_loop()
        super().on_train_end()  # type: ignore[misc]

    def on_validation_start(self) -> None:
        super().on_validation_start()  # type: ignore[misc]
        self._install_sigterm_handler()

    def on_test_start(self) -> None:
        super().on_test_start()  # type: ignore[misc]
        self._install_sigterm_handler()

    def on_predict_start(self) -> None:
        super().on_predict_start()  # type: ignore[misc]
        self._install_sigterm_handler()

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        trainer = self._preempt_trainer()
        if self._preempt_armed and trainer is not None and trainer.state.stage in _STOP_STAGES:
            self._preempt_agreement(f"before the next {trainer.state.stage.value} batch")
        return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # type: ignore[misc]
        trainer = self._preempt_trainer()
        ours = isinstance(exception, Preempted)
        lightnings = isinstance(exception, SIGTERMException) and trainer is not None and trainer.received_sigterm
        if not (ours or lightnings):
            return
        exception.code = PREEMPT_EXIT_CODE  # type: ignore[union-attr]  # Lightning's own, on a single process
        if not self.checkpoint_on_preempt or trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.sanity_checking:
            rank_zero_info("fsdp_strategies: preempted during the sanity check; the checkpoint on disk is current.")
            return
        self._write_preempt_checkpoint(trainer)

    def teardown(self) -> None:
        self._restore_epoch_loop()
        super().teardown()  # type: ignore[misc]
        self._preempt_armed = False

    def _restore_epoch_loop(self) -> None:
        seam.restore_sigterm_broadcast(self._preempt_loop)  # back to Lightning's own method
        self._preempt_loop = None

    # ------------------------------------------------------------------ the checkpoint
    def _preempt_checkpoint_path(self, trainer: pl.Trainer) -> str:
        """``<ModelCheckpoint dirpath>/last-preempt.ckpt``, else ``<default_root_dir>/last-preempt.ckpt`` (a URL
        stays a URL: the strategy's save decides whether it writes object storage)."""
        folder = str(getattr(trainer.checkpoint_callback, "dirpath", None) or trainer.default_root_dir)
        if url_or_none(folder) is not None:
            return f"{folder.rstrip('/')}/{PREEMPT_CHECKPOINT_NAME}"
        return str(local_checkpoint_path(folder, "the preemption checkpoint folder") / PREEMPT_CHECKPOINT_NAME)

    def _write_preempt_checkpoint(self, trainer: pl.Trainer) -> None:
        """All ranks together: agree that there is time left, then the strategy's atomic save."""
        started = _STATE.requested_at if _STATE.requested_at is not None else time.monotonic()
        (late,) = self.agreement.agree_any(time.monotonic() - started >= self.preempt_grace_s)
        if late:
            rank_zero_warn(f"fsdp_strategies: preempt_grace_s={self.preempt_grace_s:g}s already passed on some rank; "
                           "no preemption checkpoint (the last complete checkpoint stays the resume point).")
            return
        path = self.broadcast(self._preempt_checkpoint_path(trainer))  # type: ignore[attr-defined]
        t0 = time.monotonic()
        self._preempt_saving = True
        try:
            trainer.save_checkpoint(path)
        except Exception as err:  # the stop goes on (status 75); the atomic save left the previous checkpoint
            rank_zero_warn(f"fsdp_strategies: the preemption checkpoint failed ({type(err).__name__}: {err}); the "
                           "last complete checkpoint stays the resume point.")
            return
        finally:
            self._preempt_saving = False
        rank_zero_info(f"fsdp_strategies: preemption checkpoint of step {trainer.global_step} written to {path} in "
                       f"{time.monotonic() - t0:.1f}s; exiting with status {PREEMPT_EXIT_CODE} (requeue). Resume with "
                       f"ckpt_path={path!r} or ckpt_path='last'.")
