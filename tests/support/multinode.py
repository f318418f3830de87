"""One builder for the multi-node launch lines, shared by the local two-agent test and the SLURM check.

``tests/test_multinode.py`` starts two ``torchrun`` agents on this machine with exactly these
arguments (each agent is one simulated node), and renders ``examples/slurm/*.sbatch`` with stub
``srun``/``scontrol``/``torchrun`` commands to check that the scripts run the same lines on a cluster.

Why no ``--node-rank``: with the ``c10d`` rendezvous torchrun ignores it (and warns). The rendezvous
numbers the agents itself (``GROUP_RANK``, in the order of their host/pid descriptors) and gives each
agent a contiguous block of global ranks, ``GROUP_RANK * nproc_per_node + LOCAL_RANK``; so the
strategies' "one node = ``devices`` consecutive ranks" layout holds on any node numbering.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fsdp_strategies.ft.launch.process_tree import process_tree
from support import processes

RDZV_BACKEND = "c10d"


def torchrun_args(*, nnodes: int | str, nproc_per_node: int | str, rdzv_endpoint: str, rdzv_id: str,
                  script: str, script_args: Sequence[str] = ()) -> list[str]:
    """The arguments after ``torchrun`` for one agent (node) of a multi-node job."""
    return [f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", f"--rdzv-backend={RDZV_BACKEND}",
            f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}", "--max-restarts=0", script,
            *script_args]


def lighthouse_args(
    *, min_replicas: int | str, port: int | str, heartbeat_timeout_ms: int | str = 5000
) -> list[str]:
    """The arguments after ``torchft_lighthouse`` (its own job step / process)."""
    return [
        f"--min_replicas={min_replicas}",
        f"--bind=[::]:{port}",
        f"--heartbeat_timeout_ms={heartbeat_timeout_ms}",
    ]


def hsdp_script_args(
    config: str, *, nnodes: int | str, devices: int | str, extra: Sequence[str] = ()
) -> list[str]:
    """What ``examples/slurm/hsdp.sbatch`` passes to the training script: HSDP with both degrees ``auto``."""
    return ["fit", "--config", config, f"--trainer.num_nodes={nnodes}", f"--trainer.devices={devices}",
            "--trainer.strategy.init_args.replicate_degree=auto",
            "--trainer.strategy.init_args.shard_degree=auto", *extra]


def start_lighthouse(*, port: int, min_replicas: int, heartbeat_timeout_ms: int, log: Path,
                     timeout: float = 60) -> subprocess.Popen[bytes]:
    """``torchft_lighthouse`` (the venv's, next to this Python) as its own process, listening once this
    returns."""
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    args = lighthouse_args(min_replicas=min_replicas, port=port, heartbeat_timeout_ms=heartbeat_timeout_ms)
    with log.open("wb") as fh:
        processes.check_start([str(binary), *args])
        proc = subprocess.Popen([str(binary), *args], stdout=fh, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise RuntimeError(
        f"torchft_lighthouse {' '.join(args)} did not listen within {timeout} s (exit {proc.returncode}; "
        f"log {log})"
    )


def ft_hsdp_script_args(
    config: str, *, nnodes: int | str, devices: int | str, extra: Sequence[str] = ()
) -> list[str]:
    """What ``examples/slurm/ft_hsdp.sbatch`` passes to the training script of one replica group."""
    return ["fit", "--config", config, f"--trainer.num_nodes={nnodes}", f"--trainer.devices={devices}",
            "--trainer.strategy.init_args.shard_degree=auto", *extra]


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL an agent still running, and its workers."""
    if proc.poll() is None:
        for pid in process_tree(proc.pid):  # torchrun starts each worker in a session of its own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


def run_agents(agent_args: Sequence[Sequence[str]], *, env: dict[str, str], log_dir: Path, timeout: float,
               agent_env: Sequence[dict[str, str]] | None = None) -> list[int]:
    """Start one ``torchrun`` agent per entry of ``agent_args`` at once (the simulated nodes), wait for all.

    Returns their exit statuses. On timeout every agent's session is killed and ``TimeoutError`` raised.
    Output goes to ``log_dir/agent<i>.log``.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, args in enumerate(agent_args):
            with (log_dir / f"agent{i}.log").open("wb") as log:
                processes.check_start([sys.executable, "-m", "torch.distributed.run", *args])
                procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args],
                                              env={**env, **(agent_env[i] if agent_env else {})}, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        return [proc.returncode for proc in procs]
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"torchrun agents still running after {timeout} s (logs in {log_dir})") from None
    finally:
        for proc in procs:
            _kill(proc)
