"""``fsdp-strategies-ft`` supervising replica groups: real processes, no training.

The worker (``tests/workers/ft_fail.py``) fails at once with a Python error in the groups named by
``FT_FAIL_GROUPS``; the others exit 0 after a few seconds, as a group that finished its training would.
``_EXITS`` is a group that leaves the quorum, is preempted or finishes, as its plan says for each start.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from conftest import WORKERS, run_python
from fsdp_strategies.ft.launch.group_exit import (
    GroupExit,
    classify_exit,
    last_error_line,
    torchrun_worker_exit_code,
)
from fsdp_strategies.ft.launch.options import core_sets
from fsdp_strategies.ft.leave import restart_cannot_fix
from fsdp_strategies.ft.protocol import LEAVE_EXIT_CODE, PREEMPT_EXIT_CODE, UNFIXABLE_EXIT_CODE


@pytest.mark.multiprocess
def test_a_group_that_gives_up_fails_the_job_and_says_why(tmp_path: Path) -> None:
    events = tmp_path / "events"
    proc = run_python(["-m", "fsdp_strategies.ft", "--groups", "2", "--max-restarts", "1", "--runner",
                       "lightning", "--events-dir", str(events), "--timeout", "200", "--",
                       str(WORKERS / "ft_fail.py")],
                      env={"FT_FAIL_GROUPS": "0", "FT_OK_SLEEP": "6"}, timeout=300, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("fsdp-strategies-ft: FAILED: replica group 0 "
                    "gave up after 1 restart(s) (--max-restarts 1) "
                    "(exit codes [1, 1]); "
                    "last error: RuntimeError: cannot read the dataset shard of group 0 (restart 1)"), last
    assert (
        "replica group 0 gave up: it exited 1 after 1 restart(s) "
        "(--max-restarts 1). Last error: RuntimeError: "
        f"cannot read the dataset shard of group 0 (restart 1) (log: {events / 'group0.log'})"
    ) in proc.stderr
    records = [json.loads(line) for line in (events / "launcher.jsonl").read_text().splitlines()]
    [give_up] = [r for r in records if r["event"] == "give_up"]
    assert give_up["group"] == 0 and give_up["last_error"].startswith("RuntimeError: cannot read")
    # the healthy group is not mistaken for one that never joined a finished job: it runs to its own end
    assert {"event": "exit", "group": 1, "code": 0} in [{k: r.get(k) for k in ("event", "group", "code")}
                                                         for r in records]
    assert not [r for r in records if r["event"] == "kill"]


def test_last_error_line_skips_torchrun_summary(tmp_path: Path) -> None:
    log = tmp_path / "group0.log"
    log.write_text("\n===== start #0: torchrun ...\n[rank0]: ValueError: an older failure\n"
                   "\n===== start #1: torchrun ...\nloading\n[rank0]: Traceback (most recent call last):\n"
                   '[rank0]:   File "train.py", line 3, in <module>\n'
                   "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
                   "Traceback (most recent call last):\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                   "============================================================\ntrain.py FAILED\n")
    assert last_error_line(log) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    log.write_text("\n===== start #0: python x.py\nKilled\n")
    assert last_error_line(log) == "Killed"
    assert last_error_line(tmp_path / "missing.log") == "(no log)"


@pytest.mark.multiprocess
def test_pin_cores_gives_each_group_its_cpus_and_a_restart_the_same_ones(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    spec = "auto" if len(allowed) >= 2 else f"{allowed[0]};{allowed[0]}"
    expected = core_sets(spec, 2)
    assert expected is not None and len(expected) == 2
    if spec == "auto":  # the groups' CPUs do not overlap
        assert not set(expected[0]) & set(expected[1])
    events = tmp_path / "events"
    proc = run_python(["-m", "fsdp_strategies.ft", "--groups", "2", "--max-restarts", "1", "--runner",
                       "lightning", "--pin-cores", spec, "--events-dir", str(events), "--timeout", "200",
                       "--", str(WORKERS / "ft_fail.py")],
                      env={"FT_FAIL_GROUPS": "0", "FT_OK_SLEEP": "2", "FT_AFFINITY_DIR": str(tmp_path)},
                      timeout=300, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]  # group 0 gives up after its restart, as designed
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("group*-start*.json")}
    # what each process really got from the kernel, a restart included
    assert seen == {
        "group0-start0": expected[0],
        "group0-start1": expected[0],
        "group1-start0": expected[1],
    }, seen
    starts = [json.loads(line) for line in (events / "launcher.jsonl").read_text().splitlines()]
    assert sorted((r["group"], r["cores"]) for r in starts if r["event"] == "start") == sorted(
        [(0, expected[0]), (0, expected[0]), (1, expected[1])])


@pytest.mark.parametrize(("spec", "groups", "message"), [
    ("0;0;0", 2, "3 CPU lists for 2 replica groups"),
    ("0;x", 2, "'x' is not a CPU list"),
    ("0;9999", 2, "CPUs [9999] are not available to this process"),
    ("auto", 9999, "9999 replica groups but this process may use only"),
])
def test_bad_pin_cores_is_refused_with_the_fix(spec: str, groups: int, message: str) -> None:
    with pytest.raises(SystemExit) as err:
        core_sets(spec, groups)
    assert message in str(err.value) and "Fix:" in str(err.value) and "--pin-cores" in str(err.value)


def test_pin_cores_parsing() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert core_sets("none", 2) is None
    assert core_sets(f"{allowed[0]};{allowed[0]}", 2) == [[allowed[0]], [allowed[0]]]
    assert core_sets(f"{allowed[0]}-{allowed[-1]}", 1) == [allowed]
    per = len(allowed) // 2
    if per:
        assert core_sets("auto", 2) == [allowed[:per], allowed[per:2 * per]]


# A replica group that does, at each start, what FT_PLAN says ("0:leave,preempt;1:preempt": group 0 leaves the
# quorum at its first start and is preempted at its second; group 1 is preempted at once). Without the
# package's imports (fast); a leave writes the events file's `left` record as the strategy does when
# FT_WRITE_LEFT is set (under torchrun the launcher sees only torchrun's own status, 1).
_EXITS = textwrap.dedent("""
    import json, os, sys, time
    group, start = os.environ["REPLICA_GROUP_ID"], int(os.environ["FT_RESTART_COUNT"])
    plan = dict(item.split(":") for item in os.environ["FT_PLAN"].split(";"))
    action = plan[group].split(",")[start]
    print(f"group {group} start #{start}: {action}", flush=True)
    if action == "leave":
        if os.environ.get("FT_WRITE_LEFT"):
            with open(os.environ["FSDP_STRATEGIES_FT_EVENTS"], "a") as fh:
                fh.write(json.dumps({"t": time.time(), "group": int(group),
                                     "left": "evicted as a straggler"}) + "\\n")
        sys.exit(int(os.environ["FT_LEAVE_CODE"]))
    sys.exit(int(os.environ["FT_PREEMPT_CODE"]) if action == "preempt" else 0)
