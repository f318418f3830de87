"""The benchmark runner in quick mode, so it cannot rot: real worker jobs, real result files.

Never asserts on timings (the machine is shared and noisy); it checks the result files' structure,
that every sample is a real positive number, that medians and ratios are computed from those
samples, and that the interleaving really is A B A B.
"""

from __future__ import annotations

import copy
import importlib.metadata as md
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, WORKERS, run_python

BENCH = ROOT / "benchmarks"

import common  # noqa: E402
import gpu as gpu_harness  # noqa: E402
import run as bench_run  # noqa: E402


def _positive_floats(values: list) -> bool:
    return bool(values) and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values)


def _one(pattern: str, folder: Path) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {folder}, found {found}"
    return found[0]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_round_orders_balance_positions_and_the_job_before(n: int) -> None:
    """Issue 43: a rotation (A B C, B C A, ...) kept every contender right after the same other one; over a
    cycle of rounds every contender runs in every position equally often and right after every other
    contender equally often (once each for an even n over n rounds, twice for an odd n over 2n)."""
    from collections import Counter

    names = [f"c{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    orders = common.round_orders(names, cycle + 1)
    assert all(sorted(order) == names for order in orders) and orders[cycle] == orders[0]
    assert orders[0][0] == names[0]  # the first round starts with the first contender (the warm-up job's)
    positions = Counter((name, i) for order in orders[:cycle] for i, name in enumerate(order))
    before = Counter(pair for order in orders[:cycle] for pair in itertools.pairwise(order))
    assert set(positions.values()) == {cycle // n} and len(positions) == n * n
    assert set(before.values()) == {cycle // n} and len(before) == n * (n - 1)


def test_interleave_order_and_ratios() -> None:
    calls: list[tuple[str, int]] = []

    def run_one(name: str, rep: int) -> float:
        calls.append((name, rep))
        if name == "C":
            raise RuntimeError("boom")
        return {"A": 2.0, "B": 1.0}[name] * (rep + 1)

    out = common.interleave(["A", "B", "C"], 2, run_one, retries=1)
    # C fails in every attempt: each round is run twice (1 retry) as a whole, then left incomplete; the order
    # changes per round (A B C, then B C A: common.round_orders)
    assert calls == [("A", 0), ("B", 0), ("C", 0)] * 2 + [("B", 1), ("C", 1), ("A", 1)] * 2
    assert out.orders == [["A", "B", "C"], ["B", "C", "A"]]
    assert out["A"] == [2.0, 4.0] and out["B"] == [1.0, 2.0]
    assert all(isinstance(e, RuntimeError) for e in out["C"])  # a failing contender does not stop the others
    assert [(f["contender"], f["round"], f["attempt"], f["outcome"]) for f in out.failures] == [
        ("C", 0, 0, "round re-run"), ("C", 0, 1, "round incomplete"),
        ("C", 1, 0, "round re-run"), ("C", 1, 1, "round incomplete")]
    assert out.failures[0]["stderr_tail"] == ["RuntimeError: boom"]
    # ratios only over rounds both sides completed: the ratio of medians too (round 3 has no numerator)
    ratio = common.paired_ratio([2.0, 4.0, None], [1.0, 2.0, 30.0])
    assert ratio["per_round"] == [2.0, 2.0] and ratio["value"] == 2.0
    assert ratio["ratio_of_medians"] == pytest.approx(3.0 / 1.5)
    assert (ratio["rounds_paired"], ratio["rounds_unpaired"]) == (2, 1)
    none = common.paired_ratio([None, None], [1.0, 2.0])
    assert none["value"] is None and none["ratio_of_medians"] is None and none["rounds_paired"] == 0


def test_ratio_intervals_and_the_aa_pair_that_withholds_verdicts() -> None:
    import timing_stats

    # the 95 % t interval of the geometric mean of per-round ratios, reciprocal for b/a
    ratio = common.paired_ratio([1.10, 1.00, 1.20, 1.05], [1.0, 1.0, 1.0, 1.0])
    logs = [math.log(x) for x in (1.10, 1.00, 1.20, 1.05)]
    half = 3.182 * statistics.stdev(logs) / 2  # t(0.975, df=3), sqrt(4)
    assert ratio["geo_mean"] == pytest.approx(math.exp(statistics.fmean(logs)))
    assert ratio["ci95"] == pytest.approx([math.exp(statistics.fmean(logs) - half),
                                           math.exp(statistics.fmean(logs) + half)])
    back = common.paired_ratio([1.0] * 4, [1.10, 1.00, 1.20, 1.05])
    assert back["ci95"] == pytest.approx([1 / ratio["ci95"][1], 1 / ratio["ci95"][0]])
    assert common.paired_ratio([1.0], [2.0])["ci95"] is None  # one round: no spread to estimate
    assert timing_stats.t975(3) == 3.182 and timing_stats.t975(11) == 2.228 and timing_stats.t975(500) == 1.96

    # an A/A pair whose interval holds 1.00 leaves the case's verdicts alone ...
    quiet = {"a/b": timing_stats.judge(common.paired_ratio([1.01, 0.99, 1.0], [1.0] * 3), 1.03, False),
             "a/a_aa": timing_stats.judge(common.paired_ratio([1.0, 1.02, 0.99], [1.0] * 3), None, True)}
    assert quiet["a/a_aa"]["met"] is True and timing_stats.withhold_if_aa_failed(quiet) is None
    assert quiet["a/b"]["met"] is True and "verdict" not in quiet["a/b"]
    # a ratio whose interval spans its target gets no verdict: the rounds cannot tell
    spans = timing_stats.judge(common.paired_ratio([1.0, 1.06, 0.98], [1.0] * 3), 1.03, False)
    assert spans["met"] is None and spans["verdict"].startswith("undecided: the interval")
    clear = timing_stats.judge(common.paired_ratio([1.20, 1.22, 1.19], [1.0] * 3), 1.03, False)
    assert clear["met"] is False and "verdict" not in clear
    # ... one that excludes 1.00 (identical jobs 1.17x apart, as the fsdp suite once gave) withholds them
    noisy = {"a/b": timing_stats.judge(common.paired_ratio([1.01, 0.99, 1.0], [1.0] * 3), 1.03, False),
             "a/a_aa": timing_stats.judge(common.paired_ratio([1.18, 1.10, 1.16], [1.0] * 3), None, True)}
    reason = timing_stats.withhold_if_aa_failed(noisy)
    assert noisy["a/a_aa"]["met"] is False and reason and "too noisy" in reason
    assert noisy["a/b"]["met"] is None and noisy["a/b"]["verdict"] == reason
    # and the console table says so
    table = common.format_summary({"suite": "x", "summary": [
        {"ratio": n, "value": r["value"], "ci95": r["ci95"], "target": r["target"], "met": r["met"],
         "aa": r["aa"], **({"verdict": r["verdict"]} if "verdict" in r else {})} for n, r in noisy.items()]})
    assert "A/A FAILED" in table and "(no verdict: A/A failed)" in table
    assert common.contender("fsdp2_aa").worker_name == "fsdp2"  # the twin runs the same job


def test_a_failed_round_is_rerun_so_contenders_stay_paired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real runner (run_worker, summarise, ratios, JSON, table) with fake contender jobs; no training.

    ``flaky`` aborts at exit in its first job of round 2 (after writing a result, as gloo jobs did):
    the whole round runs again, both contenders keep exactly 2 rounds, the ratio stands on both,
    and the failure is listed with its stderr tail. ``broken`` never succeeds: its rounds stay
    incomplete after 2 retries and its ratio has no paired round.
    """
    fake = WORKERS / "bench_fake.py"
    log = tmp_path / "jobs.log"
    monkeypatch.setenv("BENCH_FAKE_LOG", str(log))
    # the seam where a contender's job is started: the same process handling, a plain python command
    monkeypatch.setattr(common, "worker_command",
                        lambda script, nproc, args, out: [sys.executable, str(script), *args, "--out",
                                                          str(out)])
    contenders = [common.Contender(n, str(fake), "torch", f"fake {n}") for n in ("steady", "flaky", "broken")]
    specs = [common.RatioSpec("flaky", "steady", 2.5), common.RatioSpec("broken", "steady", 1.0)]
    result = common.run_timing_suite("fake", contenders[:2], specs[:1], sizes=["tiny"], ranks=[1], reps=2,
                                     steps=2, warmup=1, precision="32-true", out_dir=tmp_path, quick=True,
                                     show_progress=False)
    # round 2 runs in the rotated order (flaky first): its failed attempt is run again, in the same order
    assert log.read_text().split("\n")[:-1] == ["steady 0", "flaky 0", "flaky 1", "steady 1", "flaky 1",
                                                "steady 1"]
    saved = json.loads(Path(result["json_path"]).read_text())
    [case] = saved["cases"]
    for name in ("steady", "flaky"):
        assert (
            len(case["contenders"][name]["rep_medians_s"]) == 2 and case["contenders"][name]["errors"] == []
        )
    ratio = case["ratios"]["flaky/steady"]
    assert (
        ratio["per_round"] == pytest.approx([2.0, 2.0])
        and ratio["rounds_paired"] == 2
        and ratio["met"] is True
    )
    [failure] = case["failures"]
    assert (failure["contender"], failure["round"], failure["attempt"], failure["returncode"],
            failure["outcome"]) == (
        "flaky", 1, 0, 134, "round re-run")
    assert failure["stderr_tail"][-1] == "terminate called without an active exception"
    table = common.format_summary(saved)
    assert (
        "[2/2 rounds]" in table
        and "FAILED, round re-run: size=tiny ranks=1 flaky round 2 try 1: exit 134" in table
    )
    assert "| terminate called without an active exception" in table

    log.unlink()
    result = common.run_timing_suite("fake", [contenders[0], contenders[2]], specs[1:], sizes=["tiny"],
                                     ranks=[1],
                                     reps=1, steps=2, warmup=1, precision="32-true", out_dir=tmp_path / "b",
                                     quick=True, show_progress=False)
    assert log.read_text().split("\n")[:-1] == ["steady 0", "broken 0"] * 3  # 1 + ROUND_RETRIES attempts
    [case] = result["cases"]
    assert [f["outcome"] for f in case["failures"]] == ["round re-run", "round re-run", "round incomplete"]
    assert (
        case["ratios"]["broken/steady"]["value"] is None
        and case["ratios"]["broken/steady"]["rounds_paired"] == 0
    )
    assert case["contenders"]["steady"]["rep_medians_s"] == [pytest.approx(0.01)]
    table = common.format_summary(result)
    assert "ERROR size=tiny ranks=1 broken round 1 try 3: exit 1" in table
    assert "| RuntimeError: the broken contender always fails" in table and "[0/1 rounds]" in table


def test_runner_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert {"ddp", "fsdp", "hsdp", "memory"} <= set(bench_run.discover())
    with pytest.raises(SystemExit):
        bench_run.main(["no_such_suite"])
    assert "no_such_suite" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--sizes"):
        bench_run.main(["fsdp", "--sizes", "enormous"])
    with pytest.raises(ValueError, match="--contenders"):
        common.select("fsdp", ("fsdp2", "torch_fsdp2"), ["torch_ddp"])


def test_accumulation_suite_reads_whole_optimizer_steps_and_the_bytes_between_micro_batches() -> None:
    """K = 2, one warm-up step: a step's time is its 2 micro-batches summed per rank, then the slowest rank;
    "between micro-batches" is the largest total after a non-final micro-batch's backward (FSDP2's state)."""
    from suites import accumulation

    def held(unsharded: int, sharded: int) -> dict[str, int]:
        return {"sharded": sharded, "unsharded": unsharded, "pending_all_reduce": 0}

    run = {"params": 100, "loss_last": 1.0, "strategy_class": "x",
           "per_rank": [{"times_s": [9.0, 9.0, 1.0, 2.0, 1.0, 1.0]},
                        {"times_s": [9.0, 9.0, 2.0, 2.0, 1.0, 3.0]}],
           "fsdp_grad_bytes_after_backward": [held(400, 0), held(0, 200), held(400, 0), held(0, 200),
                                              held(300, 0), held(0, 200)]}
    assert accumulation._step_times(run, 2, 1) == [4.0, 4.0]
    rec = accumulation._record([run, RuntimeError("lost")], 2, 1)
    assert (rec["full_grad_bytes"], rec["between_grad_bytes"], rec["between_fraction"]) == (400, 400, 1.0)
    assert rec["peak_grad_kinds"] == held(400, 0) and rec["step_median_s"] == 4.0
    assert rec["errors"] == ["lost"]
    # K = 1: no micro-batch between, the value after each step's backward
    one = accumulation._record([{**run, "fsdp_grad_bytes_after_backward": [held(0, 200)] * 6}], 1, 1)
    assert one["between_fraction"] == 0.5 and accumulation._step_times(run, 1, 1) == [9.0, 2.0, 2.0, 1.0, 3.0]


@pytest.mark.multiprocess
def test_runner_quick_mode_writes_real_results(tmp_path: Path) -> None:
    # fsdp (both worker scripts: Lightning fit and the plain torch loop, 1 rank, 2 interleaved
    # rounds of 2 steps) and memory (fsdp2 vs Lightning ddp on 2 ranks) in one invocation.
    proc = run_python(
        ["benchmarks/run.py", "fsdp", "memory", "--quick", "--contenders", "fsdp2", "torch_fsdp2",
         "lightning_ddp", "--out-dir", str(tmp_path)],
        timeout=900,
    )
    assert "fsdp2/torch_fsdp2" in proc.stdout and "fsdp2/lightning_ddp" in proc.stdout

    fsdp = json.loads(_one("fsdp-*.json", tmp_path).read_text())
    assert fsdp["suite"] == "fsdp" and fsdp["device"] and fsdp["device_name"]
    # how busy the host was
    assert fsdp["host_cpu_count"] == os.cpu_count() and fsdp["host_load_at_start"] >= 0
    for dist in ("torch", "lightning", "torchft"):
        assert fsdp["versions"][dist] == md.version(dist)
    cfg = fsdp["config"]
    assert (cfg["reps"], cfg["steps"], cfg["warmup"], cfg["ranks"]) == (2, 2, 1, [1])
    assert set(cfg["contenders"]) == {"fsdp2", "torch_fsdp2"}
    [case] = fsdp["cases"]
    assert case["ranks"] == 1 and case["size"] == "tiny" and case["params"] > 0
    for name in ("fsdp2", "torch_fsdp2"):
        rec = case["contenders"][name]
        assert rec["errors"] == []
        assert len(rec["samples_s"]) == 2 and all(
            len(s) == 2 and _positive_floats(s) for s in rec["samples_s"]
        )
        assert all(len(w) == 1 and _positive_floats(w) for w in rec["warmup_samples_s"])
        assert rec["rep_medians_s"] == [statistics.median(s) for s in rec["samples_s"]]
        assert rec["median_s"] == statistics.median([x for s in rec["samples_s"] for x in s])
        assert all(math.isfinite(v) for v in rec["loss_last"])
        assert len(rec["per_rank_times_s"]) == 2 and all(len(r) == 1 for r in rec["per_rank_times_s"])
        assert len(rec["memory_per_rank"]) == 1 and rec["memory_per_rank"][0]["param_bytes"] > 0
    ratio = case["ratios"]["fsdp2/torch_fsdp2"]
    a, b = case["contenders"]["fsdp2"]["rep_medians_s"], case["contenders"]["torch_fsdp2"]["rep_medians_s"]
    assert ratio["per_round"] == pytest.approx([x / y for x, y in zip(a, b)])
    assert ratio["value"] == pytest.approx(statistics.median(ratio["per_round"]))
    assert ratio["ci95"][0] < ratio["geo_mean"] < ratio["ci95"][1]  # two rounds: an interval
    lo, hi = ratio["ci95"]  # met / missed when the interval is on one side of the target, else no verdict
    assert ratio["target"] == 1.03 and ratio["met"] == {(True, True): True, (False, False): False}.get(
        (hi <= 1.03, lo <= 1.03))
    assert case["orders"] == [["fsdp2", "torch_fsdp2"], ["torch_fsdp2", "fsdp2"]]  # no contender always first
    assert {r["ratio"] for r in fsdp["summary"]} == {"fsdp2/torch_fsdp2"}
    png = _one("fsdp-*.png", tmp_path).read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000

    memory = json.loads(_one("memory-*.json", tmp_path).read_text())
    [case] = memory["cases"]
    assert case["ranks"] == 2 and set(case["worst_rank_bytes"]) == {"lightning_ddp", "fsdp2"}
    for name in ("lightning_ddp", "fsdp2"):  # every rank reports, from its own process
        assert len(case["contenders"][name]["memory_per_rank"]) == 2
    for rec in case["worst_rank_bytes"].values():
        assert rec["param_bytes"] > 0 and rec["grad_bytes"] > 0 and rec["optimizer_state_bytes"] > 0
        assert rec["total_bytes"] == rec["param_bytes"] + rec["grad_bytes"] + rec["optimizer_state_bytes"]
    ratio = case["ratios"]["fsdp2/lightning_ddp"]
    assert ratio["ideal"] == 0.5 and ratio["target"] == pytest.approx(0.525)
    # sharding is measured, not assumed: each of 2 ranks holds about half of what a DDP rank holds
    assert 0.45 < ratio["value"] <= ratio["target"] and ratio["met"] is True
    assert _one("memory-*.png", tmp_path).read_bytes().startswith(b"\x89PNG")


@pytest.mark.multiprocess
def test_checkpoint_suite_quick_mode_measures_real_saves(tmp_path: Path) -> None:
    # the async-checkpoint benchmark (issue 14): 2 ranks, a sync and a thread job of 4 steps, a save every 2;
    # and the thread job to object storage (issue 42: a SeaweedFS server the suite starts itself)
    proc = run_python(["benchmarks/suites/checkpoint.py", "--quick", "--contenders", "sync", "thread",
                       "s3-thread", "--out-dir", str(tmp_path)], timeout=600)
    assert "stall sync/thread" in proc.stdout
    result = json.loads(_one("checkpoint-*.json", tmp_path).read_text())
    assert result["config"]["contenders"] == ["sync", "thread", "s3-thread"]
    assert result["config"]["ranks"] == 2
    assert result["config"]["s3"] == "a SeaweedFS server on this machine (127.0.0.1)"
    s3 = next(r for r in result["summary"]
              if r["ratio"] == "stall s3-thread / thread (object storage over local disk)")
    local, remote = (result["contenders"][c]["runs"][0]["median_stall_s"] for c in ("thread", "s3-thread"))
    assert s3["value"] == pytest.approx(remote / local)
    for name in ("sync", "thread", "s3-thread"):
        rec = result["contenders"][name]
        assert rec["errors"] == []
        [run] = rec["runs"]
        # weights + AdamW moments
        assert run["checkpoints"] == 2 and run["checkpoint_bytes"] > 12 * run["params"]
        assert (
            len(run["stalls_s"]) == 2
            and _positive_floats(run["stalls_s"])
            and _positive_floats([run["cpu_s"]])
        )
        assert run["median_stall_s"] == pytest.approx(statistics.median(run["stalls_s"]))
    ratio = next(r for r in result["summary"] if r["ratio"] == "stall sync/thread (x shorter)")
    sync, thread = (result["contenders"][c]["runs"][0]["median_stall_s"] for c in ("sync", "thread"))
    assert ratio["value"] == pytest.approx(sync / thread) and ratio["met"] == (ratio["value"] >= 5.0)
    assert _one("checkpoint-*.png", tmp_path).read_bytes().startswith(b"\x89PNG")


@pytest.mark.multiprocess
def test_pretrained_load_suite_quick_mode_measures_real_loads(tmp_path: Path) -> None:
    # issue 25: peak host memory per rank while a pretrained HF model gets onto 2 ranks, ours vs
    # from_pretrained in __init__ under Lightning's ddp; each job also checked that its ranks hold the
    # pretrained weights
    proc = run_python(["benchmarks/suites/pretrained_load.py", "--quick", "--contenders",
                       "fsdp2_configure_model",
                       "init_from_pretrained", "--out-dir", str(tmp_path)], timeout=600)
    assert "fsdp2_configure_model: peak anonymous / (model/N)" in proc.stdout
    result = json.loads(_one("pretrained_load-*.json", tmp_path).read_text())
    assert result["config"]["ranks"] == [2] and set(result["config"]["contenders"]) == {
        "fsdp2_configure_model", "init_from_pretrained"}
    models = result["models"]
    assert set(models) == {"overhead", "quick-6m"}
    cases = {(c["size"], c["ranks"]): c for c in result["cases"]}
    assert set(cases) == {("overhead", 2), ("quick-6m", 2)}
    for (size, _), case in cases.items():
        assert case["failures"] == []
        for rec in case["contenders"].values():
            assert rec["errors"] == [] and rec["weights_ok"] is True and len(rec["per_rank"]) == 2
            assert rec["ref_loss_per_rank"] == pytest.approx([models[size]["ref_loss"]] * 2, abs=1e-5)
            assert all(math.isfinite(x) for x in rec["train_loss_per_rank"])  # and one step trained
            for key in ("peak_growth_bytes", "peak_anon_growth_bytes"):
                assert rec["worst_rank"][key] == max(r["memory"][key] for r in rec["per_rank"]) > 0
    model, case = models["quick-6m"], cases[("quick-6m", 2)]
    assert (
        model["model_bytes"] == 4 * model["params"]
        and 0 < model["largest_tensor_bytes"] < model["model_bytes"]
    )
    # the budget: model/2 + largest tensor + the route's own overhead
    for name, rec in case["contenders"].items():
        fixed = cases[("overhead", 2)]["contenders"][name]["worst_rank"]["peak_anon_growth_bytes"]
        anon = rec["targets"]["anon"]
        assert anon["budget_bytes"] == pytest.approx(
            model["model_bytes"] / 2 + model["largest_tensor_bytes"] + fixed
        )
        assert anon["met"] == (rec["worst_rank"]["peak_anon_growth_bytes"] <= anon["budget_bytes"])
    ours, base = (case["contenders"][n]["worst_rank"]["peak_anon_growth_bytes"]
                  for n in ("fsdp2_configure_model", "init_from_pretrained"))
    # measured, not assumed: no rank of ours allocates the full model; the __init__ route allocates more than
    # it
    assert ours < model["model_bytes"] < base
    assert _one("pretrained_load-*.png", tmp_path).read_bytes().startswith(b"\x89PNG")


@pytest.mark.subprocess
def test_sac_suite_quick_mode_measures_modes_budget_and_offload(tmp_path: Path) -> None:
    # issue 28: every checkpointing mode, budget at 0.25/0.5/0.75 and at the fixed modes' kept bytes, offload,
    # on the example and an HF Llama (tiny); one process. Bytes and FLOPs are exact, so they are checked;
    # times are not.
    from suites import sac

    proc = run_python(["benchmarks/suites/sac.py", "--quick", "--out-dir", str(tmp_path)], timeout=300)
    assert "| `budget@selective_layer` |" in proc.stdout
    result = json.loads(_one("sac-*.json", tmp_path).read_text())
    cfg = result["config"]
    assert list(cfg["contenders"]) == list(sac.CONTENDERS) and (cfg["reps"], cfg["steps"], cfg["warmup"]) == (
        1,
        2,
        1,
    )
    assert [(c["size"], c["family"]) for c in result["cases"]] == [
        ("tiny", "example"),
        ("hf-llama-tiny", "hf_llama"),
    ]
    for case in result["cases"]:
        recs = case["contenders"]
        assert case["skipped"] == case["failed"] == {} and list(recs) == list(sac.CONTENDERS), case
        none = recs["none"]
        for name, rec in recs.items():
            assert len(rec["step_s"]) == 2 and _positive_floats(rec["step_s"]), name
            assert rec["median_step_s"] == statistics.median(rec["step_s"])
            assert rec["kept_vs_none"] == rec["kept_bytes"] / none["kept_bytes"]
            assert rec["time_vs_none"] == statistics.median(
                t / b for t, b in zip(rec["step_s"], none["step_s"])
            )
            assert rec["model_flops"] == none["model_flops"] > 0  # recomputation never counts as model FLOPs
            assert 0 <= rec["recompute_flops"] <= recs["full"]["recompute_flops"], name
            grads = rec["gradients"]  # the suite stops if any contender's gradients differ from none's
            assert grads == {"reference": True} if name == "none" else (grads["equal_to_none"] is True
                                                                         and grads["params"] > 0), name
            per = rec["memory_saved_pct_per_pct_time_lost"]
            assert per is None or per == pytest.approx(rec["memory_saved_pct"] / rec["time_overhead_pct"])
        assert none["recompute_flops"] == 0 and recs["full"]["recompute_flops"] > 0
        assert (
            recs["full"]["kept_bytes"]
            < recs["selective_op_2nd_mm"]["kept_bytes"]
            < recs["selective_op"]["kept_bytes"]
        )
        assert recs["selective_layer"]["kept_bytes"] < none["kept_bytes"]
        budgets = [recs[f"budget_{b}"] for b in ("0.25", "0.5", "0.75")]
        assert (
            budgets[0]["kept_bytes"]
            < budgets[1]["kept_bytes"]
            < budgets[2]["kept_bytes"]
            < none["kept_bytes"]
        )
        for name, rec in recs.items():
            b = rec.get("budget")
            assert (b is not None) == name.startswith("budget"), name
            if b:  # measured on a step after planning; the target is a fraction of none's measured kept bytes
                assert b["target_bytes"] == b["memory_budget"] * none["kept_bytes"]
                assert (
                    b["measured_over_target"] == rec["kept_bytes"] / b["target_bytes"] <= 1.05 and b["met"]
                ), name
                assert b["measured_bytes"] > 0 and b["predicted_bytes"] <= b["target_bytes"] * 1.05
        # budget at the fixed mode's measured fraction: equal bytes, FLOPs side by side
        for fixed in sac.MATCHED:
            target = recs[f"budget@{fixed}"]["budget"]["memory_budget"]
            assert recs[fixed]["kept_vs_none"] <= target <= recs[fixed]["kept_vs_none"] + 1e-6
        assert [c["fixed"] for c in case["equal_bytes"]] == list(sac.MATCHED)
        for cmp in case["equal_bytes"]:
            assert cmp["recompute_flops"] == [
                recs[cmp["fixed"]]["recompute_flops"],
                recs[cmp["budget"]]["recompute_flops"],
            ]
        # offload: on the CPU the host copies are in the same memory, so kept bytes grow; what stays off them
        # is less
        # 2 blocks; selective_layer checkpoints 1
        for name, blocks in (("offload", 2), ("selective_layer+offload", 1)):
            rec = recs[name]
            assert rec["offloaded_blocks"] == blocks and rec["offloaded_bytes"] > 0
            assert (
                rec["kept_on_device_bytes"]
                == rec["kept_bytes"] - rec["offloaded_bytes"]
                < none["kept_bytes"] / 2
            )
        assert recs["selective_layer+offload"]["offloaded_bytes"] < recs["offload"]["offloaded_bytes"]
    rows = [r for r in result["summary"] if r.get("target") == 1.05]
    assert len(rows) == 10 and all(r["met"] for r in rows)
    assert _one("sac-*.png", tmp_path).read_bytes().startswith(b"\x89PNG")


@pytest.mark.multiprocess
def test_tensor_parallel_suite_quick_mode_measures_real_tp_runs(tmp_path: Path) -> None:
    # issue 26: ours with tensor_parallel_degree=2 (the plan of configs/fsdp2_tp.yaml) vs Lightning's
    # ModelParallelStrategy with the same plan written by hand, 1 x 2 on 2 ranks, one round of 2 steps
    proc = run_python(["benchmarks/run.py", "tensor_parallel", "--quick", "--contenders", "fsdp2_tp2",
                       "lightning_mp_tp2", "--out-dir", str(tmp_path)], timeout=600)
    assert (
        "step time fsdp2_tp2/lightning_mp_tp2" in proc.stdout
        and "bytes per rank fsdp2_tp2/lightning_mp_tp2" in proc.stdout
    )
    result = json.loads(_one("tensor_parallel-*.json", tmp_path).read_text())
    assert result["config"]["ranks"] == [2] and set(result["config"]["contenders"]) == {
        "fsdp2_tp2",
        "lightning_mp_tp2",
    }
    assert "correctness of cost" in result["note"]
    [case] = result["cases"]
    assert case["failures"] == [] and case["size"] == "tiny"
    # what one TP rank should hold: the planned Linear/Embedding weights halved, the 1-D norm weights whole
    import torch

    from llama import LlamaLM

    lm = LlamaLM(max_seq_len=common.SIZES["tiny"]["seq_len"], **common.SIZES["tiny"]["model"])
    with torch.device("meta"):
        lm.configure_model()
    whole = sum(p.numel() for p in lm.parameters() if p.dim() < 2)
    assert case["params"] == sum(p.numel() for p in lm.parameters())
    for name in ("fsdp2_tp2", "lightning_mp_tp2"):
        rec = case["contenders"][name]
        assert rec["errors"] == [] and len(rec["samples_s"]) == 1 and _positive_floats(rec["samples_s"][0])
        assert rec["median_s"] == statistics.median(rec["samples_s"][0])
        assert all(math.isfinite(v) for v in rec["loss_last"])
        assert len(rec["memory_per_rank"]) == 2  # every rank reports, from its own process
        for mem in rec["memory_per_rank"]:  # measured, not assumed: the tensor-parallel split is real
            assert mem["param_bytes"] == 4 * (whole + (case["params"] - whole) // 2)
            assert (
                mem["grad_bytes"] == mem["param_bytes"]
                and mem["optimizer_state_bytes"] >= 2 * mem["param_bytes"]
            )
    assert (
        case["worst_rank_bytes"]["fsdp2_tp2"]["total_bytes"]
        == case["worst_rank_bytes"]["lightning_mp_tp2"]["total_bytes"]
    )  # the same plan, the same shards
    memory = case["memory_ratios"]["fsdp2_tp2/lightning_mp_tp2"]
    assert memory["value"] == 1.0 and memory["target"] == 1.05 and memory["met"] is True
    ratio = case["ratios"]["fsdp2_tp2/lightning_mp_tp2"]
    a, b = (case["contenders"][n]["rep_medians_s"][0] for n in ("fsdp2_tp2", "lightning_mp_tp2"))
    assert ratio["per_round"] == pytest.approx([a / b]) and ratio["met"] == (ratio["value"] <= 1.0)
    assert _one("tensor_parallel-*.png", tmp_path).read_bytes().startswith(b"\x89PNG")


@pytest.mark.subprocess
def test_pretrained_load_worker_fails_a_load_that_is_not_the_pretrained_weights(tmp_path: Path) -> None:
    # the guard that keeps a broken load from looking cheap: a reference loss the weights do not give fails
    # the job
    from suites import pretrained_load

    facts = pretrained_load.save_model("overhead", tmp_path / "model")
    ref = tmp_path / "model-ref.json"
    spec = json.loads(ref.read_text())
    assert spec["loss"] == facts["ref_loss"]
    spec["loss"] += 0.01
    ref.write_text(json.dumps(spec))
    proc = run_python([str(BENCH / "workers" / "pretrained_load.py"), "--contender", "transformers_single",
                       "--folder",
                       str(tmp_path / "model"), "--ref", str(ref), "--out", str(tmp_path / "out.json")],
                       check=False)
    assert proc.returncode != 0 and "the loaded weights are not the pretrained ones" in proc.stderr
    assert json.loads((tmp_path / "out.json").read_text())["weights_ok"] is False


def test_ft_recovery_goodput_counts_committed_samples_not_steps() -> None:
    from suites.ft_recovery import REFERENCE, _goodput

    # 2 groups, 4 samples each per step; group 1 is down for steps 3-4: those steps commit only group 0's
    # samples
    def rec(t: float, group: int, step: int, samples: int) -> dict:
        return {"t": t, "group": group, "step": step, "committed": True, "data_samples": samples}

    g0 = [rec(float(i), 0, i, 4) for i in range(1, 7)]
    g1 = [rec(float(i), 1, i, 4) for i in (1, 2, 5, 6)]
    good = _goodput({"timelines": {"0": g0, "1": g1}}, global_batch=8)
    assert good["steps"] == 5 and good["seconds"] == 5.0
    assert good["samples"] == 4 * 5 + 4 * 3  # the first record's samples precede the span
    assert good["samples_per_s"] == pytest.approx(32 / 5) and good["steps_per_s"] == pytest.approx(1.0)
    # hsdp's step log has no per-step samples: committed steps x the global batch
    hsdp = _goodput(
        {"timelines": {"job": [{"t": float(i), "step": i, "committed": True} for i in range(1, 7)]}},
        global_batch=8,
    )
    assert hsdp["samples"] == 5 * 8
    # each faulty run is compared with the fault-free run of its own sync mode (any restart mechanism)
    assert REFERENCE == {"ft_faults": "ft_nofault", "ft_faults_warm": "ft_nofault",
                         "ft_faults_fork": "ft_nofault_fork",
                         "diloco_faults": "diloco_nofault", "diloco_faults_warm": "diloco_nofault",
                         "diloco_faults_fork": "diloco_nofault_fork", "hsdp_restart": "hsdp_nofault"}


def test_ft_recovery_downtime_is_kill_to_the_killed_groups_next_commit() -> None:
    from suites.ft_recovery import _downtimes

    def rec(t: float, group: int, step: int) -> dict:
        return {"t": t, "group": group, "step": step, "committed": True}

    g0 = [rec(float(i), 0, i) for i in range(1, 11)]
    g1 = [rec(1.0, 1, 1), rec(2.0, 1, 2), rec(5.5, 1, 6), rec(6.0, 1, 7)]  # killed at 2.5, back at 5.5
    run = {"kills": [{"t": 2.5, "group": 1}, {"t": 8.2, "group": 1}], "timelines": {"0": g0, "1": g1}}
    down = _downtimes(run)
    assert [d["down_s"] for d in down] == [3.0, None]  # the second fault: never committed again


def test_ft_recovery_local_loss_is_measured_against_the_rate_around_each_fault() -> None:
    from suites.ft_recovery import _local_losses

    # one group committing 10 samples every 0.1 s for 200 s (100 samples/s); a fault at 60 s stops it for 3 s,
    # and the host runs 20% faster after 100 s: the fault at 150 s costs nothing but sits in the faster part
    rows = [{"t": round(0.1 * i, 1), "step": i, "committed": True, "data_samples": 10 if i < 1000 else 12}
            for i in range(1, 2000) if not 600 < i <= 630]
    run = {"kills": [{"t": 60.0, "group": 0}, {"t": 150.0, "group": 0}, {"t": 195.0, "group": 0}],
           "timelines": {"0": rows}}
    losses = _local_losses(run, global_batch=10)
    assert [x["fault_t"] for x in losses] == [60.0, 150.0]  # the last one's windows pass the end of the run
    assert losses[0]["rate"] == pytest.approx(100.0, rel=0.01) and losses[0]["lost_s"] == pytest.approx(
        3.0, abs=0.11
    )
    assert losses[1]["rate"] == pytest.approx(120.0, rel=0.01) and losses[1]["lost_s"] == pytest.approx(
        0.0, abs=0.11
    )
    # hsdp: steps redone after a restart (back to the checkpoint at step 500) add no samples
    job = [{"t": 0.1 * i, "step": i, "committed": True} for i in range(1, 601)]
    job += [{"t": 60.0 + 0.1 * k, "step": 500 + k, "committed": True} for k in range(1, 1001)]
    hsdp = _local_losses({"kills": [{"t": 60.0}], "timelines": {"job": job}}, global_batch=10)
    assert hsdp[0]["lost_s"] == pytest.approx(10.0, abs=0.11)  # 100 redone steps at 10 steps/s


def test_ft_recovery_step_time_and_what_a_fault_leaves_behind() -> None:
    from suites.ft_recovery import _post_fault_step_ratios, _step_time

    # 2 groups stepping in 60 ms with both in the quorum; around the fault at 50 s one group is alone for 2 s
    # (those steps do not count), and after the fault at 100 s the steps take 72 ms until the end
    def rows(gid: int) -> list[dict]:
        out, t = [], 0.0
        while t < 150.0:
            alone = 50.0 <= t < 52.0
            step_s = 0.072 if t >= 100.0 else 0.060
            out.append({"t": t, "step_s": 0.5 if alone else step_s, "participants": 1 if alone else 2,
                        "committed": True})
            t += step_s
        return out

    run = {
        "kills": [{"t": 50.0, "group": 1}, {"t": 100.0, "group": 1}],
        "timelines": {"0": rows(0), "1": rows(1)},
    }
    assert _step_time(run, groups=2) == pytest.approx(0.060)  # the lone steps are left out
    post = _post_fault_step_ratios(run, groups=2)
    assert [x["fault_t"] for x in post] == [50.0, 100.0]
    assert post[0]["ratio"] == pytest.approx(1.0) and post[1]["ratio"] == pytest.approx(1.2)
    assert _step_time({"kills": [], "timelines": {"job": [{"t": 1.0, "step": 1}]}}, groups=2) is None  # hsdp


def test_ft_overhead_steady_step_time_costs_and_the_cpu_each_role_spent_more() -> None:
    from suites.ft_overhead import breakdown, costs, steady, step_records, step_time

    # group 0's events: 50 ms steps, step 7 missing (a discarded step: its gap is not a step time), the
    # first steps slower (left out by the warm-up); group 1's records are not read
    rows = [{"t": 0.2 * s if s < 5 else 1.0 + 0.05 * (s - 5), "step": s, "committed": s != 7, "step_s": 0.05,
             "cost_allreduce_s": 0.004 + 0.001 * (s % 2), "allreduces": 3} for s in range(1, 40)]
    run = {"timelines": {"0": rows, "1": [{"t": 0.0, "step": 1, "committed": True}]}}
    records = steady(step_records(run), warmup=5)
    assert records[0]["step"] == 5 and 7 not in [r["step"] for r in records]
    assert step_time(records) == pytest.approx(0.05)
    assert step_time(records[:4]) is None  # too few gaps for a median
    assert costs(records) == {"cost_allreduce_s": pytest.approx(0.0045), "allreduces": 3}
    ft = {"step_s": 0.105, "costs": {"cost_allreduce_s": 0.004},
          "cpu_per_step": {"rank:main": 0.2, "self:main": 0.01}}
    hsdp = {"step_s": 0.100, "cpu_per_step": {"rank:main": 0.19, "agent": 0.001}}
    b = breakdown({"ft_nofault": [ft, dict(ft, step_s=0.115), RuntimeError("a failed round")],
                   "hsdp_nofault": [hsdp, dict(hsdp, step_s=0.100)]})
    assert b["step_s"]["extra"] == pytest.approx(0.010)
    extra = b["cpu_s_per_step"]["extra"]
    assert extra == pytest.approx({"agent": -0.001, "rank:main": 0.01, "self:main": 0.01})
    assert b["ft_costs_per_step"] == {"cost_allreduce_s": 0.004}


def test_ft_overhead_runs_a_before_checkout_in_the_same_rounds(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    from suites import ft_overhead, ft_recovery

    with pytest.raises(ValueError, match=r"--before-src /nonexistent: no fsdp_strategies package there"):
        ft_overhead.run(quick=True, out_dir=tmp_path, before_src="/nonexistent")
    before = tmp_path / "before" / "src"
    (before / "fsdp_strategies").mkdir(parents=True)
    (before / "fsdp_strategies" / "__init__.py").write_text("")
    calls: list[tuple[str, object]] = []

    def timeline(step_s: float) -> dict:  # 40 steps of step_s seconds, rank 0's records
        rows = [{"t": 100.0 + step_s * s, "step": s, "committed": True, "cost_account_s": step_s / 100}
                for s in range(1, 41)]
        return {"returncode": 0, "wall_s": 1.0, "timelines": {0: rows}}

    def fake_ft(work: Path, *args: object, src: Path | None = None, **kwargs: object) -> dict:
        calls.append(("ft", src))
        return timeline(0.12 if src else 0.11)  # the "before" checkout is slower

    def fake_hsdp(work: Path, *args: object, **kwargs: object) -> dict:
        calls.append(("hsdp", None))
        return timeline(0.10)

    monkeypatch.setattr(ft_recovery, "_run_ft", fake_ft)
    monkeypatch.setattr(ft_recovery, "_run_hsdp_restart", fake_hsdp)
    result = ft_overhead.run(quick=True, out_dir=tmp_path / "out", reps=2, before_src=str(before))
    assert result["config"]["contenders"] == ["ft_nofault", "ft_nofault_before", "hsdp_nofault",
                                              "hsdp_nofault_aa"]
    ft_sources = [src for kind, src in calls if kind == "ft"]
    assert ft_sources.count(None) == 2 and ft_sources.count(before) == 2
    assert result["orders"][1][0] == "ft_nofault_before"  # rotated
    change = result["ratios"]["ft_nofault / ft_nofault_before step time (the change)"]
    assert change["value"] == pytest.approx(0.11 / 0.12)
    assert result["ratios"]["ft_nofault / hsdp_nofault step time"]["value"] == pytest.approx(1.1)
    assert result["breakdown"]["ft_before_costs_per_step"]["cost_account_s"] == pytest.approx(0.0012)
    assert json.loads(Path(result["json_path"]).read_text())["config"]["before_src"] == str(before)


def test_ft_overhead_runs_the_before_contender_under_its_own_environment(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    from suites import ft_overhead, ft_recovery

    with pytest.raises(ValueError, match=r"--before-env 'RUST_LOG': not KEY=VALUE"):
        ft_overhead.run(quick=True, out_dir=tmp_path, before_env=["RUST_LOG"])
    monkeypatch.delenv("FT_OVERHEAD_PROBE", raising=False)
    seen: list[tuple[object, str | None]] = []

    def fake_ft(work: Path, *args: object, src: Path | None = None, **kwargs: object) -> dict:
        seen.append((src, os.environ.get("FT_OVERHEAD_PROBE")))  # what the launcher and lighthouse would see
        rows = [{"t": 100.0 + 0.1 * s, "step": s, "committed": True} for s in range(1, 41)]
        return {"returncode": 0, "wall_s": 1.0, "timelines": {0: rows}}

    monkeypatch.setattr(ft_recovery, "_run_ft", fake_ft)
    result = ft_overhead.run(quick=True, out_dir=tmp_path / "out", reps=2, contenders=["ft_nofault"],
                             before_env=["FT_OVERHEAD_PROBE=old"])
    assert result["config"]["contenders"] == ["ft_nofault", "ft_nofault_before"]
    assert seen.count((None, "old")) == 2 and seen.count((None, None)) == 2, seen
    assert "FT_OVERHEAD_PROBE" not in os.environ  # restored after the job
    assert result["config"]["before_env"] == {"FT_OVERHEAD_PROBE": "old"}
    assert "ft_nofault / ft_nofault_before step time (the change)" in result["ratios"]


def test_ft_overhead_pools_the_rounds_of_saved_runs_and_refuses_other_jobs(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """``--pool``: the rounds of two saved runs judged together (the interval over all of them), a failed
    round kept as a failure; results of other jobs are refused naming the file."""
    from suites import ft_overhead, ft_recovery

    times = iter([0.105, 0.100, 0.100, 0.103, 0.100, 0.101,  # run 1, round by round (order as it runs)
                  0.102, 0.100, 0.100, 0.104, 0.101, 0.100] * 2)

    def timeline(*args: object, **kwargs: object) -> dict:
        step_s = next(times)
        rows = [{"t": 100.0 + step_s * s, "step": s, "committed": True, "commit_s": 0.001}
                for s in range(1, 41)]
        return {"returncode": 0, "wall_s": 1.0, "timelines": {0: rows}}

    monkeypatch.setattr(ft_recovery, "_run_ft", timeline)
    monkeypatch.setattr(ft_recovery, "_run_hsdp_restart", timeline)
    runs = [ft_overhead.run(quick=True, out_dir=tmp_path / f"run{i}", reps=2) for i in (1, 2)]
    saved = [r["json_path"] for r in runs]
    broken = json.loads(Path(saved[1]).read_text())
    broken["per_round"]["hsdp_nofault_aa"][0] = {"error": "RuntimeError('exited with 1')"}
    Path(saved[1]).write_text(json.dumps(broken))
    pooled = ft_overhead.run(quick=True, out_dir=tmp_path / "pooled", pool_files=saved)
    assert pooled["pooled_from"] == saved and pooled["config"]["reps"] == 4
    ft_hsdp = pooled["ratios"]["ft_nofault / hsdp_nofault step time"]
    per_run = [r["ratios"]["ft_nofault / hsdp_nofault step time"]["per_round"] for r in runs]
    assert ft_hsdp["per_round"] == pytest.approx(per_run[0] + per_run[1]) and ft_hsdp["rounds_paired"] == 4
    assert pooled["ratios"]["A/A: hsdp_nofault / hsdp_nofault_aa step time"]["rounds_paired"] == 3
    assert pooled["breakdown"]["ft_costs_per_step"]["commit_s"] == pytest.approx(0.001)
    assert Path(pooled["json_path"]).name == "ft_overhead_pooled-cpu.json"
    assert Path(pooled["png_path"]).exists()
    other = json.loads(Path(saved[1]).read_text())
    other["config"]["steps"] = 999
    Path(saved[1]).write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"run2.*ran other jobs or on another host.*steps differ"):
        ft_overhead.run(quick=True, out_dir=tmp_path / "pooled", pool_files=saved)


def test_cpu_sampler_counts_a_ranks_threads_by_name_and_only_inside_the_window() -> None:
    import subprocess

    from cpu_roles import CpuSampler

    # a "rank" (its command line holds --worker) that burns CPU in its main thread and in a thread named
    # "burner", then idles (a process's last reading is the last sample before it exits); the window after it
    # exited counts nothing more
    script = ("import ctypes, threading, time\n"
              "def burn(s):\n    end = time.process_time() + s\n    while time.process_time() < end: pass\n"
              "def named():\n    ctypes.CDLL(None).prctl(15, b'burner', 0, 0, 0)\n    burn(0.6)\n"
              "burn(0.3); t = threading.Thread(target=named); t.start(); t.join(); time.sleep(0.35)\n")
    with CpuSampler(interval_s=0.1) as sampler:
        subprocess.run([sys.executable, "-c", script, "--worker"], check=True)
        t_end = time.time()
        time.sleep(0.5)
    t_start = sampler.samples[0][0]
    spent = sampler.between(t_start, t_end + 0.3)
    assert spent is not None
    assert spent["rank:burner"] == pytest.approx(0.6, abs=0.15)
    assert spent["rank:main"] >= 0.3 - 0.05  # plus the interpreter's start
    after = sampler.between(t_end + 0.15, time.time())
    assert after is not None and after.get("rank:burner", 0.0) == pytest.approx(0.0, abs=1e-6)
    assert sampler.between(t_end + 100, t_end + 200) is None  # no samples there


def test_ft_sync_compare_seeds_pick_the_chain_and_the_initialisation(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    import ft_sync_compare

    # the floor is the true chain's loss on the seed's held-out set: below uniform guessing, different per
    # seed
    floors = [ft_sync_compare.bayes_floor(64, seed) for seed in (0, 1)]
    assert all(0 < f < math.log(64) for f in floors) and floors[0] != floors[1]
    # the launched job gets the seed's data and a shifted seed_everything (seed 0: the configs as they are)
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **_: object) -> subprocess.CompletedProcess:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "stopped by the test")

    monkeypatch.setattr(ft_sync_compare.subprocess, "run", fake_run)
    for seed in (0, 3):
        with pytest.raises(SystemExit, match="the diloco run failed"):
            ft_sync_compare.run("diloco", 8, 4, Path("/nonexistent"), 16, seed)
    # --outer-lr / --outer-momentum reach diloco only
    for mode in ("diloco", "every_step"):
        with pytest.raises(SystemExit, match=f"the {mode} run failed"):
            ft_sync_compare.run(mode, 8, 4, Path("/nonexistent"), 16, 0, {"outer_momentum": 0.5})
    zero, three, diloco, every = seen
    assert zero[zero.index("--data.seed") + 1] == "0" and "--seed_everything" not in zero
    assert (
        three[three.index("--data.seed") + 1] == "3" and three[three.index("--seed_everything") + 1] == "1237"
    )
    assert diloco[diloco.index("--trainer.strategy.init_args.outer_momentum") + 1] == "0.5"
    assert not any("outer_momentum" in a for a in every + zero)


def test_ft_recovery_keep_other_runs_reuses_only_a_same_config_result(tmp_path: Path) -> None:
    from suites.ft_recovery import _kept_runs

    config = {"size": "small", "groups": 2, "ranks_per_group": 2, "steps": 3000, "kill_every_s": 45.0,
              "heartbeat_timeout_ms": 1000, "hsdp_ckpt_every": 50, "quick": False, "pin_cores": "auto"}
    with pytest.raises(SystemExit, match="no earlier result"):
        _kept_runs(tmp_path, config, ["ft_faults_fork"])
    stored = {"config": {**config, "global_batch": 16}, "runs": {"ft_nofault": {"kills": []},
                                                                "ft_faults_fork": {"kills": [1]}}}
    common.result_path("ft_recovery", tmp_path).write_text(json.dumps(stored))
    # the contenders rerun now are dropped from what is kept; the others come back as stored
    assert _kept_runs(tmp_path, config, ["ft_faults_fork"]) == {"ft_nofault": {"kills": []}}
    with pytest.raises(SystemExit, match=r"kill_every_s.*\(45.0, 30.0\)"):
        _kept_runs(tmp_path, {**config, "kill_every_s": 30.0}, ["ft_faults_fork"])


def test_ft_recovery_pool_combines_rounds_of_one_configuration(tmp_path: Path) -> None:
    from suites.ft_recovery import _pool

    config = {"size": "small", "groups": 2, "ranks_per_group": 2, "steps": 3000, "kill_every_s": 45.0,
              "heartbeat_timeout_ms": 300, "hsdp_ckpt_every": 50, "quick": False, "pin_cores": "auto",
              "global_batch": 16}

    def round_dir(name: str, ratio: float | None, lost: list[float], cfg: dict | None = None,
                  valid: bool = True) -> str:
        d = tmp_path / name
        d.mkdir()
        fig = {"local_loss": {"per_fault": [{"lost_s": v} for v in lost]}, "downtime_s": {"median": 1.5},
               "stall_s": {"max": 0.4}}
        if ratio is not None:
            fig["goodput_vs_nofault"] = ratio
            fig["goodput_vs_nofault_step_normalised"] = ratio + 0.05
            fig["step_normalised_valid"] = valid
        stored = {"config": cfg or config, "figures": {"ft_faults_fork": fig, "ft_nofault_fork": {}},
                  "runs": {"ft_faults_fork": {"measured_utc": name}}}
        common.result_path("ft_recovery", d).write_text(json.dumps(stored))
        return str(d)

    # a round without its fault-free reference adds faults but no ratio
    dirs = [round_dir("a", 0.92, [0.8, 0.6, 1.0, 1.8]), round_dir("b", 0.97, [1.4, 0.7, 2.2]),
            round_dir("c", None, [1.7, 3.1, -0.1])]
    result = _pool(dirs, tmp_path / "out")
    fig = result["figures"]["ft_faults_fork"]
    assert fig["separate_run_ratios"] == [0.92, 0.97] and fig["separate_run_ratio_median"] == pytest.approx(
        0.945
    )
    assert fig["step_normalised_ratios"] == pytest.approx([0.97, 1.02])
    assert fig["step_normalised_ratio_median"] == pytest.approx(0.995)
    assert fig["local_lost_s_pooled"] == sorted([0.8, 0.6, 1.0, 1.8, 1.4, 0.7, 2.2, 1.7, 3.1, -0.1])
    assert fig["local_lost_s_median"] == pytest.approx(1.2)
    assert fig["goodput_at_kill_every"] == pytest.approx(1 - 1.2 / 45)
    assert fig["goodput_at_kill_every_range"] == pytest.approx([1 - 3.1 / 45, 1 + 0.1 / 45])
    assert [r["measured_utc"] for r in fig["rounds"]] == ["a", "b", "c"]
    met = {row["ratio"]: row["met"] for row in result["summary"]}
    assert met["ft_faults_fork goodput / fault-free, median of 2 rounds"] is False
    assert met["ft_faults_fork goodput / fault-free at equal step time, median of 2 rounds"] is True
    assert met["ft_faults_fork goodput at one fault per 45 s, from that loss"] is True
    assert Path(result["json_path"]).exists() and Path(result["png_path"]).stat().st_size > 0
    # a round whose faults changed the step time keeps its plain ratio but not its step-normalised one
    slowed = _pool([dirs[0], round_dir("e", 0.80, [5.0], valid=False)], tmp_path / "out")
    assert slowed["figures"]["ft_faults_fork"]["separate_run_ratios"] == [0.92, 0.80]
    assert slowed["figures"]["ft_faults_fork"]["step_normalised_ratios"] == pytest.approx([0.97])
    # rounds of another configuration are refused, naming the option
    other = round_dir("d", 0.99, [0.1], {**config, "heartbeat_timeout_ms": 1000})
    with pytest.raises(SystemExit, match=r"heartbeat_timeout_ms.*\(300, 1000\)"):
        _pool([dirs[0], other], tmp_path / "out")
    with pytest.raises(SystemExit, match="no ft_recovery result"):
        _pool([str(tmp_path / "missing")], tmp_path / "out")


def test_ft_recovery_runs_the_contenders_in_the_order_given_and_reports_the_aa_ratio(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An A/A pair's order alternates between rounds (``--contenders`` in the order given); one round's A/A
    ratio is reported without a verdict (no interval)."""
    from suites import ft_recovery

    ran: list[tuple[str, str]] = []

    def fake_ft(work: Path, *args: object, runner: str = "torchrun", **kwargs: object) -> dict:
        ran.append((work.name, runner))
        rows = [{"t": 100.0 + 0.1 * s, "step": s, "committed": True, "participants": 2, "data_samples": 16}
                for s in range(1, 41)]
        return {"returncode": 0, "wall_s": 4.0, "timelines": {0: rows, 1: rows}, "kills": [], "restarts": []}

    monkeypatch.setattr(ft_recovery, "_run_ft", fake_ft)
    monkeypatch.setattr(ft_recovery, "_plot", lambda runs, path: path)
    result = ft_recovery.run(quick=True, out_dir=tmp_path,
                             contenders=["ft_nofault_fork_aa", "ft_nofault_fork"])
    assert ran == [("ft_nofault_fork_aa", "forkserver"), ("ft_nofault_fork", "forkserver")]
    (aa,) = [r for r in result["summary"] if r["ratio"].startswith("A/A")]
    assert aa["value"] == pytest.approx(1.0) and aa["met"] is None and aa["aa"] is True


def test_ft_recovery_pool_judges_the_aa_twin_and_withholds_the_verdicts_when_it_fails(tmp_path: Path) -> None:
    """Issue 43: ``ft_nofault_fork_aa`` is the suite's A/A pair; pooled over the rounds that ran both, its
    ratio's interval must hold 1.00, or the goodput verdicts of those rounds are withheld."""
    from suites.ft_recovery import _pool

    config = {"size": "small", "groups": 2, "ranks_per_group": 2, "steps": 600, "kill_every_s": 45.0,
              "heartbeat_timeout_ms": 300, "hsdp_ckpt_every": 50, "quick": False, "pin_cores": "auto"}

    def round_dir(name: str, nofault: float, twin: float, ratio: float | None = None) -> str:
        d = tmp_path / name
        d.mkdir()
        figures = {"ft_nofault_fork": {"goodput": {"samples_per_s": nofault}},
                   "ft_nofault_fork_aa": {"goodput": {"samples_per_s": twin}}}
        if ratio is not None:
            figures["ft_faults_fork"] = {"goodput_vs_nofault": ratio, "local_loss": {"per_fault": []}}
        common.result_path("ft_recovery", d).write_text(json.dumps({"config": config, "figures": figures}))
        return str(d)

    held = _pool([round_dir("a", 100.0, 99.0), round_dir("b", 100.0, 101.0), round_dir("c", 99.5, 100.0)],
                 tmp_path / "out")  # the twin alone: an A/A-only pool is a result of its own
    (row,) = [r for r in held["summary"] if r["ratio"].startswith("A/A")]
    assert row["met"] is True and row["ci95"][0] <= 1.0 <= row["ci95"][1] and held["aa"]["rounds_paired"] == 3
    failed = _pool([round_dir("d", 100.0, 90.0, ratio=0.97), round_dir("e", 100.0, 91.0, ratio=0.96)],
                   tmp_path / "out")  # the twin ran 10 % slower both times: the host moved
    rows = {r["ratio"]: r for r in failed["summary"]}
    assert rows["A/A: ft_nofault_fork / ft_nofault_fork_aa (committed samples/s), 2 rounds"]["met"] is False
    verdict = rows["ft_faults_fork goodput / fault-free, median of 2 rounds"]
    assert verdict["met"] is None
    assert verdict["verdict"].startswith("withheld: the A/A pair came out at 1.105")


# ----------------------------------------------------------------------------------------------
# benchmarks/gpu.py


def test_gpu_harness_helpers(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess

    import torch

    from llama import LlamaLM
    from suites.mfu import _torchtitan_flops_per_token

    # the example's model, read from its YAML, and the arithmetic parameter count / torchtitan formula
    ex = gpu_harness.example_model()
    assert (
        ex["model"]["dim"] == 2048
        and ex["model"]["n_kv_heads"] == 8
        and ex["seq_len"] == 2048
        and ex["batch"] == 4
    )
    for model, seq in ((ex["model"], ex["seq_len"]), (gpu_harness.quick_model()["model"], 32),
                       ({**ex["model"], **gpu_harness.LADDER["7b"]}, 2048)):
        lm = LlamaLM(**model, max_seq_len=seq)
        with torch.device("meta"):
            lm.configure_model()
        assert gpu_harness.llama_params(model)["total"] == sum(p.numel() for p in lm.parameters())
        heads = model["n_heads"]
        assert gpu_harness.torchtitan_flops_per_token(model, seq) == _torchtitan_flops_per_token(
            lm, model["n_layers"], heads, model["dim"] // heads, seq)
    assert 0.85e9 < gpu_harness.llama_params(ex["model"])["total"] < 1.2e9  # "~1B"

    # bisection: monotone fits, a known lower bound, and a probe that says nothing stops the search
    sizes = [1, 2, 3, 5, 8, 13, 21]
    for limit in (0, 1, 4, 13, 100):
        probed: list[int] = []
        best, order = gpu_harness.bisect_largest(
            len(sizes), lambda i, probed=probed, limit=limit: probed.append(i) or sizes[i] <= limit)
        assert best == max((i for i, s in enumerate(sizes) if s <= limit), default=-1) and order == probed
        assert len(order) <= 3
    best, order = gpu_harness.bisect_largest(len(sizes), lambda i: sizes[i] <= 13, lo=1)
    assert best == 5 and 0 not in order and 1 not in order
    best, order = gpu_harness.bisect_largest(len(sizes), lambda i: None if i == 4 else True, lo=1)
    assert best == 1 and order == [4]
    assert gpu_harness.is_oom(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"
    ) and not gpu_harness.is_oom("x")

    # the memory bisection over the example's family, with fake probes: guards, OOMs, a known fit
    def fake_run_worker(script: str, nproc: int, args: list[str], **_: object) -> dict:
        model = json.loads(args[args.index("--model") + 1])
        params, offload = gpu_harness.llama_params(model)["total"], "--cpu-offload" in args
        if params > (8e9 if offload else 2e9):
            raise common.WorkerError(
                "exit 1: ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"
            )
        return {
            "per_rank": [{"memory": {"peak_cuda_bytes": params * 10}}],
            "step_times_s": [0.5],
            "warmup_times_s": [1.0],
        }

    monkeypatch.setattr(common, "run_worker", fake_run_worker)
    monkeypatch.setattr(gpu_harness, "host_available_bytes", lambda: 200 * 2**30)
    plan = object.__new__(gpu_harness.Plan)
    plan.__dict__.update(example=ex, precision="bf16-mixed", ladder=list(gpu_harness.LADDER), timeout=10,
                         env={}, total_device_bytes=80 * 2**30, budget_s=None, started=time.monotonic())
    fit = gpu_harness._bisect_ladder(plan, {"median_s": 0.3})  # 1b ran in the contenders section
    no, off = fit["no_offload"], fit["cpu_offload"]
    assert (
        no["largest"] == "1b"
        and off["largest"] == "7b"
        and not no["inconclusive"]
        and not off["inconclusive"]
    )
    assert [p["size"] for p in no["probes"]] == ["13b", "3b"] and "GiB on the device" in no["probes"][0][
        "not_started"
    ]
    assert no["probes"][1]["why"] == "out of memory" and no["probes"][1]["fits"] is False
    assert [p["size"] for p in off["probes"]] == ["13b", "3b", "7b"] and "host RAM" in off["probes"][0][
        "not_started"
    ]
    assert off["probes"][2]["fits"] is True and off["probes"][2]["peak_cuda_bytes"] > 0
    monkeypatch.setattr(
        common, "run_worker", lambda *a, **k: (_ for _ in ()).throw(common.WorkerError("NCCL error"))
    )
    fit = gpu_harness._bisect_ladder(plan, {"median_s": 0.3})
    # a non-OOM failure says nothing
    assert fit["no_offload"]["largest"] == "1b" and fit["no_offload"]["inconclusive"]
    monkeypatch.undo()

    # bad options are named
    for argv, fragment in ((["--sections", "nope"], "--sections"), (["--ladder", "9t"], "--ladder"),
                           (["--steps", "0"], "--steps")):
        with pytest.raises(SystemExit):
            gpu_harness.parse_args(argv)
        err = capsys.readouterr().err
        assert fragment in err and argv[1] in err

    # a failing section is recorded with its error tail, and the caller goes on
    def boom(plan: object, done: object) -> dict:
        raise RuntimeError("device fell over\nlast line of the tail")

    monkeypatch.setitem(gpu_harness.SECTION_FUNCS, "sac", boom)
    rec = gpu_harness.run_section("sac", object(), {})  # type: ignore[arg-type]
    assert rec["status"] == "failed" and rec["error"] == "RuntimeError"
    assert rec["error_tail"][-1].endswith("last line of the tail") and rec["wall_s"] >= 0

    # smoke: a crashed worker process restarts the remaining runs; a failed run is retried alone
    calls: list[list[str]] = []

    def fake_worker(plan: object, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        out = Path(args[args.index("--out") + 1])
        runs = args[args.index("--runs") + 1:args.index("--out")] if "--runs" in args else ["a", "b", "c"]
        calls.append(runs)
        lines = [{"event": "plan", "runs": runs}]
        code = 0
        for name in runs:
            lines.append({"event": "started", "name": name})
            if name == "b" and len(calls) == 1:
                code = -9  # the process dies during b
                break
            status = "failed" if name == "c" and len(calls) == 2 else "ok"
            lines.append({"event": "done", "name": name, "status": status, "attempt": len(calls)})
        out.write_text("".join(json.dumps(x) + "\n" for x in lines))
        return subprocess.CompletedProcess(args, code, "", "Fatal Python error: Segmentation fault")

    monkeypatch.setattr(gpu_harness, "_run_section_worker", fake_worker)
    plan = object.__new__(gpu_harness.Plan)
    plan.__dict__.update(
        precision="bf16-mixed", quick=True, timeout=10, budget_s=None, started=time.monotonic()
    )
    smoke = gpu_harness.section_smoke(plan, {})
    assert calls == [["a", "b", "c"], ["c"], ["b"], ["c"]]
    runs = smoke["runs"]
    assert runs["a"]["status"] == "ok" and "retried_alone" not in runs["a"]
    assert runs["b"]["status"] == "ok" and runs["b"]["retried_alone"]
    assert (
        "died" in runs["b"]["first_attempt"]["reason"]
        and "Segmentation" in runs["b"]["first_attempt"]["error_tail"][-1]
    )
    assert runs["c"]["retried_alone"] and runs["c"]["first_attempt"]["status"] == "failed"
    assert smoke["status"] == "ok" and smoke["failed_runs"] == []


def test_gpu_harness_budget_arithmetic() -> None:
    # rounds are cut to what fits (at least one), section estimates follow the measured job time
    assert gpu_harness.fit_reps(3, 3, 45.0, 1000.0) == 3 and gpu_harness.fit_reps(3, 3, 45.0, 300.0) == 2
    assert gpu_harness.fit_reps(3, 3, 45.0, 10.0) == 1 and gpu_harness.fit_reps(2, 0, 45.0, 0.0) == 2
    plan = object.__new__(gpu_harness.Plan)
    plan.__dict__.update(quick=False, job_walls=[], contenders=["fsdp2", "torch_fsdp2"], budget_s=100.0,
                         started=time.monotonic() - 40, timeout=480)
    assert gpu_harness.section_estimate("contenders", plan) == 2 * gpu_harness.JOB_S["gpu"]
    plan.job_walls += [10.0, 20.0, 30.0]
    assert gpu_harness.section_estimate("contenders", plan) == 40.0  # 2 x the measured median
    assert gpu_harness.section_estimate("smoke", plan) == gpu_harness.FIXED_S["smoke"][0]
    assert 59 <= plan.left_s() <= 60 and plan.job_timeout() <= 60  # no job outlives the budget
    reason = gpu_harness.budget_reason(150.0, plan)
    assert "--budget-s 100" in reason and "estimated 150s" in reason


@pytest.mark.subprocess
def test_gpu_harness_budget_skips_what_cannot_finish(tmp_path: Path) -> None:
    # --quick with a 1 s budget: no section is started, each is recorded as skipped with its estimate and why
    proc = run_python(
        ["benchmarks/gpu.py", "--quick", "--budget-s", "1", "--out-dir", str(tmp_path)],
        timeout=300,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert list(result["sections"]) == list(gpu_harness.SECTIONS) and result["config"]["budget_s"] == 1
    for sec in result["sections"].values():
        assert sec["status"] == "skipped" and sec["estimate_s"] > 1 and "--budget-s 1:" in sec["reason"]


def _mfu_ratio_met(result: dict) -> bool:
    ratio = result["sections"]["contenders"]["ratios"]["fsdp2 MFU: MFUMonitor / torchtitan formula"]
    return ratio["met"] is True and ratio["target"] < 1.0 and ratio["direction"] == ">="


def _numbers(*values: object) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


@pytest.mark.multiprocess
def test_gpu_harness_quick_mode_on_cpu(tmp_path: Path) -> None:
    # Every section of benchmarks/gpu.py in its CPU smoke mode: each part produced numbers or a skip reason.
    proc = run_python(
        ["benchmarks/gpu.py", "--quick", "--budget-s", "1800", "--out-dir", str(tmp_path)],
        timeout=900,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    result = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert result["suite"] == "gpu" and result["device"] == "cpu" and result["config"]["quick"] is True
    assert list(result["sections"]) == list(gpu_harness.SECTIONS)
    for name, sec in result["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("error_tail") or sec)
        assert sec["wall_s"] > 0 and sec["started_utc"]

    sec = result["sections"]["contenders"]["contenders"]
    assert "lightning_fsdp" not in sec  # FSDP1: only with --contenders (no budget for it on a lent GPU)
    for name in ("fsdp2", "lightning_model_parallel", "torch_fsdp2"):
        rec = sec[name]
        assert rec["errors"] == [] and _numbers(
            rec["median_s"], rec["tokens_per_s"], rec["peak_memory_bytes"]
        )
        assert _numbers(rec["torchtitan"]["mfu"], rec["torchtitan"]["tflops"]) and rec["peak_flops"] == 1e12
        assert rec["variant"] == {"compile_blocks": False, "compile_backend": None, "cpu_offload": False}
    for name in ("fsdp2", "lightning_model_parallel"):  # MFUMonitor's own figures (Lightning contenders)
        mon = sec[name]["mfu_monitor"]
        assert _numbers(mon["mfu"], mon["hfu"], mon["tflops_per_device"], mon["model_flops_per_batch"])
        assert mon["hfu"] >= mon["mfu"] and mon["flop_source"].startswith("FlopCounterMode")
        # on the same timing the two MFUs differ only by their FLOPs: the formula also books the norm weights
        assert 0.99 < mon["mfu_over_torchtitan"] <= 1.0
    assert _mfu_ratio_met(result)
    ratios = result["sections"]["contenders"]["ratios"]
    assert {
        "fsdp2/torch_fsdp2",
        "fsdp2/lightning_model_parallel",
        "fsdp2 MFU: MFUMonitor / torchtitan formula",
    } <= set(ratios)
    assert ratios["fsdp2/torch_fsdp2"]["value"] == pytest.approx(
        sec["fsdp2"]["rep_medians_s"][0] / sec["torch_fsdp2"]["rep_medians_s"][0])

    sec = result["sections"]["compile"]["contenders"]
    assert "quick" in sec["fsdp2"]["skipped"]
    for name in ("fsdp2+compile", "torch_fsdp2+compile"):
        assert sec[name]["errors"] == [] and _numbers(sec[name]["median_s"])
        assert (
            sec[name]["variant"]["compile_blocks"] is True
            and sec[name]["variant"]["compile_backend"] == "aot_eager"
        )
    # compiled: FLOPs not countable
    assert sec["fsdp2+compile"]["mfu_monitor"]["flop_source"].startswith("analytic")

    sac = result["sections"]["sac"]
    # the fixed modes and offload (budget runs bf16-mixed here: see the sac suite's own test for budget in
    # fp32)
    assert {"none", "selective_op", "selective_op_2nd_mm", "selective_layer", "full", "offload",
            "selective_layer+offload"} <= set(sac["modes"])
    for mode, rec in sac["modes"].items():
        assert _numbers(rec["median_step_s"], rec["tokens_per_s"], rec["kept_bytes"]), mode
    assert sac["modes"]["full"]["kept_bytes"] < sac["modes"]["none"]["kept_bytes"]
    assert "GPUs only" in sac["peak_cuda"]["skipped"]

    mem = result["sections"]["memory"]
    rows = mem["strategies"]
    assert rows["fsdp2+offload"]["from_section"] == "memory" and rows["fsdp2+offload"]["cpu_offload"] is True
    assert rows["fsdp2"]["from_section"] == "contenders"
    # accumulation 4 next to the contenders' 1: what each backward leaves held
    acc = rows["fsdp2+accumulate4"]
    assert (
        acc["accumulate_grad_batches"] == gpu_harness.ACCUMULATE
        and len(acc["grad_bytes_held_after_backward"]) >= 4
    )
    assert acc["cuda_allocated_after_backward"] is None  # CPU: no device counter
    for key, row in rows.items():
        assert row.get("skipped") or _numbers(row["peak_memory_bytes"], row["param_bytes"]), key
    assert "host" in mem["largest_fitting"]["skipped"]

    runs = result["sections"]["smoke"]["runs"]
    assert set(runs) == {"fsdp2", "hsdp", "ddp_hooks:allreduce", "ddp_hooks:bf16_compress",
                         "ddp_hooks:fp16_compress",
                         "ddp_hooks:powersgd", "ddp_hooks:post_local_sgd", "ddp_hooks:hierarchical_sgd",
                         "ft_hsdp",
                         "async_checkpoint:thread", "async_checkpoint:process", "activation_offload",
                         "straggler", "mfu_peak"}
    for name, rec in runs.items():
        assert rec["status"] == "ok" and rec["backend"] == "gloo" and "retried_alone" not in rec, (name, rec)
    assert runs["ddp_hooks:powersgd"]["comm_state"]["powersgd"]["numel_after_compression"] > 0
    assert runs["ddp_hooks:hierarchical_sgd"]["comm_state"]["averager"]["step"] > 0
    assert runs["ft_hsdp"]["ft_stats"]["committed"] == runs["ft_hsdp"]["steps"] > 0
    assert runs["hsdp"]["mesh"]["shape"] == [1, 1] and runs["fsdp2"]["mesh"]["shape"] == [1]
    for mode in ("thread", "process"):  # saves every 2 steps, the last verified and resumed from
        rec = runs[f"async_checkpoint:{mode}"]
        assert rec["verify_last"]["status"] == "ok" and len(rec["resumed_losses"]) == 2
    offload = runs["activation_offload"]
    assert offload["offloaded"]["bytes"] > 0 and offload["losses_max_abs_diff"] < 1e-3
    straggler = runs["straggler"]
    assert straggler["windows_scored"] >= 2 and len(straggler["per_window"]) >= 2
    assert all(_numbers(w["detector_busy_s"], w["hand_busy_s"]) for w in straggler["per_window"])
    assert "GPUs only" in straggler["cuda_event_check"]["skipped"]
    assert runs["mfu_peak"]["agrees"] and runs["mfu_peak"]["mfu_monitor_peak"] is None
    assert "no CUDA device" in runs["mfu_peak"]["peak_check"]["skipped"]

    for png in ("gpu-cpu.png", "gpu-cpu-sac.png"):
        assert (tmp_path / png).read_bytes().startswith(b"\x89PNG")
    pre = result["sections"]["pretrained"]
    assert pre["weights_ok"] and pre["ref_loss"] == pytest.approx(
        pre["expected_ref_loss"], abs=pre["tolerance"]
    )
    assert _numbers(pre["load_s"], pre["peak_host_growth_bytes"]) and pre["peak_cuda_bytes"] is None
    assert "smoke        14/14 ok" in proc.stdout and result["table"] in proc.stdout
    assert "| fsdp2 |" in gpu_harness.markdown(result) and "report_error" not in result

    # the GPU-only fields render too (peak CUDA memory of the SAC modes, the bisection's answers)
    gpu_like = copy.deepcopy(result)
    gpu_like.update(device="nvidia-h100-80gb-hbm3", device_name="NVIDIA H100 80GB HBM3")
    for i, rec in enumerate(gpu_like["sections"]["sac"]["modes"].values()):
        rec.update(peak_cuda_bytes_over_weights=(5 - i) * 2**30, peak_vs_none=(5 - i) / 5)
    gpu_like["sections"]["memory"]["largest_fitting"] = {
        "no_offload": {"largest": "3b", "probes": [], "inconclusive": False},
        "cpu_offload": {"largest": "7b", "probes": [], "inconclusive": True}}
    text = gpu_harness.table(gpu_like)
    assert "largest fitting, no_offload: 3b" in text and "cpu_offload: 7b (inconclusive)" in text
    assert "with cpu_offload 7b" in gpu_harness.markdown(gpu_like) and "5.00 GiB" in gpu_harness.markdown(
        gpu_like
    )
    assert gpu_harness.plot(gpu_like, tmp_path / "g.png").exists()
    assert gpu_harness.plot_sac(gpu_like, tmp_path / "g-sac.png").exists()


def test_hang_watchdog_own_cost_from_the_worker_extras() -> None:
    # the suite's direct measurement: hooks timed here, rank 0's thread CPU over the fit's wall time (per
    # round, from the worker's "extras"), both as fractions of fsdp2's median step; no figure without both
    from suites import hang_watchdog

    assert 0 < hang_watchdog.hook_seconds_per_step(5, reps=200) < 1e-3
    threads = [{"thread_cpu_s": 0.002, "fit_wall_s": 4.0, "polls": 4, "poll_s": 1.0},
               {"thread_cpu_s": 0.004, "fit_wall_s": 4.0, "polls": 4, "poll_s": 1.0},
               {"thread_cpu_s": 0.003, "fit_wall_s": 4.0, "polls": 4, "poll_s": 1.0}]
    contenders = {"fsdp2": {"median_s": 0.1},
                  "fsdp2_hang_watchdog": {"extras": [{"hang_watchdog": t} for t in threads]}}
    result = {"config": {"sizes": {"small": common.size_config("small")}},
              "cases": [{"size": "small", "ranks": 2, "contenders": contenders}]}
    [cost] = hang_watchdog.own_cost(result)
    assert cost["thread_cpu_fraction"] == pytest.approx(0.003 / 4.0)
    assert cost["fsdp_units"] == common.size_config("small")["model"]["n_layers"] + 1
    assert cost["total_fraction"] == pytest.approx(cost["hooks_fraction"] + 0.003 / 4.0) and cost["met"]
    del result["cases"][0]["contenders"]["fsdp2"]
    assert hang_watchdog.own_cost(result) == []
