"""A replica group's own way out: leaving the quorum on purpose, or exiting with the code that tells the
launcher not to restart it.

These run inside a training process (:class:`~fsdp_strategies.ft.strategy.FTHSDPStrategy`); the launcher's
side -- reading why a group stopped -- is :mod:`fsdp_strategies.ft.launch.group_exit`. The exit codes are the
contract between the two (:mod:`fsdp_strategies.ft.protocol`).
"""

from __future__ import annotations

import errno
import sys
from typing import Any

from fsdp_strategies._options import is_option_error
from fsdp_strategies.checkpoint.disk_full import CheckpointDiskFullError
from fsdp_strategies.checkpoint.integrity import CheckpointIntegrityError
from fsdp_strategies.checkpoint.load_into_fsdp import CheckpointMismatchError
from fsdp_strategies.checkpoint.safe_load import UnsafeCheckpointError
from fsdp_strategies.ft.manager import exit_now
from fsdp_strategies.ft.protocol import LEAVE_EXIT_CODE, UNFIXABLE_EXIT_CODE, EventLog
from fsdp_strategies.hf.pretrained import PretrainedFolderError
from fsdp_strategies.parallel.blocks import BlockNotFoundError

__all__ = ["exit_if_unfixable", "leave_now", "restart_cannot_fix"]

#: errors a restart of the group meets again (option errors -- an unreachable ``memory_budget`` too -- are
#: recognised by ``is_option_error``)
_UNFIXABLE = (CheckpointDiskFullError, CheckpointIntegrityError, CheckpointMismatchError,
              UnsafeCheckpointError, PretrainedFolderError, BlockNotFoundError)
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

def restart_cannot_fix(error: BaseException) -> bool:
    """Whether a restarted group would meet ``error`` (or an error it was raised from) again: a bad option, a
    full disk (also a plain ``OSError`` with ``ENOSPC`` / ``EDQUOT``), a damaged or mismatched checkpoint or
    pretrained folder, an unreachable memory budget, a block class that is not in the model."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if is_option_error(current) or isinstance(current, _UNFIXABLE) or \
                (isinstance(current, OSError) and current.errno in _NO_SPACE):
            return True
        current = current.__cause__
    return False


def exit_if_unfixable(error: BaseException, manager: Any) -> None:
    """If a restart cannot fix ``error``: print it once, say so, and exit with ``UNFIXABLE_EXIT_CODE`` now
    (the manager stopped without waiting on peers), so that the launcher does not restart the group into
    it."""
    if not restart_cannot_fix(error):
        return
    sys.excepthook(type(error), error, error.__traceback__)  # as if uncaught (torch's hook prefixes the rank)
    print(f"ft_hsdp: a restart cannot fix this {type(error).__name__}: the replica group exits with "
          f"{UNFIXABLE_EXIT_CODE} and the launcher does not "
          "restart it. Fix the cause, then resume from the last "
          "checkpoint.", file=sys.stderr, flush=True)
    exit_now(manager, UNFIXABLE_EXIT_CODE)


def leave_now(manager: Any, events: EventLog | None, *, group: int, rank: int, step: int | None,
              reason: str) -> None:
    """This rank of replica group ``group`` leaves the quorum now: says why on stderr, writes the ``left``
    record (``events``: rank 0's log, else ``None``) and exits with ``LEAVE_EXIT_CODE`` without waiting on
    peers."""
    print(f"ft_hsdp: replica group {group} rank {rank} leaves the quorum"
          f"{'' if step is None else f' at committed step {step}'}: {reason}", file=sys.stderr, flush=True)
    if events is not None:
        events.write_left(group, reason, step)
    exit_now(manager, LEAVE_EXIT_CODE)
