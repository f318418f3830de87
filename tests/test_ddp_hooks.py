"""``ddp_hooks``: comm hooks, post-local / hierarchical SGD and their checkpoint state, with real
processes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from conftest import WORKERS, run_python
from fsdp_strategies import STRATEGY_NAMES, DDPHooksStrategy, verify_checkpoint
from fsdp_strategies.strategies.ddp_hooks import in_bucket_order

WORKER = str(WORKERS / "ddp_train.py")
TINY_CLI = (
    "--trainer.logger false --trainer.enable_checkpointing false --trainer.enable_progress_bar false "
    "--trainer.val_check_interval 4 --trainer.limit_val_batches 1 --model.dim 64 --model.max_seq_len 32 "
    "--model.vocab_size 64 --data.vocab_size 64 --data.seq_len 32 --data.num_train 256 --data.num_val 16"
)


def _run(tmp_path: Path, devices: int, runs: list[str], steps: int, cli_extra: str = "", timeout: float = 400,
         bucket_cap_mb: float | None = None) -> dict:
    out = tmp_path / "out.pt"
    cap = [] if bucket_cap_mb is None else ["--bucket-cap-mb", str(bucket_cap_mb)]
    run_python([WORKER, "--out", str(out), "--devices", str(devices), "--steps", str(steps), "--runs",
                ",".join(runs), "--cli-extra", cli_extra, *cap], timeout=timeout)
    return torch.load(out, weights_only=False)


def _tail_loss(run: dict[str, Any], n: int = 3) -> float:
    rows = run["rows"][-n:]
    return sum(sum(r["loss"]) / len(r["loss"]) for r in rows) / len(rows)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


# ---------------------------------------------------------------------- no processes
def test_registered_without_shadowing_lightning() -> None:
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    assert "ddp_hooks" in STRATEGY_NAMES
    assert StrategyRegistry["ddp_hooks"]["strategy"] is DDPHooksStrategy
    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"comm_hook": "topk"}, "comm_hook='topk'"),
    ({"comm_hook": "powersgd", "powersgd_start_iter": 1}, "powersgd_start_iter=1"),
    ({"comm_hook": "hierarchical_sgd", "hierarchy_levels": {2: 4, 8: 2}}, "group sizes must grow"),
    ({"comm_hook": "hierarchical_sgd", "hierarchy_levels": {2: 3, 8: 4}}, "does not divide"),
    ({"comm_hook": "post_local_sgd", "hierarchy_levels": {2: 2, 8: 4}}, "comm_hook: hierarchical_sgd"),
    ({"comm_hook": "post_local_sgd", "local_group_size": 0}, "local_group_size=0"),
])
def test_bad_options_fail_early(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=r"Fix|must|does not") as info:
        DDPHooksStrategy(**kwargs)
    assert needle in str(info.value)


def test_layout_validated_before_the_process_group() -> None:
    strategy = DDPHooksStrategy(comm_hook="hierarchical_sgd", hierarchy_levels={2: 2, 8: 4})
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.num_nodes = 3  # world 6: the last level (4) is not the world size
    with pytest.raises(ValueError, match="must be the world size 6"):
        strategy._resolve_layout()
    default = DDPHooksStrategy(comm_hook="hierarchical_sgd", local_sgd_period=3)
    default.parallel_devices = [torch.device("cpu")] * 2
    default.num_nodes = 2
    default._resolve_layout()  # nodes x local ranks: one node every 3 steps, the world every 12
    assert dict(default.hierarchy_levels) == {3: 2, 12: 4}
    assert default.local_group_size == 2


def test_in_bucket_order_starts_a_bucket_after_the_previous_one_finished() -> None:
    """The hook for bucket i + 1 is called only once bucket i's future (and its callbacks) completed."""
    events: list[str] = []
    futures: list[torch.futures.Future] = []

    def hook(state: object, bucket: str) -> torch.futures.Future:
        events.append(f"start {bucket}")
        fut: torch.futures.Future = torch.futures.Future()
        futures.append(fut)
        return fut

    ordered = in_bucket_order(hook)
    assert ordered(None, "b0") is futures[0]
    finish = threading.Timer(0.3, lambda: (events.append("end b0"), futures[0].set_result(None)))
    finish.start()
    ordered(None, "b1")  # blocks until b0's future is done
    finish.join()
    assert events == ["start b0", "end b0", "start b1"]
    assert "powerSGD_hook" in in_bucket_order(powerSGD_hook.powerSGD_hook).__qualname__  # DDP logs the name
    futures[1].set_exception(RuntimeError("peer gone"))
    # a failed bucket surfaces in the next one's backward
    with pytest.raises(RuntimeError, match="peer gone"):
        ordered(None, "b2")


