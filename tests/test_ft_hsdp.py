"""ft_hsdp (torchft) with real processes on CPU: 2 replica groups x 2 ranks, started by fsdp-strategies-ft.

The fault run SIGKILLs groups (once inside the cross-group all-reduce, once from the launcher); the
no-fault run is compared with ``hsdp`` and with a resumed job.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from conftest import WORKERS, free_port, run_python
from fsdp_strategies import FTHSDPStrategy, verify_checkpoint
from fsdp_strategies.callbacks.hang_watchdog import HANG_EXIT_CODE
from fsdp_strategies.ft import LEAVE_EXIT_CODE, LighthouseUnreachableError
from fsdp_strategies.ft.launch.options import parse_kill_at

WORKER = str(WORKERS / "ft_train.py")
# val_check_interval 1.0: Lightning 2.6.0 (make test-lightning-range) refuses configs/ft_hsdp.yaml's 100
# against a 16-batch epoch even with validation off
TINY = ["--trainer.logger", "false", "--trainer.limit_val_batches", "0", "--trainer.val_check_interval",
        "1.0", "--trainer.enable_progress_bar", "false",
        "--model.vocab_size", "64", "--data.vocab_size", "64", "--model.dim", "64", "--model.n_layers", "2",
        "--model.n_heads", "4", "--model.max_seq_len", "32", "--data.seq_len", "32", "--data.batch_size", "2",
        "--data.num_train", "32", "--data.num_val", "8"]
FT = ["--config", "configs/ft_hsdp.yaml", *TINY, "--trainer.strategy.init_args.timeout_s", "10",
      "--trainer.strategy.init_args.connect_timeout_s", "5"]


def _launch(
    tmp: Path, name: str, args: list[str], launcher: list[str], env: dict[str, str], timeout: float = 400
) -> Path:
    events = tmp / f"{name}-events"
    run_python(["-m", "fsdp_strategies.ft", "--groups", "2", "--ranks-per-group", "2",
                "--heartbeat-timeout-ms",
                "1000", "--join-timeout-ms", "500", "--events-dir", str(events), "--timeout",
                str(timeout - 20),
                *launcher, "--", WORKER, "fit", *args], env={"FT_TEST_OUT": str(tmp / name), **env},
                timeout=timeout)
    return events


def _records(out: Path, group: int, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"group{group}_rank{rank}.jsonl").read_text().splitlines()]


def _dump(out: Path, tag: str) -> dict:
    return torch.load(out / f"{tag}.pt", weights_only=False)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.multiprocess
def test_kill_heal_and_bit_identical_groups(tmp_path: Path) -> None:
    # Group 1 SIGKILLs itself (torchrun + both ranks) just before its 2nd cross-group all-reduce of step 3;
    # restarted, it heals; then the launcher SIGKILLs group 0 (at step >= 30, once group 1 is live again),
    # which heals in turn. Survivors sleep 1 s per step while alone so that restarts overlap training, and
    # the restarted group 1 waits until group 0 has committed 3 steps alone (a fast restart must not race it).
    max_steps = 140
    events = _launch(
        tmp_path,
        "fault",
        [*FT, "--trainer.max_steps", str(max_steps), "--trainer.enable_checkpointing", "false"],
        ["--min-replicas", "1", "--kill-at-steps", "0@30", "--max-restarts", "2"],
        {"FT_TEST_KILL": "1:3:2", "FT_TEST_SLEEP_ALONE": "1.0", "FT_TEST_REJOIN_AFTER": "3"},
    )
    out = tmp_path / "fault"
    launcher = _jsonl(events / "launcher.jsonl")
    exits = [(e["group"], e["code"]) for e in launcher if e["event"] == "exit"]
    assert exits[:2] == [(1, -9), (0, -9)] and sorted(exits[2:]) == [(0, 0), (1, 0)], exits
    assert [e["why"] for e in launcher if e["event"] == "kill"] == ["at step 30"]
    assert sorted(e["group"] for e in launcher if e["event"] == "start") == [0, 0, 1, 1]

    for rank in (0, 1):
        g0 = _records(out, 0, rank)
        g1 = _records(out, 1, rank)
        # The kill inside the all-reduce: the survivor's step 3 is discarded (params + optimizer state
        # untouched, step counter unchanged), and the dead group never committed it either.
        first0 = [r for r in g0 if r["incarnation"] == 0]
        at3 = [r for r in first0 if r["step_before"] == 3]
        assert (
            at3[0]["committed"] is False and at3[0]["before"] == at3[0]["after"] and at3[0]["step_after"] == 3
        )
        assert at3[1]["committed"] is True and at3[1]["step_after"] == 4
        assert max(r["step_after"] for r in g1 if r["incarnation"] == 0) == 3
        # Every committed step changed the state and advanced global_step by exactly one (or jumped on a
        # heal).
        for r in g0 + g1:
            if r["committed"] and r["step_before"] > 0:
                assert r["step_after"] == r["step_before"] + 1 and r["before"] != r["after"]
            assert r["step_after"] == r["manager_step"]
        # The survivor kept committing alone while the other group was down.
        alone = [r for r in first0 if r["committed"] and r["participants"] == 1]
        assert len(alone) >= 3, "group 0 did not commit steps while group 1 was down"
        # Healed incarnations start at step 0 and jump to their peers' committed step on their first step.
        for records, incarnations in ((g1, (1,)), (g0, (1,))):
            for inc in incarnations:
                first = next(r for r in records if r["incarnation"] == inc)
                assert first["step_before"] == 0 and first["committed"] and first["step_after"] > 3, first

        # Afterwards both groups hold bit-identical parameter and optimizer-state shards and step counters.
        a, b = _dump(out, f"group0_rank{rank}"), _dump(out, f"group1_rank{rank}")
        assert a["incarnation"] == 1 and b["incarnation"] == 1
        assert a["global_step"] == b["global_step"] == a["manager_step"] == b["manager_step"] == max_steps
        assert a["shards"].keys() == b["shards"].keys() and any(k.startswith("opt0.") for k in a["shards"])
        for key in a["shards"]:
            assert torch.equal(a["shards"][key], b["shards"][key]), key
        assert all(float(v) == max_steps for k, v in a["shards"].items() if k.endswith(".step"))
        assert a["ft_stats"]["heals"] >= 1 and b["ft_stats"]["heals"] >= 1


@pytest.mark.multiprocess
def test_hung_group_is_exited_by_its_watchdog_restarted_and_heals(tmp_path: Path) -> None:
    # Every group runs HangWatchdog(timeout_s=20). In its first incarnation group 1's rank 1 sleeps forever
    # when it starts step 5. Group 1's watchdog names that rank, both of its ranks exit 81 (torchrun: 1), the
    # launcher restarts group 1 like any failed group, it heals from group 0, which waited for it in the
    # quorum meanwhile (not a hang of group 0: protocols.PeerWaitSource) and went on; both end bit-identical.
    max_steps = 30
    events = _launch(
        tmp_path, "hang",
        [*FT, "--trainer.max_steps", str(max_steps), "--trainer.enable_checkpointing", "false"],
        ["--min-replicas", "1", "--max-restarts", "1"],
        {"FT_TEST_HANG": "1:1:5:20", "FT_TEST_SLEEP_ALONE": "0.5"},
    )
    out = tmp_path / "hang"
    launcher = _jsonl(events / "launcher.jsonl")
    exits = [(e["group"], e["code"]) for e in launcher if e["event"] == "exit"]
    assert exits[0][0] == 1 and exits[0][1] not in (0, -9) and sorted(exits[1:]) == [(0, 0), (1, 0)], exits
    starts = sorted((e["group"], e["restart"]) for e in launcher if e["event"] == "start")
    assert starts == [(0, 0), (1, 0), (1, 1)], starts
    log1, log0 = (events / "group1.log").read_text(), (events / "group0.log").read_text()
    assert log1.count(f"exiting with status {HANG_EXIT_CODE} (hang)") == 2, log1[-3000:]
    reports = [line for line in log1.splitlines() if "hang: " in line and "(no progress for" in line]
    assert len(reports) == 1 and "hang: rank 1 (host " in reports[0], reports
    assert "stuck in forward at step 5" in reports[0], reports
    assert "hang: " not in log0  # the group that waited for it was never called hung
    assert "in hang_forever" in (out / "hang" / "group1-rank1-stacks.txt").read_text()
    assert not (out / "hang" / "group0-rank0-stacks.txt").exists()
    for rank in (0, 1):
        a, b = _dump(out, f"group0_rank{rank}"), _dump(out, f"group1_rank{rank}")
        assert (a["incarnation"], b["incarnation"]) == (0, 1)
        assert a["global_step"] == b["global_step"] == max_steps and b["ft_stats"]["heals"] >= 1
        for key in a["shards"]:
            assert torch.equal(a["shards"][key], b["shards"][key]), key


@pytest.mark.multiprocess
@pytest.mark.parametrize("data_on_failure", ["skip", "redistribute"])
def test_nonfinite_loss_group_leaves_the_step_and_groups_stay_identical(tmp_path: Path,
                                                                       data_on_failure: str) -> None:
    # Every group runs NonFiniteGuard; group 1's rank 1 has a NaN loss at step 4. Group 1 leaves step 4's
    # cross-group average before its backward (ft/nonfinite.py), the step commits on both groups with group
    # 0's gradient alone, both groups apply it (parameters change, stay bit-identical), the guard skips
    # nothing, and the events account group 1's batch of step 4 as not trained (in both data_on_failure
    # modes). Without the exclusion the guard skips step 4 on every group.
    max_steps = 8
    events = _launch(tmp_path, "nan", [*FT, "--trainer.max_steps", str(max_steps),
                                       "--trainer.enable_checkpointing", "false",
                                       "--trainer.strategy.init_args.data_on_failure", data_on_failure],
                     ["--min-replicas", "2"], {"FT_TEST_NAN": "1:1:4"})
    out = tmp_path / "nan"
    for rank in (0, 1):
        g0, g1 = _records(out, 0, rank), _records(out, 1, rank)
        assert [r["committed"] for r in g0] == [True] * max_steps == [r["committed"] for r in g1]
        for a, b in zip(g0, g1):
            assert a["after"] == b["after"], (rank, a["step_before"])  # bit-identical after every step
        step4 = next(r for r in g1 if r["step_before"] == 4)
        assert step4["before"] != step4["after"]  # the step was applied (group 0's gradient), not skipped
        a, b = _dump(out, f"group0_rank{rank}"), _dump(out, f"group1_rank{rank}")
        for key in a["shards"]:
            assert torch.equal(a["shards"][key], b["shards"][key]), key
            assert torch.isfinite(a["shards"][key]).all(), key
    steps = {g: {r["data_step"]: r for r in _jsonl(events / f"group{g}.jsonl") if "data_step" in r}
             for g in (0, 1)}
    assert steps[1][4]["data_samples"] == 0
    assert steps[0][4]["data_missed_samples"] == steps[0][3]["data_samples"] > 0
    assert all(steps[0][s]["data_missed_samples"] == 0 for s in steps[0] if s != 4)
    log0, log1 = (events / "group0.log").read_text(), (events / "group1.log").read_text()
    for log in (log0, log1):
        assert "ft_hsdp: step 4: replica group(s) [1] had a non-finite loss and left" in log, log[-3000:]
        assert "NonFiniteGuard: step" not in log  # nothing skipped: the average was finite


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.multiprocess
def test_warm_spare_replaces_a_killed_group_and_heals(tmp_path: Path) -> None:
    # --warm-spares: each group gets a standby incarnation once it has committed a step (imports done, Trainer
    # built, no process group). Both groups wait after step 6 until both spares are ready, then the launcher
    # SIGKILLs group 1 at step 8: its spare -- the very process started before the kill -- is activated in its
    # place, joins the quorum and heals from group 0. While on standby a spare never joins: at most 2
    # participants.
    max_steps = 40
    events = _launch(
        tmp_path,
        "spare",
        [*FT, "--trainer.max_steps", str(max_steps), "--trainer.enable_checkpointing", "false"],
        ["--min-replicas", "1", "--kill-at-steps", "1@8", "--max-restarts", "1", "--warm-spares"],
        {"FT_TEST_AWAIT_SPARES": "6:2", "FT_TEST_SLEEP_ALONE": "0.5"},
    )
    out = tmp_path / "spare"
    launcher = _jsonl(events / "launcher.jsonl")
    kinds = [e["event"] for e in launcher]
    [kill] = [e for e in launcher if e["event"] == "kill"]
    assert kill["group"] == 1 and kill["why"] == "at step 8", kill
    spare = next(e for e in launcher if e["event"] == "spare" and e["group"] == 1 and e["restart"] == 1)
    ready = next(e for e in launcher if e["event"] == "spare_ready" and e["group"] == 1)
    [restart] = [e for e in launcher if e["event"] == "start" and e["restart"] == 1]
    assert launcher.index(spare) < launcher.index(ready) < launcher.index(kill) < launcher.index(restart), (
        kinds
    )
    assert restart["group"] == 1 and restart["warm_spare"] is True and restart["spare_ready"] is True
    assert restart["pid"] == spare["pid"], (restart, spare)  # the spare itself, not a new process
    assert "ft_hsdp: warm spare of replica group 1 activated after" in (events / "group1.log").read_text()
    # group 0's unused spare was stopped when it finished (group 1, out of restarts, got no second one); no
    # spare process is left behind
    stopped = [(e["group"], e["why"]) for e in launcher if e["event"] == "spare_stopped"]
    assert stopped == [(0, "the group finished")], stopped
    assert not [e["pid"] for e in launcher if e["event"] == "spare" and _alive(e["pid"])]
    assert not list(events.glob("*.go*")), "spare activation files left in the events folder"

    for rank in (0, 1):
        g0, g1 = _records(out, 0, rank), _records(out, 1, rank)
        assert max(r["participants"] for r in g0 + g1) <= 2
        healed = next(r for r in g1 if r["incarnation"] == 1)
        assert healed["step_before"] == 0 and healed["committed"] and healed["step_after"] > 8, healed
        a, b = _dump(out, f"group0_rank{rank}"), _dump(out, f"group1_rank{rank}")
        assert (a["incarnation"], b["incarnation"]) == (0, 1)
        assert a["global_step"] == b["global_step"] == max_steps
        for key in a["shards"]:
            assert torch.equal(a["shards"][key], b["shards"][key]), key
        assert b["ft_stats"]["heals"] >= 1


@pytest.mark.multiprocess
@pytest.mark.torch_range
def test_forkserver_runner_restarts_preimported_groups_that_heal(tmp_path: Path) -> None:
    # --runner forkserver: every incarnation's ranks are forked (through a group leader) from one server that
    # imported torch, Lightning and torchft. The launcher SIGKILLs group 0 (leader and ranks) at step 12 and
    # group 1 at step 24, once group 0 is live again; each restart is forked again, heals, and the groups end
    # identical.
    max_steps = 40
    events = _launch(
        tmp_path, "fork",
        [*FT, "--trainer.max_steps", str(max_steps), "--trainer.enable_checkpointing", "false"],
        ["--runner", "forkserver", "--min-replicas", "1", "--kill-at-steps", "0@12,1@24", "--max-restarts",
         "1"],
        {"FT_TEST_SLEEP_ALONE": "0.5"},
    )
    out = tmp_path / "fork"
    launcher = _jsonl(events / "launcher.jsonl")
    assert [(e["group"], e["why"]) for e in launcher if e["event"] == "kill"] == [
        (0, "at step 12"),
        (1, "at step 24"),
    ]
    exits = [(e["group"], e["code"]) for e in launcher if e["event"] == "exit"]
    assert exits[:2] == [(0, -9), (1, -9)] and sorted(exits[2:]) == [(0, 0), (1, 0)], exits
    starts = [e for e in launcher if e["event"] == "start"]
    assert sorted((e["group"], e["restart"]) for e in starts) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    leader = {e["group"]: e["pid"] for e in starts if e["restart"] == 1}
    assert "(forked from the forkserver: 2 rank(s))" in (events / "group0.log").read_text()
    assert not [e["pid"] for e in starts if _alive(e["pid"])]  # no leader left behind

    for rank in (0, 1):
        for group in (0, 1):
            healed = next(r for r in _records(out, group, rank) if r["incarnation"] == 1)
            assert healed["step_before"] == 0 and healed["committed"] and healed["step_after"] > 12, healed
        a, b = _dump(out, f"group0_rank{rank}"), _dump(out, f"group1_rank{rank}")
        # the ranks started with Lightning imported, as children of their group's leader
        assert a["preimported"] and b["preimported"]
        assert (
            (a["ppid"], b["ppid"]) == (leader[0], leader[1]) and not _alive(a["pid"]) and not _alive(b["pid"])
        )
        assert (a["incarnation"], b["incarnation"]) == (1, 1)
        assert a["global_step"] == b["global_step"] == max_steps
        for key in a["shards"]:
            assert torch.equal(a["shards"][key], b["shards"][key]), key
        assert a["ft_stats"]["heals"] >= 1 and b["ft_stats"]["heals"] >= 1


def test_forkserver_group_fails_as_a_whole_like_torchrun(tmp_path: Path) -> None:
    # One rank exits 3 while the other would sleep a minute: the leader kills it and exits 3; each rank had
    # torchrun's environment, its argv, and the modules preloaded.
    from fsdp_strategies.ft.launch.forkserver import start_group

    script = tmp_path / "rank.py"
    script.write_text(
        "import json, os, sys, time\n"
        "preimported = 'torch' in sys.modules\n"
        "rank = int(os.environ['RANK'])\n"
        "keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', "
        "'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_PORT', 'EXTRA')\n"
        "info = {'argv': sys.argv, 'env': {k: os.environ.get(k) for k in keys}, 'pid': os.getpid(),\n"
        "        'preimported': preimported, 'threads': __import__('torch').get_num_threads()}\n"
        "open(os.path.join(os.environ['OUT'], f'{rank}.json'), 'w').write(json.dumps(info))\n"
        "print('rank', rank, 'says hello', flush=True)\n"
        "sys.exit(3) if rank == 1 else time.sleep(60)\n"
    )
    env = {**os.environ, "OUT": str(tmp_path), "EXTRA": "x", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "12345", "OMP_NUM_THREADS": "1"}
    log = tmp_path / "group.log"
    leader = start_group(
        command=[str(script), "--flag", "v"], ranks=2, env=env, log_path=str(log), cores=None
    )
    assert leader.wait(timeout=45) == 3 and leader.returncode == 3
    infos = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    for rank, info in enumerate(infos):
        assert info["argv"] == [str(script), "--flag", "v"] and info["preimported"] and info["threads"] == 1
        assert info["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                               "LOCAL_WORLD_SIZE": "2",
                               "GROUP_RANK": "0", "MASTER_PORT": "12345", "EXTRA": "x"}
    deadline = time.time() + 10
    while _alive(infos[0]["pid"]) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(infos[0]["pid"]), "the surviving rank was left running"
    text = log.read_text()
    assert "rank 0 says hello" in text and "rank exited with 3" in text


def test_forkserver_runner_rejects_warm_spares_and_another_python() -> None:
    from fsdp_strategies.ft.launch.launcher import LaunchOptions

    with pytest.raises(SystemExit, match="--runner forkserver with --warm-spares: pick one"):
        LaunchOptions(runner="forkserver", warm_spares=True).validate(["train.py"])
    with pytest.raises(SystemExit, match="forks from this Python"):
        LaunchOptions(runner="forkserver", python="/usr/bin/false").validate(["train.py"])
    with pytest.raises(SystemExit, match="--runner 'slurm': use one of torchrun, lightning, forkserver"):
        LaunchOptions(runner="slurm").validate(["train.py"])


@pytest.mark.multiprocess
def test_no_fault_matches_hsdp_and_checkpoint_resume_continues_exactly(tmp_path: Path) -> None:
    # 2 groups x 2 ranks x batch 2 = global batch 8 = hsdp on 4 ranks with the same data layout.
    # 32 samples: an epoch is 4 steps; a checkpoint every 4 steps (written by one group only).
    steps, ckpt = 8, tmp_path / "ckpt"
    no_fault = ["--trainer.max_steps", str(steps), "--trainer.strategy.init_args.init_sync", "false"]
    launcher = ["--min-replicas", "2", "--max-restarts", "0"]
    # The checkpoints are written in the background (async_checkpoint: thread) by the participating rank-0
    # group.
    events = _launch(tmp_path, "ft", [*FT, *no_fault, "--trainer.strategy.init_args.async_checkpoint",
                                      "thread"], launcher, {"FT_TEST_CKPT": str(ckpt)})
    run_python([WORKER, "fit", "--config", "configs/hsdp.yaml", *TINY, "--trainer.max_steps", str(steps),
                "--trainer.enable_checkpointing", "false"], env={"FT_TEST_OUT": str(tmp_path / "hsdp")},
                timeout=300)

    ft0, ft1, ref = _dump(tmp_path / "ft", "group0_rank0"), _dump(tmp_path / "ft", "group1_rank0"), \
        _dump(tmp_path / "hsdp", "grouphsdp_rank0")
    assert ft0["global_step"] == ft1["global_step"] == ref["global_step"] == steps
    for key, value in ref["full"].items():
        assert torch.equal(ft0["full"][key], ft1["full"][key]), key
        torch.testing.assert_close(
            ft0["full"][key], value, rtol=1e-5, atol=1e-6, msg=f"ft_hsdp != hsdp for {key}"
        )
    losses_ft = [r["loss"] for r in _records(tmp_path / "ft", 0, 0)]
    losses_ref = [r["loss"] for r in _records(tmp_path / "hsdp", "hsdp", 0)]  # type: ignore[arg-type]
    assert losses_ft == pytest.approx(losses_ref, rel=1e-5)
    # Per-step torchft figures reach the LightningModule's logged metrics.
    assert ft0["ft_metrics"]["ft/participants"] == 2 and ft0["ft_metrics"]["ft/committed_steps"] == steps
    assert ft0["ft_metrics"]["ft/discarded_steps"] == 0
    # Each step's line says what its fault tolerance cost (benchmarks/suites/ft_overhead.py sums these):
    # the same cross-group all-reduces every step -- one per FSDP unit (2 blocks + the root), together this
    # rank's whole fp32 gradient shard (dim 0 split over the group's 2 ranks) -- and each part timed
    from llama import LlamaLM

    model = LlamaLM(vocab_size=64, dim=64, n_layers=2, n_heads=4, max_seq_len=32)
    model.configure_model()
    shard_bytes = sum(4 * -(-p.shape[0] // 2) * (p.numel() // p.shape[0]) for p in model.parameters())
    for group in (0, 1):
        lines = [r for r in _jsonl(events / f"group{group}.jsonl") if "step_s" in r]
        assert [r["step"] for r in lines] == list(range(1, steps + 1)), lines
        assert {(r["allreduces"], r["allreduce_bytes"]) for r in lines} == {(3, shard_bytes)}, lines
        for r in lines:
            assert 0 < r["cost_allreduce_s"] < r["step_s"] and 0 < r["cost_capture_s"] < r["step_s"], r
            assert r["cost_batch_s"] >= 0 and r["cost_quorum_start_s"] > 0, r
        assert all(r["cost_account_s"] > 0 for r in lines[1:]) and "cost_account_s" not in lines[0], lines

    # The whole job restarted from the step-4 checkpoint continues exactly.
    assert sorted(p.name for p in ckpt.iterdir()) == ["step4.ckpt", "step8.ckpt"]
    assert all(verify_checkpoint(p).ok for p in ckpt.iterdir())  # complete: fit waited for the last write
    _launch(tmp_path, "resumed", [*FT, *no_fault, "--ckpt_path", str(ckpt / "step4.ckpt")], launcher, {})
    for group in (0, 1):
        for rank in (0, 1):
            straight, resumed = _dump(tmp_path / "ft", f"group{group}_rank{rank}"), \
                _dump(tmp_path / "resumed", f"group{group}_rank{rank}")
            assert resumed["global_step"] == resumed["manager_step"] == steps
            assert _records(tmp_path / "resumed", group, rank)[0]["step_before"] == 4
            assert [r["loss"] for r in _records(tmp_path / "resumed", group, rank)] == \
                [r["loss"] for r in _records(tmp_path / "ft", group, rank)][4:]
            for key in straight["shards"]:
                assert torch.equal(straight["shards"][key], resumed["shards"][key]), (group, rank, key)


@pytest.mark.multiprocess
def test_accumulation_one_cross_group_reduction_per_step_sharded_gradients_kill_and_heal(
        tmp_path: Path) -> None:
    # accumulate_grad_batches=4 under accumulation="sharded" (ft_hsdp's default), 2 groups x 2 ranks: 8
    # samples a micro-batch, 32 a step (one step per data epoch). Group 1 SIGKILLs itself in its first
    # cross-group all-reduce of step 3 -- after its 4 micro-batches, in the step's one reduction -- restarts
    # and heals.
    acc, max_steps = 4, 8
    common = ["--trainer.accumulate_grad_batches", str(acc), "--trainer.enable_checkpointing", "false"]
    events = _launch(
        tmp_path, "acc", [*FT, *common, "--trainer.max_steps", str(max_steps),
                          "--trainer.strategy.init_args.init_sync", "false"],
        ["--min-replicas", "1", "--max-restarts", "1"],
        {"FT_TEST_KILL": "1:3:1", "FT_TEST_SLEEP_ALONE": "0.5", "FT_TEST_REJOIN_AFTER": "2",
         "FT_TEST_GRAD_BYTES": "1"})
    # (the same max_steps: the example's LR schedule depends on it)
    run_python([WORKER, "fit", "--config", "configs/hsdp.yaml", *TINY, *common,
                "--trainer.max_steps", str(max_steps)],
               env={"FT_TEST_OUT": str(tmp_path / "hsdp")}, timeout=300)
    out = tmp_path / "acc"
    launcher = _jsonl(events / "launcher.jsonl")
    assert next((e["group"], e["code"]) for e in launcher if e["event"] == "exit") == (1, -9), launcher
    for rank in (0, 1):
        g0, g1 = _records(out, 0, rank), _records(out, 1, rank)
        for r in g0 + g1:
            # between micro-batches a rank holds half the gradients (shard degree 2), never a whole one;
            # the step's last micro-batch ends after the optimizer step (gradients freed)
            held, last = r["held"], r["batch_idx"] % acc == acc - 1
            assert held["unsharded"] == held["pending_all_reduce"] == 0, r
            if not last:
                assert held["sharded"] == pytest.approx(held["full"] / 2, rel=0.02), r
            # one cross-group all-reduce per optimizer step, after its last micro-batch's backward
            assert r["allreduces"] == (1 if last and r["participants"] else 0) or not r["committed"], r
        # the steps both groups trained before the fault equal hsdp's with the same accumulation
        before = [r["loss"] for r in g0 if r["incarnation"] == 0 and r["step_before"] < 3]
        ref = [r["loss"] for r in _records(tmp_path / "hsdp", "hsdp", rank)]  # type: ignore[arg-type]
        assert before == pytest.approx(ref[:3 * acc], rel=1e-5)  # group 0's rank r = hsdp's rank r (data)
        # a kill mid-step loses that step only: the survivor's step 3 is discarded, nothing else
        at3 = [r for r in g0 if r["incarnation"] == 0 and r["step_before"] == 3
               and r["batch_idx"] % acc == acc - 1]
        assert at3[0]["committed"] is False and at3[0]["before"] == at3[0]["after"], at3
        first = next(r for r in g1 if r["incarnation"] == 1)
        assert first["step_before"] == 0, first
        healed = next(r for r in g1 if r["incarnation"] == 1 and r["batch_idx"] % acc == acc - 1)
        assert healed["committed"] and healed["step_after"] > 3, healed
        a, b = _dump(out, f"group0_rank{rank}"), _dump(out, f"group1_rank{rank}")
        assert a["global_step"] == b["global_step"] == max_steps
        for key in a["shards"]:
            assert torch.equal(a["shards"][key], b["shards"][key]), key
    for group in (0, 1):  # the events: one all-reduce per step of both groups, the gradient shard's bytes
        lines = [r for r in _jsonl(events / f"group{group}.jsonl") if "step_s" in r and r["committed"]
                 and r.get("participants") == 2]
        assert lines and {r["allreduces"] for r in lines} == {1}, lines
        assert {r["data_micro_batches"] for r in lines if "data_micro_batches" in r} <= {acc}, lines


@pytest.fixture
def checkpoint_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A local folder, or a folder on a real S3 server (SeaweedFS) with the client's environment."""
    if request.param == "local":
        yield str(tmp_path / "ckpt"), {}
        return
    from support.s3_server import S3Server

    server = S3Server(tmp_path / "s3").start()
    try:
        yield "s3://fsdp-tests/ft-run", server.env()
    finally:
        server.stop()


