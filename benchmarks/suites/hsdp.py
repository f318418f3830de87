"""hsdp suite: ``hsdp`` vs a plain torch FSDP2 loop on the same 2-D ``(replicate, shard)`` mesh
(2 x ranks/2; 4 ranks by default), on the example model, interleaved.

    python benchmarks/run.py hsdp            # or: python benchmarks/suites/hsdp.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

CONTENDERS = ("hsdp", "torch_hsdp", "hsdp_aa")
RATIOS = (common.RatioSpec("hsdp", "torch_hsdp", 1.03, "ours / plain torch FSDP2 on the same 2-D mesh"),
          common.aa_pair("hsdp"))


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, ranks: list[int] | None = None,
        reps: int | None = None, steps: int | None = None, warmup: int | None = None,
        precision: str | None = None, contenders: list[str] | None = None,
        show_progress: bool = True) -> dict[str, Any]:
    return common.run_timing_suite(
        "hsdp", common.select("hsdp", CONTENDERS, contenders), RATIOS,
        sizes=common.pick(sizes, quick, ["tiny"], ["small", "medium"]),
        ranks=common.pick(ranks, quick, [4], [4]),
        reps=common.pick(reps, quick, 1, 3),
        steps=common.pick(steps, quick, 2, 10),
        warmup=common.pick(warmup, quick, 1, 3),
        precision=precision or "32-true", out_dir=Path(out_dir), quick=quick, show_progress=show_progress,
    )


if __name__ == "__main__":
    common.suite_main(run, __doc__ or "")
