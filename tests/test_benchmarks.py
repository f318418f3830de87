"""The benchmark runner in quick mode, so it cannot rot: real worker jobs, real result files.

Never asserts on timings (the machine is shared and noisy); it checks the result files' structure,
that every sample is a real positive number, that medians and ratios are computed from those
samples, and that the interleaving really is A B A B.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import os
import statistics
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_python

BENCH = ROOT / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import common  # noqa: E402
import run as bench_run  # noqa: E402


def _positive_floats(values: list) -> bool:
    return bool(values) and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values)


def _one(pattern: str, folder: Path) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {folder}, found {found}"
    return found[0]


def test_interleave_order_and_ratios() -> None:
    calls: list[tuple[str, int]] = []

    def run_one(name: str, rep: int) -> float:
        calls.append((name, rep))
        if name == "C":
            raise RuntimeError("boom")
        return {"A": 2.0, "B": 1.0}[name] * (rep + 1)

    out = common.interleave(["A", "B", "C"], 2, run_one)
    assert calls == [("A", 0), ("B", 0), ("C", 0), ("A", 1), ("B", 1), ("C", 1)]
    assert out["A"] == [2.0, 4.0] and out["B"] == [1.0, 2.0]
    assert all(isinstance(e, RuntimeError) for e in out["C"])  # a failing contender does not stop the others
    ratio = common.paired_ratio([2.0, 4.0, None], [1.0, 2.0, 3.0])
    assert ratio["per_round"] == [2.0, 2.0] and ratio["value"] == 2.0
    assert ratio["ratio_of_medians"] == pytest.approx(3.0 / 2.0)


def test_runner_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert {"ddp", "fsdp", "hsdp", "memory"} <= set(bench_run.discover())
    with pytest.raises(SystemExit):
        bench_run.main(["no_such_suite"])
    assert "no_such_suite" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--sizes"):
        bench_run.main(["fsdp", "--sizes", "enormous"])
    with pytest.raises(ValueError, match="--contenders"):
        common.select("fsdp", ("fsdp2", "torch_fsdp2"), ["torch_ddp"])


@pytest.mark.multiprocess
def test_runner_quick_mode_writes_real_results(tmp_path: Path) -> None:
    # fsdp (both worker scripts: Lightning fit and the plain torch loop, 1 rank, 2 interleaved
    # rounds of 2 steps) and memory (fsdp2 vs Lightning ddp on 2 ranks) in one invocation.
    proc = run_python(
        ["benchmarks/run.py", "fsdp", "memory", "--quick", "--contenders", "fsdp2", "torch_fsdp2", "lightning_ddp",
         "--out-dir", str(tmp_path)],
        timeout=900,
    )
    assert "fsdp2/torch_fsdp2" in proc.stdout and "fsdp2/lightning_ddp" in proc.stdout

    fsdp = json.loads(_one("fsdp-*.json", tmp_path).read_text())
    assert fsdp["suite"] == "fsdp" and fsdp["device"] and fsdp["device_name"]
    assert fsdp["host_cpu_count"] == os.cpu_count() and fsdp["host_load_at_start"] >= 0  # how busy the host was
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
        assert len(rec["samples_s"]) == 2 and all(len(s) == 2 and _positive_floats(s) for s in rec["samples_s"])
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
    assert ratio["target"] == 1.03 and ratio["met"] == (ratio["value"] <= 1.03)
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