# ---------------------------------------------------------------------- 2 ranks
@pytest.mark.multiprocess
def test_comm_hooks_train_and_match_ddp(tmp_path: Path) -> None:
    """Every hook on 2 ranks, each model split into several DDP buckets (0.05 MB each: ~8 for the tiny Llama).

    PowerSGD issues a bucket's later all-reduces from future callbacks: with several buckets on gloo
    they used to reach the process group in a different order on each rank (abort or hang).
    """
    steps = 10
    runs = ["ddp", "allreduce", "bf16_compress", "fp16_compress", "powersgd", "post_local_sgd",
            "hierarchical_sgd_2", "resume:powersgd", "recap:powersgd", "resume:post_local_sgd+async",
            "cli:configs/ddp_hooks_powersgd.yaml", "cli:configs/ddp_hooks_post_local_sgd.yaml",
            "cli:configs/ddp_hooks_compress.yaml", "stall:post_local_sgd_period8", "demo:powersgd"]
    extra = (
        f"{TINY_CLI} --trainer.max_steps 4 --trainer.strategy.init_args.local_sgd_warmup 2 "
        "--trainer.strategy.init_args.powersgd_start_iter 2 --trainer.strategy.init_args.bucket_cap_mb 0.05"
    )
    res = _run(tmp_path, 2, runs, steps, extra, bucket_cap_mb=0.05)
    # several buckets, the same on both ranks (PowerSGD keeps one error-feedback tensor per bucket)
    assert res["powersgd"]["buckets"] >= 4, res["powersgd"]["buckets"]
    assert res["cli:configs/ddp_hooks_powersgd.yaml"]["buckets"] >= 4
    # Lightning's demo Transformer (the reproduction) with DDP's default 25 MB buckets: embedding and
    # decoder (33278 x 200 each) land in different buckets; compression from step 3 on, ranks stay identical
    demo = res["demo:powersgd"]
    assert demo["buckets"] >= 2 and demo["global_step"] == 5
    assert demo["rows"][-1]["hook_iter"] == 5 and all(r["in_sync"] for r in demo["rows"])
    ref = res["ddp"]
    assert ref["global_step"] == steps
    # the default hook is DDP's own all-reduce: identical to Lightning's ddp
    assert _max_diff(res["allreduce"]["params"], ref["params"]) == 0.0
    # 16-bit compressed gradients: close to, but not exactly, full precision; fp16 (10-bit mantissa) closer
    # than bf16
    bf16 = _max_diff(res["bf16_compress"]["params"], ref["params"])
    fp16 = _max_diff(res["fp16_compress"]["params"], ref["params"])
    assert 0.0 < fp16 < bf16 < 0.05, (fp16, bf16)
    assert abs(_tail_loss(res["bf16_compress"]) - _tail_loss(ref)) < 0.01
    start = sum(ref["rows"][0]["loss"]) / 2
    # 10 steps take the loss from ~4.2 to ~2.0-2.5
    for name in ("ddp", "powersgd", "post_local_sgd", "hierarchical_sgd_2"):
        assert _tail_loss(res[name]) < start - 1.0, f"{name} did not train: {res[name]['rows']}"
    assert abs(_tail_loss(res["post_local_sgd"]) - _tail_loss(ref)) < 0.15
    assert _tail_loss(res["powersgd"]) < _tail_loss(ref) + 0.7  # rank-2 compression learns more slowly
    # local steps hide a stall: rank 1 is held after 4 steps until rank 0 has finished 9 -- rank 0 runs on
    # (no collective per step, not even DDP's buffer broadcast) until the next averaging, after step 10 (an
    # order of events: with a collective in steps 5-9 rank 0 could not get there and rank 1 gives up after 120
    # s)
    assert res["stall:post_local_sgd_period8"]["saw_rank0_ahead"] == [None, True]
    # synchronous hooks keep every rank identical; post-local SGD diverges between averagings
    for name in ("allreduce", "bf16_compress", "fp16_compress", "powersgd"):
        assert all(r["in_sync"] for r in res[name]["rows"]), name
    sync = [r["in_sync"] for r in res["post_local_sgd"]["rows"]]
    # warm-up 3 global steps; then PeriodicModelAverager (period 2) averages at averager steps 3, 5, 7, ...
    assert sync == [True, True, True, True, False, True, False, True, False, True]
    # HierarchicalModelAverager {2: 2}, warm-up 3: averages at even averager steps from 4 on
    assert [r["in_sync"] for r in res["hierarchical_sgd_2"]["rows"]] == [True, True, True] + [
        False,
        True,
    ] * 3 + [False]
    assert abs(_tail_loss(res["hierarchical_sgd_2"]) - _tail_loss(ref)) < 0.15
    # PowerSGD state restored per rank (error feedback differs between ranks) from the checkpoint
    ckpt = torch.load(res["continuous:powersgd"]["ckpt"], weights_only=True)
    saved = ckpt["ddp_hooks_state"]["per_rank"]
    restored = res["resume:powersgd"]["start_states"]
    assert len(saved) == 2 and saved[0]["powersgd"]["iter"] == 6
    for rank in range(2):
        assert restored[rank]["iter"] == saved[rank]["powersgd"]["iter"]
        expect = {k: v.double().abs().sum().item() for k, v in saved[rank]["powersgd"]["error_dict"].items()}
        assert expect and restored[rank]["error"] == pytest.approx(expect, rel=1e-12)
    assert saved[0]["powersgd"]["error_dict"][0].ne(saved[1]["powersgd"]["error_dict"][0]).any()
    # ... and the resumed run continues exactly (every rank's loss), although DDP's first step after a
    # re-wrap uses its initial buckets, not the rebuilt ones the saved state belongs to
    assert len(saved[0]["powersgd"]["error_dict"]) >= 4
    keys = ("step", "loss", "in_sync", "hook_iter")
    cont, resumed = res["continuous:powersgd"]["rows"], res["resume:powersgd"]["rows"]
    assert [r["step"] for r in resumed] == list(range(7, steps + 1))
    assert [tuple(r[k] for k in keys) for r in resumed] == [tuple(r[k] for k in keys) for r in cont[6:]]
    # resumed with one bucket instead: the first step still runs the checkpoint's buckets (exact), then
    # PowerSGD restarts the error feedback of the one bucket DDP has now, and the stale buckets' state is gone
    recap = res["recap:powersgd"]
    assert [tuple(r[k] for k in keys) for r in recap["rows"][:2]] == [
        tuple(r[k] for k in keys) for r in cont[6:8]
    ]
    assert (
        recap["buckets"] == 1 and recap["global_step"] == steps and all(r["in_sync"] for r in recap["rows"])
    )
    assert _tail_loss(recap) < start - 1.0
    # async_checkpoint='thread' (rank 0's background writer) under local SGD: the checkpoint fit waited for is
    # complete and verified, and resuming from it continues exactly (every rank's loss, the schedule)
    cont, resumed = res["continuous:post_local_sgd+async"]["rows"], res["resume:post_local_sgd+async"]["rows"]
    assert verify_checkpoint(res["continuous:post_local_sgd+async"]["ckpt"]).ok
    assert [r["step"] for r in resumed] == list(range(7, steps + 1))
    assert [tuple(r[k] for k in keys) for r in resumed] == [tuple(r[k] for k in keys) for r in cont[6:]]
    # YAML configs through LightningCLI
    for name in ("cli:configs/ddp_hooks_powersgd.yaml", "cli:configs/ddp_hooks_post_local_sgd.yaml",
                 "cli:configs/ddp_hooks_compress.yaml"):
        assert res[name]["global_step"] == 4
    assert res["cli:configs/ddp_hooks_powersgd.yaml"]["rows"][-1]["hook_iter"] == 4
    # warm-up 2, period 4: averaged at averager step 2 (the 3rd step), not at the 4th
    assert [r["in_sync"] for r in res["cli:configs/ddp_hooks_post_local_sgd.yaml"]["rows"]] == [True, True,
                                                                                                True, False]


