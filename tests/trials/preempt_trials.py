"""SIGTERM trials: preempt a real multi-process job at a random time, then resume it and compare.

Each trial starts ``tests/workers/preempt_train.py`` (2 ranks, a tiny Llama, a checkpoint every 2 steps,
``checkpoint_on_preempt``), waits until it has trained a step (or a random moment of the startup), waits a
random time more, and sends SIGTERM to every process of the job (launchers included, as a scheduler does),
to one rank, or to the launcher only (rotating). It then
checks that the whole process tree ended within a bound (a "hang" otherwise; the tree is killed), the exit
status, that the newest complete checkpoint loads (``export_consolidated``, no process group), and resumes
the job from ``ckpt_path="last"`` to the end: the resumed losses and final parameters must equal those of an
uninterrupted reference run of the same strategy, bit for bit.

Launch paths: ``fsdp2`` and ``ddp_hooks`` run under Lightning's launcher (SIGTERM to the launcher = to rank
0's process, which forwards it), ``hsdp`` under ``torchrun`` (SIGTERM to the agent, which forwards it),
``ft_hsdp`` under ``fsdp-strategies-ft`` (one replica group of 2 ranks under torchrun; SIGTERM to the
fsdp-strategies-ft launcher, which forwards it to the group).

Full run (10 trials per strategy, a table of the figures)::

    python tests/trials/preempt_trials.py --trials 10

``tests/test_preemption.py`` runs a cut of it in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
WORKER = TESTS / "workers" / "preempt_train.py"
if __name__ == "__main__":  # run as a script: src and tests/, as pytest's `pythonpath` has them
    sys.path[:0] = [str(ROOT / "src"), str(TESTS)]

from fsdp_strategies.checkpoint.export import export_consolidated  # noqa: E402
from fsdp_strategies.ft.launch.process_tree import process_tree  # noqa: E402
from fsdp_strategies.runtime.preemption import PREEMPT_EXIT_CODE  # noqa: E402
from support import processes  # noqa: E402
from support.paths import job_pythonpath  # noqa: E402

STRATEGIES = ("fsdp2", "hsdp", "ddp_hooks", "ft_hsdp")
MODES = ("all", "one", "launcher")
HANG_S = 90.0  # a job still alive this long after SIGTERM counts as hung (the watchdog bounds it to grace_s)
STEPS = 24


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK",
                "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        env.pop(key, None)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "PYTHONPATH": job_pythonpath()})
    env.update(extra or {})
    return env


def command(strategy: str, root: Path, *, resume: bool = False, steps: int = STEPS, step_sleep: float = 0.0,
            grace: float = 25.0, also_reference: Path | None = None) -> list[str]:
    """The job for ``strategy`` (its launch path), writing under ``root``."""
    worker = [str(WORKER), "--strategy", strategy, "--root", str(root), "--steps", str(steps), "--devices",
              "2", "--step-sleep", str(step_sleep), "--grace", str(grace), *(["--resume"] if resume else []),
              *(["--also-reference", str(also_reference)] if also_reference else [])]
    py = sys.executable
    if strategy in ("fsdp2", "ddp_hooks"):
        return [py, *worker]
    if strategy == "hsdp":
        return [py, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
                "--master_addr=127.0.0.1",
                f"--master_port={job_env()['MASTER_PORT']}", "--shutdown-timeout", str(int(grace) + 5),
                *worker]
    return [py, "-m", "fsdp_strategies.ft", "--groups", "1", "--ranks-per-group", "2", "--max-restarts", "0",
            "--events-dir", str(root / "ft_events"), "--grace", str(grace + 5), "--", *worker]


def events(root: Path, rank: int) -> list[dict[str, Any]]:
    path = root / f"events-rank{rank}.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the kill
            continue
    return out


def losses(root: Path, rank: int) -> dict[int, float]:
    """Loss per global step; a step that ran twice (before and after a resume) keeps the later value."""
    return {r["step"]: r["loss"] for r in events(root, rank) if r["event"] == "step"}


def run_job(
    strategy: str, root: Path, *, resume: bool, timeout: float = 600, **kw: Any
) -> subprocess.CompletedProcess[str]:
    return processes.run(
        command(strategy, root, resume=resume, **kw), timeout=timeout, env=job_env(), cwd=ROOT
    )


def _tree_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            continue
    return alive


def _ranks(proc_pid: int, strategy: str) -> list[int]:
    """PIDs of the rank processes (rank 0 first where the launcher is rank 0)."""
    tree = process_tree(proc_pid)
    workers = []
    for pid in tree:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        launcher = b"torch.distributed.run" in cmd or b"fsdp_strategies.ft" in cmd
        if any(c.endswith(b"preempt_train.py") for c in cmd) and not launcher:
            workers.append(pid)
    return sorted(workers)


@dataclass
class Trial:
    strategy: str
    mode: str
    delay_s: float
    rc: int | None = None
    rank_rcs: list[Any] = field(default_factory=list)
    hung: bool = False
    stop_s: float | None = None
    # SIGTERM -> the ranks' SystemExit (the rest of stop_s is interpreter teardown)
    exit_s: float | None = None
    signalled_at_step: int | None = None
    mid_save: bool = False
    mid_val: bool = False
    preempt_step: int | None = None
    loadable: bool | None = None
    resumed_from: int | None = None
    resume_rc: int | None = None
    exact: bool | None = None
    notes: list[str] = field(default_factory=list)


def _in_interval(records: list[dict[str, Any]], t: float, start: str, end: str) -> bool:
    opened = None
    for r in records:
        if r["event"] == start:
            opened = r["t"]
        elif r["event"] == end and opened is not None:
            if opened <= t <= r["t"]:
                return True
            opened = None
    return opened is not None and t >= opened


def _newest_checkpoint(ckpt: Path) -> tuple[int, Path] | None:
    """(step, path) of the newest complete checkpoint as ``ckpt_path='last'`` sees it (newest last*.ckpt)."""
    lasts = [p for p in ckpt.glob("last*.ckpt") if p.exists()]
    if not lasts:
        return None
    newest = max(lasts, key=lambda p: p.stat().st_mtime)
    meta = torch.load(newest / "meta.pt", weights_only=False) if newest.is_dir() else \
        torch.load(newest, weights_only=False, map_location="cpu")
    return int(meta["global_step"]), newest


def trial(strategy: str, mode: str, rng: random.Random, work: Path, reference: dict[int, Any] | str | None,
          window_s: float = 3.0, step_sleep: float = 0.05, steps: int = STEPS) -> Trial:
    """One SIGTERM trial. ``reference``: the uninterrupted run's figures, ``"inline"`` (the resume job runs
    the uninterrupted fit afterwards in the same processes, which saves a job), or None (no resume)."""
    root = work / f"{strategy}-{mode}-{rng.randrange(10**6)}"
    delay = rng.uniform(0, window_s)
    t = Trial(strategy, mode, round(delay, 3))
    proc = processes.start(command(strategy, root, step_sleep=step_sleep, steps=steps),
                           stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=job_env(), cwd=ROOT)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:  # trained at least one step
            if any(r["event"] == "step" for r in events(root, 0)):
                break
            time.sleep(0.05)
        time.sleep(delay)
        ranks = _ranks(proc.pid, strategy)
        if proc.poll() is not None or len(ranks) < 2:
            t.notes.append(f"job ended before the signal (rc={proc.poll()}, ranks={ranks})")
            proc.wait()
            return t
        # "all": every process of the job, launchers included -- what a scheduler's job-wide SIGTERM does
        victims = {"all": _tree_alive(process_tree(proc.pid)), "one": [ranks[-1]], "launcher": [proc.pid]}[
            mode
        ]
        t0 = time.time()
        for pid in victims:
            os.kill(pid, signal.SIGTERM)
        records = events(root, 0)
        t.signalled_at_step = max((r["step"] for r in records if r["event"] == "step"), default=0)
        tree = process_tree(proc.pid)
        while time.time() - t0 < HANG_S and _tree_alive(tree):
            time.sleep(0.05)
        t.stop_s = round(time.time() - t0, 2)
        if _tree_alive(tree):
            t.hung = True
            for pid in _tree_alive(tree):
                os.kill(pid, signal.SIGKILL)
        t.rc = proc.wait(timeout=30)
        out = proc.stdout.read() if proc.stdout else ""
        (root / "job.log").write_text(out)
        out += "".join(log.read_text() for log in (root / "ft_events").glob("group*.log"))
        exits = [next((r for r in events(root, rank) if r["event"] == "exit"), None) for rank in (0, 1)]
        t.rank_rcs = [e["code"] if e else None for e in exits]
        if all(exits):
            t.exit_s = round(max(e["t"] for e in exits if e) - t0, 2)
        records = events(root, 0)
        t.mid_save = _in_interval(records, t0, "save_start", "save_end")
        vals = [r["t"] for r in records if r["event"] == "val"]
        t.mid_val = any(abs(v - t0) < 0.3 for v in vals)
        for line in out.splitlines():
            if "preemption checkpoint of step" in line:
                t.preempt_step = int(line.split("preemption checkpoint of step")[1].split()[0])
        if "still running" in out and "preempt_grace_s" in out:
            t.notes.append("watchdog exit")
    finally:
        proc.kill_tree()  # whatever of the job is still running, in any session (a no-op after a clean stop)

    newest = _newest_checkpoint(root / "ckpt")
    if newest is not None:
        step, path = newest
        try:
            export_consolidated(path, root / "export.pt")
            t.loadable = True
        except Exception as err:  # reported as a failed trial
            t.loadable = False
            t.notes.append(f"newest checkpoint {path.name} (step {step}) does not load: {err}")
        t.resumed_from = step
    else:
        t.notes.append("no checkpoint yet: resume starts from scratch")
    if reference is not None:
        inline = root / "reference" if reference == "inline" else None
        res = run_job(strategy, root, resume=True, steps=steps, also_reference=inline)
        t.resume_rc = res.returncode
        (root / "resume.log").write_text(res.stdout + res.stderr)
        if res.returncode == 0 and inline is not None:
            reference = load_run(inline)
        t.exact = res.returncode == 0 and _same_as_reference(root, reference, t)  # type: ignore[arg-type]
    return t


def load_run(root: Path) -> dict[int, Any]:
    """Losses and final parameters of every rank of a finished run."""
    return {rank: {"losses": losses(root, rank), "params": torch.load(root / f"params-rank{rank}.pt")}
            for rank in (0, 1)}


def reference_run(strategy: str, work: Path, steps: int = STEPS) -> dict[int, Any]:
    """An uninterrupted run of ``strategy``."""
    root = work / f"{strategy}-reference"
    res = run_job(strategy, root, resume=False, steps=steps)
    if res.returncode != 0:
        raise RuntimeError(
            f"reference run of {strategy} exited {res.returncode}:\n{(res.stdout + res.stderr)[-4000:]}"
        )
    return load_run(root)


def _same_as_reference(root: Path, reference: dict[int, Any], t: Trial) -> bool:
    start = t.resumed_from or 0
    ok = True
    for rank, ref in reference.items():
        resumed = losses(root, rank)
        want = {s: v for s, v in ref["losses"].items() if s > start}
        got = {s: resumed.get(s) for s in want}
        if got != want:
            bad = [s for s in want if got[s] != want[s]][:3]
            t.notes.append(f"rank {rank}: losses differ from the uninterrupted run at steps {bad}")
            ok = False
        params = torch.load(root / f"params-rank{rank}.pt")
        diff = [k for k in ref["params"] if not torch.equal(ref["params"][k], params[k])]
        if diff:
            t.notes.append(f"rank {rank}: parameters differ ({diff[:2]})")
            ok = False
    return ok


def launcher_status(strategy: str) -> int:
    """What the job's top process returns: 75 from Lightning's launcher (rank 0), and from fsdp-strategies-ft
    both when it got the SIGTERM itself and when only its group's rank did (the group is preempted, not
    restarted, and no group finished: requeue). torchrun reports its workers' non-zero exit as its own failure
    (1); fsdp-strategies-ft reads their status from torchrun's failure summary."""
    return 1 if strategy == "hsdp" else PREEMPT_EXIT_CODE


