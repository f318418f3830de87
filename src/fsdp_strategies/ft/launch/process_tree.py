"""Finding and signalling a whole replica group: a process and every descendant it started.

A replica group is a process tree -- ``torchrun`` (or a forkserver group leader, or rank 0 of Lightning's
launcher) and its ranks. ``torchrun`` puts each worker in its own session, so signalling the group's
session alone (``killpg``) would leave ranks running; :func:`process_tree` walks the parent links of
every process instead (``psutil``, which reads Linux's ``/proc``), and :func:`kill_tree` signals what it
finds and then the session as well, for a process the walk raced with. The launcher SIGKILLs a tree for a
fault and SIGTERMs it to forward a preemption; tests and benchmarks use the same two functions. Before it
kills a group that is stuck (its ``--timeout``), :func:`dump_stacks` makes each of its processes print its
Python stacks.
"""

from __future__ import annotations

import os
import resource
import signal
import time

import psutil

__all__ = ["dump_stacks", "dump_stacks_of", "kill_tree", "process_tree"]


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants, parents before children (psutil walks the parent links)."""
    try:
        descendants = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:  # ended meanwhile: its children, if any, were re-parented away from it
        return [root]
    return [root, *(child.pid for child in descendants)]


def kill_tree(root: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to ``root`` and every descendant (a whole replica group); return the pids signalled.

    A caller inside the tree (a rank that kills its own group) is signalled last: were it signalled in the
    middle, the rest of the list would never be, and those ranks would live on as orphans."""
    pids = process_tree(root)
    me = os.getpid()
    if me in pids:
        pids = [pid for pid in pids if pid != me] + [me]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    try:
        os.killpg(root, sig)  # the group's session, for whatever the tree walk raced with
    except (ProcessLookupError, PermissionError):
        pass
    return pids


def dump_stacks(root: int, wait_s: float = 2.0) -> list[int]:
    """Make ``root`` and its descendants print the Python stacks of all their threads, then end.

    The tree is frozen first (SIGSTOP: a ``torchrun`` that saw one rank end would kill the rest before they
    wrote); then, children before parents and one at a time (their stacks do not interleave in the shared
    log), each gets SIGABRT with core dumps off (``prlimit``) and SIGCONT, and is given up to ``wait_s`` to
    end. A Python with :mod:`faulthandler` enabled (the launcher sets ``PYTHONFAULTHANDLER=1`` for its
    groups) answers SIGABRT by writing every thread's stack to its stderr -- the group's log. Returns the
    pids signalled."""
    return dump_stacks_of(process_tree(root), wait_s)


def dump_stacks_of(tree: list[int], wait_s: float = 2.0) -> list[int]:
    """:func:`dump_stacks` for a tree walked another way: ``tree`` lists parents before children."""
    pids = list(reversed(tree))
    for pid in pids:
        _signal(pid, signal.SIGSTOP)
    for pid in pids:
        try:
            resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
        except OSError:  # gone, or not ours
            continue
        _signal(pid, signal.SIGABRT)
        _signal(pid, signal.SIGCONT)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.02)
    for pid in pids:  # anything that did not end stays runnable for the kill that follows
        _signal(pid, signal.SIGCONT)
    return pids


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False
