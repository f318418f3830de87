"""``ft_hsdp`` sync modes (``local_sgd``, ``diloco``) with real processes: 2 replica groups x 2 ranks (FSDP2
shards).

Each run is started by ``fsdp-strategies-ft`` with the mode's YAML (configs/ft_hsdp_diloco.yaml,
configs/ft_hsdp_local_sgd.yaml). The probe in ``workers/ft_train.py`` counts the manager's cross-group
all-reduces per step and digests, per rank, the model shards and DiLoCo's backup + outer-optimizer state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from conftest import ROOT, WORKERS, run_python
from fsdp_strategies.ft.outer_sync import _fragments, validate_sync_options

WORKER = str(WORKERS / "ft_train.py")
TINY = ["--trainer.logger", "false", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar",
        "false",
        "--model.vocab_size", "64", "--data.vocab_size", "64", "--model.dim", "64", "--model.n_layers", "2",
        "--model.n_heads", "4", "--model.max_seq_len", "32", "--data.seq_len", "32", "--data.batch_size", "2",
        "--data.num_train", "32", "--data.num_val", "8", "--trainer.strategy.init_args.timeout_s", "10",
        "--trainer.strategy.init_args.connect_timeout_s", "5", "--trainer.enable_checkpointing", "false"]


# ---------------------------------------------------------------------------------------------- fast checks
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sync": "async"}, "sync='async'"),
    ({"sync": "diloco", "sync_every": 0}, "sync_every=0"),
    ({"sync": "every_step", "sync_every": 4}, "need a semi-synchronous mode"),
    ({"sync": "diloco", "sync_every": 6, "num_fragments": 4}, "not a multiple of num_fragments=4"),
    ({"sync": "diloco", "outer_lr": 0.0}, "outer_lr=0.0"),
    ({"sync": "diloco", "outer_momentum": 1.0}, "outer_momentum=1.0"),
    ({"sync": "local_sgd", "outer_lr": 0.7}, "do not apply to sync='local_sgd'"),
    ({"sync": "diloco", "data_on_failure": "redistribute"}, "data_on_failure='redistribute'"),
])
def test_bad_sync_options_name_option_value_and_fix(kwargs: dict, match: str) -> None:
    args = {"sync": "every_step", "sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "num_fragments": 1,
            "data_on_failure": "skip", **kwargs}
    with pytest.raises(ValueError, match="Fix:") as err:
        validate_sync_options(**args)
    assert match in str(err.value)


def test_strategy_rejects_bad_sync_before_any_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_strategies import FTHSDPStrategy

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:1")
    with pytest.raises(ValueError, match=r"sync_every=3 is not a multiple of num_fragments=2.*Fix"):
        FTHSDPStrategy(replica_group_id=0, num_replica_groups=2, sync="diloco", sync_every=3, num_fragments=2,
                       outer_lr=0.7, outer_momentum=0.9)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("name", ["ft_hsdp_diloco.yaml", "ft_hsdp_local_sgd.yaml"])
def test_sync_configs_build_their_strategy(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the multi-process runs below train with these files; this checks both cheaply in CI
    import yaml

    from conftest import ROOT
    from fsdp_strategies import FTHSDPStrategy

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:1")
    init_args = yaml.safe_load((ROOT / "configs" / name).read_text())["trainer"]["strategy"]["init_args"]
    strategy = FTHSDPStrategy(**{**init_args, "replica_group_id": 0, "num_replica_groups": 2})
    assert strategy.sync == name.removeprefix("ft_hsdp_").removesuffix(".yaml") and strategy.sync_every > 1


def test_round_start_checks_are_shared_by_sync_and_straggler_sync() -> None:
    from fsdp_strategies.ft.semi_sync import check_rounds

    ok = {"max_steps": 8, "sync_every": 4, "num_optimizers": 1}
    for option, value, required in (("sync", "diloco", False), ("straggler_sync", "local_sgd", True)):
        check_rounds(option, value, **ok, max_steps_required=required)
        with pytest.raises(
            ValueError, match=rf"max_steps=10 is not a multiple of sync_every=4 with {option}=.*Fix"
        ):
            check_rounds(option, value, **{**ok, "max_steps": 10}, max_steps_required=required)
        with pytest.raises(ValueError, match=rf"{option}='{value}' supports one optimizer, got 2.*Fix"):
            check_rounds(option, value, **{**ok, "num_optimizers": 2}, max_steps_required=required)
    with pytest.raises(ValueError, match=r"max_steps=-1 is not set with straggler_sync='diloco'.*Fix"):
        check_rounds("straggler_sync", "diloco", **{**ok, "max_steps": -1}, max_steps_required=True)
    with pytest.warns(UserWarning, match=r"sync='diloco' without max_steps.*Fix"):
        check_rounds("sync", "diloco", **{**ok, "max_steps": -1}, max_steps_required=False)


def test_fragments_partition_every_parameter_once() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    for n in (1, 2, 3, 6):
        frags = _fragments(model, n)
        assert len(frags) == n
        ids = [id(p) for f in frags for p in f.parameters()]
        assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(set(ids)) == len(ids)
    with pytest.raises(ValueError, match=r"num_fragments=7.*Fix"):
        _fragments(model, 7)


class _FakeManager:
    """Single-process stand-in for ``torchft.Manager``: a peer group that did not move (zero
    pseudo-gradient)."""

    _use_async_quorum = False

    def __init__(self) -> None:
        self.step, self.commit, self.quorums, self.allreduces = 0, True, 0, 0
        self.fns: dict = {}

    def start_quorum(self) -> None:
        self.quorums += 1

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: object = None
    ) -> object:
        self.allreduces += 1
        tensor.div_(2)  # AVG with a peer whose pseudo-gradient is zero
        return type("Done", (), {"wait": lambda self: True})()

    def should_commit(self, timeout: object = None) -> bool:
        self.step += int(self.commit)
        return self.commit

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return 2

    def register_state_dict_fn(self, key: str, load: object, save: object) -> None:
        self.fns[key] = (load, save)

    def disallow_state_dict_read(self) -> None: ...
    def allow_state_dict_read(self) -> None: ...


def test_outer_sync_commit_discard_and_heal_state_with_a_mocked_manager() -> None:
    from fsdp_strategies.ft.manager import CountedManager
    from fsdp_strategies.ft.outer_sync import STATE_KEY, OuterSync

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    manager, stats, refreshed = _FakeManager(), {}, []
    outer = OuterSync(CountedManager(manager, stats), model, inner, mode="local_sgd", sync_every=2,
                      outer_lr=1.0, outer_momentum=0.0,
                      num_fragments=1, before_quorum=lambda: refreshed.append(1), stats=stats)
    assert {"StreamingDiLoCoFragment_0", STATE_KEY} <= set(manager.fns)
    backup = [p.detach().clone() for p in model.parameters()]

    def inner_step() -> bool | None:
        inner.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        inner.step()
        return outer.after_inner_step()

    # inner: no cross-group traffic
    assert inner_step() is None and manager.allreduces == 0 and manager.quorums == 0
    assert inner_step() is True and manager.quorums == 1 and manager.allreduces == 2 and refreshed == [1]
    local = [b - 0.1 * 2 * g for b, g in zip(backup, (torch.full((1, 3), 4.0), torch.full((1,), 4.0)))]
    for p, b, loc in zip(model.parameters(), backup, local):  # local SGD: the mean of own and peer's weights
        torch.testing.assert_close(p.detach(), (b + loc) / 2)
    assert (outer.step, outer.committed, outer.pending) == (2, 2, 0) and stats["cross_group_allreduces"] == 2
    synced = [p.detach().clone() for p in model.parameters()]

    manager.commit = False  # a discarded sync: every member rolls back to the last committed outer step
    assert inner_step() is None and outer.step == 3
    assert inner_step() is False and (outer.step, stats["syncs_discarded"]) == (2, 1)
    for p, s in zip(model.parameters(), synced):
        torch.testing.assert_close(p.detach(), s)

    load, save = manager.fns[STATE_KEY]  # the step travels with the heal state
    outer.pending = 1
    assert save() == {"committed": 2, "pending": 1}
    load({"committed": 8, "pending": 2})
    assert outer.step == 10 and outer.healed


# ---------------------------------------------------------------------------------------------- real
# processes
def _launch(tmp: Path, name: str, config: str, args: list[str], launcher: list[str], env: dict[str, str],
            timeout: float = 400) -> Path:
    events = tmp / f"{name}-events"
    run_python(["-m", "fsdp_strategies.ft", "--groups", "2", "--ranks-per-group", "2",
                "--heartbeat-timeout-ms",
                "1000", "--join-timeout-ms", "30000", "--events-dir", str(events), "--timeout",
                str(timeout - 20), *launcher, "--", WORKER, "fit", "--config", config, *TINY, *args],
               env={"FT_TEST_OUT": str(tmp / name), **env}, timeout=timeout)
    return events


def _records(out: Path, group: int, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"group{group}_rank{rank}.jsonl").read_text().splitlines()]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_semi_sync_run(out: Path, groups: int, max_steps: int, sync_every: int, fragments: int = 1,
                        accumulate: int = 1) -> dict[str, int]:
    """Replicas identical after every outer sync both committed and at the end; inner steps without
    cross-group traffic; a discarded sync rolls the parameters back to the last committed one. Returns counts.

    ``accumulate``: micro-batches per inner step (``accumulate_grad_batches``); a record is written per
    micro-batch, and the non-final ones neither step nor send anything across groups.

    Streaming (``fragments > 1``): one fragment syncs every ``sync_every / fragments`` steps, the others hold
    local progress, so only DiLoCo's backups and outer-optimizer state are compared (they are identical after
    every sync), not the live parameters."""
    interval = sync_every // fragments
    pick = (lambda d: d) if fragments == 1 else (lambda d: (None, d[1]))
    counts = {"compared_syncs": 0, "discarded_syncs": 0, "inner_steps": 0, "heals": 0}
    for rank in (0, 1):
        synced: list[dict[int, tuple[str, str]]] = []
        for g in range(groups):
            recs = _records(out, g, rank)
            prev_syncs: int | None = None
            prev_inc = -1
            by_step: dict[int, tuple[str, str]] = {}
            for r in recs:
                if r["incarnation"] != prev_inc:
                    prev_inc, prev_syncs = r["incarnation"], None
                is_sync = prev_syncs is not None and r["syncs"] != prev_syncs
                first = prev_syncs is None
                prev_syncs = r["syncs"]
                if not first and (r["batch_idx"] + 1) % accumulate:  # a micro-batch inside an inner step
                    assert r["allreduces"] == 0 and not is_sync, f"cross-group traffic mid-step: {g} {r}"
                    assert r["step_after"] == r["step_before"], r
                    continue
                if first:  # the incarnation's start = right after its initial sync (a committed state)
                    by_step.setdefault(r["step_before"], pick((r["model_before"], r["outer_before"])))
                    if r["syncs"] == 1:  # no sync in this step (the initial one was the first)
                        assert r["allreduces"] == 0, f"inner step with cross-group traffic: group {g} {r}"
                    continue
                if not is_sync:
                    assert r["allreduces"] == 0, f"inner step with cross-group traffic: group {g} {r}"
                    assert r["step_after"] == r["step_before"] + 1
                    counts["inner_steps"] += 1
                    continue
                assert r["allreduces"] > 0, r
                if r["committed"]:
                    assert r["step_after"] % interval == 0 and r["step_after"] >= r["step_before"] + 1, r
                    by_step[r["step_after"]] = pick((r["model"], r["outer"]))
                else:  # rolled back to the last committed sync on this member
                    counts["discarded_syncs"] += 1
                    assert r["step_after"] == r["step_before"] + 1 - interval, r
                    assert r["step_after"] in by_step, (r, sorted(by_step))
                    if fragments == 1:
                        assert r["model"] == by_step[r["step_after"]][0], (
                            "a discarded outer step changed the weights"
                        )
            synced.append(by_step)
        common = set(synced[0]).intersection(*synced[1:])
        for step in common:
            assert len({s[step] for s in synced}) == 1, (
                f"rank {rank}: groups differ after the outer sync at {step}"
            )
        counts["compared_syncs"] += len(common)
        dumps = [torch.load(out / f"group{g}_rank{rank}.pt", weights_only=False) for g in range(groups)]
        assert {d["global_step"] for d in dumps} == {max_steps}
        keys = [k for k in dumps[0]["shards"] if k.startswith(("model.", "backup", "outer") if fragments == 1
                                                               else ("backup", "outer"))]
        assert any(k.startswith("backup") for k in keys), (
            "DiLoCo's backup parameters are missing from the dump"
        )
        for d in dumps[1:]:
            for k in keys:
                assert torch.equal(d["shards"][k], dumps[0]["shards"][k]), (
                    f"rank {rank}: {k} differs at the end"
                )
        counts["heals"] += sum(int(d["ft_stats"]["heals"]) for d in dumps)
    return counts


def outer_step_errors(out: Path, groups: int, lr: float, momentum: float) -> list[float]:
    """Each outer sync that every group committed together (all present, none healing in it) recomputed by
    hand from the saved inputs (``workers/ft_train.py`` writes them): pseudo-gradient
    ``mean over groups(backup - local)``, then torch's Nesterov SGD (``buf = momentum * buf + g`` -- ``g``
    itself on the first step --, ``backup - lr * (g + momentum * buf)``; ``momentum == 0``:
    ``backup - lr * g``). Returns, per sync and rank, the largest absolute difference from what the run
    produced (parameters and momentum buffers) -- independent of ``check_semi_sync_run``, which only compares
    the groups with each other (two groups applying the same wrong step would pass there)."""
    dumps: dict[tuple[int, int], dict[str, dict]] = {}
    for path in sorted((out / "syncs").glob("group*_rank*_inc*_m*.pt")):
        group, rank, _, step = path.stem.split("_")
        dumps.setdefault((int(rank[4:]), int(step[1:])), {})[group] = torch.load(path, weights_only=False)
    errors = []
    for (_, _), by_group in sorted(dumps.items()):
        records = list(by_group.values())
        if len(records) != groups or not all(
            r["committed"] and r["participants"] == groups and not r["healed"] for r in records
        ):
            continue
        first = records[0]
        if any(not torch.equal(r["before"]["backup"][n], first["before"]["backup"][n])
               for r in records[1:] for n in first["before"]["backup"]):
            continue  # not a round all groups started from the same backup (a heal before it)
        worst = 0.0
        for name, backup in first["before"]["backup"].items():
            g = sum(backup - r["before"]["local"][name] for r in records) / groups
            update = g
            if momentum:
                previous = first["before"]["momentum"][name]
                buf = g.clone() if previous is None else momentum * previous + g
                update = g + momentum * buf
                for r in records:
                    worst = max(worst, float((r["after"]["momentum"][name] - buf).abs().max()))
            expected = backup - lr * update
            for r in records:
                worst = max(worst, float((r["after"]["params"][name] - expected).abs().max()))
        errors.append(worst)
    return errors


def check_outer_steps_by_hand(
    out: Path, lr: float, momentum: float, at_least: int, averaging: bool = False
) -> None:
    """The run's outer steps equal the hand-computed ones, and the check would see a 10% error in lr or a
    momentum off by 0.1 (both recomputed with the wrong value must miss). ``averaging``: local SGD, whose
    outer step is the groups' mean (lr 1, no momentum buffers to compare): only the lr is perturbed."""
    tolerance = 2e-6
    errors = outer_step_errors(out, 2, lr, momentum)
    assert len(errors) >= at_least and max(errors) <= tolerance, errors
    assert min(outer_step_errors(out, 2, lr * 1.1, momentum)) > 10 * tolerance
    if averaging:
        return
    wrong_momentum = momentum + 0.1 if momentum < 0.85 else momentum - 0.1
    assert min(outer_step_errors(out, 2, lr, wrong_momentum)) > 10 * tolerance