def ok(t: Trial) -> bool:
    """No hang, every rank (and the launcher) exited with the requeue status, the newest checkpoint loads,
    the resume equals the uninterrupted run."""
    return (not t.hung and t.rc == launcher_status(t.strategy) and t.rank_rcs == [PREEMPT_EXIT_CODE] * 2
            and t.loadable is not False and t.exact is not False)


def summarise(trials: list[Trial]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in sorted({t.strategy for t in trials}):
        ts = [t for t in trials if t.strategy == strategy]
        stops = [t.stop_s for t in ts if t.stop_s is not None and not t.hung]
        out[strategy] = {
            "trials": len(ts), "hangs": sum(t.hung for t in ts),
            "launcher_exit": sorted({t.rc for t in ts}, key=str),
            "ranks_exit_75": f"{sum(c == PREEMPT_EXIT_CODE for t in ts for c in t.rank_rcs)}/{2 * len(ts)}",
            "stop_s_max": max(stops, default=None),
            "stop_s_median": statistics.median(stops) if stops else None,
            "exit_s_max": max((t.exit_s for t in ts if t.exit_s is not None), default=None),
            "preempt_checkpoints": sum(t.preempt_step is not None for t in ts),
            "mid_save": sum(t.mid_save for t in ts), "mid_val": sum(t.mid_val for t in ts),
            "loadable": f"{sum(bool(t.loadable) for t in ts)}/{sum(t.loadable is not None for t in ts)}",
            "resume_exact": f"{sum(bool(t.exact) for t in ts)}/{sum(t.exact is not None for t in ts)}",
            "watchdog_exits": sum("watchdog exit" in t.notes for t in ts),
            "failed_trials": sum(not ok(t) for t in ts),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--trials", type=int, default=10, help="per strategy (modes rotate all/one/launcher)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="keep the runs here (default: a temp folder)")
    parser.add_argument("--out", type=Path, default=None, help="write every trial and the summary as JSON")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="preempt-") as tmp:
        work = args.work or Path(tmp)
        for strategy in args.strategies.split(","):
            reference = reference_run(strategy, work)
            for i in range(args.trials):
                t = trial(strategy, MODES[i % len(MODES)], rng, work, reference)
                trials.append(t)
                print(json.dumps(asdict(t)), flush=True)
    summary = summarise(trials)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"trials": [asdict(t) for t in trials], "summary": summary}, indent=1))
    failed = [t for t in trials if not ok(t)]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
