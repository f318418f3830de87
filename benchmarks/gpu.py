"""GPU harness: one command that measures this package on whatever single CUDA device it finds.

    python benchmarks/gpu.py                       # every section, on cuda:0 (about 20-30 min on an H100)
    python benchmarks/gpu.py --sections contenders # a subset; the other sections of an existing result stay
    python benchmarks/gpu.py --quick               # CPU smoke mode (tiny model, gloo), ~70 s CPU time
    python benchmarks/gpu.py --report FILE.json    # markdown tables of a result

Sections, in the priority order of ../shared/GPU_CHECKLIST.md (smoke, contenders, sac, memory, compile,
pretrained); each is guarded, so a failure is recorded with its error tail and the rest go on:

``contenders``  the example at ~1B parameters (``configs/fsdp2_gpu_1b.yaml``'s model, sequence length
                and per-device batch), bf16-mixed, world size 1: ``fsdp2`` vs Lightning
                ``ModelParallelStrategy`` (hand-written ``fully_shard``) vs Lightning ``fsdp`` (FSDP1) vs a
                plain torch FSDP2 loop, interleaved rounds (the fsdp suite's workers and ratio targets).
                Per contender: step time, tokens/s, peak memory, MFU and HFU as ``MFUMonitor`` logged them
                (Lightning contenders), and torchtitan's formula-based MFU computed here from the same run's
                tokens/s: ``6 * N_non_embedding + 12 * L * H * Q * T`` FLOPs per token.
``compile``     the same with ``compile_blocks: true`` (``fsdp2``) against the plain loop compiling the same
                blocks, and against uncompiled ``fsdp2``.
``sac``         activation checkpointing on the same model: peak CUDA memory and step time for ``none``,
                ``selective_op``, every-other-matmul (``save_every_nth_matmul=2``), ``selective_layer``,
                ``full`` (the sac suite's measurement, one process).
``memory``      peak CUDA memory per strategy (the contenders' runs), ``cpu_offload`` on and off, and the
                largest size of the example's family that fits on the device with and without offload
                (a bisection over ``LADDER``; a probe is a real 1-step ``fsdp2`` run, an OOM means "does
                not fit"; sizes whose offloaded state cannot fit in host RAM are not started).
``smoke``       the NCCL code paths at world size 1, which must run, not only import: ``ddp_hooks`` with every
                comm hook, ``ft_hsdp`` with one replica group and a local lighthouse, the straggler
                detector's CUDA-event timing next to ``torch.cuda.Event`` measured by hand, and the
                MFU peak lookup on the real device name.

Writes ``<out-dir>/gpu-<device>.json`` (every raw sample, per-section status, error tails, skip
reasons, versions, command), ``gpu-<device>.png`` (step-time bars, MFU, peak memory) and
``gpu-<device>-sac.png`` (memory vs throughput of the checkpointing modes), and prints one short table.

``--quick`` runs the same code paths on the CPU (gloo, ``CUDA_VISIBLE_DEVICES=""``) with a tiny model,
``aot_eager`` instead of inductor for the compile section, and a nominal peak of 1 TFLOP/s
(``FSDP_STRATEGIES_PEAK_FLOPS``) so the MFU arithmetic runs; every CUDA-only part records why it was
skipped. Its figures say nothing about speed. It writes to ``outputs/gpu-quick/`` unless ``--out-dir``.

A machine without network access (such as one whose image lacks ``torchft`` and ``jsonargparse``):
``python benchmarks/gpu_pack.py`` on a machine with network fills ``.whl/`` and prints the one-line
install-and-run command for the GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import gpu_report  # noqa: E402
from gpu_report import markdown, plot, plot_sac  # noqa: E402  (the harness's public report functions)

# The priority order of ../shared/GPU_CHECKLIST.md: with --budget-s, later sections are the ones skipped.
SECTIONS = ("smoke", "contenders", "sac", "memory", "compile", "pretrained")
EXAMPLE_CONFIG = BENCH.parent / "configs" / "fsdp2_gpu_1b.yaml"
QUICK_OUT_DIR = BENCH.parent / "outputs" / "gpu-quick"
QUICK_PEAK_FLOPS = 1e12  # nominal, labelled as such: lets the MFU arithmetic run on a CPU
MFU_RATIO_SLACK = 5e-4  # see mfu_ratio_target
ACCUMULATE = 4  # the memory section's accumulate_grad_batches run (against the contenders' 1)
OOM_PATTERNS = ("out of memory", "outofmemoryerror", "cuda error: out of memory", "cudaerrormemoryallocation")

# The example's family (Llama shapes, the example's vocabulary and sequence length, 8 KV heads): the
# memory section bisects over it. "1b" is configs/fsdp2_gpu_1b.yaml's own model.
LADDER: dict[str, dict[str, int]] = {
    "350m": {"dim": 1024, "n_layers": 24, "n_heads": 16, "n_kv_heads": 8, "mlp_hidden": 2816},
    "1b": {},  # the example as configured
    "3b": {"dim": 3072, "n_layers": 28, "n_heads": 24, "n_kv_heads": 8, "mlp_hidden": 8192},
    "7b": {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "mlp_hidden": 14336},
    "13b": {"dim": 5120, "n_layers": 40, "n_heads": 40, "n_kv_heads": 8, "mlp_hidden": 17920},
    "34b": {"dim": 8192, "n_layers": 48, "n_heads": 64, "n_kv_heads": 8, "mlp_hidden": 22016},
    "70b": {"dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "mlp_hidden": 28672},
}

CONTENDERS = ("fsdp2", "torch_fsdp2", "lightning_model_parallel")
OPTIONAL_CONTENDERS = ("lightning_fsdp",)  # FSDP1: only with --contenders (a budgeted run has no time for it)
# Seconds a section is expected to take before anything was measured (GPU, the 1B example; --quick on a CPU).
# Once jobs have run, the measured median wall time of a job replaces JOB_S. See section_estimate.
JOB_S = {"gpu": 45.0, "quick": 25.0}
FIXED_S = {"smoke": (150.0, 150.0), "sac": (90.0, 40.0), "pretrained": (150.0, 60.0),
           "compile_extra": (90.0, 30.0)}
BISECT_PROBE_S = 90.0
SMOKE_CAP = 1.5  # the smoke section stops after this many times its estimate (a hung run is killed there)
COMPILED = {"fsdp2+compile": "fsdp2", "torch_fsdp2+compile": "torch_fsdp2"}
OFFLOADABLE = ("fsdp2", "torch_fsdp2", "lightning_fsdp")  # contenders with a cpu_offload switch


# ---------------------------------------------------------------------------------------------- pure helpers
def example_model(config: Path = EXAMPLE_CONFIG) -> dict[str, Any]:
    """The example's model kwargs, sequence length and per-device batch, read from its YAML."""
    import yaml

    cfg = yaml.safe_load(Path(config).read_text())
    model = {k: v for k, v in cfg["model"].items()
             if k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden")}
    return {"model": model, "seq_len": int(cfg["data"]["seq_len"]), "batch": int(cfg["data"]["batch_size"]),
            "config": str(Path(config).relative_to(BENCH.parent)) if Path(config).is_relative_to(BENCH.parent)
            else str(config)}


def quick_model() -> dict[str, Any]:
    """A tiny model with the example's shape features (grouped-query attention)."""
    return {"model": {"vocab_size": 64, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
            "seq_len": 32, "batch": 8, "config": "tiny (--quick)"}


def mlp_hidden(model: dict[str, Any]) -> int:
    """``LlamaLM``'s default SwiGLU width when the config leaves it out."""
    return int(model.get("mlp_hidden") or int(8 * model["dim"] / 3 / 64 + 0.999) * 64)


def llama_params(model: dict[str, Any]) -> dict[str, int]:
    """Parameter counts of the example's ``Llama`` from its shape (no model is built)."""
    v, d, layers, heads = model["vocab_size"], model["dim"], model["n_layers"], model["n_heads"]
    kv = model.get("n_kv_heads") or heads
    head_dim = d // heads
    per_block = 2 * d + d * d + 2 * d * kv * head_dim + d * d + 3 * d * mlp_hidden(model)
    embedding = v * d
    total = embedding + layers * per_block + d + v * d  # embedding, blocks, final norm, LM head
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding}


def torchtitan_flops_per_token(model: dict[str, Any], seq_len: int) -> int:
    """torchtitan's estimate: ``6 * N + 12 * L * H * Q * T`` (N without the embedding, Q the head dim)."""
    heads = model["n_heads"]
    return (
        6 * llama_params(model)["non_embedding"]
        + 12 * model["n_layers"] * heads * (model["dim"] // heads) * seq_len
    )


def mfu_ratio_target(model: dict[str, Any], seq_len: int) -> float:
    """Lowest acceptable MFUMonitor MFU / torchtitan MFU on identical timing (= counted / formula FLOPs).

    The formula's ``6 N`` also books the RMSNorm weights (``2 L d + d``) as matmul parameters, which no
    kernel multiplies, so an exact count lands that share below 1 (0.007% for the 1B example, 0.3% for
    the tiny --quick model); anything further below (minus ``MFU_RATIO_SLACK``) means FLOPs the counter
    missed, e.g. an attention kernel without a FLOP formula.
    """
    norm = (2 * model["n_layers"] + 1) * model["dim"]
    return 1 - 6 * norm / torchtitan_flops_per_token(model, seq_len) - MFU_RATIO_SLACK


def bisect_largest(n: int, fits: Callable[[int], bool | None], lo: int = -1) -> tuple[int, list[int]]:
    """Largest ``i < n`` with ``fits(i)``, assuming fitting is monotone; ``lo``: an index known to fit.

    ``fits`` returns None when a probe says nothing (a non-OOM failure): the search stops there and
    the answer is the largest index known to fit. Returns (index or -1, probed indices in order).
    """
    hi, probed = n, []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        probed.append(mid)
        verdict = fits(mid)
        if verdict is None:
            break
        if verdict:
            lo = mid
        else:
            hi = mid
    return lo, probed


def host_bytes_offloaded(params: int) -> int:
    """Host memory ``cpu_offload`` needs at least: fp32 parameters, gradients and two AdamW moments."""
    return 16 * params


def device_bytes_unoffloaded(params: int) -> int:
    """Device memory ``fsdp2`` without offload needs at least (world size 1): the same 16 bytes per
    parameter."""
    return 16 * params


def host_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def is_oom(text: str) -> bool:
    low = text.lower()
    return any(p in low for p in OOM_PATTERNS)


def error_tail(exc: BaseException, lines: int = 30) -> list[str]:
    """The last lines of the traceback (a worker's error carries its job's output tail)."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()[-lines:]


def fit_reps(planned: int, jobs: int, job_s: float, left_s: float) -> int:
    """Rounds of ``jobs`` jobs of ``job_s`` seconds each that fit in ``left_s`` (at least 1, at most
    ``planned``).

    Interleaved ratios need paired rounds, so rounds are cut, not jobs; one round is always tried (a section
    is only started when its estimate, one round at least, fits)."""
    if jobs <= 0 or job_s <= 0:
        return planned
    return max(1, min(planned, int(left_s // (jobs * job_s))))


def budget_reason(estimate_s: float, plan: Any) -> str:
    return (
        f"--budget-s {plan.budget_s:g}: estimated {estimate_s:.0f}s, {max(0.0, plan.left_s()):.0f}s left; "
        "not started (a run cut off half-way would measure nothing)"
    )


def section_estimate(name: str, plan: Any) -> float:
    """Seconds the section needs at least (its smallest useful form): what the budget check compares."""
    job, quick = plan.job_s(), plan.quick
    if name == "contenders":
        return len(plan.contenders) * job  # one round; more rounds only as the budget allows (fit_reps)
    if name == "compile":
        return 2 * (job + FIXED_S["compile_extra"][quick])
    if name == "memory":
        return 2 * job  # the offload run; the rest only as the budget allows, job by job
    return FIXED_S[name][quick]


# ---------------------------------------------------------------------------------------------- plan
class Plan:
    """What one invocation runs: the device, the model, sizes of each section."""

    def __init__(self, ns: argparse.Namespace) -> None:
        import torch

        import common

        self.quick: bool = ns.quick
        self.started = time.monotonic()
        self.budget_s: float | None = ns.budget_s
        self.job_walls: list[float] = []  # wall seconds of every single-device job so far (for the estimates)
        self.contenders: list[str] = list(ns.contenders or CONTENDERS)
        self.wanted: list[str] = [s for s in SECTIONS if not ns.sections or s in ns.sections]
        self.gpu = torch.cuda.is_available()
        self.device_count = torch.cuda.device_count() if self.gpu else 0
        self.device_name = torch.cuda.get_device_name(0) if self.gpu else common.device_name()
        self.total_device_bytes = torch.cuda.get_device_properties(0).total_memory if self.gpu else None
        self.example = quick_model() if self.quick else example_model(ns.config)
        self.precision = "bf16-mixed"  # --quick too: the GPU run's precision paths, on the CPU
        self.reps = ns.reps or (1 if self.quick else 3)
        self.steps = ns.steps or (2 if self.quick else 10)
        self.warmup = ns.warmup if ns.warmup is not None else (1 if self.quick else 3)
        self.compile_reps = ns.reps or (1 if self.quick else 2)
        # compiling settles
        self.compile_warmup = ns.warmup if ns.warmup is not None else (1 if self.quick else 5)
        self.compile_backend = "aot_eager" if self.quick else None
        self.timeout = ns.job_timeout or (300 if self.quick else 480)
        self.ladder = list(ns.ladder or LADDER)
        self.out_dir = Path(ns.out_dir or (QUICK_OUT_DIR if self.quick else common.RESULTS_DIR))
        self.env: dict[str, str] = {}
        if self.gpu and self.device_count > 1:  # one device: the first one visible
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            self.env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[0] if visible else "0"
        if self.quick:
            self.env.update({"CUDA_VISIBLE_DEVICES": "", "FSDP_STRATEGIES_PEAK_FLOPS": str(QUICK_PEAK_FLOPS)})
        elif "OMP_NUM_THREADS" not in os.environ:
            # one process owns the machine (the runner's default of 1 thread is for many ranks on few cores):
            # the CPU side of cpu_offload (AdamW on offloaded state) needs the cores
            self.env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)

    def left_s(self) -> float:
        """Seconds left of --budget-s (infinite without one)."""
        if self.budget_s is None:
            return float("inf")
        return self.budget_s - (time.monotonic() - self.started)

    def job_timeout(self) -> float:
        """A job's timeout: the per-job limit, and never past the budget's end."""
        return max(1.0, min(self.timeout, self.left_s()))

    def job_s(self) -> float:
        """Expected wall seconds of one single-device job: measured so far, else the default."""
        import common

        return common.median(self.job_walls) or JOB_S["quick" if self.quick else "gpu"]

    def config(self) -> dict[str, Any]:
        ex = self.example
        return {
            "quick": self.quick, "device_name": self.device_name,
            "device_total_bytes": self.total_device_bytes,
            "visible_devices": self.device_count, "model": ex["model"], "model_source": ex["config"],
            "params": llama_params(ex["model"]), "seq_len": ex["seq_len"], "batch_per_device": ex["batch"],
            "world_size": 1, "precision": self.precision, "reps": self.reps, "steps": self.steps,
            "warmup": self.warmup, "compile": {"reps": self.compile_reps, "warmup": self.compile_warmup,
                        "backend": self.compile_backend or "inductor (torch.compile default)"},
            "job_timeout_s": self.timeout, "worker_env": self.env, "budget_s": self.budget_s,
            "contenders": self.contenders,
            "peak_flops_note": (f"--quick: nominal {QUICK_PEAK_FLOPS:g} "
                                "FLOP/s via FSDP_STRATEGIES_PEAK_FLOPS, not "
                                "this CPU's peak; the MFU figures only show that the arithmetic runs")
            if self.quick else "dense bf16 peak from fsdp_strategies.flops.peaks by device name",
            "step_time": "wall time between consecutive optimizer-step "
                         "ends (CUDA-synchronised), warm-up excluded",
        }

    def worker_args(self, contender: str, *, steps: int, warmup: int, seed: int = 0,
                    model: dict[str, Any] | None = None, extra: Sequence[str] = ()) -> list[str]:
        ex = self.example
        return ["--contender", contender, "--model", json.dumps(model or ex["model"]), "--seq-len",
                str(ex["seq_len"]),
                "--global-batch", str(ex["batch"]), "--steps", str(steps), "--warmup", str(warmup),
                "--precision", self.precision, "--seed", str(seed), *extra]


# ---------------------------------------------------------------------------------------------- timing
# sections
def _job(plan: Plan, base: str, args: list[str]) -> dict[str, Any]:
    """One single-device job of the contender ``base``'s worker (torchrun, 1 process), its JSON result."""
    import common

    t0 = time.perf_counter()
    try:
        return common.run_worker(
            common.contender(base).script, 1, args, timeout=plan.job_timeout(), env=plan.env
        )
    finally:
        plan.job_walls.append(time.perf_counter() - t0)


def _contender_record(plan: Plan, runs: list[Any]) -> dict[str, Any]:
    """The fsdp suite's per-contender record plus throughput, MFU (both definitions) and peak memory."""
    import common

    rec = common.summarise(runs)
    ok = [r for r in runs if isinstance(r, dict)]
    ex = plan.example
    tokens_per_step = ex["batch"] * ex["seq_len"]
    per_token = torchtitan_flops_per_token(ex["model"], ex["seq_len"])
    median = rec["median_s"]
    peak = next((r.get("peak_flops") for r in ok if r.get("peak_flops")), None)
    rec["tokens_per_s"] = tokens_per_step / median if median else None
    rec["peak_flops"] = peak
    rec["peak_flops_source"] = next((r.get("peak_flops_source") for r in ok), None)
    tt = {"flops_per_token": per_token, "tflops": None, "mfu": None,
          "formula": "6 * N_non_embedding + 12 * n_layers * n_heads * head_dim * seq_len per token"}
    if rec["tokens_per_s"]:
        tt["tflops"] = rec["tokens_per_s"] * per_token / 1e12
        tt["mfu"] = rec["tokens_per_s"] * per_token / peak if peak else None
        tt["mfu_per_round"] = [tokens_per_step / m * per_token / peak if m and peak else None
                               for m in rec["rep_medians_s"]]
    rec["torchtitan"] = tt
    monitors = [r.get("mfu_monitor") for r in ok if r.get("mfu_monitor")]
    if monitors:
        rec["mfu_monitor_rounds"] = monitors
        rec["mfu_monitor"] = {key: common.median(m[key] for m in monitors if m.get(key) is not None)
                              for key in ("mfu", "hfu", "tflops_per_device", "tokens_per_sec_per_device")}
        rec["mfu_monitor"].update({k: monitors[0].get(k) for k in ("flop_source", "model_flops_per_batch",
                                                                   "hardware_flops_per_batch", "peak_flops")})
        # torchtitan's MFU on MFUMonitor's own timing: the two definitions compared on identical seconds
        mon_tokens = rec["mfu_monitor"].get("tokens_per_sec_per_device")
        if mon_tokens and peak:
            tt["mfu_at_mfu_monitor_timing"] = mon_tokens * per_token / peak
            if rec["mfu_monitor"].get("mfu"):
                rec["mfu_monitor"]["mfu_over_torchtitan"] = (
                    rec["mfu_monitor"]["mfu"] / tt["mfu_at_mfu_monitor_timing"]
                )
    mem = (rec.get("memory_per_rank") or [{}])[0]
    rec["peak_memory_bytes"] = mem.get("peak_cuda_bytes") if plan.gpu else mem.get("max_rss_bytes")
    rec["variant"] = ok[0].get("variant") if ok else None
    rec["precision_plugin"] = ok[0].get("precision_plugin") if ok else None
    return rec


def _ratios(per: dict[str, Any], specs: Sequence[Any]) -> dict[str, Any]:
    import common

    out = {}
    for spec in specs:
        a, b = per.get(spec.num, {}), per.get(spec.den, {})
        if not a.get("rep_medians_s") or not b.get("rep_medians_s"):
            continue
        ratio = common.paired_ratio(a["rep_medians_s"], b["rep_medians_s"])
        ratio.update({"target": spec.target, "meaning": spec.meaning,
                      "met": None
                          if spec.target is None or ratio["value"] is None
                              else ratio["value"] <= spec.target})
        out[spec.name] = ratio
    return out


def _timing_section(plan: Plan, jobs: dict[str, tuple[str, list[str]]], skipped: dict[str, str], reps: int,
                    specs: Sequence[Any], label: str) -> dict[str, Any]:
    """Interleaved rounds of single-device jobs; per contender records and ratios."""
    import common

    bar = common.progress(len(jobs) * reps, f"gpu/{label}")
    try:
        def run_one(name: str, rep: int) -> dict[str, Any]:
            base, extra = jobs[name]
            steps = plan.steps
            warmup = plan.compile_warmup if label == "compile" else plan.warmup
            return _job(plan, base, plan.worker_args(base, steps=steps, warmup=warmup, seed=rep, extra=extra))

        runs = common.interleave(list(jobs), reps, run_one, bar)
    finally:
        bar.close()
    per: dict[str, Any] = {name: _contender_record(plan, r) for name, r in runs.items()}
    for name, reason in skipped.items():
        per[name] = {"skipped": reason}
    failed = sorted(n for n, r in per.items() if r.get("errors"))
    return {"contenders": per, "ratios": _ratios(per, specs), "failed_contenders": failed,
            "status": "ok" if not failed else "failed" if len(failed) == len(jobs) else "partial"}


def section_contenders(plan: Plan, done: dict[str, Any]) -> dict[str, Any]:
    import common
    from suites import fsdp

    jobs: dict[str, tuple[str, list[str]]] = {}
    skipped: dict[str, str] = {}
    for name in plan.contenders:
        reason = common.contender(name).skip_reason(1)
        if reason:
            skipped[name] = reason
            continue
        jobs[name] = (name, ["--mfu"] if common.contender(name).script == "lightning_fit.py" else [])
    # more rounds only where the next checklist sections (sac, memory) keep their minimum
    reserve = sum(section_estimate(n, plan) for n in ("sac", "memory") if n in plan.wanted)
    reps = fit_reps(plan.reps, len(jobs), plan.job_s(), plan.left_s() - reserve)
    out = _timing_section(plan, jobs, skipped, reps, fsdp.RATIOS, "contenders")
    if reps < plan.reps:
        out["reps_cut_by_budget"] = {"planned": plan.reps, "run": reps, "job_s_estimate": plan.job_s()}
    mon = out["contenders"].get("fsdp2", {}).get("mfu_monitor") or {}
    if mon.get("mfu_over_torchtitan") is not None:
        target = round(mfu_ratio_target(plan.example["model"], plan.example["seq_len"]), 5)
        out["ratios"]["fsdp2 MFU: MFUMonitor / torchtitan formula"] = {
            "value": mon["mfu_over_torchtitan"], "target": target, "direction": ">=",
            "met": mon["mfu_over_torchtitan"] >= target,
            "meaning": "MFUMonitor's MFU (FLOPs counted on the first "
                       "batch) over torchtitan's formula-based MFU, both on "
                       "MFUMonitor's timing of the same run (the issue's "
                       "target: at or above). The formula's 6N also "
                       "counts the RMSNorm weights, which no matmul "
                       "multiplies: the target is 1 minus their share "
                       "minus 0.05% (mfu_ratio_target)"}
    return out


def section_compile(plan: Plan, done: dict[str, Any]) -> dict[str, Any]:
    import common

    backend = ["--compile-backend", plan.compile_backend] if plan.compile_backend else []
    jobs = {"fsdp2+compile": ("fsdp2", ["--compile-blocks", *backend, "--mfu"]),
            "torch_fsdp2+compile": ("torch_fsdp2", ["--compile-blocks", *backend])}
    skipped = {}
    if plan.quick:  # saves a job in CI; the uncompiled path ran in the contenders section
        skipped["fsdp2"] = (
            "--quick: the uncompiled baseline runs here in the full mode only (it ran in contenders)"
        )
    else:
        jobs["fsdp2"] = ("fsdp2", ["--mfu"])
    specs = (
        common.RatioSpec(
            "fsdp2+compile", "torch_fsdp2+compile", 1.03, "ours / plain torch, both compiled per block"
        ),
        common.RatioSpec("fsdp2+compile", "fsdp2", None, "what compile_blocks gives ours (below 1: faster)"),
    )
    per_job = plan.job_s() + FIXED_S["compile_extra"][plan.quick]
    reps = fit_reps(plan.compile_reps, len(jobs), per_job, plan.left_s())
    out = _timing_section(plan, jobs, skipped, reps, specs, "compile")
    if reps < plan.compile_reps:
        out["reps_cut_by_budget"] = {"planned": plan.compile_reps, "run": reps, "job_s_estimate": per_job}
    return out


# ---------------------------------------------------------------------------------------------- sac
def _run_section_worker(plan: Plan, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    import common

    cmd = [sys.executable, str(common.WORKERS_DIR / "single_device.py"), *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=common.worker_env(plan.env), cwd=common.ROOT
    )


def section_sac(plan: Plan, done: dict[str, Any]) -> dict[str, Any]:
    ex = plan.example
    with tempfile.TemporaryDirectory(prefix="gpu-sac-") as tmp:
        out = Path(tmp) / "sac.json"
        args = ["sac", "--model", json.dumps(ex["model"]), "--seq-len", str(ex["seq_len"]), "--batch",
                str(ex["batch"]),
                "--reps", str(1 if plan.quick else 2), "--steps", str(2 if plan.quick else 5),
                "--warmup", str(1 if plan.quick else 2), "--precision", plan.precision, "--out", str(out)]
        proc = _run_section_worker(plan, args, timeout=min(plan.timeout * 2, max(1.0, plan.left_s())))
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"sac worker exit {proc.returncode}\n"
                + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            )
        data = json.loads(out.read_text())
    case = data["case"]
    tokens = case["batch"] * case["seq_len"]
    modes = {}
    for name, rec in case["contenders"].items():
        modes[name] = {
            "config": data["config"]["contenders"].get(name),
            "median_step_s": rec["median_step_s"], "step_s": rec["step_s"],
            "tokens_per_s": tokens / rec["median_step_s"] if rec["median_step_s"] else None,
            "peak_cuda_bytes_over_weights": rec.get("peak_cuda_bytes_over_weights"),
            "kept_bytes": rec["kept_bytes"], "time_vs_none": rec.get("time_vs_none"),
            "kept_vs_none": rec.get("kept_vs_none"), "recompute_overhead": rec["recompute_overhead"],
            "model_flops": rec["model_flops"], "hardware_flops": rec["hardware_flops"],
        }
    base = modes.get("none", {})
    for rec in modes.values():
        peak, base_peak = rec["peak_cuda_bytes_over_weights"], base.get("peak_cuda_bytes_over_weights")
        rec["peak_vs_none"] = peak / base_peak if peak is not None and base_peak else None
        # what the issue asks to report: memory saved per % of throughput lost
        memory = rec["peak_vs_none"] if rec["peak_vs_none"] is not None else rec["kept_vs_none"]
        lost = (1 - 1 / rec["time_vs_none"]) * 100 if rec.get("time_vs_none") else None
        rec["memory_saved_frac_per_pct_throughput_lost"] = (
            (1 - memory) / lost if memory is not None and lost and lost > 0 else None)
    result = {"status": "ok", "params": case["params"], "batch": case["batch"], "seq_len": case["seq_len"],
              "precision": data["config"]["precision"], "modes": modes,
              "measured": "forward + backward of one batch on the bare model (sac suite), modes interleaved; "
                          "peak CUDA memory over the weights on a GPU, bytes kept for backward everywhere"}
    if not plan.gpu:
        result["peak_cuda"] = {
            "skipped": "no CUDA device: peak CUDA memory is measured on GPUs only (kept bytes "
            "for backward are measured on the CPU instead)"
        }
    return result


# ---------------------------------------------------------------------------------------------- memory
def _probe(plan: Plan, size: str, offload: bool) -> dict[str, Any]:
    """One 1-step fsdp2 run of a ladder size; ``fits`` True/False, or None when it failed for another
    reason."""
    import common

    model = {**plan.example["model"], **LADDER[size]}
    params = llama_params(model)["total"]
    rec: dict[str, Any] = {"size": size, "cpu_offload": offload, "params": params}
    host = host_available_bytes()
    if offload and host is not None and host_bytes_offloaded(params) > 0.8 * host:
        return {**rec, "fits": False, "not_started": f"offloaded fp32 state needs >= "
                f"{host_bytes_offloaded(params) / 2**30:.0f} GiB host RAM, {host / 2**30:.0f} GiB available"}
    total = plan.total_device_bytes or 0
    # offload: fp32 shards materialise first
    need = 4 * params if offload else device_bytes_unoffloaded(params)
    if total and need > total:
        held = "fp32 parameters before offloading" if offload else "parameters, gradients, AdamW state"
        return {**rec, "fits": False, "not_started": f"needs >= {need / 2**30:.0f} GiB on the device "
                f"({held}), "
                f"{total / 2**30:.0f} GiB there"}
    args = plan.worker_args(
        "fsdp2", steps=1, warmup=1, model=model, extra=["--cpu-offload"] if offload else []
    )
    t0 = time.perf_counter()
    try:
        out = common.run_worker("lightning_fit.py", 1, args, timeout=plan.job_timeout(), env=plan.env)
    except common.WorkerError as exc:
        text = str(exc)
        rec.update({"wall_s": time.perf_counter() - t0, "error_tail": text.splitlines()[-12:]})
        if is_oom(text):
            return {**rec, "fits": False, "why": "out of memory"}
        return {**rec, "fits": None, "why": "failed without an out-of-memory error (see error_tail)"}
    mem = out["per_rank"][0]["memory"]
    return {**rec, "fits": True, "wall_s": time.perf_counter() - t0,
            "peak_cuda_bytes": mem.get("peak_cuda_bytes"),
            "peak_cuda_reserved_bytes": mem.get("peak_cuda_reserved_bytes"),
            "max_rss_bytes": mem.get("max_rss_bytes"), "step_s": out["step_times_s"] or out["warmup_times_s"]}


def section_memory(plan: Plan, done: dict[str, Any]) -> dict[str, Any]:
    """Peak memory per strategy (from the contenders' runs), cpu_offload on/off, accumulation 1 vs 4, then
    (budget permitting) the largest size of the family that fits. Jobs run in that order; one whose estimate
    exceeds what is left of the budget is not started (recorded as skipped)."""
    import common

    reused = done.get("contenders", {}).get("contenders", {})
    rows: dict[str, Any] = {}
    measure = "peak_cuda_bytes (torch.cuda.max_memory_allocated)" if plan.gpu else \
        "max_rss_bytes (CPU: peak resident set of the worker process, interpreter and libraries included)"
    jobs: dict[str, tuple[str, list[str]]] = {}
    for name in plan.contenders:
        reason = common.contender(name).skip_reason(1)
        if reason:
            rows[name] = {"skipped": reason}
        elif reused.get(name, {}).get("memory_per_rank"):
            rows[name] = {
                "from_section": "contenders",
                "cpu_offload": False,
                **_memory_row(plan, reused[name]),
            }
        else:
            jobs[name] = (name, [])
    jobs["fsdp2+accumulate4"] = ("fsdp2", ["--accumulate", str(ACCUMULATE)])
    for name in plan.contenders:
        if "skipped" in rows.get(name, {}):
            continue
        if name not in OFFLOADABLE:
            rows[f"{name}+offload"] = {
                "skipped": "ModelParallelStrategy has no offload option (a user passes "
                "offload_policy to fully_shard by hand); not measured"
            }
        elif plan.quick and name != "fsdp2":
            rows[f"{name}+offload"] = {
                "skipped": "--quick: only fsdp2's offload run (the others run in the full mode)"
            }
        else:
            jobs[f"{name}+offload"] = (name, ["--cpu-offload"])
    # the checklist's order: offload on vs off and accumulation 1 vs 4 first, then what the contenders did not
    # run
    order = sorted(jobs, key=lambda k: 0 if k == "fsdp2+offload" else 1 if "accumulate" in k else 2)
    for key in order:
        base, extra = jobs[key]
        estimate = plan.job_s() * (2 if "offload" in key else 1)
        if estimate > plan.left_s():
            rows[key] = {"skipped": budget_reason(estimate, plan)}
            continue
        try:
            run: Any = _job(plan, base,
                            plan.worker_args(base, steps=4 if "accumulate" in key else 2, warmup=1,
                                                         extra=extra))
        except Exception as exc:  # recorded in the row
            run = exc
        rec = _contender_record(plan, [run])
        rows[key] = {"from_section": "memory", "cpu_offload": "+offload" in key, **_memory_row(plan, rec)}
        if isinstance(run, dict) and "accumulate" in key:  # the worker's rank 0 writes these at the top level
            rows[key].update({k: run.get(k) for k in ("accumulate_grad_batches",
                                                      "grad_bytes_held_after_backward",
                                                      "fsdp_grad_bytes_after_backward", "accumulation",
                                                      "cuda_allocated_after_backward")})
    result: dict[str, Any] = {"status": "ok", "measure": measure, "strategies": rows}
    if not plan.gpu:
        result["largest_fitting"] = {
            "skipped": "no CUDA device: out-of-memory probes would exhaust the host's RAM, "
            "which other work shares, not a device limit"
        }
    elif plan.left_s() < 2 * BISECT_PROBE_S:
        result["largest_fitting"] = {"skipped": budget_reason(2 * BISECT_PROBE_S, plan)}
    else:
        result["largest_fitting"] = _bisect_ladder(plan, reused.get("fsdp2", {}))
    failed = sorted(k for k, r in rows.items() if r.get("errors") and not r.get("peak_memory_bytes"))
    if failed:
        result.update(failed_rows=failed, status="partial")
    return result


def _memory_row(plan: Plan, rec: dict[str, Any]) -> dict[str, Any]:
    mem = (rec.get("memory_per_rank") or [{}])[0]
    return {"peak_memory_bytes": rec.get("peak_memory_bytes"), "peak_cuda_bytes": mem.get("peak_cuda_bytes"),
            "peak_cuda_reserved_bytes": mem.get("peak_cuda_reserved_bytes"),
            "max_rss_bytes": mem.get("max_rss_bytes"),
            "param_bytes": mem.get("param_bytes"), "grad_bytes": mem.get("grad_bytes"),
            "optimizer_state_bytes": mem.get("optimizer_state_bytes"), "median_step_s": rec.get("median_s"),
            "errors": rec.get("errors")}


def _bisect_ladder(plan: Plan, fsdp2_record: dict[str, Any]) -> dict[str, Any]:
    names = [n for n in LADDER if n in plan.ladder]
    out: dict[str, Any] = {
        "ladder": {n: llama_params({**plan.example["model"], **LADDER[n]})["total"] for n in names},
        "probe": "fsdp2, 1 step after 1 warm-up step, the example's batch and sequence length",
    }
    known = names.index("1b") if "1b" in names and fsdp2_record.get("median_s") else -1  # ran in contenders
    for offload in (False, True):
        probes: list[dict[str, Any]] = []

        def fits(i: int, offload: bool = offload, probes: list = probes) -> bool | None:
            if plan.left_s() < BISECT_PROBE_S:
                probes.append({"size": names[i], "cpu_offload": offload, "fits": None,
                               "not_started": budget_reason(BISECT_PROBE_S, plan)})
                return None
            rec = _probe(plan, names[i], offload)
            probes.append(rec)
            return rec["fits"]

        best, _ = bisect_largest(len(names), fits, lo=known)
        out["cpu_offload" if offload else "no_offload"] = {
            "largest": names[best] if best >= 0 else None,
            "largest_params": out["ladder"][names[best]] if best >= 0 else None,
            "known_to_fit_before_probing": names[known] if known >= 0 else None,
            "probes": probes, "inconclusive": any(p["fits"] is None for p in probes)}
        if best >= 0:
            known = best  # offload fits at least what fits without it
    return out


# ---------------------------------------------------------------------------------------------- smoke
def section_smoke(plan: Plan, done: dict[str, Any]) -> dict[str, Any]:
    """All smoke runs in one process; a crash restarts the rest in a fresh one, a failure is retried alone."""
    results: dict[str, Any] = {}
    planned: list[str] = []
    # a hang (an NCCL collective that never returns) must not eat the budget of the sections after this one
    deadline = time.monotonic() + min(plan.left_s(), FIXED_S["smoke"][plan.quick] * SMOKE_CAP)

    def launch(names: list[str] | None) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as tmp:
            out = Path(tmp) / "smoke.jsonl"
            args = ["smoke", *(["--runs", *names] if names else []), "--out", str(out), "--precision",
                    plan.precision]
            if plan.quick:
                args.append("--quick")
            try:
                proc = _run_section_worker(plan, args, timeout=max(1.0, deadline - time.monotonic()))
                tail = (proc.stdout + proc.stderr).splitlines()[-30:]
                code: int | str = proc.returncode
            except subprocess.TimeoutExpired as exc:
                tail, code = [f"timed out after {exc.timeout}s"], "timeout"
            lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        got = {r["name"]: r for r in lines if r.get("event") == "done"}
        if not planned:
            planned.extend(next((r["runs"] for r in lines if r.get("event") == "plan"), []))
        started = [r["name"] for r in lines if r.get("event") == "started"]
        for name in started:
            if name not in got:  # the process died during this run
                got[name] = {"name": name, "status": "failed",
                             "reason": f"the smoke process died (exit {code})", "error_tail": tail}
        return got

    pending: list[str] | None = None  # the worker's own list first (its plan line names it)
    while pending is None or pending:
        got = launch(pending)
        if pending is None:
            if not planned:
                raise RuntimeError("the smoke worker wrote no plan: " + json.dumps(got)[:2000])
            pending = list(planned)
        results.update(got)
        remaining = [n for n in pending if n not in got]
        if len(remaining) == len(pending):  # nothing started: give up on the rest, recorded
            for name in remaining:
                results[name] = {
                    "name": name,
                    "status": "failed",
                    "reason": "the smoke process did not start it",
                }
            break
        pending = remaining
    for name, rec in list(results.items()):
        if rec.get("status") == "failed" and deadline - time.monotonic() > 10:
            # in a fresh process, so an earlier run's state cannot be the cause
            alone = launch([name]).get(name, {"status": "failed", "reason": "no result"})
            results[name] = {**alone, "first_attempt": rec, "retried_alone": True}
    failed = sorted(n for n, r in results.items() if r.get("status") == "failed")
    status = "ok" if not failed else "failed" if len(failed) == len(results) else "partial"
    return {"status": status, "runs": results, "failed_runs": failed}


# ---------------------------------------------------------------------------------------------- pretrained
# ~1B LlamaForCausalLM (Llama 3's vocabulary, the suite's 8 layers); --quick: the suite's own quick size
PRETRAINED_SIZE = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 8,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 128256}
# fp32 reference loss on the CPU vs the loaded model on the GPU (other kernels)
PRETRAINED_GPU_TOLERANCE = 1e-4


def section_pretrained(plan: Plan, done: dict[str, Any]) -> dict[str, Any]:
    """A ``save_pretrained`` folder of a random ~1B Llama loaded into ``fsdp2`` (``from_pretrained`` in
    ``configure_model``, the pretrained_load suite's route) on the one device: peak host memory the load adds,
    peak device memory, load time; the loaded weights checked against the saved model's reference loss."""
    import common
    from suites import pretrained_load

    size = "quick-6m" if plan.quick else "gpu-1b"
    if not plan.quick:
        pretrained_load.SIZES[size] = PRETRAINED_SIZE
    with tempfile.TemporaryDirectory(prefix="gpu-pretrained-") as tmp:
        folder = Path(tmp) / size
        t0 = time.perf_counter()
        model = pretrained_load.save_model(size, folder)
        save_s = time.perf_counter() - t0
        ref = Path(tmp) / f"{size}-ref.json"
        if plan.gpu:
            spec = json.loads(ref.read_text())
            ref.write_text(json.dumps({**spec, "tolerance": PRETRAINED_GPU_TOLERANCE}))
        args = ["--contender", "fsdp2_configure_model", "--folder", str(folder), "--ref", str(ref),
                "--accelerator", "gpu" if plan.gpu else "cpu"]
        t0 = time.perf_counter()
        run = common.run_worker("pretrained_load.py", 1, args, timeout=plan.job_timeout(), env=plan.env)
        job_s = time.perf_counter() - t0
    [rank] = run["per_rank"]
    mem = rank["memory"]
    return {"status": "ok" if run["weights_ok"] else "failed", "size": size,
            "model": {k: v for k, v in model.items() if k != "config"}, "config": model["config"],
            "route": "fsdp2_configure_model (from_pretrained in configure_model under fsdp2, world size 1)",
            "weights_ok": run["weights_ok"], "ref_loss": rank["ref_loss"],
            "expected_ref_loss": run["ref_loss"],
            "tolerance": PRETRAINED_GPU_TOLERANCE if plan.gpu else pretrained_load.TOLERANCE,
            "load_s": mem["load_s"], "job_wall_s": job_s, "save_pretrained_s": save_s,
            "peak_host_growth_bytes": mem["peak_growth_bytes"], "peak_host_anon_growth_bytes":
            mem["peak_anon_growth_bytes"], "peak_cuda_bytes": mem.get("peak_cuda_bytes"),
            "peak_host_growth_over_model": mem["peak_growth_bytes"] / model["model_bytes"],
            "measured": "the pretrained_load suite's window: host RSS growth from before the model exists to "
                        "on_fit_start; peak CUDA memory (max_memory_allocated) at on_fit_start"}


# ---------------------------------------------------------------------------------------------- orchestration
SECTION_FUNCS: dict[str, Callable[[Plan, dict[str, Any]], dict[str, Any]]] = {
    "contenders": section_contenders, "compile": section_compile, "sac": section_sac,
    "memory": section_memory, "smoke": section_smoke, "pretrained": section_pretrained,
}


def run_section(name: str, plan: Plan, done: dict[str, Any]) -> dict[str, Any]:
    """One guarded section: its result, or ``status: failed`` with the error tail."""
    import common

    t0 = time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        rec = SECTION_FUNCS[name](plan, done)
    except Exception as exc:  # recorded; the next section runs
        rec = {"status": "failed", "error": f"{type(exc).__name__}", "error_tail": error_tail(exc)}
    rec["wall_s"] = time.perf_counter() - t0
    rec["started_utc"] = started
    rec["git_commit"] = common.versions().get("git_commit")
    return rec


def table(result: dict[str, Any]) -> str:
    """The short plain-text table printed at the end (:func:`gpu_report.table` over this harness's
    sections)."""
    return gpu_report.table(result, SECTIONS)



# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="CPU smoke mode: tiny model, gloo, CUDA-only parts skipped"
    )
    parser.add_argument("--sections", nargs="+", default=None, metavar="SECTION",
                        help=f"run only these ({' '.join(SECTIONS)}); "
                             "the others of an existing result file stay")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where gpu-<device>.json and the PNGs go (default: benchmarks/results, "
                             "--quick: outputs/gpu-quick)")
    parser.add_argument(
        "--config", type=Path, default=EXAMPLE_CONFIG, help="the example's YAML (model, data)"
    )
    parser.add_argument("--reps", type=int, default=None, help="interleaved rounds (contenders 3, compile 2)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per job (10)")
    parser.add_argument("--warmup", type=int, default=None, help="excluded steps per job (3; compile 5)")
    parser.add_argument("--ladder", nargs="+", default=None, metavar="SIZE",
                        help=f"sizes the memory bisection may probe ({' '.join(LADDER)})")
    parser.add_argument("--job-timeout", type=float, default=None, help="seconds per job (480; --quick 300)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget in seconds: sections "
                             "run in priority order, one whose estimate "
                             "exceeds what is left is skipped (recorded), no job runs past the end")
    parser.add_argument("--contenders", nargs="+", default=None, metavar="NAME",
                        help=f"contenders ({' '.join(CONTENDERS)} by "
                             f"default; also {' '.join(OPTIONAL_CONTENDERS)})")
    parser.add_argument("--report", type=Path, default=None, metavar="FILE.json",
                        help="print markdown tables of a result file and exit")
    ns = parser.parse_args(argv)
    for name in ns.sections or []:
        if name not in SECTIONS:
            parser.error(f"--sections: unknown section {name!r}. Fix: choose from {list(SECTIONS)}.")
    for name in ns.contenders or []:
        if name not in CONTENDERS + OPTIONAL_CONTENDERS:
            parser.error(f"--contenders: unknown contender {name!r}. Fix: choose from "
                         f"{list(CONTENDERS + OPTIONAL_CONTENDERS)}.")
    if ns.budget_s is not None and ns.budget_s <= 0:
        parser.error(f"--budget-s {ns.budget_s:g}: must be > 0 seconds.")
    for size in ns.ladder or []:
        if size not in LADDER:
            parser.error(f"--ladder: unknown size {size!r}. Fix: choose from {list(LADDER)}.")
    for flag in ("reps", "steps", "warmup"):
        value = getattr(ns, flag)
        if value is not None and value < (0 if flag == "warmup" else 1):
            parser.error(f"--{flag} {value}: must be {'>= 0' if flag == 'warmup' else '>= 1'}.")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.report:
        print(markdown(json.loads(ns.report.read_text())))
        return 0
    if ns.quick:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA: the whole run is on the CPU
    import torch

    import common

    if not ns.quick and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device is visible (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}). Fix: run it on a CUDA "
              "machine with a CUDA build of torch, or pass --quick "
              "for the CPU smoke mode.", file=sys.stderr)
        return 2
    plan = Plan(ns)
    wanted = plan.wanted
    path = common.result_path("gpu", plan.out_dir)
    result = common.header("gpu", plan.config())
    result.update({"device_name": plan.device_name, "sections": {}})  # the one device used
    if plan.quick:
        result["note"] = (
            "--quick: CPU smoke run of the harness (tiny model, gloo); its figures say nothing about "
            "GPU or CPU speed, only that every code path runs and records its numbers."
        )
    previous: dict[str, Any] = {}  # an existing result's sections: kept unless measured again
    if ns.sections and path.exists():  # keep the sections not run now
        with contextlib.suppress(ValueError, KeyError):
            old = json.loads(path.read_text())
            if old.get("config", {}).get("quick") == plan.quick:
                previous = {k: v for k, v in old.get("sections", {}).items() if v.get("status") != "skipped"}
                result["sections"] = {k: v for k, v in old.get("sections", {}).items() if k not in wanted}
                result["kept_sections_from"] = {
                    "created_utc": old.get("created_utc"),
                    "command": old.get("command"),
                }
    t0 = time.perf_counter()
    # kept sections count (memory reuses the contenders' runs)
    done: dict[str, Any] = dict(result["sections"])
    for name in wanted:
        estimate = section_estimate(name, plan)
        if estimate > plan.left_s():  # never start a section that cannot finish: record why instead
            skip = {"status": "skipped", "reason": budget_reason(estimate, plan), "estimate_s": estimate,
                    "wall_s": 0.0}
            # a measured section of the existing result stays, with a note that this run could not redo it
            done[name] = {**previous[name], "rerun_skipped": skip} if name in previous else skip
            result["sections"][name] = done[name]
            print(f"[gpu] {name}: skipped ({skip['reason']})", file=sys.stderr, flush=True)
            common.write_result("gpu", result, plan.out_dir)
            continue
        print(
            f"[gpu] {name} (estimate {estimate:.0f}s, {plan.left_s():.0f}s left) ...",
            file=sys.stderr,
            flush=True,
        )
        done[name] = run_section(name, plan, done)
        done[name]["estimate_s"] = estimate
        result["sections"][name] = done[name]
        print(
            f"[gpu] {name}: {done[name]['status']} in {done[name]['wall_s']:.0f}s",
            file=sys.stderr,
            flush=True,
        )
        # after every section: a crash keeps what was measured
        common.write_result("gpu", result, plan.out_dir)
    result["wall_s"] = time.perf_counter() - t0
    result["sections"] = {k: result["sections"][k] for k in SECTIONS if k in result["sections"]}
    pngs: list[Path | None] = []
    try:  # the measurements are on disk already; a reporting bug must not hide them
        result["table"] = table(result)
        pngs = [
            plot(result, path.with_suffix(".png")),
            plot_sac(result, path.with_name(f"{path.stem}-sac.png")),
        ]
    except Exception as exc:
        result["report_error"] = error_tail(exc)
        print("[gpu] table/plots failed:\n" + "\n".join(result["report_error"]), file=sys.stderr)
    path = common.write_result("gpu", result, plan.out_dir)
    print(result.get("table", ""))
    print(f"wrote {', '.join(str(p) for p in [path, *pngs] if p)} in {result['wall_s']:.0f}s")
    ok = ("ok", "skipped") if plan.budget_s is not None else ("ok",)
    return (
        0
        if all(result["sections"][s]["status"] in ok for s in wanted) and "report_error" not in result
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
