"""Fault tolerance in one place: the group/launcher contract, the strategy, the step-aligned data, the
launcher.

* :mod:`~fsdp_strategies.ft.protocol` -- environment variables, exit codes and the events file
  (one class writes and reads it), shared by the strategy and the launcher.
* :mod:`~fsdp_strategies.ft.strategy` -- ``ft_hsdp`` (:class:`FTHSDPStrategy`): HSDP whose replication
  runs across replica groups through torchft. The Lightning class keeps the options, the hooks and the
  step protocol, and composes the modules beside it:
  :mod:`~fsdp_strategies.ft.options` (defaults from the launcher's environment, option checks),
  :mod:`~fsdp_strategies.ft.manager` (lighthouse check, the torchft ``Manager``, cross-group bytes counted),
  :mod:`~fsdp_strategies.ft.heal_state` (what a recovering group fetches; LR schedulers after a heal),
  :mod:`~fsdp_strategies.ft.semi_sync` (the rounds of ``sync``/``straggler_sync`` over
  :mod:`~fsdp_strategies.ft.outer_sync` and :mod:`~fsdp_strategies.ft.straggler_switch`),
  :mod:`~fsdp_strategies.ft.redistribute` (a dead group's batches),
  :mod:`~fsdp_strategies.ft.nonfinite` (a group with a non-finite loss leaves the step's average) and
  :mod:`~fsdp_strategies.ft.accounting` (``ft_stats``, ``ft/*`` metrics, events, data trained and missed).
* :mod:`~fsdp_strategies.ft.data` -- the data position that follows the committed step.
* :mod:`~fsdp_strategies.ft.leave` -- a group leaving the quorum on purpose, or exiting with the code that
  tells the launcher not to restart it.
* :mod:`~fsdp_strategies.ft.launch` -- the supervisor's side, never imported by a training process:
  ``fsdp-strategies-ft`` (a lighthouse plus N replica groups on one machine, restarted on failure, with fault
  injection), its options, a group's start and the reading of its exit, a group's process tree, the
  forkserver, and the hand-over of checkpoints to a group restarted with no live peer ahead.
"""

from fsdp_strategies.ft.protocol import (
    LEAVE_EXIT_CODE,
    PREEMPT_EXIT_CODE,
    UNFIXABLE_EXIT_CODE,
    EventLog,
    FTEnvironment,
)
from fsdp_strategies.ft.strategy import FTHSDPStrategy, LighthouseUnreachableError

__all__ = ["LEAVE_EXIT_CODE", "PREEMPT_EXIT_CODE", "UNFIXABLE_EXIT_CODE", "EventLog", "FTEnvironment",
           "FTHSDPStrategy", "LighthouseUnreachableError"]
