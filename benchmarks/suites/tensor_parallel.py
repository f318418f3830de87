"""tensor_parallel suite: FSDP x tensor parallelism (2 TP ranks x ranks/2 data-parallel ranks) on the example
model.

Contenders, interleaved, each a real ``torchrun`` job on the same model, data, optimizer and global batch
(split over the data-parallel ranks: both ranks of a TP pair read the same sequences):

* ``fsdp2_tp2`` (ours): ``FSDP2Strategy(tensor_parallel_degree=2, tp_plan=...)`` with the example's plan as
  ``configs/fsdp2_tp.yaml`` gives it (read from that file);
* ``lightning_mp_tp2``: Lightning's
  ``ModelParallelStrategy(data_parallel_size=ranks/2, tensor_parallel_size=2)`` with the same plan written by
  hand in ``configure_model`` (``parallelize_module`` + ``fully_shard``);
* ``torch_tp2``: a plain torch loop doing the same on an ``init_device_mesh``;
* ``fsdp2``: ours without tensor parallelism (FSDP over all ranks), what TP is an alternative to.

No gradient clipping in any of them: Lightning's ``ModelParallelStrategy`` cannot clip gradients that live on
two meshes (``All operands in aten.stack.default must have the same mesh``). Measured: step time (median over
the steps after warm-up; ratios per round) and per-rank memory (parameter, gradient and optimizer-state bytes
of the local shards, ``fsdp_strategies.testing``, and peak RSS), as ratios against Lightning's.

    python benchmarks/run.py tensor_parallel     # or: python benchmarks/suites/tensor_parallel.py [--quick]

Default: ``medium`` (dim 256, 4 layers, 8 heads: every planned Linear splits over 2 ranks), 4 ranks, 3 rounds
of 6 steps (+2 warm-up). ``--quick``: ``tiny`` on 2 ranks (1 x 2), one round of 2 steps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

TP = 2
WORKER = "tensor_parallel.py"
CONTENDERS = ("fsdp2_tp2", "lightning_mp_tp2", "torch_tp2", "fsdp2")
BASELINE = "lightning_mp_tp2"
RATIOS = (
    common.RatioSpec("fsdp2_tp2", "lightning_mp_tp2", 1.00,
                     "ours / Lightning ModelParallelStrategy + the same plan by hand"),
    common.RatioSpec("fsdp2_tp2", "torch_tp2", 1.03,
                     "ours / plain torch parallelize_module + fully_shard loop"),
    common.RatioSpec("lightning_mp_tp2", "torch_tp2", None, "Lightning's own overhead over plain torch"),
    common.RatioSpec("fsdp2_tp2", "fsdp2", None, "tensor parallelism's cost over FSDP alone on this machine"),
)
COMPONENTS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "total_bytes", "max_rss_bytes")
SLACK = 1.05  # per-rank bytes of ours / Lightning's: the same plan and sharding, so at most this
TP_NOTE = ("Tensor parallelism on CPU (gloo): every planned "
           "layer adds an all-reduce per forward and backward, "
           "which a CPU pays for with no fast interconnect and "
           "no large matmuls to split; these figures check the "
           "cost of our strategy against Lightning's and plain torch's on the same model and plan "
           "(correctness of cost), not the speed-up TP gives on GPUs.")


def _needs_pairs(ranks: int) -> str | None:
    return (
        None if ranks % TP == 0 else f"tensor_parallel_degree={TP} needs an even number of ranks; got {ranks}"
    )


def select_contenders(wanted: list[str] | None) -> list[common.Contender]:
    chosen = [n for n in CONTENDERS if wanted is None or n in wanted]
    if not chosen:
        raise ValueError(
            f"--contenders {' '.join(wanted or [])}: none of them is in the tensor_parallel suite. "
            f"Fix: choose from {list(CONTENDERS)}."
        )
    mesh = f"(data_parallel=ranks/{TP}, tensor_parallel={TP})"
    catalogue = {
        "fsdp2_tp2": common.Contender(
            "fsdp2_tp2", WORKER, "ours",
            f"FSDP2Strategy(tensor_parallel_degree={TP}, tp_plan=configs/fsdp2_tp.yaml's plan) on {mesh}",
            skip_reason=_needs_pairs),
        "lightning_mp_tp2": common.Contender(
            "lightning_mp_tp2", WORKER, "lightning",
            f"ModelParallelStrategy(data_parallel_size=ranks/{TP}, "
            f"tensor_parallel_size={TP}) + the same plan by hand "
            "in configure_model (parallelize_module, then fully_shard per block and root)",
            skip_reason=_needs_pairs),
        "torch_tp2": common.Contender(
            "torch_tp2", WORKER, "torch",
            f"plain torch loop: parallelize_module + fully_shard on init_device_mesh {mesh}",
            skip_reason=_needs_pairs),
        "fsdp2": common.contender("fsdp2"),
    }
    return [catalogue[n] for n in chosen]


def _worst(record: dict[str, Any], key: str) -> int | None:
    values = [m.get(key) for m in record.get("memory_per_rank") or [] if m.get(key) is not None]
    return max(values) if values else None


def _memory_ratios(case: dict[str, Any]) -> dict[str, Any]:
    base = case["contenders"].get(BASELINE, {})
    out: dict[str, Any] = {}
    if not base.get("memory_per_rank"):
        return out
    for name, record in case["contenders"].items():
        if name == BASELINE or not record.get("memory_per_rank"):
            continue
        components = {
            k: _worst(record, k) / _worst(base, k)
            for k in COMPONENTS
            if _worst(record, k) and _worst(base, k)
        }
        target = SLACK if name == "fsdp2_tp2" else None
        value = components.get("total_bytes")
        out[f"{name}/{BASELINE}"] = {"value": value, "components": components, "target": target,
                                     "met": None if target is None or value is None else value <= target}
    return out


def plot(result: dict[str, Any], path: Path) -> Path:
    """Per case: step time (round medians as dots), the ratios against Lightning's, worst-rank bytes and peak
    RSS."""
    plt = common._pyplot()
    cases = result["cases"]
    fig, axes = plt.subplots(len(cases), 4, figsize=(18, 4.2 * len(cases)), squeeze=False)
    colors = {"ours": "tab:blue", "lightning": "tab:purple", "torch": "tab:grey"}
    roles = {n: c["role"] for n, c in result["config"]["contenders"].items()}
    for row, case in zip(axes, cases):
        names = [n for n, r in case["contenders"].items() if r.get("median_s") is not None]
        recs = [case["contenders"][n] for n in names]
        tint = [colors.get(roles.get(n, ""), "tab:green") if n != "fsdp2" else "tab:cyan" for n in names]
        common.bars_with_points(row[0], names, [r["median_s"] * 1e3 for r in recs],
                                [[m * 1e3 if m else None for m in r["rep_medians_s"]] for r in recs], tint,
                                ylabel="median step time (ms)", rotation=20, fontsize=8)
        row[0].set_title(
            f"{case['size']} ({(case.get('params') or 0) / 1e6:.2f}M params), {case['ranks']} ranks"
        )
        labels, values, targets = [], [], []
        for name, ratio in case["ratios"].items():
            labels.append(f"time {name}")
            values.append(ratio["value"] or 0)
            targets.append(ratio["target"])
        for name, ratio in case["memory_ratios"].items():
            labels.append(f"bytes {name}")
            values.append(ratio["value"] or 0)
            targets.append(ratio["target"])
        row[1].barh(range(len(labels)), values, color="tab:blue")
        for i, target in enumerate(targets):
            if target is not None:
                row[1].plot([target, target], [i - 0.4, i + 0.4], color="black", linestyle=":")
        row[1].axvline(1.0, color="grey", linewidth=0.8)
        row[1].set_yticks(range(len(labels)), labels, fontsize=7)
        row[1].set_xlabel("ratio (dotted: target)")
        mem = [n for n in names if case["contenders"][n].get("memory_per_rank")]
        bottom = [0.0] * len(mem)
        for key, label in (
            ("param_bytes", "params"),
            ("grad_bytes", "grads"),
            ("optimizer_state_bytes", "optimizer"),
        ):
            vals = [(_worst(case["contenders"][n], key) or 0) / 2**20 for n in mem]
            row[2].bar(range(len(mem)), vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        row[2].set_xticks(range(len(mem)), mem, rotation=20, fontsize=8)
        row[2].set_ylabel("worst-rank MiB (local shards)")
        row[2].legend(fontsize=7)
        row[3].bar(range(len(mem)),
                   [(_worst(case["contenders"][n], "max_rss_bytes") or 0) / 2**20 for n in mem],
                   color=[tint[names.index(n)] for n in mem])
        row[3].set_xticks(range(len(mem)), mem, rotation=20, fontsize=8)
        row[3].set_ylabel("peak RSS per rank, worst rank (MiB)")
    fig.suptitle(f"tensor_parallel on {result['device_name']} (torch {result['versions'].get('torch')}, "
                 f"lightning {result['versions'].get('lightning')})", fontsize=9)
    return common.save_figure(fig, path)


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, ranks: list[int] | None = None,
        reps: int | None = None, steps: int | None = None, warmup: int | None = None,
        precision: str | None = None, contenders: list[str] | None = None,
        show_progress: bool = True) -> dict[str, Any]:
    chosen = select_contenders(contenders)
    sizes = common.pick(sizes, quick, ["tiny"], ["medium"])
    ranks = common.pick(ranks, quick, [2], [4])
    reps = common.pick(reps, quick, 1, 3)
    steps = common.pick(steps, quick, 2, 6)
    warmup = common.pick(warmup, quick, 1, 2)
    precision = precision or "32-true"
    config = common.suite_config(chosen, sizes, ranks, reps, steps, warmup, precision, quick)
    config["ratios"] = {r.name: {"target": r.target, "meaning": r.meaning} for r in RATIOS}
    config["memory"] = (
        f"worst rank's bytes (local shards: a DTensor counts its shard; fsdp_strategies.testing) after "
        f"the last step, and its peak RSS; ratios against {BASELINE}, target for fsdp2_tp2 <= {SLACK}"
    )
    config["tensor_parallel_degree"] = TP
    config["batch"] = "global batch split over the data-parallel ranks (ranks/2 for the TP contenders)"
    config["gradient_clipping"] = (
        "off for every contender (ModelParallelStrategy cannot clip 2-mesh gradients)"
    )
    result = common.header("tensor_parallel", config)
    result["note"] = f"{result['note']} {TP_NOTE}"
    cases = common.collect_cases("tensor_parallel", chosen, sizes=sizes, ranks=ranks, reps=reps, steps=steps,
                                 warmup=warmup, precision=precision, show_progress=show_progress)
    summary = []
    for case in cases:
        per = case["contenders"]
        for spec in RATIOS:
            a, b = per.get(spec.num, {}), per.get(spec.den, {})
            if "rep_medians_s" not in a or "rep_medians_s" not in b:
                continue
            ratio = common.paired_ratio(a["rep_medians_s"], b["rep_medians_s"])
            ratio["target"] = spec.target
            ratio["met"] = (
                None if spec.target is None or ratio["value"] is None else ratio["value"] <= spec.target
            )
            case["ratios"][spec.name] = ratio
            summary.append({"size": case["size"], "ranks": case["ranks"], "ratio": f"step time {spec.name}",
                            "value": ratio["value"], "target": spec.target, "met": ratio["met"],
                            "rounds": f"{ratio['rounds_paired']}/{reps}"})
        case["memory_ratios"] = _memory_ratios(case)
        case["worst_rank_bytes"] = {n: {k: _worst(r, k) for k in COMPONENTS}
                                    for n, r in per.items() if r.get("memory_per_rank")}
        for name, ratio in case["memory_ratios"].items():
            summary.append({"size": case["size"], "ranks": case["ranks"], "ratio": f"bytes per rank {name}",
                            "value": ratio["value"], "target": ratio["target"], "met": ratio["met"]})
    result["cases"] = cases
    result["summary"] = summary
    path = common.write_result("tensor_parallel", result, Path(out_dir))
    result["json_path"] = str(path)
    result["png_path"] = str(plot(result, path.with_suffix(".png")))
    return result


if __name__ == "__main__":
    common.suite_main(run, __doc__ or "")
