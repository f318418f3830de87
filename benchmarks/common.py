"""Shared machinery of the benchmark suites: launching workers, interleaving, statistics, results.

A suite is a module ``benchmarks/suites/<name>.py`` with ``run(quick: bool, out_dir: Path, **opts) -> dict``
(``benchmarks/run.py`` finds it by name). Suites import this module as ``common`` after putting
``benchmarks/`` on ``sys.path`` (the runner does it; a standalone suite does it itself)::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import common

What it gives a suite:
- :func:`run_worker`: one real multi-process job (``torchrun``) of a worker script, returning the
  JSON the worker's rank 0 wrote; a failure raises :class:`WorkerError` with the job's output tail.
- :func:`interleave`: contenders run A B C A B C ... (``reps`` rounds) so a slow phase of a shared
  machine hits every contender alike; warm-up steps are excluded inside the workers. A round in
  which any contender failed is run again (up to :data:`ROUND_RETRIES` more times), so every
  contender's samples come from the same rounds; every failed attempt is kept with its stderr tail.
- :func:`summarise` / :func:`paired_ratio`: medians and ratios over the rounds both sides completed
  (the median of the per-round ratios, which cancels drift between rounds, plus the ratio of medians).
- :func:`write_result`: ``<out_dir>/<suite>-<device>.json`` with :func:`header` (device name, versions
  of torch / lightning / torchft, command line, time) and every raw sample.
- :func:`plot_timing`: the PNG of a timing suite; :func:`progress`: the tqdm progress bar.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from timing_stats import judge, median, paired_ratio, withhold_if_aa_failed

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "benchmarks"
RESULTS_DIR = BENCH_DIR / "results"
WORKERS_DIR = BENCH_DIR / "workers"

CPU_NOTE = ("CPU figures come from a small machine (gloo, OMP_NUM_THREADS=1 per rank, ranks may outnumber "
            "cores; host_load_at_start tells whether other work was running): absolute times are noisy; "
            "compare the interleaved ratios, not the times.")
# load average when the suite was started, before its own jobs: how busy the machine was with other work
LOAD_AT_START = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

# Example model sizes (LlamaLM keyword arguments) and the sequence length / global batch they run with.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"model": {"vocab_size": 64, "dim": 64, "n_layers": 2, "n_heads": 4}, "seq_len": 32,
             "global_batch": 8},
    "small": {"model": {"vocab_size": 128, "dim": 128, "n_layers": 2, "n_heads": 4}, "seq_len": 64,
              "global_batch": 16},
    "medium": {"model": {"vocab_size": 128, "dim": 256, "n_layers": 4, "n_heads": 8}, "seq_len": 64,
               "global_batch": 16},
    "large": {"model": {"vocab_size": 256, "dim": 384, "n_layers": 6, "n_heads": 8}, "seq_len": 64,
              "global_batch": 16},
    # GPU sizes (pass --sizes gpu-350m gpu-1b on a GPU machine; bf16-mixed recommended there)
    "gpu-350m": {"model": {"vocab_size": 2048, "dim": 1024, "n_layers": 24, "n_heads": 16}, "seq_len": 1024,
                 "global_batch": 16},
    "gpu-1b": {"model": {"vocab_size": 2048, "dim": 2048, "n_layers": 16, "n_heads": 16, "mlp_hidden": 5632},
               "seq_len": 1024, "global_batch": 16},
}


# ---------------------------------------------------------------------------------------------- device
def is_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def device_count() -> int:
    """Ranks one node can run: GPUs when there are some, else unlimited CPU processes (gloo)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1 << 30


def device_name() -> str:
    """Human-readable device, e.g. ``NVIDIA H100 80GB HBM3 x8`` or the CPU model and core count."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"


def device_slug() -> str:
    """File-name tag of the device: ``cpu``, or the GPU name lower-cased (``nvidia-h100-80gb-hbm3``)."""
    import torch

    if torch.cuda.is_available():
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")
    return "cpu"


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "lightning", "torchft", "fsdp_strategies"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = None
    return out


def header(suite: str, config: dict[str, Any]) -> dict[str, Any]:
    """The first keys of every result file: what ran, where, with which versions, and how to rerun it."""
    return {
        "suite": suite,
        "device": device_slug(),
        "device_name": device_name(),
        "versions": versions(),
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "host_cpu_count": os.cpu_count(),
        "host_load_at_start": LOAD_AT_START,
        "note": CPU_NOTE if not is_gpu() else "GPU figures; each contender runs in its own job.",
        "config": config,
    }


# ---------------------------------------------------------------------------------------------- workers
class WorkerError(RuntimeError):
    """A worker job failed; the message carries the command and the tail of its output.

    ``returncode`` (``None`` on a timeout) and ``stderr_tail`` (its last lines of stderr, or of stdout
    when stderr is empty) are kept apart so result files can list why a round was re-run.
    """

    def __init__(self, message: str, returncode: int | None = None, stderr_tail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stderr_tail = list(stderr_tail)


def _tail(text: str | bytes | None, lines: int) -> list[str]:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "").splitlines()[-lines:]


def failure_tail(exc: BaseException, lines: int = 12) -> list[str]:
    """The last lines that say why a job failed: a worker's stderr, else the exception's own text."""
    tail = getattr(exc, "stderr_tail", None)
    if tail:
        return list(tail)[-lines:]
    return _tail(f"{type(exc).__name__}: {exc}", lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                "NODE_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "examples"), env.get("PYTHONPATH", "")]
    )
    env.update(extra or {})
    return env


def worker_command(script: Path, nproc: int, args: Sequence[str], out: Path) -> list[str]:
    """The command line of one contender job: ``torchrun`` with ``nproc`` ranks of ``script``."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), *args, "--out", str(out)]


