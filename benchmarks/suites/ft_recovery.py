"""ft_recovery suite: what a fault costs with ``ft_hsdp`` versus plain ``hsdp`` restarting from a checkpoint.

Runs of the example model, one after another, each for the same number of committed steps:

* ``ft_nofault`` / ``ft_faults`` -- fsdp-strategies-ft, G replica groups x R ranks, ``sync: every_step``,
  without faults / with a whole replica group SIGKILLed every K seconds and restarted cold (a new torchrun:
  Python, imports, Trainer; it heals from a live peer while the others keep going);
* ``ft_faults_warm`` -- the same faults with ``--warm-spares``: the killed group is replaced by its standby
  incarnation (already imported and built, waiting without a process group), which heals from a peer;
* ``ft_nofault_fork`` / ``ft_faults_fork`` -- the same with ``--runner forkserver``: every incarnation's ranks
  are forked from a server that imported torch, Lightning and torchft once, so a restart skips the imports
  (and nothing runs between faults). Compared with each other only: forked ranks share their group's session,
  torchrun starts each rank in its own, and with Linux's autogroup scheduling two ranks sharing a core then
  step at different speeds (see docs/strategies/ft_launcher.md);
* ``ft_nofault_fork_aa`` -- ``ft_nofault_fork`` again: the A/A pair. Its ratio (committed samples/s) must hold
  1.00 over the rounds ``--pool`` judges together, or the rounds' separate-run goodput ratios lose their
  verdict (a host whose speed moves between runs by more than a fault costs cannot tell them);
* ``diloco_nofault`` / ``diloco_faults`` / ``diloco_faults_warm`` / ``diloco_nofault_fork`` /
  ``diloco_faults_fork`` -- the same with
  ``sync: diloco`` (``sync_every`` 8);
* ``hsdp_nofault`` / ``hsdp_restart`` -- plain ``hsdp`` on the same G x R ranks as one job, checkpointing
  every C steps; with faults, K seconds after each (re)start has taken its first step the whole job is
  SIGKILLed and restarted from its last checkpoint.

The replica groups are pinned to their own CPUs (``fsdp-strategies-ft --pin-cores``, ``auto`` by default:
the allowed CPUs split evenly), so a group that trains alone while its peer is down cannot borrow the dead
group's core and run faster than in the fault-free run; the hsdp job runs over all of those CPUs.

Reported: goodput = committed **samples** per second (from the first committed step to the last) under faults
/ the same mode without faults (target >= 0.95 for ``ft_hsdp``), with the restart's figure next to it; that
ratio at equal full-quorum step time (times each run's median step time with every group in the quorum /
the fault-free run's: this VM's speed moves by 5-10% between runs, which swamps the cost of a few faults; it
is valid because a fault leaves step times as they were, which is measured per fault as
``post_fault_step_ratio``: median step time in [+3, +44) s over that in [-15, -1) s, and the normalised ratio
is marked not comparable where that is off 1 by more than 3%, e.g. warm spares' start-up slows steps); the
seconds of fault-free training each fault cost (``lost_s_per_fault`` = (1 - goodput) x span / faults, so
goodput at another fault interval T is about 1 - lost_s_per_fault / T); the killed group's downtime per fault
(SIGKILL to its first committed step after it); the seconds each fault cost against the rate just before and
after it (``local_loss``: robust to a host whose speed drifts between runs) and the goodput that implies at
the fault interval; survivors' stall per fault (the gap between a survivor's committed steps around a kill,
minus its median step time); a recovery timeline PNG (committed step and participating groups over wall time,
fault marks). Committed samples come from the groups' events (``data_samples``: what each group trained in
each committed step or outer round; a step without a dead group's shard counts fewer samples); for hsdp,
committed steps x the global batch.

    python benchmarks/suites/ft_recovery.py --quick          # ~6 contenders x 1-3 min on 2 CPU cores
    python benchmarks/suites/ft_recovery.py --quick --steps 2400 --kill-every 10
    python benchmarks/suites/ft_recovery.py          # full: 2 x 2 ranks, 45 s between faults (~60 min)
    python benchmarks/suites/ft_recovery.py --contenders ft_nofault_fork ft_faults_fork --keep-other-runs
    python benchmarks/suites/ft_recovery.py --reanalyse     # figures from the stored runs, nothing rerun
    for r in 1 2 3; do python benchmarks/suites/ft_recovery.py --contenders ft_nofault_fork ft_faults_fork \
        --heartbeat-ms 300 --out-dir /tmp/hb300/$r; done
    python benchmarks/suites/ft_recovery.py --pool /tmp/hb300/1 /tmp/hb300/2 /tmp/hb300/3 \
        --out-dir benchmarks/results
    for r in 1 2 3; do  # the A/A pair alone, its order alternating (contenders run in the order given)
        if [ $((r % 2)) = 1 ]; then aa="ft_nofault_fork ft_nofault_fork_aa"; \
        else aa="ft_nofault_fork_aa ft_nofault_fork"; fi
        python benchmarks/suites/ft_recovery.py --contenders $aa --heartbeat-ms 300 --out-dir /tmp/aa/$r; done
    python benchmarks/suites/ft_recovery.py --pool /tmp/aa/1 /tmp/aa/2 /tmp/aa/3 --out-dir /tmp/aa/pooled
    python benchmarks/run.py ft_recovery
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common
import timing_stats

ROOT = common.ROOT
THIS = Path(__file__).resolve()
STEP_LOG_ENV = "FT_RECOVERY_STEP_LOG"
#: a folder: every worker rank writes a cProfile of its run there (``<group>_<rank>_<pid>.prof``)
PROFILE_ENV = "FT_RECOVERY_PROFILE_DIR"
CONTENDERS = ("ft_nofault", "ft_faults", "ft_faults_warm", "ft_nofault_fork", "ft_nofault_fork_aa",
              "ft_faults_fork",
              "diloco_nofault",
              "diloco_faults", "diloco_faults_warm", "diloco_nofault_fork", "diloco_faults_fork",
              "hsdp_nofault", "hsdp_restart")
#: the fault-free run each faulty one is compared with
#: (forkserver runs against forkserver runs: forked ranks step faster than torchrun's, see
#: docs/strategies/ft_launcher.md)
REFERENCE = {"ft_faults": "ft_nofault", "ft_faults_warm": "ft_nofault", "ft_faults_fork": "ft_nofault_fork",
             "diloco_faults": "diloco_nofault", "diloco_faults_warm": "diloco_nofault",
             "diloco_faults_fork": "diloco_nofault_fork", "hsdp_restart": "hsdp_nofault"}
FAULTY = tuple(REFERENCE)
#: the A/A pair: the same fault-free job twice (each round), whose ratio must hold 1.00 for the separate-run
#: ratios of the rounds to mean anything
AA = ("ft_nofault_fork", "ft_nofault_fork_aa")
#: the contenders the >= 0.95 goodput target applies to (ft_hsdp every-step training)
TARGETED = ("ft_faults", "ft_faults_warm", "ft_faults_fork")
GOODPUT_TARGET = 0.95


def _target(value: float, targeted: bool) -> dict[str, Any]:
    """A summary row's target fields: the goodput target and whether ``value`` meets it, where it applies."""
    return {
        "target_min": GOODPUT_TARGET if targeted else None,
        "met": value >= GOODPUT_TARGET if targeted else None,
    }