@pytest.mark.parametrize("checkpoint_dir", ["local", "s3"], indirect=True)
@pytest.mark.multiprocess
def test_every_group_down_resumes_from_the_newest_checkpoint_not_step_0(
        tmp_path: Path, checkpoint_dir: tuple[str, dict[str, str]]) -> None:
    # Both groups kill themselves right after committed step 5 -- no live peer is left to heal from -- with a
    # checkpoint every 2 steps. Restarted, each gets the recorded checkpoints from the launcher and resumes
    # from the newest that verifies (before: both started over from step 0); they end at max_steps, identical.
    # On object storage (s3): the writer group commits each checkpoint by its manifest, the launcher hands the
    # URLs over, and the restarted groups verify and read them from the bucket.
    steps, (ckpt, store_env) = 8, checkpoint_dir
    args = [*FT, "--trainer.max_steps", str(steps), "--trainer.strategy.init_args.init_sync", "false"]
    events = _launch(tmp_path, "ft", args, ["--min-replicas", "2", "--max-restarts", "1"],
                     {"FT_TEST_CKPT": ckpt, "FT_TEST_CKPT_EVERY": "2", "FT_TEST_ALL_DIE_AT": "5",
                      **store_env})
    launcher = _jsonl(events / "launcher.jsonl")
    exits = sorted((e["group"], e["code"]) for e in launcher if e["event"] == "exit")
    assert exits == [(0, -9), (0, 0), (1, -9), (1, 0)], exits  # each killed once, then finished
    firsts = []
    for group in (0, 1):
        for rank in (0, 1):
            second = [r for r in _records(tmp_path / "ft", group, rank) if r["incarnation"] == 1]
            # its first step ends past the checkpoint: restored from it, or (restarted while the other group
            # was still going down, so handed nothing) healed in that step from the group that restored it
            assert second and second[0]["step_after"] >= 5, second[:2]
            firsts.append(second[0]["step_before"])
            assert _dump(tmp_path / "ft", f"group{group}_rank{rank}")["global_step"] == steps
    assert 4 in firsts and set(firsts) <= {0, 4}, firsts  # a group restored the newest checkpoint (step 4)
    handed = [e for e in launcher if e["event"] == "hand_checkpoints"]
    assert handed and all(e["step"] == 4 for e in handed), handed
    assert all(e["newest"] == f"{ckpt}/step4.ckpt" for e in handed), handed
    for rank in (0, 1):
        a, b = (_dump(tmp_path / "ft", f"group{g}_rank{rank}")["shards"] for g in (0, 1))
        for key in a:
            assert torch.equal(a[key], b[key]), (rank, key)
    logs = "".join((events / f"group{g}.log").read_text() for g in (0, 1))
    assert f"resumes from {ckpt}/step4.ckpt" in logs
    if store_env:  # every checkpoint is in the bucket and verifies; nothing went to a local folder "s3:"
        import fsspec

        options = {"endpoint_url": store_env["AWS_ENDPOINT_URL"], "key": store_env["AWS_ACCESS_KEY_ID"],
                   "secret": store_env["AWS_SECRET_ACCESS_KEY"]}
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(ckpt.removeprefix("s3://")))
        assert names == ["step2.ckpt", "step4.ckpt", "step6.ckpt", "step8.ckpt"], names
        for name in names:
            assert verify_checkpoint(f"{ckpt}/{name}", options).ok, name
        assert not list(Path.cwd().glob("s3:*")) and not list(tmp_path.rglob("s3:*"))


