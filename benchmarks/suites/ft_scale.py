"""ft_scale suite: how torchft's per-step quorum, a fault, a heal, the lighthouse and the launcher's event
handling scale with the number N of replica groups, on one machine.

Per N (``--groups``, default 2 8 32 128 512 1024), on loopback:

* the **real lighthouse**: ``torchft._torchft.LighthouseServer`` with ``fsdp-strategies-ft``'s options
  (``min_replicas`` 1, ``join_timeout_ms`` 1000, ``quorum_tick_ms`` 100, ``heartbeat_timeout_ms`` 2000), alone
  in a process whose CPU time and RSS are read from ``/proc``;
* **N simulated replica groups** (``benchmarks/workers/ft_scale_worker.py groups``): each a thread with the
  Rust ``ManagerServer`` + ``ManagerClient`` a real ``torchft.Manager`` uses (heartbeats every 100 ms),
  running the per-step protocol -- quorum, heal handshake when told to, ``--step-s`` of "training" (a sleep),
  should_commit -- and writing its steps to ``group<G>.jsonl`` in the events-file format. Many groups per
  process (threads); a few "victim" groups run one per process so that a fault is a real SIGKILL;
* **the launcher's supervision loop** (``ft_scale_worker.py launcher``): the real ``FTLauncher`` for N groups
  runs its per-pass concerns every 50 ms over those events files (full runs; ``--quick`` leaves it out: its
  import of torch and Lightning alone takes most of a minute on a busy 2-core host).

A run at one N: start everything, wait until a quorum holds all N groups, measure ``--duration`` seconds --
the first half fault-free (the per-step cost of N), the second half with faults: a live victim group SIGKILLed
every ``fault_group_s / N`` seconds (the fault rate is proportional to N: each group fails once per
``--fault-group-s`` on average; at least one fault per N) and restarted at once (a new process, a new replica
id; it heals); then a fault-free stretch of a heartbeat timeout + 2 s (longer, up to ``--start-timeout``,
until every restarted group has committed) in which the last fault's survivors and heal are still measured.
The sweep stops at the first N whose groups cannot all reach one quorum within ``--start-timeout``
(``stopped_at`` says why).

Full runs also train **real ft_hsdp groups** (``--real-groups``: 2 replica groups x 1 rank, the example's
``tiny`` model, ``configs/ft_hsdp.yaml``, through ``fsdp-strategies-ft``'s launcher with ``--kill-every``):
their own per-step quorum / commit / step time from their events files, the survivor's stall and the killed
group's heal. They run against their own lighthouse, not next to the simulated groups: every member of a
torchft quorum joins the cross-group process group (``Manager`` configures its gloo/NCCL group with the
quorum's whole ``replica_world_size``), which groups without a model cannot join, so a real group sharing a
quorum with them never gets past its process-group set-up.

    python benchmarks/suites/ft_scale.py --quick        # N = 2, 8; 4 s each; no launcher loop, no real groups
    python benchmarks/suites/ft_scale.py                # the sweep (about 10 min on 2 busy cores)
    python benchmarks/suites/ft_scale.py --groups 2 32 128 --duration 20 --no-real-groups
    # the launcher loop of an earlier commit, for a comparison:
    git archive <commit> src | tar -x -C /tmp/before
    python benchmarks/suites/ft_scale.py --src /tmp/before/src --no-real-groups --out-dir /tmp/before-results
    python benchmarks/suites/ft_scale.py --before /tmp/before-results/ft_scale-cpu.json  # both in one table
    # fan-in:
    python benchmarks/suites/ft_scale.py --groups 128 512 --heartbeat-interval-ms 1000 --no-real-groups

Result ``results/ft_scale-<device>.json`` (keys are stable; other suites read them), besides
``common.header``'s:

    config{groups, duration_s, step_s, fault_group_s, start_timeout_s, victims_max, pool_processes_max,
           lighthouse{min_replicas, join_timeout_ms, quorum_tick_ms, heartbeat_timeout_ms},
           heartbeat_interval_ms,
           launcher_loop, real_groups, quick, src}
    sweep[ {n, status ("ok" | "failed"), error, processes{pools, victims},
            full_quorum_after_s          start of the groups -> first quorum holding all N
            groups_committed             groups with a committed step (all N when status is ok)
            quorum_s{p50, p99, max, count}, commit_s{...}, step_s{...}  fault-free half, every group's steps
            quorum_s_faults{...}, step_s_faults{...}                       the half with faults
            committed_steps_per_s        per group, fault-free half; committed_steps_per_s_faults
            faults[ {t, group, pid, replica_id, dropped (a later quorum lacked its replica id),
                     kill_to_next_commit_s (median over survivors: SIGKILL -> its first commit in a
                     quorum without the killed id), kill_to_next_commit_max_s, survivor_stall_s (median
                     over survivors: the gap between its commits around the kill minus its median step),
                     heal_s (restart -> the new incarnation's first commit), heal_handshake_s, restart_t} ]
            faults_injected, faults_skipped (no live victim at the time), kill_to_next_commit_s{p50, max},
            survivor_stall_s{p50, max}, heal_s{p50, max}
            lighthouse{cpu_s_per_s (fault-free half; _faults: the other), rss_bytes_start, rss_bytes_max,
                       hwm_bytes}
            participants_rss_bytes       all simulated-group processes at the end
            pools_cpu_s_per_s            cores the pool processes (all groups but the victims) used,
                                         fault-free half
            host_load_1min               the host's load average at the end of the fault-free half
            launcher{pass_s{p50, p99, max}, cpu_fraction, rss_bytes_start, rss_bytes_end, records_retained}
                | {skipped}
            events{files, bytes, records, bytes_per_group_step}, errors, error_samples[] } ]
    largest_n, stopped_at
    before_fix{path, src, created_utc, launcher{"<n>": launcher figures of that result + records_read (its
               events records)}}   with --before FILE only
    real_groups{groups, ranks_per_group, size, quorum_s{..}, commit_s{..}, step_s{..}, faults[ {t, group,
                survivor_next_commit_s, survivor_stall_s, heal_s} ], returncode} | {skipped}
    summary[ {ratio, value, met: null} ]  (one row per figure and N; rendered by the docs' benchmark macro)
    failures[ {n | phase, error} ]
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import itertools

import common

ROOT = common.ROOT
WORKER = common.WORKERS_DIR / "ft_scale_worker.py"
#: fsdp-strategies-ft's lighthouse defaults (src/fsdp_strategies/ft/launch/options.py)
LIGHTHOUSE = {"min_replicas": 1, "join_timeout_ms": 1000, "quorum_tick_ms": 100, "heartbeat_timeout_ms": 2000}
HEARTBEAT_INTERVAL_MS = 100  # torchft.Manager's default heartbeat_interval
GROUPS_PER_POOL = 128
TICK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------- small helpers
def _stats(values: list[float]) -> dict[str, Any]:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"p50": None, "p99": None, "max": None, "count": 0}
    return {"p50": statistics.median(vals), "p99": vals[min(len(vals) - 1, math.ceil(0.99 * len(vals)) - 1)],
            "max": vals[-1], "count": len(vals)}


def _proc(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) and RSS / peak RSS of a live process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    mem = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status.splitlines()
           if line.startswith(("VmRSS:", "VmHWM:"))}
    return {
        "cpu_s": (int(fields[11]) + int(fields[12])) / TICK,
        "rss": mem.get("VmRSS", 0),
        "hwm": mem.get("VmHWM", 0),
    }


def _read(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a SIGKILL
    return out


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as fh:
        return subprocess.Popen([sys.executable, str(WORKER), *args], stdout=fh, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, cwd=str(ROOT))


def _stop(procs: list[subprocess.Popen[bytes]], sig: int = signal.SIGKILL) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


class _Sampler(threading.Thread):
    """Samples the lighthouse's /proc every 0.25 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.samples, self.stop = pid, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            s = _proc(self.pid)
            if s:
                self.samples.append({"t": time.time(), **s})
            self.stop.wait(0.25)

    def cpu_rate(self, t0: float, t1: float) -> float | None:
        inside = [s for s in self.samples if t0 <= s["t"] <= t1]
        if len(inside) < 2 or inside[-1]["t"] <= inside[0]["t"]:
            return None
        return (inside[-1]["cpu_s"] - inside[0]["cpu_s"]) / (inside[-1]["t"] - inside[0]["t"])


