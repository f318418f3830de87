"""Goodput model: the effective training time of a job vs cluster size and failure rate, for three ways to
survive a failure, with its inputs read from this repository's measurements and from published figures.

    python benchmarks/goodput.py                       # writes benchmarks/results/goodput-cpu.json + .png
    python benchmarks/goodput.py --group-size 64 --step-s 10 --out-dir /tmp/goodput

Nothing is measured here: the script re-reads the result files it names each time it runs, so a rerun after a
benchmark was rerun (or after ``benchmarks/results/ft_scale-cpu.json`` appeared) picks the new figures up.
Every input in the JSON carries its source (a file and key, or a paper).

The model (``M`` = the cluster's mean time between failures = 3600 / (GPUs x failures per GPU-hour) seconds;
``N`` = GPUs / group size replica groups):

* ``restart`` -- synchronous training; any failure stops the whole job, which restarts and reloads its last
  checkpoint (restart + reload ``R``), redoing the work since it; a checkpoint every ``tau`` seconds stalls
  training ``C``. Daly's complete model for exponentially distributed failures gives the useful fraction
  ``tau / (M e^(R/M) (e^((tau+C)/M) - 1))`` (-> ``tau / (tau + C)`` without failures), at Daly's optimal
  interval ``tau = sqrt(2CM) (1 + sqrt(C/2M)/3 + (C/2M)/9) - C`` (``M`` when ``C >= 2M``).
* ``ft_every_step`` -- ``ft_hsdp`` with ``sync="every_step"``: a failure stalls the ``N-1`` surviving groups
  ``S`` (the lighthouse drops the dead group; the step in flight is discarded) and takes the failed group out
  for ``D`` (its restart and heal from a live peer; its shard is skipped meanwhile). Lost fraction per second
  ``(S (N-1)/N + D/N) / M``; the per-step quorum's growth with N (``ft_scale``, when measured) is an overhead
  on every step.
* ``ft_diloco`` -- the same groups syncing every ``H`` steps: the failed group also loses its work since the
  last outer sync and waits for the next one to rejoin, on average one round ``H x step`` in all:
  ``(S (N-1)/N + (D + H step)/N) / M``; the quorum's growth costs once per round.

No mode is charged for the checkpoints ``ft_hsdp`` may still write (one an hour with the measured asynchronous
stall is well under 0.01%).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import math
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

HOUR = 3600.0
RESULTS = common.RESULTS_DIR
MODES = ("restart", "ft_every_step", "ft_diloco")
TABLE_GPUS = (1_000, 10_000, 100_000)

#: published figures (cited in docs/goodput.md; numbers only, no text)
LLAMA3 = {"interruptions": 419, "gpus": 16_384, "days": 54,
          "source": "Llama 3 paper (arXiv:2407.21783), sec. 3.3.4: 419 unexpected interruptions in a 54-day "
                    "snapshot of pre-training on 16,384 H100 GPUs"}
FT_HSDP_PAPER = {"gpus": 100_000, "sync_stall_s": 600.0, "ft_stall_s": 180.0, "sync_goodput": 0.44,
                 "ft_goodput": 0.80,
                 "source": "FT-HSDP paper (arXiv:2602.00277), abstract: "
                           "at O(100K) GPUs the stall per failure goes "
                           "from 10 to 3 minutes and effective training time from 44% to 80%"}
TORCHFT_RUN = {"gpus": 300, "failures": 1100, "hours": 19.0, "step_efficiency": 0.82,
               "source": "torchft's Fault Tolerant Llama run on Crusoe "
                         "L40S (PyTorch blog, 2025), as quoted in "
                         "issue 29: ~1,100 failures in 19 h on 300 GPUs at 82% step efficiency"}


# ---------------------------------------------------------------------------------------------- the model
def cluster_mtbf_s(gpus: float, failures_per_gpu_hour: float) -> float:
    """The whole cluster's mean time between failures, seconds (``inf`` without failures)."""
    rate = gpus * failures_per_gpu_hour
    return math.inf if rate <= 0 else HOUR / rate


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimal checkpoint interval ``sqrt(2 C M)``."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal interval of compute between checkpoints (``inf`` without failures)."""
    if math.isinf(mtbf_s):
        return math.inf
    x = checkpoint_s / (2 * mtbf_s)
    if x >= 1:
        return mtbf_s
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