def run_worker(script: str | Path, nproc: int, args: Sequence[str], *, timeout: float = 900,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``torchrun --nproc_per_node NPROC WORKERS_DIR/script ARGS --out FILE`` and return FILE's JSON.

    A non-zero exit is a failure even when FILE was written (e.g. an abort at interpreter exit).
    """
    script = Path(script)
    if not script.is_absolute():
        script = WORKERS_DIR / script
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = worker_command(script, nproc, args, out)
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, env=worker_env(env), cwd=ROOT
            )
        except subprocess.TimeoutExpired as exc:
            raise WorkerError(f"timed out after {timeout}s: {shlex.join(cmd)}", None,
                              _tail(exc.stderr, 20) or _tail(exc.stdout, 20)) from exc
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            why = f"exit {proc.returncode}" if proc.returncode != 0 else "exit 0 without a result file"
            raise WorkerError(f"{why}: {shlex.join(cmd)}\n{tail}", proc.returncode,
                              _tail(proc.stderr, 20) or _tail(proc.stdout, 20))
        return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------- scheduling
def progress(total: int, desc: str) -> Any:
    """A tqdm bar on stderr (``disable`` when not wanted is the caller's choice)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="job", dynamic_ncols=True, file=sys.stderr)


# Extra attempts of a round in which a contender failed (``benchmarks/run.py --retries``).
ROUND_RETRIES = 2


class Rounds(dict):  # type: ignore[type-arg]
    """:func:`interleave`'s result: contender -> one result per round (a dict as before), plus ``failures``.

    ``orders`` lists the order each round ran its contenders in. ``failures`` lists every failed attempt:
    ``contender``, ``round``, ``attempt``, ``error`` (first line), ``returncode``, ``stderr_tail`` and
    ``outcome`` (``"round re-run"`` or, after the last attempt, ``"round incomplete"``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failures: list[dict[str, Any]] = []
        self.orders: list[list[str]] = []


def round_orders(contenders: Sequence[str], reps: int) -> list[list[str]]:
    """Each round's contender order, from a Williams design: a Latin square (every contender runs in every
    position once per cycle) in which every contender also runs right after every other one equally often --
    once per cycle of N rounds for an even number N of contenders, twice per 2N for an odd N (the square and
    its mirror). Rounds beyond a cycle repeat it. Two contenders: A B, B A; three: A B C, B C A, C A B, C B A,
    A C B, B A C."""
    n = len(contenders)
    if n == 0:
        return [[] for _ in range(reps)]
    base, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: every difference between neighbours once
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    rows = [[(b + r) % n for b in base] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[contenders[i] for i in rows[k % len(rows)]] for k in range(reps)]


def interleave(contenders: Sequence[str], reps: int, run_one: Callable[[str, int], Any],
               bar: Any | None = None, *, retries: int | None = None, warm_up: bool = False) -> Rounds:
    """Run ``run_one(contender, rep)`` for ``reps`` rounds in the orders of :func:`round_orders`; results per
    contender.

    The order changes every round (``orders`` lists each round's), so no contender always runs first -- on
    a shared machine the first job of a round met other conditions (a cold page cache, a quieter machine)
    than the rest -- nor always right after the same other one (a job that leaves the machine warm, its
    caches full or a process behind it). ``warm_up``: one untimed job of the first contender before the
    first round (its result, or its failure, is dropped), so the first timed job does not read the
    libraries from disk.

    ``run_one`` may raise. A round in which any contender raised is run again, every contender of it
    (up to ``retries`` more times, default :data:`ROUND_RETRIES`), and the attempt that completes it
    is kept: every contender then has a result from the same rounds, and per-round ratios compare
    jobs that ran side by side. A round still incomplete after the last attempt keeps that attempt,
    with the exception object in place of the failed results, so one failing contender does not stop
    the others. Every failed attempt is listed in the result's ``failures``.
    """
    retries = ROUND_RETRIES if retries is None else max(0, retries)
    results = Rounds({c: [] for c in contenders})
    if warm_up and contenders:
        try:
            run_one(contenders[0], 0)
        except Exception:  # a contender that fails fails its timed rounds too, where it is recorded
            pass
    for rep, order in enumerate(round_orders(contenders, reps)):
        results.orders.append(order)
        for attempt in range(retries + 1):
            got: dict[str, Any] = {}
            for name in order:
                if bar is not None:
                    bar.set_postfix_str(
                        f"{name} rep {rep + 1}/{reps}" + (f" try {attempt + 1}" if attempt else "")
                    )
                try:
                    got[name] = run_one(name, rep)
                except Exception as exc:  # recorded in the result file, shown in the summary
                    got[name] = exc
                if bar is not None:
                    bar.update(1)
            failed = [n for n in contenders if isinstance(got[n], BaseException)]
            last = not failed or attempt == retries
            for name in failed:
                exc = got[name]
                results.failures.append({
                    "contender": name, "round": rep, "attempt": attempt,
                    "error": (str(exc).splitlines() or [type(exc).__name__])[0],
                    "returncode": getattr(exc, "returncode", None), "stderr_tail": failure_tail(exc),
                    "outcome": "round incomplete" if last else "round re-run"})
            if last:
                break
            if bar is not None and getattr(bar, "total", None) is not None:
                bar.total += len(contenders)
                bar.refresh()
        for name in contenders:
            results[name].append(got[name])
    return results


# ---------------------------------------------------------------------------------------------- statistics
@dataclass
class RatioSpec:
    """``num / den`` with a target the ratio should not exceed (``None``: reported only); see
    ``timing_stats``."""

    num: str
    den: str
    target: float | None = None
    meaning: str = ""
    #: an A/A pair (the same configuration twice): its interval must hold 1.00, else the case gets no verdict
    aa: bool = False

    @property
    def name(self) -> str:
        return f"{self.num}/{self.den}"


# ---------------------------------------------------------------------------------------------- timing suites
@dataclass
class Contender:
    """One way of training the example: a worker script and its ``--contender`` name."""

    name: str
    script: str
    role: str  # "ours", "lightning" or "torch"
    description: str
    skip_reason: Callable[[int], str | None] = field(default=lambda ranks: None)
    replicate: Callable[[int], int] = field(default=lambda ranks: 1)
    #: the worker's ``--contender`` (default: ``name``); an A/A twin runs its original's
    worker_name: str | None = None


def size_config(size: str) -> dict[str, Any]:
    if size not in SIZES:
        raise ValueError(f"--sizes: unknown size {size!r}. Fix: choose from {sorted(SIZES)}.")
    return SIZES[size]


def worker_args(contender: Contender, size: str, ranks: int, steps: int, warmup: int, precision: str,
                seed: int = 0) -> list[str]:
    cfg = size_config(size)
    return ["--contender", contender.worker_name or contender.name, "--model", json.dumps(cfg["model"]),
            "--seq-len", str(cfg["seq_len"]),
            "--global-batch", str(cfg["global_batch"]), "--steps", str(steps), "--warmup", str(warmup),
            "--replicate", str(contender.replicate(ranks)), "--precision", precision, "--seed", str(seed)]


def summarise(runs: list[Any]) -> dict[str, Any]:
    """Per-contender record of one case: every raw sample, per-round medians, overall median, errors."""
    samples = [r["step_times_s"] if isinstance(r, dict) else None for r in runs]
    rep_medians = [median(s) if s else None for s in samples]
    ok = [r for r in runs if isinstance(r, dict)]
    return {
        "samples_s": samples,
        "warmup_samples_s": [r["warmup_times_s"] if isinstance(r, dict) else None for r in runs],
        "rep_medians_s": rep_medians,
        "median_s": median(x for s in samples if s for x in s),
        "loss_first": [r["loss_first"] for r in ok],
        "loss_last": [r["loss_last"] for r in ok],
        "memory_per_rank": [p["memory"] for p in ok[0]["per_rank"]] if ok else None,
        "per_rank_times_s": [[p["times_s"] for p in r["per_rank"]] for r in ok],
        "strategy_class": ok[0].get("strategy_class") if ok else None,
        "extras": [r.get("extras") or {} for r in ok],
        "errors": [str(r) for r in runs if isinstance(r, BaseException)],
    }


def suite_config(contenders: Sequence[Contender], sizes: Sequence[str], ranks: Sequence[int], reps: int,
                 steps: int, warmup: int, precision: str, quick: bool) -> dict[str, Any]:
    return {"sizes": {s: size_config(s) for s in sizes}, "ranks": list(ranks), "reps": reps, "steps": steps,
            "warmup": warmup, "precision": precision, "quick": quick,
            "contenders": {c.name: {"role": c.role, "description": c.description, "worker": c.script}
                           for c in contenders},
            "step_time": "wall time between consecutive optimizer-step ends, slowest rank, warm-up excluded"}


def collect_cases(suite: str, contenders: Sequence[Contender], *, sizes: Sequence[str], ranks: Sequence[int],
                  reps: int, steps: int, warmup: int, precision: str, timeout: float = 900,
                  show_progress: bool = True, warm_up: bool = True) -> list[dict[str, Any]]:
    """Run every (size, ranks) case, its contenders interleaved (order changed per round; ``warm_up``: one
    untimed job first, see :func:`interleave`); one record per case (no ratios yet)."""
    plan = []
    for size in sizes:
        size_config(size)
        for n in ranks:
            if n < 1:
                raise ValueError(f"--ranks: {n} is not a process count. Fix: positive integers, e.g. 1 2 4.")
            active, skipped = [], {}
            for c in contenders:
                reason = c.skip_reason(n) or (f"needs {n} devices, {device_count()} available"
                                              if n > device_count() else None)
                if reason:
                    skipped[c.name] = reason
                else:
                    active.append(c)
            plan.append((size, n, active, skipped))
    bar = progress(sum(len(a) * reps for _, _, a, _ in plan), suite) if show_progress else None
    cases = []
    try:
        for size, n, active, skipped in plan:
            by_name = {c.name: c for c in active}

            def run_one(name: str, rep: int, size: str = size, n: int = n, by_name: dict = by_name) -> dict:
                c = by_name[name]
                return run_worker(c.script, n, worker_args(c, size, n, steps, warmup, precision, seed=rep),
                                  timeout=timeout)

            runs = interleave([c.name for c in active], reps, run_one, bar, warm_up=warm_up)
            per: dict[str, Any] = {name: summarise(r) for name, r in runs.items()}
            for name, reason in skipped.items():
                per[name] = {"skipped": reason}
            case: dict[str, Any] = {"size": size, "ranks": n, "params": None, "contenders": per, "ratios": {},
                                    "failures": runs.failures, "orders": runs.orders}
            ok = [x for r in runs.values() for x in r if isinstance(x, dict)]
            if ok:
                case["params"] = ok[0]["params"]
            cases.append(case)
    finally:
        if bar is not None:
            bar.close()
    return cases


def run_timing_suite(
    suite: str,
    contenders: Sequence[Contender],
    ratios: Sequence[RatioSpec],
    *,
    sizes: Sequence[str],
    ranks: Sequence[int],
    reps: int,
    steps: int,
    warmup: int,
    precision: str,
    out_dir: Path,
    quick: bool,
    timeout: float = 900,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Step-time suite: cases from :func:`collect_cases`, the ratios, the JSON and the PNG."""
    config = suite_config(contenders, sizes, ranks, reps, steps, warmup, precision, quick)
    config["ratios"] = {r.name: {"target": r.target, "meaning": r.meaning, "aa": r.aa} for r in ratios}
    result = header(suite, config)
    cases = collect_cases(suite, contenders, sizes=sizes, ranks=ranks, reps=reps, steps=steps, warmup=warmup,
                          precision=precision, timeout=timeout, show_progress=show_progress,
                          warm_up=not quick)
    for case in cases:
        per = case["contenders"]
        for spec in ratios:
            a, b = per.get(spec.num, {}), per.get(spec.den, {})
            if "rep_medians_s" not in a or "rep_medians_s" not in b:
                continue
            ratio = paired_ratio(a["rep_medians_s"], b["rep_medians_s"])
            case["ratios"][spec.name] = judge(ratio, spec.target, spec.aa)
        case["aa_failed"] = withhold_if_aa_failed(case["ratios"])
    result["cases"] = cases
    result["summary"] = [
        {"size": c["size"], "ranks": c["ranks"], "ratio": name, "value": r["value"], "ci95": r["ci95"],
         "target": r["target"], "met": r["met"], "aa": r["aa"], "rounds": f"{r['rounds_paired']}/{reps}",
         **({"verdict": r["verdict"]} if "verdict" in r else {})}
        for c in cases for name, r in c["ratios"].items()
    ]
    path = write_result(suite, result, out_dir)
    result["json_path"] = str(path)
    result["png_path"] = str(plot_timing(result, path.with_suffix(".png")))
    return result


# ---------------------------------------------------------------------------------------------- output
def result_path(suite: str, out_dir: Path) -> Path:
    return Path(out_dir) / f"{suite}-{device_slug()}.json"


def write_result(suite: str, result: dict[str, Any], out_dir: Path) -> Path:
    """Write ``<out_dir>/<suite>-<device>.json`` atomically and return its path."""
    path = result_path(suite, out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)
    return path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bars_with_points(ax: Any, names: Sequence[str], medians: Sequence[float | None],
                     points: Sequence[Sequence[float | None]], colors: Sequence[str], *, ylabel: str,
                     rotation: int = 0, fontsize: float | None = None) -> None:
    """One bar per contender (its median) with every round's value drawn over it as a dot."""
    ax.bar(range(len(names)), [m or 0 for m in medians], color=list(colors))
    for i, pts in enumerate(points):
        vals = [v for v in pts if v is not None]
        ax.scatter([i] * len(vals), vals, s=10, color="black", zorder=3)
    ax.set_xticks(range(len(names)), names, rotation=rotation, fontsize=fontsize)
    ax.set_ylabel(ylabel)


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write (creating the folder) and close a results figure; returns its path."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_timing(result: dict[str, Any], path: Path) -> Path:
    """Per size: median step time per contender vs ranks (round medians as dots), and the ratios."""
    plt = _pyplot()
    sizes = list(dict.fromkeys(c["size"] for c in result["cases"]))
    names = list(result["config"]["contenders"])
    fig, axes = plt.subplots(2, max(1, len(sizes)), figsize=(5.5 * max(1, len(sizes)), 7.5), squeeze=False)
    for col, size in enumerate(sizes):
        cases = [c for c in result["cases"] if c["size"] == size]
        ranks = [c["ranks"] for c in cases]
        ax = axes[0][col]
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            xs, ys = [], []
            for j, case in enumerate(cases):
                rec = case["contenders"].get(name, {})
                if rec.get("median_s") is None:
                    continue
                x = j + (i - (len(names) - 1) / 2) * width
                xs.append(x)
                ys.append(rec["median_s"] * 1e3)
                dots = [m * 1e3 for m in rec["rep_medians_s"] if m is not None]
                ax.scatter([x] * len(dots), dots, s=8, color="black", zorder=3)
            if xs:
                ax.bar(xs, ys, width=width, label=name)
        ax.set_xticks(range(len(cases)), [f"{r} rank{'s' if r > 1 else ''}" for r in ranks])
        params = next((c["params"] for c in cases if c.get("params")), None)
        ax.set_title(f"{result['suite']} / {size}" + (f" ({params / 1e6:.2f}M params)" if params else ""))
        ax.set_ylabel("median step time (ms)")
        ax.legend(fontsize=7)
        ax = axes[1][col]
        ratio_names = list(dict.fromkeys(n for c in cases for n in c["ratios"]))
        for name in ratio_names:
            pts = [(c["ranks"], c["ratios"][name]["value"]) for c in cases
                   if name in c["ratios"] and c["ratios"][name]["value"] is not None]
            if pts:
                line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)[0]
                target = result["config"]["ratios"].get(name, {}).get("target")
                if target is not None:
                    ax.axhline(target, color=line.get_color(), linestyle=":", linewidth=1)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(sorted(set(ranks)))
        ax.set_xlabel("ranks")
        ax.set_ylabel("step-time ratio (dotted: target)")
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['suite']} on {result['device_name']} "
                 f"(torch {result['versions'].get('torch')}, "
                 f"lightning {result['versions'].get('lightning')})",
                 fontsize=9)
    return save_figure(fig, path)


