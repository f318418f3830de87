"""StragglerDetector: scoring logic alone, then injected stragglers in real multi-process runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import yaml

from conftest import ROOT, WORKERS, run_python
from fsdp_strategies.callbacks import StragglerDetector
from fsdp_strategies.callbacks.straggler_scoring import StragglerScorer
from fsdp_strategies.testing import StallInjector, StragglerInjection

WORKER = str(WORKERS / "straggler_train.py")


def _window(rng: np.random.Generator, ranks: int, steps: int, base: float, slow: dict[int, float]) -> tuple:
    """One window of per-step self times with 10% jitter; ``slow`` adds seconds to chosen (rank, every
    step)."""
    self_steps = base * (1 + 0.1 * rng.random((ranks, steps)))
    for r, extra in slow.items():
        self_steps[r] += extra
    n = np.full(ranks, steps, dtype=float)
    header = np.stack([n, 0.2 * self_steps.sum(1), 0.7 * self_steps.sum(1), 0.1 * self_steps.sum(1),
                       self_steps.sum(1), self_steps.sum(1), np.zeros(ranks), np.zeros(ranks)], axis=1)
    return header, self_steps


# ---------------------------------------------------------------------- no processes
def test_scorer_hysteresis_transients_and_clearing() -> None:
    rng = np.random.default_rng(0)
    scorer = StragglerScorer(world_size=4, threshold=1.5, patience=3)
    flagged_at = None
    for w in range(8):  # rank 2 three times slower from window 2 on
        res = scorer.update(*_window(rng, 4, 10, 0.05, {2: 0.1} if w >= 2 else {}), step=10 * (w + 1))
        if res["newly_persistent"]:
            assert res["newly_persistent"] == [2]
            flagged_at = w
    assert flagged_at == 2 + 3 - 1  # after exactly `patience` slow windows
    assert scorer.tracks[2].persistent and not any(
        t.persistent for i, t in enumerate(scorer.tracks) if i != 2
    )
    for _ in range(2):  # normal again: still flagged for patience - 1 windows, then cleared
        res = scorer.update(*_window(rng, 4, 10, 0.05, {}), step=0)
        assert res["cleared"] == []
    assert scorer.update(*_window(rng, 4, 10, 0.05, {}), step=0)["cleared"] == [2]
    # single-step stalls: counted, never persistent
    scorer = StragglerScorer(world_size=2, threshold=1.5, patience=2)
    for _ in range(6):
        header, steps = _window(rng, 2, 10, 0.05, {})
        steps[1, 3] += 1.0
        header[1, 5] += 1.0
        scorer.update(header, steps, step=0)
    assert scorer.tracks[1].stalls == 6 and scorer.tracks[0].stalls == 0
    assert not scorer.tracks[1].persistent and scorer.tracks[1].slow_windows == 0
    assert scorer.lost_s == pytest.approx(6.0, rel=0.05)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"threshold": 1.0}, "threshold=1.0"),
    ({"action": "kill"}, "action='kill'"),
    ({"window": 1}, "window=1"),
])
def test_bad_options_fail_early(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=r"Fix|must") as info:
        StragglerDetector(**kwargs)
    assert needle in str(info.value)


def test_bad_injection_fails_early() -> None:
    with pytest.raises(ValueError, match=r"Fix|must") as info:
        StallInjector({"ranks": [1], "probability": 2.0})
    assert "inject.probability=2.0" in str(info.value)


def test_inject_is_no_detector_option_any_more() -> None:
    # stalls come from the separate StallInjector callback; the removed option is named, in Python and in YAML
    with pytest.raises(TypeError, match="inject"):
        StragglerDetector(inject=StragglerInjection(ranks=[1], delay_s=0.1))  # type: ignore[call-arg]
    from jsonargparse import ArgumentError, ArgumentParser
    from lightning.pytorch.callbacks import Callback

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--callbacks", type=list[Callback])
    old = [
        {"class_path": "fsdp_strategies.callbacks.StragglerDetector", "init_args": {"inject": {"ranks": [1]}}}
    ]
    with pytest.raises(ArgumentError, match="inject"):
        parser.parse_args(["--callbacks", json.dumps(old)])


def test_stall_injector_must_come_before_the_detector() -> None:
    # a stall at batch start must end before the detector starts timing the step (its own time, not compute)
    injector, detector = StallInjector(StragglerInjection(ranks=[1], delay_s=0.1)), StragglerDetector()
    trainer = SimpleNamespace(callbacks=[detector, injector], global_rank=0)
    with pytest.raises(ValueError, match=r"StallInjector is listed after StragglerDetector.*Fix: list "
                                         r"fsdp_strategies.testing.StallInjector before"):
        injector.setup(trainer, None, "fit")  # type: ignore[arg-type]
    trainer.callbacks = [injector, detector]
    injector.setup(trainer, None, "fit")  # type: ignore[arg-type]


def test_actions_check_the_strategy_at_setup() -> None:
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=SimpleNamespace(type="cpu")), world_size=1,
                              global_rank=0)
    with pytest.raises(ValueError, match=r"action=.evict. needs .*leave_quorum.*Fix"):
        StragglerDetector(action="evict").setup(trainer, None, "fit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="action='hierarchical_sgd' needs the ddp_hooks strategy"):
        StragglerDetector(action="hierarchical_sgd").setup(trainer, None, "fit")  # type: ignore[arg-type]


def test_evict_makes_every_rank_of_the_group_leave_the_quorum(tmp_path: Path) -> None:
    # every rank of the group scores the same gathered window, so all of them leave at the same step
    calls: dict[int, list[str]] = {0: [], 1: []}
    for rank in (0, 1):
        strategy = SimpleNamespace(root_device=SimpleNamespace(type="cpu"),
                                   leave_quorum=lambda reason, rank=rank: calls[rank].append(reason))
        trainer = SimpleNamespace(strategy=strategy, world_size=1, global_rank=rank, log_dir=str(tmp_path),
                                  is_global_zero=rank == 0, global_step=9)
        det = StragglerDetector(action="evict", window=4)
        det.setup(trainer, None, "fit")  # type: ignore[arg-type]
        det.hosts = ["a", "b"]
        det.scorer = StragglerScorer(world_size=2, patience=1)
        rng = np.random.default_rng(1)
        result = det.scorer.update(*_window(rng, 2, 4, 0.05, {1: 0.2}), step=8)
        det.history.append(result)
        det._act(trainer, result)  # type: ignore[arg-type]
        assert det.events[-1] == {"step": 8, "event": "evict", "ranks": [1], "left_at_step": 9}
        det._act(trainer, {**result, "newly_persistent": []})  # type: ignore[arg-type]  # no new straggler
    assert (
        calls[0] == calls[1]
        and len(calls[1]) == 1
        and "rank 1 on b" in calls[1][0]
        and "step 9" in calls[0][0]
    )
    # rank 0 wrote the report before leaving (the process ends inside leave_quorum)
    assert json.loads((tmp_path / "straggler_report.json").read_text())["events"][-1]["event"] == "evict"


def test_a_step_is_an_optimizer_step_under_accumulation(tmp_path: Path) -> None:
    """``accumulate_grad_batches=4``: windows, ``skip_first`` and the step times count optimizer steps (all 4
    micro-batches), so a window ends only between optimizer steps and a 0.05 s stall before every micro-batch
    adds >= 0.2 s to each step's data time. Before the fix a step was a micro-batch: windows of 2
    micro-batches (scored at global steps 0, 1, 1, 2, ...) and step times of one micro-batch."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    detector = StragglerDetector(window=2, skip_first=1, report_path=str(tmp_path / "report.json"))
    stall = StallInjector(StragglerInjection(ranks=[0], delay_s=0.05))  # every micro-batch of every step
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=7, accumulate_grad_batches=4, logger=False,
                         callbacks=[stall, detector], enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=False, limit_val_batches=0, default_root_dir=str(tmp_path))
    trainer.fit(BoringModel())
    windows = json.loads((tmp_path / "report.json").read_text())["windows"]
    assert [w["step"] for w in windows] == [2, 4, 6]  # after optimizer steps 2, 4, 6 (step 1 skipped)
    for w in windows:
        assert w["data"][0] >= 4 * 0.05 and w["step_median"] >= 4 * 0.05, w
        assert w["step_median"] == pytest.approx(w["data"][0] + w["compute"][0] + w["optimizer"][0], rel=1e-6)


