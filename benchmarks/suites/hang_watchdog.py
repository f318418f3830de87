"""hang_watchdog suite: what ``HangWatchdog`` costs while nothing hangs -- ``fsdp2`` with and without it,
beside Lightning's ``ModelParallelStrategy`` + hand-written ``fully_shard`` and a plain torch FSDP2 loop,
interleaved.

    python benchmarks/run.py hang_watchdog      # or: python benchmarks/suites/hang_watchdog.py [--quick]

The watchdog polls every second here (its default is every ``min(10, timeout_s / 6)`` s), so its thread's
store calls happen ~10x as often as in a default run: an upper bound. Target: ``fsdp2_hang_watchdog / fsdp2``
<= 1.01 (step time). On a shared 2-core CPU the rounds' spread (a few %) is larger than that target, so the
suite also measures the watchdog's own cost directly (``own_cost`` in the JSON):

* its hooks: the hook sequence of one optimizer step (batch start, one forward pre-hook per FSDP unit,
  backward, optimizer, batch end) on a real ``HangWatchdog``, timed over many repetitions in this process;
* its thread: the CPU seconds rank 0's watchdog thread used (``time.thread_time``; rank 0 also reads every
  rank's position) over the wall time of the fit, in every round of ``fsdp2_hang_watchdog``;

as fractions of ``fsdp2``'s median step time from the same run. Target: their sum <= 0.01.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

CONTENDERS = ("fsdp2", "fsdp2_hang_watchdog", "lightning_model_parallel", "torch_fsdp2", "fsdp2_aa")
RATIOS = (
    common.RatioSpec(
        "fsdp2_hang_watchdog", "fsdp2", 1.01, "HangWatchdog's cost while nothing hangs (step time)"
    ),
    common.RatioSpec(
        "fsdp2_hang_watchdog",
        "lightning_model_parallel",
        None,
        "ours with the watchdog / Lightning ModelParallelStrategy + fully_shard (no watchdog)",
    ),
    common.RatioSpec(
        "fsdp2_hang_watchdog", "torch_fsdp2", None, "ours with the watchdog / plain torch FSDP2 loop"
    ),
    common.aa_pair("fsdp2"),
)


def hook_seconds_per_step(units: int, reps: int = 20000) -> float:
    """Seconds the watchdog's hooks take in one optimizer step with ``units`` FSDP units (no thread)."""
    from types import SimpleNamespace

    from fsdp_strategies.callbacks import HangWatchdog

    dog = HangWatchdog(timeout_s=300, flight_recorder=0)
    trainer: Any = SimpleNamespace(global_step=0)
    t0 = time.perf_counter()
    for _ in range(reps):
        dog.on_train_batch_start(trainer, None, None, 0)  # type: ignore[arg-type]
        for _ in range(units):
            dog._entered(None, ())  # type: ignore[arg-type]  # the forward pre-hook it registers per unit
        dog.on_before_backward(trainer, None, None)  # type: ignore[arg-type]
        dog.on_before_optimizer_step(trainer, None, None)  # type: ignore[arg-type]
        dog.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
    return (time.perf_counter() - t0) / reps


def own_cost(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case: the watchdog's hooks and thread as fractions of ``fsdp2``'s median step time."""
    out = []
    for case in result["cases"]:
        base, dog = case["contenders"].get("fsdp2", {}), case["contenders"].get("fsdp2_hang_watchdog", {})
        if not base.get("median_s") or not dog.get("extras"):
            continue
        step_s = base["median_s"]
        units = result["config"]["sizes"][case["size"]]["model"]["n_layers"] + 1  # blocks + root
        hooks_s = hook_seconds_per_step(units)
        threads = [e["hang_watchdog"] for e in dog["extras"] if e.get("hang_watchdog")]
        thread_fraction = common.median(t["thread_cpu_s"] / t["fit_wall_s"] for t in threads)
        total = hooks_s / step_s + (thread_fraction or 0.0)
        out.append(
            {
                "size": case["size"],
                "ranks": case["ranks"],
                "step_s": step_s,
                "fsdp_units": units,
                "hooks_us_per_step": hooks_s * 1e6,
                "hooks_fraction": hooks_s / step_s,
                "thread_cpu_fraction": thread_fraction,
                "threads": threads,
                "total_fraction": total,
                "target": 0.01,
                "met": total <= 0.01,
            }
        )
    return out


def run(
    quick: bool,
    out_dir: Path,
    sizes: list[str] | None = None,
    ranks: list[int] | None = None,
    reps: int | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    precision: str | None = None,
    contenders: list[str] | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    result = common.run_timing_suite(
        "hang_watchdog",
        common.select("hang_watchdog", CONTENDERS, contenders),
        RATIOS,
        sizes=common.pick(sizes, quick, ["tiny"], ["small"]),
        ranks=common.pick(ranks, quick, [2], [2]),
        reps=common.pick(reps, quick, 2, 5),
        steps=common.pick(steps, quick, 4, 40),
        warmup=common.pick(warmup, quick, 1, 3),
        precision=precision or "32-true",
        out_dir=Path(out_dir),
        quick=quick,
        show_progress=show_progress,
    )
    result["own_cost"] = own_cost(result)
    for c in result["own_cost"]:
        print(
            f"  size={c['size']} ranks={c['ranks']}  HangWatchdog's own cost: "
            f"hooks {c['hooks_us_per_step']:.1f} us "
            f"per step ({c['hooks_fraction']:.2e} of {c['step_s'] * 1e3:.1f} ms) + thread CPU "
            f"{c['thread_cpu_fraction']:.2e} of the wall time = {c['total_fraction']:.2e} (target <= 0.01: "
            f"{'met' if c['met'] else 'MISSED'})"
        )
    keep = {k: v for k, v in result.items() if k not in ("json_path", "png_path")}
    common.write_result("hang_watchdog", keep, Path(out_dir))
    return result


if __name__ == "__main__":
    common.suite_main(run, __doc__ or "")