@pytest.mark.multiprocess
def test_diloco_kill_during_an_outer_sync_then_live_heal(tmp_path: Path) -> None:
    # Group 1 SIGKILLs itself (torchrun + both ranks) inside the 2nd cross-group all-reduce of the outer sync
    # that ends inner step 8: group 0's sync is discarded (rolled back to step 4 on both of its ranks). Group
    # 1 restarts and heals from group 0 at its first sync (weights, inner AND outer optimizer state, DiLoCo's
    # backup, the step). A group alone sleeps 2.5 s per step so that the restart overlaps training. Every
    # inner step accumulates 2 micro-batches (accumulate_grad_batches=2): rounds count optimizer steps.
    acc = 2
    events = _launch(tmp_path, "diloco", "configs/ft_hsdp_diloco.yaml",
                     ["--trainer.strategy.init_args.sync_every", "4", "--trainer.max_steps", "32",
                      "--trainer.accumulate_grad_batches", str(acc)],
                     ["--min-replicas", "1", "--max-restarts", "1"],
                     {"FT_TEST_KILL": "1:8:2", "FT_TEST_SLEEP_ALONE": str(2.5 / acc)})
    launcher = _jsonl(events / "launcher.jsonl")
    exits = [(e["group"], e["code"]) for e in launcher if e["event"] == "exit"]
    assert exits[0] == (1, -9) and sorted(exits[1:]) == [(0, 0), (1, 0)], exits
    counts = check_semi_sync_run(tmp_path / "diloco", 2, 32, 4, accumulate=acc)
    assert counts["discarded_syncs"] >= 2, counts  # group 0's sync at step 8 (rank 0 and rank 1)
    assert counts["heals"] >= 2, counts  # group 1 healed on both ranks
    assert counts["compared_syncs"] >= 6, counts
    # configs/ft_hsdp_diloco.yaml: outer_lr 0.7, outer_momentum 0.6 -- read from the YAML, not from the run
    diloco = yaml.safe_load((ROOT / "configs" / "ft_hsdp_diloco.yaml").read_text())["trainer"]["strategy"][
        "init_args"
    ]
    check_outer_steps_by_hand(tmp_path / "diloco", diloco["outer_lr"], diloco["outer_momentum"], at_least=4)
    for rank in (0, 1):
        # the healed group starts from its peer's state of that sync: weights AND inner-optimizer state (the
        # outer state and backups are compared above)
        healed = next(r for r in _records(tmp_path / "diloco", 1, rank) if r["incarnation"] == 1)
        peer = [r for r in _records(tmp_path / "diloco", 0, rank)
                if r["step_after"] == healed["step_before"] and r["manager_step"] == healed["manager_step"]]
        assert peer and healed["before"] == peer[-1]["after"], (healed, peer)