def _config_differences(stored: dict[str, Any], now: dict[str, Any], keys: Any) -> dict[str, tuple[Any, Any]]:
    """``{option: (stored, now)}`` for every key of ``keys`` whose value differs between two results'
    configs."""
    return {k: (stored.get(k), now.get(k)) for k in keys if stored.get(k) != now.get(k)}


# ---------------------------------------------------------------------------------------------- worker mode
def _worker_main(argv: list[str]) -> None:
    """``python ft_recovery.py --worker CKPT_DIR|- [LightningCLI args]``: the example + a step timeline.

    With a checkpoint folder (the hsdp contender) it saves every ``FT_RECOVERY_CKPT_EVERY`` steps and
    resumes from the newest complete checkpoint there.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.cli import LightningCLI

    sys.path.insert(0, str(ROOT / "examples"))
    import fsdp_strategies  # noqa: F401
    from llama import LlamaLM, MarkovDataModule

    ckpt_dir, args = argv[0], argv[1:]

    class StepLog(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            path = os.environ.get(STEP_LOG_ENV)
            if path and trainer.global_rank == 0:
                with open(path, "a") as fh:
                    fh.write(
                        json.dumps({"t": time.time(), "step": trainer.global_step, "committed": True}) + "\n"
                    )

    callbacks: list[pl.Callback] = [StepLog()]
    if ckpt_dir != "-":
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="step{step}",
                                         auto_insert_metric_name=False,
                                         every_n_train_steps=int(os.environ.get("FT_RECOVERY_CKPT_EVERY",
                                                                                "20")),
                                         save_top_k=1, monitor="step", mode="max"))
        done = sorted(
            (p for p in Path(ckpt_dir).glob("step*.ckpt") if (p / ".metadata").exists() or p.is_file()),
            key=lambda p: int(p.name[4:-5]),
        )
        if done:
            args = [*args, "--ckpt_path", str(done[-1])]
    LightningCLI(LlamaLM, MarkovDataModule, args=args, trainer_defaults={"callbacks": callbacks},
                 save_config_callback=None)


# ---------------------------------------------------------------------------------------------- runs
def _model_args(size: str, steps: int, groups: int, ranks: int) -> list[str]:
    cfg = common.SIZES[size]
    batch = max(1, cfg["global_batch"] // (groups * ranks))
    args = ["--trainer.max_steps", str(steps), "--trainer.logger", "false", "--trainer.limit_val_batches",
            "0", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--data.seq_len", str(cfg["seq_len"]), "--model.max_seq_len", str(cfg["seq_len"]),
            "--data.batch_size", str(batch), "--data.num_train", str(batch * groups * ranks * 64),
            "--data.num_val", "8"]
    for key, value in cfg["model"].items():
        args += [f"--model.{key}", str(value)]
    if "vocab_size" in cfg["model"]:
        args += ["--data.vocab_size", str(cfg["model"]["vocab_size"])]
    return args


def _global_batch(size: str, groups: int, ranks: int) -> int:
    """Samples per committed step with every group in it (what :func:`_model_args` configures)."""
    return max(1, common.SIZES[size]["global_batch"] // (groups * ranks)) * groups * ranks


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_ft(work: Path, size: str, steps: int, groups: int, ranks: int, kill_every: float | None,
            heartbeat_ms: int, timeout: float, sync: str = "every_step", pin_cores: str = "auto",
            warm_spares: bool = False, runner: str = "torchrun", src: Path | None = None) -> dict[str, Any]:
    """``src``: the ranks import the package from this folder (another checkout's ``src``; default: this
    one's)."""
    from fsdp_strategies.ft.launch.launcher import run as ft_run

    events = work / "events"
    config = {"every_step": "ft_hsdp.yaml", "diloco": "ft_hsdp_diloco.yaml"}[sync]
    command = [str(THIS), "--worker", "-", "fit", "--config", str(ROOT / "configs" / config),
               "--trainer.devices", str(ranks), "--trainer.enable_checkpointing", "false",
               "--trainer.strategy.init_args.timeout_s", "10", "--trainer.strategy.init_args.init_sync",
               "false", *_model_args(size, steps, groups, ranks)]
    result = ft_run(command, groups=groups, ranks_per_group=ranks, min_replicas=1 if kill_every else groups,
                    heartbeat_timeout_ms=heartbeat_ms, join_timeout_ms=min(heartbeat_ms, 1000),
                    kill_every=kill_every, max_restarts=50 if kill_every else 0, events_dir=events,
                    timeout=timeout, pin_cores=pin_cores, warm_spares=warm_spares, runner=runner,
                    env={"PYTHONPATH": os.pathsep.join([str(src or ROOT / "src"), str(ROOT / "examples")])})
    timelines = {g: _read(events / f"group{g}.jsonl") for g in range(groups)}
    faults = [k for k in result.kills if str(k.get("why", "")).startswith(("every", "at step"))]
    launcher = _read(events / "launcher.jsonl")
    return {"returncode": result.returncode, "kills": faults, "restarts": result.restarts,
            "wall_s": result.wall_s, "timelines": timelines, "cores": _launcher_cores(events),
            "spares": [r for r in launcher if r.get("event") in ("spare", "spare_ready", "spare_exit")]}


def _launcher_cores(events: Path) -> dict[str, Any]:
    """The CPUs each replica group's processes were pinned to (from the launcher's start records)."""
    return {
        str(r["group"]): r.get("cores") for r in _read(events / "launcher.jsonl") if r.get("event") == "start"
    }


def _run_hsdp_restart(work: Path, size: str, steps: int, groups: int, ranks: int, kill_every: float | None,
                      ckpt_every: int, timeout: float) -> dict[str, Any]:
    from fsdp_strategies.ft.launch.process_tree import kill_tree

    ckpt, log = work / "ckpt", work / "steps.jsonl"
    ckpt.mkdir(parents=True, exist_ok=True)
    # ckpt_every 0: no checkpoints at all (a fault-free comparison with ft_hsdp, which writes none either)
    saving = [str(ckpt)] if ckpt_every > 0 else ["-"]
    no_ckpt = [] if ckpt_every > 0 else ["--trainer.enable_checkpointing", "false"]
    world = groups * ranks
    env = common.worker_env({STEP_LOG_ENV: str(log), "FT_RECOVERY_CKPT_EVERY": str(ckpt_every),
                             "OMP_NUM_THREADS": "1",
                             "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "examples")])})
    kills: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []
    t0 = time.time()
    incarnation = 0
    with (work / "hsdp.log").open("ab") as out:
        while True:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--nnodes=1",
                   "--master_addr=127.0.0.1", f"--master_port={common.free_port()}", str(THIS), "--worker",
                   *saving, "fit", "--config", str(ROOT / "configs" / "hsdp.yaml"), "--trainer.devices",
                   str(world), *no_ckpt,
                   "--trainer.strategy.init_args.replicate_degree", str(groups),
                   "--trainer.strategy.init_args.shard_degree", str(ranks),
                   *_model_args(size, steps, groups, ranks)]
            proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(ROOT)
            )
            if incarnation:
                restarts.append({"t": time.time(), "restart": incarnation})
            # K seconds of training after each (re)start's first step (a wall-clock fault shorter than
            # the restart would never let the job progress)
            next_kill = float("inf")
            first_seen = len(_read(log))
            while proc.poll() is None:
                now = time.time()
                if now - t0 > timeout:
                    kill_tree(proc.pid)
                    proc.wait()
                    return {"returncode": 124, "kills": kills, "restarts": restarts, "wall_s": now - t0,
                            "timelines": {0: _read(log)}}
                if kill_every and next_kill == float("inf") and len(_read(log)) > first_seen:
                    next_kill = now + kill_every
                if now >= next_kill:
                    kill_tree(proc.pid)
                    proc.wait()
                    done = [r["step"] for r in _read(log)]
                    kills.append({"t": now, "group": "all", "step": max(done, default=0)})
                    break
                time.sleep(0.05)
            if proc.returncode == 0:
                break
            incarnation += 1
    import shutil

    shutil.rmtree(ckpt, ignore_errors=True)  # only needed for the restarts
    return {"returncode": 0, "kills": kills, "restarts": restarts, "wall_s": time.time() - t0,
            "timelines": {0: _read(log)}}


# ---------------------------------------------------------------------------------------------- analysis
def _committed(timeline: list[dict[str, Any]]) -> list[tuple[float, int]]:
    return [(r["t"], r["step"]) for r in timeline if r.get("committed")]


def _goodput(run: dict[str, Any], global_batch: int) -> dict[str, Any]:
    """Committed steps and samples per second over the whole run: from the first committed step anywhere to
    the last. Samples: what the groups' events say each committed step (or outer round) trained -- the first
    record's excluded, as the span starts there; without such records (hsdp) steps x ``global_batch``."""
    points = [p for tl in run["timelines"].values() for p in _committed(tl)]
    if len(points) < 2:
        return {"steps": 0, "samples": 0, "seconds": None, "steps_per_s": None, "samples_per_s": None}
    t_first, t_last = min(t for t, _ in points), max(t for t, _ in points)
    first_step = min(s for _, s in points)
    last_step = max(s for _, s in points)
    span = t_last - t_first
    rows = [r for tl in run["timelines"].values() for r in tl if r.get("committed") and "t" in r]
    if any("data_samples" in r for r in rows):
        samples = sum(int(r.get("data_samples") or 0) for r in rows if r["t"] > t_first)
    else:
        samples = (last_step - first_step) * global_batch
    return {"steps": last_step - first_step, "samples": samples, "seconds": span,
            "steps_per_s": (last_step - first_step) / span if span > 0 else None,
            "samples_per_s": samples / span if span > 0 else None}


def _full_quorum_steps(run: dict[str, Any], groups: int) -> list[tuple[float, float]]:
    """(time, step_s) of every step taken while all ``groups`` were in the quorum (runs without participant
    records, i.e. hsdp, give none)."""
    return sorted((r["t"], r["step_s"]) for tl in run["timelines"].values() for r in tl
                  if "step_s" in r and "t" in r and r.get("participants") == groups)


def _step_time(run: dict[str, Any], groups: int) -> float | None:
    """Median seconds per step with every group in the quorum: how fast the host ran during that run."""
    steps = _full_quorum_steps(run, groups)
    return statistics.median(s for _, s in steps) if len(steps) > 20 else None


POST_FAULT = (3.0, 44.0)
PRE_FAULT = (-15.0, -1.0)
# |post_fault_step_ratio - 1| up to which the step-normalised ratio is reported as valid
POST_FAULT_TOLERANCE = 0.03


def _post_fault_step_ratios(run: dict[str, Any], groups: int) -> list[dict[str, Any]]:
    """Per fault: the median full-quorum step time in ``POST_FAULT`` (up to the next fault) over that in
    ``PRE_FAULT``. About 1 when a fault leaves nothing slower behind it (e.g. a leaked thread or a cold
    restarted rank); this is what lets a run's step time stand for the host's speed in the step-normalised
    ratio."""
    steps = _full_quorum_steps(run, groups)
    kills = sorted(k["t"] for k in run["kills"])
    out = []
    for i, k in enumerate(kills):
        end = min(k + POST_FAULT[1], kills[i + 1] if i + 1 < len(kills) else float("inf"))
        before = [s for t, s in steps if k + PRE_FAULT[0] <= t < k + PRE_FAULT[1]]
        after = [s for t, s in steps if k + POST_FAULT[0] <= t < end]
        if len(before) > 20 and len(after) > 20:
            out.append({"fault_t": k, "ratio": statistics.median(after) / statistics.median(before)})
    return out


def _downtimes(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per fault of a replica group: seconds from its SIGKILL to its own first committed step after it (its
    restart's start-up, quorum and heal); ``None`` if it never committed again (e.g. training ended first)."""
    out = []
    for kill in run["kills"]:
        timeline = run["timelines"].get(str(kill.get("group")), run["timelines"].get(kill.get("group")))
        if timeline is None:
            continue
        after = [t for t, _ in _committed(timeline) if t > kill["t"]]
        out.append(
            {"fault_t": kill["t"], "group": kill["group"], "down_s": after[0] - kill["t"] if after else None}
        )
    return out


#: around each fault: the window whose samples count ([-5 s, +30 s]) and the two that give its local rate
LOCAL_WINDOW = (-5.0, 30.0)
LOCAL_BASELINE = ((-20.0, -5.0), (30.0, 40.0))


def _progress_points(run: dict[str, Any], global_batch: int) -> list[tuple[float, int]]:
    """(time, samples) of every commit that advanced training: a group's ``data_samples``; for hsdp, the
    global batch of each step beyond the furthest step reached so far (steps redone after a restart add
    nothing)."""
    rows = sorted((r for tl in run["timelines"].values() for r in tl if r.get("committed") and "t" in r),
                  key=lambda r: r["t"])
    if any("data_samples" in r for r in rows):
        return [(r["t"], int(r.get("data_samples") or 0)) for r in rows]
    points, furthest = [], None
    for r in rows:
        if furthest is None or r["step"] > furthest:
            if furthest is not None:
                points.append((r["t"], (r["step"] - furthest) * global_batch))
            furthest = r["step"]
    return points


def _local_losses(run: dict[str, Any], global_batch: int) -> list[dict[str, Any]]:
    """Per fault: the seconds of training it cost against the rate just before and after it
    (``LOCAL_BASELINE``), not against a separate fault-free run, so a host whose speed drifts by several
    percent over minutes (as this VM's does) does not swamp a loss of a few seconds. Faults whose windows
    overlap another fault or the run's ends are left out."""
    points = _progress_points(run, global_batch)
    if not points:
        return []
    start, end = points[0][0], points[-1][0]
    kills = sorted(k["t"] for k in run["kills"])
    lo, hi = LOCAL_WINDOW
    reach = (min(a for a, _ in LOCAL_BASELINE), max(b for _, b in LOCAL_BASELINE))

    def samples(a: float, b: float) -> int:
        return sum(n for t, n in points if a < t <= b)

    out = []
    for k in kills:
        if (
            k + reach[0] < start
            or k + reach[1] > end
            or any(o != k and k + reach[0] < o < k + reach[1] for o in kills)
        ):
            continue
        base_s = sum(b - a for a, b in LOCAL_BASELINE)
        rate = sum(samples(k + a, k + b) for a, b in LOCAL_BASELINE) / base_s
        if rate <= 0:
            continue
        out.append({"fault_t": k, "rate": rate, "lost_s": (hi - lo) - samples(k + lo, k + hi) / rate})
    return out


def _stalls(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per fault and per surviving group: extra time between its committed steps around the kill."""
    out = []
    for kill in run["kills"]:
        for gid, timeline in run["timelines"].items():
            if str(gid) == str(kill.get("group")):
                continue
            points = _committed(timeline)
            times = [t for t, _ in points]
            before = [t for t in times if t <= kill["t"]]
            after = [t for t in times if t > kill["t"]]
            if not before or not after:
                continue
            gaps = [b - a for a, b in itertools.pairwise(times)]
            typical = statistics.median(gaps) if gaps else 0.0
            out.append(
                {"fault_t": kill["t"], "survivor": gid, "stall_s": max(0.0, after[0] - before[-1] - typical)}
            )
    return out


def _plot(runs: dict[str, dict[str, Any]], path: Path) -> Path:
    plt = common._pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    colors = {"ft_nofault": "tab:gray", "ft_faults": "tab:blue", "diloco_nofault": "tab:olive",
              "diloco_faults": "tab:green", "hsdp_nofault": "tab:pink", "hsdp_restart": "tab:red",
              "ft_faults_warm": "tab:cyan", "diloco_faults_warm": "tab:purple",
              "ft_faults_fork": "tab:orange",
              "diloco_faults_fork": "tab:brown", "ft_nofault_fork": "gold", "diloco_nofault_fork": "black"}
    shown = next((n for n in ("ft_faults_fork", "ft_faults_warm", "ft_faults") if n in runs), "ft_faults")
    t0s = {name: min((r["t"] for tl in run["timelines"].values() for r in tl if "t" in r), default=0.0)
           for name, run in runs.items()}
    for name, run in runs.items():
        t0 = t0s[name]
        for gid, timeline in run["timelines"].items():
            pts = _committed(timeline)
            if not pts:
                continue
            label = f"{name}" + (f" group {gid}" if name.startswith("ft") else "")
            axes[0].plot([t - t0 for t, _ in pts], [s for _, s in pts], ".", ms=2, color=colors.get(name),
                         alpha=0.5 + 0.5 * (int(gid) == 0 if str(gid).isdigit() else 1), label=label)
        for kill in run["kills"]:
            axes[0].axvline(kill["t"] - t0, color=colors.get(name), ls="--", lw=0.8, alpha=0.6)
        if name == shown:
            rows = sorted((r["t"] - t0, r.get("participants", 0),
                           r["group"]) for tl in run["timelines"].values()
                          for r in tl if r.get("committed"))
            for gid in run["timelines"]:
                xs = [t for t, _, g in rows if g == int(gid)]
                ys = [p for _, p, g in rows if g == int(gid)]
                axes[1].step(xs, ys, where="post", label=f"participants seen by group {gid}")
            for kill in run["kills"]:
                axes[1].axvline(kill["t"] - t0, color="k", ls="--", lw=0.8)
    axes[0].set_ylabel("committed step")
    axes[0].legend(fontsize=6, markerscale=4, ncol=2, loc="upper left")
    axes[0].set_title("Recovery timeline (dashed: SIGKILL of a replica group / of the whole hsdp job)")
    axes[1].set_ylabel(f"participating groups\n({shown})")
    axes[1].set_xlabel("wall time since the first step [s]")
    axes[1].legend(fontsize=7)
    return common.save_figure(fig, path)


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, ranks: list[int] | None = None,
        steps: int | None = None, kill_every: float | None = None, heartbeat_ms: int | None = None,
        ckpt_every: int | None = None, contenders: list[str] | None = None, pin_cores: str = "auto",
        keep_other_runs: bool = False, reanalyse: bool = False, pool: list[str] | None = None,
        **_: Any) -> dict[str, Any]:
    if pool:
        return _pool(pool, Path(out_dir))
    size = common.pick(sizes, quick, ["tiny"], ["small"])[0]
    rpg = common.pick(ranks, quick, [1], [2])[0]
    groups = 2
    steps = common.pick(steps, quick, 800, 3000)
    kill_every = common.pick(kill_every, quick, 12.0, 45.0)
    heartbeat_ms = common.pick(heartbeat_ms, quick, 1000, 1000)
    ckpt_every = common.pick(ckpt_every, quick, 20, 50)
    timeout = 900.0 if quick else 3600.0
    # in the order given (an A/A pair's order alternates between rounds: the first job of a round meets a
    # colder page cache), else the suite's
    names = [] if reanalyse else [n for n in (contenders or CONTENDERS) if n in CONTENDERS]
    work = Path(out_dir) / "ft_recovery-work"
    config = {"size": size, "groups": groups, "ranks_per_group": rpg, "steps": steps,
              "kill_every_s": kill_every,
              "heartbeat_timeout_ms": heartbeat_ms, "hsdp_ckpt_every": ckpt_every, "quick": quick,
              "pin_cores": pin_cores}
    keep = keep_other_runs or reanalyse
    runs: dict[str, dict[str, Any]] = _kept_runs(Path(out_dir), config, names) if keep else {}
    for name in names:
        wdir = work / name
        if wdir.exists():
            import shutil

            shutil.rmtree(wdir)
        wdir.mkdir(parents=True)
        print(f"ft_recovery: running {name} ...", file=sys.stderr, flush=True)
        faults = kill_every if name in FAULTY else None
        if name.startswith("hsdp"):
            runs[name] = _run_hsdp_restart(wdir, size, steps, groups, rpg, faults, ckpt_every, timeout)
        else:
            runs[name] = _run_ft(wdir, size, steps, groups, rpg, faults, heartbeat_ms, timeout,
                                 sync="diloco" if name.startswith("diloco") else "every_step",
                                 pin_cores=pin_cores, warm_spares=name.endswith("_warm"),
                                 runner="forkserver" if "_fork" in name else "torchrun")
        runs[name]["measured_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs = {n: runs[n] for n in CONTENDERS if n in runs}
    global_batch = _global_batch(size, groups, rpg)
    figures: dict[str, Any] = {}
    for name, r in runs.items():
        figures[name] = {"goodput": _goodput(r, global_batch), "faults": len(r["kills"]),
                         "restarts": len(r["restarts"]), "returncode": r["returncode"],
                         "cores": r.get("cores")}
    summary: list[dict[str, Any]] = []
    for name in FAULTY:
        ref_name = REFERENCE[name]
        good = figures.get(name, {}).get("goodput", {})
        post = _post_fault_step_ratios(runs[name], groups) if name in runs else []
        post_median = statistics.median(x["ratio"] for x in post) if post else None
        sps, ref = (
            good.get("samples_per_s"),
            figures.get(ref_name, {}).get("goodput", {}).get("samples_per_s"),
        )
        if ref and sps:
            value = sps / ref
            figures[name]["goodput_vs_nofault"] = value
            summary.append({"ratio": f"{name} goodput / {ref_name} (committed samples/s)", "value": value,
                            **_target(value, name in TARGETED)})
            step_f, step_ref = _step_time(runs[name], groups), _step_time(runs[ref_name], groups)
            if step_f and step_ref and post_median is not None:
                # the same ratio had both runs stepped at one speed: the host's speed moves by 5-10% between
                # separate runs here. Only a stand-in for the host's speed where faults leave step times as
                # they were; where they slow steps (a spare starting up), that slowdown is part of the faults'
                # cost
                normalised = value * step_f / step_ref
                valid = abs(post_median - 1) <= POST_FAULT_TOLERANCE
                figures[name]["goodput_vs_nofault_step_normalised"] = normalised
                figures[name]["step_normalised_valid"] = valid
                figures[name]["step_s_full_quorum"] = {"faults": step_f, "fault_free": step_ref}
                label = f"{name} goodput / {ref_name} at equal full-quorum step time"
                if not valid:
                    label += f" (not comparable: steps after faults {post_median - 1:+.1%})"
                summary.append(
                    {"ratio": label, "value": normalised, **_target(normalised, name in TARGETED and valid)}
                )
            if figures[name]["faults"]:
                # the fault-free seconds each fault cost: at interval T, goodput ~ 1 - lost / T
                lost = (1 - value) * good["seconds"] / figures[name]["faults"]
                figures[name]["lost_s_per_fault"] = lost
                summary.append(
                    {"ratio": f"{name} fault-free seconds lost per fault", "value": lost, "met": None}
                )
        local = _local_losses(runs[name], global_batch) if name in runs else []
        if local:
            lost_local = statistics.median(x["lost_s"] for x in local)
            estimate = 1 - lost_local / kill_every
            figures[name]["local_loss"] = {"median_lost_s": lost_local, "faults_measured": len(local),
                                           "goodput_at_kill_every": estimate, "per_fault": local}
            summary.append({"ratio": f"{name} seconds lost per fault vs the "
                                     f"local rate, median of {len(local)}",
                            "value": lost_local, "met": None})
            summary.append({"ratio": f"{name} goodput at one fault per {kill_every:g} s, from that loss",
                            "value": estimate, **_target(estimate, name in TARGETED)})
        if post:
            figures[name]["post_fault_step_ratio"] = {"median": post_median, "per_fault": post}
            summary.append({"ratio": f"{name} step time after a fault / before it, median of {len(post)}",
                            "value": post_median, "met": None})
        if name.startswith(("ft", "diloco")) and name in runs:
            down = [d["down_s"] for d in _downtimes(runs[name]) if d["down_s"] is not None]
            if down:
                figures[name]["downtime_s"] = {"median": statistics.median(down), "max": max(down),
                                               "per_fault": _downtimes(runs[name])}
                summary.append({"ratio": f"{name} killed group's downtime per fault, median [s]",
                                "value": statistics.median(down), "met": None})
    for name in TARGETED:
        stalls = _stalls(runs[name]) if name in runs else []
        if stalls:
            worst = max(s["stall_s"] for s in stalls)
            figures[name]["stall_s"] = {
                "median": statistics.median(s["stall_s"] for s in stalls),
                "max": worst,
                "per_fault": stalls,
            }
            summary.append(
                {"ratio": f"{name} survivors' max stall per fault [s]", "value": worst, "met": worst < 5.0}
            )
    aa = _pooled_aa([(Path(out_dir), {"figures": figures})])
    if aa is not None:  # one round: no interval, so no verdict (the rounds pooled give one)
        summary.append(_aa_row(aa, ""))
    config = {**config, "global_batch": global_batch, "contenders": list(runs), "measured_now": names}
    result = {**common.header("ft_recovery", config), "figures": figures, "summary": summary,
              "runs": {n: {k: v for k, v in r.items()} for n, r in runs.items()}}
    png = _plot(runs, Path(out_dir) / f"ft_recovery-{common.device_slug()}.png")
    result["png_path"] = str(png)
    json_path = common.write_result("ft_recovery", result, Path(out_dir))
    result["json_path"] = str(json_path)
    return result


POOL_KEYS = ("size", "groups", "ranks_per_group", "steps", "kill_every_s", "heartbeat_timeout_ms",
             "hsdp_ckpt_every", "quick", "pin_cores", "global_batch")


def _pool(dirs: list[str], out_dir: Path) -> dict[str, Any]:
    """``--pool DIR ...``: one verdict from several rounds of the same configuration (each DIR holds one run's
    result), because on this VM one round's separate-run ratio moves by up to 0.1 with the host's speed.
    Per faulty contender: every round's separate-run ratio (only where that round also ran its fault-free
    reference), every fault's local loss pooled over the rounds, and what their median implies at the fault
    interval. Nothing is rerun; the per-round figures are the ones each round stored."""
    rounds = []
    for d in dirs:
        path = common.result_path("ft_recovery", Path(d))
        if not path.exists():
            raise SystemExit(
                f"--pool: no ft_recovery result at {path}; run the suite with --out-dir {d} first"
            )
        rounds.append((path, json.loads(path.read_text())))
    first = rounds[0][1].get("config", {})
    for path, r in rounds[1:]:
        differs = _config_differences(first, r.get("config", {}), POOL_KEYS)
        if differs:
            raise SystemExit(f"--pool: {path} was measured with another configuration than {rounds[0][0]} "
                             f"(option: (first, this)) {differs}; pool rounds of one configuration only")
    kill_every = first.get("kill_every_s")
    figures: dict[str, Any] = {}
    summary: list[dict[str, Any]] = []
    for name in FAULTY:
        per_round = []
        for path, r in rounds:
            fig = r.get("figures", {}).get(name)
            if not fig:
                continue
            per_round.append({"result": str(path),
                              "measured_utc": r.get("runs", {}).get(name, {}).get("measured_utc"),
                              "goodput_vs_nofault": fig.get("goodput_vs_nofault"),
                              "goodput_vs_nofault_step_normalised":
                                  fig.get("goodput_vs_nofault_step_normalised")
                                  if fig.get("step_normalised_valid") else None,
                              "post_fault_step_ratio": fig.get("post_fault_step_ratio", {}).get("median"),
                              "local_lost_s": [x["lost_s"] for x in fig.get("local_loss", {}).get("per_fault",
                                                                                                  [])],
                              "downtime_median_s": fig.get("downtime_s", {}).get("median"),
                              "stall_max_s": fig.get("stall_s", {}).get("max")})
        if not per_round:
            continue
        targeted = name in TARGETED
        ratios = [x["goodput_vs_nofault"] for x in per_round if x["goodput_vs_nofault"] is not None]
        lost = sorted(v for x in per_round for v in x["local_lost_s"])
        normalised = [x["goodput_vs_nofault_step_normalised"] for x in per_round
                      if x["goodput_vs_nofault_step_normalised"] is not None]
        fig_out: dict[str, Any] = {"rounds": per_round, "separate_run_ratios": ratios,
                                   "step_normalised_ratios": normalised, "local_lost_s_pooled": lost}
        for key, values, label in (("separate_run_ratio", ratios, "goodput / fault-free"),
                                   ("step_normalised_ratio", normalised,
                                    "goodput / fault-free at equal step time")):
            if values:
                fig_out[f"{key}_median"] = statistics.median(values)
                summary.append({"ratio": f"{name} {label}, median of {len(values)} rounds",
                                "value": statistics.median(values),
                                **_target(statistics.median(values), targeted)})
        if lost and kill_every:
            median_lost = statistics.median(lost)
            fig_out.update(local_lost_s_median=median_lost,
                           goodput_at_kill_every=1 - median_lost / kill_every,
                           goodput_at_kill_every_range=[1 - lost[-1] / kill_every, 1 - lost[0] / kill_every])
            summary.append({"ratio": f"{name} seconds lost per fault, median of {len(lost)} faults "
                                     f"in {len(per_round)} rounds", "value": median_lost, "met": None})
            summary.append({"ratio": f"{name} goodput at one fault per {kill_every:g} s, from that loss",
                            "value": 1 - median_lost / kill_every,
                            **_target(1 - median_lost / kill_every, targeted)})
        figures[name] = fig_out
    aa = _pooled_aa(rounds)
    if aa is not None:
        summary.append(_aa_row(aa, f", {aa['rounds_paired']} rounds"))
        if not aa["met"]:  # the rounds' separate-run ratios cannot be trusted: no verdict on them
            ci = aa["ci95"]
            shown = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else " (no interval: < 2 rounds)"
            for row in summary:
                if row.get("target_min") is not None:
                    row["met"] = None
                    row["verdict"] = (f"withheld: the A/A pair came out at {aa['value']:.3f}{shown}, not an "
                                      "interval holding 1.00; rerun more rounds on a quiet machine")
    if not figures and aa is None:
        raise SystemExit(f"--pool: none of {dirs} holds a faulty contender's figures or the A/A pair {AA}")
    config = {**{k: first.get(k) for k in POOL_KEYS}, "pooled": [str(p) for p, _ in rounds]}
    result = {**common.header("ft_recovery_pooled", config), "figures": figures, "summary": summary,
              "aa": aa}
    png = Path(out_dir) / f"ft_recovery_pooled-{common.device_slug()}.png"
    result["png_path"] = str(_plot_pool(figures, kill_every, png)) if figures else None  # A/A only: none
    result["json_path"] = str(common.write_result("ft_recovery_pooled", result, Path(out_dir)))
    return result


def _pooled_aa(rounds: list[tuple[Path, dict[str, Any]]]) -> dict[str, Any] | None:
    """The A/A pair over the rounds that ran both (:data:`AA`): per-round ratio of committed samples/s, its
    interval, and whether that holds 1.00 (``timing_stats``); ``None`` when no round ran both."""
    pairs = [[r.get("figures", {}).get(n, {}).get("goodput", {}).get("samples_per_s") for n in AA]
             for _, r in rounds]
    pairs = [p for p in pairs if all(p)]
    if not pairs:
        return None
    return timing_stats.judge(timing_stats.paired_ratio([a for a, _ in pairs], [b for _, b in pairs]),
                              None, aa=True)


def _aa_row(aa: dict[str, Any], rounds: str) -> dict[str, Any]:
    """The summary row of :func:`_pooled_aa`'s result (``rounds``: how many, in the label)."""
    return {"ratio": f"A/A: {AA[0]} / {AA[1]} (committed samples/s){rounds}", "value": aa["value"],
            "ci95": aa["ci95"], "aa": True, "target": 1.0, "met": aa["met"]}


def _plot_pool(figures: dict[str, Any], kill_every: float | None, path: Path) -> Path:
    """Left: each round's separate-run ratio and its step-normalised ratio; right: each fault's local loss
    (one colour a round) with the pooled median, one column per contender."""
    plt = common._pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    names = list(figures)
    for i, name in enumerate(names):
        ratios, normalised = figures[name]["separate_run_ratios"], figures[name]["step_normalised_ratios"]
        axes[0].scatter([i - 0.05] * len(ratios), ratios, color="tab:blue", zorder=3,
                        label="separate-run ratio" if i == 0 else None)
        axes[0].scatter([i + 0.05] * len(normalised), normalised, color="tab:orange", zorder=3,
                        label="at equal full-quorum step time" if i == 0 else None)
        for j, rnd in enumerate(figures[name]["rounds"]):
            pts = rnd["local_lost_s"]
            axes[1].scatter([i + (j - (len(figures[name]["rounds"]) - 1) / 2) * 0.08] * len(pts), pts, s=14,
                            label=f"round {j + 1}" if i == 0 else None, zorder=3)
        if figures[name].get("local_lost_s_median") is not None:
            axes[1].hlines(figures[name]["local_lost_s_median"], i - 0.3, i + 0.3, color="k")
    axes[0].axhline(GOODPUT_TARGET, color="tab:red", ls="--", lw=0.8, label=f"target {GOODPUT_TARGET:g}")
    axes[0].set_ylabel("goodput / fault-free run (one dot a round)")
    if kill_every:
        axes[1].axhline((1 - GOODPUT_TARGET) * kill_every, color="tab:red", ls="--", lw=0.8,
                        label=f"{GOODPUT_TARGET:g} at one fault per {kill_every:g} s")
    axes[1].set_ylabel("seconds lost per fault vs the local rate\n(black: pooled median)")
    for ax in axes:
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_xlim(-0.5, len(names) - 0.5)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("ft_recovery pooled over rounds")
    return common.save_figure(fig, path)


def _kept_runs(out_dir: Path, config: dict[str, Any], rerun: list[str]) -> dict[str, dict[str, Any]]:
    """``--keep-other-runs``: the stored runs of the contenders not run now, from this suite's last result in
    ``out_dir`` -- only if it was measured with the same configuration (else the ratios would mix setups)."""
    path = common.result_path("ft_recovery", out_dir)
    if not path.exists():
        raise SystemExit(f"--keep-other-runs: no earlier result at {path}; run the suite without it first")
    old = json.loads(path.read_text())
    differs = _config_differences(old.get("config", {}), config, config)
    if differs:
        raise SystemExit(f"--keep-other-runs: {path} was measured with another configuration "
                         f"(option: (stored, now)) {differs}; rerun every contender instead")
    return {n: r for n, r in old.get("runs", {}).items() if n in CONTENDERS and n not in rerun}


def _add_options(parser: Any) -> None:
    """This suite's own flags (``run``'s keyword arguments of the same names)."""
    parser.add_argument("--kill-every", type=float, default=None, help="seconds between faults")
    parser.add_argument("--heartbeat-ms", type=int, default=None, help="lighthouse heartbeat timeout")
    parser.add_argument(
        "--ckpt-every", type=int, default=None, help="hsdp_restart: steps between checkpoints"
    )
    parser.add_argument(
        "--pin-cores", default="auto", help="fsdp-strategies-ft --pin-cores for the replica groups"
    )
    parser.add_argument("--keep-other-runs", action="store_true",
                        help="rerun only --contenders and keep the other "
                             "contenders' runs from the last result in "
                             "--out-dir (same configuration only); ratios are recomputed over all of them")
    parser.add_argument("--reanalyse", action="store_true",
                        help="run nothing: recompute the figures, summary "
                             "and plot from the runs stored in the last "
                             "result in --out-dir (same configuration only)")
    parser.add_argument("--pool", nargs="+", metavar="DIR", default=None,
                        help="run nothing: pool several rounds (each DIR "
                             "an --out-dir of one run, same configuration) "
                             "into ft_recovery_pooled-<device>.json/.png "
                             "in --out-dir: every round's ratio, every "
                             "fault's local loss and their median")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        if os.environ.get(PROFILE_ENV):  # a cProfile of each rank (where the time of a step goes)
            import cProfile

            # FT_RECOVERY_PROFILE_TIMER=thread: the main thread's CPU seconds instead of wall time
            thread_cpu = os.environ.get("FT_RECOVERY_PROFILE_TIMER") == "thread"
            profiler = cProfile.Profile(time.thread_time) if thread_cpu else cProfile.Profile()
            profiler.enable()
            try:
                _worker_main(sys.argv[2:])
            finally:
                profiler.disable()
                group, rank = os.environ.get("REPLICA_GROUP_ID", "x"), os.environ.get("RANK", "0")
                tag = f"g{group}_r{rank}_{os.getpid()}"
                profiler.dump_stats(str(Path(os.environ[PROFILE_ENV]) / f"{tag}.prof"))
        else:
            _worker_main(sys.argv[2:])
    else:
        common.suite_main(run, (__doc__ or "").split("\n\n")[0], add_options=_add_options)
