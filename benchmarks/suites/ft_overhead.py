"""ft_overhead suite: what ``ft_hsdp`` costs when nothing fails, against ``hsdp`` on the same mesh, and where.

The fault-free pair of ``ft_recovery``, measured the way the timing suites measure (``common.interleave``:
rounds, the order changing every round, an A/A twin), with nothing pinned and nothing checkpointed:

* ``ft_nofault`` -- ``fsdp-strategies-ft``: 2 replica groups x R ranks (``configs/ft_hsdp.yaml``,
  ``sync: every_step``), no faults, ``--pin-cores none``;
* ``hsdp_nofault`` -- ``hsdp`` 2 x R in one torchrun job (``configs/hsdp.yaml``);
* ``hsdp_nofault_aa`` -- the same job again: the A/A pair, whose interval must hold 1.00;
* ``ft_nofault_before`` (with ``--before-src DIR`` and/or ``--before-env KEY=VALUE ...``) -- ``ft_nofault``
  with its ranks importing the package from another checkout's ``src`` (e.g. a worktree of an earlier
  commit) and/or with these environment variables set for the whole job (launcher, lighthouse and ranks; e.g.
  torchft's own runtime defaults ``RUST_LOG=info TOKIO_WORKER_THREADS=2``, which the environment lets win
  over this package's), in the same rounds: a change's effect measured side by side (the ratio
  ``ft_nofault / ft_nofault_before``), not across two runs.

Per job: the median step time over its steady steps (from step ``--warmup`` on; step times are the gaps
between rank 0's per-step records: ``ft_hsdp``'s events lines, ``hsdp``'s step log), and the CPU seconds per
step spent by each process role and thread (:mod:`cpu_roles`: ranks' main threads, ranks' other threads by
name, torchrun agents, the launcher + lighthouse process). ``ft_nofault`` also gives the median per-step cost
of each part of its fault-tolerance work (the events' ``cost_*_s``, ``quorum_s``, ``commit_s``; the
cross-group all-reduces per step and their bytes; see ``fsdp_strategies.ft.accounting.COST_PARTS``).

Ratios (each with a 95 % interval over the rounds, ``timing_stats``): ``ft_nofault / hsdp_nofault`` step time
(target <= 1/0.97 = 1.031, i.e. ``ft_hsdp`` keeps >= 97 % of ``hsdp``'s throughput) and the A/A.

    python benchmarks/suites/ft_overhead.py                   # small model, 2 x 2 ranks, 3 rounds (~12 min)
    python benchmarks/suites/ft_overhead.py --reps 5 --steps 400
    python benchmarks/suites/ft_overhead.py --quick           # tiny, 2 x 1 rank, 2 rounds
    git worktree add /tmp/before <rev> && python benchmarks/suites/ft_overhead.py --before-src /tmp/before/src
    python benchmarks/suites/ft_overhead.py --before-env RUST_LOG=info TOKIO_WORKER_THREADS=2
    python benchmarks/run.py ft_overhead
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common
import timing_stats
from cpu_roles import CpuSampler
from suites import ft_recovery

CONTENDERS = ("ft_nofault", "hsdp_nofault", "hsdp_nofault_aa")
#: ft_hsdp's step time over hsdp's: at most this (throughput >= 0.97 of hsdp's)
TARGET = 1 / 0.97
GROUPS = 2
#: the events fields of ft_hsdp's per-step costs summarised (seconds, except the counts)
COST_FIELDS = ("cost_batch_s", "cost_capture_s", "cost_quorum_start_s", "quorum_s", "cost_allreduce_s",
               "commit_s", "cost_account_s", "allreduces", "allreduce_bytes")


def step_records(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Rank 0's per-step records of a job (group 0's for ``ft_hsdp``), committed ones, in step order."""
    timeline = run["timelines"].get(0) or run["timelines"].get("0") or []
    return sorted((r for r in timeline if r.get("committed") and "t" in r), key=lambda r: r["step"])


def steady(records: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """The records from step ``warmup`` on (the first steps compile caches and fill the page cache)."""
    return [r for r in records if r["step"] >= warmup]


def step_time(records: list[dict[str, Any]]) -> float | None:
    """Median gap between consecutive records of consecutive steps (seconds per step)."""
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(records) if b["step"] == a["step"] + 1]
    return statistics.median(gaps) if len(gaps) >= 5 else None


def costs(records: list[dict[str, Any]]) -> dict[str, float]:
    """Median per step of each of :data:`COST_FIELDS` the records have."""
    return {f: statistics.median(r[f] for r in records if f in r) for f in COST_FIELDS
            if any(f in r for r in records)}


