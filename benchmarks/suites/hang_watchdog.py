"""hang_watchdog suite: what ``HangWatchdog`` costs while nothing hangs -- ``fsdp2`` with and without it, beside
Lightning's ``ModelParallelStrategy`` + hand-written ``fully_shard`` and a plain torch FSDP2 loop, interleaved.

    python benchmarks/run.py hang_watchdog      # or: python benchmarks/suites/hang_watchdog.py [--quick]

The watchdog polls every second here (its default is every ``min(10, timeout_s / 6)`` s), so its thread's store
calls happen ~10x as often as in a default run: an upper bound. Target: ``fsdp2_hang_watchdog / fsdp2`` <= 1.01
(step time). On a shared 2-core CPU the rounds' spread is of the same order as the target; read the paired
per-round ratios, not one number.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

CONTENDERS = ("fsdp2", "fsdp2_hang_watchdog", "lightning_model_parallel", "torch_fsdp2")
RATIOS = (
    common.RatioSpec("fsdp2_hang_watchdog", "fsdp2", 1.01, "HangWatchdog's cost while nothing hangs (step time)"),
    common.RatioSpec("fsdp2_hang_watchdog", "lightning_model_parallel", None,
                     "ours with the watchdog / Lightning ModelParallelStrategy + fully_shard (no watchdog)"),
    common.RatioSpec("fsdp2_hang_watchdog", "torch_fsdp2", None, "ours with the watchdog / plain torch FSDP2 loop"),
)


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, ranks: list[int] | None = None,
        reps: int | None = None, steps: int | None = None, warmup: int | None = None,
        precision: str | None = None, contenders: list[str] | None = None,
        show_progress: bool = True) -> dict[str, Any]:
    return common.run_timing_suite(
        "hang_watchdog", common.select("hang_watchdog", CONTENDERS, contenders), RATIOS,
        sizes=common.pick(sizes, quick, ["tiny"], ["small"]),
        ranks=common.pick(ranks, quick, [2], [2]),
        reps=common.pick(reps, quick, 2, 5),
        steps=common.pick(steps, quick, 4, 40),
        warmup=common.pick(warmup, quick, 1, 3),
        precision=precision or "32-true", out_dir=Path(out_dir), quick=quick, show_progress=show_progress,
    )


if __name__ == "__main__":
    common.suite_main(run, __doc__ or "")