# ---------------------------------------------------------------------------------------------- one N
def _measure(n: int, cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    events = work / "events"
    events.mkdir(parents=True, exist_ok=True)
    env = common.worker_env({"RUST_LOG": "warn", "PYTHONPATH": os.pathsep.join([str(cfg["src"]),
                                                                               os.environ.get("PYTHONPATH",
                                                                                              "")])})
    procs: list[subprocess.Popen[bytes]] = []
    out: dict[str, Any] = {"n": n, "status": "failed", "error": None}
    try:
        addr_file = work / "lighthouse.addr"
        lh = _spawn(["lighthouse", "--addr-file", str(addr_file),
                     *[f"--{k.replace('_', '-')}={v}" for k, v in cfg["lighthouse"].items()]],
                     work / "lighthouse.log", env)
        procs.append(lh)
        _wait_for(lambda: addr_file.exists(), 30, "the lighthouse did not start", lh, work / "lighthouse.log")
        address = addr_file.read_text().strip()
        sampler = _Sampler(lh.pid)
        sampler.start()
        launcher = None
        if cfg["launcher_loop"]:
            ready = work / "launcher.ready"
            launcher = _spawn(["launcher", "--events-dir", str(events), "--groups", str(n), "--ready-file",
                               str(ready), "--out", str(work / "launcher.json")], work / "launcher.log", env)
            procs.append(launcher)
            _wait_for(ready.exists, 180, "the launcher loop did not start", launcher, work / "launcher.log")
        victims_n = min(cfg["victims_max"], n - 1)
        pool_ids = list(range(victims_n, n))
        pools_n = min(cfg["pool_processes_max"], max(1, math.ceil(len(pool_ids) / GROUPS_PER_POOL)))
        common_args = ["--lighthouse", address, "--observer", str(n - 1), "--events-dir", str(events),
                       "--step-s", str(cfg["step_s"]), "--heartbeat-ms", str(cfg["heartbeat_interval_ms"])]
        t_start = time.time()
        pools = [_spawn(["groups", "--groups", ",".join(map(str, pool_ids[i::pools_n])), *common_args],
                        work / f"pool{i}.log", env) for i in range(pools_n) if pool_ids[i::pools_n]]
        procs += pools
        victims: dict[int, dict[str, Any]] = {}
        for gid in range(victims_n):
            p = _spawn(
                ["groups", "--groups", str(gid), "--restart", "0", *common_args],
                work / f"victim{gid}.log",
                env,
            )
            victims[gid] = {"proc": p, "restart": 0, "started": time.time()}
            procs.append(p)
        out["processes"] = {"pools": len(pools), "victims": victims_n}
        full_at = _wait_full_quorum(events, n, t_start, cfg["start_timeout_s"], procs)
        out["full_quorum_after_s"] = full_at - t_start
        t0 = time.time()
        pool_cpu0 = sum(_proc(p.pid).get("cpu_s", 0.0) for p in pools)
        half = cfg["duration_s"] / 2
        time.sleep(half)
        t_faults = time.time()
        # the simulated groups' own CPU (the pool processes: all groups but the victims): with the
        # lighthouse's, how much of the host the harness itself takes (2 cores here: near 2, the latencies are
        # the machine's)
        out["pools_cpu_s_per_s"] = (sum(_proc(p.pid).get("cpu_s", 0.0) for p in pools) - pool_cpu0) / (
            t_faults - t0
        )
        out["host_load_1min"] = os.getloadavg()[0]
        interval = cfg["fault_group_s"] / n
        faults: list[dict[str, Any]] = []
        skipped = 0
        next_fault = t_faults + min(interval, half / 2)
        while time.time() < t_faults + half:  # faults in this half, then a settling stretch
            now = time.time()
            if now >= next_fault and victims_n:
                victim = _live_victim(victims, events)
                if victim is None:
                    skipped += 1
                else:
                    faults.append(
                        _kill_and_restart(victim, victims[victim], events, work, common_args, env, procs)
                    )
                next_fault = now + interval
            time.sleep(0.02)
        # no fault in the last stretch: the last one's survivors see the quorum drop it (a heartbeat timeout
        # at most), and every restarted group heals (its first commit), however busy the host is (up to
        # --start-timeout)
        settle_end = time.time() + cfg["lighthouse"]["heartbeat_timeout_ms"] / 1000 + 2.0
        healed_by = time.time() + cfg["start_timeout_s"]
        while time.time() < settle_end or (time.time() < healed_by and not _all_healed(victims, events)):
            time.sleep(0.1)
        t1 = time.time()
        out["participants_rss_bytes"] = sum(_proc(p.pid).get("rss", 0) for p in procs[1:] if p.poll() is None
                                            and p is not launcher)
        if launcher is not None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        sampler.stop.set()
        _stop(procs)
        sampler.join()
        out.update(_analyse(n, events, t0, t_faults, t1, faults, cfg))
        out["faults_skipped"] = skipped
        out["lighthouse"] = {"cpu_s_per_s": sampler.cpu_rate(t0, t_faults),
                             "cpu_s_per_s_faults": sampler.cpu_rate(t_faults, t1),
                             "rss_bytes_start": sampler.samples[0]["rss"] if sampler.samples else None,
                             "rss_bytes_max": max((s["rss"] for s in sampler.samples), default=None),
                             "hwm_bytes": sampler.samples[-1]["hwm"] if sampler.samples else None}
        out["launcher"] = _launcher_figures(work / "launcher.json") if cfg["launcher_loop"] else \
            {"skipped": "quick mode (the loop's process imports torch and Lightning)"}
        out["status"] = "ok" if out["groups_committed"] == n else "failed"
        if out["status"] != "ok":
            out["error"] = f"only {out['groups_committed']} of {n} groups committed a step"
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _stop(procs)
    return out


def _wait_for(cond: Any, timeout: float, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.time() + timeout
    while not cond():
        if proc.poll() is not None or time.time() > deadline:
            tail = log.read_text(errors="replace").splitlines()[-5:] if log.exists() else []
            raise RuntimeError(f"{what} (exit {proc.poll()}): {' | '.join(tail)}")
        time.sleep(0.05)


def _wait_full_quorum(events: Path, n: int, t_start: float, timeout: float,
                      procs: list[subprocess.Popen[bytes]]) -> float:
    """Time of the first committed step whose quorum held all N groups (reading group 0's... any group's
    file)."""
    deadline = t_start + timeout
    path = events / f"group{n - 1}.jsonl"
    while time.time() < deadline:
        for rec in _read(path):
            if rec.get("committed") and rec.get("participants") == n:
                return float(rec["t"])
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(
                f"a process exited ({dead[0].args[2:4]}, code {dead[0].returncode}) before the quorum "
                f"held all {n} groups"
            )
        time.sleep(0.2)
    raise RuntimeError(
        f"no quorum held all {n} groups within {timeout:g} s (the machine cannot run this N; see "
        f"pool logs in the work folder)"
    )


def _live_victim(victims: dict[int, dict[str, Any]], events: Path) -> int | None:
    """A victim group that has committed a step since its (re)start, the one running longest."""
    for gid in sorted(victims, key=lambda g: victims[g]["started"]):
        v = victims[gid]
        if v["proc"].poll() is None and any(r.get("committed") and r.get("pid") == v["proc"].pid
                                            for r in _read(events / f"group{gid}.jsonl")[-5:]):
            return gid
    return None


def _all_healed(victims: dict[int, dict[str, Any]], events: Path) -> bool:
    """Whether every victim group's current incarnation has committed a step."""
    return all(
        any(r.get("committed") and r.get("pid") == v["proc"].pid for r in _read(events / f"group{gid}.jsonl"))
        for gid, v in victims.items()
    )


def _kill_and_restart(gid: int, v: dict[str, Any], events: Path, work: Path, common_args: list[str],
                      env: dict[str, str], procs: list[subprocess.Popen[bytes]]) -> dict[str, Any]:
    pid = v["proc"].pid
    t = time.time()
    os.killpg(pid, signal.SIGKILL)
    v["proc"].wait()
    v["restart"] += 1
    p = _spawn(["groups", "--groups", str(gid), "--restart", str(v["restart"]), *common_args],
               work / f"victim{gid}.log", env)
    v["proc"], v["started"] = p, time.time()
    procs.append(p)
    return {"t": t, "group": gid, "pid": pid, "restart_t": v["started"], "new_pid": p.pid}


# ---------------------------------------------------------------------------------------------- analysis
def _analyse(n: int, events: Path, t0: float, t_faults: float, t1: float, faults: list[dict[str, Any]],
             cfg: dict[str, Any]) -> dict[str, Any]:
    timelines = {g: _read(events / f"group{g}.jsonl") for g in range(n)}
    steps = [r for recs in timelines.values() for r in recs if "committed" in r]
    errors = [r for recs in timelines.values() for r in recs if "error" in r]
    calm = [r for r in steps if t0 <= r["t"] < t_faults and not r.get("healed")]
    stormy = [r for r in steps if t_faults <= r["t"] <= t1]
    committed = {g for g, recs in timelines.items() if any(r.get("committed") for r in recs)}
    out: dict[str, Any] = {
        "groups_committed": len(committed),
        "quorum_s": _stats([r["quorum_s"] for r in calm]), "commit_s": _stats([r["commit_s"] for r in calm]),
        "step_s": _stats([r["step_s"] for r in calm]),
        "quorum_s_faults": _stats([r["quorum_s"] for r in stormy]),
        "step_s_faults": _stats([r["step_s"] for r in stormy]),
        "committed_steps_per_s": sum(1 for r in calm if r["committed"]) / n / max(1e-9, t_faults - t0),
        "committed_steps_per_s_faults": sum(1 for r in stormy if r["committed"]) / n / max(1e-9,
                                                                                           t1 - t_faults),
        "errors": len(errors), "error_samples": sorted({str(r["error"])[:160] for r in errors})[:5],
    }
    victims = {f["group"] for f in faults}
    survivors = [g for g in range(n) if g not in victims]
    for f in faults:
        f.update(_fault_figures(f, timelines, survivors, n))
    out["faults"] = faults
    out["faults_injected"] = len(faults)
    for key in ("kill_to_next_commit_s", "survivor_stall_s", "heal_s"):
        vals = [f[key] for f in faults if f.get(key) is not None]
        out[key] = {"p50": statistics.median(vals) if vals else None, "max": max(vals) if vals else None}
    files = list(events.glob("group*.jsonl"))
    size = sum(p.stat().st_size for p in files)
    out["events"] = {"files": len(files), "bytes": size, "records": len(steps),
                     "bytes_per_group_step": size / max(1, len(steps))}
    return out


def _fault_figures(f: dict[str, Any], timelines: dict[int, list[dict[str, Any]]], survivors: list[int],
                   n: int) -> dict[str, Any]:
    """The survivors' view of one SIGKILL and the killed group's heal.

    ``dropped``: a quorum recorded by the observer group after the kill lacks the killed incarnation's replica
    id; ``kill_to_next_commit_s``: per survivor, the kill to its first commit in that quorum (or a later
    one)."""
    tk = f["t"]
    killed_id = next(
        (r.get("replica_id") for r in timelines[f["group"]] if r.get("started") and r["pid"] == f["pid"]),
        None,
    )
    f["replica_id"] = killed_id
    observed = [r for r in timelines[n - 1] if "members" in r and r["t"] > tk]
    drop = next((r for r in observed if killed_id not in r["members"]), None)
    out: dict[str, Any] = {"dropped": drop is not None, "kill_to_next_commit_s": None,
                           "kill_to_next_commit_max_s": None, "survivor_stall_s": None}
    if drop is not None:
        next_commit, stalls = [], []
        for g in survivors:
            recs = [r for r in timelines[g] if r.get("committed")]
            prev = [r["t"] for r in recs if r["t"] <= tk]
            after = [r for r in recs if r["t"] > tk and r["quorum_id"] >= drop["quorum_id"]]
            if not after:
                continue
            next_commit.append(after[0]["t"] - tk)
            if prev:
                gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(recs)]
                stalls.append(after[0]["t"] - prev[-1] - statistics.median(gaps))
        out.update(kill_to_next_commit_s=statistics.median(next_commit) if next_commit else None,
                   kill_to_next_commit_max_s=max(next_commit) if next_commit else None,
                   survivor_stall_s=statistics.median(stalls) if stalls else None)
    heal = [r for r in timelines[f["group"]] if r.get("committed") and r.get("pid") == f["new_pid"]]
    handshake = [
        r["heal_s"] for r in timelines[f["group"]] if r.get("pid") == f["new_pid"] and r.get("heal_s")
    ]
    out["heal_s"] = heal[0]["t"] - f["restart_t"] if heal else None
    out["heal_handshake_s"] = handshake[0] if handshake else None
    return out


def _launcher_figures(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"error": "the launcher loop wrote no result"}
    data = json.loads(path.read_text())
    passes = data["passes"][20:]  # the first second: imports settling
    span = (passes[-1][0] - passes[0][0]) if len(passes) > 1 else 0.0
    return {"pass_s": _stats([p[1] for p in passes]),
            "cpu_fraction": sum(p[2] for p in passes) / span if span else None,
            "passes": len(passes), "rss_bytes_start": data["rss"][0][1], "rss_bytes_end": data["rss"][-1][1],
            "records_retained": data.get("records_retained")}


# ---------------------------------------------------------------------------------------------- real ft_hsdp
# groups
def _real_groups(work: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    from suites import ft_recovery

    run = ft_recovery._run_ft(work, "tiny", steps=cfg["real_steps"], groups=2, ranks=1,
                              kill_every=cfg["real_kill_every"],
                              heartbeat_ms=LIGHTHOUSE["heartbeat_timeout_ms"], timeout=600, pin_cores="none")
    recs = {int(g): [r for r in tl if "committed" in r] for g, tl in run["timelines"].items()}
    steady = [r for tl in recs.values() for r in tl if r.get("committed") and not r.get("healed")
              and r.get("participants") == 2]
    faults = []
    for k in run["kills"]:
        victim, tk = int(k["group"]), k["t"]
        other = 1 - victim
        commits = [r["t"] for r in recs.get(other, []) if r.get("committed")]
        after = [t for t in commits if t > tk]
        before = [t for t in commits if t <= tk]
        gaps = [b - a for a, b in itertools.pairwise(commits)]
        restart = [r["t"] for r in run["restarts"] if r["group"] == victim and r["t"] >= tk]
        healed = [
            r["t"] for r in recs.get(victim, []) if r.get("committed") and restart and r["t"] > restart[0]
        ]
        faults.append({"t": tk, "group": victim,
                       "survivor_next_commit_s": after[0] - tk if after else None,
                       "survivor_stall_s": (after[0] - before[-1] - statistics.median(gaps))
                           if after and before and gaps
                       else None,
                       "heal_s": healed[0] - tk if healed else None})
    return {"groups": 2, "ranks_per_group": 1, "size": "tiny", "returncode": run["returncode"],
            "quorum_s": _stats([r.get("quorum_s") for r in steady]),
            "commit_s": _stats([r.get("commit_s") for r in steady]),
            "step_s": _stats([r.get("step_s") for r in steady]), "faults": faults, "wall_s": run["wall_s"]}


# ---------------------------------------------------------------------------------------------- result
def _summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(label: str, value: Any) -> None:
        if value is not None:
            rows.append({"ratio": label, "value": value, "met": None})

    for s in result["sweep"]:
        n = s["n"]
        if s["status"] != "ok":
            rows.append({"ratio": f"N={n}: failed", "value": s.get("error"), "met": False})
            continue
        add(
            f"N={n}: quorum latency p50 / p99 [s]", f"{s['quorum_s']['p50']:.4f} / {s['quorum_s']['p99']:.4f}"
        )
        add(
            f"N={n}: commit latency p50 / p99 [s]", f"{s['commit_s']['p50']:.4f} / {s['commit_s']['p99']:.4f}"
        )
        add(f"N={n}: committed steps/s per group, fault-free / with faults",
            f"{s['committed_steps_per_s']:.2f} / {s['committed_steps_per_s_faults']:.2f}")
        add(f"N={n}: faults injected (skipped)", f"{s['faults_injected']} ({s['faults_skipped']})")
        add(f"N={n}: SIGKILL -> survivors' next commit, p50 [s]", s["kill_to_next_commit_s"]["p50"])
        add(f"N={n}: survivors' stall per fault, p50 [s]", s["survivor_stall_s"]["p50"])
        add(f"N={n}: heal of a restarted group, p50 [s]", s["heal_s"]["p50"])
        lh = s["lighthouse"]
        add(f"N={n}: lighthouse CPU [cores] fault-free / faults",
            f"{lh['cpu_s_per_s'] or 0:.3f} / {lh['cpu_s_per_s_faults'] or 0:.3f}")
        add(f"N={n}: lighthouse RSS max [MiB]", (lh["rss_bytes_max"] or 0) / 2**20)
        add(f"N={n}: simulated groups' CPU [cores], host load (1 min)",
            f"{s['pools_cpu_s_per_s']:.2f}, {s['host_load_1min']:.1f}")
        add(f"N={n}: events files: bytes per group-step", s["events"]["bytes_per_group_step"])
        la = s.get("launcher") or {}
        if "pass_s" in la:
            add(f"N={n}: launcher pass p50 / p99 [ms], CPU [cores]",
                f"{la['pass_s']['p50'] * 1e3:.2f} / "
                f"{la['pass_s']['p99'] * 1e3:.2f}, {la['cpu_fraction']:.3f}")
            add(f"N={n}: launcher RSS growth [MiB], records retained",
                f"{(la['rss_bytes_end'] - la['rss_bytes_start']) / 2**20:.1f}, {la['records_retained']}")
        old = ((result.get("before_fix") or {}).get("launcher") or {}).get(str(n)) or {}
        if "pass_s" in old:
            add(f"N={n}: BEFORE the fix: launcher pass p50 / p99 [ms], CPU [cores]",
                f"{old['pass_s']['p50'] * 1e3:.2f} / "
                f"{old['pass_s']['p99'] * 1e3:.2f}, {old['cpu_fraction']:.3f}")
            add(f"N={n}: BEFORE the fix: launcher RSS growth [MiB], records retained",
                f"{(old['rss_bytes_end'] - old['rss_bytes_start']) / 2**20:.1f}, {old['records_retained']}")
    real = result.get("real_groups") or {}
    if "quorum_s" in real:
        add(
            "real ft_hsdp (2 groups): quorum p50 / p99 [s]",
            f"{real['quorum_s']['p50']:.4f} / {real['quorum_s']['p99']:.4f}",
        )
        add("real ft_hsdp (2 groups): step p50 [s]", real["step_s"]["p50"])
        for f in real["faults"]:
            add(f"real ft_hsdp: fault at group {f['group']}: survivor's next commit / stall / heal [s]",
                " / ".join("-" if f[k] is None else f"{f[k]:.2f}" for k in ("survivor_next_commit_s",
                                                                            "survivor_stall_s", "heal_s")))
    return rows


def _plot(result: dict[str, Any], path: Path) -> Path:
    plt = common._pyplot()
    ok = [s for s in result["sweep"] if s["status"] == "ok"]
    ns = [s["n"] for s in ok]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    ax = axes[0]
    for key, label, style in (("quorum_s", "quorum", "o-"), ("commit_s", "commit", "s-")):
        ax.plot(ns, [s[key]["p50"] for s in ok], style, label=f"{label} p50")
        ax.plot(ns, [s[key]["p99"] for s in ok], style, alpha=0.4, label=f"{label} p99")
    ax.plot(ns, [s["quorum_s_faults"]["p50"] for s in ok], "o:", label="quorum p50 under faults")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("replica groups N")
    ax.set_ylabel("seconds per step (simulated groups)")
    ax.legend(fontsize=7)
    ax = axes[1]
    for key, label in (("kill_to_next_commit_s", "SIGKILL -> survivors' next commit"),
                       ("survivor_stall_s", "survivors' stall"), ("heal_s", "heal of the restarted group")):
        ax.plot(ns, [s[key]["p50"] for s in ok], "o-", label=f"{label} (p50)")
    real = result.get("real_groups") or {}
    for f in real.get("faults", []):
        ax.scatter([2], [f["survivor_stall_s"]], marker="x", color="k", zorder=4)
        ax.scatter([2], [f["heal_s"]], marker="+", color="r", zorder=4)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replica groups N (x / +: real ft_hsdp stall / heal)")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    ax = axes[2]
    ax.plot(ns, [s["lighthouse"]["cpu_s_per_s"] for s in ok], "o-", label="lighthouse CPU [cores]")
    ax.plot(ns, [(s.get("launcher") or {}).get("cpu_fraction") for s in ok], "s-",
            label="launcher loop CPU [cores]")
    old = (result.get("before_fix") or {}).get("launcher") or {}
    if old:
        xs = [n for n in ns if "cpu_fraction" in (old.get(str(n)) or {})]
        ax.plot(xs, [old[str(n)]["cpu_fraction"] for n in xs], "s:", color="tab:red",
                label="launcher loop CPU before the fix")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replica groups N")
    ax.set_ylabel("cores")
    ax2 = ax.twinx()
    ax2.plot(ns, [(s["lighthouse"]["rss_bytes_max"] or 0) / 2**20 for s in ok], "^--", color="tab:green",
             label="lighthouse RSS [MiB]")
    ax2.set_ylabel("MiB")
    ax.legend(fontsize=7, loc="upper left")
    ax2.legend(fontsize=7, loc="lower right")
    ax = axes[3]  # the launcher's memory: what its event readers keep, per 1,000 group-steps they read

    def growth(la: dict[str, Any] | None, steps: int) -> float | None:
        if not la or "rss_bytes_end" not in la or not steps:
            return None
        return (la["rss_bytes_end"] - la["rss_bytes_start"]) / 2**20 / steps * 1000

    ax.plot(ns, [growth(s.get("launcher"), s["events"]["records"]) for s in ok], "s-", label="launcher loop")
    if old:
        before_steps = {str(s["n"]): s["events"]["records"] for s in ok}
        xs = [n for n in ns if growth(old.get(str(n)), before_steps[str(n)]) is not None]
        ax.plot(xs,
                [growth(old[str(n)], (old[str(n)].get("records_read") or before_steps[str(n)])) for n in xs],
                "s:", color="tab:red", label="before the fix")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replica groups N")
    ax.set_ylabel("launcher RSS growth [MiB per 1,000 group-steps]")
    ax.legend(fontsize=7)
    fig.suptitle(f"ft_scale on {result['device_name']} (torchft {result['versions'].get('torchft')}; step "
                 f"{result['config']['step_s']} s, one fault per "
                 f"group per {result['config']['fault_group_s']:g} s)",
                 fontsize=9)
    return common.save_figure(fig, path)


def run(quick: bool, out_dir: Path, groups: list[int] | None = None, duration: float | None = None,
        step_s: float | None = None, fault_group_s: float | None = None, start_timeout: float | None = None,
        real_groups: bool | None = None, launcher_loop: bool | None = None, src: str | None = None,
        before: str | None = None, heartbeat_interval_ms: int | None = None, **_: Any) -> dict[str, Any]:
    cfg = {
        "groups": groups or ([2, 8] if quick else [2, 8, 32, 128, 512, 1024]),
        "duration_s": common.pick(duration, quick, 4.0, 30.0),
        "step_s": common.pick(step_s, quick, 0.05, 0.2),
        "fault_group_s": common.pick(fault_group_s, quick, 4.0, 240.0),
        "start_timeout_s": common.pick(start_timeout, quick, 30.0, 120.0),
        "victims_max": 16, "pool_processes_max": 8,
        "lighthouse": dict(LIGHTHOUSE),
        "heartbeat_interval_ms": heartbeat_interval_ms or HEARTBEAT_INTERVAL_MS,
        "launcher_loop": common.pick(launcher_loop, quick, False, True),
        "real_groups": common.pick(real_groups, quick, False, True),
        "real_steps": 2000, "real_kill_every": 20.0, "quick": quick,
        # the fsdp_strategies the launcher loop imports (another checkout's src/: a before/after comparison)
        "src": str(Path(src).resolve() if src else ROOT / "src"),
    }
    ft_dir = Path(cfg["src"]) / "fsdp_strategies" / "ft"
    if not ((ft_dir / "launch" / "launcher.py").exists() or (ft_dir / "launcher.py").exists()):
        raise ValueError(
            f"--src {cfg['src']}: no fsdp_strategies/ft/launch/launcher.py in it. Fix: a checkout's "
            "src/ folder "
            "(e.g. `git archive <commit> src | tar -x -C /tmp/before`, then --src /tmp/before/src)."
        )
    for n in cfg["groups"]:
        if n < 2:
            raise ValueError(f"--groups {n}: a fault needs a survivor. Fix: N >= 2.")
    result: dict[str, Any] = {**common.header("ft_scale", cfg), "sweep": [], "failures": [],
                              "largest_n": None, "stopped_at": None}
    if before:
        result["before_fix"] = _before_fix(Path(before))
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="ft_scale-") as tmp:
        for n in cfg["groups"]:
            work = Path(tmp) / f"n{n}"
            work.mkdir()
            print(f"[ft_scale] N={n} ...", file=sys.stderr, flush=True)
            s = _measure(n, cfg, work)
            result["sweep"].append(s)
            if s["status"] != "ok":
                result["failures"].append({"n": n, "error": s["error"]})
                result["stopped_at"] = f"N={n}: {s['error']}"
                _keep_logs(work, out_dir, n)
                break
            result["largest_n"] = n
            _write(result, out_dir)  # after every N: a partial sweep is readable
        if cfg["real_groups"]:
            print("[ft_scale] real ft_hsdp groups ...", file=sys.stderr, flush=True)
            try:
                result["real_groups"] = _real_groups(Path(tmp) / "real", cfg)
            except Exception as exc:
                result["real_groups"] = {"error": f"{type(exc).__name__}: {exc}"}
                result["failures"].append({"phase": "real_groups", "error": result["real_groups"]["error"]})
        else:
            result["real_groups"] = {"skipped": "quick mode" if quick else "--no-real-groups"}
    if result["stopped_at"] is None:
        result["stopped_at"] = f"not stopped: every N of {cfg['groups']} ran"
    return _write(result, out_dir)


def _before_fix(path: Path) -> dict[str, Any]:
    """``--before FILE``: the launcher-loop figures of an earlier result (the same sweep run with ``--src`` of
    the code before a fix), shown next to this run's in the summary and the plot."""
    if not path.exists():
        raise ValueError(
            f"--before {path}: no such result file. Fix: run the suite with --src <old src> --out-dir "
            "<folder> first and pass that folder's ft_scale-<device>.json."
        )
    old = json.loads(path.read_text())
    return {"path": str(path), "src": old.get("config", {}).get("src"), "created_utc": old.get("created_utc"),
            "launcher": {str(s["n"]): {**(s.get("launcher") or {}), "records_read": s["events"]["records"]}
                         for s in old.get("sweep", []) if s.get("status") == "ok"}}


def _keep_logs(work: Path, out_dir: Path, n: int) -> None:
    """A failed N's process logs go to ``<out_dir>/ft_scale-logs/N<n>/`` (not into the result)."""
    dest = out_dir.parent / "outputs" / "ft_scale-logs" / f"N{n}" if out_dir.name == "results" else \
        out_dir / "ft_scale-logs" / f"N{n}"
    dest.mkdir(parents=True, exist_ok=True)
    for log in work.glob("*.log"):
        shutil.copy(log, dest / log.name)


def _write(result: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    result["summary"] = _summary(result)
    if any(s["status"] == "ok" for s in result["sweep"]):
        result["png_path"] = str(_plot(result, out_dir / f"ft_scale-{common.device_slug()}.png"))
    result["json_path"] = str(common.write_result("ft_scale", result, out_dir))
    return result


def _add_options(parser: Any) -> None:
    parser.add_argument("--groups", type=int, nargs="+", default=None, help="the N to sweep")
    parser.add_argument(
        "--duration", type=float, default=None, help="measured seconds per N (half of them with faults)"
    )
    parser.add_argument(
        "--step-s", type=float, default=None, help="simulated groups' seconds of training per step"
    )
    parser.add_argument("--fault-group-s", type=float, default=None,
                        help="mean seconds between two faults of one group "
                             "(faults every FAULT_GROUP_S / N seconds)")
    parser.add_argument(
        "--start-timeout", type=float, default=None, help="seconds for all N groups to reach a quorum"
    )
    parser.add_argument("--src", default=None,
                        help="import fsdp_strategies from this src/ folder "
                             "in the launcher loop (default: this checkout's)")
    parser.add_argument("--heartbeat-interval-ms", type=int, default=None,
                        help="simulated groups' heartbeat period "
                             "(torchft.Manager's heartbeat_interval; default "
                             f"{HEARTBEAT_INTERVAL_MS}): the lighthouse's heartbeat fan-in is N / this")
    parser.add_argument("--before", default=None, metavar="FILE",
                        help="an earlier result (e.g. with --src of the code "
                             "before a fix): its launcher-loop figures go "
                             "next to this run's (before_fix in the JSON)")
    parser.add_argument("--real-groups", action=__import__("argparse").BooleanOptionalAction, default=None,
                        help="also train 2 real ft_hsdp groups (default: on, off with --quick)")
    parser.add_argument("--launcher-loop", action=__import__("argparse").BooleanOptionalAction, default=None,
                        help="run the launcher's supervision loop over the "
                             "events files (default: on, off with --quick)")


if __name__ == "__main__":
    common.suite_main(run, (__doc__ or "").split("\n\n")[0], add_options=_add_options)