@pytest.mark.multiprocess
def test_a_group_restarted_beside_a_live_peer_heals_and_is_handed_nothing(tmp_path: Path) -> None:
    # Checkpoints every 2 steps, group 1 SIGKILLed in step 5 while group 0 lives: the launcher hands group 1
    # no checkpoint (a live peer is ahead), it heals from group 0 as always and both end identical. (Group 0
    # waits, while alone, until the restarted group 1 trains: a slow restart must not find the job finished.)
    steps, ckpt = 12, tmp_path / "ckpt"
    events = _launch(tmp_path, "ft", [*FT, "--trainer.max_steps", str(steps)],
                     ["--min-replicas", "1", "--max-restarts", "1"],
                     {"FT_TEST_CKPT": str(ckpt), "FT_TEST_CKPT_EVERY": "2", "FT_TEST_KILL": "1:5:1",
                      "FT_TEST_SLEEP_ALONE": "0.5", "FT_TEST_AWAIT_REJOIN": "1"})
    launcher = _jsonl(events / "launcher.jsonl")
    assert not [e for e in launcher if e["event"] == "hand_checkpoints"], launcher
    assert sorted(e["group"] for e in launcher if e["event"] == "start") == [0, 1, 1]
    for rank in (0, 1):
        a, b = _dump(tmp_path / "ft", f"group0_rank{rank}"), _dump(tmp_path / "ft", f"group1_rank{rank}")
        assert b["ft_stats"]["heals"] >= 1 and a["global_step"] == b["global_step"] == steps
        for key in a["shards"]:
            assert torch.equal(a["shards"][key], b["shards"][key]), (rank, key)