def restart_goodput(mtbf_s: float, restart_s: float, checkpoint_s: float, interval_s: float) -> float:
    """Daly's complete model: useful time / wall time with a checkpoint of cost ``C`` every ``interval_s`` of
    work."""
    if math.isinf(interval_s):
        return 1.0
    if math.isinf(mtbf_s):
        return interval_s / (interval_s + checkpoint_s)
    exponent = (interval_s + checkpoint_s) / mtbf_s + restart_s / mtbf_s
    if exponent > 700:
        return 0.0
    return interval_s / (
        mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + checkpoint_s) / mtbf_s)
    )


def ft_goodput(mtbf_s: float, groups: int, stall_s: float, down_s: float, *, lost_work_s: float = 0.0,
               overhead: float = 0.0) -> float:
    """Replica groups as the unit of failure: survivors stall ``stall_s``, the failed group is out ``down_s``
    and loses ``lost_work_s`` of work; ``overhead`` is a fraction added to every fault-free second."""
    if groups < 2:
        raise ValueError(f"groups={groups}: a fault-tolerant job needs at least 2 replica groups")
    lost = (
        0.0
        if math.isinf(mtbf_s)
        else (stall_s * (groups - 1) / groups + (down_s + lost_work_s) / groups) / mtbf_s
    )
    return max(0.0, 1.0 - lost) / (1.0 + overhead)


def implied_mtbf_s(stall_per_failure_s: float, goodput: float) -> float:
    """The failure interval at which ``stall_per_failure_s`` per failure leaves ``goodput`` (first order)."""
    return stall_per_failure_s / (1.0 - goodput)


# ---------------------------------------------------------------------------------------------- inputs
def _inp(value: Any, unit: str, source: str, what: str) -> dict[str, Any]:
    return {"value": value, "unit": unit, "source": source, "what": what}


def _restart_decomposition(run: dict[str, Any]) -> tuple[list[float], list[int], float]:
    """Per kill of ``hsdp_restart``: restart + reload seconds (kill to the first step after it, minus one
    step) and the steps redone (kill step - resumed checkpoint step); and the run's median step time."""
    timeline = [r for r in run["timelines"]["0"] if r.get("committed")]
    step_s = statistics.median(
        b["t"] - a["t"] for a, b in itertools.pairwise(timeline) if b["step"] == a["step"] + 1
    )
    restarts, redone = [], []
    for kill in run["kills"]:
        # records within 0.5 s of the kill are the killed incarnation's last writes
        after = [r for r in timeline if r["t"] > kill["t"] + 0.5]
        if not after:
            continue
        restarts.append(after[0]["t"] - kill["t"] - step_s)
        redone.append(max(0, kill["step"] - (after[0]["step"] - 1)))
    return restarts, redone, step_s


def _ft_scale(path: Path) -> dict[str, Any] | None:
    """``ft_scale``'s quorum p50, survivors' stall and heal time per N (``sweep[]`` rows with ``status`` ok:
    ``quorum_s.p50``, ``survivor_stall_s.p50``, ``heal_s.p50``), if its result exists; ``None`` otherwise."""
    if not path.is_file():
        return None
    rows = sorted((r for r in json.loads(path.read_text()).get("sweep") or []
                   if isinstance(r, dict) and r.get("status") == "ok" and isinstance(r.get("n"), int)),
                  key=lambda r: r["n"])

    def p50(row: dict[str, Any], key: str) -> float | None:
        value = (row.get(key) or {}).get("p50")
        return float(value) if isinstance(value, (int, float)) else None

    return {"path": str(path), "usable": len(rows) >= 2, "n": [r["n"] for r in rows],
            "quorum_p50_s": [p50(r, "quorum_s") for r in rows],
            "stall_s": [p50(r, "survivor_stall_s") for r in rows], "heal_s": [p50(r, "heal_s") for r in rows],
            "source": f"{path.name}: sweep[].quorum_s.p50, "
                      "sweep[].survivor_stall_s.p50, sweep[].heal_s.p50 (status ok)"}