def format_summary(result: dict[str, Any]) -> str:
    """Plain-text table of a suite's ratios (or its own ``summary`` rows) for the console."""
    rows = result.get("summary") or []
    lines = [f"{result.get('suite', '?')} ({result.get('device_name', '')}):"]
    if not rows:
        lines.append("  no ratios")
    for row in rows:
        if not isinstance(row, dict):
            lines.append(f"  {row}")
            continue
        value = row.get("value")
        shown = f"{value:.3f}" if isinstance(value, (int, float)) else str(value)
        target = row.get("target")
        if row.get("aa"):
            verdict = {None: "  A/A: no interval", True: "  A/A ok", False: "  A/A FAILED"}[row.get("met")]
            target = None
        else:
            verdict = "" if row.get("met") is None else ("  ok" if row["met"] else "  MISSED")
        if row.get("verdict"):
            verdict = ("  (no verdict: A/A failed)" if "A/A" in row["verdict"]
                       else "  undecided (interval spans it)")
        ci = row.get("ci95")
        shown += f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
        keys = " ".join(f"{k}={row[k]}" for k in ("size", "ranks") if k in row)
        rounds = f"  [{row['rounds']} rounds]" if row.get("rounds") else ""
        lines.append(f"  {keys:<22} {row.get('ratio', ''):<42} {shown:>7}"
                     + (f"  (target <= {target:.3f})" if isinstance(target,
                                                                    (int, float)) else "") + verdict + rounds)
    for case in result.get("cases") or []:
        if not isinstance(case, dict):
            continue
        listed = isinstance(case.get("failures"), list)
        for name, rec in (case.get("contenders") or {}).items():
            where = f"size={case.get('size')} ranks={case.get('ranks')} {name}"
            if isinstance(rec, dict) and rec.get("skipped"):
                lines.append(f"  skipped {where}: {rec['skipped']}")
            if listed:
                continue  # every failed attempt is listed below, with its stderr tail
            for err in (rec.get("errors") or []) if isinstance(rec, dict) else []:
                lines.append(f"  ERROR {where}: {err.splitlines()[0] if err else err}")
        for fail in (case.get("failures") or []) if listed else []:
            where = f"size={case.get('size')} ranks={case.get('ranks')} {fail.get('contender')}"
            kind = "ERROR" if fail.get("outcome") == "round incomplete" else "FAILED, round re-run:"
            error = str(fail.get("error"))
            lines.append(
                f"  {kind} {where} round {fail.get('round', 0) + 1} try {fail.get('attempt', 0) + 1}: "
                f"{error if len(error) <= 100 else error[:97] + '...'}"
            )
            lines.extend(f"      | {line}" for line in (fail.get("stderr_tail") or [])[-6:])
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- CLI
def add_common_options(parser: Any) -> None:
    """The options ``run.py`` and every standalone suite accept (``None``: the suite's default)."""
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps, 1-2 ranks (smoke test)")
    parser.add_argument("--sizes", nargs="+", default=None, help=f"model sizes from {sorted(SIZES)}")
    parser.add_argument("--ranks", nargs="+", type=int, default=None, help="process counts, e.g. 1 2 4")
    parser.add_argument("--reps", type=int, default=None, help="interleaved rounds per contender")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per job")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per job (excluded)")
    parser.add_argument("--precision", default=None, choices=("32-true", "bf16-mixed"))
    parser.add_argument("--contenders", nargs="+", default=None,
                        help="run only these contenders (each suite keeps the ones it has)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--retries", type=int, default=None,
                        help="extra attempts of a round in which a "
                             f"contender failed (default {ROUND_RETRIES})")


