"""``ft_hsdp``'s step protocol (:class:`fsdp_strategies.ft.step.FTStep`) in one process, with a fake manager.

What the real runs (tests/test_ft_*.py) cannot show directly: the call order torchft's manager sees per
optimizer step (one quorum, one wait, one commit vote, whatever the number of micro-batches), the commit and
discard paths, one accounting per step, no quorum in the inner steps of a round, a step timed from its first
micro-batch, and a clear error for a call out of order.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_strategies.ft.accounting import StepAccounting
from fsdp_strategies.ft.heal_state import HealState, SchedulerRollback, TrainingState
from fsdp_strategies.ft.protocol import EventLog
from fsdp_strategies.ft.semi_sync import SemiSync
from fsdp_strategies.ft.step import FTStep, StepOrderError
from fsdp_strategies.protocols import SyncModeSwitch


class FakeManager:
    """The calls of a ``torchft.Manager`` the step makes, recorded; ``should_commit`` answers ``commit``."""

    def __init__(self, commit: bool = True) -> None:
        self.calls: list[str] = []
        self.commit = commit
        self.step = 0

    def start_quorum(self) -> None:
        self.calls.append("start_quorum")

    def wait_quorum(self) -> None:
        self.calls.append("wait_quorum")

    def is_participating(self) -> bool:
        return True

    def should_commit(self) -> bool:
        self.calls.append("should_commit")
        self.step += int(self.commit)  # torchft: the step counts commits
        return self.commit

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        self.calls.append("num_participants")
        return 2

    def allreduce(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        self.calls.append("allreduce")
        return SimpleNamespace(wait=lambda: None)

    gradient_allreduce = allreduce  # CrossGroupReduce's (the same protocol step)


class FakeRounds:
    """An ``OuterSync`` whose rounds are two inner steps and whose syncs commit."""

    def __init__(self) -> None:
        self.committed = self.pending = self.last_round = self.syncs = 0
        self.healed, self.last_quorum_s = False, 0.0

    @property
    def step(self) -> int:
        return self.committed + self.pending

    def after_inner_step(self) -> bool | None:
        self.pending += 1
        if self.pending % 2:
            return None
        self.syncs += 1
        self.committed, self.last_round, self.pending = self.committed + self.pending, self.pending, 0
        return True


def _protocol(tmp_path: Path, *, sync: str = "every_step",
              commit: bool = True) -> tuple[FTStep, FakeManager, Any]:
    """The step object over a real heal state, rollback, accounting (events in ``tmp_path``) and semi-sync
    part; returns it, its fake manager and ``(model, progress)``: the model and the ``progress`` calls."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def state() -> TrainingState:
        return TrainingState(model, [optimizer], [])

    semi = SemiSync(sync=sync, straggler_sync="off", sync_every=2, outer_lr=1.0, outer_momentum=0.0,
                    num_fragments=1, replica_group_id=0, num_replica_groups=2)
    accounting = StepAccounting(0, 2, "skip", EventLog(tmp_path / "events.jsonl"))
    progress: list[tuple[int, int]] = []
    step = FTStep(semi, HealState(state), SchedulerRollback(state), accounting, group_id=0, groups=2,
                  progress=lambda target, pending: progress.append((target, pending)), module=lambda: None)
    manager = FakeManager(commit)
    step.bind(manager, manager, device=torch.device("cpu"), world_size=1, writes_events=True)
    return step, manager, SimpleNamespace(model=model, progress=progress)


