"""CPU seconds by process role and thread name while a benchmark's jobs run (psutil, sampled).

On a machine with fewer cores than busy ranks every CPU-second a helper spends -- a launcher's polling
loop, a lighthouse, a communication thread, a torchrun agent -- is taken from the ranks' compute. A
:class:`CpuSampler` reads, every ``interval_s``, the CPU time of every thread of this process and of all
its descendants, and keeps one cumulative total per *role*:

* ``rank:main`` / ``rank:<thread name>`` -- a training rank (its command line holds ``--worker``): the main
  thread, and the others by name (``/proc/<pid>/task/<tid>/comm``: gloo's, torchft's tokio runtime, ...);
* ``agent`` -- a ``torch.distributed.run`` agent (its threads together);
* ``self:main`` / ``self:<thread name>`` -- this process: the launcher loop (``fsdp-strategies-ft`` runs in
  it) and the threads it started (the lighthouse's runtime); the sampler's own thread is left out;
* ``other`` -- any other descendant.

:meth:`CpuSampler.between` gives the CPU seconds per role spent between two wall-clock times (the samples
nearest inside), e.g. a run's steady-state steps. A process that ended keeps its last reading.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil


def _thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() or "?"
    except OSError:
        return "?"


def _role(proc: psutil.Process, me: int) -> str:
    if proc.pid == me:
        return "self"
    try:
        cmd = " ".join(proc.cmdline())
    except (psutil.Error, OSError):
        return "other"
    if "--worker" in cmd:
        return "rank"
    if "torch.distributed.run" in cmd or "torchrun" in cmd:
        return "agent"
    return "other"


class CpuSampler:
    """Samples CPU time by role (see the module docstring) in a daemon thread; use as a context manager."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []  # (time.time(), cumulative seconds by role)
        self._last: dict[tuple[int, int], tuple[str, float]] = {}  # (pid, tid) -> (role, cpu seconds)
        self._roles: dict[int, tuple[float, str]] = {}  # pid -> (create_time, role)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._me = os.getpid()
        self._own_tid: int | None = None

    def __enter__(self) -> CpuSampler:
        self.sample()  # the baseline: a process started after this counts from zero
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _loop(self) -> None:
        self._own_tid = threading.get_native_id()
        while not self._stop.wait(self.interval_s):
            self.sample()

    def _process_role(self, proc: psutil.Process) -> str:
        try:
            created = proc.create_time()
        except psutil.Error:
            return "other"
        known = self._roles.get(proc.pid)
        if known is None or known[0] != created:  # a pid reused by a new process is classified again
            known = self._roles[proc.pid] = (created, _role(proc, self._me))
        return known[1]

    def sample(self) -> None:
        """Read every thread's CPU time now and append the totals by role."""
        me = psutil.Process(self._me)
        try:
            procs = [me, *me.children(recursive=True)]
        except psutil.Error:
            procs = [me]
        for proc in procs:
            role = self._process_role(proc)
            try:
                threads = proc.threads()
            except psutil.Error:
                continue
            for th in threads:
                if proc.pid == self._me and th.id == self._own_tid:
                    continue
                if role in ("rank", "self"):
                    name = "main" if th.id == proc.pid else _thread_name(proc.pid, th.id)
                    key = f"{role}:{name}"
                else:
                    key = role
                self._last[(proc.pid, th.id)] = (key, th.user_time + th.system_time)
        totals: dict[str, float] = {}
        for key, cpu in self._last.values():
            totals[key] = totals.get(key, 0.0) + cpu
        self.samples.append((time.time(), totals))

    def between(self, t0: float, t1: float) -> dict[str, float] | None:
        """CPU seconds by role from the first sample at or after ``t0`` to the last at or before ``t1``,
        scaled to the span ``t1 - t0``; ``None`` when fewer than two samples fall inside."""
        times = [t for t, _ in self.samples]
        i, j = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1) - 1
        if j <= i:
            return None
        (ta, a), (tb, b) = self.samples[i], self.samples[j]
        scale = (t1 - t0) / (tb - ta)
        return {k: (b.get(k, 0.0) - a.get(k, 0.0)) * scale for k in sorted(set(a) | set(b))}