def apply_common_options(ns: Any) -> None:
    """Process-wide settings from the common options (``--retries``)."""
    global ROUND_RETRIES
    if getattr(ns, "retries", None) is not None:
        if ns.retries < 0:
            raise ValueError(f"--retries={ns.retries} is negative. Fix: 0 (no re-runs) or more.")
        ROUND_RETRIES = ns.retries


def suite_options(ns: Any) -> dict[str, Any]:
    return {k: getattr(ns, k) for k in ("sizes", "ranks", "reps", "steps", "warmup", "precision",
                                        "contenders")
            if getattr(ns, k, None) is not None}


def suite_main(run: Callable[..., dict[str, Any]], description: str,
               add_options: Callable[[Any], None] | None = None) -> None:
    """``python benchmarks/suites/<name>.py [--quick] ...``: run one suite without the runner.

    ``add_options`` adds the suite's own flags; each is passed to ``run`` under its ``dest`` name.
    """
    import argparse

    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_options(parser)
    shared = set(vars(parser.parse_args([])))  # the common options' names
    if add_options is not None:
        add_options(parser)
    ns = parser.parse_args()
    apply_common_options(ns)
    own = {k: v for k, v in vars(ns).items() if k not in shared}
    result = run(quick=ns.quick, out_dir=ns.out_dir, **suite_options(ns), **own)
    print(format_summary(result))
    print(f"wrote {result.get('json_path')} and {result.get('png_path')}")


