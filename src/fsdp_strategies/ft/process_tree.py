"""Finding and signalling a whole replica group: a process and every descendant it started.

A replica group is a process tree -- ``torchrun`` (or a forkserver group leader, or rank 0 of Lightning's
launcher) and its ranks. ``torchrun`` puts each worker in its own session, so signalling the group's
session alone (``killpg``) would leave ranks running; :func:`process_tree` walks the parent links of
every process in Linux's ``/proc`` instead, and :func:`kill_tree` signals what it finds and then the
session as well, for a process the walk raced with. The launcher SIGKILLs a tree for a fault and
SIGTERMs it to forward a preemption; tests and benchmarks use the same two functions.
"""

from __future__ import annotations

import os
import signal

__all__ = ["kill_tree", "process_tree"]


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants, parents before children (read from Linux's ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:  # the process ended meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name in (...) may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def kill_tree(root: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to ``root`` and every descendant (a whole replica group); return the pids signalled.

    A caller inside the tree (a rank that kills its own group) is signalled last: were it signalled in the
    middle, the rest of the list would never be, and those ranks would live on as orphans."""
    pids = process_tree(root) if os.path.isdir("/proc") else [root]
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
