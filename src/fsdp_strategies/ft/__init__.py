"""Fault tolerance in one place: the group/launcher contract, the strategy, the step-aligned data, the launcher.

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
* :mod:`~fsdp_strategies.ft.handover` -- a group restarted with no live peer ahead resumes from the newest
  checkpoint the groups recorded (the launcher and ``examples/slurm/ft_hsdp.sbatch``).
* :mod:`~fsdp_strategies.ft.launcher` -- ``fsdp-strategies-ft``: a lighthouse plus N replica groups
  on one machine, restarted on failure, with fault injection; its options are declared once in
  :mod:`~fsdp_strategies.ft.launch_options`, a group's start is :mod:`~fsdp_strategies.ft.group_start`,
  the reading of its exit (left, preempted, unfixable, failed) :mod:`~fsdp_strategies.ft.group_exit`, and
  killing a whole group :mod:`~fsdp_strategies.ft.process_tree`; :mod:`~fsdp_strategies.ft.forkserver` forks
  groups with their imports done.
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
