"""ddp suite: this package's DDP strategy (``ddp_hooks``) vs Lightning's ``ddp`` vs a plain torch
``DistributedDataParallel`` loop, on the example model, interleaved.

    python benchmarks/run.py ddp             # or: python benchmarks/suites/ddp.py [--quick]

``ddp_hooks`` is skipped (with the reason in the result file) until the package registers it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

CONTENDERS = ("ddp_hooks", "lightning_ddp", "torch_ddp", "ddp_hooks_aa")
RATIOS = (
    common.RatioSpec("ddp_hooks", "torch_ddp", 1.03, "ours / plain torch DDP loop"),
    common.RatioSpec("ddp_hooks", "lightning_ddp", 1.00, "ours / Lightning DDPStrategy"),
    common.RatioSpec("lightning_ddp", "torch_ddp", None, "Lightning's own overhead over plain torch"),
    common.aa_pair("ddp_hooks"),
)


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, ranks: list[int] | None = None,
        reps: int | None = None, steps: int | None = None, warmup: int | None = None,
        precision: str | None = None, contenders: list[str] | None = None,
        show_progress: bool = True) -> dict[str, Any]:
    return common.run_timing_suite(
        "ddp", common.select("ddp", CONTENDERS, contenders), RATIOS,
        sizes=common.pick(sizes, quick, ["tiny"], ["small", "medium"]),
        ranks=common.pick(ranks, quick, [1], [1, 2, 4]),
        reps=common.pick(reps, quick, 2, 3),
        steps=common.pick(steps, quick, 2, 10),
        warmup=common.pick(warmup, quick, 1, 3),
        precision=precision or "32-true", out_dir=Path(out_dir), quick=quick, show_progress=show_progress,
    )


if __name__ == "__main__":
    common.suite_main(run, __doc__ or "")
