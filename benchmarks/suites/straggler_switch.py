"""straggler_switch suite: ``ft_hsdp(straggler_sync: diloco)`` vs staying synchronous with one persistently slow
replica group. 4 replica groups x 1 rank (``fsdp-strategies-ft``), a tiny Llama, contenders interleaved.

    python benchmarks/suites/straggler_switch.py              # 4 groups, 160 steps, 2 rounds (~10 min, 2 cores)
    python benchmarks/suites/straggler_switch.py --quick      # 64 steps, 1 round
    python benchmarks/run.py straggler_switch

The slow group is modelled as a slow LINK (``fsdp_strategies.testing.SlowLinkInjector``, ``$FSDP_STRATEGIES_SLOW_LINK``):
every cross-group all-reduce of group 3 sleeps ``--seconds-per-mb`` per MB it sends, for the whole run, so the other
groups wait for it inside the all-reduce (every step under every-step reduction; once per outer sync in rounds).
The CPU is free while the link is slow, as on separate machines.

Contenders (same model, data, optimizer, number of committed steps):
  sync_slow      ``configs/ft_hsdp.yaml`` (``sync: every_step``, asynchronous quorum) with the slow link
  switched_slow  ``configs/ft_hsdp_straggler_sync.yaml`` (``straggler_sync: diloco``, ``sync_every: 8``) with
                 ``StragglerDetector(action: semi_sync, window: 8, switch_threshold: 0.3, patience: 2)`` and the slow
                 link: it starts every-step and switches to DiLoCo once the detector's cost exceeds the threshold
                 (the switch's own cost -- the slow synchronous steps before it -- is included)
  sync_clean     ``sync_slow`` without the slow link (the reference)
Measured: throughput = committed steps x global batch / seconds, from the first committed step of any group to the
last (events files), and the step at which ``switched_slow`` switched. Target: switched_slow / sync_slow >= 1.5.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

ROOT = common.ROOT
SUITE = "straggler_switch"
CONTENDERS = ("sync_slow", "switched_slow", "sync_clean")
GROUPS = 4
BATCH = 2
MODEL = ["--model.vocab_size", "64", "--data.vocab_size", "64", "--model.dim", "64", "--model.n_layers", "2",
         "--model.n_heads", "4", "--model.max_seq_len", "32", "--data.seq_len", "32", "--data.batch_size", str(BATCH)]


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _run_one(work: Path, name: str, steps: int, seconds_per_mb: float, timeout: float) -> dict[str, Any]:
    from fsdp_strategies.ft.launcher import run as ft_run

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    switched = name == "switched_slow"
    callbacks: list[dict[str, Any]] = [{"class_path": "fsdp_strategies.testing.SlowLinkInjector"}]
    if switched:
        callbacks.insert(0, {"class_path": "fsdp_strategies.callbacks.StragglerDetector", "init_args": {
            "window": 8, "skip_first": 2, "action": "semi_sync", "switch_threshold": 0.3, "patience": 2,
            "report_path": str(work / "straggler_{replica_group_id}.json")}})
    override = work / "callbacks.yaml"
    override.write_text(json.dumps({"trainer": {"callbacks": callbacks}}))  # JSON is YAML
    config = "ft_hsdp_straggler_sync.yaml" if switched else "ft_hsdp.yaml"
    command = [str(ROOT / "examples" / "train_llama.py"), "fit", "--config", str(ROOT / "configs" / config),
               "--config", str(override), "--trainer.devices", "1", "--trainer.logger", "false",
               "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
               "--trainer.enable_model_summary", "false", "--trainer.enable_checkpointing", "false",
               "--trainer.max_steps", str(steps), "--trainer.strategy.init_args.timeout_s", "30",
               "--data.num_train", str(BATCH * GROUPS * 64), "--data.num_val", "8", *MODEL]
    link = {"groups": [GROUPS - 1], "seconds_per_mb": seconds_per_mb if name != "sync_clean" else 0.0}
    events = work / "events"
    result = ft_run(command, groups=GROUPS, ranks_per_group=1, min_replicas=GROUPS, heartbeat_timeout_ms=5000,
                    join_timeout_ms=60000, quorum_tick_ms=10, max_restarts=0, events_dir=events, timeout=timeout,
                    env={"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "examples")]),
                         "OMP_NUM_THREADS": "1", "FSDP_STRATEGIES_SLOW_LINK": json.dumps(link)})
    if result.returncode != 0:
        raise RuntimeError(f"{name}: fsdp-strategies-ft exited {result.returncode} (logs in {events})")
    timelines = {g: _read(events / f"group{g}.jsonl") for g in range(GROUPS)}
    points = [(r["t"], r["step"]) for tl in timelines.values() for r in tl if r.get("committed")]
    t0, t1 = min(t for t, _ in points), max(t for t, _ in points)
    s0, s1 = min(s for _, s in points), max(s for _, s in points)
    switches = [{"to": r["switch"], "step": r["switch_step"], "cost": r["cost"]} for r in timelines[0] if "switch" in r]
    return {"steps": s1 - s0, "seconds": t1 - t0, "samples_per_s": (s1 - s0) * BATCH * GROUPS / (t1 - t0),
            "wall_s": result.wall_s, "switches": switches, "final_step": s1}


def run(quick: bool, out_dir: Path, steps: int | None = None, reps: int | None = None,
        contenders: list[str] | None = None, seconds_per_mb: float | None = None, **_: Any) -> dict[str, Any]:
    steps = common.pick(steps, quick, 64, 160)
    reps = common.pick(reps, quick, 1, 2)
    seconds_per_mb = common.pick(seconds_per_mb, quick, 1.0, 1.0)
    names = [n for n in CONTENDERS if not contenders or n in contenders]
    work = Path(out_dir) / f"{SUITE}-work"
    bar = common.progress(len(names) * reps, SUITE)
    rounds = common.interleave(names, reps, lambda name, rep: _run_one(work / f"{name}-{rep}", name, steps,
                                                                        seconds_per_mb, 900.0), bar)
    bar.close()
    figures: dict[str, Any] = {}
    for name in names:
        ok = [r for r in rounds[name] if isinstance(r, dict)]
        figures[name] = {"samples_per_s": [r["samples_per_s"] for r in ok],
                         "median_samples_per_s": statistics.median(r["samples_per_s"] for r in ok) if ok else None,
                         "switches": [r["switches"] for r in ok], "runs": ok}
    summary: list[dict[str, Any]] = []
    if "switched_slow" in names and "sync_slow" in names:
        ratio = common.paired_ratio([r["samples_per_s"] if isinstance(r, dict) else None for r in rounds["switched_slow"]],
                                    [r["samples_per_s"] if isinstance(r, dict) else None for r in rounds["sync_slow"]])
        figures["switched_vs_sync"] = ratio
        if ratio.get("value") is not None:
            summary.append({"ratio": "switched_slow / sync_slow throughput", "value": ratio["value"],
                            "met": ratio["value"] >= 1.5, "rounds": ratio["rounds_paired"]})
    if "sync_clean" in names and "sync_slow" in names:
        a, b = figures["sync_slow"]["median_samples_per_s"], figures["sync_clean"]["median_samples_per_s"]
        if a and b:
            summary.append({"ratio": "sync_slow / sync_clean throughput", "value": a / b, "met": None})
    config = {"groups": GROUPS, "ranks_per_group": 1, "steps": steps, "reps": reps, "batch_per_rank": BATCH,
              "slow_link": {"group": GROUPS - 1, "seconds_per_mb": seconds_per_mb}, "model": MODEL, "quick": quick,
              "switch": {"sync_every": 8, "window": 8, "switch_threshold": 0.3, "patience": 2}}
    result = {**common.header(SUITE, config), "figures": figures, "summary": summary,
              "failures": rounds.failures}
    result["png_path"] = str(_plot(figures, names, Path(out_dir) / f"{SUITE}-{common.device_slug()}.png"))
    result["json_path"] = str(common.write_result(SUITE, result, Path(out_dir)))
    shutil.rmtree(work, ignore_errors=True)
    return result


def _plot(figures: dict[str, Any], names: list[str], path: Path) -> Path:
    plt = common._pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    common.bars_with_points(ax, names, [figures[n]["median_samples_per_s"] for n in names],
                            [figures[n]["samples_per_s"] for n in names], ["#c44", "#4a4", "#888"][: len(names)],
                            ylabel="committed samples / s")
    ax.set_title(f"{GROUPS} replica groups, group {GROUPS - 1} on a slow link")
    return common.save_figure(fig, path)


def _add_options(parser: Any) -> None:
    parser.add_argument("--seconds-per-mb", type=float, default=None, help="slow link: seconds per MB sent")


if __name__ == "__main__":
    common.suite_main(run, (__doc__ or "").split("\n\n")[0], add_options=_add_options)
