"""The test suite's Python jobs, forked from one process that has already imported torch, Lightning and the
package.

Why: most of ``make test``'s multi-process time went to starting Python -- every rank of every job imports
torch, Lightning, torchmetrics and transformers, ~5 s of CPU each, twice per two-rank job (Lightning starts
rank 1 only after rank 0 has imported everything), on a 2-core machine. Here one *server* per pytest process
pays that once; each job is a fork of it, so only what the job itself does costs time.

How, without changing what a job sees:

* :func:`install_shim` writes ``python-zygote`` next to the venv's Python: a tiny stdlib-only client. The test
  helpers (``conftest.run_python``) start it instead of ``python``; the server sets ``sys.executable`` to it
  in every job, so what a job starts with ``sys.executable`` -- Lightning's rank 1, torchrun's workers -- is
  forked from the server too.
* The client sends its arguments, environment, working directory, umask, CPU affinity, scheduling policy,
  niceness, resource limits and every file descriptor it inherited (stdio and any ``pass_fds``) over a Unix
  socket. The server forks; the child becomes the job: a new session,
  the same descriptor numbers, that environment, ``sys.argv``/``sys.path[0]`` as ``python`` would set them,
  fresh ``random``/NumPy/torch seeds, ``os.getppid()`` answering the client's parent; then it runs the script,
  ``-m`` module or ``-c`` code as ``__main__`` and exits through the interpreter's normal shutdown (atexit
  handlers, threads, flush).
* The client stays the job's stand-in for its parent: it forwards
  SIGTERM/SIGINT/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 to the job and exits with the job's status (or dies of the
  same signal). If the client is killed (a test's timeout kills its tree), the server kills the job's whole
  tree. SIGABRT to the client (how the FT launcher's ``--timeout`` asks a stuck group for its stacks) makes
  the server do the same to the job's tree.
* Anything the server cannot reproduce exactly -- another interpreter flag, or an environment variable read at
  import time (``PYTHON*``, ``OMP_*``, ``TORCHINDUCTOR_*``, ... see :data:`IMPORT_TIME_ENV`) that differs from
  the server's -- is run by the client ``exec``-ing the real Python instead: slower, never different. Two such
  variables the job reproduces itself: ``PYTHONFAULTHANDLER`` (the FT launcher's groups set it) and a
  ``PYTHONPATH`` that only adds folders holding none of the preloaded modules (a test's helper modules).

What it cannot give a job is its client's pid: ``os.getpid()`` in the job is the fork's. A job whose parent
matches the pid its ``Popen`` returned against one the child reports itself
(``benchmarks/suites/ft_scale.py``) runs unforked: ``run_python(..., env={"FSDP_TESTS_ZYGOTE": "off"})``,
which its descendants inherit. ``FSDP_TESTS_ZYGOTE=off`` turns it off for a whole pytest run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "FSDP_TESTS_ZYGOTE"
PYTHON_ENV = "FSDP_TESTS_PYTHON"
SHIM_NAME = "python-zygote"
#: imported once by the server (in this order); each job starts with them loaded
PRELOAD = ("numpy", "torch", "torch.distributed", "torchmetrics", "transformers", "lightning.pytorch",
           "jsonargparse", "lightning.pytorch.cli", "fsdp_strategies", "fsdp_strategies.ft.strategy")
#: environment variables a module may read while it is imported: a job whose value differs from the server's
#: runs in a fresh interpreter instead (prefixes)
IMPORT_TIME_ENV = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "TORCHDYNAMO", "TORCHINDUCTOR", "TORCH_LOGS",
                   "TORCH_COMPILE", "TORCH_SHOW", "FSDP_STRATEGIES_EXPECT", "FSDP_STRATEGIES_LIGHTNING",
                   "HF_", "TRANSFORMERS", "TOKENIZERS")
#: what a client sends its server when it gets SIGABRT (:func:`_ask_for_stacks`)
STACKS_REQUEST = b"S"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                     signal.SIGUSR2)
_HEADER = struct.Struct("!I")


#: import-time variables a forked job reproduces itself (:func:`_become_job`): ``PYTHONFAULTHANDLER`` (the
#: FT launcher sets it for its groups) and ``PYTHONPATH`` where :func:`_job_sys_path` allows it
REPRODUCED_ENV = ("PYTHONFAULTHANDLER", "PYTHONPATH")


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    found = {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}
    if "PYTHONPATH" in found:  # a folder listed twice is looked in once: the first listing is what counts
        found["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(found["PYTHONPATH"].split(os.pathsep)))
    return found


def _path_entries(value: str, cwd: str) -> list[str]:
    """``PYTHONPATH``'s folders as the interpreter puts them on ``sys.path``: absolute, each once."""
    if not value:
        return []
    return list(dict.fromkeys(os.path.abspath(os.path.join(cwd, e)) for e in value.split(os.pathsep)))


