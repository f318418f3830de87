"""Starting one incarnation of a replica group: its environment, command, session, CPUs and log.

An incarnation is what the launcher starts for a group at its first start, at each restart and for a warm
spare. Every incarnation gets

* the protocol's environment (:class:`~fsdp_strategies.ft.protocol.FTEnvironment`: lighthouse, group id,
  group count, events file, restart count; for a spare also its activation file and the launcher's pid),
  its own rendezvous (``MASTER_ADDR``/``MASTER_PORT`` on a free port) and none of a parent's rank variables;
* its own OS session (``start_new_session``), so a fault kills exactly the group (see
  :mod:`~fsdp_strategies.ft.launch.process_tree`);
* its CPUs (``--pin-cores``, inherited by ``torchrun`` and its ranks; a restart gets the same ones);
* its output appended to ``group<G>.log`` after a ``===== <header>`` line (``start #N`` for each start:
  :mod:`~fsdp_strategies.ft.launch.group_exit` reads the latest start from there).

A spare starts under ``SCHED_IDLE``: its start-up uses only CPU time the group's training leaves idle, and it
returns to normal scheduling once activated (:func:`~fsdp_strategies.ft.protocol.restore_normal_scheduling`).
With ``--runner forkserver`` the ranks are forked from the forkserver instead
(:func:`~fsdp_strategies.ft.launch.forkserver.start_group`), which does the same for them.
"""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_strategies.ft.launch.forkserver import ForkServerGroup, start_group
from fsdp_strategies.ft.launch.options import LaunchOptions
from fsdp_strategies.ft.protocol import FTEnvironment

__all__ = ["GroupProcess", "GroupStarter", "free_port"]

#: a started incarnation: a process (torchrun, or ``python SCRIPT``) or a forkserver group leader
GroupProcess = subprocess.Popen[bytes] | ForkServerGroup

#: a parent's rank variables, which must not reach a group (it gets its own from its launcher)
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for a group's rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class GroupStarter:
    """Starts incarnations of the replica groups running ``command`` (see the module docstring)."""

    command: list[str]
    options: LaunchOptions
    logs: Path
    cores: list[list[int]] | None
    lighthouse_addr: str = ""  # set once the lighthouse runs

    def env(self, gid: int, restart_count: int, events_file: Path, master_port: int,
            standby_file: Path | None = None) -> dict[str, str]:
        """The group's environment: the protocol's variables, its own rendezvous, nothing of a parent's ranks
        (a warm spare: its future restart count, its activation file and this launcher's pid)."""
        genv = dict(os.environ)
        for key in _RANK_VARIABLES:
            genv.pop(key, None)
        genv.update(self.options.env or {})
        genv.update(FTEnvironment(lighthouse_addr=self.lighthouse_addr, replica_group_id=gid,
                                  num_replica_groups=self.options.groups, events_file=str(events_file),
                                  restart_count=restart_count,
                                  standby_file=str(standby_file) if standby_file else None,
                                  launcher_pid=os.getpid() if standby_file else None).to_env())
        # the strategy checks its quorum timeout against them
        genv.update(self.options.lighthouse_timeouts().to_env())
        genv.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
                     "OMP_NUM_THREADS": genv.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
                     # stacks on a fatal signal, and on the SIGABRT of process_tree.dump_stacks (--timeout)
                     "PYTHONFAULTHANDLER": genv.get("PYTHONFAULTHANDLER") or "1"})
        return genv

    def argv(self, master_port: int) -> list[str]:
        """What the group's top process runs (with the forkserver: what each forked rank runs as
        ``__main__``)."""
        o = self.options
        if o.runner == "forkserver":
            return list(self.command)
        if o.runner == "torchrun":
            return [o.python, "-m", "torch.distributed.run", f"--nproc_per_node={o.ranks_per_group}",
                    "--nnodes=1",
                    "--master_addr=127.0.0.1", f"--master_port={master_port}", "--max_restarts=0",
                    *self.command]
        return [o.python, *self.command]

    def start(self, gid: int, header: str, restart_count: int, events_file: Path,
              standby_file: Path | None = None) -> tuple[GroupProcess, Any]:
        """Start one incarnation of group ``gid``; returns it and its open log (the caller closes it)."""
        master_port = free_port()
        cmd = self.argv(master_port)
        env = self.env(gid, restart_count, events_file, master_port, standby_file)
        log = (self.logs / f"group{gid}.log").open("ab")
        log.write(f"\n===== {header}: {' '.join(cmd)}\n".encode())
        log.flush()
        cores = self.cores[gid] if self.cores is not None else None
        if self.options.runner == "forkserver":
            log.write(f"(forked from the forkserver: {self.options.ranks_per_group} rank(s))\n".encode())
            log.flush()
            return start_group(command=cmd, ranks=self.options.ranks_per_group, log_path=log.name, env=env,
                               cores=cores), log
        idle = standby_file is not None and hasattr(os, "SCHED_IDLE")

        def setup_child() -> None:
            if cores is not None:
                os.sched_setaffinity(0, cores)
            if idle:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=setup_child if cores is not None or idle else None)
        return proc, log
