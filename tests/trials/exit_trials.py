"""Back-to-back short 2-rank jobs; every one must exit 0 (no
``terminate called without an active exception``).

    python tests/trials/exit_trials.py --runs 50                    # the strategies: fit/validate/test/...
    python tests/trials/exit_trials.py --runs 50 --mode collectives # plain gloo collectives + fsdp_strategies
    python tests/trials/exit_trials.py --runs 20 --mode torch_loop  # the benchmarks' plain-torch FSDP2 worker
    python tests/trials/exit_trials.py --runs 20 --mode collectives --without-fix   # the control: aborts

Modes ``lightning`` (tests/workers/exit_job.py under Lightning's launcher, ``--strategy`` fsdp2 by
default), ``collectives`` (both ranks started directly with RANK/WORLD_SIZE set) and
``torch_loop`` (``benchmarks/workers/torch_loop.py --contender torch_fsdp2`` under torchrun). Prints one line
per failed run (exit status and the output's last lines) and a summary; returns 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
JOB = TESTS / "workers" / "exit_job.py"
if __name__ == "__main__":  # run as a script: tests/, as pytest's `pythonpath` has it (support, trials)
    sys.path.insert(0, str(TESTS))

from support import processes  # noqa: E402
from trials.preempt_trials import job_env  # noqa: E402


def run_once(mode: str, work: Path, *, strategy: str = "fsdp2", without_fix: bool = False,
             timeout: float = 300, python: str = sys.executable,
             extra_env: dict[str, str] | None = None) -> tuple[int, str]:
    """One 2-rank job; returns (its exit status -- the first non-zero one of its ranks --, its output).

    ``python``/``extra_env``: what starts each process (the tests pass the zygote's client and its variables:
    the job then exits through the same interpreter finalization, forked with its imports done)."""
    env = job_env(extra_env)
    py = python
    if mode == "collectives":  # both ranks started here, no launcher process
        procs = []
        for rank in (0, 1):
            renv = {**env, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
            cmd = [py, str(JOB), "collectives", *(["--without-fix"] if without_fix else [])]
            procs.append(
                processes.start(
                    cmd, env=renv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        try:
            outs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:
            for p in procs:
                p.kill_tree()
        return next((p.returncode for p in procs if p.returncode != 0), 0), "\n".join(outs)
    if mode == "lightning":
        cmd = [py, str(JOB), "lightning", "--strategy", strategy, "--root", str(work)]
    elif mode == "torch_loop":
        cmd = [py, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
               "--master_addr=127.0.0.1",
               f"--master_port={env['MASTER_PORT']}", str(ROOT / "benchmarks" / "workers" / "torch_loop.py"),
               "--contender", "torch_fsdp2", "--model", '{"dim": 64, "n_layers": 2, "n_heads": 4}',
               "--seq-len", "32",
               "--global-batch", "8", "--steps", "2", "--out", str(work / "torch_loop.json")]
    else:
        raise ValueError(mode)
    proc = processes.run(cmd, env=env, cwd=ROOT, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--mode", choices=("lightning", "collectives", "torch_loop"), default="lightning")
    parser.add_argument("--strategy", default="fsdp2", help="lightning mode: the strategy name")
    parser.add_argument(
        "--without-fix", action="store_true", help="collectives mode: do not import fsdp_strategies"
    )
    args = parser.parse_args(argv)
    failures: list[tuple[int, int]] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="exit-trials-") as tmp:
        for i in range(args.runs):
            code, out = run_once(
                args.mode, Path(tmp) / str(i), strategy=args.strategy, without_fix=args.without_fix
            )
            if code != 0:
                failures.append((i, code))
                tail = "\n    ".join(out.splitlines()[-6:])
                print(f"run {i}: exit {code}; aborted={'terminate called' in out}\n    {tail}", flush=True)
    summary = {"mode": args.mode, "strategy": args.strategy if args.mode == "lightning" else None,
               "without_fix": args.without_fix, "runs": args.runs, "nonzero_exits": len(failures),
               "exit_codes": sorted({c for _, c in failures}), "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(summary))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