# ---------------------------------------------------------------------- 2 ranks
@pytest.mark.multiprocess
def test_two_ranks_clean_transient_persistent_and_stop(tmp_path: Path) -> None:
    proc = run_python([WORKER, "--out", str(tmp_path), "--devices", "2", "--steps", "24",
                       "--runs", "clean,transient,persistent,stop"], check=False, timeout=400)
    report = {
        n: json.loads((tmp_path / f"{n}.json").read_text()) for n in ("transient", "persistent", "stop")
    }
    # default report location: the trainer's log_dir (here its default_root_dir), resolved on every rank
    report["clean"] = json.loads((tmp_path / "clean" / "straggler_report.json").read_text())
    window, patience = 6, 2
    # no false positives on a clean run (Lightning's own ddp)
    assert report["clean"]["persistent"] == [] and report["clean"]["events"] == []
    assert len(report["clean"]["windows"]) == 4
    # a 2-step burst on rank 1: counted as stalls, not called persistent
    assert report["transient"]["persistent"] == [] and report["transient"]["slow_windows"][1] == 0
    assert report["transient"]["stalls"][1] >= 2
    # persistent 0.15 s on rank 1: named within `patience` windows, with its host
    rep = report["persistent"]
    assert rep["persistent"] == [1] and rep["first_flagged_step"][0] is None
    assert rep["first_flagged_step"][1] <= patience * window
    assert rep["events"][0]["rank"] == 1 and rep["events"][0]["host"] == rep["hosts"][1]
    assert rep["windows"][-1]["worst"][0]["rank"] == 1
    assert rep["lost_s"] > 0.5  # ~0.15 s per measured step
    # a rank burning extra compute under fsdp2, action stop: checkpoint, hosts file, exit code
    assert proc.returncode == 3, proc.stderr[-3000:]
    stop = report["stop"]
    assert stop["persistent"] == [1] and stop["events"][-1]["event"] == "stop"
    assert (tmp_path / "stop_hosts.txt").read_text().split() == [stop["hosts"][1]]
    assert (tmp_path / "straggler_stop.ckpt").exists()


