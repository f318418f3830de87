"""Shared test helpers: run real multi-process jobs (gloo on CPU) and read back their results.

Every distributed test runs its ranks as separate OS processes, either through Lightning's own
launcher (the script re-executes itself per rank) or ``torchrun``; nothing is simulated in-process.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from support import processes, zygote
from support.paths import ROOT, WORKERS, job_pythonpath  # noqa: F401  (WORKERS: tests import it from here)

#: how long a process may outlive the test that started it (a rank still in its exit path) before it is a leak
LEAK_GRACE_S = 10.0


#: Ports handed out by :func:`free_port` lie below the kernel's ephemeral range
#: (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), from which ``bind(0)`` and outgoing
#: connections take theirs: between the check here and the server's own bind, nothing but an explicit bind can
#: take the port. Explicit binds by this suite's tests are kept apart by a counter shared through a locked
#: file, so two tests (or two pytest sessions) never get the same port.
_PORT_RANGE = (20000, 32000)
_PORT_COUNTER = Path(os.environ.get("TMPDIR", "/tmp")) / "fsdp_strategies_test_ports"


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free on 127.0.0.1 now that no ephemeral allocation can take before the caller binds it (see
    above)."""
    import fcntl

    low, high = _PORT_RANGE[0], min(_PORT_RANGE[1], _ephemeral_low())
    with _PORT_COUNTER.open("a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        text = fh.read().strip()
        port = int(text) if text.isdigit() else low + os.getpid() % 1000 * 10
        for _ in range(high - low):
            port = port + 1 if low <= port + 1 < high else low
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            fh.seek(0)
            fh.truncate()
            fh.write(str(port))
            return port
    raise RuntimeError(f"no free port in {low}-{high}")


def as_torchrun_rank0(monkeypatch: pytest.MonkeyPatch, world_size: int, local_world_size: int) -> None:
    """Make this process look like rank 0 of a torchrun job (``world_size`` ranks, ``local_world_size`` per
    node).

    Why: a Trainer with ``devices > 1`` inside pytest would otherwise start Lightning's subprocess launcher,
    whose rank 1 re-runs the current command -- the whole test session -- and is orphaned when rank 0's test
    ends. Under torchrun's variables the processes are created externally, so ``fit`` runs in this process
    alone.
    """
    for key, value in {"TORCHELASTIC_RUN_ID": "pytest", "WORLD_SIZE": str(world_size), "RANK": "0",
                       "LOCAL_RANK": "0", "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": str(local_world_size),
                       "GROUP_WORLD_SIZE": str(world_size // local_world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK",
                "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": job_pythonpath(env.get("PYTHONPATH"))})
    if _ZYGOTE.get("shim"):
        env.update({zygote.SOCKET_ENV: _ZYGOTE["socket"], zygote.PYTHON_ENV: sys.executable})
    env.update(extra or {})
    return env


#: the pre-imported server that jobs are forked from (``tests/support/zygote.py``): its process, socket,
#: client
_ZYGOTE: dict = {}


def _start_zygote() -> None:
    """Start this pytest process's zygote server in the background (it imports for a few seconds)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="fsdp-tests-zygote-")
    socket_path, shim = os.path.join(folder, "socket"), zygote.install_shim(sys.executable)
    log = open(os.path.join(folder, "server.log"), "w")  # noqa: SIM115 -- the server's, closed at exit
    env = {k: v for k, v in _env().items() if k not in (zygote.SOCKET_ENV, zygote.PYTHON_ENV)}
    server = subprocess.Popen([sys.executable, str(Path(zygote.__file__)), socket_path, shim], env=env,
                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
    _ZYGOTE.update(server=server, socket=socket_path, log=log, wanted_shim=shim, folder=folder)


def python_executable() -> str:
    """What a test starts as ``python``: the zygote's client once its server listens, else the real Python."""
    server = _ZYGOTE.get("server")
    if server is None:
        return sys.executable
    if "shim" not in _ZYGOTE:
        deadline = time.monotonic() + 300
        while not os.path.exists(_ZYGOTE["socket"]) and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if not os.path.exists(_ZYGOTE["socket"]):
            log = Path(_ZYGOTE["log"].name).read_text()[-3000:]
            pytest.fail(f"the test zygote (tests/support/zygote.py) did not start (exit {server.poll()}):\n"
                        f"{log}\n"
                        f"Fix: the error above, or run with {zygote.SOCKET_ENV}=off")
        _ZYGOTE["shim"] = _ZYGOTE["wanted_shim"]
    return str(_ZYGOTE["shim"])


def zygote_vars() -> dict[str, str]:
    """The variables a job started with :func:`python_executable` needs (empty when the zygote is off)."""
    if not _ZYGOTE.get("shim"):
        return {}
    return {zygote.SOCKET_ENV: _ZYGOTE["socket"], zygote.PYTHON_ENV: sys.executable}


def run_python(args: list[str], *, timeout: float = 300, env: dict[str, str] | None = None,
               cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` (e.g. a script that starts Lightning's launcher) and fail with its output."""
    python = python_executable()
    proc = processes.run([python, *args], timeout=timeout, env=_env(env), cwd=str(cwd or ROOT))
    if check and proc.returncode != 0:
        pytest.fail(f"`python {' '.join(args)}` exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                    f"--- stderr\n{proc.stderr[-8000:]}{_group_logs(args)}")
    return proc


def _group_logs(args: list[str]) -> str:
    """The ends of an ``fsdp-strategies-ft`` job's group logs (a timed-out group's stacks are there)."""
    if "--events-dir" not in args:
        return ""
    folder = Path(args[args.index("--events-dir") + 1])
    return "".join(f"\n--- {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-80:])
                   for log in sorted(folder.glob("group*.log")))


def run_torchrun(script: str | Path, nproc: int, args: list[str], *, timeout: float = 300,
                 env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Start ``nproc`` ranks of ``script`` with torchrun on a free port."""
    port = free_port()
    return run_python(["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
                       f"--master_port={port}", "--master_addr=127.0.0.1", str(script), *args],
                      timeout=timeout, env=env, check=check)


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """Fail the test that leaves a process of its own running, and kill it (see
    ``tests/support/processes.py``).

    Orphans count too: :func:`pytest_configure` made this process a child subreaper, so a rank whose launcher
    died is re-parented here, not to init."""
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    helpers = {_ZYGOTE["server"].pid} if "server" in _ZYGOTE else set()
    leaked = processes.leaked_processes(ignore_pids=helpers)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked = processes.leaked_processes(ignore_pids=helpers)
    if leaked:
        for pid in leaked:
            processes.kill_tree(pid)
        pytest.fail(f"the test left {len(leaked)} process(es) running "
                    f"{LEAK_GRACE_S:.0f} s after it ended (now "
                    "killed):\n" + "\n".join(f"  {pid}: {cmd[:300]}" for pid, cmd in leaked.items())
                    + "\nFix: start jobs with tests/support/processes.py (run / start), which kill the whole "
                    "tree.")


#: node id -> the names of its markers, for the check below
_MARKS: dict[str, set[str]] = {}
PROCESS_MARKERS = {"multiprocess", "subprocess", "slurm"}


#: Files whose multi-process tests measure real time against the job's own deadlines (heartbeats, quorum and
#: collective timeouts, straggler windows, signal grace periods, shaped links) or hold a machine-wide resource
#: (network namespaces, tmpfs mounts): their process-starting tests are marked ``serial``. ``make test`` runs
#: every other test on several pytest workers (pytest-xdist) and these afterwards, alone, so that another
#: test's load never decides their outcome.
SERIAL_FILES = frozenset({
    "test_ft_hsdp.py", "test_ft_launch.py", "test_ft_sync.py", "test_ft_data.py",
    "test_ft_tensor_parallel.py",
    "test_ft_switch.py", "test_ft_scale.py", "test_ft_protocol.py", "test_ft_timeouts.py", "test_netns.py",
    "test_preemption.py", "test_clean_exit.py", "test_straggler.py", "test_multinode.py",
    "test_async_checkpoint.py", "test_goodput.py", "test_processes.py"})


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the :data:`SERIAL_FILES`' tests ``serial``; record every test's markers; skip the ``soak`` ones
    unless ``FSDP_STRATEGIES_FULL=1``."""
    for item in items:
        if item.path.name in SERIAL_FILES and {m.name for m in item.iter_markers()} & PROCESS_MARKERS:
            item.add_marker(pytest.mark.serial)
    _MARKS.update({item.nodeid: {m.name for m in item.iter_markers()} for item in items})
    if os.environ.get("FSDP_STRATEGIES_FULL") != "1":
        soak = pytest.mark.skip(
            reason="soak run (minutes): FSDP_STRATEGIES_FULL=1 runs it; CI runs its short form"
        )
        for item in items:
            if "soak" in _MARKS[item.nodeid]:
                item.add_marker(soak)
    if (os.environ.get(zygote.SOCKET_ENV) != "off" and sys.platform.startswith("linux")
        and "server" not in _ZYGOTE
            and any(_MARKS[item.nodeid] & PROCESS_MARKERS for item in items)):
        _start_zygote()


def pytest_unconfigure(config: pytest.Config) -> None:
    server = _ZYGOTE.pop("server", None)
    if server is not None:
        server.kill()
        server.wait()
        _ZYGOTE["log"].close()
        shutil.rmtree(_ZYGOTE["folder"], ignore_errors=True)  # its socket and log (one per pytest process)


def require_process_marker(cmd: Sequence[str]) -> None:
    """Fail the running test if it starts a process without a marker saying so
    (``processes.before_start``)."""
    current = os.environ.get("PYTEST_CURRENT_TEST")
    if not current:
        return
    nodeid = current.rsplit(" (", 1)[0]
    marks = _MARKS.get(nodeid)
    if marks is not None and not marks & PROCESS_MARKERS:
        pytest.fail(f"{nodeid} starts a process ({' '.join(map(str, cmd))[:200]}) "
                    "but is not marked: selections by "
                    "marker (the Lightning-range run's `not multiprocess`) would misclassify it. Fix: add "
                    "@pytest.mark.multiprocess (a distributed job: several ranks or replica groups) or "
                    "@pytest.mark.subprocess (one child process).")


processes.before_start = require_process_marker


def _check_expected_torch_and_transformers() -> None:
    """``make test-torch-range``: stop a run that imports another torch (or transformers) than the one it
    asked for (``FSDP_STRATEGIES_EXPECT_TORCH`` / ``_TRANSFORMERS``; a local build suffix such as
    ``+cu130`` is ignored)."""
    import importlib

    for package in ("torch", "transformers"):
        expected = os.environ.get(f"FSDP_STRATEGIES_EXPECT_{package.upper()}")
        if not expected:
            continue
        module = importlib.import_module(package)
        if module.__version__.split("+")[0] != expected:
            raise pytest.UsageError(
                f"FSDP_STRATEGIES_EXPECT_{package.upper()}={expected}, but this run imports {package} "
                f"{module.__version__} from {module.__file__} ({sys.executable}). Fix: run pytest with the "
                f"Python of the venv that has {package} {expected}.")


def _one_compute_thread() -> None:
    """In-process tests compute on one thread, as the jobs they start do (``OMP_NUM_THREADS=1`` in
    :func:`_env`): ``make test`` runs two pytest workers beside the serial pass's jobs on two cores, where
    torch's default (a thread per core) only adds threads that wait for each other (two
    activation-checkpointing tests beside three busy loops: 11.4 s on two threads, 8.2 s on one)."""
    import torch

    torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a pytest session started from inside a test, and one that runs against another Lightning
    (``make test-lightning-range``) or torch / transformers (``make test-torch-range``) than the one it asked
    for."""
    if os.environ.get("PYTEST_CURRENT_TEST"):
        # a test ran Trainer(devices>1).fit in-process: Lightning's subprocess launcher re-ran this command
        # (the pytest session) as rank 1, which would run every test again, orphaned once rank 0's test ends
        pytest.exit(
            f"this pytest session was started by the test {os.environ['PYTEST_CURRENT_TEST']!r} (LOCAL_RANK="
            f"{os.environ.get('LOCAL_RANK')}): a Trainer with "
            "devices > 1 was fit inside pytest. Fix: in that "
            "test, call conftest.as_torchrun_rank0(monkeypatch, "
            "...) first, or run the job in a worker script.",
            returncode=3,
        )
    processes.become_subreaper()
    _check_expected_torch_and_transformers()
    _one_compute_thread()
    expected = os.environ.get("FSDP_STRATEGIES_EXPECT_LIGHTNING")
    if not expected:
        return
    import lightning

    where = os.environ.get("FSDP_STRATEGIES_LIGHTNING_DIR")
    if lightning.__version__ != expected or (where and not Path(lightning.__file__).resolve().is_relative_to(
            Path(where).resolve())):
        raise pytest.UsageError(
            f"FSDP_STRATEGIES_EXPECT_LIGHTNING={expected} (from {where}), but this run imports "
            f"lightning {lightning.__version__} from {lightning.__file__}. Fix: put that folder "
            "first on PYTHONPATH."
        )