#: ft_overhead's per-step parts that a faster device does not shrink (host work and RPCs, every step)
FIXED_PARTS = ("commit_s", "cost_capture_s", "cost_quorum_start_s", "cost_account_s", "cost_batch_s")
#: HBM bandwidth of an H100 SXM (NVIDIA's data sheet: 3.35 TB/s), for torchft's averaging pass on the device
HBM_BYTES_PER_S = 3.35e12
#: dense BF16 peak of an H100 SXM (NVIDIA's data sheet, no sparsity) and the MFU assumed for the 1B example
H100_BF16_FLOPS, EXAMPLE_MFU = 989e12, 0.40


def _ft_fault_free(path: Path) -> dict[str, Any] | None:
    """``ft_overhead``'s per-step cost of ``ft_hsdp``'s protocol when nothing fails, if its result exists:
    the fixed host-side parts (:data:`FIXED_PARTS`, medians per step) and the cross-group all-reduces per
    step."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    costs = (data.get("breakdown") or {}).get("ft_costs_per_step") or {}
    if not costs:
        return None
    return {"fixed_s": sum(costs.get(k, 0.0) for k in FIXED_PARTS),
            "parts": {k: costs.get(k) for k in FIXED_PARTS}, "allreduces": costs.get("allreduces"),
            "allreduce_bytes": costs.get("allreduce_bytes"), "step_s": data["breakdown"]["step_s"],
            "source": f"{path.name}: breakdown.ft_costs_per_step ({' + '.join(FIXED_PARTS)})"}


def example_1b() -> dict[str, Any]:
    """The ~1B example (``configs/fsdp2_gpu_1b.yaml``): parameters, FSDP units, tokens per GPU and step."""
    import yaml

    cfg = yaml.safe_load((common.ROOT / "configs" / "fsdp2_gpu_1b.yaml").read_text())
    m, d = cfg["model"], cfg["data"]
    dim, layers, kv = m["dim"], m["n_layers"], m["dim"] * m["n_kv_heads"] // m["n_heads"]
    per_layer = 2 * dim * dim + 2 * dim * kv + 3 * dim * m["mlp_hidden"] + 2 * dim
    params = 2 * m["vocab_size"] * dim + layers * per_layer + dim  # embedding, output, blocks, final norm
    return {"params": params, "units": layers + 1, "tokens_per_gpu": d["batch_size"] * d["seq_len"]}


def fault_free_overhead(fixed_s: float, shard_bytes: float, step_s: float) -> dict[str, float]:
    """What ``ft_hsdp`` adds to a fault-free step of ``step_s`` seconds: the fixed host-side parts, and
    torchft's average (a SUM all-reduce, then one read + write pass dividing this rank's gradient shard of
    ``shard_bytes`` on the device); the all-reduce itself moves the same bytes as ``hsdp``'s."""
    division_s = 2 * shard_bytes / HBM_BYTES_PER_S
    return {"step_s": step_s, "fixed_s": fixed_s, "division_s": division_s,
            "fraction": (fixed_s + division_s) / step_s}