# ---------------------------------------------------------------------- 4 ranks
@pytest.mark.multiprocess
def test_four_ranks_detects_and_switches_hierarchical_sgd_from_yaml(tmp_path: Path) -> None:
    # configs/straggler.yaml + its demo overlay (examples/straggler_demo_stall.yaml: rank 1 made slow), with a
    # shorter window and the stall ending at step 14: callbacks are a list, so the overrides go into a copy of
    # the file (a command-line override would reach only the list's last entry)
    config = yaml.safe_load((ROOT / "configs" / "straggler.yaml").read_text())
    overlay = yaml.safe_load((ROOT / "examples" / "straggler_demo_stall.yaml").read_text())
    (shipped,) = config["trainer"]["callbacks"]  # the shipped config: the detector alone, no test helper
    assert overlay["trainer"]["callbacks"][1] == shipped, (
        "the demo overlay's detector differs from the config's"
    )
    config["trainer"]["callbacks"] = overlay["trainer"]["callbacks"]
    injector, detector = config["trainer"]["callbacks"]
    assert injector["class_path"] == "fsdp_strategies.testing.StallInjector"
    assert detector["class_path"] == "fsdp_strategies.callbacks.StragglerDetector"
    # a 2-core CPU shared by 4 ranks (and whatever else runs) has ~50 ms of scheduling jitter per
    # step: a 0.3 s straggler and a 0.1 s noise floor keep the test about detection, not load
    injector["init_args"]["inject"].update(end_step=14, delay_s=0.3)
    detector["init_args"].update(window=4, min_excess_s=0.1, switch_threshold=0.2)
    (tmp_path / "straggler.yaml").write_text(yaml.safe_dump(config))
    extra = (f"--trainer.max_steps 28 --trainer.limit_val_batches 0 --trainer.enable_checkpointing false "
             f"--trainer.enable_progress_bar false --trainer.logger lightning.pytorch.loggers.CSVLogger "
             f"--trainer.logger.save_dir {tmp_path} --trainer.logger.name csv --trainer.log_every_n_steps 1 "
             "--trainer.default_root_dir " + str(tmp_path) + " "
             "--model.dim 64 --model.max_seq_len 32 --model.vocab_size "
             "64 --data.vocab_size 64 --data.seq_len 32 "
             "--data.num_train 1024")
    run_python([WORKER, "--out", str(tmp_path), "--devices", "4", "--runs",
                f"cli:{tmp_path / 'straggler.yaml'}", "--cli-extra", extra], timeout=500)
    rep = json.loads((tmp_path / "straggler.json").read_text())
    assert rep["window"] == 4 and len(rep["hosts"]) == 4
    assert rep["persistent"] == []  # cleared after the injection ended at step 14
    flagged = [e for e in rep["events"] if e["event"] == "persistent"]
    assert [e["rank"] for e in flagged] == [1] and flagged[0]["step"] <= 2 * 4
    kinds = [e["event"] for e in rep["events"] if e["event"].startswith("local_sgd")]
    assert kinds == ["local_sgd_on", "local_sgd_off"], rep["events"]
    on = next(e["step"] for e in rep["events"] if e["event"] == "local_sgd_on")
    off = next(e["step"] for e in rep["events"] if e["event"] == "local_sgd_off")
    assert on <= 12 and 16 < off <= 28
    extra_info = json.loads((tmp_path / "straggler.extra.json").read_text())
    assert extra_info == {"global_step": 28, "local_sgd_enabled_at_end": False}
    # logged through the Trainer's logger
    rows = list(csv.DictReader((tmp_path / "csv" / "version_0" / "metrics.csv").open()))
    logged = [r for r in rows if r.get("straggler/step_time_max")]
    windows = list(dict.fromkeys(r["straggler/step_time_max"] for r in logged))  # one value per window
    assert len(windows) == 7
    first = {r["straggler/step_time_max"]: r for r in logged}
    assert [first[w]["straggler/worst1_rank"] for w in windows[:3]] == ["1.0"] * 3


def test_injection_is_a_typed_dataclass() -> None:
    inj = StragglerInjection(ranks=[1], delay_s=0.1)
    assert StallInjector(inj).inject is inj
    assert StallInjector({"ranks": [1], "delay_s": 0.1}).inject == inj
    with pytest.raises(ValueError, match="end_step"):
        StragglerInjection(start_step=5, end_step=5)