""")


@pytest.mark.parametrize(("runner", "plan", "returncode"), [
    # nobody finishes training: the job ends with the requeue status
    ("lightning", "0:leave,preempt;1:preempt", PREEMPT_EXIT_CODE),
    # the evicted group comes back and finishes: the job is done, although group 1 was preempted
    ("torchrun", "0:leave,finish;1:preempt", 0),
])
@pytest.mark.multiprocess
def test_a_group_that_left_is_restarted_and_a_preempted_one_is_not(tmp_path: Path, runner: str, plan: str,
                                                                     returncode: int) -> None:
    script = tmp_path / "group.py"
    script.write_text(_EXITS)
    events = tmp_path / "events"
    proc = run_python(["-m", "fsdp_strategies.ft", "--groups", "2", "--max-restarts", "3", "--runner", runner,
                       "--events-dir", str(events), "--timeout", "200", "--", str(script)],
                      env={"FT_PLAN": plan, "FT_LEAVE_CODE": str(LEAVE_EXIT_CODE),
                           "FT_PREEMPT_CODE": str(PREEMPT_EXIT_CODE),
                           "FT_WRITE_LEFT": "1" if runner == "torchrun" else ""},
                      timeout=300, check=False)
    assert proc.returncode == returncode, proc.stderr[-3000:]
    records = [json.loads(line) for line in (events / "launcher.jsonl").read_text().splitlines()]
    exits = [(r["group"], r["kind"]) for r in records if r["event"] == "exit"]
    last = plan.split(";")[0].split(",")[-1]
    assert exits.count((0, "left")) == 1 and exits.index((0, "left")) < exits.index(
        (0, "preempted" if last == "preempt" else "finished")
    ), exits
    assert sorted(exits) == sorted([(0, "left"), (0, "finished" if last == "finish" else "preempted"),
                                    (1, "preempted")]), exits
    assert sorted((r["group"], r["restart"]) for r in records if r["event"] == "start") == [
        (0, 0),
        (0, 1),
        (1, 0),
    ]
    assert sorted(r["group"] for r in records if r["event"] == "not_restarted"
                  and r["why"].startswith("preempted")) == ([0, 1] if last == "preempt" else [1])
    if runner == "torchrun":  # the leave was read from the events file: its reason is in the exit record
        assert [r.get("left") for r in records if r["event"] == "exit" and r["kind"] == "left"] == [
            "evicted as a straggler"]
    assert not [r for r in records if r["event"] in ("give_up", "kill")]


_TORCHRUN_FAILURE = ("\n===== start #0: python -m torch.distributed.run ... train.py\n"
                     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                     "============================================================\ntrain.py FAILED\n"
                     "------------------------------------------------------------\nFailures:\n"
                     "  <NO_OTHER_FAILURES>\n------------------------------------------------------------\n"
                     "Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-25_11:45:50\n"
                     "  host      : localhost\n  rank      : 1 "
                     "(local_rank: 1)\n  exitcode  : {code} (pid: 9848)\n"
                     "  error_file: <N/A>\n============================================================\n")


def test_exit_kinds_from_the_status_the_events_and_torchruns_summary(tmp_path: Path) -> None:
    log = tmp_path / "group0.log"
    log.write_text("\n===== start #0: python train.py\n")
    assert classify_exit(0, log, left=False) is GroupExit.FINISHED
    assert classify_exit(LEAVE_EXIT_CODE, log, left=False) is GroupExit.LEFT
    assert classify_exit(1, log, left=True) is GroupExit.LEFT  # torchrun's 1 after a `left` record
    assert classify_exit(PREEMPT_EXIT_CODE, log, left=False) is GroupExit.PREEMPTED
    assert classify_exit(1, log, left=False) is GroupExit.FAILED
    assert classify_exit(-9, log, left=False) is GroupExit.FAILED  # a fault's SIGKILL
    # torchrun exits 1 for any failure of its workers: their status is read from its summary of the latest
    # start
    log.write_text(_TORCHRUN_FAILURE.format(code=PREEMPT_EXIT_CODE))
    assert torchrun_worker_exit_code(log) == PREEMPT_EXIT_CODE
    assert classify_exit(1, log, left=False) is GroupExit.PREEMPTED
    log.write_text(
        _TORCHRUN_FAILURE.format(code=1) + "\n===== start #1: python -m torch.distributed.run ...\n"
    )
    assert torchrun_worker_exit_code(log) is None  # an earlier start's summary does not count
    assert classify_exit(1, log, left=False) is GroupExit.FAILED
    assert torchrun_worker_exit_code(tmp_path / "missing.log") is None
    log.write_text(_TORCHRUN_FAILURE.format(code=UNFIXABLE_EXIT_CODE))
    assert classify_exit(1, log, left=False) is GroupExit.UNFIXABLE
    assert classify_exit(UNFIXABLE_EXIT_CODE, log, left=False) is GroupExit.UNFIXABLE


def test_errors_a_restart_cannot_fix(tmp_path: Path) -> None:
    import errno

    from fsdp_strategies._options import OptionError
    from fsdp_strategies.checkpoint.disk_full import CheckpointDiskFullError
    from fsdp_strategies.checkpoint.integrity import CheckpointIntegrityError
    from fsdp_strategies.hf.pretrained import PretrainedFolderNotFoundError, PretrainedMismatchError
    from fsdp_strategies.memory.budget import BudgetNotMetError
    from fsdp_strategies.parallel.tensor_parallel import TensorParallelPlanError

    def raised_from(cause: BaseException) -> BaseException:
        try:
            raise RuntimeError("while saving") from cause
        except RuntimeError as err:
            return err

    unfixable = [OptionError("x=0 is not allowed. Fix: x >= 1"), TensorParallelPlanError("no module matches"),
                 CheckpointDiskFullError("full"), OSError(errno.ENOSPC, "No space left on device"),
                 OSError(errno.EDQUOT, "Disk quota exceeded"), CheckpointIntegrityError("damaged"),
                 PretrainedFolderNotFoundError("missing"), PretrainedMismatchError("shapes"),
                 BudgetNotMetError("below the floor"), raised_from(OSError(errno.ENOSPC, "full"))]
    for error in unfixable:
        assert restart_cannot_fix(error), error
    # what a restart may well fix: a peer that died, a flaky read, a killed rank, a NaN
    for error in (RuntimeError("Connection closed by peer"), OSError(errno.EIO, "I/O error"),
                  ConnectionError("lighthouse"), KeyboardInterrupt(), ValueError("nan loss")):
        assert not restart_cannot_fix(error), error


_STUCK = textwrap.dedent("""\
    import os, threading, time

    def stuck_after_training():  # a rank that never returns (the launcher's --timeout must find it)
        time.sleep(1000)

    def side_thread_waits():
        time.sleep(1000)

    threading.Thread(target=side_thread_waits, daemon=True).start()
    print(f"rank {os.environ.get('RANK')} ready", flush=True)
    stuck_after_training()
