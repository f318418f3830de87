"""fsdp suite: ``fsdp2`` vs Lightning's ``fsdp`` (FSDP1) vs ``ModelParallelStrategy`` + hand-written
``fully_shard`` vs a plain torch FSDP2 loop, on the example model, interleaved.

    python benchmarks/run.py fsdp            # or: python benchmarks/suites/fsdp.py [--quick]

With ``--precision bf16-mixed``, ``fsdp2_no_autocast`` (the MixedPrecisionPolicy alone) measures what
the autocast that ``fsdp2`` runs on top of it costs:

    python benchmarks/suites/fsdp.py --precision bf16-mixed --contenders fsdp2 fsdp2_no_autocast torch_fsdp2 \
        --sizes small --ranks 2 --reps 4
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

CONTENDERS = ("fsdp2", "lightning_fsdp", "lightning_model_parallel", "torch_fsdp2", "fsdp2_no_autocast",
              "fsdp2_aa")
RATIOS = (
    common.RatioSpec("fsdp2", "torch_fsdp2", 1.03, "ours / plain torch FSDP2 loop"),
    common.RatioSpec(
        "fsdp2", "lightning_model_parallel", 1.00, "ours / Lightning ModelParallelStrategy + fully_shard"
    ),
    common.RatioSpec("fsdp2", "lightning_fsdp", 1.00, "ours / Lightning FSDPStrategy (FSDP1)"),
    common.RatioSpec(
        "lightning_model_parallel", "torch_fsdp2", None, "Lightning's own overhead over plain torch"
    ),
    common.RatioSpec(
        "fsdp2", "fsdp2_no_autocast", None, "autocast on top of the MixedPrecisionPolicy (bf16-mixed)"
    ),
    common.aa_pair("fsdp2"),
)


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, ranks: list[int] | None = None,
        reps: int | None = None, steps: int | None = None, warmup: int | None = None,
        precision: str | None = None, contenders: list[str] | None = None,
        show_progress: bool = True) -> dict[str, Any]:
    return common.run_timing_suite(
        "fsdp", common.select("fsdp", CONTENDERS, contenders), RATIOS,
        sizes=common.pick(sizes, quick, ["tiny"], ["small", "medium"]),
        ranks=common.pick(ranks, quick, [1], [1, 2, 4]),
        reps=common.pick(reps, quick, 2, 3),
        steps=common.pick(steps, quick, 2, 10),
        warmup=common.pick(warmup, quick, 1, 3),
        precision=precision or "32-true", out_dir=Path(out_dir), quick=quick, show_progress=show_progress,
    )


if __name__ == "__main__":
    common.suite_main(run, __doc__ or "")
