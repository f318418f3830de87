"""Unit tests of the ``ft_hsdp`` parts that otherwise run only inside multi-process fault runs: the options'
refusals (``ft/options``), the accounting of a step's samples (``ft/accounting``) and the heal state with
its LR-scheduler round trip (``ft/heal_state``). One process, no process group, no lighthouse: each part
through its own functions, so that a wrong count or a lost scheduler step shows here, named, instead of as
a loss that drifts in a two-group run."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fsdp_strategies.ft.accounting import StepAccounting, StepInFlight
from fsdp_strategies.ft.heal_state import HealState, HealStateMismatchError, SchedulerRollback, TrainingState
from fsdp_strategies.ft.options import (
    check_ft_options,
    check_group_size,
    check_training,
    resolve_placement,
    resolve_timeouts,
)
from fsdp_strategies.ft.protocol import (
    EVENTS_ENV,
    LIGHTHOUSE_ENV,
    NUM_GROUPS_ENV,
    REPLICA_GROUP_ENV,
    EventLog,
)

# ------------------------------------------------------------------------------------------------ options

LIGHTHOUSE = "http://127.0.0.1:29510"


@pytest.fixture
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """None of the variables ``fsdp-strategies-ft`` sets for a group (a test run may be inside one)."""
    for name in (LIGHTHOUSE_ENV, REPLICA_GROUP_ENV, NUM_GROUPS_ENV, EVENTS_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_placement_without_a_lighthouse_or_a_group_is_refused_with_the_fix(
        no_launcher_env: pytest.MonkeyPatch) -> None:
    unset = rf"lighthouse_addr is not set and {LIGHTHOUSE_ENV} is empty\. Fix: set"
    with pytest.raises(ValueError, match=unset):
        resolve_placement(None, 0, 2, None)
    with pytest.raises(ValueError, match=r"replica_group_id is missing\. Fix: set strategy\.init_args"):
        resolve_placement(LIGHTHOUSE, None, 2, None)
    with pytest.raises(ValueError, match=r"num_replica_groups=None is invalid. Fix: set"):
        resolve_placement(LIGHTHOUSE, 0, None, None)
    with pytest.raises(ValueError, match=r"replica_group_id=2 is out of range .* Fix: use an id in \[0, 1\]"):
        resolve_placement(LIGHTHOUSE, 2, 2, None)
    with pytest.raises(ValueError, match=r"replica_group_id=True is out of range"):
        resolve_placement(LIGHTHOUSE, True, 2, None)  # a bool is not a group id


def test_placement_falls_back_to_the_launchers_variables(no_launcher_env: pytest.MonkeyPatch) -> None:
    no_launcher_env.setenv(LIGHTHOUSE_ENV, LIGHTHOUSE)
    no_launcher_env.setenv(REPLICA_GROUP_ENV, "1")
    no_launcher_env.setenv(NUM_GROUPS_ENV, "3")
    no_launcher_env.setenv(EVENTS_ENV, "/run/events/group{replica_group_id}.jsonl")
    placement = resolve_placement(None, None, None, None)
    assert (placement.lighthouse_addr, placement.replica_group_id, placement.num_replica_groups,
            placement.events_file) == (LIGHTHOUSE, 1, 3, "/run/events/group1.jsonl")
    # what the strategy was given wins over the environment
    assert resolve_placement(None, 0, 2, "mine.jsonl").events_file == "mine.jsonl"
    assert resolve_placement(None, 0, 2, None).replica_group_id == 0


OPTIONS = dict(num_replica_groups=2, min_replica_size=1, checkpoint_transport="pg", timeout_s=None,
               quorum_timeout_s=None, connect_timeout_s=None, data_on_failure="skip", sync="every_step",
               sync_every=1, outer_lr=0.7, outer_momentum=0.9, num_fragments=1, straggler_sync="off")


@pytest.mark.parametrize(("change", "message"), [
    ({"min_replica_size": 3}, r"min_replica_size.*3.*1 <= min_replica_size <= num_replica_groups \(2\)"),
    ({"checkpoint_transport": "nfs"}, r"checkpoint_transport.*'nfs'"),
    ({"data_on_failure": "retry"}, r"data_on_failure.*'retry'"),
    ({"timeout_s": -1.0}, r"timeout_s.*-1.0.*a positive number of seconds"),
])
def test_each_bad_ft_option_is_refused_naming_it_and_the_fix(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_ft_options(**{**OPTIONS, **change})


def test_timeouts_not_given_are_derived_and_an_explicit_set_is_kept(
        no_launcher_env: pytest.MonkeyPatch) -> None:
    derived = check_ft_options(**OPTIONS)
    assert derived.quorum_timeout_s >= derived.timeout_s >= derived.connect_timeout_s > 0
    given = resolve_timeouts(2, 1, 30.0, 60.0, 10.0)
    assert (given.timeout_s, given.quorum_timeout_s, given.connect_timeout_s) == (30.0, 60.0, 10.0)


def test_group_size_and_training_refusals_name_the_fix() -> None:
    check_group_size("auto", 2, 4)
    check_group_size(8, 2, 4)
    with pytest.raises(ValueError, match=r"shard_degree=4 does not match the replica group's size 8 .* "
                                         r"Fix: set shard_degree to 8 or 'auto'"):
        check_group_size(4, 2, 4)
    with pytest.raises(ValueError, match=r"automatic optimization only .* Fix: remove"):
        check_training("sharded", "skip", 1, automatic_optimization=False)
    with pytest.raises(ValueError, match=r"accumulation='no_sync' with data_on_failure='redistribute'.* Fix"):
        check_training("no_sync", "redistribute", 2, automatic_optimization=True)
    check_training("no_sync", "redistribute", 1, automatic_optimization=True)  # no accumulation: fine
    check_training("sharded", "redistribute", 4, automatic_optimization=True)


# --------------------------------------------------------------------------------------------- accounting

def _step(position: int, micro_samples: list[int]) -> StepInFlight:
    """A step that took ``len(micro_samples)`` micro-batches from ``position`` on (one rank's samples
    each)."""
    step = StepInFlight()
    step.begin()
    for i, samples in enumerate(micro_samples):
        step.take_batch(position + i, samples, first=i == 0, rebuilt=False)
    return step


def test_a_steps_samples_count_every_micro_batch_and_every_rank() -> None:
    step = _step(10, [4, 4, 3])
    assert (step.position, step.own_samples, step.micro_batches) == (10, 11, 3)
    accounting = StepAccounting(0, 2, "skip", None)
    data = accounting.step_data(step, committed=True, quorum_step=10, participants=2,
                                batch_size=step.own_samples, world_size=2, sharded=True)
    assert data["samples"] == 22 and data["missed_samples"] == 0 and data["micro_batches"] == 3
    assert step.position is None  # accounted once: a second call reports nothing
    assert accounting.step_data(step, committed=True, quorum_step=10, participants=2, batch_size=11,
                                world_size=2, sharded=True) == {}
    # the next step's first micro-batch starts the data fields over
    step.take_batch(13, 4, first=True, rebuilt=True)
    assert (step.position, step.own_samples, step.micro_batches, step.rebuilt) == (13, 4, 1, True)


def test_skip_counts_what_absent_groups_missed_and_redistribute_counts_nothing_missed() -> None:
    skip = StepAccounting(0, 3, "skip", None)
    data = skip.step_data(_step(5, [4]), committed=True, quorum_step=5, participants=2, batch_size=4,
                          world_size=2, sharded=True)
    assert (data["samples"], data["missed_samples"]) == (8, 8)  # one group absent: its 4 x 2 samples
    skip.step_data(_step(6, [4]), committed=True, quorum_step=6, participants=1, batch_size=4, world_size=2,
                   sharded=True)
    assert skip.stats["missed_samples"] == 8 + 16

    redistribute = StepAccounting(0, 3, "redistribute", None)
    step = _step(5, [4])
    step.extra_samples = 2  # this group's share of the absent group's samples
    data = redistribute.step_data(step, committed=True, quorum_step=5, participants=2, batch_size=4,
                                  world_size=2, sharded=True)
    assert (data["samples"], data["missed_samples"], data["redistributed_samples"]) == (12, 0, 4)
    # a loader that does not shard over the groups cannot redistribute: the absent group's data is missed
    data = redistribute.step_data(_step(6, [4]), committed=True, quorum_step=6, participants=2, batch_size=4,
                                  world_size=2, sharded=False)
    assert data["missed_samples"] == 8


def test_a_discarded_step_trains_nothing_and_a_group_left_out_for_a_nonfinite_loss_is_missed() -> None:
    accounting = StepAccounting(0, 2, "redistribute", None)
    data = accounting.step_data(_step(3, [4]), committed=False, quorum_step=3, participants=2, batch_size=4,
                                world_size=1, sharded=True)
    assert (data["samples"], data["missed_samples"]) == (0, None)
    step = _step(3, [4])
    step.excluded_groups = 1  # the other group's loss was not finite: it trained nothing, in either mode
    data = accounting.step_data(step, committed=True, quorum_step=3, participants=2, batch_size=4,
                                world_size=1, sharded=True)
    assert (data["samples"], data["missed_samples"]) == (4, 4)
    healing = _step(3, [4])
    healing.participating = False  # a healing group contributes zeros: its stale batch is not trained
    data = accounting.step_data(healing, committed=True, quorum_step=4, participants=2, batch_size=4,
                                world_size=1, sharded=True)
    assert (data["samples"], data["participating"], data["step"], data["position"]) == (0, False, 4, 3)


def test_a_round_absent_group_misses_the_whole_round() -> None:
    accounting = StepAccounting(1, 3, "skip", None)
    data = accounting.round_data(committed=True, participants=2, round_samples=64, healed=False,
                                 committed_steps=16, round_steps=8)
    assert (data["step"], data["samples"], data["missed_samples"]) == (8, 64, 64)
    healed = accounting.round_data(committed=True, participants=3, round_samples=64, healed=True,
                                   committed_steps=24, round_steps=8)
    assert (healed["participating"], healed["samples"], healed["missed_samples"]) == (False, 0, None)
    assert accounting.stats["missed_samples"] == 64


def test_finish_counts_steps_recovery_and_writes_the_events_line(tmp_path: Path) -> None:
    events = EventLog(tmp_path / "group0.jsonl")
    accounting = StepAccounting(0, 2, "skip", events)
    committed = []
    for n, ok in enumerate([True, False, True, True]):
        step = _step(n, [2])
        with step.timed("batch"):
            pass
        data = accounting.step_data(step, committed=ok, quorum_step=n, participants=1 if n == 3 else 2,
                                    batch_size=2, world_size=1, sharded=True)
        metrics = accounting.finish(step, committed=ok, committed_step=len(committed) + int(ok),
                                    participants=2, quorum_id=7, commit_s=0.01, data=data, write_event=True)
        committed += [n] if ok else []
        assert set(step.costs) == {"batch"}  # written with this step's line; close_step hands them over
    assert (accounting.stats["committed"], accounting.stats["discarded"]) == (3, 1)
    assert accounting.stats["recovery_s"] > 0  # the discarded step and the one after it
    assert metrics["ft/missed_samples"] == 2 and metrics["ft/committed_steps"] == 3
    lines = list(events.records())
    assert [r["committed"] for r in lines] == [True, False, True, True]
    assert lines[-1]["data_missed_samples"] == 2 and "cost_batch_s" in lines[-1]
    assert lines[1]["data_samples"] == 0


# --------------------------------------------------------------------------------------------- heal state

def _training(seed: int) -> TrainingState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return TrainingState(model, [opt], [SimpleNamespace(scheduler=sched, interval="step")])


def _train(state: TrainingState, steps: int) -> None:
    for _ in range(steps):
        loss = state.model(torch.ones(5, 3)).square().mean()
        loss.backward()
        state.optimizers[0].step()
        state.optimizers[0].zero_grad()
        state.lr_scheduler_configs[0].scheduler.step()


def test_ft_metrics_reach_the_loggers_directly_and_callback_metrics_when_a_step_needs_attention() -> None:
    """At a routine logging step the ``ft/*`` metrics are written straight to the Trainer's loggers (no
    ``self.log``: ~0.3 ms a metric); a step that did not go as planned, the last step and an epoch's last
    batch go through ``self.log`` (``trainer.callback_metrics``); a routine step between logging steps
    costs nothing."""
    routed: list[tuple[str, float]] = []

    class Connector:
        should_update_logs = False

        def log_metrics(self, metrics: dict[str, float]) -> None:
            routed.append(("loggers", metrics["ft/committed_steps"]))

    trainer = SimpleNamespace(max_steps=100, is_last_batch=False, _logger_connector=Connector())
    module = SimpleNamespace(_current_fx_name="optimizer_step", trainer=trainer,
                             log_dict=lambda m, **kw: routed.append(("self.log", m["ft/committed_steps"])))
    accounting = StepAccounting(0, 2, "skip", None)

    def metrics(step: int, **changed: float) -> dict[str, float]:
        return {"ft/committed_steps": float(step), "ft/participants": 2.0, "ft/committed": 1.0,
                "ft/heal": 0.0, **changed}

    accounting.log(module, metrics(1))  # routine, not a logging step: nothing
    trainer._logger_connector.should_update_logs = True
    accounting.log(module, metrics(10))  # routine logging step: the loggers only
    accounting.log(module, metrics(11, **{"ft/participants": 1.0}))  # a group missing
    accounting.log(module, metrics(12, **{"ft/committed": 0.0}))  # discarded
    trainer._logger_connector.should_update_logs = False
    accounting.log(module, metrics(13, **{"ft/heal": 1.0}))  # healed, not a logging step
    trainer.is_last_batch = True
    accounting.log(module, metrics(14))  # the epoch's last batch
    trainer.is_last_batch = False
    accounting.log(module, metrics(100))  # max_steps
    module._current_fx_name = None
    accounting.log(module, metrics(15, **{"ft/committed": 0.0}))  # outside a hook: nothing
    assert routed == [("loggers", 10.0), ("self.log", 11.0), ("self.log", 12.0), ("self.log", 13.0),
                      ("self.log", 14.0), ("self.log", 100.0)]


def test_a_healed_group_gets_the_peers_weights_optimizer_moments_and_lr_schedule() -> None:
    peer, healing = _training(0), _training(1)
    _train(peer, 3)
    sent = HealState(lambda: peer)
    sent.capture()
    # the transport (torchft's pg / http) hands over copies: the capture itself holds references
    HealState(lambda: healing).load(copy.deepcopy(sent.state_dict()))
    for a, b in zip(peer.model.parameters(), healing.model.parameters()):
        assert torch.equal(a, b)
    peer_opt, healed_opt = peer.optimizers[0].state_dict(), healing.optimizers[0].state_dict()
    for i, moments in peer_opt["state"].items():
        for key, value in moments.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(healed_opt["state"][i][key])), key
    peer_sched, healed_sched = (s.lr_scheduler_configs[0].scheduler for s in (peer, healing))
    assert healed_sched.last_epoch == peer_sched.last_epoch == 3
    assert healing.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05)  # the peer's decayed LR
    # and the two go on identically
    _train(peer, 2)
    _train(healing, 2)
    for a, b in zip(peer.model.parameters(), healing.model.parameters()):
        assert torch.equal(a, b)
    assert healing.optimizers[0].param_groups[0]["lr"] == peer.optimizers[0].param_groups[0]["lr"] == 0.025


def test_a_capture_leaves_the_optimizer_and_schedulers_to_the_request() -> None:
    """Issue 43: the step-start capture takes the model's references only; the optimizers' and LR schedulers'
    state is read when a peer asks (torchft's quorum thread, during the step's forward/backward, which
    change neither): no ``Optimizer.state_dict`` per step, the same state a peer receives."""
    peer = _training(0)
    _train(peer, 2)
    asked: list[str] = []
    optimizer, scheduler = peer.optimizers[0], peer.lr_scheduler_configs[0].scheduler
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler)):
        real = obj.state_dict
        obj.state_dict = (lambda real=real, name=name: asked.append(name) or real())  # type: ignore[method-assign]
    sent = HealState(lambda: peer)
    for _ in range(3):
        sent.capture()
    assert asked == []
    state = sent.state_dict()
    assert asked == ["optimizer", "scheduler"]
    assert state["lr_schedulers"][0]["last_epoch"] == 2
    assert set(state) == {"model", "optimizers", "lr_schedulers"}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, param in enumerate(params):  # the live moments, as references
        assert state["optimizers"][0]["state"][index]["exp_avg"] is optimizer.state[param]["exp_avg"]


def test_a_capture_reuses_the_models_references_until_a_tensor_is_replaced() -> None:
    """Issue 43: the model's ``state_dict`` (FSDP2's hooks on every unit) is taken at the first capture and
    again only when the model holds another tensor; what is sent is always the live values."""
    peer = _training(0)
    calls: list[int] = []
    peer.model.register_state_dict_pre_hook(lambda *_: calls.append(1))
    walks: list[int] = []
    walk = peer.model.parameters
    peer.model.parameters = lambda *a, **k: walks.append(1) or walk(*a, **k)  # type: ignore[method-assign]
    sent = HealState(lambda: peer)
    for _ in range(3):
        sent.capture()
        _train(peer, 1)  # in place: the references see it
    assert len(calls) == 1 and len(walks) == 1  # the model walked at the first capture only
    assert torch.equal(sent.state_dict()["model"]["0.weight"], peer.model[0].weight)
    peer.model[0].weight = nn.Parameter(torch.zeros(4, 3))  # replaced (a user's callback, a load)
    sent.capture()
    assert len(calls) == 2 and torch.equal(sent.state_dict()["model"]["0.weight"], torch.zeros(4, 3))
    peer.model[1].register_buffer("count", torch.zeros(()))  # a new buffer: a new state_dict
    sent.capture()
    assert len(calls) == 3 and "1.count" in sent.state_dict()["model"]
    sent.capture()
    assert len(calls) == 3
    peer.model[1].count = torch.ones(())  # a buffer assigned another tensor
    sent.capture()
    assert len(calls) == 4 and sent.state_dict()["model"]["1.count"] == 1.0
    peer.model.add_module("2", nn.Linear(2, 2))  # a module added
    sent.capture()
    assert len(calls) == 5 and "2.weight" in sent.state_dict()["model"]
    other = _training(1)  # another model (a new fit): its own references
    sent = HealState(lambda: other)
    sent.capture()
    assert torch.equal(sent.state_dict()["model"]["0.weight"], other.model[0].weight)

    class Extra(nn.Linear):  # anything but parameters and buffers: taken every step
        def get_extra_state(self) -> dict:
            return {"calls": len(calls)}

        def set_extra_state(self, state: dict) -> None:
            pass

    extra = TrainingState(Extra(2, 2), [], [])
    extra.model.register_state_dict_pre_hook(lambda *_: calls.append(1))
    sent, before = HealState(lambda: extra), len(calls)
    sent.capture()
    sent.capture()
    assert len(calls) == before + 2 and sent.state_dict()["model"]["_extra_state"] == {"calls": len(calls)}


def test_heal_state_refuses_another_model_and_a_request_before_the_first_capture() -> None:
    peer = _training(0)
    sent = HealState(lambda: peer)
    with pytest.raises(AssertionError, match="before the first step"):
        sent.state_dict()
    sent.capture()
    other = TrainingState(nn.Linear(3, 2), [], [])
    with pytest.raises(RuntimeError, match="missing in the healed state: bias, weight") as refused:
        HealState(lambda: other).load(sent.state_dict())
    assert isinstance(refused.value, HealStateMismatchError) and "Fix:" in str(refused.value)


def test_a_discarded_step_rolls_the_lr_scheduler_back_and_a_heal_inside_a_round_resteps_it() -> None:
    state = _training(0)
    sched, opt = state.lr_scheduler_configs[0].scheduler, state.optimizers[0]
    rollback = SchedulerRollback(lambda: state)
    _train(state, 1)
    rollback.discard_step()  # the optimizer step that just ended was discarded...
    sched.step()  # ...but Lightning steps the scheduler after it anyway
    assert (sched.last_epoch, opt.param_groups[0]["lr"]) == (2, 0.05)
    rollback.restore_pending()  # the next step starts where the committed steps left the schedule
    assert (sched.last_epoch, opt.param_groups[0]["lr"]) == (1, 0.1)
    rollback.restore_pending()  # armed once
    assert sched.last_epoch == 1

    rollback.mark_round_start()
    _train(state, 3)
    rollback.discard_round()  # the outer sync failed: the whole round's inner steps are rolled back
    rollback.restore_pending()
    assert (sched.last_epoch, opt.param_groups[0]["lr"]) == (1, 0.1)

    state.lr_scheduler_configs.append(SimpleNamespace(scheduler=torch.optim.lr_scheduler.StepLR(
        opt, step_size=1), interval="epoch"))
    epoch_sched = state.lr_scheduler_configs[1].scheduler
    before = epoch_sched.last_epoch
    rollback.restep_after_heal()  # only the per-step schedulers
    assert (sched.last_epoch, epoch_sched.last_epoch) == (2, before)


class _FakeGroupManager:
    """torchft's Manager as CountedManager.gradient_allreduce uses it (2 groups take part unless told)."""

    def __init__(self, participants: int = 2, participating: bool = True, errored: bool = False) -> None:
        self.participants, self.participating, self._errored = participants, participating, errored
        self.reported: list[Exception] = []
        self.waited = 0

    def errored(self) -> object:
        return self._errored or None

    def wait_quorum(self) -> None:
        self.waited += 1

    def num_participants(self) -> int:
        return self.participants

    def is_participating(self) -> bool:
        return self.participating

    def report_error(self, err: Exception) -> None:
        self.reported.append(err)


class _FakePG:
    """A process group whose all-reduce adds ``other`` (the other group's contribution) when waited for, or
    raises there (``fail``)."""

    def __init__(self, other: float = 3.0, fail: bool = False) -> None:
        self.other, self.fail, self.ops = other, fail, []

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> object:
        self.ops.append(opts.reduceOp)  # type: ignore[attr-defined]
        pg = self

        class Work:
            def wait(self) -> bool:
                if pg.fail:
                    raise RuntimeError("peer gone")
                tensors[0].add_(pg.other)
                return True
        return Work()


def test_gradient_allreduce_sums_then_divides_by_the_participating_groups_like_torchft() -> None:
    from torch.distributed import ReduceOp

    from fsdp_strategies.ft.manager import CountedManager

    stats: dict[str, float] = {}
    manager, pg = _FakeGroupManager(), _FakePG()
    link = CountedManager(manager, stats, pg)
    grad = torch.full((4,), 1.0)
    work = link.gradient_allreduce(grad)  # AVG: a sum on the process group, divided after the wait
    assert pg.ops == [ReduceOp.SUM] and grad.tolist() == [1.0] * 4 and manager.waited == 1
    assert work.wait() is True and grad.tolist() == [2.0] * 4  # (1 + 3) / 2
    assert stats == {"cross_group_allreduces": 1, "cross_group_bytes": 16}
    summed = torch.ones(2)
    assert link.gradient_allreduce(summed, reduce_op=ReduceOp.SUM).wait() and summed.tolist() == [4.0, 4.0]
    # healing (not participating): zeros contributed, still divided by the participating groups
    healing = torch.full((2,), 5.0)
    link = CountedManager(_FakeGroupManager(participating=False), {}, _FakePG(other=4.0))
    assert link.gradient_allreduce(healing).wait() and healing.tolist() == [2.0, 2.0]
    # an error while waiting: recorded (no commit), not raised; the tensor is not divided
    failing = _FakeGroupManager()
    broken = torch.ones(2)
    assert CountedManager(failing, {}, _FakePG(fail=True)).gradient_allreduce(broken).wait() is False
    assert [str(e) for e in failing.reported] == ["peer gone"] and broken.tolist() == [1.0, 1.0]
    # once the step errored: no traffic at all
    pg = _FakePG()
    errored = _FakeGroupManager(errored=True)
    untouched = torch.ones(2)
    assert CountedManager(errored, {}, pg).gradient_allreduce(untouched).wait() is True
    assert pg.ops == [] and untouched.tolist() == [1.0, 1.0] and errored.waited == 0


def test_gradient_allreduce_given_the_steps_quorum_does_not_ask_the_manager_again() -> None:
    """The step's :class:`QuorumView` (read once per step) decides the division and the zeros; the manager's
    quorum calls (a profiler range and a lock each) are not made per all-reduce."""
    from fsdp_strategies.ft.manager import CountedManager, QuorumView

    manager = _FakeGroupManager(participants=5, participating=True)
    asked: list[str] = []
    manager.num_participants = lambda: asked.append("num_participants") or 5  # type: ignore[method-assign]
    link = CountedManager(manager, {}, _FakePG(other=3.0))
    grad = torch.full((2,), 1.0)
    assert link.gradient_allreduce(grad, quorum=QuorumView(participants=2, participating=True)).wait()
    assert grad.tolist() == [2.0, 2.0] and manager.waited == 0 and asked == []  # (1 + 3) / 2: the view's 2
    healing = torch.full((2,), 5.0)
    assert link.gradient_allreduce(healing, quorum=QuorumView(participants=2, participating=False)).wait()
    assert healing.tolist() == [1.5, 1.5] and manager.waited == 0  # zeros contributed: (0 + 3) / 2
    assert QuorumView.of(manager) == (5, True) and manager.waited == 1 and asked == ["num_participants"]


def test_gradient_allreduce_gives_torchfts_result_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a real torchft Manager (one group of one rank, a real lighthouse): the same bytes as
    ``Manager.allreduce`` for AVG and SUM."""
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import ReduceOp

    from fsdp_strategies.ft.manager import CountedManager, create_manager
    from fsdp_strategies.ft.protocol import torchft_runtime_env

    with torchft_runtime_env():
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setitem(os.environ, "MASTER_ADDR", "127.0.0.1")
    monkeypatch.setitem(os.environ, "MASTER_PORT", str(store.port))
    manager, pg = create_manager(
        device=torch.device("cpu"), rank=0, world_size=1, replica_group_id=0,
        lighthouse_addr=lighthouse.address(), min_replica_size=1, checkpoint_transport="pg", timeout_s=30,
        quorum_timeout_s=30, connect_timeout_s=10, init_sync=False, max_retries=None, hostname=None,
        use_async_quorum=True, state_dict=lambda: {}, load_state_dict=lambda s: None)
    try:
        link = CountedManager(manager, {}, pg)
        for op in (ReduceOp.AVG, ReduceOp.SUM):
            manager.start_quorum()
            ours = torch.randn(1000) * 7
            theirs = ours.clone()
            assert link.gradient_allreduce(ours, reduce_op=op).wait()
            assert manager.allreduce(theirs, reduce_op=op).wait()
            assert torch.equal(ours, theirs)
            assert manager.should_commit(timeout=timedelta(seconds=30))
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()