def parse_worker_args(flags: Sequence[tuple[str, type]]) -> Any:
    """The arguments of a suite's ``--worker`` job (the suite passes every flag, so each is required)."""
    import argparse

    parser = argparse.ArgumentParser()
    for flag, kind in flags:
        parser.add_argument(flag, type=kind, required=True)
    parser.add_argument("--worker", action="store_true")
    return parser.parse_args()


def select(suite: str, names: Sequence[str], wanted: Sequence[str] | None) -> list[Contender]:
    """The suite's contenders, restricted to ``wanted`` (``--contenders``) when given."""
    chosen = [n for n in names if wanted is None or n in wanted]
    if not chosen:
        raise ValueError(f"--contenders {' '.join(wanted or [])}: none of them is in the {suite} suite. "
                         f"Fix: choose from {list(names)}.")
    return [contender(n) for n in chosen]


def pick(value: Any, quick: bool, quick_default: Any, default: Any) -> Any:
    """An explicit option wins; otherwise the quick or the full default."""
    if value is not None:
        return value
    return quick_default if quick else default


# ---------------------------------------------------------------------------------------------- contenders
#: a contender's A/A twin is named ``<name>_aa``
AA_SUFFIX = "_aa"


def aa_pair(name: str) -> RatioSpec:
    """The A/A ratio of ``name`` and its twin: its interval must hold 1.00 for the case's verdicts."""
    return RatioSpec(name, f"{name}{AA_SUFFIX}", None, f"A/A: {name} against itself (the machine's noise)",
                     aa=True)


