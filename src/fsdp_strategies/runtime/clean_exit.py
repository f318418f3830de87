"""A clean interpreter exit after collectives: no ``terminate called without an active exception``.

The abort (SIGABRT, status 134, on one rank, intermittently, after a successful run) comes from
gloo's worker threads. torch's ``ProcessGroupGloo`` runs each collective on a C++ worker thread
(``pt_gloo_runloop``) that keeps a reference to the collective's tensors until *after* the
collective has completed and the caller has moved on. Dropping that reference releases the
tensors' Python objects, so the worker thread must take the GIL -- which the main thread holds
while it runs Python, typically all the way to the end of the script. If the interpreter has
started finalizing by the time the worker gets the GIL, CPython ends the worker with
``pthread_exit``; the forced unwind passes a ``noexcept`` destructor (pybind11's
``gil_scoped_acquire``) and ``std::terminate`` aborts the process. ``destroy_process_group()``
does not help: it does not join the worker threads (they live until the last reference to the
group -- held by the model's DeviceMesh/FSDP state -- is gone, usually during finalization).
Reproduced with 200 synchronous gloo all-reduces followed by the end of the script: 7 of 10
two-rank runs aborted (torch 2.13, CPU); the core dump shows the worker in ``take_gil`` under
``~AsyncWork`` -> ``TensorImpl::decref_pyobject``. torch issue #190489 describes the same decref.

The fix, at the point where it arises -- the end of the interpreter's life, before finalization:
an ``atexit`` handler (registered by every strategy of this package, and usable by any script)
releases the GIL in short sleeps until every gloo worker thread of the process is parked: asleep
and not scheduled at all during an interval in which the GIL was free (a worker waiting for the
GIL would have taken it and run). On Linux this is read from ``/proc/self/task``; elsewhere a
fixed settle time is used. The wait is bounded (``timeout_s``).
"""

from __future__ import annotations

import atexit
import os
import sys
import time

__all__ = ["PREEMPT_EXIT_CODE", "quiesce_collective_threads", "register_clean_exit"]

#: Exit status of every rank (and launcher) stopped by SIGTERM, checkpoint written or not: ``EX_TEMPFAIL``
#: from ``sysexits.h``, "temporary failure, try again later" -- the job is not finished; requeue it.
PREEMPT_EXIT_CODE = 75

#: thread names of torch's gloo collective workers (``ProcessGroupGloo::runLoop``)
_WORKER_NAMES = frozenset({"pt_gloo_runloop"})
_TASKS = "/proc/self/task"
_registered = False


def _worker_states() -> dict[str, tuple[str, int]] | None:
    """``{tid: (state, times scheduled)}`` of this process's gloo worker threads; None without ``/proc``."""
    if not os.path.isdir(_TASKS):
        return None
    out: dict[str, tuple[str, int]] = {}
    for tid in os.listdir(_TASKS):
        try:
            with open(f"{_TASKS}/{tid}/comm") as fh:
                if fh.read().strip() not in _WORKER_NAMES:
                    continue
            with open(f"{_TASKS}/{tid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
            with open(f"{_TASKS}/{tid}/schedstat") as fh:
                slices = int(fh.read().split()[2])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile (or no schedstat: treated as not parked below)
        out[tid] = (state, slices)
    return out


def quiesce_collective_threads(timeout_s: float = 10.0, step_s: float = 0.005) -> bool:
    """Give the GIL to gloo's worker threads until all are parked; True when they are (or none exist).

    Parked = sleeping in two consecutive samples and not scheduled once between them, while this
    thread slept (GIL free). Call it after the last collective, before the interpreter finalizes.
    """
    deadline = time.monotonic() + timeout_s
    before = _worker_states()
    if before is None:  # no /proc: a fixed settle time (the GIL is free while sleeping)
        time.sleep(min(0.2, timeout_s))
        return True
    if not before:
        return True
    calm = 0
    while time.monotonic() < deadline:
        time.sleep(step_s)
        now = _worker_states() or {}
        parked = all(state == "S" and tid in before and before[tid][1] == slices
                     for tid, (state, slices) in now.items())
        calm = calm + 1 if parked else 0
        if calm >= 2:
            return True
        before = now
    print(f"fsdp_strategies: gloo worker threads still busy {timeout_s:.0f}s after the end of the program; "
          "exiting anyway.", file=sys.stderr)
    return False


def register_clean_exit() -> None:
    """Run :func:`quiesce_collective_threads` at interpreter exit (once per process)."""
    global _registered
    if not _registered:
        atexit.register(quiesce_collective_threads)
        _registered = True
