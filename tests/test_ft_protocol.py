"""The strategy/launcher contract of :mod:`fsdp_strategies.ft.protocol`: one class writes and reads events,
one class reads and writes the environment (fast, no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_strategies.ft.protocol import (
    EVENTS_ENV,
    LIGHTHOUSE_ENV,
    NUM_GROUPS_ENV,
    REPLICA_GROUP_ENV,
    RESTART_COUNT_ENV,
    EventLog,
    FTEnvironment,
)


def test_environment_round_trip_and_bad_numbers() -> None:
    env = FTEnvironment(lighthouse_addr="http://h:1", replica_group_id=1, num_replica_groups=3,
                        events_file="/tmp/g1.jsonl", restart_count=2)
    assert set(env.to_env()) == {LIGHTHOUSE_ENV, REPLICA_GROUP_ENV, NUM_GROUPS_ENV, EVENTS_ENV, RESTART_COUNT_ENV}
    assert FTEnvironment.from_env(env.to_env()) == env
    assert FTEnvironment.from_env({}) == FTEnvironment()
    with pytest.raises(ValueError, match=r"REPLICA_GROUP_ID='one' is not an integer. Fix"):
        FTEnvironment.from_env({REPLICA_GROUP_ENV: "one"})


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
