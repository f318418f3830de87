"""The ft_scale suite (benchmarks/suites/ft_scale.py) in quick mode, so the scaling harness cannot rot.

The real torchft lighthouse and N simulated replica groups (Rust ManagerServer + ManagerClient per group) run
the per-step protocol; a victim group is SIGKILLed and restarted. Checks the result file's structure and
sanity -- every group reached the quorum, latencies are real positive numbers, the killed group was dropped
from a later quorum, the survivors committed after the kill, the restarted group healed -- and never a timing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT, run_python
from support import zygote

BENCH = ROOT / "benchmarks"


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and value > 0


@pytest.mark.multiprocess
def test_quick_sweep_reaches_quorum_drops_the_killed_group_and_heals_it(tmp_path: Path) -> None:
    # unforked (tests/support/zygote.py): the suite picks its victim by matching the pid its Popen
    # returned with the pid
    # the group's process records itself, which a forked job cannot share with its client
    proc = run_python(["benchmarks/suites/ft_scale.py", "--quick", "--out-dir", str(tmp_path)], timeout=240,
                      env={zygote.SOCKET_ENV: "off"})
    result = json.loads((tmp_path / "ft_scale-cpu.json").read_text())
    assert (tmp_path / "ft_scale-cpu.png").stat().st_size > 0
    assert result["suite"] == "ft_scale" and result["config"]["groups"] == [2, 8], proc.stderr[-2000:]
    assert result["failures"] == [], result["failures"]
    assert result["largest_n"] == 8 and result["real_groups"] == {"skipped": "quick mode"}
    assert [s["n"] for s in result["sweep"]] == [2, 8]
    for s in result["sweep"]:
        n = s["n"]
        assert s["status"] == "ok", s["error"]
        assert s["groups_committed"] == n  # every group committed a step
        assert s["full_quorum_after_s"] >= 0  # and a quorum held all N of them
        for key in ("quorum_s", "commit_s", "step_s"):
            assert s[key]["count"] > 0 and _positive(s[key]["p50"]) and s[key]["p99"] >= s[key]["p50"], (
                n,
                key,
                s[key],
            )
        assert s["step_s"]["p50"] >= result["config"]["step_s"]  # a step contains its simulated training
        assert s["faults_injected"] >= 1 and len(s["faults"]) == s["faults_injected"]
        for fault in s["faults"]:
            assert fault["replica_id"] and fault["replica_id"].startswith(f"ft_hsdp_{fault['group']}:")
            assert fault["dropped"], fault  # a later quorum lacked the killed incarnation's replica id
            assert _positive(fault["kill_to_next_commit_s"]), fault  # the survivors committed after the kill
            # the restart healed
            assert _positive(fault["heal_s"]) and fault["heal_handshake_s"] is not None, fault
        assert _positive(s["lighthouse"]["rss_bytes_max"]) and s["lighthouse"]["cpu_s_per_s"] is not None
        assert s["events"]["files"] == n and s["events"]["records"] > 0
        assert s["launcher"] == {"skipped": "quick mode (the loop's process imports torch and Lightning)"}
    assert any(row["ratio"].startswith("N=8: quorum latency") for row in result["summary"])


def test_a_fault_whose_group_stays_in_every_later_quorum_is_not_dropped() -> None:
    from suites.ft_scale import _fault_figures

    killed = "ft_hsdp_0:old"

    def step(t: float, q: int, **extra: object) -> dict[str, object]:
        return {"t": t, "committed": True, "quorum_id": q, "participants": 2, "pid": 7, **extra}

    timelines = {
        0: [{"t": 0.0, "started": True, "replica_id": killed, "pid": 5}],
        1: [
            step(1.0, 1, members=[killed, "ft_hsdp_1:x"]),
            step(2.0, 1),
            step(3.5, 2, members=[killed, "ft_hsdp_1:x"]),
        ],
    }
    fault = {"t": 2.5, "group": 0, "pid": 5, "new_pid": 9, "restart_t": 2.6}
    still_there = _fault_figures(dict(fault), timelines, [1], 2)
    assert still_there["dropped"] is False and still_there["kill_to_next_commit_s"] is None
    assert still_there["heal_s"] is None  # the restarted incarnation (pid 9) never committed
    timelines[1].append(step(4.0, 3, members=["ft_hsdp_1:x"]))
    timelines[0] += [{"t": 4.2, "started": True, "replica_id": "ft_hsdp_0:new", "pid": 9},
                     step(5.0, 4, pid=9, heal_s=0.01)]
    dropped = _fault_figures(dict(fault), timelines, [1], 2)
    assert dropped["dropped"] is True and dropped["kill_to_next_commit_s"] == pytest.approx(1.5)
    assert dropped["heal_s"] == pytest.approx(2.4) and dropped["heal_handshake_s"] == 0.01


def test_the_launchers_event_readers_keep_no_records_and_look_once_per_pass(tmp_path: Path) -> None:
    # the bottleneck ft_scale found in this package: a kept reader held every parsed record (~1.5 KB per
    # group-step, GiBs an hour at 1,024 groups) and looked at its file 2-3 times per launcher pass
    import tracemalloc

    from fsdp_strategies.ft.launch.launcher import LOOK_EVERY_S, LOOP_S
    from fsdp_strategies.ft.protocol import EventLog

    assert 0 < LOOK_EVERY_S < LOOP_S  # every pass of the loop still sees what was appended before it
    path = tmp_path / "group0.jsonl"
    extra = {f"data_{k}": k for k in range(12)}  # a real step record's size
    path.write_text("".join(json.dumps({"t": 1.0 + i, "group": 0, "step": i, "committed": True,
                                        **extra}) + "\n"
                            for i in range(20_000)))
    reader = EventLog(path, max_age_s=3600)
    tracemalloc.start()
    try:
        assert reader.last_committed_step() == 19_999
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 2 * 2**20, kept  # 16 bytes per committed step (the old reader kept ~30 MiB here)
    # records() reads the file: nothing was needed in memory
    assert sum(1 for _ in reader.records()) == 20_000
    EventLog(path).write_step(0, 20_000, committed=True)
    EventLog(path).write_left(0, "evicted")
    assert reader.last_committed_step() == 19_999  # within max_age_s: the last look is reused
    assert reader.left_since() == "evicted"  # asked after an exit: always a fresh look
    assert reader.last_committed_step() == 20_000
