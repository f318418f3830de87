"""StragglerDetector's actions, one object each, driven alone (one process): a fake strategy implementing the
protocol the action needs, scored windows as the scorer returns them, and what the action did."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from fsdp_strategies._options import choices
from fsdp_strategies.callbacks.straggler_actions import (
    ACTIONS,
    Action,
    ActionOptions,
    Evict,
    HierarchicalSGD,
    SemiSync,
    Stop,
    Warn,
    make_action,
)
from fsdp_strategies.callbacks.straggler_report import StragglerReport

OPTIONS = ActionOptions(switch_threshold=0.2, patience=2, skip_first=1, hosts_file=None, stop_exit_code=7)


def _report(tmp_path: Path) -> StragglerReport:
    report = StragglerReport(lambda: {"events": report.events}, top_k=2)
    report.hosts, report.file = ["host0", "host1"], tmp_path / "report.json"
    return report


def _result(step: int = 8, lost_frac: float = 0.0, newly: list[int] | None = None,
            persistent: list[int] | None = None) -> dict[str, Any]:
    return {"step": step, "lost_frac": lost_frac, "relative": [1.0, 3.0], "ewma": [1.0, 2.5],
            "newly_persistent": newly or [], "cleared": [], "persistent": persistent or []}


def test_every_action_value_has_its_own_class() -> None:
    assert set(ACTIONS) == set(choices(Action))
    for name, cls in ACTIONS.items():
        action = make_action(name, OPTIONS)
        assert type(action) is cls and cls.name == name and action.switched is False


class LocalAveraging:
    """A LocalAveragingSwitch that records its calls."""

    local_sgd_available = True

    def __init__(self) -> None:
        self.calls: list[tuple[bool, bool]] = []

    def set_local_sgd(self, enabled: bool, average: bool = True) -> None:
        self.calls.append((enabled, average))


def test_hierarchical_sgd_switches_after_patience_windows_and_back_below_half(tmp_path: Path) -> None:
    action, strategy, report = HierarchicalSGD(OPTIONS), LocalAveraging(), _report(tmp_path)
    action.setup(strategy)
    action.train_start(strategy)
    assert strategy.calls == [(False, False)]  # synchronous from the start, nothing to average
    trainer = SimpleNamespace(strategy=strategy, global_step=10)
    for lost, calls in ((0.3, 1), (0.1, 1), (0.3, 1), (0.3, 2)):  # a streak of 2 above 0.2, interrupted once
        action.act(trainer, _result(lost_frac=lost), report, final=False)  # type: ignore[arg-type]
        assert len(strategy.calls) == calls
    assert strategy.calls[-1] == (True, True) and action.switched
    assert report.events == [{"step": 10, "event": "local_sgd_on", "lost_frac": 0.3}]
    for lost in (0.15, 0.15):  # above half of the threshold: stays on
        action.act(trainer, _result(lost_frac=lost), report, final=False)  # type: ignore[arg-type]
    assert action.switched
    action.act(trainer, _result(lost_frac=0.05), report, final=True)  # type: ignore[arg-type]  # no step left
    action.act(trainer, _result(lost_frac=0.05), report, final=False)  # type: ignore[arg-type]
    assert action.switched and len(strategy.calls) == 2
    action.act(trainer, _result(lost_frac=0.05), report, final=False)  # type: ignore[arg-type]
    assert not action.switched and strategy.calls[-1] == (False, True)
    assert report.events[-1]["event"] == "local_sgd_off"
    resumed = HierarchicalSGD(OPTIONS)
    resumed.switched = True  # restored from a checkpoint: local averaging stays on
    resumed.train_start(strategy)
    assert len(strategy.calls) == 3
    with pytest.raises(ValueError, match=r"action='hierarchical_sgd' needs the ddp_hooks strategy.*Fix"):
        HierarchicalSGD(OPTIONS).setup(SimpleNamespace(comm_hook="allreduce"))


class SyncSwitch:
    """A SyncModeSwitch with settable counters that records the costs it is told."""

    sync_switch_available = True

    def __init__(self) -> None:
        self.semi_sync_active = False
        self.sync_switch_events: list[dict[str, Any]] = []
        self.counters = (0.0, 0.0)
        self.costs: list[float] = []
        self.configured: tuple[float, int] | None = None

    def configure_sync_switch(self, threshold: float, patience: int) -> None:
        self.configured = (threshold, patience)

    def sync_cost_counters(self) -> tuple[float, float]:
        return self.counters

    def report_sync_cost(self, cost: float) -> None:
        self.costs.append(cost)


def test_semi_sync_reports_the_groups_worst_cost_and_copies_the_strategys_switches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_strategies.callbacks import straggler_actions

    now = [100.0]
    monkeypatch.setattr(straggler_actions, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    action, strategy, report = SemiSync(OPTIONS), SyncSwitch(), _report(tmp_path)
    action.setup(strategy)
    assert strategy.configured == (0.2, 2)
    action.train_start(strategy)
    now[0], strategy.counters = 101.0, (0.5, 0.0)
    action.step_end(strategy, 1, report)  # skip_first=1: the warm-up step's cost does not count
    now[0], strategy.counters = 105.0, (1.5, 1.0)
    columns = action.window_columns(strategy)
    # 1 s cross-group of 4 s wall + 1 s every-step-equivalent extra
    assert columns == pytest.approx([1.0, 5.0])
    gathered = np.array([[7.0, *columns], [8.0, 3.0, 5.0]])  # the other rank spent 3 of 5 s
    timings, extra = action.split_gathered(gathered, strategy)
    assert timings.tolist() == [[7.0], [8.0]] and extra == {"sync_cost": pytest.approx(0.6)}
    assert strategy.costs == [pytest.approx(0.6)]
    strategy.sync_switch_events.append({"step": 12, "to": "semi_sync", "cost": 0.6})
    strategy.semi_sync_active = True
    action.step_end(strategy, 13, report)
    action.step_end(strategy, 14, report)  # copied once
    assert report.events == [{"step": 12, "to": "semi_sync", "cost": 0.6}] and action.switched
    with pytest.raises(ValueError, match=r"action='semi_sync' needs ft_hsdp.*"
                                         r"straggler_sync='every_step'.*Fix"):
        SemiSync(OPTIONS).setup(SimpleNamespace(straggler_sync="every_step"))


def test_evict_leaves_the_quorum_once_for_a_new_straggler_after_writing_the_report(tmp_path: Path) -> None:
    reasons: list[str] = []
    strategy = SimpleNamespace(leave_quorum=reasons.append)
    action, report = Evict(OPTIONS), _report(tmp_path)
    action.setup(strategy)
    trainer = SimpleNamespace(strategy=strategy, global_step=9, is_global_zero=True)
    action.act(trainer, _result(persistent=[1]), report, final=False)  # type: ignore[arg-type]  # not new
    action.act(trainer, _result(newly=[1], persistent=[1]), report, final=True)  # type: ignore[arg-type]
    assert reasons == [] and report.events == []
    action.act(trainer, _result(newly=[1], persistent=[1]), report, final=False)  # type: ignore[arg-type]
    assert len(reasons) == 1 and "step 9" in reasons[0]
    assert "rank 1 on host1 (relative score 3.00)" in reasons[0]
    assert report.events == [{"step": 8, "event": "evict", "ranks": [1], "left_at_step": 9}]
    assert json.loads(report.path.read_text())["events"] == report.events
    with pytest.raises(ValueError, match=r"action='evict' needs .*leave_quorum.*Fix"):
        Evict(OPTIONS).setup(SimpleNamespace())


def test_stop_checkpoints_writes_the_hosts_and_exits_with_the_code(tmp_path: Path) -> None:
    saved: list[str] = []
    barriers: list[str] = []
    trainer = SimpleNamespace(save_checkpoint=saved.append, is_global_zero=True,
                              strategy=SimpleNamespace(barrier=barriers.append))
    action, report = Stop(OPTIONS), _report(tmp_path)
    action.act(trainer, _result(), report, final=False)  # type: ignore[arg-type]  # nobody persistent
    assert saved == []
    with pytest.raises(SystemExit) as stopped:
        action.act(trainer, _result(persistent=[1]), report, final=True)  # type: ignore[arg-type]
    assert stopped.value.code == 7 and barriers == ["straggler_stop"]
    assert saved == [str(tmp_path / "straggler_stop.ckpt")]
    assert (tmp_path / "straggling_hosts.txt").read_text() == "host1\n"
    assert json.loads(report.path.read_text())["events"][-1]["event"] == "stop"


def test_warn_leaves_the_strategy_alone(tmp_path: Path) -> None:
    action, report, strategy = Warn(OPTIONS), _report(tmp_path), SimpleNamespace()
    action.setup(strategy)
    action.train_start(strategy)
    action.step_end(strategy, 1, report)
    assert action.window_columns(strategy).size == 0
    trainer = SimpleNamespace(strategy=strategy)
    action.act(trainer, _result(newly=[1], persistent=[1]), report, final=False)  # type: ignore[arg-type]
    assert report.events == [] and vars(strategy) == {}