def _lines(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _micro_batches(step: FTStep, n: int, pause_s: float = 0.0) -> None:
    """What Lightning calls per micro-batch before the optimizer step: ``begin`` (on_train_batch_start)."""
    for _ in range(n):
        step.begin()
        time.sleep(pause_s)


def test_a_step_of_several_micro_batches_has_one_quorum_one_wait_and_one_commit(tmp_path: Path) -> None:
    step, manager, fit = _protocol(tmp_path)
    stepped: list[Any] = []
    _micro_batches(step, 3, pause_s=0.02)
    step.wait_quorum()  # the all-reduce hook of each micro-batch: waits once per step
    step.wait_quorum()
    out = step.finish(lambda: "loss", lambda closure: stepped.append(closure()) or "stepped", fit.model)
    # the quorum's groups read once, with the wait (the all-reduces and the accounting reuse them)
    assert manager.calls == ["start_quorum", "wait_quorum", "num_participants", "should_commit"]
    assert out == "stepped" and stepped == ["loss"]  # the optimizer stepped once, with the step's loss
    assert step.accounting.stats["committed"] == 1 and step.accounting.last_step_committed is True
    assert fit.progress == [(1, 1)]  # Lightning's step = the quorum's
    (line,) = _lines(tmp_path)  # one events line: the step is accounted once
    assert line["committed"] and line["step_s"] >= 0.06  # timed from its first micro-batch
    # the next step: a quorum of its own; its line carries the previous step's accounting seconds
    _micro_batches(step, 1)
    step.finish(lambda: "loss", lambda closure: closure(), fit.model)
    assert manager.calls.count("start_quorum") == 2 and manager.calls[-1] == "should_commit"
    first, second = _lines(tmp_path)
    assert "cost_account_s" not in first and second["cost_account_s"] >= 0 and "cost_capture_s" in second


def test_a_discarded_step_does_not_step_the_optimizer(tmp_path: Path) -> None:
    step, manager, fit = _protocol(tmp_path, commit=False)
    _micro_batches(step, 2)
    stepped: list[Any] = []
    out = step.finish(lambda: "loss", lambda closure: stepped.append(closure()), fit.model)
    assert out == "loss" and not stepped
    assert step.accounting.stats["discarded"] == 1 and step.accounting.stats["committed"] == 0
    assert [line["committed"] for line in _lines(tmp_path)] == [False]
    assert fit.progress == [(0, 1)]  # the quorum's step did not move
    _micro_batches(step, 1)  # the step is over: the next begin starts another quorum
    assert manager.calls.count("start_quorum") == 2


def test_rounds_start_no_quorum_and_time_the_whole_step(tmp_path: Path) -> None:
    step, manager, fit = _protocol(tmp_path, sync="local_sgd")
    rounds = FakeRounds()
    step.semi.outer = rounds  # type: ignore[assignment]  # SemiSync.start builds the real one at train start
    assert step.semi.active
    for _ in range(2):  # one round: two inner steps of two micro-batches each
        _micro_batches(step, 2, pause_s=0.03)
        with pytest.raises(StepOrderError, match="no quorum started"):
            step.wait_quorum()  # nothing crosses the groups in an inner step
        step.finish(lambda: "loss", lambda closure: closure(), fit.model)
    assert "start_quorum" not in manager.calls and rounds.syncs == 1
    (line,) = _lines(tmp_path)  # the round's outer sync is accounted, not its inner steps
    assert line["committed"] and line["step_s"] >= 0.06  # both micro-batches of the round's last step
    assert fit.progress == [(1, 1), (2, 1)]


def test_calls_out_of_order_raise(tmp_path: Path) -> None:
    step, manager, fit = _protocol(tmp_path)
    with pytest.raises(StepOrderError, match=r"finish\(\) with no step begun"):
        step.finish(lambda: "loss", lambda closure: closure(), fit.model)
    with pytest.raises(StepOrderError, match=r"wait_quorum\(\) with no quorum started"):
        step.wait_quorum()
    with pytest.raises(StepOrderError, match=r"first_sync\(\)"):
        step.first_sync()  # every step: no rounds
    _micro_batches(step, 1)
    step.finish(lambda: "loss", lambda closure: closure(), fit.model)
    with pytest.raises(StepOrderError, match=r"finish\(\) with no step begun"):
        step.finish(lambda: "loss", lambda closure: closure(), fit.model)  # the step is over
    step.unbind()
    with pytest.raises(StepOrderError, match=r"begin\(\) before bind\(\)"):
        step.begin()
    assert manager.calls == ["start_quorum", "wait_quorum", "num_participants", "should_commit"]


def test_the_rounds_object_is_the_sync_mode_switch() -> None:
    semi = SemiSync(sync="every_step", straggler_sync="diloco", sync_every=2, outer_lr=1.0,
                    outer_momentum=0.0, num_fragments=1, replica_group_id=0, num_replica_groups=2)
    assert isinstance(semi, SyncModeSwitch) and semi.sync_switch_available and not semi.semi_sync_active
    semi.configure_sync_switch(0.4, 3)
    semi.report_sync_cost(0.5)
    assert semi.sync_cost_counters() == (0.0, 0.0) and semi.sync_switch_events == []
