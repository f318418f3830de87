"""Worker: a fake benchmark contender for the runner's tests (no torch, starts in milliseconds).

Takes the benchmark workers' command line and writes their JSON shape with fixed step times:
``steady`` 10 ms per step, ``flaky`` 20 ms, except that ``flaky``'s first job of round 1 (``--seed 1``)
writes its result, prints an abort message and exits 134, as a gloo job aborting at exit does;
``broken`` always fails. Every job appends ``<contender> <seed>`` to ``$BENCH_FAKE_LOG``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contender", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args, _ = parser.parse_known_args()
    log = Path(os.environ["BENCH_FAKE_LOG"])
    earlier = log.read_text().splitlines() if log.exists() else []
    mine = f"{args.contender} {args.seed}"
    with log.open("a") as f:
        f.write(mine + "\n")
    if args.contender == "broken":
        print(
            "Traceback (most recent call last):\nRuntimeError: the broken contender always fails",
            file=sys.stderr,
        )
        sys.exit(1)
    step = {"steady": 0.010, "flaky": 0.020}[args.contender] * (1 + args.seed)
    times = [step] * args.steps
    args.out.write_text(json.dumps({
        "step_times_s": times, "warmup_times_s": [step], "loss_first": 4.0, "loss_last": 3.0, "params": 1000,
        "strategy_class": "Fake", "per_rank": [{"memory": {"param_bytes": 4000}, "times_s": times}]}))
    if args.contender == "flaky" and args.seed == 1 and mine not in earlier:
        print("step 2 done\nterminate called without an active exception", file=sys.stderr, flush=True)
        os._exit(134)


if __name__ == "__main__":
    main()
