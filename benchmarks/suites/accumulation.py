"""accumulation suite: gradient memory per rank and step time under ``accumulate_grad_batches`` 1 / 4 / 8.

Contenders (2 ranks by default, the same micro-batch per rank at every K, so a step of K micro-batches
trains K x the samples):

* ``fsdp2_sharded``: ``FSDP2Strategy(accumulation="sharded")`` (the default): every micro-batch is
  reduce-scattered, only the gradient shards are kept between micro-batches;
* ``fsdp2_no_sync``: ``FSDP2Strategy(accumulation="no_sync")``: the non-final micro-batches keep unsharded
  gradients, one reduce-scatter per optimizer step;
* ``lightning_model_parallel``: Lightning's ``ModelParallelStrategy`` with ``fully_shard`` by hand
  (``benchmarks/workers/lightning_fit.py``): what it does under accumulation is measured, not assumed.

Measured inside the workers (``--grad-bytes``): after every backward, the gradient bytes rank 0 holds in
FSDP2's own state (``fsdp_strategies.testing.fsdp_gradient_bytes``: sharded ``.grad`` plus unsharded
gradients kept outside ``.grad``), as a fraction of the full model's fp32 gradient bytes; "between
micro-batches" is the largest value after a non-final micro-batch's backward (at K = 1 there is none: after
the step's backward). Step time: wall time of each optimizer step (its K micro-batches; per rank, the
slowest rank's), warm-up steps excluded. Target: ``fsdp2_sharded`` holds at most ``1/N * 1.05`` of the full
model's gradients between micro-batches on N ranks.

    python benchmarks/run.py accumulation     # or: python benchmarks/suites/accumulation.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

CONTENDERS = ("fsdp2_sharded", "fsdp2_no_sync", "lightning_model_parallel")
#: contender -> (the worker's --contender, its extra flags)
_JOBS: dict[str, tuple[str, list[str]]] = {
    "fsdp2_sharded": ("fsdp2", ["--accumulation", "sharded"]),
    "fsdp2_no_sync": ("fsdp2", ["--accumulation", "no_sync"]),
    "lightning_model_parallel": ("lightning_model_parallel", []),
}
ACCUMULATIONS = (1, 4, 8)
BASELINE = "lightning_model_parallel"
SLACK = 1.05


def _step_times(run: dict[str, Any], k: int, warmup_steps: int) -> list[float]:
    """Wall time of each measured optimizer step: per rank the sum of its K micro-batches; slowest rank."""
    per_rank = [r["times_s"][warmup_steps * k:] for r in run["per_rank"]]
    steps = min(len(t) for t in per_rank) // k
    return [max(sum(t[j * k:(j + 1) * k]) for t in per_rank) for j in range(steps)]


def _record(runs: list[Any], k: int, warmup_steps: int) -> dict[str, Any]:
    ok = [r for r in runs if isinstance(r, dict)]
    rec: dict[str, Any] = {"errors": [str(r) for r in runs if isinstance(r, BaseException)]}
    if not ok:
        return rec
    first = ok[0]
    held = first.get("fsdp_grad_bytes_after_backward") or []
    totals = [sum(d.values()) for d in held]
    between = [t for i, t in enumerate(totals) if (i + 1) % k] or totals  # after non-final micro-batches
    full = first["params"] * 4  # fp32 gradients of the whole model
    peak_i = max(range(len(totals)), key=totals.__getitem__) if totals else None
    times = [_step_times(r, k, warmup_steps) for r in ok]
    rep_medians = [common.median(t) for t in times]
    rec.update({
        "full_grad_bytes": full,
        "grad_bytes_after_backward": totals,
        "peak_grad_bytes": max(totals) if totals else None,
        "peak_grad_kinds": held[peak_i] if peak_i is not None else None,
        "between_grad_bytes": max(between) if between else None,
        "between_fraction": max(between) / full if between else None,
        "step_times_s": times,
        "rep_step_medians_s": rep_medians,
        "step_median_s": common.median(x for t in times for x in t),
        "per_microbatch_median_s": (common.median(x for t in times for x in t) or 0.0) / k,
        "loss_last": [r["loss_last"] for r in ok],
        "strategy_class": first.get("strategy_class"),
    })
    return rec


def _summary(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for case in cases:
        k, n = case["accumulate"], case["ranks"]
        base = case["contenders"].get(BASELINE, {})
        for name, rec in case["contenders"].items():
            if rec.get("between_fraction") is None:
                continue
            target = 1.0 / n * SLACK if name == "fsdp2_sharded" else None
            where = "between micro-batches" if k > 1 else "after the backward"
            rows.append({"size": case["size"], "ranks": n,
                         "ratio": f"{name} K={k}: gradient bytes held {where} / full model's",
                         "value": rec["between_fraction"], "target": target,
                         "met": None if target is None else rec["between_fraction"] <= target})
            ratio = common.paired_ratio(rec["rep_step_medians_s"], base.get("rep_step_medians_s") or [])
            rows.append({"size": case["size"], "ranks": n, "ratio": f"{name} K={k}: optimizer step time s",
                         "value": rec["step_median_s"], "per_round": rec["rep_step_medians_s"],
                         "target": None, "met": None})
            if name != BASELINE and ratio.get("value") is not None:
                rows.append({"size": case["size"], "ranks": n, "value": ratio["value"], "target": None,
                             "ratio": f"{name} K={k}: step time / {BASELINE}", "met": None})
    return rows


def plot(result: dict[str, Any], path: Path) -> Path:
    """Left: gradient bytes held between micro-batches (fraction of the model's) vs K; right: step time."""
    plt = common._pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    cases = result["cases"]
    names = list(dict.fromkeys(n for c in cases for n in c["contenders"]))
    styles = [("s", "-", 9), ("o", "--", 6), ("^", ":", 5)]  # lines that coincide stay visible
    for i, name in enumerate(names):
        pts = [(c["accumulate"], c["contenders"][name]) for c in cases if name in c["contenders"]]
        pts = [(k, r) for k, r in pts if r.get("between_fraction") is not None]
        if not pts:
            continue
        marker, line, size = styles[i % len(styles)]
        style = {"marker": marker, "linestyle": line, "markersize": size, "label": name}
        left.plot([k for k, _ in pts], [r["between_fraction"] for _, r in pts], **style)
        right.plot([k for k, _ in pts], [r["step_median_s"] for _, r in pts], **style)
    ranks = cases[0]["ranks"] if cases else 1
    ks = sorted({c["accumulate"] for c in cases})
    left.plot(ks, [1.0 / ranks] * len(ks), linestyle=":", color="grey", label=f"1/N (N={ranks})")
    left.set_xlabel("accumulate_grad_batches")
    left.set_ylabel("gradient bytes held between micro-batches\n/ full model's (rank 0)")
    left.set_xticks(ks)
    left.legend(fontsize=7)
    right.set_xlabel("accumulate_grad_batches")
    right.set_ylabel("optimizer step time, median s (K micro-batches)")
    right.set_xticks(ks)
    right.legend(fontsize=7)
    size = cases[0]["size"] if cases else "?"
    fig.suptitle(f"gradient accumulation, {size} model, {ranks} ranks, on {result['device_name']}",
                 fontsize=9)
    return common.save_figure(fig, path)


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, ranks: list[int] | None = None,
        reps: int | None = None, steps: int | None = None, warmup: int | None = None,
        precision: str | None = None, contenders: list[str] | None = None,
        show_progress: bool = True) -> dict[str, Any]:
    chosen = [n for n in CONTENDERS if contenders is None or n in contenders]
    if not chosen:
        raise ValueError(f"--contenders: none of them is in the accumulation suite. "
                         f"Fix: choose from {CONTENDERS}.")
    size = common.pick(sizes, quick, ["tiny"], ["small"])[0]
    n = common.pick(ranks, quick, [2], [2])[0]
    reps = common.pick(reps, quick, 1, 2)
    steps = common.pick(steps, quick, 1, 4)  # optimizer steps measured per job
    warmup = common.pick(warmup, quick, 1, 1)  # optimizer steps excluded per job
    precision = precision or "32-true"
    ks = (1, 2) if quick else ACCUMULATIONS
    config = {"sizes": {size: common.size_config(size)}, "ranks": [n], "reps": reps, "steps": steps,
              "warmup": warmup, "precision": precision, "quick": quick, "accumulate_grad_batches": list(ks),
              "contenders": {c: {"worker": "lightning_fit.py", "flags": _JOBS[c]} for c in chosen},
              "baseline": BASELINE,
              "target": f"fsdp2_sharded: gradient bytes held between micro-batches <= 1/N * {SLACK} of "
                        "the model's",
              "measured": "rank 0, after every backward, FSDP2's own state (fsdp_strategies.testing."
                          "fsdp_gradient_bytes); step time = K micro-batches, slowest rank, warm-up excluded",
              "steps_unit": "optimizer steps (each job runs K x as many micro-batches)"}
    result = common.header("accumulation", config)
    bar = common.progress(len(ks) * len(chosen) * reps, "accumulation") if show_progress else None
    cases = []
    try:
        for k in ks:
            def run_one(name: str, rep: int, k: int = k) -> dict[str, Any]:
                worker_contender, flags = _JOBS[name]
                args = common.worker_args(common.contender(worker_contender), size, n, steps * k, warmup * k,
                                          precision, seed=rep)
                extra = ["--accumulate", str(k), "--grad-bytes", *flags]
                return common.run_worker("lightning_fit.py", n, [*args, *extra])

            runs = common.interleave(chosen, reps, run_one, bar)
            case = {"size": size, "ranks": n, "accumulate": k,
                    "contenders": {name: _record(r, k, warmup) for name, r in runs.items()},
                    "failures": runs.failures}
            cases.append(case)
    finally:
        if bar is not None:
            bar.close()
    result["cases"] = cases
    result["summary"] = _summary(cases)
    path = common.write_result("accumulation", result, Path(out_dir))
    result["json_path"] = str(path)
    result["png_path"] = str(plot(result, path.with_suffix(".png")))
    return result


if __name__ == "__main__":
    common.suite_main(run, __doc__ or "")