""")


@pytest.mark.parametrize("runner", ["torchrun", "forkserver"])
@pytest.mark.multiprocess
def test_the_timeout_prints_every_stuck_ranks_stacks_into_its_log(tmp_path: Path, runner: str) -> None:
    # A group that never exits: at --timeout the launcher makes each of its processes print the Python stacks
    # of all its threads into the group's log (SIGABRT + PYTHONFAULTHANDLER, no core file), then ends the job
    # with 124 and says where the stacks are.
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK)
    events = tmp_path / "events"
    proc = run_python(["-m", "fsdp_strategies.ft", "--groups", "1", "--ranks-per-group", "2",
                       "--runner", runner, "--events-dir", str(events), "--timeout", "10", "--", str(script)],
                      timeout=120, check=False, cwd=tmp_path)
    assert proc.returncode == 124, proc.stderr[-3000:]
    log = (events / "group0.log").read_text()
    assert log.count("rank") >= 2 and "rank 0 ready" in log and "rank 1 ready" in log, log[-3000:]
    assert log.count("in stuck_after_training") == 2, log[-4000:]  # each rank's main thread ...
    assert log.count("in side_thread_waits") == 2, log[-4000:]  # ... and its other threads
    assert f"the Python stacks of its processes are at the end of {events / 'group0.log'}" in proc.stderr
    records = [json.loads(line) for line in (events / "launcher.jsonl").read_text().splitlines()]
    assert [r["group"] for r in records if r["event"] == "stacks"] == [0]
    assert not list(tmp_path.glob("core*")), "no core file is left behind"
