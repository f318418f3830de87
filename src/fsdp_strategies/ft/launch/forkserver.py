"""``fsdp-strategies-ft --runner forkserver``: replica groups forked from a process that has imported
everything.

Why: a restarted replica group is down while each of its ranks starts Python and imports torch, Lightning and
torchft (about 4 s of CPU per rank here). The survivors train meanwhile, but the group's share of the work is
lost. With this runner the launcher keeps one server process (the standard library's
:mod:`multiprocessing` forkserver, with those modules preloaded) that sleeps until asked; each start or
restart of a group forks a *group leader* from it, which forks the group's ranks. Every process starts with
the imports done, and the server costs memory only, never CPU: unlike ``--warm-spares`` nothing competes with
training between faults.

The leader does what ``torchrun --nnodes=1 --max_restarts=0`` does for a group: it gives each rank torchrun's
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ...), runs the script as
``__main__``, and when a rank fails it kills the others and exits non-zero, so a rank that dies takes its
group down. Like ``--warm-spares`` it helps against process failures; losing the host also loses its server.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import traceback
import uuid
from typing import Any

from fsdp_strategies.ft.protocol import torchft_runtime_env

__all__ = ["PRELOAD", "ForkServerGroup", "start_group"]

#: imported once by the server; every group leader and rank is forked with them loaded
PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "torchft", "fsdp_strategies",
           "fsdp_strategies.ft.strategy")

_context: Any = None


def _server_context(preload: tuple[str, ...]) -> Any:
    """The launcher's forkserver context (one server per launcher process, started on first use)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(list(preload))
    return _context


class ForkServerGroup:
    """A started group leader, with the part of :class:`subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, process: Any) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        return int(self._process.pid)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"replica group leader {self.pid}", timeout or 0.0)
        return int(self._process.exitcode)


def start_group(*, command: list[str], ranks: int, env: dict[str, str], log_path: str,
                cores: list[int] | None, preload: tuple[str, ...] = PRELOAD) -> ForkServerGroup:
    """Fork one incarnation of a replica group from the server: ``command`` is ``SCRIPT ARGS...`` or
    ``-m MODULE ARGS...``, run by ``ranks`` ranks with ``env`` (the group's environment, with ``MASTER_ADDR``
    and ``MASTER_PORT``); output is appended to ``log_path``; ``cores`` pins the group."""
    if not command or (command[0] == "-m" and len(command) < 2):
        raise ValueError(
            f"--runner forkserver: nothing to run in {command!r}; give SCRIPT [ARGS...] or -m MODULE"
        )
    process = _server_context(preload).Process(
        target=_lead_group, args=(list(command), ranks, dict(env), log_path, cores), daemon=True,
        name="fsdp-strategies-ft-group",
    )
    with torchft_runtime_env():  # the server (started by the first group) imports torchft with its log level
        process.start()
    return ForkServerGroup(process)


def _lead_group(command: list[str], ranks: int, env: dict[str, str], log_path: str,
                cores: list[int] | None) -> None:
    """The group leader (forked from the server): its own session, CPUs and log; forks the ranks, waits, and
    exits with the first failing rank's code (1 for a rank killed by a signal, as torchrun does)."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    os.environ.clear()
    os.environ.update(env)
    # a SIGTERM (preemption) reaches every rank directly (the launcher signals the whole tree): the leader
    # waits for them to stop and checkpoint instead of dying first
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run_id = uuid.uuid4().hex[:12]
    children: dict[int, int] = {}
    for local_rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os._exit(_run_rank(command, local_rank, ranks, run_id))
        children[pid] = local_rank
    code = 0
    while children:
        pid, status = os.wait()
        if children.pop(pid, None) is None:
            continue
        rank_code = os.waitstatus_to_exitcode(status)
        if rank_code != 0 and code == 0:
            code = rank_code if rank_code > 0 else 1
            print(f"[fsdp-strategies-ft] rank exited with {rank_code}: stopping the group's other ranks "
                  f"{sorted(children)}", file=sys.stderr, flush=True)
            for other in children:
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_rank(command: list[str], local_rank: int, ranks: int, run_id: str) -> int:
    """One rank (forked from the leader): torchrun's environment, then the script as ``__main__``."""
    os.environ.update({
        "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": "0",
        "ROLE_RANK": str(local_rank),
        "ROLE_NAME": "default", "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
        "ROLE_WORLD_SIZE": str(ranks),
        "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
    })
    code = 0
    if os.environ.get("PYTHONFAULTHANDLER"):  # as a fresh interpreter does (the server had another env)
        faulthandler.enable(all_threads=True)
    try:
        import torch

        # libgomp read OMP_NUM_THREADS when the server imported torch, under the launcher's environment
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
        # PYTHONPATH of the group's environment (the server's sys.path is the launcher's)
        for entry in reversed([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
            if os.path.abspath(entry) not in sys.path:
                sys.path.insert(0, os.path.abspath(entry))
        if command[0] == "-m":
            sys.argv = [command[1], *command[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(command[0])
            sys.argv = [command[0], *command[1:]]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    from fsdp_strategies._torch_seam import run_exit_handlers

    try:
        run_exit_handlers()  # what a normal interpreter exit runs (os._exit below does not)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code
