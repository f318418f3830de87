"""``fsdp-strategies-ft``: run fault-tolerant HSDP on this machine -- a lighthouse plus N replica groups.

    fsdp-strategies-ft --groups 2 --ranks-per-group 2 --kill-every 30 -- \\
        examples/train_llama.py fit --config configs/ft_hsdp.yaml

Each replica group is one ``torchrun`` job (``--runner torchrun``, the default: a rank that dies
takes its group down, which is what fault tolerance needs) or a plain ``python SCRIPT`` that lets
Lightning's own launcher start the ranks (``--runner lightning``). Every group gets its own OS
session, so a fault (``--kill-every SECONDS`` or ``--kill-at-steps``) is a SIGKILL of the whole
group, and a group that exits non-zero is restarted; the restarted group heals from a live peer.
Groups learn their place from the environment: ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``,
``TORCHFT_LIGHTHOUSE``, ``FSDP_STRATEGIES_FT_EVENTS`` (a per-group JSON-lines step log, which the
launcher also reads for ``--kill-at-steps``) and ``FT_RESTART_COUNT``.

On a cluster the same job is ``torchft_lighthouse --min_replicas 1 --bind [::]:29510`` on one host
and one ``torchrun`` (or torchx / SLURM) job per replica group with those variables set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LauncherResult", "kill_tree", "main", "run"]


def _process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (Linux ``/proc``); torchrun puts each worker in its own session,
    so killing the launcher's process group alone would leave the ranks running."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def kill_tree(root: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to ``root`` and every descendant (a whole replica group); return the pids signalled."""
    pids = _process_tree(root) if os.path.isdir("/proc") else [root]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    try:
        os.killpg(root, sig)  # the group's session, for whatever the tree walk raced with
    except (ProcessLookupError, PermissionError):
        pass
    return pids


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class _Group:
    gid: int
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    finished: bool = False
    log: Any = None
    kills: int = 0
    abandoned: bool = False
    succeeded: bool = False  # exited 0: its training finished
    gave_up: str | None = None  # why, once it exhausted --max-restarts
    exit_codes: list[int] = field(default_factory=list)


@dataclass
class LauncherResult:
    """What happened, for callers (tests, benchmarks)."""

    returncode: int
    kills: list[dict[str, Any]]
    restarts: list[dict[str, Any]]
    wall_s: float
    events_dir: Path


def _parse_kill_at(spec: str | None, groups: int) -> list[tuple[int | None, int]]:
    """``"8,20"`` (victim chosen round-robin) or ``"1@8,0@20"`` (group@committed step)."""
    out: list[tuple[int | None, int]] = []
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        if "@" in item:
            g, s = item.split("@", 1)
            gid = int(g)
            if not 0 <= gid < groups:
                raise SystemExit(f"--kill-at-steps: group {gid} is out of range [0, {groups - 1}]")
            out.append((gid, int(s)))
        else:
            out.append((None, int(item)))
    return sorted(out, key=lambda x: x[1])


def _last_step(events: Path, min_time: float) -> int:
    """Highest committed step in a group's events file written after ``min_time``."""
    if not events.exists():
        return -1
    step = -1
    try:
        with events.open() as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("committed") and rec.get("t", 0) >= min_time:
                    step = max(step, int(rec.get("step", -1)))
    except OSError:
        return -1
    return step


_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure)\b|error:|Error:|FATAL|Fatal)")
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")


def _last_error_line(log: Path, max_bytes: int = 256 * 1024) -> str:
    """The last error line of a group's latest start in its log (the worker's own exception before
    torchrun's summary), else its last non-empty line."""
    try:
        with log.open("rb") as fh:
            fh.seek(max(0, log.stat().st_size - max_bytes))
            text = fh.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    lines = [_RANK_PREFIX.sub("", line).strip() for line in text.split("\n===== start #")[-1].splitlines()[1:]]
    lines = [line for line in lines if line and not line.startswith("=====")]
    errors = [line for line in lines if _ERROR_LINE.match(line) and "ChildFailedError" not in line]
    return (errors or lines or ["(no output)"])[-1][:500]


def _finished(events: Path) -> bool:
    """Whether the group wrote its end-of-training record (before its slow teardown and exit)."""
    try:
        with events.open() as fh:
            return any('"finished"' in line for line in fh)
    except OSError:
        return False