def _job_sys_path(entries: list[str], server_entries: list[str], base: list[str],
                  loaded: set[str]) -> list[str] | str:
    """The ``sys.path`` (after ``sys.path[0]``) a fresh ``python`` with ``PYTHONPATH`` ``entries`` would have,
    or why a fork of the server cannot be that interpreter.

    It can when the folders it keeps of the server's ``PYTHONPATH`` keep their order, the ones it drops gave
    the server none of its modules, and the ones it adds hold no top-level module the server has already
    imported (``loaded``): every preloaded module is then the one a fresh interpreter would have found, and
    anything else is found along the job's own path."""
    kept = [e for e in entries if e in server_entries]
    if kept != [e for e in server_entries if e in entries]:
        return f"PYTHONPATH differs: it reorders the server's {server_entries}"
    files = [getattr(m, "__file__", None) or "" for m in list(sys.modules.values())]
    for entry in server_entries:
        if entry not in entries and any(f.startswith(entry + os.sep) for f in files):
            return f"PYTHONPATH differs: it drops {entry}, where preloaded modules come from"
    for entry in entries:
        if entry in server_entries or not os.path.isdir(entry):
            continue
        shadowing = sorted({name.split(".")[0] for name in os.listdir(entry)} & loaded)
        if shadowing:
            return f"PYTHONPATH differs: {entry} holds {shadowing[:3]}, preloaded from elsewhere"
    return list(dict.fromkeys([*entries, *base]))


# ----------------------------------------------------------------------------------------------------- client


def _inherited_fds() -> list[int]:
    """The descriptors this client got from its parent: open and not close-on-exec."""
    import fcntl

    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC:
                fds.append(fd)
        except OSError:
            pass  # the descriptor listdir itself used
    return sorted(fds)


def _scheduling() -> dict:
    """What a child inherits from this client besides descriptors: CPUs (``--pin-cores``), scheduling policy
    (a warm spare's ``SCHED_IDLE``), niceness and resource limits."""
    import resource

    limits = {
        name: resource.getrlimit(getattr(resource, name))
        for name in dir(resource)
        if name.startswith("RLIMIT_")
    }
    return {"affinity": sorted(os.sched_getaffinity(0)), "policy": os.sched_getscheduler(0),
            "priority": os.sched_getparam(0).sched_priority, "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "rlimits": limits}


def _inherit_scheduling(request: dict) -> None:
    """In the job: take on the client's :func:`_scheduling`."""
    import resource

    for name, limits in request["rlimits"].items():
        try:
            resource.setrlimit(getattr(resource, name), tuple(limits))
        except (ValueError, OSError):  # one the job may not raise: it keeps the server's, as close as it gets
            pass
    os.sched_setaffinity(0, request["affinity"])
    os.sched_setscheduler(0, request["policy"], os.sched_param(request["priority"]))
    os.setpriority(os.PRIO_PROCESS, 0, request["nice"])


def _exec_python(args: list[str]) -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)  # the mask would survive the exec
    python = os.environ[PYTHON_ENV]
    os.execv(python, [python, *args])


def client(args: list[str]) -> None:
    """Run ``python ARGS`` as a fork of the server (or, where it cannot be exact, as a fresh ``python``)."""
    path = os.environ.get(SOCKET_ENV, "")
    if not path.startswith("/"):
        _exec_python(args)
    fds = _inherited_fds()
    # a signal that comes before the job's pid is known waits, then goes to the job
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        _exec_python(args)
    umask = os.umask(0o022)  # (reading it means setting it)
    os.umask(umask)
    body = json.dumps({"args": args, "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask,
                       "fds": fds, "ppid": os.getppid(), "pid": os.getpid(), **_scheduling()}).encode()
    socket.send_fds(conn, [_HEADER.pack(len(body))], fds)
    conn.sendall(body)
    reader = conn.makefile("rb")
    reply = json.loads(reader.readline() or b'{"refused": "the server closed the connection"}')
    if "pid" not in reply:
        conn.close()
        _exec_python(args)
    pid = reply["pid"]
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    signal.signal(signal.SIGABRT, lambda *_: _ask_for_stacks(conn))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
    line = b""
    while not line:
        try:
            line = reader.readline() or b'{"status": 35072}'  # the server went away: exit 137
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(json.loads(line)["status"])
    if code < 0:
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _ask_for_stacks(conn: socket.socket) -> None:
    """SIGABRT to the client: the FT launcher's ``--timeout`` asks every process of a stuck group for its
    Python stacks that way (``fsdp_strategies.ft.launch.process_tree.dump_stacks``). The job's processes
    descend from the server, not from this client, so the server does it for the job's tree; the job then ends
    of SIGABRT and so does this client."""
    try:
        conn.send(STACKS_REQUEST)
    except OSError:  # the server is gone: so is the job
        pass