# ---------------------------------------------------------------------------- clear errors (no processes)
def test_errors_name_the_option_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"lighthouse_addr is not set.*torchft_lighthouse"):
        FTHSDPStrategy(replica_group_id=0, num_replica_groups=1)
    with pytest.raises(ValueError, match=r"replica_group_id is missing.*REPLICA_GROUP_ID"):
        FTHSDPStrategy(lighthouse_addr="http://localhost:1", num_replica_groups=2)
    with pytest.raises(ValueError, match=r"replica_group_id=2 is out of range.*\[0, 1\]"):
        FTHSDPStrategy(lighthouse_addr="http://localhost:1", replica_group_id=2, num_replica_groups=2)
    monkeypatch.setenv("REPLICA_GROUP_ID", "-1")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    with pytest.raises(ValueError, match="replica_group_id=-1 is out of range"):
        FTHSDPStrategy(lighthouse_addr="http://localhost:1")
    with pytest.raises(ValueError, match="min_replica_size=3"):
        FTHSDPStrategy(lighthouse_addr="http://localhost:1", replica_group_id=0, min_replica_size=3)
    with pytest.raises(ValueError, match="checkpoint_transport='nccl'"):
        FTHSDPStrategy(lighthouse_addr="http://localhost:1", replica_group_id=0, checkpoint_transport="nccl")
    with pytest.raises(ValueError, match="accumulation='gather' is invalid"):
        FTHSDPStrategy(lighthouse_addr="http://localhost:1", replica_group_id=0, accumulation="gather")
    # What the Trainer and the module ask (checked in the strategy's setup, with these arguments)
    from fsdp_strategies.ft.options import check_training

    with pytest.raises(ValueError, match=r"automatic optimization only.*Fix: remove `self.automatic_opt"):
        check_training("sharded", "skip", 1, automatic_optimization=False)
    with pytest.raises(ValueError, match=r"accumulation='no_sync' with data_on_failure='redistribute' and "
                                         r"accumulate_grad_batches=2 is not supported.*Fix: accumulation="):
        check_training("no_sync", "redistribute", 2, automatic_optimization=True)
    check_training("no_sync", "redistribute", 1, automatic_optimization=True)  # no accumulation: no conflict
    check_training("sharded", "redistribute", 4, automatic_optimization=True)

    # Degrees must match the group's size; the lighthouse must answer -- both before any process starts.
    port = free_port()
    strategy = FTHSDPStrategy(lighthouse_addr=f"http://127.0.0.1:{port}", replica_group_id=0, shard_degree=4)
    with pytest.raises(ValueError, match="shard_degree=4 does not match the replica group's size 2"):
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    strategy = FTHSDPStrategy(lighthouse_addr=f"http://127.0.0.1:{port}", replica_group_id=1)
    with pytest.raises(
        LighthouseUnreachableError, match=rf"127.0.0.1:{port}.*torchft_lighthouse --min_replicas"
    ):
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    # ... and with a listening lighthouse the Trainer builds, also from the registry name + environment.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setenv("REPLICA_GROUP_ID", "1")
        trainer = pl.Trainer(strategy="ft_hsdp", accelerator="cpu", devices=2, logger=False)
        assert isinstance(trainer.strategy, FTHSDPStrategy)
        assert (trainer.strategy.replica_group_id, trainer.strategy.num_replica_groups) == (1, 2)