def cpu_per_step(sampler: CpuSampler, records: list[dict[str, Any]]) -> dict[str, float] | None:
    """CPU seconds per step by role over the steady records' span."""
    if len(records) < 2:
        return None
    t0, t1 = records[0]["t"], records[-1]["t"]
    spent = sampler.between(t0, t1)
    steps = records[-1]["step"] - records[0]["step"]
    return None if spent is None or steps <= 0 else {k: v / steps for k, v in spent.items()}


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in this process while within (the launcher, the lighthouse; the ranks inherit it)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_env(pairs: list[str] | None) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict; ``ValueError`` naming the bad one."""
    env: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--before-env {pair!r}: not KEY=VALUE. Fix: e.g. --before-env RUST_LOG=info")
        env[key] = value
    return env


def _job(name: str, work: Path, size: str, steps: int, ranks: int, warmup: int, heartbeat_ms: int,
         timeout: float, before_src: Path | None = None,
         before_env: dict[str, str] | None = None) -> dict[str, Any]:
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    before = name.endswith("_before")
    with _environment((before_env or {}) if before else {}), CpuSampler() as sampler:
        if name.startswith("ft"):
            run = ft_recovery._run_ft(work, size, steps, GROUPS, ranks, None, heartbeat_ms, timeout,
                                      pin_cores="none", src=before_src if before else None)
        else:
            run = ft_recovery._run_hsdp_restart(work, size, steps, GROUPS, ranks, None, 0, timeout)
    if run["returncode"] != 0:
        raise RuntimeError(f"{name} exited with {run['returncode']} (logs under {work})")
    records = steady(step_records(run), warmup)
    out = {"step_s": step_time(records), "steps_measured": len(records), "wall_s": run["wall_s"],
           "cpu_per_step": cpu_per_step(sampler, records)}
    if name.startswith("ft"):
        out["costs"] = costs(records)
    return out


def _median_of(rounds: list[Any], key: str) -> dict[str, float]:
    """Per key of the rounds' ``key`` dicts: the median over the rounds."""
    dicts = [r[key] for r in rounds if isinstance(r, dict) and r.get(key)]
    names = sorted({k for d in dicts for k in d})
    return {k: statistics.median(d[k] for d in dicts if k in d) for k in names}


def breakdown(per: dict[str, list[Any]]) -> dict[str, Any]:
    """Where ft_nofault's extra time per step goes: its timed parts, and the CPU each role spent per step
    more than in hsdp_nofault (medians over the rounds)."""
    ft_cpu = _median_of(per["ft_nofault"], "cpu_per_step")
    hsdp_cpu = _median_of(per["hsdp_nofault"], "cpu_per_step")
    ft_step = timing_stats.median(r["step_s"] for r in per["ft_nofault"] if isinstance(r, dict))
    hsdp_step = timing_stats.median(r["step_s"] for r in per["hsdp_nofault"] if isinstance(r, dict))
    return {
        "step_s": {"ft_nofault": ft_step, "hsdp_nofault": hsdp_step,
                   "extra": None if ft_step is None or hsdp_step is None else ft_step - hsdp_step},
        "ft_costs_per_step": _median_of(per["ft_nofault"], "costs"),
        **({"ft_before_costs_per_step": _median_of(per["ft_nofault_before"], "costs")}
           if "ft_nofault_before" in per else {}),
        "cpu_s_per_step": {"ft_nofault": ft_cpu, "hsdp_nofault": hsdp_cpu,
                           "extra": {k: ft_cpu.get(k, 0.0) - hsdp_cpu.get(k, 0.0)
                                     for k in sorted(set(ft_cpu) | set(hsdp_cpu))}},
    }


def _breakdown_rows(b: dict[str, Any]) -> list[dict[str, Any]]:
    """The breakdown as console rows (milliseconds per step, no verdicts)."""
    rows = [{"ratio": "ft_nofault step time minus hsdp_nofault's [ms]",
             "value": 1e3 * (b["step_s"]["extra"] or 0)}]
    rows += [{"ratio": f"ft_nofault {k} per step" + (" [ms]" if k.endswith("_s") else ""),
              "value": 1e3 * v if k.endswith("_s") else v} for k, v in b["ft_costs_per_step"].items()]
    rows += [{"ratio": f"extra CPU per step, {k} [ms]", "value": 1e3 * v}
             for k, v in b["cpu_s_per_step"]["extra"].items() if abs(v) >= 1e-4]
    return rows