# ---------------------------------------------------------------------- 4 ranks
@pytest.mark.multiprocess
def test_hierarchical_sgd_resume_continues_the_schedule(tmp_path: Path) -> None:
    extra = f"{TINY_CLI} --trainer.max_steps 6 --trainer.strategy.init_args.local_sgd_warmup 2"
    res = _run(tmp_path, 4, ["resume:hierarchical_sgd", "cli:configs/ddp_hooks_hierarchical_sgd.yaml"], 12,
               extra, timeout=500)
    cont, resumed = res["continuous:hierarchical_sgd"]["rows"], res["resume:hierarchical_sgd"]["rows"]
    # every rank's loss too: after local steps each rank has its own AdamW moments, which the
    # checkpoint must hold per rank (Lightning's own DDP keeps rank 0's only)
    keys = ("step", "loss", "in_sync", "pairs_in_sync", "averager_step", "hook_iter")
    # levels {2: 2, 4: 4}, warm-up 3: pairs average when the averager step is even, all 4 ranks when divisible
    # by 4
    expected_sync = [True] * 3 + [False, True, False, False, False, True, False, False, False]
    expected_pairs = [True] * 3 + [False, True, False, True, False, True, False, True, False]
    assert [r["in_sync"] for r in cont] == expected_sync
    assert [r["pairs_in_sync"] for r in cont] == expected_pairs
    # the resumed run (from the step-6 checkpoint) continues exactly where the continuous run was
    assert [r["step"] for r in resumed] == list(range(7, 13))
    assert [tuple(r[k] for k in keys) for r in resumed] == [tuple(r[k] for k in keys) for r in cont[6:]]
    # parameters are averaged before validation (steps 5, 10) and while a checkpoint is written (6, 12)
    assert res["continuous:hierarchical_sgd"]["val_in_sync"] == [(5, True), (10, True)]
    assert res["continuous:hierarchical_sgd"]["save_in_sync"] == [(6, True), (12, True)]
    # they were not before
    assert not cont[9]["in_sync"] and not cont[5]["in_sync"] and not cont[11]["in_sync"]
    assert len({tuple(r["loss"]) for r in cont[6:]}) == 6 and len(set(cont[7]["loss"])) == 4  # ranks differ
    start = res["resume:hierarchical_sgd"]["start_states"]
    assert all(s == {"averager_step": 6, "hook_iter": 3} for s in start), start
    # configs/ddp_hooks_hierarchical_sgd.yaml ({2: 2, 8: 4}) through LightningCLI: warm-up 2, then pairs only
    cli = res["cli:configs/ddp_hooks_hierarchical_sgd.yaml"]["rows"]
    assert [r["in_sync"] for r in cli] == [True, True, False, False, False, False]
    assert [r["pairs_in_sync"] for r in cli] == [True, True, True, False, True, False]


