"""Every process a test or trial script starts, started one way: in a session of its own, killed as a whole
tree.

Why: ``subprocess.run(timeout=...)`` kills only its direct child. A job's real work runs further down --
Lightning's rank 1, torchrun's workers (each in a session of its own), the FT launcher's replica groups --
and those stay blocked in gloo for up to the collective timeout (30 min), slowing every later test. Here:

* :func:`start` starts the command in a new session (``start_new_session=True``); :class:`Job` is a
  ``Popen`` that, when it is closed (``with`` block, :meth:`Job.kill_tree`) while anything of it is alive,
  SIGKILLs the command's whole tree: every descendant (``fsdp_strategies.ft.launch.process_tree``, psutil;
  whatever session it moved to) and every process of the command's session.
* :func:`run` is ``subprocess.run`` on top of it: on a timeout, a failure of the caller or a
  ``KeyboardInterrupt`` the whole tree goes, then the error is raised as before.
* :func:`leaked_processes` lists the live descendants of this process. ``tests/conftest.py`` makes the
  pytest process a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``), so a grandchild whose parent died
  is re-parented to pytest instead of to init and still shows up there; after every test it fails the test
  that left one behind, and kills it.

Orphans re-parented to pytest that have exited stay zombies until pytest ends: harmless, and never reaped
here, because a ``waitpid`` on them could race a ``Popen`` waiting for its own child.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Any

import psutil

from fsdp_strategies.ft.launch.process_tree import process_tree

__all__ = ["Job", "become_subreaper", "kill_tree", "leaked_processes", "run", "start"]

_PR_SET_CHILD_SUBREAPER = 36

#: processes that torch itself keeps alive for the rest of the process once a test has used the feature, and
#: that are not a job of the test: inductor's compile-worker pool (``compile_blocks``), DCP's async checkpoint
#: daemon (``async_checkpoint="process"`` in-process). Matched against the command line.
LONG_LIVED_HELPERS = ("torch/_inductor/compile_worker", "torch._inductor.compile_worker",
                      "torch.distributed.checkpoint._async_process_executor",
                      "multiprocessing.resource_tracker", "multiprocessing.forkserver",
                      "fsdp-tests-s3-server")  # tests/support/s3_server.py: one per test module


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _session_members(sid: int) -> list[int]:
    """The live processes of session ``sid`` (psutil has no session id; ``os.getsid`` reads it)."""
    members = []
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            if os.getsid(pid) == sid and _alive(pid):
                members.append(pid)
    return members


def kill_tree(pid: int, sid: int | None = None) -> list[int]:
    """SIGKILL ``pid``, every descendant of it and every process of session ``sid``; the pids signalled."""
    targets = set(process_tree(pid))
    if sid is not None:
        targets.update(_session_members(sid))
    targets.discard(os.getpid())
    killed = []
    for target in sorted(targets):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, signal.SIGKILL)
            killed.append(target)
    return killed


class Job(subprocess.Popen):  # type: ignore[type-arg]
    """A ``Popen`` in a session of its own whose whole tree is killed when it is closed while alive."""

    def kill_tree(self) -> list[int]:
        """SIGKILL the command, its descendants and its session; reap the command. Returns the pids
        signalled."""
        killed = kill_tree(self.pid, sid=self.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(timeout=30)
        return killed

    def __exit__(self, *exc: Any) -> None:
        # the descendants may outlive a command that exited by itself (a launcher whose rank hangs): always
        # sweep
        kill_tree(self.pid, sid=self.pid)
        super().__exit__(*exc)


#: Called with the command before every start. ``tests/conftest.py`` sets it to fail a test that starts a
#: process without the ``multiprocess`` or ``subprocess`` marker, so that ``-m "not multiprocess"`` and the
#: other selections by marker mean what they say.
before_start: Callable[[Sequence[str]], None] | None = None


def check_start(cmd: Sequence[str]) -> None:
    """Run :data:`before_start` for ``cmd`` (every start goes through here, also those that cannot use
    :func:`start`)."""
    if before_start is not None:
        before_start(cmd)


def start(cmd: Sequence[str], **popen_kwargs: Any) -> Job:
    """Start ``cmd`` in a new session (see :class:`Job`); ``popen_kwargs`` as for ``subprocess.Popen``."""
    check_start(cmd)
    popen_kwargs.setdefault("start_new_session", True)
    if not popen_kwargs["start_new_session"]:
        raise ValueError(
            "start(start_new_session=False): a job runs in a session of its own so that its whole "
            "tree can be found and killed. Fix: leave start_new_session alone."
        )
    return Job(list(cmd), **popen_kwargs)


def run(cmd: Sequence[str], *, timeout: float, capture_output: bool = True, text: bool = True,
        check: bool = False, **popen_kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` whose timeout (or any exception, Ctrl-C included) kills the command's whole tree."""
    if capture_output:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with start(cmd, text=text, **popen_kwargs) as job:
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as expired:  # (any other exception: Job.__exit__ kills the tree)
            job.kill_tree()
            out, err = job.communicate()
            raise subprocess.TimeoutExpired(job.args, timeout, output=out, stderr=err) from expired
    proc = subprocess.CompletedProcess(job.args, job.returncode, out, err)
    if check:
        proc.check_returncode()
    return proc


def leaked_processes(
    ignore: Sequence[str] = LONG_LIVED_HELPERS, ignore_pids: Collection[int] = ()
) -> dict[int, str]:
    """Live descendants of this process (zombies, torch's own long-lived helpers and ``ignore_pids`` aside):
    pid -> command line."""
    me = os.getpid()
    found = {}
    for pid in process_tree(me):
        if pid == me or pid in ignore_pids or not _alive(pid):
            continue
        cmdline = _cmdline(pid)
        if any(pattern in cmdline for pattern in ignore):
            continue
        found[pid] = cmdline
    return found
