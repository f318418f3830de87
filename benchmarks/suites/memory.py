"""memory suite: bytes each rank holds (parameters, gradients, optimizer state; peak CUDA memory on
GPUs) per strategy, and how they grow with model size and rank count.

Measured inside the workers after the last optimizer step with ``fsdp_strategies.testing`` (local
shards only, so a DTensor counts its shard). Target: per-rank bytes of ``fsdp2`` / ``ddp`` at most
``1/N * 1.05`` on N ranks (``hsdp``: ``1/shard_degree * 1.05``).

    python benchmarks/run.py memory          # or: python benchmarks/suites/memory.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

CONTENDERS = ("lightning_ddp", "ddp_hooks", "fsdp2", "hsdp", "lightning_fsdp")
BASELINE = "lightning_ddp"
COMPONENTS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "total_bytes", "peak_cuda_bytes")
SLACK = 1.05


def _worst_rank(record: dict[str, Any], key: str) -> int | None:
    values = [m.get(key) for m in record.get("memory_per_rank") or [] if m.get(key) is not None]
    return max(values) if values else None


def _shard_factor(name: str, ranks: int) -> float:
    """Fraction of the model one rank should hold under ``name``."""
    if name in ("lightning_ddp", "ddp_hooks", "torch_ddp"):
        return 1.0
    if name == "hsdp":
        return 1.0 / (ranks // common.contender("hsdp").replicate(ranks))
    return 1.0 / ranks


def _ratios(case: dict[str, Any]) -> dict[str, Any]:
    base = case["contenders"].get(BASELINE, {})
    out: dict[str, Any] = {}
    if "memory_per_rank" not in base:
        return out
    for name, record in case["contenders"].items():
        if name == BASELINE or not record.get("memory_per_rank"):
            continue
        ideal = _shard_factor(name, case["ranks"])
        target = ideal * SLACK if ideal < 1.0 else None
        per_component = {}
        for key in COMPONENTS:
            a, b = _worst_rank(record, key), _worst_rank(base, key)
            if a is not None and b:
                per_component[key] = a / b
        value = per_component.get("total_bytes")
        out[f"{name}/{BASELINE}"] = {
            "value": value, "components": per_component, "ideal": ideal, "target": target,
            "met": None if target is None or value is None else value <= target,
        }
    return out


def plot(result: dict[str, Any], path: Path) -> Path:
    """Per size: worst-rank bytes (params + grads + optimizer state) vs ranks, one line per strategy."""
    plt = common._pyplot()
    sizes = list(dict.fromkeys(c["size"] for c in result["cases"]))
    fig, axes = plt.subplots(1, max(1, len(sizes)), figsize=(5 * max(1, len(sizes)), 4.2), squeeze=False)
    for col, size in enumerate(sizes):
        ax = axes[0][col]
        cases = [c for c in result["cases"] if c["size"] == size]
        names = list(
            dict.fromkeys(n for c in cases for n, r in c["contenders"].items() if r.get("memory_per_rank"))
        )
        for name in names:
            pts = [(c["ranks"], _worst_rank(c["contenders"][name], "total_bytes")) for c in cases
                   if c["contenders"].get(name, {}).get("memory_per_rank")]
            ax.plot([p[0] for p in pts], [p[1] / 2**20 for p in pts], marker="o", label=name)
        base = [(c["ranks"], _worst_rank(c["contenders"].get(BASELINE, {}), "total_bytes")) for c in cases]
        base = [(r, b) for r, b in base if b]
        if base:
            full = base[0][1]
            xs = sorted({c["ranks"] for c in cases})
            ax.plot(xs, [full / x / 2**20 for x in xs], linestyle=":", color="grey", label="ddp / N (ideal)")
        params = next((c["params"] for c in cases if c.get("params")), None)
        ax.set_title(f"{size}" + (f" ({params / 1e6:.2f}M params)" if params else ""))
        ax.set_xlabel("ranks")
        ax.set_ylabel("per-rank params+grads+optimizer (MiB, worst rank)")
        ax.set_xticks(sorted({c["ranks"] for c in cases}))
        ax.legend(fontsize=7)
    fig.suptitle(f"memory per rank on {result['device_name']}", fontsize=9)
    return common.save_figure(fig, path)


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, ranks: list[int] | None = None,
        reps: int | None = None, steps: int | None = None, warmup: int | None = None,
        precision: str | None = None, contenders: list[str] | None = None,
        show_progress: bool = True) -> dict[str, Any]:
    chosen = common.select("memory", CONTENDERS, contenders)
    sizes = common.pick(sizes, quick, ["tiny"], ["small", "medium", "large"])
    ranks = common.pick(ranks, quick, [2], [1, 2, 4])
    reps = common.pick(reps, quick, 1, 1)  # bytes are deterministic: one round is enough
    steps = common.pick(steps, quick, 1, 1)
    warmup = common.pick(warmup, quick, 1, 1)
    precision = precision or "32-true"
    config = common.suite_config(chosen, sizes, ranks, reps, steps, warmup, precision, quick)
    config["baseline"] = BASELINE
    config["target"] = f"worst-rank total bytes / {BASELINE} <= (1/N) * {SLACK} (hsdp: 1/shard_degree)"
    config["measured"] = "after the last optimizer step, local shards only (fsdp_strategies.testing)"
    result = common.header("memory", config)
    cases = common.collect_cases("memory", chosen, sizes=sizes, ranks=ranks, reps=reps, steps=steps,
                                 warmup=warmup, precision=precision, show_progress=show_progress)
    for case in cases:
        case["ratios"] = _ratios(case)
        case["worst_rank_bytes"] = {
            name: {k: _worst_rank(r, k) for k in COMPONENTS}
            for name, r in case["contenders"].items() if r.get("memory_per_rank")
        }
    result["cases"] = cases
    result["summary"] = [
        {"size": c["size"], "ranks": c["ranks"], "ratio": name, "value": r["value"], "target": r["target"],
         "met": r["met"]}
        for c in cases for name, r in c["ratios"].items()
    ]
    path = common.write_result("memory", result, Path(out_dir))
    result["json_path"] = str(path)
    result["png_path"] = str(plot(result, path.with_suffix(".png")))
    return result


if __name__ == "__main__":
    common.suite_main(run, __doc__ or "")