def _ddp_hooks_missing(ranks: int) -> str | None:
    try:
        from lightning.pytorch.strategies import StrategyRegistry

        import fsdp_strategies  # noqa: F401  (registers the package's strategy names)
    except Exception as exc:
        return f"fsdp_strategies does not import: {exc}"
    if "ddp_hooks" not in StrategyRegistry:
        return ("this package's DDP strategy ('ddp_hooks', src/fsdp_strategies/strategies/ddp.py) is not "
                "registered yet; rerun the suite once it is")
    return None


def _lightning_fsdp_needs_gpu(ranks: int) -> str | None:
    if is_gpu():
        return None
    return ("Lightning's FSDPStrategy (FSDP1) refuses CPU: 'The strategy `fsdp` requires a GPU accelerator'; "
            "it is compared on GPUs only")


def _hsdp_replicate(ranks: int) -> int:
    """Two replica groups when the rank count allows it (2 x ranks/2), else one."""
    return 2 if ranks >= 4 and ranks % 2 == 0 else 1


def _hsdp_needs_4(ranks: int) -> str | None:
    return None if _hsdp_replicate(ranks) > 1 else f"a 2-D mesh needs >= 4 ranks (2 x ranks/2); got {ranks}"


def contender(name: str) -> Contender:
    """The catalogue of contenders every suite draws from (see benchmarks/README.md). ``<name>_aa`` is
    ``<name>`` once more, the A/A twin a timing suite compares it with (``timing_stats``)."""
    if name.endswith(AA_SUFFIX):
        original = contender(name[: -len(AA_SUFFIX)])
        return dataclasses.replace(original, name=name, worker_name=original.worker_name or original.name,
                                   description=f"{original.name} again: the suite's A/A twin (the same job)")
    catalogue = {
        "fsdp2": Contender("fsdp2", "lightning_fit.py", "ours",
                           "Trainer(strategy=FSDP2Strategy(block_class_names=['TransformerBlock']))"),
        "fsdp2_no_autocast": Contender(
            "fsdp2_no_autocast", "lightning_fit.py", "ours",
            "FSDP2Strategy(autocast=False): bf16-mixed by the MixedPrecisionPolicy alone "
            "(the autocast cost)"),
        "fsdp2_hang_watchdog": Contender(
            "fsdp2_hang_watchdog", "lightning_fit.py", "ours",
            "fsdp2 + callbacks=[HangWatchdog(timeout_s=300, poll_s=1)] (its cost while nothing hangs)"),
        "hsdp": Contender("hsdp", "lightning_fit.py", "ours",
                          "Trainer(strategy=HSDPStrategy(replicate_degree=2, shard_degree=ranks/2))",
                          skip_reason=_hsdp_needs_4, replicate=_hsdp_replicate),
        "ddp_hooks": Contender("ddp_hooks", "lightning_fit.py", "ours",
                               "Trainer(strategy='ddp_hooks') (default hook)",
                               skip_reason=_ddp_hooks_missing),
        "lightning_ddp": Contender("lightning_ddp", "lightning_fit.py", "lightning",
                                   "Trainer(strategy='ddp')"),
        "lightning_fsdp": Contender("lightning_fsdp", "lightning_fit.py", "lightning",
                                    "Trainer(strategy=FSDPStrategy(auto_wrap_policy={TransformerBlock})) "
                                    "(FSDP1)",
                                    skip_reason=_lightning_fsdp_needs_gpu),
        "lightning_model_parallel": Contender(
            "lightning_model_parallel", "lightning_fit.py", "lightning",
            "Trainer(strategy=ModelParallelStrategy()) + fully_shard written by hand in configure_model"),
        "torch_ddp": Contender("torch_ddp", "torch_loop.py", "torch",
                               "plain torch loop, DistributedDataParallel"),
        "torch_fsdp2": Contender("torch_fsdp2", "torch_loop.py", "torch",
                                 "plain torch loop, fully_shard per block + root, 1-D mesh"),
        "torch_hsdp": Contender("torch_hsdp", "torch_loop.py", "torch",
                                "plain torch loop, fully_shard on the same 2-D (replicate, shard) mesh",
                                skip_reason=_hsdp_needs_4, replicate=_hsdp_replicate),
    }
    return catalogue[name]


