"""straggler_switch suite: ``ft_hsdp(straggler_sync: diloco)`` vs staying synchronous with one replica group
behind a slow link. 4 replica groups x 1 rank on separate network-namespace hosts, a tiny Llama, contenders
interleaved. Needs root (``tests/support/netns.py``).

    python benchmarks/suites/straggler_switch.py          # 4 groups, 160 steps, 2 rounds (~10 min, 2 cores)
    python benchmarks/suites/straggler_switch.py --quick  # 64 steps, 1 round
    python benchmarks/run.py straggler_switch

The slow group is a slow LINK, for real: the lighthouse runs on host 0 and group g on host g+1 (own addresses
on a bridge); group 3's host link is shaped with ``tbf`` to ``--rate-mbit`` (default 10 Mbit/s) in each
direction, so every cross-group all-reduce waits for the bytes group 3 sends and receives (every step under
every-step reduction; once per outer sync in rounds). The jobs are run by ``benchmarks/suites/slow_link.py``'s
``run_job`` (which also compares the sync modes on a 2-group link).

Contenders (same model, data, optimizer, number of committed steps; the shipped configs, one rank per group):
  sync_slow      ``configs/ft_hsdp.yaml`` (``sync: every_step``) with the slow link
  switched_slow  ``configs/ft_hsdp_straggler_sync.yaml`` as shipped (``straggler_sync: diloco``,
                 ``sync_every: 8``,
                 ``StragglerDetector(action: semi_sync, window: 8, switch_threshold: 0.3, patience: 2)``) with
                 the slow link: it starts every-step and switches to DiLoCo once the detector's cost exceeds
                 the threshold (the switch's own cost -- the slow synchronous steps before it -- is included)
  sync_clean     ``sync_slow`` without the shaping (the reference)
Measured: throughput = committed steps x global batch / seconds, from the first committed step of any group to
the last (events files), bytes each host sent per committed step, and the step at which ``switched_slow``
switched. Target: switched_slow / sync_slow >= 1.5.
"""

from __future__ import annotations

import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import slow_link

import common

SUITE = "straggler_switch"
CONTENDERS = ("sync_slow", "switched_slow", "sync_clean")
CONFIGS = {
    "sync_slow": "ft_hsdp.yaml",
    "switched_slow": "ft_hsdp_straggler_sync.yaml",
    "sync_clean": "ft_hsdp.yaml",
}
GROUPS = 4
BATCH = slow_link.BATCH
MODEL = slow_link.MODEL


def run(quick: bool, out_dir: Path, steps: int | None = None, reps: int | None = None,
        contenders: list[str] | None = None, rate_mbit: float | None = None, **_: Any) -> dict[str, Any]:
    reason = slow_link.netns.unavailable()
    if reason:
        raise SystemExit(f"{SUITE}: network-namespace hosts cannot be built here: {reason}")
    steps = common.pick(steps, quick, 64, 160)
    reps = common.pick(reps, quick, 1, 2)
    rate_mbit = common.pick(rate_mbit, quick, 10.0, 10.0)
    names = [n for n in CONTENDERS if not contenders or n in contenders]
    work = Path(out_dir) / f"{SUITE}-work"
    bar = common.progress(len(names) * reps, SUITE)
    with slow_link.netns.Hosts(GROUPS + 1) as hosts:
        rounds = common.interleave(names, reps, lambda name, rep: slow_link.run_job(
            hosts, work / f"{name}-{rep}", CONFIGS[name], steps, None if name == "sync_clean" else rate_mbit,
            900.0, groups=GROUPS, name=name), bar)
    bar.close()
    figures: dict[str, Any] = {}
    for name in names:
        ok = [r for r in rounds[name] if isinstance(r, dict)]
        figures[name] = {"samples_per_s": [r["samples_per_s"] for r in ok],
                         "median_samples_per_s": statistics.median(r["samples_per_s"] for r in ok)
                             if ok else None,
                         "bytes_per_step": [statistics.fmean(r["bytes_sent_per_step"].values()) for r in ok],
                         "switches": [r["switches"] for r in ok],
                         "runs": [{k: v for k, v in r.items() if k != "losses_group0"} for r in ok]}
    summary: list[dict[str, Any]] = []
    if "switched_slow" in names and "sync_slow" in names:
        ratio = common.paired_ratio(
            [r["samples_per_s"] if isinstance(r, dict) else None for r in rounds["switched_slow"]],
            [r["samples_per_s"] if isinstance(r, dict) else None for r in rounds["sync_slow"]],
        )
        figures["switched_vs_sync"] = ratio
        if ratio.get("value") is not None:
            summary.append({"ratio": "switched_slow / sync_slow throughput", "value": ratio["value"],
                            "met": ratio["value"] >= 1.5, "rounds": ratio["rounds_paired"]})
    if "sync_clean" in names and "sync_slow" in names:
        a, b = figures["sync_slow"]["median_samples_per_s"], figures["sync_clean"]["median_samples_per_s"]
        if a and b:
            summary.append({"ratio": "sync_slow / sync_clean throughput", "value": a / b, "met": None})
    config = {"groups": GROUPS, "ranks_per_group": 1, "steps": steps, "reps": reps, "batch_per_rank": BATCH,
              "slow_link": {"group": GROUPS - 1, "qdisc": "tbf", "rate_mbit": rate_mbit,
                            "directions": "both"},
              "layout": "lighthouse on host 0, group g on host g+1 (network namespaces on a bridge)",
              "configs": CONFIGS, "model": MODEL, "quick": quick,
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
                            [figures[n]["samples_per_s"] for n in names],
                            ["#c44", "#4a4", "#888"][: len(names)], ylabel="committed samples / s")
    ax.set_title(f"{GROUPS} replica groups on separate hosts, group {GROUPS - 1}'s link tbf-shaped")
    return common.save_figure(fig, path)


def _add_options(parser: Any) -> None:
    parser.add_argument(
        "--rate-mbit", type=float, default=None, help="the slow link's rate (Mbit/s, default 10)"
    )


if __name__ == "__main__":
    common.suite_main(run, (__doc__ or "").split("\n\n")[0], add_options=_add_options)