def _data_summary(events: Path) -> dict[str, Any] | None:
    """Samples the committed steps missed (``data_on_failure="skip"``) or took over from missing groups
    (``"redistribute"``), from the groups' step records.

    Each participating group reports, per committed step, the samples of the groups that were not in
    the step; steps are merged over groups (a step's reporter may have died before writing it).
    """
    missed: dict[int, int] = {}
    redistributed: dict[tuple[int, int], int] = {}
    for path in sorted(events.glob("group*.jsonl")):
        with path.open() as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("committed") and rec.get("data_missed_samples") is not None:
                    missed[int(rec["data_step"])] = int(rec["data_missed_samples"])
                    redistributed[int(rec["data_step"]), int(rec["group"])] = int(rec.get("data_redistributed_samples", 0))
    if not missed:
        return None
    stretches: list[list[int]] = []  # [first step, last step, samples]
    for step in sorted(missed):
        if not missed[step]:
            continue
        if stretches and stretches[-1][1] == step - 1:
            stretches[-1][1] = step
            stretches[-1][2] += missed[step]
        else:
            stretches.append([step, step, missed[step]])
    return {"committed_steps": len(missed), "missed_samples": sum(missed.values()), "missed_stretches": stretches,
            "redistributed_samples": sum(redistributed.values())}


