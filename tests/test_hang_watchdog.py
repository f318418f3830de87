"""``HangWatchdog``: a rank that stops is noticed within ``timeout_s``, named, and every rank exits 81 (issue
39).

Real processes (2 ranks, torchrun, gloo; ``tests/workers/hang_train.py``): under ``fsdp2`` rank 1 sleeps
forever inside ``training_step`` at step 5; under ``hsdp`` rank 1's dataset never returns an item at step 5 (a
stuck data loader). Before that, every rank's first step and the checkpoint save at step 2 each take longer
than ``timeout_s`` -- the watchdog must not call either a hang (its warm-up and checkpoint limits). Checked:
the job ends within ``timeout_s`` + 30 s of the hang's start; torchrun reports exit status 81 for every rank;
exactly one report line, naming rank 1 (and only rank 1) as stuck, at step 5, in the right phase; every rank
wrote its stacks file, rank 1's holding the sleeping frame; the checkpoints before the hang were written."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from conftest import WORKERS, run_torchrun
from fsdp_strategies._options import OptionError
from fsdp_strategies.callbacks import HangWatchdog
from fsdp_strategies.callbacks.hang_watchdog import HANG_EXIT_CODE, PHASES, culprit_report

WORKER = WORKERS / "hang_train.py"
TIMEOUT_S = 8.0


def _rec(batch: int, phase: str, sub: int = 0, step: int = 5) -> dict:
    return {"batch": batch, "phase": PHASES.index(phase), "sub": sub, "step": step, "host": "n1"}


def test_the_report_names_the_rank_furthest_behind_and_where_the_others_wait() -> None:
    culprits, line = culprit_report(
        {0: _rec(5, "backward"), 1: _rec(5, "forward", 1), 2: _rec(5, "backward"), 3: _rec(5, "backward")},
        61.2,
    )
    assert culprits == [1], line
    assert line == (
        "hang: rank 1 (host n1) stuck in forward at step 5 (unit 1); ranks 0,2,3 wait in backward at "
        "step 5 (unit 0) (no progress for 61 s)"
    )
    culprits, line = culprit_report({0: _rec(6, "data", step=6), 1: _rec(5, "optimizer")}, 9)
    assert culprits == [1] and "rank 0 waits in data at step 6" in line, line
    culprits, line = culprit_report({0: _rec(5, "forward", 2), 1: _rec(5, "forward", 2)}, 9)
    assert culprits == [] and "the same point" in line and "ranks 0,1 all stand in forward" in line, line


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"timeout_s": 0}, "timeout_s=0"),
        ({"action": "kill"}, "action='kill'"),
        ({"poll_s": -1}, "poll_s=-1"),
        ({"flight_recorder": -5}, "flight_recorder=-5"),
    ],
)
def test_bad_options_name_the_option_value_and_fix(kwargs: dict, named: str) -> None:
    with pytest.raises(OptionError, match=re.escape(named)) as err:
        HangWatchdog(**kwargs)
    assert "Fix:" in str(err.value)


def _run(tmp_path: Path, strategy: str, hang: str) -> tuple[str, Path, float, float]:
    stacks = tmp_path / "hang"
    t0 = time.time()
    proc = run_torchrun(
        WORKER,
        2,
        [
            "--strategy",
            strategy,
            "--hang",
            hang,
            "--hang-rank",
            "1",
            "--hang-step",
            "5",
            "--timeout",
            str(TIMEOUT_S),
            "--slow-first-step",
            str(TIMEOUT_S + 4),
            "--slow-save",
            str(TIMEOUT_S + 4),
            "--stacks",
            str(stacks),
        ],
        timeout=240,
        check=False,
    )
    ended = time.time()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    # torchrun's summary: one "exitcode : N" per failed rank
    assert sorted(re.findall(r"exitcode\s+:\s+(-?\d+)", out)) == [str(HANG_EXIT_CODE)] * 2, out[-4000:]
    began = float((stacks / "hang-began").read_text())
    assert t0 < began and ended - began < TIMEOUT_S + 30, (began - t0, ended - began)
    return out, stacks, began, ended


def _one_report(out: str) -> str:
    reports = [
        line.split("]:", 1)[-1].strip()
        for line in out.splitlines()
        if "hang: " in line and "(no progress for" in line and "HangWatchdog" not in line
    ]
    assert len(reports) == 1, out[-4000:]
    return reports[0]


@pytest.mark.multiprocess
def test_fsdp2_rank_asleep_in_training_step_is_named_and_every_rank_exits_81(tmp_path: Path) -> None:
    out, stacks, _, _ = _run(tmp_path, "fsdp2", "training_step")
    report = _one_report(out)
    assert report.startswith("hang: rank 1 (host ") and "stuck in forward at step 5 (unit 0)" in report, (
        report
    )
    assert "rank 0 waits in forward at step 5 (unit 1)" in report, (
        report
    )  # in the first FSDP unit's all-gather
    assert "rank 0 (host" not in report, report
    assert "sleep_forever_in_training_step" in (stacks / "rank1-stacks.txt").read_text()
    assert "sleep_forever" not in (stacks / "rank0-stacks.txt").read_text()
    # the slow first step and the slow save at step 2 (both > timeout_s) passed; steps 2 and 4 were saved
    assert sorted(p.name for p in (stacks / "ckpt").iterdir()) == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
    ]
    trace = json.loads((stacks / "rank0-flight-recorder.json").read_text())  # torch's flight recorder, gloo's
    assert any(e["profiling_name"].startswith("gloo:") for e in trace["entries"]), trace["entries"][-3:]


@pytest.mark.multiprocess
def test_hsdp_rank_stuck_in_its_data_loader_is_named_and_every_rank_exits_81(tmp_path: Path) -> None:
    out, stacks, _, _ = _run(tmp_path, "hsdp", "data")
    report = _one_report(out)
    assert report.startswith("hang: rank 1 (host ") and "stuck in data at step 5" in report, report
    assert "rank 0 waits in backward at step 5" in report, report  # the replicas' gradient all-reduce
    assert "sleep_forever_in_getitem" in (stacks / "rank1-stacks.txt").read_text()