def _plot(result: dict[str, Any], path: Path) -> Path:
    plt = common._pyplot()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(result["per_round"])
    meds = [result["medians_step_s"].get(n) for n in names]
    points = [[r["step_s"] for r in result["per_round"][n] if isinstance(r, dict) and r.get("step_s")]
              for n in names]
    palette = {"ft_nofault": "tab:blue", "ft_nofault_before": "tab:cyan", "hsdp_nofault": "tab:pink",
               "hsdp_nofault_aa": "tab:gray"}
    common.bars_with_points(ax0, names, meds, points, [palette[n] for n in names],
                            ylabel="median step time [s]")
    ax0.set_title("ft_hsdp vs hsdp, no faults (points: rounds)")
    extra = result["breakdown"]["cpu_s_per_step"]["extra"]
    costs = result["breakdown"]["ft_costs_per_step"]
    labels = [f"cpu {k}" for k in extra] + [f"time {k}" for k in costs if k.endswith("_s")]
    values = [1e3 * v for v in extra.values()] + [1e3 * v for k, v in costs.items() if k.endswith("_s")]
    ax1.barh(labels, values, color=["tab:blue"] * len(extra) + ["tab:orange"] * (len(values) - len(extra)))
    ax1.set_xlabel("ms per step (cpu: ft_nofault minus hsdp_nofault; time: ft_nofault's parts)")
    ax1.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    return common.save_figure(fig, path)


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, ranks: list[int] | None = None,
        reps: int | None = None, steps: int | None = None, warmup: int | None = None,
        contenders: list[str] | None = None, heartbeat_ms: int = 1000, before_src: str | None = None,
        before_env: list[str] | None = None, pool_files: list[str] | None = None,
        **_: Any) -> dict[str, Any]:
    if pool_files:
        return pool(pool_files, out_dir)
    size = common.pick(sizes, quick, ["tiny"], ["small"])[0]
    rpg = common.pick(ranks, quick, [1], [2])[0]
    reps = common.pick(reps, quick, 2, 3)
    steps = common.pick(steps, quick, 80, 260)
    warmup = common.pick(warmup, quick, 10, 30)
    names = [n for n in CONTENDERS if not contenders or n in contenders]
    before = Path(before_src).resolve() if before_src else None
    if before is not None and not (before / "fsdp_strategies" / "__init__.py").is_file():
        raise ValueError(f"--before-src {before_src}: no fsdp_strategies package there. Fix: the src "
                         "folder of another checkout (git worktree add /tmp/before <rev>; --before-src "
                         "/tmp/before/src)")
    env_before = parse_env(before_env)
    if before is not None or env_before:
        names.insert(names.index("ft_nofault") + 1 if "ft_nofault" in names else 0, "ft_nofault_before")
    work = Path(out_dir) / "ft_overhead-work"
    timeout = 600.0 if quick else 1800.0
    bar = common.progress(len(names) * reps, "ft_overhead")
    per = common.interleave(
        names, reps,
        lambda name, rep: _job(name, work / name, size, steps, rpg, warmup, heartbeat_ms, timeout, before,
                               env_before),
        bar, warm_up=not quick)
    bar.close()
    ratios, withheld, summary = _ratios(per, names)
    config = {"size": size, "groups": GROUPS, "ranks_per_group": rpg, "reps": reps, "steps": steps,
              "warmup_steps": warmup, "quick": quick, "pin_cores": "none", "checkpointing": False,
              "heartbeat_timeout_ms": heartbeat_ms, "contenders": names,
              "before_src": str(before) if before else None, "before_env": env_before or None}
    clean = {n: [r if isinstance(r, dict) else {"error": str(r)} for r in per[n]] for n in names}
    result = {**common.header("ft_overhead", config), "orders": per.orders, "failures": per.failures,
              "per_round": clean, "medians_step_s": _medians(per, names),
              "ratios": ratios, "withheld": withheld, "summary": summary,
              "breakdown": breakdown(per) if {"ft_nofault", "hsdp_nofault"} <= set(per) else None}
    if result["breakdown"] is not None:
        summary.extend(_breakdown_rows(result["breakdown"]))
    result["json_path"] = str(common.write_result("ft_overhead", result, Path(out_dir)))  # before the plot
    if result["breakdown"] is not None:
        result["png_path"] = str(_plot(result, Path(out_dir) / f"ft_overhead-{common.device_slug()}.png"))
        common.write_result("ft_overhead", result, Path(out_dir))
    return result