def test_cross_group_reduction_is_deferred_to_one_call_per_dtype_under_accumulation() -> None:
    # CrossGroupReduce with a fake manager link (each all-reduce triples the tensor: "the other groups").
    from types import SimpleNamespace

    from torch.distributed import ReduceOp

    from fsdp_strategies.ft.accounting import StepInFlight
    from fsdp_strategies.ft.cross_group import CrossGroupReduce

    calls: list[tuple[torch.dtype, int, ReduceOp]] = []

    class Link:
        def gradient_allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp,
                               quorum: object = None) -> object:
            calls.append((tensor.dtype, tensor.numel(), reduce_op))
            tensor.mul_(3.0)
            return SimpleNamespace(wait=lambda: None)

    step, waits = StepInFlight(), []
    cross = CrossGroupReduce(step, lambda: waits.append(1), lambda: False)
    cross.link = Link()
    # one micro-batch per step: the FSDP hook reduces each unit's output at once, with this group's weight
    step.grad_scale, out = 0.5, torch.ones(4)
    cross.hook(out)
    assert calls == [(torch.float32, 4, ReduceOp.AVG)] and out.tolist() == [1.5] * 4 and waits
    # accumulation: from a non-final micro-batch on, the hook only weights; one reduction after the last
    calls.clear()
    with cross.micro_batch():
        cross.hook(out := torch.ones(4))
    cross.hook(last := torch.ones(4))
    assert not calls and out.tolist() == last.tolist() == [0.5] * 4
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1).double())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    cross.reduce_accumulated(model)
    assert calls == [(torch.float32, 8, ReduceOp.AVG), (torch.float64, 3, ReduceOp.AVG)], calls
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())
    # NonFiniteGuard's weight (a sum) replaces the redistribute weights the micro-batches already got
    calls.clear()
    step.sum_scale, step.micro_scales = 0.25, [0.5, 0.5]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    cross.reduce_accumulated(model)
    assert {op for *_, op in calls} == {ReduceOp.SUM}
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25 / 0.5 * 3.0)) for p in model.parameters())
    cross.end_step()
    assert not cross.deferred
    cross.paused = lambda: True  # a semi-synchronous phase: nothing deferred, nothing sent
    with cross.micro_batch():
        cross.hook(torch.ones(4))
    assert not cross.deferred and len(calls) == 2


