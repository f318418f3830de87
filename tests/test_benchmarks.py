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

from conftest import ROOT, WORKERS, run_python

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

    out = common.interleave(["A", "B", "C"], 2, run_one, retries=1)
    # C fails in every attempt: each round is run twice (1 retry), A B C as a whole, then left incomplete
    assert calls == [("A", 0), ("B", 0), ("C", 0)] * 2 + [("A", 1), ("B", 1), ("C", 1)] * 2
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


def test_a_failed_round_is_rerun_so_contenders_stay_paired(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
                        lambda script, nproc, args, out: [sys.executable, str(script), *args, "--out", str(out)])
    contenders = [common.Contender(n, str(fake), "torch", f"fake {n}") for n in ("steady", "flaky", "broken")]
    specs = [common.RatioSpec("flaky", "steady", 2.5), common.RatioSpec("broken", "steady", 1.0)]
    result = common.run_timing_suite("fake", contenders[:2], specs[:1], sizes=["tiny"], ranks=[1], reps=2, steps=2,
                                     warmup=1, precision="32-true", out_dir=tmp_path, quick=True, show_progress=False)
    assert log.read_text().split("\n")[:-1] == ["steady 0", "flaky 0", "steady 1", "flaky 1", "steady 1", "flaky 1"]
    saved = json.loads(Path(result["json_path"]).read_text())
    [case] = saved["cases"]
    for name in ("steady", "flaky"):
        assert len(case["contenders"][name]["rep_medians_s"]) == 2 and case["contenders"][name]["errors"] == []
    ratio = case["ratios"]["flaky/steady"]
    assert ratio["per_round"] == pytest.approx([2.0, 2.0]) and ratio["rounds_paired"] == 2 and ratio["met"] is True
    [failure] = case["failures"]
    assert (failure["contender"], failure["round"], failure["attempt"], failure["returncode"], failure["outcome"]) == (
        "flaky", 1, 0, 134, "round re-run")
    assert failure["stderr_tail"][-1] == "terminate called without an active exception"
    table = common.format_summary(saved)
    assert "[2/2 rounds]" in table and "FAILED, round re-run: size=tiny ranks=1 flaky round 2 try 1: exit 134" in table
    assert "| terminate called without an active exception" in table

    log.unlink()
    result = common.run_timing_suite("fake", [contenders[0], contenders[2]], specs[1:], sizes=["tiny"], ranks=[1],
                                     reps=1, steps=2, warmup=1, precision="32-true", out_dir=tmp_path / "b",
                                     quick=True, show_progress=False)
    assert log.read_text().split("\n")[:-1] == ["steady 0", "broken 0"] * 3  # 1 + ROUND_RETRIES attempts
    [case] = result["cases"]
    assert [f["outcome"] for f in case["failures"]] == ["round re-run", "round re-run", "round incomplete"]
    assert case["ratios"]["broken/steady"]["value"] is None and case["ratios"]["broken/steady"]["rounds_paired"] == 0
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