# ---------------------------------------------------------------------------------------------- report
def has_case_table(result: dict[str, Any]) -> bool:
    """Whether ``result`` is a timing or memory suite whose cases :func:`case_table` renders (the cases of
    other suites, e.g. sac and mfu, hold other records: their own summaries describe them)."""
    cases = result.get("cases") if isinstance(result, dict) else None  # the matrix's file is a list of cells
    if not isinstance(cases, list) or not cases or "contenders" not in cases[0]:
        return False
    records = [rec for c in cases for rec in c["contenders"].values()]
    return result.get("suite") == "memory" or any(
        isinstance(rec, dict) and "median_s" in rec for rec in records
    )


def case_table(result: dict[str, Any]) -> list[str]:
    """Markdown table of a timing or memory suite's cases: each contender's median (or worst-rank memory) per
    case and the ratios with their targets, then the contenders that were skipped and why.

    One renderer for ``run.py --report`` and the documentation site (docs/hooks/generated.py)."""
    cases = result["cases"]
    names = [n for n in result.get("config", {}).get("contenders", {})
             if any("skipped" not in c["contenders"].get(n, {"skipped": 1}) for c in cases)]
    ratio_names = list(dict.fromkeys(r for c in cases for r in c.get("ratios", {})))
    memory = result.get("suite") == "memory"
    unit = "worst-rank MiB" if memory else "median ms"
    head = ["size (params)", "ranks", *[f"`{n}` ({unit})" for n in names], *ratio_names]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        row = [
            f"{c['size']} ({c['params'] / 1e6:.2f}M)" if c.get("params") else str(c["size"]),
            str(c["ranks"]),
        ]
        for n in names:
            rec = c["contenders"].get(n, {})
            if memory:
                val = (c.get("worst_rank_bytes", {}).get(n) or {}).get("total_bytes")
                row.append(f"{val / 2**20:.2f}" if val else "-")
            else:
                row.append(f"{rec['median_s'] * 1e3:.1f}" if rec.get("median_s") else "-")
        for r in ratio_names:
            ratio = c.get("ratios", {}).get(r)
            if not ratio or ratio.get("value") is None:
                row.append("-")
                continue
            mark = "" if ratio.get("met") is None else (" met" if ratio["met"] else " **missed**")
            if ratio.get("aa"):
                mark = {None: "", True: " A/A ok", False: " **A/A failed**"}[ratio.get("met")]
            elif ratio.get("verdict"):
                undecided = ratio["verdict"].startswith("undecided")
                mark = " undecided" if undecided else " no verdict (A/A failed)"
            has_target = ratio.get("target") is not None and not ratio.get("aa")
            tgt = f" (<= {ratio['target']:.3f})" if has_target else ""
            ci = ratio.get("ci95")
            interval = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
            row.append(f"{ratio['value']:.3f}{interval}{tgt}{mark}")
        out.append("| " + " | ".join(row) + " |")
    skipped = sorted({f"`{n}`: {rec['skipped']}" for c in cases for n, rec in c["contenders"].items()
                      if "skipped" in rec and "2-D mesh" not in rec["skipped"]})
    if skipped:
        out.append("")
        out.extend(f"Skipped {s}" for s in skipped)
    return out


def markdown_report(paths: Sequence[Path]) -> str:
    """Markdown tables of result files (timing and memory suites), printed by ``run.py --report``."""
    out: list[str] = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        if not has_case_table(result):
            continue
        cfg = result.get("config", {})
        v = result.get("versions", {})
        out.append(f"### {result['suite']} -- {result['device_name']}")
        out.append("")
        out.append(
            f"`{result.get('command', '')}` -- torch {v.get('torch')}, lightning {v.get('lightning')}, "
            f"{cfg.get('reps')} interleaved rounds x "
            f"{cfg.get('steps')} steps (+{cfg.get('warmup')} warm-up), "
            f"{cfg.get('precision')}, {result.get('created_utc')}"
        )
        out.append("")
        out.extend(case_table(result))
        out.append("")
        out.append(f"![{result['suite']}]({Path(path).with_suffix('.png').name})")
        out.append("")
    return "\n".join(out)
