"""``fsdp-strategies-ft`` when a replica group exhausts ``--max-restarts``: real processes, no training.

The worker (``tests/workers/ft_fail.py``) fails at once with a Python error in the groups named by
``FT_FAIL_GROUPS``; the others exit 0 after a few seconds, as a group that finished its training would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import WORKERS, run_python
from fsdp_strategies.ft.launcher import _last_error_line, core_sets


def test_a_group_that_gives_up_fails_the_job_and_says_why(tmp_path: Path) -> None:
    events = tmp_path / "events"
    proc = run_python(["-m", "fsdp_strategies.ft", "--groups", "2", "--max-restarts", "1", "--runner",
                       "lightning", "--events-dir", str(events), "--timeout", "200", "--",
                       str(WORKERS / "ft_fail.py")],
                      env={"FT_FAIL_GROUPS": "0", "FT_OK_SLEEP": "6"}, timeout=300, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("fsdp-strategies-ft: FAILED: replica group 0 exhausted --max-restarts 1 (exit codes [1, 1]); "
                    "last error: RuntimeError: cannot read the dataset shard of group 0 (restart 1)"), last
    assert (f"replica group 0 gave up: it exited 1 after 1 restart(s) (--max-restarts 1). Last error: RuntimeError: "
            f"cannot read the dataset shard of group 0 (restart 1) (log: {events / 'group0.log'})") in proc.stderr
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
    assert _last_error_line(log) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    log.write_text("\n===== start #0: python x.py\nKilled\n")
    assert _last_error_line(log) == "Killed"
    assert _last_error_line(tmp_path / "missing.log") == "(no log)"


def test_pin_cores_gives_each_group_its_cpus_and_a_restart_the_same_ones(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    spec = "auto" if len(allowed) >= 2 else f"{allowed[0]};{allowed[0]}"
    expected = core_sets(spec, 2)
    assert expected is not None and len(expected) == 2
    if spec == "auto":  # the groups' CPUs do not overlap
        assert not set(expected[0]) & set(expected[1])
    events = tmp_path / "events"
    proc = run_python(["-m", "fsdp_strategies.ft", "--groups", "2", "--max-restarts", "1", "--runner",
                       "lightning", "--pin-cores", spec, "--events-dir", str(events), "--timeout", "200", "--",
                       str(WORKERS / "ft_fail.py")],
                      env={"FT_FAIL_GROUPS": "0", "FT_OK_SLEEP": "2", "FT_AFFINITY_DIR": str(tmp_path)}, timeout=300,
                      check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]  # group 0 gives up after its restart, as designed
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("group*-start*.json")}
    # what each process really got from the kernel, a restart included
    assert seen == {"group0-start0": expected[0], "group0-start1": expected[0], "group1-start0": expected[1]}, seen
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