def install_shim(python: str) -> str:
    """Write the client executable next to ``python`` (idempotent, atomic) and return its path."""
    shim = os.path.join(os.path.dirname(python), SHIM_NAME)
    text = (f"#!{python} -S\nimport sys\nsys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
            "import zygote\nzygote.client(sys.argv[1:])\n")
    try:
        with open(shim) as fh:
            if fh.read() == text:
                return shim
    except OSError:
        pass
    tmp = f"{shim}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, shim)
    return shim


# ----------------------------------------------------------------------------------------------------- server


def _plan(args: list[str], server_env: dict[str, str], env: dict[str, str], set_by_imports: dict[str, str],
          paths: dict | None = None, cwd: str = "/") -> tuple[str, str, list[str], list[str] | None] | str:
    """(kind, target, argv, sys.path after its first entry or None for the server's) for ``python ARGS``, or
    why a fresh interpreter must run it. ``paths``: the server's ``PYTHONPATH`` folders (``entries``), the
    rest of its ``sys.path`` (``base``) and the top-level modules it imported (``loaded``); without it any
    other ``PYTHONPATH`` is refused."""
    job_env = _import_time_env({k: v for k, v in env.items() if set_by_imports.get(k) != v})
    reproduced = REPRODUCED_ENV if paths is not None else ("PYTHONFAULTHANDLER",)
    changed = sorted(set(job_env.items()) ^ set(server_env.items()))
    if [kv for kv in changed if kv[0] not in reproduced]:
        return f"import-time environment differs: {changed[:4]}"
    sys_path = None
    if paths is not None and job_env.get("PYTHONPATH") != server_env.get("PYTHONPATH"):
        entries = _path_entries(env.get("PYTHONPATH", ""), cwd)
        sys_path = _job_sys_path(entries, paths["entries"], paths["base"], paths["loaded"])
        if isinstance(sys_path, str):
            return sys_path
    rest = list(args)
    while rest and rest[0] in ("-u", "-B"):
        rest.pop(0)
    if not rest:
        return "no program"
    if rest[0] in ("-m", "-c"):
        if len(rest) < 2:
            return f"{rest[0]} without an argument"
        return rest[0], rest[1], ([rest[0]] if rest[0] == "-c" else [rest[1]]) + rest[2:], sys_path
    if rest[0].startswith("-"):
        return f"interpreter flag {rest[0]}"
    return "script", rest[0], rest, sys_path


def _place_fds(received: list[int], wanted: list[int]) -> None:
    """Give the job the client's descriptors under the client's numbers, and nothing else."""
    import fcntl

    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in received]
    for fd in received:
        os.close(fd)
    for src, dst in zip(high, wanted):
        os.dup2(src, dst)
    keep = set(wanted)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _become_job(request: dict, received: list[int], shim: str,
                sockets: list[socket.socket]) -> tuple[str, str]:
    """In the forked child: turn this process into ``python ARGS`` started by the client."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    for sock in sockets:  # the server's sockets must not close a descriptor number the job reuses later
        sock.detach()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _place_fds(received, request["fds"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    _inherit_scheduling(request)
    kind, target, argv, rest_of_path = request["plan"]
    sys.argv = argv
    sys.executable = shim
    parent = int(request["ppid"])
    os.getppid = lambda: parent  # the process that started the client, not the server
    sys.path[0] = {"script": os.path.dirname(os.path.realpath(target)), "-m": os.getcwd(), "-c": ""}[kind]
    if rest_of_path is not None:  # the job's own PYTHONPATH (see _job_sys_path)
        sys.path[1:] = rest_of_path
    import faulthandler

    if os.environ.get("PYTHONFAULTHANDLER"):  # as the interpreter does at start-up
        faulthandler.enable(all_threads=True)
    else:
        faulthandler.disable()
    import random

    import numpy
    import torch

    random.seed()
    numpy.random.seed()
    torch.seed()  # a fresh process's torch draws its start-up seed at random too
    return kind, target


def _run_as_main(kind: str, target: str) -> None:
    import runpy
    import types

    if kind == "script":
        runpy.run_path(target, run_name="__main__")
    elif kind == "-m":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)


def _job_tree(job: int, client_jobs: dict[int, int]) -> list[int]:
    """``job`` and its descendants, parents before children, where a descendant that is a client stands for
    its job's tree (a job's own ``python`` children -- torchrun's ranks -- are forked from the server too)."""
    from fsdp_strategies.ft.launch.process_tree import process_tree

    tree = []
    for pid in process_tree(job):
        if pid in client_jobs:
            tree.extend(_job_tree(client_jobs[pid], client_jobs))
        else:
            tree.append(pid)
    return tree


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    msg, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, 255)
    (size,) = _HEADER.unpack(msg)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the client went away mid-request")
        body += chunk
    return json.loads(body), fds


