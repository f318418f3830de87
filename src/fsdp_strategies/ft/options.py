"""The options of ``ft_hsdp`` beyond ``fsdp2``'s: where the replica group is, and the checks, before any
process group.

``FTHSDPStrategy.__init__`` declares them (its signature and docstring are the documentation); this module

* :func:`resolve_placement` -- fills what was not given from the environment the launcher sets
  (:class:`fsdp_strategies.ft.protocol.FTEnvironment`: lighthouse address, replica group id, number of
  groups, events file with ``{replica_group_id}`` substituted) and checks that the result names a group;
* :func:`check_ft_options` -- the remaining values (quorum size, transport, the data policy and the sync modes
  of :mod:`~fsdp_strategies.ft.outer_sync` / :mod:`~fsdp_strategies.ft.straggler_switch`) and the timeouts:
  those not given are derived and the set is checked as a whole (:func:`resolve_timeouts`, the rule and the
  checks in :mod:`~fsdp_strategies.ft.timeouts`);
* :func:`check_group_size` -- ``shard_degree`` against the job's ranks (once Lightning knows them).

Every error names the option, its value and a "Fix:". The lighthouse itself is contacted later, in
``validate_options`` (:func:`fsdp_strategies.ft.manager.check_lighthouse`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fsdp_strategies._options import OptionError, check_choice, check_int, check_number
from fsdp_strategies.ft.manager import HOW_TO_START, lighthouse_host_port
from fsdp_strategies.ft.outer_sync import validate_sync_options
from fsdp_strategies.ft.protocol import LIGHTHOUSE_ENV, NUM_GROUPS_ENV, REPLICA_GROUP_ENV, FTEnvironment
from fsdp_strategies.ft.straggler_switch import validate_straggler_sync
from fsdp_strategies.ft.timeouts import LighthouseTimeouts, Timeouts, check_timeouts, derive_timeouts

__all__ = ["DataOnFailure", "GroupPlacement", "Transport", "check_ft_options", "check_group_size",
           "resolve_placement", "resolve_timeouts"]

#: how a healing group fetches the live state
Transport = Literal["pg", "http"]
#: what happens to a down group's data
DataOnFailure = Literal["skip", "redistribute"]


@dataclass(frozen=True)
class GroupPlacement:
    """Which replica group this job is, of how many, and where it reports."""

    lighthouse_addr: str
    replica_group_id: int
    num_replica_groups: int
    #: this group's events file (``None``: none is written)
    events_file: str | None


def resolve_placement(lighthouse_addr: str | None, replica_group_id: int | None,
                      num_replica_groups: int | None, events_file: str | None) -> GroupPlacement:
    """The given values, else the launcher's environment; ``ValueError`` with a fix when a group is not
    named."""
    env = FTEnvironment.from_env()
    lighthouse_addr = lighthouse_addr or env.lighthouse_addr
    if lighthouse_addr is None:
        raise OptionError(
            f"ft_hsdp needs a torchft lighthouse: lighthouse_addr is not set and {LIGHTHOUSE_ENV} is empty. "
            "Fix: set strategy.init_args.lighthouse_addr or "
            f"{LIGHTHOUSE_ENV}=http://<host>:<port>. {HOW_TO_START}"
        )
    lighthouse_host_port(lighthouse_addr)
    if replica_group_id is None:
        replica_group_id = env.replica_group_id
    if num_replica_groups is None:
        num_replica_groups = env.num_replica_groups
    if replica_group_id is None:
        raise OptionError(
            f"ft_hsdp: replica_group_id is missing. Fix: set strategy.init_args.replica_group_id or "
            f"{REPLICA_GROUP_ENV}=<0..num_replica_groups-1> for "
            "each replica group (fsdp-strategies-ft sets it)."
        )
    fix_groups = (f"set strategy.init_args.num_replica_groups or {NUM_GROUPS_ENV} to the number of replica "
                  "groups (>= 1).")
    if num_replica_groups is None:
        raise OptionError(f"ft_hsdp: num_replica_groups=None is invalid. Fix: {fix_groups}")
    check_int("num_replica_groups", num_replica_groups, 1, fix=fix_groups, prefix="ft_hsdp: ")
    if isinstance(replica_group_id, bool) or not 0 <= replica_group_id < num_replica_groups:
        raise OptionError(
            f"ft_hsdp: replica_group_id={replica_group_id!r} is out of range for num_replica_groups="
            f"{num_replica_groups}. Fix: use an id in [0, {num_replica_groups - 1}]."
        )
    events_file = events_file or env.events_file
    if events_file:
        events_file = events_file.replace("{replica_group_id}", str(int(replica_group_id)))
    return GroupPlacement(
        lighthouse_addr, int(replica_group_id), int(num_replica_groups), events_file or None
    )


def check_ft_options(*, num_replica_groups: int, min_replica_size: int, checkpoint_transport: str,
                     timeout_s: float | None, quorum_timeout_s: float | None, connect_timeout_s: float | None,
                     data_on_failure: str, sync: str, sync_every: int, outer_lr: float, outer_momentum: float,
                     num_fragments: int, straggler_sync: str) -> Timeouts:
    """Raise ``ValueError`` naming the option, its value and the fix; return the timeouts to use."""
    check_int("min_replica_size", min_replica_size, 1, num_replica_groups, prefix="ft_hsdp: ",
              fix=f"1 <= min_replica_size <= num_replica_groups ({num_replica_groups}).")
    check_choice("checkpoint_transport", checkpoint_transport, Transport)
    check_choice("data_on_failure", data_on_failure, DataOnFailure, prefix="ft_hsdp: ")
    validate_straggler_sync(straggler_sync, sync, sync_every, outer_lr, outer_momentum, num_fragments,
                            data_on_failure)
    if straggler_sync == "off":
        validate_sync_options(sync, sync_every, outer_lr, outer_momentum, num_fragments, data_on_failure)
    rounds = sync != "every_step" or straggler_sync != "off"
    return resolve_timeouts(num_replica_groups, sync_every if rounds else 1, timeout_s, quorum_timeout_s,
                            connect_timeout_s)


def resolve_timeouts(num_replica_groups: int, sync_every: int, timeout_s: float | None,
                     quorum_timeout_s: float | None, connect_timeout_s: float | None) -> Timeouts:
    """The given timeouts, the others derived by :func:`~fsdp_strategies.ft.timeouts.derive_timeouts` (with
    the lighthouse's values when the launcher passed them), checked together; an explicit set is returned as
    given."""
    for name, value in (("timeout_s", timeout_s), ("quorum_timeout_s", quorum_timeout_s),
                        ("connect_timeout_s", connect_timeout_s)):
        check_number(name, value, optional=True, prefix="ft_hsdp: ",
                     fix="a positive number of seconds, or leave it unset "
                         "to derive it (see fsdp_strategies.ft.timeouts).")
    lighthouse = LighthouseTimeouts.from_env()
    derived = derive_timeouts(num_replica_groups, sync_every=sync_every, lighthouse=lighthouse)
    timeout = derived.timeout_s if timeout_s is None else timeout_s
    quorum = max(derived.quorum_timeout_s, timeout) if quorum_timeout_s is None else quorum_timeout_s
    connect = min(derived.connect_timeout_s, quorum) if connect_timeout_s is None else connect_timeout_s
    timeouts = Timeouts(timeout, quorum, connect)
    check_timeouts(timeouts, lighthouse)
    return timeouts


def check_training(accumulation: str, data_on_failure: str, accumulate_grad_batches: int,
                   automatic_optimization: bool) -> None:
    """What the Trainer and the module ask of ``ft_hsdp`` (at set-up; raise naming the options and the fix):
    automatic optimization (the optimizer step must follow ``should_commit``); and ``redistribute`` weights
    each micro-batch's gradient by its share of the step's samples, which needs the micro-batch's own
    reduce-scatter (``accumulation="sharded"``)."""
    if not automatic_optimization:
        raise OptionError("ft_hsdp supports automatic optimization only (the optimizer step must follow the "
                          "commit vote, should_commit). Fix: remove `self.automatic_optimization = False`, "
                          "or use hsdp.")
    if accumulate_grad_batches > 1 and accumulation == "no_sync" and data_on_failure == "redistribute":
        raise OptionError(
            "ft_hsdp: accumulation='no_sync' with data_on_failure='redistribute' and "
            f"accumulate_grad_batches={accumulate_grad_batches} is not supported (a micro-batch's gradient "
            "is never reduced on its own, "
            "so it cannot be weighted by its share of the step's samples). Fix: accumulation='sharded' (the "
            "default), or data_on_failure='skip'.")


def check_group_size(shard_degree: int | str, num_nodes: int, devices: int) -> None:
    """Each replica group shards over all of its ranks: ``shard_degree`` is ``"auto"`` or
    ``num_nodes x devices``."""
    group_size = num_nodes * devices
    if shard_degree != "auto" and shard_degree != group_size:
        raise OptionError(
            f"ft_hsdp: shard_degree={shard_degree} does not match the replica group's size {group_size} "
            f"(num_nodes={num_nodes} x devices={devices}). Each replica group shards over all of "
            f"its ranks. Fix: set shard_degree to {group_size} or 'auto', or run each group with "
            f"{shard_degree} devices."
        )