@pytest.mark.multiprocess
@pytest.mark.full
def test_local_sgd_kill_between_outer_syncs(tmp_path: Path) -> None:
    # The launcher SIGKILLs group 1 once it has committed step 8, i.e. in the round after that sync.
    events = _launch(tmp_path, "local_sgd", "configs/ft_hsdp_local_sgd.yaml",
                     ["--trainer.strategy.init_args.sync_every", "4", "--trainer.max_steps", "32"],
                     ["--min-replicas", "1", "--kill-at-steps", "1@8", "--max-restarts", "2"],
                     {"FT_TEST_SLEEP_ALONE": "2.5"})
    launcher = _jsonl(events / "launcher.jsonl")
    exits = [(e["group"], e["code"]) for e in launcher if e["event"] == "exit"]
    assert exits[0] == (1, -9) and sorted(exits[1:]) == [(0, 0), (1, 0)], exits
    counts = check_semi_sync_run(tmp_path / "local_sgd", 2, 32, 4)
    assert counts["heals"] >= 2 and counts["compared_syncs"] >= 6, counts
    # the groups' mean
    check_outer_steps_by_hand(tmp_path / "local_sgd", 1.0, 0.0, at_least=4, averaging=True)


@pytest.mark.multiprocess
# minutes per mode; CI runs the kill tests (diloco in make test, local_sgd in make test-full)
@pytest.mark.soak
@pytest.mark.parametrize("mode", ["diloco", "local_sgd"])
def test_sync_mode_under_chaos(mode: str, tmp_path: Path) -> None:
    # Issue 13's done-when: the example under fsdp-strategies-ft chaos (>= 5 kills) with replicas identical
    # after every outer sync both groups committed, and at the end. The launcher SIGKILLs a live group
    # (round-robin) at committed steps 40, 80, ..., 240 (mostly mid-round), and group 1 also kills itself
    # inside the 3rd all-reduce of the outer sync ending step 20. The last kill leaves 80 steps for the
    # restart to rejoin, so both groups finish (random --kill-every kills near the end leave a group that
    # never rejoins).
    steps = int(os.environ.get("FT_SYNC_CHAOS_STEPS", "320"))
    plan = ",".join(str(s) for s in range(40, steps - 79, 40))
    events = _launch(tmp_path, mode, f"configs/ft_hsdp_{mode}.yaml",
                     ["--trainer.strategy.init_args.sync_every", "4", "--trainer.max_steps", str(steps),
                      "--data.num_train", "128"],
                     ["--min-replicas", "1", "--kill-at-steps", plan, "--max-restarts", "10"],
                     {"FT_TEST_KILL": "1:20:3", "FT_TEST_SLEEP": "0.2", "FT_TEST_SLEEP_ALONE": "1.0"},
                     timeout=1500)
    launcher = _jsonl(events / "launcher.jsonl")
    kills = [e for e in launcher if e["event"] == "exit" and e["code"] == -9]
    counts = check_semi_sync_run(tmp_path / mode, 2, steps, 4)
    summary = {"mode": mode, "kills": len(kills), **counts,
               "done": [e for e in launcher if e["event"] in ("data", "done")]}
    print("FT_SYNC_CHAOS", json.dumps(summary))
    report = os.environ.get("FT_SYNC_CHAOS_REPORT")
    if report:
        with open(report, "a") as fh:
            fh.write(json.dumps(summary) + "\n")
    assert len(kills) >= 5, summary
    assert counts["compared_syncs"] >= 10, summary


