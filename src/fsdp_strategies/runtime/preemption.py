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
  all-reduce on the strategy's gloo agreement group (:mod:`fsdp_strategies._distributed`, shared
  with the async checkpoint writer's per-step check) tells every rank whether any rank got the signal, so
  every rank stops at the same step and a rank that got no signal learns it there. Validation and test
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
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies._distributed import AgreementGroup, rank_and_world
from fsdp_strategies._options import check_bool, check_number
from fsdp_strategies.checkpoint.location import local_checkpoint_path, url_or_none
from fsdp_strategies.runtime.clean_exit import PREEMPT_EXIT_CODE, register_clean_exit

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ParallelStrategy

__all__ = [
    "DEFAULT_PREEMPT_GRACE_S",
    "PREEMPT_CHECKPOINT_NAME",
    "PREEMPT_EXIT_CODE",
    "Preempted",
    "PreemptionGuard",
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
    check_number(
        "preempt_grace_s",
        preempt_grace_s,
        fix="a positive number of seconds, at most the time your "
        "scheduler leaves between SIGTERM and SIGKILL (e.g. 25 for SLURM's default KillWait of 30 s).",
    )


class Preempted(SIGTERMException):
    """Raised on every rank at the same point once any rank got SIGTERM; exits with
    :data:`PREEMPT_EXIT_CODE`."""

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
    return isinstance(getattr(handler, "__self__", None), PreemptionGuard)


class PreemptionGuard:
    """SIGTERM agreement, preemption checkpoint, requeue exit status: a part one strategy instance holds.

    The strategy creates it in ``__init__`` (the options are checked there, before any process group) and
    calls it from its Lightning hooks: :meth:`arm` after ``connect``; :meth:`install` from ``barrier`` and the
    ``on_*_start`` hooks; :meth:`on_train_start`; :meth:`agree_before_batch` from ``batch_to_device``;
    :meth:`on_exception`; :meth:`restore_epoch_loop` from ``on_train_end`` and ``teardown``; :meth:`disarm`
    after ``teardown``. What it uses of the strategy is Lightning's public surface: ``num_nodes``,
    ``num_processes``, ``lightning_module``, ``broadcast`` (and its launcher, through the seam).

    Args:
        strategy: the strategy that holds it.
        checkpoint_on_preempt, preempt_grace_s: the strategy's options of these names.
        agreement: the strategy's training-thread agreement group (shared with its async checkpointing).
        check_due: whether the per-step agreement runs before this training step; it must answer the same
            on every rank (local SGD: only where the ranks meet anyway). ``None``: every step.
        checkpoint_name: the file name of the preemption checkpoint.
    """

    def __init__(self, strategy: ParallelStrategy, checkpoint_on_preempt: bool, preempt_grace_s: float, *,
                 agreement: AgreementGroup, check_due: Callable[[], bool] | None = None,
                 checkpoint_name: str = PREEMPT_CHECKPOINT_NAME) -> None:
        validate_preempt_options(checkpoint_on_preempt, preempt_grace_s)
        self.checkpoint_on_preempt = checkpoint_on_preempt
        self.preempt_grace_s = float(preempt_grace_s)
        self.checkpoint_name = checkpoint_name
        self._strategy = strategy
        self._agreement = agreement
        self._check_due = check_due
        self._armed = False
        self._loop: Any = None
        self._decided: Preempted | None = None
        self._saving = False

    # ------------------------------------------------------------------ what the other parts ask
    def is_saving(self) -> bool:
        """Whether the preemption checkpoint is being written now (a save must then be synchronous)."""
        return self._saving

    def check_due(self) -> bool:
        """Whether the per-step agreement runs before this training step (the same answer on every rank)."""
        return self._check_due() if self._check_due is not None else True

    # ------------------------------------------------------------------ the signal handler
    def _multiprocess(self) -> bool:
        """More than one rank. A single process keeps Lightning's own handler: it broadcasts nothing there."""
        try:
            nodes = getattr(self._strategy, "num_nodes", 1) or 1
            return int(nodes) * int(getattr(self._strategy, "num_processes", 1) or 1) > 1
        except TypeError:  # devices not set yet
            return False

    def arm(self) -> None:
        """Start handling SIGTERM for a run (called when a stage starts)."""
        if not self._armed:
            self._armed = True
            self._decided = None
            self.install(capture_previous=True)
        register_clean_exit()

    def disarm(self) -> None:
        """The run is over: a later SIGTERM goes to the handler ours replaced."""
        self._armed = False

    def install(self, capture_previous: bool = False) -> None:
        """Make this guard's handler the active SIGTERM handler (idempotent; main thread only).

        ``capture_previous``: remember the handler being replaced (the user's, or the default), to call
        it from ours and to fall back to after the run. Only when arming: later calls replace Lightning's
        handler, which must never run (its broadcast is what hangs).
        """
        if threading.current_thread() is not threading.main_thread() or not self._multiprocess():
            return
        current = signal.getsignal(signal.SIGTERM)
        if current == self._on_sigterm:
            return
        if capture_previous and not _is_ours(current):
            _STATE.previous = signal.SIG_DFL if current is None else current
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def install_if_armed(self) -> None:
        """At a barrier: the first of a stage follows Lightning's own handler registration; replace it."""
        if self._armed:
            self.install()

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        first = _STATE.requested_at is None
        if first:
            _STATE.requested_at = time.monotonic()
            self._forward_to_launched_ranks(signum)
        if not self._armed:
            self._delegate_sigterm(signum, frame)
            return
        if first:
            self._start_watchdog()
        previous = _STATE.previous
        if callable(previous) and not _is_ours(previous):
            previous(signum, frame)
        trainer = self._trainer()
        if trainer is not None and trainer.state.fn == TrainerFn.PREDICTING and self._decided is None:
            # prediction may give ranks different batch counts: no agreement point, this rank stops now
            self._decided = Preempted("SIGTERM during predict: this rank stops now.")
            raise self._decided

    def _forward_to_launched_ranks(self, signum: int) -> None:
        """A SIGTERM to Lightning's launcher process (rank 0) reaches the ranks it started."""
        try:
            seam.forward_signal_to_launched_ranks(self._strategy, signum)
        except Exception as err:  # a rank already gone: nothing to forward to
            print(
                f"fsdp_strategies: could not forward SIGTERM to the launched ranks ({err})", file=sys.stderr
            )

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
            print(f"fsdp_strategies: rank {rank} still running "
                  f"{grace:g}s after SIGTERM (preempt_grace_s); exiting "
                  f"with status {PREEMPT_EXIT_CODE}; the last "
                  "complete checkpoint stays the resume point. Stacks:",
                  file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            os._exit(PREEMPT_EXIT_CODE)

        _STATE.watchdog = threading.Thread(target=watch, name="fsdp_strategies-preempt-watchdog", daemon=True)
        _STATE.watchdog.start()

    def _trainer(self) -> pl.Trainer | None:
        module = getattr(self._strategy, "lightning_module", None)
        try:
            return module.trainer if module is not None else None
        except RuntimeError:  # not attached to a Trainer
            return None

    # ------------------------------------------------------------------ agreement
    def _agree(self, where: str) -> None:
        """The agreement point: raise :class:`Preempted` on every rank if any rank got SIGTERM."""
        self.install()
        (signalled,) = self._agreement.agree_sum(int(_STATE.requested_at is not None))
        if not signalled:
            return
        if _STATE.requested_at is None:  # this rank got no signal: the same bound on its stop
            _STATE.requested_at = time.monotonic()
            self._start_watchdog()
        world = rank_and_world()[1]
        self._decided = Preempted(f"SIGTERM reached {signalled} of {world} ranks; every rank stops {where}.")
        rank_zero_info(f"fsdp_strategies: {self._decided}")
        raise self._decided

    def _step_check(self) -> None:
        """Stands in for Lightning's per-step SIGTERM broadcast (see
        :func:`~fsdp_strategies._lightning_seam.replace_sigterm_broadcast`)."""
        if self._armed and self.check_due():
            trainer = self._trainer()
            self._agree(f"after step {trainer.global_step if trainer is not None else '?'}")

    # ------------------------------------------------------------------ called from the strategy's hooks
    def on_train_start(self) -> None:
        """After Lightning's ``on_train_start``: our handler; our check for the loop's broadcast."""
        self.install()
        trainer = self._trainer()
        if trainer is not None:
            self._loop = seam.replace_sigterm_broadcast(trainer, self._step_check)

    def agree_before_batch(self) -> None:
        """``batch_to_device``: the agreement point of validation, test and sanity-check batches."""
        trainer = self._trainer()
        if self._armed and trainer is not None and trainer.state.stage in _STOP_STAGES:
            self._agree(f"before the next {trainer.state.stage.value} batch")

    def on_exception(self, exception: BaseException) -> None:
        """After Lightning's ``on_exception``: the requeue status, and the checkpoint when asked for."""
        trainer = self._trainer()
        ours = isinstance(exception, Preempted)
        lightnings = (
            isinstance(exception, SIGTERMException) and trainer is not None and trainer.received_sigterm
        )
        if not (ours or lightnings):
            return
        exception.code = PREEMPT_EXIT_CODE  # type: ignore[union-attr]  # Lightning's own, on a single process
        if not self.checkpoint_on_preempt or trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.sanity_checking:
            rank_zero_info(
                "fsdp_strategies: preempted during the sanity check; the checkpoint on disk is current."
            )
            return
        self._write_checkpoint(trainer)

    def restore_epoch_loop(self) -> None:
        seam.restore_sigterm_broadcast(self._loop)  # back to Lightning's own method
        self._loop = None

    # ------------------------------------------------------------------ the checkpoint
    def checkpoint_path(self, trainer: pl.Trainer) -> str:
        """``<ModelCheckpoint dirpath>/<checkpoint_name>``, else ``<default_root_dir>/<checkpoint_name>``
        (a URL stays a URL: the strategy's save decides whether it writes object storage)."""
        folder = str(getattr(trainer.checkpoint_callback, "dirpath", None) or trainer.default_root_dir)
        if url_or_none(folder) is not None:
            return f"{folder.rstrip('/')}/{self.checkpoint_name}"
        return str(local_checkpoint_path(folder, "the preemption checkpoint folder") / self.checkpoint_name)

    def _write_checkpoint(self, trainer: pl.Trainer) -> None:
        """All ranks together: agree that there is time left, then the strategy's atomic save."""
        started = _STATE.requested_at if _STATE.requested_at is not None else time.monotonic()
        (late,) = self._agreement.agree_any(time.monotonic() - started >= self.preempt_grace_s)
        if late:
            rank_zero_warn(
                f"fsdp_strategies: preempt_grace_s={self.preempt_grace_s:g}s already passed on some rank; "
                "no preemption checkpoint (the last complete checkpoint stays the resume point)."
            )
            return
        path = self._strategy.broadcast(self.checkpoint_path(trainer))
        t0 = time.monotonic()
        self._saving = True
        try:
            trainer.save_checkpoint(path)
        except Exception as err:  # the stop goes on (status 75); the atomic save left the previous checkpoint
            rank_zero_warn(
                f"fsdp_strategies: the preemption checkpoint failed ({type(err).__name__}: {err}); the "
                "last complete checkpoint stays the resume point."
            )
            return
        finally:
            self._saving = False
        rank_zero_info(
            f"fsdp_strategies: preemption checkpoint of step {trainer.global_step} written to {path} in "
            f"{time.monotonic() - t0:.1f}s; exiting with status {PREEMPT_EXIT_CODE} (requeue). Resume with "
            f"ckpt_path={path!r} or ckpt_path='last'."
        )