# ---------------------------------------------------------------------- 2 ranks, gradient accumulation
@pytest.mark.multiprocess
def test_hooks_and_averagers_count_optimizer_steps_under_accumulation(tmp_path: Path) -> None:
    """``accumulate_grad_batches=4``: PowerSGD's ``iter`` (so ``powersgd_start_iter``), post-local SGD's
    ``iter`` (``local_sgd_warmup``) and the averagers' ``step`` (``local_sgd_period``, hierarchy periods)
    count optimizer steps, not micro-batches.

    Lightning runs the non-final micro-batches under DDP's ``no_sync``: DDP calls no comm hook there
    (gradients accumulate locally), so a hook's counter moves once per optimizer step; the averagers step
    with the optimizer. Measured: every counter after optimizer step ``s`` is ``s`` (post-local SGD's hook
    stops at the warm-up), unchanged within a step's micro-batches, and the averaging pattern is
    accumulation 1's (the test above). Without ``no_sync`` (a hook per micro-batch) this test fails.
    """
    steps, acc = 10, 4
    names = ("ddp", "allreduce", "powersgd", "post_local_sgd", "hierarchical_sgd_2")
    runs = [f"acc{acc}:{name}" for name in names]
    res = _run(tmp_path, 2, runs, steps, bucket_cap_mb=0.05)
    for run in runs:
        assert res[run]["global_step"] == steps and len(res[run]["rows"]) == steps * acc, run
    warmup = 3  # the worker's local_sgd_warmup and powersgd_start_iter
    for name, hook_iter in (("powersgd", lambda s: s), ("post_local_sgd", lambda s: min(s, warmup)),
                            ("hierarchical_sgd_2", lambda s: min(s, warmup))):
        rows = res[f"acc{acc}:{name}"]["rows"]
        assert [r["step"] for r in rows] == [(i + 1) // acc for i in range(steps * acc)], name
        # every micro-batch's row: the counters of the optimizer steps taken so far, not of the micro-batches
        assert [r["hook_iter"] for r in rows] == [hook_iter(r["step"]) for r in rows], name
        if name != "powersgd":
            assert [r["averager_step"] for r in rows] == [r["step"] for r in rows], name
        assert all(r["in_sync"] for r in rows[: warmup * acc]), name  # synchronous warm-up (3 steps)
    # after each optimizer step: accumulation 1's averaging schedule (test_comm_hooks_train_and_match_ddp)
    last = {name: [r["in_sync"] for r in res[f"acc{acc}:{name}"]["rows"][acc - 1 :: acc]]
            for name in ("powersgd", "post_local_sgd", "hierarchical_sgd_2")}
    assert all(last["powersgd"])
    assert last["post_local_sgd"] == [True, True, True, True, False, True, False, True, False, True]
    assert last["hierarchical_sgd_2"] == [True, True, True] + [False, True] * 3 + [False]
    # DDP's own all-reduce hook: the accumulated gradients all-reduced once per step, as Lightning's ddp
    assert _max_diff(res[f"acc{acc}:allreduce"]["params"], res[f"acc{acc}:ddp"]["params"]) == 0.0