@pytest.mark.multiprocess
@pytest.mark.full
def test_streaming_diloco_two_fragments(tmp_path: Path) -> None:
    # Streaming DiLoCo over FSDP2 shards: fragments alternate (one sync every 2 steps), each sync reduces only
    # its fragment's tensors, and the backups + outer-optimizer state are identical across groups after each.
    _launch(tmp_path, "stream", "configs/ft_hsdp_diloco.yaml",
            ["--trainer.strategy.init_args.sync_every", "4", "--trainer.strategy.init_args.num_fragments",
             "2", "--trainer.max_steps", "16"], ["--min-replicas", "1"], {})
    counts = check_semi_sync_run(tmp_path / "stream", 2, 16, 4, fragments=2)
    assert counts["compared_syncs"] >= 12, counts
    recs = _records(tmp_path / "stream", 0, 0)
    per_sync = [r["allreduces"] for r in recs if r["allreduces"]]
    # the two fragments alternate and together reduce each parameter (one DiLoCo backup tensor each) once
    dump = torch.load(tmp_path / "stream" / "group0_rank0.pt", weights_only=False)
    params = sum(k.startswith("backup") for k in dump["shards"])
    assert len(set(per_sync)) == 2 and sum(per_sync[:2]) == params > 2, (per_sync, params)
