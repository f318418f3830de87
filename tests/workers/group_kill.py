"""A rank that kills its own replica group on purpose (a fault test), safely.

The group's root -- torchrun's agent, or the forkserver's group leader -- is read once, when this module is
imported at the rank's start. Reading ``os.getppid()`` at the moment of the kill is wrong: once a sibling rank
has killed the agent, this rank is an orphan whose parent is the nearest subreaper -- under ``make test`` the
pytest process itself -- and the kill would take the whole test session with it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from fsdp_strategies.ft.launch.process_tree import kill_tree

GROUP_ROOT = os.getppid()


def kill_own_group() -> None:
    """SIGKILL the group's root, every rank under it (siblings first), then this rank."""
    cmdline = Path(f"/proc/{GROUP_ROOT}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    if GROUP_ROOT <= 1 or "pytest" in cmdline:
        raise RuntimeError(
            f"kill_own_group: the recorded group root {GROUP_ROOT} ({cmdline!r}) is not a replica "
            "group's root; refusing to kill it"
        )
    kill_tree(GROUP_ROOT)
    os.kill(os.getpid(), signal.SIGKILL)  # this rank was orphaned already when the root was gone
