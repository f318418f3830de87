"""tests/support/processes.py and the leak check in tests/conftest.py: no test leaves a process behind.

The jobs here build the trees real tests make: a launcher whose worker moves to a session of its own (as
torchrun's workers and the FT launcher's groups do) and outlives it. The inner pytest sessions load
``tests/conftest.py`` as a plugin, so they run with the same subreaper and the same after-test check.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT
from support import processes

TESTS = Path(__file__).resolve().parent

# a launcher that starts a worker in a session of its own, then waits (or exits at once with "orphan")
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    pids = sys.argv[1]
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    with open(pids, "w") as fh:
        fh.write(f"{os.getpid()} {worker.pid}")
    if sys.argv[2] == "orphan":
        os._exit(0)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pids(path: Path, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(text := path.read_text().split()) == 2:
            return [int(p) for p in text]
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written")


def _gone(pids: list[int], timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


@pytest.mark.subprocess
def test_a_timeout_kills_the_whole_tree_even_a_worker_in_its_own_session(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    with pytest.raises(subprocess.TimeoutExpired):
        processes.run([sys.executable, "-c", LAUNCHER, str(pids_file), "wait"], timeout=5)
    pids = _pids(pids_file)
    assert _gone(pids), [p for p in pids if _alive(p)]


def test_plain_subprocess_run_leaves_the_worker_behind(tmp_path: Path) -> None:
    """The failure the helper exists for, shown with subprocess.run (then cleaned up here)."""
    pids_file = tmp_path / "pids"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", LAUNCHER, str(pids_file), "wait"], timeout=5)
    launcher, worker = _pids(pids_file)
    try:
        assert not _alive(launcher) and _alive(worker)
        assert worker in processes.leaked_processes()  # the subreaper adopted it: the check sees it
    finally:
        processes.kill_tree(worker)
    assert _gone([worker])


def _inner_pytest(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    test = tmp_path / "test_inner.py"
    test.write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return processes.start([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                            "--rootdir", str(tmp_path), str(test)], cwd=str(tmp_path), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.subprocess
def test_a_test_that_leaves_an_orphan_fails_and_the_orphan_is_killed(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    inner = _inner_pytest(tmp_path, f"""
        import subprocess, sys

        def test_leaks():
            subprocess.run([sys.executable, "-c", {LAUNCHER!r}, {str(pids_file)!r}, "orphan"], check=True)
    """)
    with inner:
        out, _ = inner.communicate(timeout=120)
    launcher, worker = _pids(pids_file)
    assert inner.returncode == 1, out
    assert "1 error" in out and "the test left 1 process(es) running" in out and str(worker) in out, out
    assert _gone([launcher, worker])


@pytest.mark.subprocess
def test_a_test_that_starts_a_process_without_a_marker_fails(tmp_path: Path) -> None:
    # `-m "not multiprocess"` (the Lightning-range run) must not pick up a test that starts processes unmarked
    inner = _inner_pytest(tmp_path, """
        import sys
        from support import processes
        import pytest

        def test_unmarked():
            processes.run([sys.executable, "-c", "pass"], timeout=60)

        @pytest.mark.subprocess
        def test_marked():
            processes.run([sys.executable, "-c", "pass"], timeout=60)
    """)
    with inner:
        out, _ = inner.communicate(timeout=120)
    assert inner.returncode == 1 and "1 failed, 1 passed" in out, out
    assert (
        "test_inner.py::test_unmarked starts a process" in out and "Fix: add @pytest.mark.multiprocess" in out
    ), out


@pytest.mark.subprocess
def test_ctrl_c_in_the_middle_of_a_test_leaves_no_process(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    inner = _inner_pytest(tmp_path, f"""
        import sys
        from support import processes
        import pytest

        @pytest.mark.subprocess
        def test_runs_a_long_job():
            processes.run([sys.executable, "-c", {LAUNCHER!r}, {str(pids_file)!r}, "wait"], timeout=600)
    """)
    with inner:
        pids = _pids(pids_file)
        assert all(_alive(p) for p in pids)
        inner.send_signal(signal.SIGINT)
        out, _ = inner.communicate(timeout=120)
    assert "KeyboardInterrupt" in out, out
    assert _gone(pids), [p for p in pids if _alive(p)]


# a group root with two ranks in sessions of their own (as torchrun starts them); the later-started rank kills
# its own group from inside with the launcher's kill_tree
SELF_KILLING_GROUP = textwrap.dedent("""
    import os, subprocess, sys, time
    pids = sys.argv[1]
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    killer = subprocess.Popen([sys.executable, "-c",
        "import os, sys, time; time.sleep(1); from fsdp_strategies.ft.launch.process_tree import kill_tree; "
        "kill_tree(os.getppid()); time.sleep(600)"], start_new_session=True)
    with open(pids, "w") as fh:
        fh.write(f"{sibling.pid} {killer.pid}")
    time.sleep(600)
""")


@pytest.mark.multiprocess
def test_a_rank_that_kills_its_own_group_takes_every_sibling_with_it(tmp_path: Path) -> None:
    # kill_tree walks the root's tree before signalling; a caller inside the tree must come last, or the ranks
    # after it in the walk (here the sibling, listed after the later-started killer) are never signalled and
    # live on as orphans of the nearest subreaper
    pids = tmp_path / "pids"
    with processes.start([sys.executable, "-c", SELF_KILLING_GROUP, str(pids)]) as job:
        sibling, killer = _pids(pids)
        assert job.wait(timeout=60) == -signal.SIGKILL
        assert _gone([sibling, killer]), "a rank of the group outlived its group's kill"


def test_free_port_is_outside_the_ephemeral_range_bindable_and_never_handed_out_twice() -> None:
    from conftest import _ephemeral_low, free_port

    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    assert all(p < _ephemeral_low() for p in ports)  # bind(0) and outgoing connections cannot take them
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
