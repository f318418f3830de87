"""tests/support/zygote.py: a job forked from the pre-imported server is what ``python ARGS`` would have been.

The whole suite's jobs run through it, so what it changes would change every multi-process test: each check
here runs the same probe once forked and once as a fresh interpreter and wants the same answers, plus the part
only the zygote adds (signals forwarded, a killed client taking its job's tree with it)."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import _env, python_executable
from support import processes, zygote

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.skipif(os.environ.get(zygote.SOCKET_ENV) == "off", reason=f"{zygote.SOCKET_ENV}=off"),
]

PROBE = r'''
import json, os, sys
preloaded = "lightning.pytorch" in sys.modules
out = int(os.environ["PROBE_FD"])
os.write(out, json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "main": __name__,
    "env": os.environ.get("PROBE_VALUE"), "ppid": os.getppid(), "cpus": sorted(os.sched_getaffinity(0)),
    "policy": os.sched_getscheduler(0), "nice": os.nice(0), "nofile": __import__("resource").getrlimit(7),
    "stdin": sys.stdin.read(), "umask": os.umask(0),
    "executable": sys.executable, "preloaded": preloaded, "file": globals().get("__file__"), "path": sys.path,
    "faulthandler": __import__("faulthandler").is_enabled(), "extra": __import__("extra_mod").WHERE
    if os.environ.get("PROBE_EXTRA") else None}).encode())
os.close(out)
print("to stdout"); print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
'''


def _probe(python: str, args: list[str], tmp_path: Path, *, exit_code: int = 0, **env: str) -> dict:
    read, write = os.pipe()
    environment = _env({"PROBE_FD": str(write), "PROBE_VALUE": "v", "PROBE_EXIT": str(exit_code), **env})
    # what the FT launcher does to a group (--pin-cores) and a warm spare
    def as_a_pinned_idle_spare() -> None:
        os.sched_setaffinity(0, {0})
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        os.nice(3)
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    with processes.start([python, *args], env=environment, cwd=tmp_path, pass_fds=(write,),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=as_a_pinned_idle_spare) as job:
        os.close(write)
        out, err = job.communicate("stdin data", timeout=120)
    with os.fdopen(read) as fh:
        info = json.loads(fh.read())
    info.update(returncode=job.returncode, out=out, err=err)
    return info


@pytest.mark.parametrize("form", ["script", "module", "code"])
def test_a_forked_job_sees_what_a_fresh_interpreter_sees(form: str, tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(PROBE)
    args = {"script": [str(tmp_path / "pkg" / "probe.py"), "a", "b"], "module": ["-m", "pkg.probe", "a", "b"],
            "code": ["-c", PROBE, "a", "b"]}[form]
    forked = _probe(python_executable(), args, tmp_path, exit_code=7)
    fresh = _probe(sys.executable, args, tmp_path, exit_code=7)
    assert forked.pop("preloaded") and not fresh.pop("preloaded")  # the zygote really ran it
    assert forked.pop("executable") == python_executable() and fresh.pop("executable") == sys.executable
    assert forked == fresh, (forked, fresh)
    assert forked["returncode"] == 7 and forked["out"] == "to stdout\n" and forked["err"] == "to stderr\n"
    assert (
        forked["stdin"] == "stdin data" and forked["main"] == "__main__" and forked["argv"][1:] == ["a", "b"]
    )
    assert forked["cpus"] == [0] and forked["policy"] == os.SCHED_IDLE and forked["nofile"][0] == 512


def test_an_import_time_variable_of_its_own_gets_a_fresh_interpreter(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    info = _probe(python_executable(), [str(tmp_path / "probe.py")], tmp_path, OMP_NUM_THREADS="2")
    assert not info["preloaded"] and info["executable"] == sys.executable


def test_a_job_adding_a_path_folder_or_asking_for_faulthandler_is_forked_as_python_would_run_it(
        tmp_path: Path) -> None:
    # what the FT launcher's groups (PYTHONFAULTHANDLER=1) and tests with helper modules (a folder put before
    # the suite's PYTHONPATH) start: still forked, with the sys.path and faulthandler a fresh interpreter has
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "extra_mod.py").write_text("WHERE = __file__\n")
    path = os.pathsep.join([str(tmp_path / "extra"), _env()["PYTHONPATH"]])
    env = {"PYTHONPATH": path, "PYTHONFAULTHANDLER": "1", "PROBE_EXTRA": "1"}
    forked = _probe(python_executable(), [str(tmp_path / "probe.py")], tmp_path, **env)
    fresh = _probe(sys.executable, [str(tmp_path / "probe.py")], tmp_path, **env)
    assert forked.pop("preloaded") and not fresh.pop("preloaded")
    assert forked.pop("executable") == python_executable() and fresh.pop("executable") == sys.executable
    assert forked == fresh, (forked, fresh)
    assert forked["faulthandler"] and forked["extra"] == str(tmp_path / "extra" / "extra_mod.py")
    assert forked["path"][1] == str(tmp_path / "extra")
    # a folder that would shadow a preloaded module, or a PYTHONPATH without the folder the package was
    # preloaded from: a fresh python
    (tmp_path / "shadow" / "lightning").mkdir(parents=True)
    shadow = os.pathsep.join([str(tmp_path / "shadow"), _env()["PYTHONPATH"]])
    probe = [str(tmp_path / "probe.py")]
    assert not _probe(python_executable(), probe, tmp_path, PYTHONPATH=shadow)["preloaded"]
    assert not _probe(python_executable(), probe, tmp_path, PYTHONPATH=str(tmp_path / "extra"))["preloaded"]


def test_what_a_job_starts_with_sys_executable_is_forked_too(tmp_path: Path) -> None:
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'import sys; print(\"lightning.pytorch\" in sys.modules)'], check=True)")
    proc = processes.run([python_executable(), "-c", code], env=_env(), cwd=tmp_path, timeout=120, check=True)
    assert proc.stdout.strip() == "True", proc


def test_signals_reach_the_job_and_its_death_is_the_clients(tmp_path: Path) -> None:
    code = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    with processes.start(
        [python_executable(), "-c", code], env=_env(), stdout=subprocess.PIPE, text=True
    ) as job:
        assert job.stdout is not None and job.stdout.readline() == "ready\n"
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=30) == 5
    proc = processes.run(
        [python_executable(), "-c", "import os; os.kill(os.getpid(), 9)"], env=_env(), timeout=60
    )
    assert proc.returncode == -signal.SIGKILL


def test_a_killed_client_takes_its_jobs_tree_with_it(tmp_path: Path) -> None:
    code = ("import subprocess, sys, os, time\n"
            "child = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
            "print(os.getpid(), child.pid, flush=True)\n"
            "time.sleep(300)\n")
    job = processes.start([python_executable(), "-c", code], env=_env(), stdout=subprocess.PIPE, text=True)
    assert job.stdout is not None
    pids = [int(p) for p in job.stdout.readline().split()]
    assert all(processes._alive(p) for p in pids)
    os.kill(job.pid, signal.SIGKILL)  # what a test's timeout does to its command
    job.wait(timeout=30)
    deadline = time.monotonic() + 20
    while any(processes._alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(processes._alive(p) for p in pids), pids


def test_the_server_refuses_what_it_cannot_reproduce() -> None:
    env = {"PYTHONPATH": "x", "OMP_NUM_THREADS": "1"}
    server = zygote._import_time_env(env)
    assert zygote._plan(["-u", "s.py", "a"], server, env, {}) == ("script", "s.py", ["s.py", "a"], None)
    assert zygote._plan(["-m", "m", "a"], server, env, {}) == ("-m", "m", ["m", "a"], None)
    assert zygote._plan(["-c", "pass", "a"], server, env, {}) == ("-c", "pass", ["-c", "a"], None)
    assert "flag -X" in zygote._plan(["-X", "dev", "s.py"], server, env, {})
    assert zygote._plan(["-u", "s.py", "a"], server, {**env, "PYTHONFAULTHANDLER": "1"}, {})[0] == "script"
    assert "differs" in zygote._plan(["s.py"], server, {**env, "PYTHONPATH": "y"}, {})
    # '' is the working folder
    assert "differs" in zygote._plan(["s.py"], server, {**env, "PYTHONPATH": "x:"}, {})
    assert zygote._plan(["s.py"], server, {**env, "PYTHONPATH": "x:x"}, {})[0] == "script"
    assert "differs" in zygote._plan(["s.py"], server, {**env, "TORCHINDUCTOR_X": "1"}, {})
    # what the server's own imports set (inductor's cache folder) does not count as a difference
    set_by_imports = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/t"}
    assert zygote._plan(["s.py"], server, {**env, **set_by_imports}, set_by_imports)[0] == "script"