@pytest.mark.parametrize("case", ["fresh", "root_params", "grads_kept", "cast"])
def test_the_cross_group_all_reduce_runs_behind_the_backward_and_ends_with_it(case: str) -> None:
    """Issue 43: each FSDP unit's cross-group all-reduce starts in FSDP2's hook and is waited for when the
    backward ends, not in the hook -- only where FSDP2 leaves the reduced tensor alone until then (the
    unit's gradients are views of it). A fake link's all-reduce does its work ("the other groups": x3) only
    when waited for, as a late one would: after ``backward()`` every gradient must be 3x the reference's.
    ``root_params``: the root unit holds parameters too (its reduction runs in FSDP2's own end-of-backward
    callback). ``grads_kept`` (a second backward onto kept gradients: FSDP2 adds into them at once) and
    ``cast`` (bf16 reduction, fp32 parameters: FSDP2 copies at once) must wait in the hook."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_strategies.ft.accounting import StepInFlight
    from fsdp_strategies.ft.cross_group import CrossGroupReduce
    from fsdp_strategies.parallel.replicated_params import set_all_reduce_hook

    class Work:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor, self.done = tensor, False

        def wait(self) -> None:
            if not self.done:
                self.tensor.mul_(3.0)
                self.done = True

    works: list[Work] = []
    overlapped: list[bool] = []  # per all-reduce: was the previous one still running when it started?

    class Link:
        def gradient_allreduce(self, tensor: torch.Tensor, reduce_op: object, quorum: object = None) -> Work:
            overlapped.append(bool(works) and not works[-1].done)
            works.append(Work(tensor))
            return works[-1]

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        reference = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", (1,))
        policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if case == "cast" else None)
        for layer in (model[0], model) if case == "root_params" else (model[0], model[2], model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        cross = CrossGroupReduce(StepInFlight(), lambda: None, lambda: False)
        cross.link = Link()
        set_all_reduce_hook(model, cross.hook, cross.unit_hook)
        x = torch.randn(3, 4)
        backwards = 2 if case == "grads_kept" else 1
        for _ in range(backwards):
            model(x).sum().backward()
            reference(x).sum().backward()
        assert len(works) == 2 * backwards and all(w.done for w in works) and not cross.pending
        assert overlapped[-2:] == [False, case in ("fresh", "root_params")], overlapped  # the last two
        tolerance = 1e-2 if case == "cast" else 1e-6
        for p, ref in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), 3.0 * ref.grad, rtol=tolerance, atol=tolerance)
    finally:
        dist.destroy_process_group()


@pytest.mark.subprocess
def test_leave_quorum_exits_the_group_for_a_restart(tmp_path: Path) -> None:
    # The straggler callback's `evict`: the rank records why, shuts torchft down and exits with
    # LEAVE_EXIT_CODE (the launcher restarts any non-zero exit; the heal path is the one tested above).
    events = tmp_path / "events-{replica_group_id}.jsonl"
    code = ("from fsdp_strategies import FTHSDPStrategy\n"
            "s = FTHSDPStrategy(lighthouse_addr='http://127.0.0.1:1', "
            "replica_group_id=1, num_replica_groups=2, "
            f"events_file={str(events)!r})\n"
            "s.leave_quorum('slow rank 3')\n"
            "raise SystemExit('leave_quorum returned')\n")
    proc = run_python(["-c", code], check=False, timeout=120)
    assert proc.returncode == LEAVE_EXIT_CODE, proc.stderr[-2000:]
    assert "leaves the quorum: slow rank 3" in proc.stderr
    assert _jsonl(tmp_path / "events-1.jsonl")[-1]["left"] == "slow rank 3"


@pytest.mark.multiprocess
def test_straggler_evict_makes_the_whole_group_leave_and_heal(tmp_path: Path) -> None:
    # Rank 1 of group 1 sleeps 0.5 s per step; StragglerDetector(action="evict") in group 1 names it after one
    # window; both ranks of group 1 leave at the same step with LEAVE_EXIT_CODE, group 0 goes on, the
    # restarted group 1 (no injection) heals and both finish (group 0 sleeps 1.5 s per step while alone so the
    # restart overlaps).
    events = _launch(
        tmp_path,
        "evict",
        [*FT, "--trainer.max_steps", "24", "--trainer.enable_checkpointing", "false"],
        ["--min-replicas", "1", "--max-restarts", "1"],
        {"FT_TEST_STRAGGLER": "1:1:0.5", "FT_TEST_SLEEP_ALONE": "1.5"},
    )
    out = tmp_path / "evict"
    launcher = _jsonl(events / "launcher.jsonl")
    exits = [(e["group"], e["code"]) for e in launcher if e["event"] == "exit"]
    assert exits[0][0] == 1 and exits[0][1] != 0 and sorted(exits[1:]) == [(0, 0), (1, 0)], exits
    log = (events / "group1.log").read_text()
    left = {}
    for rank in (0, 1):
        lines = [
            ln
            for ln in log.splitlines()
            if f"replica group 1 rank {rank} leaves the quorum at committed step" in ln
        ]
        assert len(lines) == 1, log[-3000:]
        left[rank] = int(lines[0].split("committed step ")[1].split(":")[0])
        last = max(r["step_after"] for r in _records(out, 1, rank) if r["incarnation"] == 0)
        assert last == left[rank]
    assert left[0] == left[1] and left[0] < 24
    assert next(r for r in _jsonl(events / "group1.jsonl") if "left" in r)["step_left"] == left[0]
    report = json.loads((out / "straggler.json").read_text())
    assert report["events"][-1]["event"] == "evict" and report["events"][-1]["ranks"] == [1]
    assert _dump(out, "group0_rank0")["global_step"] == 24 and _dump(out, "group1_rank1")["global_step"] == 24


def test_launcher_kill_plan_parsing() -> None:
    assert parse_kill_at("1@8, 0@20", 2) == [(1, 8), (0, 20)]
    assert parse_kill_at("12,5", 2) == [(None, 5), (None, 12)]
    with pytest.raises(SystemExit, match="group 2 is out of range"):
        parse_kill_at("2@5", 2)
