"""benchmarks/goodput.py: the model's arithmetic against hand-computed cases, and that the script writes its
result.

No process starts and nothing is timed: the script only reads result files and computes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
import goodput  # noqa: E402


def test_without_failures_a_restart_job_loses_only_its_checkpoint_stalls() -> None:
    # 100 s of work, then a 5 s stall: 100 / 105
    assert goodput.restart_goodput(math.inf, restart_s=60, checkpoint_s=5, interval_s=100) == pytest.approx(
        100 / 105
    )
    assert goodput.cluster_mtbf_s(1000, 0.0) == math.inf
    assert goodput.daly_interval_s(5, math.inf) == math.inf  # no failures: never checkpoint ...
    assert goodput.restart_goodput(math.inf, 60, 5, math.inf) == 1.0  # ... and lose nothing


def test_young_and_daly_intervals_by_hand() -> None:
    # C = 10 min, M = 1 day: Young sqrt(2 x 600 x 86400) = 10182.34 s; Daly's correction
    # x = 600 / 172800: sqrt(2CM) (1 + sqrt(x)/3 + x/9) - C = 9786.27 s
    assert goodput.young_interval_s(600, 86400) == pytest.approx(10182.3376, rel=1e-6)
    assert goodput.daly_interval_s(600, 86400) == pytest.approx(9786.2660, rel=1e-6)
    assert goodput.daly_interval_s(300, 100) == 100  # C >= 2M: checkpoint once per failure interval


def test_daly_goodput_matches_the_first_order_loss_when_failures_are_rare() -> None:
    # M = 1e6 s, C = 1 s, R = 10 s, 1000 s between checkpoints: 1 - C/tau - (R + tau/2)/M = 0.99849
    value = goodput.restart_goodput(1e6, restart_s=10, checkpoint_s=1, interval_s=1000)
    assert value == pytest.approx(0.9984911, rel=1e-6)
    assert value == pytest.approx(1 - 1 / 1000 - (10 + 500) / 1e6, abs=2e-6)


def test_replica_group_losses_by_hand() -> None:
    # a failure every 100 s, 4 groups: 3 survivors stall 1 s, the failed group is out 10 s
    # -> (1 x 3/4 + 10/4) / 100 = 0.0325 of the cluster lost
    assert goodput.ft_goodput(100, 4, stall_s=1, down_s=10) == pytest.approx(0.9675)
    # DiLoCo: the failed group also loses a round of 8 s; a 10% per-step overhead divides the rest
    assert goodput.ft_goodput(100, 4, 1, 10, lost_work_s=8) == pytest.approx(1 - (0.75 + 18 / 4) / 100)
    assert goodput.ft_goodput(100, 4, 1, 10, overhead=0.1) == pytest.approx(0.9675 / 1.1)
    assert goodput.ft_goodput(1, 2, 10, 10) == 0.0  # never gets a step in
    with pytest.raises(ValueError, match="groups=1"):
        goodput.ft_goodput(100, 1, 1, 10)


def test_published_points_and_rates_by_hand() -> None:
    assert goodput.cluster_mtbf_s(1000, 1e-4) == pytest.approx(36000.0)
    # 10 min per failure at 44% effective training time: a failure every 600 / 0.56 = 1071.4 s
    assert goodput.implied_mtbf_s(600, 0.44) == pytest.approx(1071.4286, rel=1e-6)


def test_growth_with_n_interpolates_and_continues_the_sweep() -> None:
    scale = {"usable": True, "n": [2, 8, 32], "quorum_p50_s": [0.1, 0.2, 0.4]}
    assert goodput.growth(scale, "quorum_p50_s", 2) == 0.0
    assert goodput.growth(scale, "quorum_p50_s", 8) == pytest.approx(0.1)
    assert goodput.growth(scale, "quorum_p50_s", 4) == pytest.approx(0.05)  # halfway in log N
    # past the sweep: the last slope, 0.2 / 24 per group, for 32 more groups
    assert goodput.growth(scale, "quorum_p50_s", 64) == pytest.approx(0.4 + 0.2 / 24 * 32 - 0.1)
    assert goodput.growth(None, "quorum_p50_s", 64) == 0.0


def _results_dir(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    results.mkdir()
    for name in ("ft_recovery-cpu.json", "checkpoint-cpu.json"):
        os.symlink(goodput.RESULTS / name, results / name)
    return results


def test_the_script_writes_its_json_and_figure_with_every_inputs_source(tmp_path: Path) -> None:
    results = _results_dir(tmp_path)
    path = goodput.main(["--results", str(results), "--out-dir", str(tmp_path / "out")])
    data = json.loads(path.read_text())
    assert (tmp_path / "out" / data["png_path"]).is_file()
    assert set(data["table"]) == {"1000", "10000", "100000"}
    for name, item in data["inputs"].items():
        assert item["source"] and item["value"] is not None, name
    assert data["ft_scale"]["usable"] is False
    for row in data["table"].values():
        scenarios = [k for k in row if k not in ("groups", "mtbf_min")]
        assert scenarios[0] == "measured" and scenarios[-1] == "published_stalls" and len(scenarios) == 3
        for scenario in scenarios:
            assert set(row[scenario]) == set(goodput.MODES)
            assert all(0.0 <= v <= 1.0 for v in row[scenario].values())
    # the model at the paper's implied failure rate with the paper's stalls gives back the paper's points
    paper = data["comparison"]["ft_hsdp_paper"]
    mtbf = paper["implied_mtbf_min"]["sync"] * 60
    assert 1 - goodput.FT_HSDP_PAPER["sync_stall_s"] / mtbf == pytest.approx(0.44)
    assert any("goodput at 100,000 GPUs" in r["ratio"] for r in data["summary"])


def test_a_rerun_reads_ft_scale_when_it_exists(tmp_path: Path) -> None:
    results = _results_dir(tmp_path)
    before = json.loads(
        goodput.main(["--results", str(results), "--out-dir", str(tmp_path / "a")]).read_text()
    )
    (results / "ft_scale-cpu.json").write_text(json.dumps({"sweep": [  # ft_scale's documented keys
        {"n": 2, "status": "ok", "quorum_s": {"p50": 0.005}, "survivor_stall_s": {"p50": 1.0},
         "heal_s": {"p50": 2.0}},
        {"n": 64, "status": "failed", "error": "not counted"},
        {"n": 1024, "status": "ok", "quorum_s": {"p50": 0.5}, "survivor_stall_s": {"p50": 5.0},
         "heal_s": {"p50": 4.0}}]}))
    after = json.loads(
        goodput.main(["--results", str(results), "--out-dir", str(tmp_path / "b")]).read_text()
    )
    assert after["ft_scale"]["usable"] is True
    assert after["ft_scale"]["quorum_p50_s"] == [0.005, 0.5]
    big_before, big_after = before["table"]["100000"]["measured"], after["table"]["100000"]["measured"]
    assert big_after["ft_every_step"] < big_before["ft_every_step"]
    assert big_after["restart"] == big_before["restart"]  # the restart mode has no per-N input


def test_ft_overhead_s_fixed_cost_is_charged_to_every_fault_free_step(tmp_path: Path) -> None:
    # the ~1B example: 16 blocks of dim 2048 (k/v: 8 of 16 heads' width), MLP 5632, vocab 32000,
    # 4 x 2048 tokens
    ex = goodput.example_1b()
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 5632 + 2 * 2048
    assert ex == {"params": 2 * 32000 * 2048 + 16 * per_layer + 2048, "units": 17, "tokens_per_gpu": 8192}
    # 2 ms fixed + 1 GB shard read and written once at 3.35 TB/s, over a 0.1 s step
    x = goodput.fault_free_overhead(0.002, 1e9, 0.1)
    assert x["division_s"] == pytest.approx(2e9 / 3.35e12)
    assert x["fraction"] == pytest.approx((0.002 + 2e9 / 3.35e12) / 0.1)
    results = _results_dir(tmp_path)
    before = json.loads(goodput.main(["--results", str(results), "--out-dir", str(tmp_path / "a")])
                        .read_text())
    assert before["inputs"]["ft_fixed_step_s"]["value"] == 0.0  # no ft_overhead result: nothing charged
    parts = {"commit_s": 0.002, "cost_capture_s": 0.001, "cost_quorum_start_s": 0.0001,
             "cost_account_s": 0.0004, "cost_batch_s": 0.0, "cost_allreduce_s": 0.02, "allreduces": 3,
             "allreduce_bytes": 900000}
    (results / "ft_overhead-cpu.json").write_text(json.dumps({"breakdown": {
        "ft_costs_per_step": parts, "step_s": {"ft_nofault": 0.13, "hsdp_nofault": 0.1, "extra": 0.03}}}))
    after = json.loads(goodput.main(["--results", str(results), "--out-dir", str(tmp_path / "b")])
                       .read_text())
    fixed = after["inputs"]["ft_fixed_step_s"]
    # the fixed parts, not the all-reduce (hsdp moves the same bytes)
    assert fixed["value"] == pytest.approx(0.0035) and "ft_overhead-cpu.json" in fixed["source"]
    small, big = before["table"]["1000"]["measured"], after["table"]["1000"]["measured"]
    assert big["ft_every_step"] < small["ft_every_step"] and big["restart"] == small["restart"]
    ex_ff = after["fault_free"]["example_1b"]
    assert ex_ff["fixed_s"] == pytest.approx(0.0035) and 0 < ex_ff["fraction"] < 1
    assert ex_ff["step_s"] == pytest.approx(6 * ex["params"] * 8192 / (989e12 * 0.4))
    assert any("fault-free cost, the ~1B example" in r["ratio"] for r in after["summary"])