def _ratios(per: dict[str, list[Any]], names: list[str]) -> tuple[dict[str, Any], str | None, list[Any]]:
    """The suite's ratios (each judged), the A/A withholding and the summary rows, from each contender's
    per-round results (``per[name][round]``: a dict with ``step_s``, or an error)."""
    step_s = {n: [r["step_s"] if isinstance(r, dict) else None for r in per[n]] for n in names}
    ratios: dict[str, dict[str, Any]] = {}
    if "ft_nofault" in per and "hsdp_nofault" in per:
        ratios["ft_nofault / hsdp_nofault step time"] = timing_stats.judge(
            timing_stats.paired_ratio(step_s["ft_nofault"], step_s["hsdp_nofault"]), TARGET, aa=False)
    if "ft_nofault_before" in per:
        if "hsdp_nofault" in per:
            pair = timing_stats.paired_ratio(step_s["ft_nofault_before"], step_s["hsdp_nofault"])
            ratios["ft_nofault_before / hsdp_nofault step time"] = timing_stats.judge(pair, TARGET, aa=False)
        if "ft_nofault" in per:
            ratios["ft_nofault / ft_nofault_before step time (the change)"] = timing_stats.judge(
                timing_stats.paired_ratio(step_s["ft_nofault"], step_s["ft_nofault_before"]), None, aa=False)
    if "hsdp_nofault_aa" in per and "hsdp_nofault" in per:
        ratios["A/A: hsdp_nofault / hsdp_nofault_aa step time"] = timing_stats.judge(
            timing_stats.paired_ratio(step_s["hsdp_nofault"], step_s["hsdp_nofault_aa"]), None, aa=True)
    withheld = timing_stats.withhold_if_aa_failed(ratios)
    summary = [{"ratio": name, "value": r["value"], "ci95": r.get("ci95"), "target": r.get("target"),
                "aa": r.get("aa"), "met": r.get("met"),
                **({"verdict": r["verdict"]} if r.get("verdict") else {})}
               for name, r in ratios.items()]
    return ratios, withheld, summary


def _medians(per: dict[str, list[Any]], names: list[str]) -> dict[str, float | None]:
    return {n: timing_stats.median(r["step_s"] if isinstance(r, dict) else None for r in per[n])
            for n in names}


#: what must be equal in result files pooled together (the same jobs)
POOLED_CONFIG = ("size", "groups", "ranks_per_group", "steps", "warmup_steps", "pin_cores", "checkpointing",
                 "heartbeat_timeout_ms")


def pool(files: list[str], out_dir: Path) -> dict[str, Any]:
    """The rounds of several saved results of this suite (the same jobs: :data:`POOLED_CONFIG`, the same
    host) judged together: every contender all of them ran, its rounds concatenated in file order, the
    ratios, intervals and breakdown computed over all of them. Written as ``ft_overhead_pooled-<device>.json``
    (+ PNG) in ``out_dir``; ``pooled_from`` names the files. ``ValueError`` naming a file that does not
    match."""
    results = [json.loads(Path(f).read_text()) for f in files]
    if len(results) < 2 or any(r.get("suite") != "ft_overhead" for r in results):
        raise ValueError(f"--pool {' '.join(files)}: give two or more ft_overhead result files")
    first = results[0]
    for f, r in zip(files[1:], results[1:]):
        differs = ft_recovery._config_differences(first["config"], r["config"], POOLED_CONFIG)
        if differs or r.get("device_name") != first.get("device_name"):
            raise ValueError(f"--pool: {f} ran other jobs or on another host than {files[0]} "
                             f"({', '.join(differs) or 'device_name'} differ). Fix: pool results of the same "
                             "command on the same machine")
    names = [n for n in (*CONTENDERS, "ft_nofault_before") if all(n in r["per_round"] for r in results)]
    per = {n: [x.get("error", x) for r in results for x in r["per_round"][n]]
           for n in names}  # a failed round stays a failure (not a dict)
    ratios, withheld, summary = _ratios(per, names)
    config = {**first["config"], "reps": len(per[names[0]]) if names else 0, "contenders": names}
    result = {**common.header("ft_overhead", config), "pooled_from": [str(f) for f in files],
              "per_round": {n: [r if isinstance(r, dict) else {"error": r} for r in per[n]] for n in names},
              "medians_step_s": _medians(per, names),
              "ratios": ratios, "withheld": withheld, "summary": summary,
              "breakdown": breakdown(per) if {"ft_nofault", "hsdp_nofault"} <= set(per) else None}
    if result["breakdown"] is not None:
        summary.extend(_breakdown_rows(result["breakdown"]))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ft_overhead_pooled-{common.device_slug()}.json"
    if result["breakdown"] is not None:
        result["png_path"] = str(_plot(result, path.with_suffix(".png")))
    result["json_path"] = str(path)
    path.write_text(json.dumps(result, indent=1, default=str))
    return result


def _add_options(parser: Any) -> None:
    parser.add_argument("--heartbeat-ms", type=int, default=1000, help="the lighthouse's heartbeat timeout")
    parser.add_argument("--before-src", default=None,
                        help="another checkout's src: adds ft_nofault_before, run from it in the same rounds")
    parser.add_argument("--pool", dest="pool_files", nargs="+", default=None, metavar="RESULT_JSON",
                        help="judge the rounds of saved results of this suite together (runs nothing)")
    parser.add_argument("--before-env", nargs="+", default=None, metavar="KEY=VALUE",
                        help="environment of ft_nofault_before's whole job (adds it; with or without "
                             "--before-src), e.g. RUST_LOG=info TOKIO_WORKER_THREADS=2")


if __name__ == "__main__":
    common.suite_main(run, __doc__ or "", _add_options)