def growth(scale: dict[str, Any] | None, key: str, n: float) -> float:
    """How much ``key`` grew from the smallest measured N to ``n``: interpolated in log N inside the sweep,
    continued linearly in N past its largest N (the last two points' slope, never negative); 0 without
    data."""
    if not scale or not scale.get("usable"):
        return 0.0
    pts = [(x, y) for x, y in zip(scale["n"], scale[key]) if y is not None]
    if len(pts) < 2:
        return 0.0
    base = pts[0][1]
    if n <= pts[0][0]:
        return 0.0
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if n <= x1:
            f = (math.log(n) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return max(0.0, y0 + f * (y1 - y0) - base)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return max(0.0, y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (n - x1) - base)


def read_inputs(results: Path, step_s: float, sync_every: int, group_size: int) -> dict[str, dict[str, Any]]:
    """Every input of the model with its source (``ft_fixed_step_s``: 0 until ``ft_overhead`` has run)."""
    rec_path, ck_path = results / "ft_recovery-cpu.json", results / "checkpoint-cpu.json"
    free = _ft_fault_free(results / "ft_overhead-cpu.json")
    rec, ck = json.loads(rec_path.read_text()), json.loads(ck_path.read_text())
    fig = rec["figures"]
    restarts, redone, hsdp_step = _restart_decomposition(rec["runs"]["hsdp_restart"])
    rn, cn = rec_path.name, ck_path.name
    llama_rate = LLAMA3["interruptions"] / (LLAMA3["gpus"] * LLAMA3["days"] * 24)
    torchft_rate = TORCHFT_RUN["failures"] / (TORCHFT_RUN["gpus"] * TORCHFT_RUN["hours"])
    return {
        "restart_s": _inp(statistics.median(restarts), "s",
                          f"{rn}: runs.hsdp_restart (kills, timelines['0']): median "
                          "of kill -> first committed step after the restart, minus one step",
                          "whole-job restart + checkpoint reload (2 x 2 ranks, torchrun, hsdp)"),
        "restart_redone_steps": _inp(statistics.mean(redone), "steps",
                                     f"{rn}: runs.hsdp_restart, kill step - resumed "
                                     f"step (checkpoint every {rec['config']['hsdp_ckpt_every']} steps)",
                                     "work redone per restart in that run "
                                     "(the model uses Daly's interval instead)"),
        "hsdp_step_s": _inp(hsdp_step, "s", f"{rn}: runs.hsdp_restart, median step", "that run's step time"),
        "checkpoint_s": _inp(ck["contenders"]["thread"]["stall_s"], "s", f"{cn}: contenders.thread.stall_s",
                             "training stall per asynchronous checkpoint (85M params, 2 ranks)"),
        "checkpoint_sync_s": _inp(ck["contenders"]["sync"]["stall_s"], "s", f"{cn}: contenders.sync.stall_s",
                                  "stall per synchronous checkpoint (not used: the async one is)"),
        "stall_s": _inp(fig["ft_faults"]["stall_s"]["median"], "s", f"{rn}: figures.ft_faults.stall_s.median",
                        "survivors' stall per fault (heartbeat timeout "
                        f"{rec['config']['heartbeat_timeout_ms']} ms)"),
        "down_s": _inp(fig["ft_faults"]["downtime_s"]["median"], "s",
                       f"{rn}: figures.ft_faults.downtime_s.median",
                       "killed group's SIGKILL -> its first committed step (cold restart + heal)"),
        "diloco_down_s": _inp(fig["diloco_faults"]["downtime_s"]["median"], "s",
                              f"{rn}: figures.diloco_faults.downtime_s.median", "the same with sync: diloco"),
        "measured_groups": _inp(rec["config"]["groups"], "groups", f"{rn}: config.groups",
                                "replica groups measured"),
        "kill_every_s": _inp(rec["config"]["kill_every_s"], "s", f"{rn}: config.kill_every_s",
                             "fault interval measured"),
        "step_s": _inp(step_s, "s",
                       "stated (--step-s): ~ a Llama 3 405B step on 16K GPUs, 6 x 405e9 x 16M tokens / "
                       "(16,384 x 400 TFLOP/s)", "step time at scale"),
        "sync_every": _inp(sync_every, "steps", "stated (--sync-every; ft_recovery's diloco runs use 8)",
                           "inner steps per DiLoCo round"),
        "group_size": _inp(group_size, "GPUs",
                           "stated (--group-size): one 8-GPU host per replica group, the finest "
                           "failure domain and the most groups", "GPUs per replica group"),
        "failures_per_gpu_hour": _inp(llama_rate, "1/(GPU h)", LLAMA3["source"], "failure rate (Llama 3)"),
        "torchft_failures_per_gpu_hour": _inp(torchft_rate, "1/(GPU h)", TORCHFT_RUN["source"],
                                              "torchft's synthetic failure rate"),
        "paper_sync_stall_s": _inp(FT_HSDP_PAPER["sync_stall_s"], "s", FT_HSDP_PAPER["source"],
                                   "published stall per failure, synchronous"),
        "paper_ft_stall_s": _inp(FT_HSDP_PAPER["ft_stall_s"], "s", FT_HSDP_PAPER["source"],
                                 "published stall per failure, FT-HSDP"),
        "ft_fixed_step_s": _inp(free["fixed_s"] if free else 0.0, "s",
                                free["source"] if free else "ft_overhead-cpu.json not written yet: 0",
                                "ft_hsdp's fixed cost per fault-free step (commit vote, heal snapshot, "
                                "quorum request, accounting; measured on this CPU host)"),
    }


# ---------------------------------------------------------------------------------------------- predictions
def predict(inputs: dict[str, dict[str, Any]], gpus: float, rate: float, scale: dict[str, Any] | None,
            published: bool = False) -> dict[str, float]:
    """Goodput of the three modes at ``gpus`` GPUs and ``rate`` failures per GPU-hour; ``published``: the
    per-failure costs are the FT-HSDP paper's stalls instead of this repository's measurements."""
    v = {k: i["value"] for k, i in inputs.items()}
    m = cluster_mtbf_s(gpus, rate)
    groups = max(2, round(gpus / v["group_size"]))
    round_s = v["sync_every"] * v["step_s"]
    if published:
        return {"restart": max(0.0, 1 - v["paper_sync_stall_s"] / m),
                "ft_every_step": max(0.0, 1 - v["paper_ft_stall_s"] / m),
                "ft_diloco": ft_goodput(m, groups, v["paper_ft_stall_s"], v["paper_ft_stall_s"],
                                        lost_work_s=round_s)}
    tau = daly_interval_s(v["checkpoint_s"], m)
    extra_stall, extra_heal = growth(scale, "stall_s", groups), growth(scale, "heal_s", groups)
    quorum = growth(scale, "quorum_p50_s", groups)
    fixed = v.get("ft_fixed_step_s", 0.0)  # every step (every_step), once per round (diloco)
    return {
        "restart": restart_goodput(m, v["restart_s"], v["checkpoint_s"], tau),
        "ft_every_step": ft_goodput(m, groups, v["stall_s"] + extra_stall, v["down_s"] + extra_heal,
                                    overhead=(quorum + fixed) / v["step_s"]),
        "ft_diloco": ft_goodput(m, groups, v["stall_s"] + extra_stall, v["diloco_down_s"] + extra_heal,
                                lost_work_s=round_s, overhead=(quorum + fixed) / round_s),
    }


def validation(inputs: dict[str, dict[str, Any]], results: Path) -> list[dict[str, Any]]:
    """The model at the measured conditions (2 groups, one fault per kill_every_s) against ft_recovery's
    figures."""
    v = {k: i["value"] for k, i in inputs.items()}
    rec = json.loads((results / "ft_recovery-cpu.json").read_text())["figures"]
    m, n = v["kill_every_s"], v["measured_groups"]
    ck_every = json.loads((results / "ft_recovery-cpu.json").read_text())["config"]["hsdp_ckpt_every"]
    tau = ck_every * v["hsdp_step_s"]
    model = {"hsdp_restart": 1 - (v["restart_s"] + tau / 2) / m,  # checkpoints cost the reference run too
             "ft_faults": ft_goodput(m, n, v["stall_s"], v["down_s"]),
             "diloco_faults": ft_goodput(m, n, v["stall_s"], v["diloco_down_s"], lost_work_s=v["sync_every"] *
                                         rec["diloco_faults"]["step_s_full_quorum"]["fault_free"])}
    return [{"run": name, "model": value, "measured": rec[name]["local_loss"]["goodput_at_kill_every"],
             "measured_source": f"ft_recovery-cpu.json: figures.{name}.local_loss.goodput_at_kill_every"}
            for name, value in model.items()]


def build(
    results: Path, step_s: float, sync_every: int, group_size: int, alt_group_size: int
) -> dict[str, Any]:
    inputs = read_inputs(results, step_s, sync_every, group_size)
    scale = _ft_scale(results / "ft_scale-cpu.json")
    rate = inputs["failures_per_gpu_hour"]["value"]
    alt = {**inputs, "group_size": {**inputs["group_size"], "value": alt_group_size}}
    table = {str(g): {"groups": max(2, round(g / group_size)), "mtbf_min": cluster_mtbf_s(g, rate) / 60,
                      "measured": predict(inputs, g, rate, scale),
                      f"measured, {alt_group_size}-GPU groups ({max(2, round(g / alt_group_size)):,} groups)":
                          predict(alt, g, rate, scale),
                      "published_stalls": predict(inputs, g, rate, scale,
                                                  published=True)} for g in TABLE_GPUS}
    paper_mtbf = {"sync": implied_mtbf_s(FT_HSDP_PAPER["sync_stall_s"], FT_HSDP_PAPER["sync_goodput"]),
                  "ft": implied_mtbf_s(FT_HSDP_PAPER["ft_stall_s"], FT_HSDP_PAPER["ft_goodput"])}
    paper_rate = {k: HOUR / (FT_HSDP_PAPER["gpus"] * mt) for k, mt in paper_mtbf.items()}
    tf_m = cluster_mtbf_s(TORCHFT_RUN["gpus"], inputs["torchft_failures_per_gpu_hour"]["value"])
    comparison = {
        "ft_hsdp_paper": {"gpus": FT_HSDP_PAPER["gpus"],
                          "published": {"restart": FT_HSDP_PAPER["sync_goodput"],
                                        "ft_every_step": FT_HSDP_PAPER["ft_goodput"]},
                          "implied_mtbf_min": {k: x / 60 for k, x in paper_mtbf.items()},
                          "implied_failures_per_gpu_hour": paper_rate,
                          "model_measured_at_llama3_rate": predict(inputs, FT_HSDP_PAPER["gpus"], rate,
                                                                   scale),
                          "model_measured_at_implied_rate": predict(inputs, FT_HSDP_PAPER["gpus"],
                                                                    statistics.mean(paper_rate.values()),
                                                                    scale)},
        "torchft_run": {"gpus": TORCHFT_RUN["gpus"],
                        "published_step_efficiency": TORCHFT_RUN["step_efficiency"], "mtbf_s": tf_m,
                        "implied_lost_s_per_failure": (1 - TORCHFT_RUN["step_efficiency"]) * tf_m,
                        "model_measured": predict(inputs, TORCHFT_RUN["gpus"],
                                                  inputs["torchft_failures_per_gpu_hour"]["value"], scale)},
    }
    fixed = inputs["ft_fixed_step_s"]["value"]
    ex = example_1b()
    ex_step = 6 * ex["params"] * ex["tokens_per_gpu"] / (H100_BF16_FLOPS * EXAMPLE_MFU)
    fault_free = {
        "example_1b": {**ex, "group_gpus": group_size, "assumed_mfu": EXAMPLE_MFU,
                       **fault_free_overhead(fixed, 4 * ex["params"] / group_size, ex_step)},
        # 405B over Llama 3's 8-way tensor x 16-way pipeline parallelism (arXiv:2407.21783 sec. 3.3.2): at
        # most this many fp32 gradient bytes per GPU before any data-parallel sharding (an upper bound)
        "paper_setting": {"params_per_gpu": 405e9 / (8 * 16),
                          **fault_free_overhead(fixed, 4 * 405e9 / (8 * 16), step_s)},
        "source": (f"{inputs['ft_fixed_step_s']['source']}; HBM {HBM_BYTES_PER_S / 1e12:g} TB/s and "
                   f"{H100_BF16_FLOPS / 1e12:g} TFLOP/s BF16 (H100 SXM data sheet)"),
    }
    return {"inputs": inputs, "fault_free": fault_free,
            "ft_scale": scale or {"path": str(results / "ft_scale-cpu.json"), "usable": False,
                                                     "why": "not written yet: the stall, "
                                                            "heal and quorum are held at "
                                                            "their 2-group values (ft_recovery) for every N"},
            "table": table, "comparison": comparison, "validation": validation(inputs, results)}


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows the docs render (``{{ benchmark goodput-cpu.json }}``): inputs, the table, the paper,
    validation."""
    rows = [{"ratio": f"input `{k}` [{i['unit']}]: {i['what']} -- {i['source']}", "value": i["value"],
             "met": None}
            for k, i in result["inputs"].items()]
    for g, t in result["table"].items():
        for scenario in (k for k in t if k not in ("groups", "mtbf_min")):
            for mode in MODES:
                rows.append({"ratio": f"goodput at {int(g):,} GPUs ({t['groups']:,} groups, a failure every "
                                      f"{t['mtbf_min']:,.0f} min), `{mode}`, {scenario.replace('_', ' ')}",
                             "value": t[scenario][mode], "met": None})
    paper = result["comparison"]["ft_hsdp_paper"]
    for mode, value in paper["published"].items():
        rows.append(
            {"ratio": f"FT-HSDP paper at O(100K) GPUs, `{mode}` (published)", "value": value, "met": None}
        )
        rows.append({"ratio": "model with measured inputs at 100,000 GPUs, "
                              f"`{mode}`, at the paper's implied failure "
                              "rate", "value": paper["model_measured_at_implied_rate"][mode], "met": None})
    for k, x in paper["implied_mtbf_min"].items():
        rows.append(
            {"ratio": f"failure interval the paper's {k} point implies [min]", "value": x, "met": None}
        )
    tf = result["comparison"]["torchft_run"]
    rows.append({"ratio": "torchft 300-GPU run: cluster-seconds lost per failure its 82% implies [s]",
                 "value": tf["implied_lost_s_per_failure"], "met": None})
    rows.append({"ratio": "model with measured inputs at that run's size and rate, `ft_every_step`",
                 "value": tf["model_measured"]["ft_every_step"], "met": None})
    ff = result.get("fault_free") or {}
    for key, label in (("example_1b", "the ~1B example (configs/fsdp2_gpu_1b.yaml) on H100s"),
                       ("paper_setting", "a 405B-class step of --step-s at scale")):
        if key in ff:
            x = ff[key]
            parts = f"{x['fixed_s'] * 1e3:.2f} ms fixed + {x['division_s'] * 1e3:.2f} ms averaging"
            rows.append({"ratio": f"ft_every_step fault-free cost, {label}: ({parts}) / {x['step_s']:.3g} s",
                         "value": x["fraction"], "met": None})
    for r in result["validation"]:
        rows.append({"ratio": f"check at the measured conditions, `{r['run']}`: model / measured",
                     "value": f"{r['model']:.3f} / {r['measured']:.3f}", "met": None})
    return rows


def plot(result: dict[str, Any], path: Path) -> None:
    plt = common._pyplot()
    inputs = result["inputs"]
    rate = inputs["failures_per_gpu_hour"]["value"]
    scale = result["ft_scale"] if result["ft_scale"].get("usable") else None
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    gpus = [10 ** (2 + i / 20) for i in range(0, 67)]
    colors = {"restart": "tab:red", "ft_every_step": "tab:blue", "ft_diloco": "tab:green"}
    width = {"restart": 1.5, "ft_every_step": 4.0, "ft_diloco": 1.5}  # the two ft modes nearly coincide
    for published, style in ((False, "-"), (True, "--")):
        curves = [predict(inputs, g, rate, scale, published) for g in gpus]
        for mode in MODES:
            a.plot(gpus, [c[mode] for c in curves], style, color=colors[mode], lw=width[mode], alpha=0.8,
                   label=f"{mode}, {'FT-HSDP paper stalls' if published else 'measured inputs'}")
    paper = result["comparison"]["ft_hsdp_paper"]
    for mode, value in paper["published"].items():
        a.plot([paper["gpus"]], [value], "o", color=colors[mode], markersize=9, markeredgecolor="k")
    a.annotate("FT-HSDP paper (44% sync, 80% FT)", (paper["gpus"], 0.44), textcoords="offset points",
               xytext=(-190, -5))
    a.set(xscale="log", xlabel="GPUs", ylabel="goodput (effective training time)", ylim=(0, 1.02),
          title=f"at Llama 3's failure rate ({rate:.2e} per GPU-hour), "
                f"{inputs['group_size']['value']} GPUs per group")
    a.legend(fontsize=7, loc="lower left")
    rates = [10 ** (-6 + i / 20) for i in range(0, 100)]
    for published, style in ((False, "-"), (True, "--")):
        curves = [predict(inputs, paper["gpus"], r, scale, published) for r in rates]
        for mode in MODES:
            b.plot(rates, [c[mode] for c in curves], style, color=colors[mode], lw=width[mode], alpha=0.8)
    for k, mode in (("sync", "restart"), ("ft", "ft_every_step")):
        b.plot([paper["implied_failures_per_gpu_hour"][k]], [paper["published"][mode]], "o",
               color=colors[mode], markersize=9, markeredgecolor="k")
    if scale:
        reach = scale["n"][-1] * inputs["group_size"]["value"]
        a.axvline(reach, color="grey", lw=0.8, ls=":")
        a.text(reach, 0.03, " ft_scale's largest N", fontsize=8)
    b.axvline(rate, color="grey", lw=0.8)
    b.text(rate, 0.03, " Llama 3", fontsize=8)
    b.set(xscale="log", xlabel="failures per GPU-hour", ylim=(0, 1.02),
          title="at 100,000 GPUs (paper's points at the "
          "rate they imply)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the input result files are")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--step-s", type=float, default=6.0, help="step time at scale, seconds")
    parser.add_argument("--sync-every", type=int, default=8, help="inner steps per DiLoCo round")
    parser.add_argument("--group-size", type=int, default=8, help="GPUs per replica group")
    parser.add_argument("--alt-group-size", type=int, default=64, help="a second group size for the table")
    args = parser.parse_args(argv)
    rec = json.loads((args.results / "ft_recovery-cpu.json").read_text())
    result = {"suite": "goodput", "device": rec["device"], "device_name": rec["device_name"],
              "versions": common.versions(),
              "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/goodput.py",
                                                           *(argv or sys.argv[1:])]),
              "note": "A model, not a measurement: its inputs are the "
                      "measured figures and published numbers listed "
                      "below (each with its source); docs/goodput.md "
                      "explains the model and the difference from "
                      "the FT-HSDP paper's points.",
              "config": {"step_s": args.step_s, "sync_every": args.sync_every, "group_size": args.group_size,
                         "alt_group_size": args.alt_group_size}}
    result.update(build(args.results, args.step_s, args.sync_every, args.group_size, args.alt_group_size))
    result["summary"] = summary(result)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    png = args.out_dir / f"goodput-{result['device']}.png"
    plot(result, png)
    result["png_path"] = png.name
    path = args.out_dir / f"goodput-{result['device']}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path} and {png}")
    for g, t in result["table"].items():
        print(f"{int(g):>7,} GPUs: " + ", ".join(f"{m} {t['measured'][m]:.3f}/{t['published_stalls'][m]:.3f}"
                                                for m in MODES))
    return path


if __name__ == "__main__":
    main()