def run(
    command: list[str],
    *,
    groups: int = 2,
    ranks_per_group: int = 1,
    runner: str = "torchrun",
    min_replicas: int = 1,
    bind: str = "127.0.0.1",
    lighthouse_port: int = 0,
    join_timeout_ms: int = 1000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 2000,
    kill_every: float | None = None,
    kill_at_steps: str | None = None,
    first_kill_after: float | None = None,
    max_restarts: int = 10,
    restart_delay: float = 0.0,
    events_dir: str | os.PathLike[str] = "outputs/ft_events",
    log_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    timeout: float | None = None,
    grace: float = 30.0,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> LauncherResult:
    """Start a lighthouse and ``groups`` replica groups running ``command``; restart and kill as asked.

    SIGTERM (preemption) is forwarded to every group (its torchrun and its ranks), which stop at their next
    step and write their preemption checkpoints; groups still running ``grace`` seconds later are killed, and
    the launcher returns :data:`~fsdp_strategies._exit.PREEMPT_EXIT_CODE`. SIGINT kills every group at once.
    """
    from torchft.coordination import LighthouseServer

    from fsdp_strategies._exit import PREEMPT_EXIT_CODE

    if groups < 1 or ranks_per_group < 1:
        raise SystemExit("--groups and --ranks-per-group must be >= 1")
    if runner not in ("torchrun", "lightning"):
        raise SystemExit(f"--runner {runner!r}: use 'torchrun' or 'lightning'")
    if not command:
        raise SystemExit("give the training script and its arguments after the options (e.g. -- examples/train_llama.py fit ...)")
    kill_plan = _parse_kill_at(kill_at_steps, groups)
    events = Path(events_dir)
    events.mkdir(parents=True, exist_ok=True)
    logs = Path(log_dir) if log_dir else events
    logs.mkdir(parents=True, exist_ok=True)
    launcher_log = events / "launcher.jsonl"
    for stale in [launcher_log, *events.glob("group*.jsonl")]:  # a previous job's records would confuse this one
        stale.unlink(missing_ok=True)
    rng = random.Random(seed)

    lighthouse = LighthouseServer(
        bind=f"{bind}:{lighthouse_port}" if ":" not in bind else f"[{bind}]:{lighthouse_port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    port = int(lighthouse.address().rsplit(":", 1)[1])
    host = bind if bind not in ("0.0.0.0", "::") else socket.gethostname()
    lighthouse_addr = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    t_start = time.time()
    kills: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []

    def note(record: dict[str, Any]) -> None:
        record = {"t": time.time(), **record}
        with launcher_log.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        print(f"[fsdp-strategies-ft] {json.dumps(record)}", file=sys.stderr, flush=True)

    note({"event": "lighthouse", "address": lighthouse_addr, "min_replicas": min_replicas,
          "heartbeat_timeout_ms": heartbeat_timeout_ms, "join_timeout_ms": join_timeout_ms})

    def start(g: _Group) -> None:
        genv = dict(os.environ)
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
            genv.pop(key, None)
        genv.update(env or {})
        master_port = _free_port()
        genv.update({
            "REPLICA_GROUP_ID": str(g.gid), "NUM_REPLICA_GROUPS": str(groups), "TORCHFT_LIGHTHOUSE": lighthouse_addr,
            "FSDP_STRATEGIES_FT_EVENTS": str(events / f"group{g.gid}.jsonl"), "FT_RESTART_COUNT": str(g.restarts),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "OMP_NUM_THREADS": genv.get("OMP_NUM_THREADS", "1"),
            "PYTHONUNBUFFERED": "1",
        })
        if runner == "torchrun":
            cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={ranks_per_group}", "--nnodes=1",
                   "--master_addr=127.0.0.1", f"--master_port={master_port}", "--max_restarts=0", *command]
        else:
            cmd = [python, *command]
        if g.log is not None:
            g.log.close()
        g.log = (logs / f"group{g.gid}.log").open("ab")
        g.log.write(f"\n===== start #{g.restarts}: {' '.join(cmd)}\n".encode())
        g.log.flush()
        g.proc = subprocess.Popen(cmd, env=genv, stdout=g.log, stderr=subprocess.STDOUT, start_new_session=True)
        g.started_at = time.time()
        note({"event": "start", "group": g.gid, "restart": g.restarts, "pid": g.proc.pid})

    def kill(g: _Group, why: str) -> None:
        if g.proc is None or g.proc.poll() is not None:
            return
        kill_tree(g.proc.pid)
        try:
            g.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        g.kills += 1
        rec = {"event": "kill", "group": g.gid, "why": why, "step": _last_step(events / f"group{g.gid}.jsonl", 0)}
        kills.append({"t": time.time(), **rec})
        note(rec)

    all_groups = [_Group(gid=i) for i in range(groups)]
    for g in all_groups:
        start(g)

    def stop_all(*_: Any) -> None:
        for g in all_groups:
            kill(g, "launcher stopping")
        lighthouse.shutdown()
        raise SystemExit(130)

    preempted: dict[str, float] = {}

    def preempt(*_: Any) -> None:
        # SIGTERM (preemption): forward it to every group and let them stop (and checkpoint) on their own;
        # the loop below waits up to `grace` seconds, then SIGKILLs what is left
        if not preempted:
            preempted["at"] = time.time()
            for g in all_groups:
                if g.proc is not None and g.proc.poll() is None:
                    kill_tree(g.proc.pid, signal.SIGTERM)

    old_int = signal.signal(signal.SIGINT, stop_all)
    old_term = signal.signal(signal.SIGTERM, preempt)
    next_kill = time.time() + (first_kill_after if first_kill_after is not None else (kill_every or 0))
    victim_rr = 0
    returncode = 0
    try:
        while True:
            now = time.time()
            if preempted:
                running = [g for g in all_groups if g.proc is not None and g.proc.poll() is None]
                if running and now - preempted["at"] < grace:
                    time.sleep(0.05)
                    continue
                for g in running:
                    kill(g, f"still running {grace:g}s after SIGTERM")
                codes = {g.gid: g.proc.returncode for g in all_groups if g.proc is not None}
                note({"event": "preempted", "after_s": round(now - preempted["at"], 3), "exit_codes": codes})
                returncode = PREEMPT_EXIT_CODE
                break
            if timeout is not None and now - t_start > timeout:
                note({"event": "timeout", "after_s": timeout})
                returncode = 124
                break
            # finished training (a group that gave up or was abandoned has not)
            any_finished = any(g.succeeded or _finished(events / f"group{g.gid}.jsonl") for g in all_groups)
            if any_finished:  # a group that has not committed yet would start over alone at step 0: stop it
                for other in all_groups:
                    if other.proc is not None and other.proc.poll() is None and not other.finished and \
                            not _finished(events / f"group{other.gid}.jsonl") and \
                            _last_step(events / f"group{other.gid}.jsonl", other.started_at) < 0:
                        kill(other, "the job finished before this group joined")
                        other.finished, other.abandoned = True, True
            for g in all_groups:
                if g.proc is None or g.finished:
                    continue
                code = g.proc.poll()
                if code is None:
                    continue
                g.exit_codes.append(code)
                note({"event": "exit", "group": g.gid, "code": code})
                if code == 0:
                    g.finished = g.succeeded = True
                    continue
                kill_tree(g.proc.pid)  # leftovers of the group (a rank that survived its peers)
                if any_finished:
                    note({"event": "not_restarted", "group": g.gid, "why": "another group already finished"})
                    g.finished = True
                    g.proc = None
                    continue
                if g.restarts >= max_restarts:
                    log = logs / f"group{g.gid}.log"
                    g.gave_up = _last_error_line(log)
                    note({"event": "give_up", "group": g.gid, "restarts": g.restarts, "code": code,
                          "last_error": g.gave_up, "log": str(log)})
                    print(f"fsdp-strategies-ft: replica group {g.gid} gave up: it exited {code} after "
                          f"{g.restarts} restart(s) (--max-restarts {max_restarts}). Last error: {g.gave_up} "
                          f"(log: {log})", file=sys.stderr, flush=True)
                    returncode = 1
                    g.finished = True
                    g.proc = None
                    continue
                if restart_delay:
                    time.sleep(restart_delay)
                g.restarts += 1
                restarts.append({"t": time.time(), "group": g.gid, "restart": g.restarts})
                start(g)
            if all(g.finished for g in all_groups):
                if any(code != 0 for g in all_groups if not g.abandoned for code in g.exit_codes[-1:]):
                    returncode = returncode or 1
                break
            running = [g for g in all_groups if g.proc is not None and g.proc.poll() is None and not g.finished]
            # A group is "live" once it has committed a step in its current incarnation: a fault never takes
            # down the last live group (a group still starting or healing holds no state worth keeping).
            live = [g for g in running if _last_step(events / f"group{g.gid}.jsonl", g.started_at) >= 0]
            # fault injection: every K seconds, a random live group (never the last one)
            if kill_every and now >= next_kill and not any_finished:
                if len(live) > 1:
                    kill(rng.choice(live), f"every {kill_every}s")
                next_kill = now + kill_every
            # ... or when a group's committed step reaches a planned step
            if kill_plan and not any_finished and len(live) > 1:
                gid, step = kill_plan[0]
                candidates = [g for g in live if gid is None or g.gid == gid]
                if gid is None and candidates:
                    candidates = [candidates[victim_rr % len(candidates)]]
                for g in candidates:
                    if _last_step(events / f"group{g.gid}.jsonl", g.started_at) >= step:
                        kill(g, f"at step {step}")
                        kill_plan.pop(0)
                        victim_rr += 1
                        break
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
        for g in all_groups:
            if g.proc is not None and g.proc.poll() is None:
                kill(g, "launcher exit")
            if g.log is not None:
                g.log.close()
        lighthouse.shutdown()
    wall = time.time() - t_start
    data = _data_summary(events)
    if data is not None:
        note({"event": "data", **data})
    note({"event": "done", "returncode": returncode, "wall_s": wall, "kills": len(kills), "restarts": len(restarts)})
    gave_up = [g for g in all_groups if g.gave_up is not None]
    if gave_up:  # the last lines a user sees: which groups gave up, and why
        for g in gave_up:
            print(f"fsdp-strategies-ft: FAILED: replica group {g.gid} exhausted --max-restarts {max_restarts} "
                  f"(exit codes {g.exit_codes}); last error: {g.gave_up}", file=sys.stderr, flush=True)
    return LauncherResult(returncode=returncode, kills=kills, restarts=restarts, wall_s=wall, events_dir=events)


def main(argv: list[str] | None = None) -> None:
    """Console script ``fsdp-strategies-ft [options] [--] SCRIPT [ARGS...]``."""
    parser = argparse.ArgumentParser(
        prog="fsdp-strategies-ft", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--groups", type=int, default=2, help="number of replica groups")
    parser.add_argument("--ranks-per-group", type=int, default=1, help="processes per replica group (torchrun nproc)")
    parser.add_argument("--runner", choices=("torchrun", "lightning"), default="torchrun",
                        help="start each group with torchrun, or as `python SCRIPT` (Lightning's launcher)")
    parser.add_argument("--min-replicas", type=int, default=1, help="lighthouse: fewest groups to form a quorum")
    parser.add_argument("--bind", default="127.0.0.1", help="lighthouse bind host (loopback by default)")
    parser.add_argument("--lighthouse-port", type=int, default=0, help="0 = any free port")
    parser.add_argument("--join-timeout-ms", type=int, default=1000)
    parser.add_argument("--quorum-tick-ms", type=int, default=100)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=2000,
                        help="a dead group counts as alive this long: the survivors' stall per fault")
    parser.add_argument("--kill-every", type=float, default=None, metavar="SECONDS",
                        help="SIGKILL a random live group (one that has committed a step since its start; "
                             "never the last) every SECONDS")
    parser.add_argument("--first-kill-after", type=float, default=None, metavar="SECONDS",
                        help="delay of the first --kill-every fault (default: SECONDS)")
    parser.add_argument("--kill-at-steps", default=None, metavar="[G@]STEP,...",
                        help="SIGKILL group G (or round-robin) once it has committed STEP and another group is live")
    parser.add_argument("--max-restarts", type=int, default=10, help="per group")
    parser.add_argument("--restart-delay", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--events-dir", default="outputs/ft_events", help="per-group step logs + launcher.jsonl (emptied at start)")
    parser.add_argument("--log-dir", default=None, help="per-group stdout/stderr (default: --events-dir)")
    parser.add_argument("--seed", type=int, default=0, help="victim choice for --kill-every")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="give up after this long")
    parser.add_argument("--grace", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM: how long the groups may take to stop (and checkpoint) before SIGKILL; "
                             "more than the strategy's preempt_grace_s")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...] run by every replica group")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    result = run(
        command, groups=args.groups, ranks_per_group=args.ranks_per_group, runner=args.runner,
        min_replicas=args.min_replicas, bind=args.bind, lighthouse_port=args.lighthouse_port,
        join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms, kill_every=args.kill_every,
        kill_at_steps=args.kill_at_steps, first_kill_after=args.first_kill_after, max_restarts=args.max_restarts,
        restart_delay=args.restart_delay, events_dir=args.events_dir, log_dir=args.log_dir, seed=args.seed,
        timeout=args.timeout, grace=args.grace,
    )
    raise SystemExit(result.returncode)


if __name__ == "__main__":
    main()
