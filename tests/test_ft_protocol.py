"""The strategy/launcher contract of :mod:`fsdp_strategies.ft.protocol`: one class writes and reads events,
one class reads and writes the environment (fast, no processes)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import fsdp_strategies
import fsdp_strategies.ft
from fsdp_strategies.ft.protocol import (
    EVENTS_ENV,
    LAUNCHER_PID_ENV,
    LEAVE_EXIT_CODE,
    LIGHTHOUSE_ENV,
    NUM_GROUPS_ENV,
    PREEMPT_EXIT_CODE,
    REPLICA_GROUP_ENV,
    RESTART_COUNT_ENV,
    STANDBY_ENV,
    TORCHFT_RUNTIME_DEFAULTS,
    EventLog,
    FTEnvironment,
    standby_ready_file,
    torchft_runtime_env,
    wait_for_activation,
)
from support import processes


def test_leaving_and_preemption_have_distinct_exit_codes() -> None:
    # the launcher restarts a group that left the quorum and requeues a preempted one: it must tell them apart
    assert PREEMPT_EXIT_CODE == 75  # EX_TEMPFAIL: what schedulers requeue
    assert LEAVE_EXIT_CODE != PREEMPT_EXIT_CODE and LEAVE_EXIT_CODE not in (0, 1, 2, 124, 130)
    assert fsdp_strategies.PREEMPT_EXIT_CODE == fsdp_strategies.ft.PREEMPT_EXIT_CODE == PREEMPT_EXIT_CODE
    assert fsdp_strategies.ft.LEAVE_EXIT_CODE == LEAVE_EXIT_CODE


def test_environment_round_trip_and_bad_numbers() -> None:
    env = FTEnvironment(lighthouse_addr="http://h:1", replica_group_id=1, num_replica_groups=3,
                        events_file="/tmp/g1.jsonl", restart_count=2)
    assert set(env.to_env()) == {LIGHTHOUSE_ENV, REPLICA_GROUP_ENV, NUM_GROUPS_ENV, EVENTS_ENV,
                                 RESTART_COUNT_ENV}
    assert FTEnvironment.from_env(env.to_env()) == env
    assert FTEnvironment.from_env({}) == FTEnvironment()
    with pytest.raises(ValueError, match=r"REPLICA_GROUP_ID='one' is not an integer. Fix"):
        FTEnvironment.from_env({REPLICA_GROUP_ENV: "one"})
    spare = FTEnvironment(
        replica_group_id=0, standby_file="/tmp/g0.spare1.go", launcher_pid=123, restart_count=1
    )
    assert {STANDBY_ENV, LAUNCHER_PID_ENV} <= set(spare.to_env())
    assert FTEnvironment.from_env(spare.to_env()) == spare


def test_a_warm_spare_waits_until_activated_and_says_it_is_ready(tmp_path: Path) -> None:
    assert wait_for_activation(FTEnvironment()) == 0.0  # not a spare: no wait
    go = tmp_path / "group1.spare1.go"
    env = FTEnvironment(standby_file=str(go), launcher_pid=None)
    ready_seen: list[bool] = []

    def activate() -> None:
        deadline = time.monotonic() + 10
        while not standby_ready_file(go).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        ready_seen.append(standby_ready_file(go).exists())
        time.sleep(0.3)
        go.touch()

    t = threading.Thread(target=activate)
    t.start()
    waited = wait_for_activation(env)
    t.join()
    assert ready_seen == [True] and go.exists() and waited >= 0.3


def test_a_warm_spare_whose_launcher_is_gone_exits(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process any more
    env = FTEnvironment(standby_file=str(tmp_path / "never.go"), launcher_pid=dead.pid)
    with pytest.raises(SystemExit, match=rf"its launcher \(pid {dead.pid}\) is gone before activating it"):
        wait_for_activation(env)


def test_events_written_by_the_group_are_what_the_launcher_reads(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "group0.jsonl")
    assert log.last_committed_step() == -1 and not log.finished()
    log.write_step(0, 1, True, data_step=0, data_missed_samples=8, data_redistributed_samples=0)
    log.write_step(0, 1, False, data_step=1)
    log.write_step(0, 2, True, data_step=1, data_missed_samples=8, data_redistributed_samples=0)
    with log.path.open("a") as fh:
        fh.write('{"t": 1, "committed": tr')  # a line cut short by a SIGKILL
    assert log.last_committed_step() == 2
    assert log.last_committed_step(since=2e9) == -1  # records of an earlier incarnation do not count
    log.write_left(0, "straggler")
    assert not log.finished()
    log.write_finished(0, 2)
    assert log.finished()
    EventLog(tmp_path / "group1.jsonl").write_step(1, 2, True, data_step=1, data_missed_samples=8,
                                                   data_redistributed_samples=4)
    summary = EventLog.data_summary(tmp_path)
    assert summary == {"committed_steps": 2, "missed_samples": 16, "missed_stretches": [[0, 1, 16]],
                       "redistributed_samples": 4}
    left = EventLog(tmp_path / "group2.jsonl")
    assert left.left_since() is None
    left.write_left(2, "evicted as a straggler", step=7)
    assert left.left_since() == "evicted as a straggler"
    assert left.left_since(since=2e9) is None  # a record of an earlier incarnation does not count


@pytest.mark.subprocess
def test_an_activated_spare_leaves_idle_scheduling_on_every_thread() -> None:
    # the launcher starts a spare under SCHED_IDLE; activation puts every thread (those started before too)
    # back to SCHED_OTHER -- or, without the privilege to do so, warns with the fix
    code = (
        "import os, threading, time, warnings, json\n"
        "from fsdp_strategies.ft.protocol import restore_normal_scheduling\n"
        "stop = threading.Event(); t = threading.Thread(target=stop.wait); t.start()\n"
        "before = [os.sched_getscheduler(int(x)) for x in os.listdir('/proc/self/task')]\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always'); restore_normal_scheduling()\n"
        "after = [os.sched_getscheduler(int(x)) for x in os.listdir('/proc/self/task')]\n"
        "stop.set(); t.join()\n"
        "print(json.dumps({'before': before, 'after': after, 'warnings': [str(x.message) for x in w]}))\n"
    )
    proc = processes.run([sys.executable, "-c", code], timeout=120, check=True,
                         preexec_fn=lambda: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)))
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(seen["before"]) >= 2 and set(seen["before"]) == {os.SCHED_IDLE}, seen
    if os.geteuid() == 0:
        assert set(seen["after"]) == {os.SCHED_OTHER} and not seen["warnings"], seen
    else:
        assert seen["warnings"] and "ulimit -e 20" in seen["warnings"][0], seen


def test_a_writer_keeps_its_file_open_and_follows_a_removed_or_replaced_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One open per file, not per line (a step's events line cost most of its events time in opens); a
    removed or replaced file is opened again, so no line goes to a file nobody reads; two writers of one
    file (a group's next incarnation beside a dying one) append whole lines."""
    opened: list[Path] = []
    real_open = Path.open

    def counting_open(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "a" in mode:  # the writer's opens (readers and the test's own files aside)
            opened.append(self)
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", counting_open)
    path = tmp_path / "run" / "group0.jsonl"  # its folder does not exist yet
    writer = EventLog(path)
    for step in range(1, 6):
        writer.write_step(0, step, committed=True)
    assert opened == [path] and [r["step"] for r in EventLog(path).records()] == [1, 2, 3, 4, 5]
    path.unlink()  # removed (a test, an operator): the next line starts a new file
    writer.write_step(0, 6, committed=True)
    assert [r["step"] for r in EventLog(path).records()] == [6]
    replacement = tmp_path / "new.jsonl"
    replacement.write_text("")
    replacement.replace(path)  # replaced by another file: followed
    writer.write_step(0, 7, committed=True)
    other = EventLog(path)
    other.write_step(0, 8, committed=True)
    writer.write_step(0, 9, committed=True)
    assert [r["step"] for r in EventLog(path).records()] == [7, 8, 9] and len(opened) == 4
    writer.close()
    other.close()
    writer.write_finished(0, 9)  # after close: opened again
    assert EventLog(path).finished() and len(opened) == 5
    copied = copy.deepcopy(writer)  # a copy (a pickled strategy) does not share the open file
    copied.write_left(0, "test")
    assert len(opened) == 6 and [r.get("left") for r in EventLog(path).records()][-1] == "test"


def test_a_kept_reader_sees_only_complete_records_as_they_are_appended(tmp_path: Path) -> None:
    # the launcher keeps one EventLog per group and asks it several times per 50 ms loop: it must read only
    # what was appended, hold back a line still being written, skip a line cut short by a kill, and start over
    # on a new job's (shorter) file
    path = tmp_path / "group0.jsonl"
    writer, reader = EventLog(path), EventLog(path)
    assert reader.last_committed_step() == -1 and not reader.finished()  # no file yet
    for step in (1, 2):
        writer.write_step(0, step, committed=True)
    writer.write_step(0, 3, committed=False)
    assert reader.last_committed_step() == 2
    started = time.time()
    with path.open("a") as fh:  # a line in the middle of being written: not a record yet
        fh.write(json.dumps({"t": started, "group": 0, "step": 9})[:-1] + ', "comm')
    assert reader.last_committed_step() == 2 and len(list(reader.records())) == 3
    with path.open("a") as fh:  # its writer was killed; the next incarnation's line lands on the same line
        fh.write(json.dumps({"t": started, "group": 0, "step": 10, "committed": True}) + "\n")
    writer.write_step(0, 11, committed=True)
    assert reader.last_committed_step() == 11
    # the broken line is skipped, as a fresh reader does
    assert [r["step"] for r in reader.records()] == [1, 2, 3, 11]
    assert [r["step"] for r in EventLog(path).records()] == [1, 2, 3, 11]
    assert (
        reader.last_committed_step(since=started) == 11
        and reader.last_committed_step(since=time.time() + 60) == -1
    )
    writer.write_finished(0, 11)
    assert reader.finished()
    path.write_text("")  # a new job's file
    writer.write_step(0, 1, committed=True)
    assert reader.last_committed_step() == 1 and not reader.finished()


def test_torchft_runtime_env_fills_only_what_the_environment_leaves_unset_and_removes_it_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKIO_WORKER_THREADS", raising=False)
    monkeypatch.setenv("RUST_LOG", "debug")  # the user's choice wins
    with torchft_runtime_env() as env:
        assert env == {"RUST_LOG": "debug", "TOKIO_WORKER_THREADS": "1"}
        assert os.environ["TOKIO_WORKER_THREADS"] == "1"
    assert "TOKIO_WORKER_THREADS" not in os.environ  # nothing else in the process inherits the default
    assert os.environ["RUST_LOG"] == "debug"


#: a real lighthouse started under torchft_runtime_env in a fresh interpreter (torchft reads RUST_LOG when it
#: is first imported), one quorum asked of it; prints the lighthouse runtime's threads
_LIGHTHOUSE = """
import os
from datetime import timedelta
from fsdp_strategies.ft.protocol import torchft_runtime_env
with torchft_runtime_env():
    from torchft.coordination import LighthouseClient, LighthouseServer
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
client = LighthouseClient(server.address(), connect_timeout=timedelta(seconds=10))
assert client.quorum(replica_id="a", timeout=timedelta(seconds=10)).quorum_id == 1
import time
def workers():  # a new thread names itself once it first runs: wait until the count holds for a second
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:
            pass
    return names.count("torchft-lighths")
seen, since, t0 = workers(), time.monotonic(), time.monotonic()
while time.monotonic() - since < 1.0 and time.monotonic() - t0 < 20:
    time.sleep(0.05)
    if workers() != seen:
        seen, since = workers(), time.monotonic()
print("threads", seen)
"""


@pytest.mark.parametrize("user_env", [{}, {"RUST_LOG": "info", "TOKIO_WORKER_THREADS": "3"}],
                         ids=["defaults", "user_set"])
def test_torchft_started_under_the_runtime_env_logs_warnings_only_and_runs_one_thread(
        user_env: dict[str, str]) -> None:
    """torchft's default (``info``) logs every quorum and commit vote from a runtime thread, each runtime has
    min(4, CPUs) workers: by default here ``warn`` and one worker; a user's RUST_LOG / TOKIO_WORKER_THREADS
    win."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHFT_RUNTIME_DEFAULTS} | user_env
    out = subprocess.run([sys.executable, "-c", _LIGHTHOUSE], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    threads = int(out.stdout.split("threads")[1])
    info_lines = [line for line in out.stderr.splitlines() if "[INFO] [torchft::lighthouse]" in line]
    if user_env:
        assert threads == 3 and info_lines, (threads, out.stderr[-2000:])
    else:
        assert threads == 1, threads
        assert not info_lines, info_lines[:3]
