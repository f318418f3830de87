"""Why a replica group stopped -- finished, left the quorum, preempted or failed -- and its last error.

The launcher reacts to each kind differently
(:meth:`~fsdp_strategies.ft.launch.launcher.FTLauncher.handle_exits`):

* ``finished`` (status 0): its training ended; it is not started again.
* ``left`` (:data:`~fsdp_strategies.ft.protocol.LEAVE_EXIT_CODE`): it left the quorum on purpose, e.g.
  evicted as a straggler by ``StragglerDetector(action="evict")``. It is restarted at once and heals from a
  live peer; the restart counts against ``--max-restarts``, so a group that keeps being evicted ends.
* ``preempted`` (:data:`~fsdp_strategies.ft.protocol.PREEMPT_EXIT_CODE`): it was told to stop (SIGTERM
  reached its ranks, not the launcher) and wrote its preemption checkpoint. It is *not* restarted -- a
  restart would undo the stop -- and the other groups go on without it. If no group finishes training,
  the launcher exits with ``PREEMPT_EXIT_CODE`` itself, so the scheduler requeues the job.
* ``unfixable`` (:data:`~fsdp_strategies.ft.protocol.UNFIXABLE_EXIT_CODE`): an error that a restart would meet
  again -- a bad option, a full disk, a damaged or mismatched input file
  (:func:`~fsdp_strategies.ft.leave.restart_cannot_fix`). The group exits with it from Lightning's
  ``on_exception`` (:func:`~fsdp_strategies.ft.leave.exit_if_unfixable`) and is not restarted; the launcher
  gives up on it at once with its last error instead of retrying ``--max-restarts`` times.
* ``failed`` (anything else: an exception, a rank killed by a fault): restarted until ``--max-restarts``.

The status the launcher sees is the group's top process's. ``torchrun`` reports any failure of its workers as
its own status 1, so there the workers' status is read from the failure summary torchrun prints into the
group's log (``Root Cause (first observed failure)`` ... ``exitcode : 75``), and a leave is also recognised
from the ``left`` record rank 0 writes to the events file before leaving
(:meth:`~fsdp_strategies.ft.protocol.EventLog.left_since`). Both readers look only at the group's latest
start in its log (each start begins with a ``===== start #N`` line the launcher writes).
"""

from __future__ import annotations

import enum
import re
from pathlib import Path

from fsdp_strategies.ft.protocol import LEAVE_EXIT_CODE, PREEMPT_EXIT_CODE, UNFIXABLE_EXIT_CODE

__all__ = ["GroupExit", "classify_exit", "last_error_line", "torchrun_worker_exit_code"]

#: the tail of a group's log that is read (a long run's log may be large; its latest start is at the end)
LOG_TAIL_BYTES = 256 * 1024

_ERROR_LINE = re.compile(
    r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure)\b|error:|Error:|FATAL|Fatal)"
)
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


class GroupExit(enum.Enum):
    """What a replica group's exit means to the launcher (the module docstring gives each reaction)."""

    FINISHED = "finished"
    LEFT = "left"
    PREEMPTED = "preempted"
    UNFIXABLE = "unfixable"
    FAILED = "failed"


def classify_exit(code: int, log: Path, *, left: bool) -> GroupExit:
    """The kind of exit of a group whose top process exited ``code``; ``left``: whether its current
    incarnation wrote a ``left`` record; ``log``: its log (for torchrun's summary)."""
    if code == 0:
        return GroupExit.FINISHED
    worker_code = torchrun_worker_exit_code(log) if code == 1 else None
    codes = {code} if worker_code is None else {code, worker_code}
    if left or LEAVE_EXIT_CODE in codes:
        return GroupExit.LEFT
    if PREEMPT_EXIT_CODE in codes:
        return GroupExit.PREEMPTED
    if UNFIXABLE_EXIT_CODE in codes:
        return GroupExit.UNFIXABLE
    return GroupExit.FAILED


def _latest_start(log: Path, max_bytes: int = LOG_TAIL_BYTES) -> list[str] | None:
    """The lines of the group's latest start in its log (without the ``===== start`` header); None: no log."""
    try:
        with log.open("rb") as fh:
            fh.seek(max(0, log.stat().st_size - max_bytes))
            text = fh.read().decode(errors="replace")
    except OSError:
        return None
    return text.split("\n===== start #")[-1].splitlines()[1:]


def torchrun_worker_exit_code(log: Path) -> int | None:
    """The status of the first failing rank in torchrun's failure summary of the latest start; None without
    one."""
    lines = _latest_start(log) or []
    for i, line in enumerate(lines):
        if line.startswith("Root Cause"):
            for later in lines[i + 1:]:
                found = _EXITCODE.match(later)
                if found:
                    return int(found.group(1))
    return None


def last_error_line(log: Path, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last error line of a group's latest start in its log (the worker's own exception before
    torchrun's summary), else its last non-empty line."""
    raw = _latest_start(log, max_bytes)
    if raw is None:
        return "(no log)"
    lines = [_RANK_PREFIX.sub("", line).strip() for line in raw]
    lines = [line for line in lines if line and not line.startswith("=====")]
    errors = [line for line in lines if _ERROR_LINE.match(line) and "ChildFailedError" not in line]
    return (errors or lines or ["(no output)"])[-1][:500]
