"""ft_hsdp exact data accounting across faults (``data_on_failure`` = ``skip`` / ``redistribute``), real
processes.

2 replica groups x 1 rank, started by ``fsdp-strategies-ft``; a dataset that returns its indices, a callback
that records the sample ids every group trained at every step (tests/workers/ft_data.py). Groups are
SIGKILLed by the launcher at planned steps and once while applying a heal. Checked: at committed step ``s``
every group that took part trained batch ``s mod B`` of its shard (data epoch ``s // B``), no sample is
trained twice in a data epoch; with ``skip`` what is not trained is exactly the down groups' shards for the
steps they were down -- which is what the strategy reported (per-step records and the launcher's summary);
with ``redistribute`` the groups in a step also trained the missing groups' batches of that step, so every
data epoch trains every sample exactly once.

Under ``accumulate_grad_batches=A`` committed step ``s`` trains positions ``s * A`` to ``s * A + A - 1``
(one quorum, one cross-group reduction, one commit per step); a kill mid-step loses that step only.

With 2 kills in CI (one launcher kill, one kill during the heal that follows): ``skip`` with accumulation 2
in ``make test``, ``skip`` without and ``redistribute`` with accumulation 2 in ``make test-full`` (the
latter weights each micro-batch by its share); ``FSDP_STRATEGIES_FULL=1`` adds both modes without
accumulation with 6 kills (4 launcher kills, 2 of them followed by a kill during the heal).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from conftest import WORKERS, run_python

WORKER = str(WORKERS / "ft_data.py")
GROUPS, NUM_SAMPLES, BATCH, SEED = 2, 96, 4, 7
PER_EPOCH = NUM_SAMPLES // GROUPS // BATCH  # committed steps per data epoch


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _expected(group: int, position: int, cache: dict) -> list[int]:
    """Batch ``position mod PER_EPOCH`` of data epoch ``position // PER_EPOCH`` of the group's shard
    (Lightning's sampler). Committed step ``s`` trains positions ``s * A .. s * A + A - 1``
    (``accumulate_grad_batches=A``)."""
    epoch, i = divmod(position, PER_EPOCH)
    if (group, epoch) not in cache:
        sampler = DistributedSampler(
            range(NUM_SAMPLES), num_replicas=GROUPS, rank=group, shuffle=True, seed=SEED
        )
        sampler.set_epoch(epoch)
        cache[group, epoch] = list(sampler)
    return cache[group, epoch][i * BATCH:(i + 1) * BATCH]


def _run(tmp: Path, mode: str, steps: int, kill_at: str, heal_kill: str, timeout: float,
         accumulate: int = 1) -> tuple[dict, list]:
    # Steps are paced (0.1 s, 1 s while a group is down) so that restarts (tens of seconds on a busy machine)
    # overlap training; the lighthouse's join timeout (2 s) stays above the pause, so a restarted group never
    # forms a quorum of its own while the survivor sleeps.
    events = tmp / "events"
    run_python(["-m", "fsdp_strategies.ft", "--groups", str(GROUPS), "--ranks-per-group", "1",
                "--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "2000", "--events-dir", str(events),
                "--timeout", str(timeout - 20), "--min-replicas", "1", "--kill-at-steps", kill_at,
                "--max-restarts", "8", "--", WORKER],
               env={"FT_DATA_OUT": str(tmp / "out"), "FT_DATA_STEPS": str(steps), "FT_DATA_SLEEP": "0.1",
                    "FT_DATA_SLEEP_ALONE": "1.0",
                    "FT_DATA_HEAL_KILL": heal_kill, "FT_DATA_MODE": mode,
                    "FT_DATA_ACCUMULATE": str(accumulate)}, timeout=timeout)
    records = {g: _jsonl(tmp / "out" / f"group{g}_rank0.jsonl") for g in range(GROUPS)}
    return records, _jsonl(events / "launcher.jsonl")


def _check(mode: str, records: dict, launcher: list, steps: int, launcher_kills: int, heal_kills: int,
           accumulate: int = 1) -> dict:
    a = accumulate
    kills = [e for e in launcher if e["event"] == "kill" and e["why"].startswith("at step")]
    assert len(kills) == launcher_kills, kills
    in_heal = [r for g in records for r in records[g] if r.get("killed_in_heal")]
    assert len(in_heal) == heal_kills, in_heal
    # every incarnation of a killed group after the last kill came back, healed and took part again
    for g, recs in records.items():
        last = max(r["incarnation"] for r in recs)
        assert any(r["incarnation"] == last and r.get("participating") for r in recs), (g, last)
    cache: dict = {}

    # 1. Every group that took part in a step trained the step's batch of its own shard, in phase.
    by_step: dict[int, dict] = {}
    for g, recs in records.items():
        seen = set()
        for r in recs:
            if r.get("killed_in_heal"):
                continue
            assert r["step_after"] == r["step"] + int(r["committed"]), r
            if r["participating"]:  # (a healing group contributes zeros: its batch does not matter)
                assert r["position"] == r["step"] * a and r["micro_batches"] == len(r["ids"]) == a, (g, r)
                for m, ids in enumerate(r["ids"]):  # each micro-batch: its own batch, then redistributed ones
                    assert ids[:BATCH] == _expected(g, r["step"] * a + m, cache), (g, m, r)
                assert sum(map(len, r["ids"])) == a * BATCH + r["redistributed_samples"], r
                assert mode == "redistribute" or not r["redistributed_samples"], r
            if r["committed"]:
                assert r["step"] not in seen, f"group {g} committed step {r['step']} twice"
                seen.add(r["step"])
                by_step.setdefault(r["step"], {})[g] = r
    assert sorted(by_step) == list(range(steps)), "some committed step has no record"

    # 2. Who trained each committed step: everybody when all groups took part (a group killed right after such
    #    a step leaves no record, but its gradients are in the committed update); else the participating ones.
    trained: dict[int, set[int]] = {}
    extra_ids: dict[int, list[int]] = {}  # redistribute: the missing groups' samples trained by the others
    missed_reported: dict[int, int] = {}
    for step, recs in by_step.items():
        participants = {r["participants"] for r in recs.values() if r["participating"]}
        assert len(participants) == 1, (step, recs)
        (p,) = participants
        active = {g for g, r in recs.items() if r["participating"]}
        trained[step] = set(range(GROUPS)) if p == GROUPS else active
        assert len(trained[step]) == p, (step, recs)
        extra_ids[step] = [i for r in recs.values() if r["participating"]
                           for m in r["ids"] for i in m[BATCH:]]
        reports = {r["missed_samples"] for r in recs.values() if r["participating"]}
        assert len(reports) == 1, (step, recs)
        missed_reported[step] = reports.pop()

    # 3. Per data epoch: no sample twice; missed = exactly the down groups' shards for the down steps =
    #    reported.
    total_missed = 0
    per_epoch = PER_EPOCH // a  # committed steps per data epoch
    for epoch in range(steps // per_epoch):
        ids: list[int] = []
        missed: set[int] = set()
        for step in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            down = [g for g in range(GROUPS) if g not in trained[step]]

            def batches(groups: list[int] | set[int], step: int = step) -> list[int]:
                return [i for g in groups for m in range(a) for i in _expected(g, step * a + m, cache)]

            step_missed = batches(down)
            if mode == "redistribute":  # the down groups' batches were trained by the others, in this step
                assert sorted(extra_ids[step]) == sorted(step_missed), (step, extra_ids[step], down)
                step_missed = []
            else:
                assert not extra_ids[step], step
            assert missed_reported[step] == len(step_missed), (step, missed_reported[step], down)
            missed.update(step_missed)
            ids += batches(trained[step]) + extra_ids[step]
        twice = [i for i, n in Counter(ids).items() if n > 1]
        assert not twice, f"data epoch {epoch}: samples trained twice: {twice}"
        assert set(ids) | missed == set(range(NUM_SAMPLES)) and not set(ids) & missed, epoch
        total_missed += len(missed)
    summary = next(e for e in launcher if e["event"] == "data")
    assert summary["committed_steps"] == steps
    assert summary["missed_samples"] == sum(missed_reported.values())
    if mode == "skip":
        # (back-to-back faults merge into one stretch of steps with a group missing)
        assert summary["missed_samples"] == sum(n for _, _, n in summary["missed_stretches"]) > 0
    else:
        assert summary["missed_samples"] == 0 and total_missed == 0
        assert (
            summary["redistributed_samples"]
            == sum(len(v) for v in extra_ids.values())
            >= BATCH * launcher_kills
        )
    # the loader follows the step: batches are rebuilt from the dataset only around faults
    rebuilt = sum(r["rebuilt"] for recs in records.values() for r in recs if "rebuilt" in r)
    assert rebuilt <= 6 * a * (launcher_kills + heal_kills) + 2 * GROUPS, rebuilt
    return {"missed_samples": summary["missed_samples"],
            "redistributed": sum(len(v) for v in extra_ids.values()),
            "stretches": summary["missed_stretches"],
            "rebuilt": rebuilt, "restarts": sum(e["event"] == "start" for e in launcher) - GROUPS}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("mode", "accumulate"), [
    pytest.param("skip", 2, marks=pytest.mark.lightning_range),
    pytest.param("skip", 1, marks=pytest.mark.full),
    pytest.param("redistribute", 2, marks=pytest.mark.full)])
def test_every_sample_is_accounted_for_across_kills(tmp_path: Path, mode: str, accumulate: int) -> None:
    # group 1 killed at step 5, its restart killed while applying the heal, the next restart heals; with
    # accumulate_grad_batches=A a step is A micro-batches (positions s*A..s*A+A-1), its records hold them all
    steps = 100 // accumulate
    records, launcher = _run(tmp_path, mode, steps, "1@5", "1:1", timeout=420, accumulate=accumulate)
    figures = _check(mode, records, launcher, steps, 1, 1, accumulate)
    print(f"data accounting ({mode}, accumulate_grad_batches={accumulate}): {figures}")


@pytest.mark.multiprocess
@pytest.mark.soak  # the 2-kill form above runs in CI (skip: make test, redistribute: make test-full)
@pytest.mark.parametrize("mode", ["skip", "redistribute"])
def test_every_sample_is_accounted_for_across_six_kills(tmp_path: Path, mode: str) -> None:
    # 4 launcher kills + 2 kills during the heals that follow (group 1's 1st and group 0's 1st restart)
    records, launcher = _run(tmp_path, mode, 200, "1@5,0@30,1@60,0@90", "1:1,0:1", timeout=900)
    figures = _check(mode, records, launcher, 200, 4, 2)
    print(f"data accounting ({mode}, 6 kills): {figures}")


@pytest.mark.multiprocess
def test_a_job_resumed_with_three_groups_trains_the_rest_of_the_epoch_once(tmp_path: Path) -> None:
    # 2 groups x 1 rank x batch 4 train 5 steps (40 of the epoch's 96 samples) and checkpoint; the job is
    # restarted with 3 groups from that checkpoint: the 56 samples left are split over 3 shards (19 each, one
    # padding sample: DistributedSampler's rule), 5 steps; then epoch 1 is the 3-shard sampler's own.
    ckpt = tmp_path / "ckpt"

    def launch(name: str, groups: int, steps: int, env: dict[str, str]) -> dict[int, list[dict]]:
        run_python(["-m", "fsdp_strategies.ft", "--groups", str(groups), "--ranks-per-group", "1",
                    "--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "2000",
                    "--min-replicas", str(groups), "--events-dir", str(tmp_path / f"{name}-events"),
                    "--timeout", "200", "--max-restarts", "0", "--", WORKER],
                   env={"FT_DATA_OUT": str(tmp_path / name), "FT_DATA_STEPS": str(steps), **env}, timeout=240)
        return {g: _jsonl(tmp_path / name / f"group{g}_rank0.jsonl") for g in range(groups)}

    first = launch("two", 2, 5, {"FT_DATA_CKPT": str(ckpt), "FT_DATA_CKPT_EVERY": "5"})
    second = launch("three", 3, 12, {"FT_DATA_RESUME": str(ckpt / "step=5.ckpt")})
    ids = [i for recs in first.values() for r in recs for m in r["ids"] for i in m]
    assert sorted(r["step"] for recs in first.values() for r in recs) == sorted(2 * list(range(5)))
    resumed = {g: {r["step"]: r for r in recs} for g, recs in second.items()}
    assert all(sorted(by_step) == list(range(5, 12)) for by_step in resumed.values()), resumed
    ids += [i for by_step in resumed.values() for s in range(5, 10) for m in by_step[s]["ids"] for i in m]
    counts = Counter(ids)
    assert set(counts) == set(range(NUM_SAMPLES)), sorted(set(range(NUM_SAMPLES)) - set(counts))
    assert sum(n - 1 for n in counts.values()) == 1, counts  # the one padding sample of 56 over 3 shards
    for g, by_step in resumed.items():  # epoch 1: the 3-shard sampler's own batches
        sampler = DistributedSampler(range(NUM_SAMPLES), num_replicas=3, rank=g, shuffle=True, seed=SEED)
        sampler.set_epoch(1)
        assert [by_step[s]["ids"][0] for s in (10, 11)] == [list(sampler)[:4], list(sampler)[4:8]], g
    log = (tmp_path / "three-events" / "group0.log").read_text()
    assert "ft_hsdp: resuming step 5 with another data layout: the checkpoint's 2 shards x batch 4" in log, \
        log[-3000:]


# ---------------------------------------------------------------------------- no processes
def test_data_on_failure_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_strategies import FTHSDPStrategy

    with pytest.raises(
        ValueError, match=r"data_on_failure='everything' is invalid. Fix: one of \['skip', 'redistribute'\]"
    ):
        FTHSDPStrategy(lighthouse_addr="http://localhost:1", replica_group_id=0, num_replica_groups=2,
                       data_on_failure="everything")  # type: ignore[arg-type]
    assert FTHSDPStrategy(lighthouse_addr="http://localhost:1", replica_group_id=0,
                          num_replica_groups=2).data_on_failure == "skip"


class _Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"idx": i}


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_follows_the_committed_step(num_workers: int) -> None:
    # Lightning's loop, reduced: an epoch of PER_EPOCH batches with one batch prefetched, the strategy taking
    # the batch of the committed step each time. The steps: a discarded step (3 twice), a heal (jump 9 -> 40),
    # epochs crossed on both sides. Every step gets its own batch; only the fault points build one from the
    # dataset.
    from fsdp_strategies.ft.data import StepAlignedData

    sampler = DistributedSampler(range(NUM_SAMPLES), num_replicas=GROUPS, rank=1, shuffle=True, seed=SEED)
    loader = torch.utils.data.DataLoader(_Ids(), batch_size=BATCH, sampler=sampler, num_workers=num_workers)
    aligned = StepAlignedData(loader, PER_EPOCH)
    steps = [0, 1, 2, 3, 3, *range(4, 10), *range(40, 70)]
    todo, cache, rebuilt = iter(steps), {}, []
    while True:
        it = iter(aligned.loader)
        ahead = next(it)
        for _ in range(len(aligned.loader)):
            current, ahead = ahead, next(it, None)
            step = next(todo, None)
            if step is None:
                assert [s for s, r in zip(steps, rebuilt) if r] == [3, 40], rebuilt
                return
            batch, was_rebuilt = aligned.take(current, step, lambda b: b)
            rebuilt.append(was_rebuilt)
            assert batch["idx"].tolist() == _expected(1, step, cache), step
            if ahead is None:
                break


def test_redistribute_batch_and_gradient_weight() -> None:
    # 3 groups, group 1 missing from step 5: groups 0 and 2 add halves of group 1's batch and weight their
    # gradients so that torchft's average over the 2 participants equals the mean gradient over all 3 groups'
    # samples.
    from torch.distributed import ReduceOp

    from fsdp_strategies.ft.data import StepAlignedData
    from fsdp_strategies.ft.redistribute import redistribute

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return NUM_SAMPLES

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(i)
            return {"idx": i, "x": torch.randn(3, generator=g), "y": torch.randn(1, generator=g)}

    class Manager:
        def num_participants(self) -> int: return 2
        def is_participating(self) -> bool: return True

        def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp) -> object:
            assert reduce_op == ReduceOp.SUM
            tensor.copy_(torch.tensor([1.0, 0.0, 1.0]))
            return type("Done", (), {"wait": lambda self: None})()

    class NoAllReduce(Manager):
        def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp) -> object:
            raise AssertionError("the step's groups were known")

    model = torch.nn.Linear(3, 1)

    def grad(batch: dict) -> torch.Tensor:
        model.zero_grad()
        torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    step, per_epoch, averaged, seen = 5, NUM_SAMPLES // 3 // BATCH, 0.0, []
    for group in (0, 2):
        sampler = DistributedSampler(Samples(), num_replicas=3, rank=group, shuffle=True, seed=SEED)
        data = StepAlignedData(
            torch.utils.data.DataLoader(Samples(), batch_size=BATCH, sampler=sampler), per_epoch
        )
        got = redistribute(None, step, data=data, manager=Manager(), replica_group_id=group,
                           num_replica_groups=3, rank=0, world_size=1, device=torch.device("cpu"),
                           prepare=lambda b: b)
        batch, extra, grad_scale = got.batch, got.extra_samples, got.grad_scale
        assert got.live == [0, 2]
        # a later micro-batch of the same step reuses the groups learnt: no second mask all-reduce
        again = redistribute(None, step, data=data, manager=NoAllReduce(), replica_group_id=group,
                             num_replica_groups=3, rank=0, world_size=1, device=torch.device("cpu"),
                             prepare=lambda b: b, live=got.live)
        assert again.batch["idx"].tolist() == batch["idx"].tolist() and again.grad_scale == grad_scale
        assert batch["idx"].tolist()[:BATCH] == data.indices_of(step)
        assert extra == BATCH // 2
        seen += batch["idx"].tolist()
        averaged = averaged + grad_scale * grad(batch) / 2  # torchft: AVG over 2 participants
    everything = StepAlignedData(torch.utils.data.DataLoader(Samples(), batch_size=BATCH,
                                                             sampler=DistributedSampler(
        Samples(), num_replicas=3, rank=0, shuffle=True, seed=SEED)), per_epoch)
    full = [i for g in range(3) for i in everything.indices_of(step, g)]
    assert sorted(seen) == sorted(full)
    torch.testing.assert_close(averaged, grad(everything.collate(full)))


def _aligned(shards: int, shard: int, batch: int, accumulate: int = 1, seed: int = SEED):
    from fsdp_strategies.ft.data import StepAlignedData

    sampler = DistributedSampler(range(NUM_SAMPLES), num_replicas=shards, rank=shard, shuffle=True, seed=seed)
    loader = torch.utils.data.DataLoader(_Ids(), batch_size=batch, sampler=sampler)
    return StepAlignedData(loader, len(loader), accumulate)


def _trained(layouts: list[tuple[int, int, int, int]]) -> list[int]:
    """Sample ids of the runs ``(shards, batch, accumulate, steps)``, each resumed from the previous one's
    checkpoint at its last step (a new layout every time), all shards of every step."""
    ids: list[int] = []
    saved, step = None, 0
    for shards, batch, accumulate, steps in layouts:
        run = [_aligned(shards, g, batch, accumulate) for g in range(shards)]
        for data in run:
            data.resume_from(saved, step, loader_drop_last=False)
        for s in range(step, step + steps):
            for m in range(accumulate):
                ids += [i for data in run for i in data.indices_of(s * accumulate + m)]
        saved, step = run[0].layout().to_dict(), step + steps
    return ids


def test_a_resume_at_another_width_continues_at_the_global_sample_position() -> None:
    # ft_hsdp's steps are positions; resumed with another number of groups (shards), per-rank batch or
    # accumulation, the run continues the checkpoint's epoch at its global sample position: every sample of
    # an epoch is trained once (DistributedSampler's padding of the rest excepted), across chained changes.
    from fsdp_strategies.ft.resume_width import Layout
    from fsdp_strategies.runtime.data_position import DataPositionError

    # 2 shards x 4 for 5 steps (40 samples), then 3 shards x 4: 56 left -> 19 each (1 padding), 5 batches
    ids = _trained([(2, 4, 1, 5), (3, 4, 1, 5)])
    counts = Counter(ids)
    assert set(counts) == set(range(NUM_SAMPLES)) and sum(n - 1 for n in counts.values()) == 1, counts
    # chained: 2 x 4 (3 steps) -> 3 x 4 with accumulation 2 (2 steps: 48 samples) -> 4 x 2 (to the end)
    ids = _trained([(2, 4, 1, 3), (3, 4, 2, 2), (4, 2, 1, 3)])
    assert Counter(ids) == Counter(range(NUM_SAMPLES))  # 24 + 48 + 24, no padding needed
    # after the resumed epoch, the new sampler's own epochs: 3 shards x 4, epoch 1 batch 0 at step 5 + 5
    later = [_aligned(3, g, 4) for g in range(3)]
    saved = _aligned(2, 0, 4).layout().to_dict()
    for data in later:
        data.resume_from(saved, 5, loader_drop_last=False)
    for g, data in enumerate(later):
        sampler = DistributedSampler(range(NUM_SAMPLES), num_replicas=3, rank=g, shuffle=True, seed=SEED)
        sampler.set_epoch(1)
        assert data.indices_of(10) == list(sampler)[:4], g
    # the same layout keeps the checkpoint's mapping (its rest included): a restart of the resumed run
    again = _aligned(3, 1, 4)
    line = again.resume_from(later[1].layout().to_dict(), 7, loader_drop_last=False)
    assert line is None
    assert [again.indices_of(q) for q in range(5, 12)] == [later[1].indices_of(q) for q in range(5, 12)]
    assert Layout.from_dict(later[1].layout().to_dict()) == later[1].layout()
    # another epoch order cannot be placed: refused, naming both orders and the fix
    with pytest.raises(DataPositionError, match=r"seed=7\) differs from this run's .*seed=8\).*Fix: resume"):
        _aligned(3, 0, 4, seed=8).resume_from(saved, 5, loader_drop_last=False)