def serve(path: str, shim: str) -> None:
    """Import :data:`PRELOAD`, listen on ``path`` and fork a job per request until the parent process
    exits."""
    import ctypes
    import gc
    import importlib
    import select

    from fsdp_strategies.ft.launch.process_tree import dump_stacks_of, kill_tree

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the pytest process
    parent = os.getppid()
    before = dict(os.environ)
    entries = _path_entries(before.get("PYTHONPATH", ""), os.getcwd())
    if sys.path[1:1 + len(entries)] == entries:
        paths: dict | None = {"entries": entries, "base": sys.path[1 + len(entries):]}
    else:  # not the sys.path this module expects: no other PYTHONPATH is reproduced
        paths = None
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # an optional package missing in this venv: its jobs import it themselves
            print(f"zygote: {name} not preloaded: {exc}", file=sys.stderr)
    gc.collect()
    gc.freeze()  # the jobs' pages stay shared with the server
    server_env = _import_time_env(before)
    if paths is not None:
        paths["loaded"] = {name.split(".")[0] for name in sys.modules}
    # what the imports put into the environment (e.g. inductor's TORCHINDUCTOR_CACHE_DIR): a fresh `python`
    # would have set it the same way, so every job gets it too
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # ready: the path appears only now
    jobs: dict[int, socket.socket | None] = {}
    clients: dict[socket.socket, int] = {}
    client_jobs: dict[int, int] = {}  # a client's pid -> its job's
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, wake_r, *clients], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        while jobs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            # what the job left running in its session goes with it, as `processes.Job` sweeps its session
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            conn = jobs.pop(pid, None)
            for client in [c for c, j in client_jobs.items() if j == pid]:
                del client_jobs[client]
            if conn is not None:
                clients.pop(conn, None)
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
        for conn in [c for c in ready if c in clients]:
            try:
                data = conn.recv(1)
            except OSError:
                data = b""
            if data == STACKS_REQUEST:
                dump_stacks_of(_job_tree(clients[conn], client_jobs))
                continue
            if not data:  # the client is gone (killed): so is its job
                pid = clients.pop(conn)
                jobs[pid] = None
                kill_tree(pid)  # the job, its descendants and its session
                conn.close()
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        try:
            request, received = _receive(conn)
        except (OSError, ValueError) as exc:
            conn.close()
            print(f"zygote: bad request: {exc}", file=sys.stderr)
            continue
        plan = _plan(request["args"], server_env, request["env"], set_by_imports, paths, request["cwd"])
        if isinstance(plan, str):
            print(f"zygote: a fresh interpreter for {request['args'][:3]}: {plan}", file=sys.stderr,
                  flush=True)
            conn.sendall(json.dumps({"refused": plan}).encode() + b"\n")
            conn.close()
            for fd in received:
                os.close(fd)
            continue
        request["plan"] = plan
        request["env"] = {**set_by_imports, **request["env"]}
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                kind, target = _become_job(request, received, shim, [listener, conn, *clients])
            except BaseException:  # a job that could not even start
                import traceback

                traceback.print_exc()
                os._exit(70)
            _run_as_main(kind, target)
            sys.exit(0)  # the script returned: the interpreter's normal exit, as `python SCRIPT` would
        for fd in received:
            os.close(fd)
        jobs[pid] = conn
        clients[conn] = pid
        client_jobs[int(request["pid"])] = pid
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
