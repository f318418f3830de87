"""``fsdp-strategies-ft``: run fault-tolerant HSDP on this machine -- a lighthouse plus N replica groups.

    fsdp-strategies-ft --groups 2 --ranks-per-group 2 --kill-every 30 -- \\
        examples/train_llama.py fit --config configs/ft_hsdp.yaml

Each replica group is one ``torchrun`` job (``--runner torchrun``, the default: a rank that dies
takes its group down, which is what fault tolerance needs), a plain ``python SCRIPT`` that lets
Lightning's own launcher start the ranks (``--runner lightning``), or ranks forked from one server process that
has imported torch, Lightning and torchft once, with torchrun's semantics (``--runner forkserver``, see
:mod:`fsdp_strategies.ft.forkserver`: a restart skips the imports). Every group gets its own OS
session, so a fault (``--kill-every SECONDS`` or ``--kill-at-steps``) is a SIGKILL of the whole
group, and a group that exits non-zero is restarted; the restarted group heals from a live peer.
With ``--warm-spares`` each group also has a standby incarnation (its next restart) that has already
started Python, imported everything and built its Trainer, and waits (no process group, no quorum seat) to
be activated: a failure then costs the group its process-group set-up and heal, not a cold start.
Groups learn their place from the environment (:class:`~fsdp_strategies.ft.protocol.FTEnvironment`:
``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE``, ``FSDP_STRATEGIES_FT_EVENTS`` -- a
per-group JSON-lines step log (:class:`~fsdp_strategies.ft.protocol.EventLog`), which the launcher also
reads for ``--kill-at-steps`` -- and ``FT_RESTART_COUNT``).

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

from fsdp_strategies.ft.forkserver import ForkServerGroup, start_group
from fsdp_strategies.ft.protocol import PREEMPT_EXIT_CODE, EventLog, FTEnvironment, standby_ready_file

#: how a replica group's ranks are started (see ``--runner``)
RUNNERS = ("torchrun", "lightning", "forkserver")

__all__ = ["RUNNERS", "FTLauncher", "LaunchOptions", "LauncherResult", "kill_tree", "main", "run"]


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
    proc: subprocess.Popen[bytes] | ForkServerGroup | None = None
    restarts: int = 0
    started_at: float = 0.0
    finished: bool = False
    log: Any = None
    kills: int = 0
    abandoned: bool = False
    succeeded: bool = False  # exited 0: its training finished
    gave_up: str | None = None  # why, once it exhausted --max-restarts
    exit_codes: list[int] = field(default_factory=list)
    # --warm-spares: the standby incarnation (its processes, activation file, log) and whether spares failed
    spare: subprocess.Popen[bytes] | None = None
    spare_go: Path | None = None
    spare_log: Any = None
    spare_started: float = 0.0
    spare_ready: bool = False
    spare_failed: bool = False


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


@dataclass
class LaunchOptions:
    """The launcher's options (the console script's flags, see :func:`main`)."""

    groups: int = 2
    ranks_per_group: int = 1
    runner: str = "torchrun"
    min_replicas: int = 1
    bind: str = "127.0.0.1"
    lighthouse_port: int = 0
    join_timeout_ms: int = 1000
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 2000
    kill_every: float | None = None
    kill_at_steps: str | None = None
    first_kill_after: float | None = None
    max_restarts: int = 10
    restart_delay: float = 0.0
    events_dir: str | os.PathLike[str] = "outputs/ft_events"
    log_dir: str | os.PathLike[str] | None = None
    seed: int = 0
    timeout: float | None = None
    grace: float = 30.0
    pin_cores: str = "none"
    warm_spares: bool = False
    python: str = sys.executable
    env: dict[str, str] | None = None

    def validate(self, command: list[str]) -> None:
        if self.groups < 1 or self.ranks_per_group < 1:
            raise SystemExit("--groups and --ranks-per-group must be >= 1")
        if self.runner not in RUNNERS:
            raise SystemExit(f"--runner {self.runner!r}: use one of {', '.join(RUNNERS)}")
        if self.runner == "forkserver" and self.warm_spares:
            raise SystemExit("--runner forkserver with --warm-spares: pick one (both shorten a restart; the forkserver "
                             "already starts every incarnation with its imports done, at no CPU cost between faults)")
        if self.runner == "forkserver" and os.path.realpath(self.python) != os.path.realpath(sys.executable):
            raise SystemExit(f"--runner forkserver forks from this Python ({sys.executable}), not {self.python!r}: "
                             "run the launcher with that interpreter, or use --runner torchrun")
        if not command:
            raise SystemExit("give the training script and its arguments after the options (e.g. -- "
                             "examples/train_llama.py fit ...)")
        core_sets(self.pin_cores, self.groups)  # a bad --pin-cores fails here, before anything starts


def _parse_cpu_list(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]`` (the kernel's cpu-list syntax)."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(part)
        cpus.extend(range(first, last + 1))
    return cpus


def core_sets(spec: str, groups: int) -> list[list[int]] | None:
    """The CPUs of each replica group for ``--pin-cores`` (``None``: no pinning).

    Why pin: a replica group that trains alone after a peer died would otherwise also run on the dead
    group's cores, so goodput under faults would be measured against a machine the fault-free run
    shared. ``auto`` splits this process's allowed CPUs into ``groups`` equal contiguous blocks; an
    explicit value lists each group's CPUs, groups separated by ``;`` (``"0-3;4-7"``; a CPU may repeat).
    """
    allowed = sorted(os.sched_getaffinity(0))
    if spec == "none":
        return None
    if spec == "auto":
        per = len(allowed) // groups
        if per < 1:
            raise SystemExit(f"--pin-cores auto: {groups} replica groups but this process may use only {len(allowed)} "
                             f"CPUs {allowed}. Fix: fewer --groups, or give each group its CPUs explicitly, e.g. "
                             f"--pin-cores '{';'.join(str(allowed[i % len(allowed)]) for i in range(groups))}' "
                             "(groups may share a CPU).")
        return [allowed[i * per:(i + 1) * per] for i in range(groups)]
    fix = (f"Fix: 'none', 'auto', or {groups} CPU lists separated by ';' (e.g. "
           f"'{';'.join(str(allowed[i % len(allowed)]) for i in range(groups))}'), using the allowed CPUs {allowed}.")
    parts = spec.split(";")
    if len(parts) != groups:
        raise SystemExit(f"--pin-cores {spec!r}: {len(parts)} CPU lists for {groups} replica groups. {fix}")
    sets: list[list[int]] = []
    for part in parts:
        try:
            cpus = _parse_cpu_list(part)
        except ValueError:
            raise SystemExit(f"--pin-cores {spec!r}: {part!r} is not a CPU list. {fix}") from None
        outside = sorted(set(cpus) - set(allowed))
        if outside:
            raise SystemExit(f"--pin-cores {spec!r}: CPUs {outside} are not available to this process. {fix}")
        sets.append(sorted(set(cpus)))
    return sets


class FTLauncher:
    """A lighthouse plus ``groups`` replica groups running ``command``: one method per concern.

    :meth:`run` is the supervision loop; each pass asks, in order: preempted? (:meth:`_preempt_step`),
    past the timeout?, has training finished somewhere (:meth:`_stop_groups_that_cannot_join`)?, which
    groups exited (:meth:`_handle_exits`: restart, or give up after ``max_restarts``)?, all done?, does a group
    need a warm spare (:meth:`_tend_spares`)?, and is a fault due (:meth:`_inject_faults`)? Groups talk to it only through the protocol of
    :mod:`fsdp_strategies.ft.protocol` (environment, exit codes, events files).
    """

    def __init__(self, command: list[str], options: LaunchOptions) -> None:
        options.validate(command)
        self.command = command
        self.opts = options
        self.kill_plan = _parse_kill_at(options.kill_at_steps, options.groups)
        self.events_dir = Path(options.events_dir)
        self.events_dir.mkdir(parents=True, exist_ok=True)
        self.logs = Path(options.log_dir) if options.log_dir else self.events_dir
        self.logs.mkdir(parents=True, exist_ok=True)
        self.launcher_log = self.events_dir / "launcher.jsonl"
        for stale in [self.launcher_log, *self.events_dir.glob("group*.jsonl")]:  # a previous job's records
            stale.unlink(missing_ok=True)
        self.rng = random.Random(options.seed)
        self.groups = [_Group(gid=i) for i in range(options.groups)]
        # one reader per group, kept: each reads only what was appended since it last looked
        self._event_logs = {g.gid: EventLog(self.events_dir / f"group{g.gid}.jsonl") for g in self.groups}
        self.kills: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []
        self.lighthouse: Any = None
        self.lighthouse_addr = ""
        self.preempted_at: float | None = None
        self.returncode = 0
        self.t_start = time.time()
        self.next_kill = 0.0
        self.victim_rr = 0
        self.cores = core_sets(options.pin_cores, options.groups)

    # ------------------------------------------------------------------ records
    def events(self, g: _Group) -> EventLog:
        return self._event_logs[g.gid]

    def note(self, record: dict[str, Any]) -> None:
        """One launcher event: appended to ``launcher.jsonl`` and printed to stderr."""
        record = {"t": time.time(), **record}
        with self.launcher_log.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        print(f"[fsdp-strategies-ft] {json.dumps(record)}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ the lighthouse
    def start_lighthouse(self) -> None:
        from torchft.coordination import LighthouseServer

        o = self.opts
        self.lighthouse = LighthouseServer(
            bind=f"{o.bind}:{o.lighthouse_port}" if ":" not in o.bind else f"[{o.bind}]:{o.lighthouse_port}",
            min_replicas=o.min_replicas, join_timeout_ms=o.join_timeout_ms, quorum_tick_ms=o.quorum_tick_ms,
            heartbeat_timeout_ms=o.heartbeat_timeout_ms,
        )
        port = int(self.lighthouse.address().rsplit(":", 1)[1])
        host = o.bind if o.bind not in ("0.0.0.0", "::") else socket.gethostname()
        self.lighthouse_addr = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        self.note({"event": "lighthouse", "address": self.lighthouse_addr, "min_replicas": o.min_replicas,
                   "heartbeat_timeout_ms": o.heartbeat_timeout_ms, "join_timeout_ms": o.join_timeout_ms})

    # ------------------------------------------------------------------ one group: start and kill
    def group_env(self, g: _Group, master_port: int, restart_count: int | None = None,
                  standby_file: Path | None = None) -> dict[str, str]:
        """The group's environment: the protocol's variables, its own rendezvous, nothing of a parent's ranks
        (a warm spare: its future restart count, its activation file and this launcher's pid)."""
        genv = dict(os.environ)
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
            genv.pop(key, None)
        genv.update(self.opts.env or {})
        genv.update(FTEnvironment(lighthouse_addr=self.lighthouse_addr, replica_group_id=g.gid,
                                  num_replica_groups=self.opts.groups, events_file=str(self.events(g).path),
                                  restart_count=g.restarts if restart_count is None else restart_count,
                                  standby_file=str(standby_file) if standby_file else None,
                                  launcher_pid=os.getpid() if standby_file else None).to_env())
        genv.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
                     "OMP_NUM_THREADS": genv.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"})
        return genv

    def group_command(self, master_port: int) -> list[str]:
        o = self.opts
        if o.runner == "forkserver":  # what each forked rank runs as __main__ (see ft/forkserver.py)
            return list(self.command)
        if o.runner == "torchrun":
            return [o.python, "-m", "torch.distributed.run", f"--nproc_per_node={o.ranks_per_group}", "--nnodes=1",
                    "--master_addr=127.0.0.1", f"--master_port={master_port}", "--max_restarts=0", *self.command]
        return [o.python, *self.command]

    def _spawn(self, g: _Group, header: str, restart_count: int | None = None,
               standby_file: Path | None = None) -> tuple[subprocess.Popen[bytes] | ForkServerGroup, Any]:
        """Start one incarnation of the group (its own session, its CPUs, its log appended); returns it and its log.

        A spare (``standby_file``) starts under ``SCHED_IDLE``: its start-up uses only CPU time the group's
        training leaves idle, and it returns to normal scheduling once activated
        (:func:`~fsdp_strategies.ft.protocol.restore_normal_scheduling`)."""
        master_port = _free_port()
        cmd = self.group_command(master_port)
        log = (self.logs / f"group{g.gid}.log").open("ab")
        log.write(f"\n===== {header}: {' '.join(cmd)}\n".encode())
        log.flush()
        cores = self.cores[g.gid] if self.cores is not None else None
        idle = standby_file is not None and hasattr(os, "SCHED_IDLE")
        if self.opts.runner == "forkserver":
            log.write(f"(forked from the forkserver: {self.opts.ranks_per_group} rank(s))\n".encode())
            log.flush()
            return start_group(command=cmd, ranks=self.opts.ranks_per_group, log_path=log.name,
                               env=self.group_env(g, master_port, restart_count, standby_file), cores=cores), log

        def setup_child() -> None:
            # the group's processes (torchrun and its ranks) inherit the affinity; a restart gets the same CPUs
            if cores is not None:
                os.sched_setaffinity(0, cores)
            if idle:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

        proc = subprocess.Popen(cmd, env=self.group_env(g, master_port, restart_count, standby_file), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=setup_child if cores is not None or idle else None)
        return proc, log

    def start(self, g: _Group) -> bool:
        """Start the group's next incarnation: activate its warm spare if one is waiting (returns True), else a
        cold start."""
        if g.log is not None:
            g.log.close()
        cores = self.cores[g.gid] if self.cores is not None else None
        if g.spare is not None and g.spare.poll() is None and g.spare_go is not None:
            g.spare_go.touch()  # the spare's ranks leave wait_for_activation
            g.proc, g.log, g.spare, g.spare_log = g.spare, g.spare_log, None, None
            g.log.write(f"\n===== start #{g.restarts}: warm spare activated (ready: {g.spare_ready})\n".encode())
            g.log.flush()
            warm = True
        else:
            self.stop_spare(g, "replaced by a cold start")
            g.proc, g.log = self._spawn(g, f"start #{g.restarts}")
            warm = False
        g.started_at = time.time()
        self.note({"event": "start", "group": g.gid, "restart": g.restarts, "pid": g.proc.pid, "cores": cores,
                   "warm_spare": warm, **({"spare_ready": g.spare_ready} if warm else {})})
        return warm

    # ------------------------------------------------------------------ warm spares
    def start_spare(self, g: _Group) -> None:
        """Start the group's standby incarnation (restart ``g.restarts + 1``): it waits for :meth:`start`."""
        n = g.restarts + 1
        g.spare_go = self.events_dir / f"group{g.gid}.spare{n}.go"
        g.spare_go.unlink(missing_ok=True)
        standby_ready_file(g.spare_go).unlink(missing_ok=True)
        g.spare, g.spare_log = self._spawn(g, f"spare #{n} (on standby)", restart_count=n, standby_file=g.spare_go)
        g.spare_started, g.spare_ready = time.time(), False
        self.note({"event": "spare", "group": g.gid, "restart": n, "pid": g.spare.pid})

    def stop_spare(self, g: _Group, why: str) -> None:
        if g.spare is None:
            return
        if g.spare.poll() is None:
            kill_tree(g.spare.pid)
            try:
                g.spare.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self.note({"event": "spare_stopped", "group": g.gid, "why": why})
        if g.spare_log is not None:
            g.spare_log.close()
        g.spare, g.spare_log = None, None

    def _tend_spares(self) -> None:
        """``--warm-spares``: each running group gets a spare once its current incarnation has committed a step
        (so a spare's start-up never competes with a start or a heal); a spare that dies on standby is reported
        and not replaced for that group (its cold restarts still work)."""
        if not self.opts.warm_spares:
            return
        for g in self.groups:
            if g.spare is not None and g.spare.poll() is not None:
                self.note({"event": "spare_exit", "group": g.gid, "code": g.spare.returncode,
                           "log": str(self.logs / f"group{g.gid}.log")})
                self.stop_spare(g, "exited on standby")
                g.spare_failed = True
            if g.spare is not None and not g.spare_ready and g.spare_go is not None \
                    and standby_ready_file(g.spare_go).exists():
                g.spare_ready = True
                self.note({"event": "spare_ready", "group": g.gid, "after_s": round(time.time() - g.spare_started, 3)})
            if g.spare is None and not g.spare_failed and not g.finished and g.restarts < self.opts.max_restarts \
                    and g.proc is not None and g.proc.poll() is None \
                    and self.events(g).last_committed_step(g.started_at) >= 0:
                self.start_spare(g)

    def kill(self, g: _Group, why: str) -> None:
        if g.proc is None or g.proc.poll() is not None:
            return
        kill_tree(g.proc.pid)
        try:
            g.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        g.kills += 1
        rec = {"event": "kill", "group": g.gid, "why": why, "step": self.events(g).last_committed_step()}
        self.kills.append({"t": time.time(), **rec})
        self.note(rec)

    def running(self) -> list[_Group]:
        return [g for g in self.groups if g.proc is not None and g.proc.poll() is None]

    # ------------------------------------------------------------------ signals
    def _on_sigint(self, *_: Any) -> None:
        for g in self.groups:
            self.kill(g, "launcher stopping")
            self.stop_spare(g, "launcher stopping")
        self.lighthouse.shutdown()
        raise SystemExit(130)

    def _on_sigterm(self, *_: Any) -> None:
        # preemption: forward SIGTERM to every group and let them stop (and checkpoint) on their own;
        # _preempt_step waits up to `grace` seconds, then SIGKILLs what is left
        if self.preempted_at is None:
            self.preempted_at = time.time()
            for g in self.running():
                kill_tree(g.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
            for g in self.groups:  # a spare holds no state: nothing to save
                self.stop_spare(g, "preempted")

    def _preempt_step(self, now: float) -> bool:
        """After a SIGTERM: True once every group stopped or the grace period ran out (the loop ends)."""
        assert self.preempted_at is not None
        running = self.running()
        if running and now - self.preempted_at < self.opts.grace:
            return False
        for g in running:
            self.kill(g, f"still running {self.opts.grace:g}s after SIGTERM")
        codes = {g.gid: g.proc.returncode for g in self.groups if g.proc is not None}
        self.note({"event": "preempted", "after_s": round(now - self.preempted_at, 3), "exit_codes": codes})
        self.returncode = PREEMPT_EXIT_CODE
        return True

    # ------------------------------------------------------------------ the supervision loop's concerns
    def _stop_groups_that_cannot_join(self) -> bool:
        """Whether training finished (in a group that did not give up); if so, a group that has not committed
        yet would start over alone at step 0: stop it. Returns whether training finished."""
        finished = any(g.succeeded or self.events(g).finished() for g in self.groups)
        if finished:
            for other in self.running():
                if not other.finished and not self.events(other).finished() and \
                        self.events(other).last_committed_step(other.started_at) < 0:
                    self.kill(other, "the job finished before this group joined")
                    other.finished, other.abandoned = True, True
        return finished

    def _handle_exits(self, training_finished: bool) -> None:
        """Record each group that exited: done (0), or restarted, or given up after ``max_restarts``."""
        o = self.opts
        for g in self.groups:
            if g.proc is None or g.finished:
                continue
            code = g.proc.poll()
            if code is None:
                continue
            g.exit_codes.append(code)
            self.note({"event": "exit", "group": g.gid, "code": code})
            if code == 0:
                g.finished = g.succeeded = True
                self.stop_spare(g, "the group finished")
                continue
            kill_tree(g.proc.pid)  # leftovers of the group (a rank that survived its peers)
            if training_finished:
                self.note({"event": "not_restarted", "group": g.gid, "why": "another group already finished"})
                g.finished, g.proc = True, None
                self.stop_spare(g, "another group already finished")
                continue
            if g.restarts >= o.max_restarts:
                log = self.logs / f"group{g.gid}.log"
                g.gave_up = _last_error_line(log)
                self.note({"event": "give_up", "group": g.gid, "restarts": g.restarts, "code": code,
                           "last_error": g.gave_up, "log": str(log)})
                print(f"fsdp-strategies-ft: replica group {g.gid} gave up: it exited {code} after "
                      f"{g.restarts} restart(s) (--max-restarts {o.max_restarts}). Last error: {g.gave_up} "
                      f"(log: {log})", file=sys.stderr, flush=True)
                self.returncode = 1
                g.finished, g.proc = True, None
                self.stop_spare(g, "the group gave up")
                continue
            if o.restart_delay:
                time.sleep(o.restart_delay)
            g.restarts += 1
            warm = self.start(g)
            self.restarts.append({"t": time.time(), "group": g.gid, "restart": g.restarts, "warm_spare": warm})

    def _all_done(self) -> bool:
        if not all(g.finished for g in self.groups):
            return False
        if any(code != 0 for g in self.groups if not g.abandoned for code in g.exit_codes[-1:]):
            self.returncode = self.returncode or 1
        return True

    def _inject_faults(self, now: float, training_finished: bool) -> None:
        """``kill_every`` / ``kill_at_steps``: SIGKILL a live group, never the last one.

        A group is "live" once it has committed a step in its current incarnation: a fault never takes
        down the last live group (a group still starting or healing holds no state worth keeping).
        """
        if training_finished:
            return
        live = [g for g in self.running() if not g.finished
                and self.events(g).last_committed_step(g.started_at) >= 0]
        kill_every = self.opts.kill_every
        if kill_every and now >= self.next_kill:
            if len(live) > 1:
                self.kill(self.rng.choice(live), f"every {kill_every}s")
            self.next_kill = now + kill_every
        if self.kill_plan and len(live) > 1:
            gid, step = self.kill_plan[0]
            candidates = [g for g in live if gid is None or g.gid == gid]
            if gid is None and candidates:
                candidates = [candidates[self.victim_rr % len(candidates)]]
            for g in candidates:
                if self.events(g).last_committed_step(g.started_at) >= step:
                    self.kill(g, f"at step {step}")
                    self.kill_plan.pop(0)
                    self.victim_rr += 1
                    break

    def _summarize(self) -> LauncherResult:
        wall = time.time() - self.t_start
        data = EventLog.data_summary(self.events_dir)
        if data is not None:
            self.note({"event": "data", **data})
        self.note({"event": "done", "returncode": self.returncode, "wall_s": wall, "kills": len(self.kills),
                   "restarts": len(self.restarts)})
        for g in self.groups:  # the last lines a user sees: which groups gave up, and why
            if g.gave_up is not None:
                print(f"fsdp-strategies-ft: FAILED: replica group {g.gid} exhausted --max-restarts "
                      f"{self.opts.max_restarts} (exit codes {g.exit_codes}); last error: {g.gave_up}",
                      file=sys.stderr, flush=True)
        return LauncherResult(returncode=self.returncode, kills=self.kills, restarts=self.restarts, wall_s=wall,
                              events_dir=self.events_dir)

    def run(self) -> LauncherResult:
        """Start everything, supervise until training ends (or a SIGTERM / the timeout), clean up."""
        o = self.opts
        self.start_lighthouse()
        self.t_start = time.time()
        for g in self.groups:
            self.start(g)
        old_int = signal.signal(signal.SIGINT, self._on_sigint)
        old_term = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.next_kill = time.time() + (o.first_kill_after if o.first_kill_after is not None else (o.kill_every or 0))
        try:
            while True:
                now = time.time()
                if self.preempted_at is not None:
                    if self._preempt_step(now):
                        break
                    time.sleep(0.05)
                    continue
                if o.timeout is not None and now - self.t_start > o.timeout:
                    self.note({"event": "timeout", "after_s": o.timeout})
                    self.returncode = 124
                    break
                finished = self._stop_groups_that_cannot_join()
                self._handle_exits(finished)
                if self._all_done():
                    break
                self._tend_spares()
                self._inject_faults(now, finished)
                time.sleep(0.05)
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
            for g in self.groups:
                if g.proc is not None and g.proc.poll() is None:
                    self.kill(g, "launcher exit")
                self.stop_spare(g, "launcher exit")
                if g.log is not None:
                    g.log.close()
            for activation in self.events_dir.glob("group*.spare*.go*"):  # no spare is left to read them
                activation.unlink(missing_ok=True)
            self.lighthouse.shutdown()
        return self._summarize()


def run(command: list[str], **options: Any) -> LauncherResult:
    """Start a lighthouse and ``groups`` replica groups running ``command``; restart and kill as asked
    (keyword options: the fields of :class:`LaunchOptions`).

    SIGTERM (preemption) is forwarded to every group (its torchrun and its ranks), which stop at their next
    step and write their preemption checkpoints; groups still running ``grace`` seconds later are killed, and
    the launcher returns :data:`~fsdp_strategies.ft.protocol.PREEMPT_EXIT_CODE`. SIGINT kills every group at once.
    """
    return FTLauncher(command, LaunchOptions(**options)).run()


def main(argv: list[str] | None = None) -> None:
    """Console script ``fsdp-strategies-ft [options] [--] SCRIPT [ARGS...]``."""
    parser = argparse.ArgumentParser(
        prog="fsdp-strategies-ft", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--groups", type=int, default=2, help="number of replica groups")
    parser.add_argument("--ranks-per-group", type=int, default=1, help="processes per replica group (torchrun nproc)")
    parser.add_argument("--runner", choices=RUNNERS, default="torchrun",
                        help="start each group with torchrun, as `python SCRIPT` (Lightning's launcher), or "
                             "'forkserver': fork its ranks from one process that has already imported torch, Lightning "
                             "and torchft (a restart skips the imports; the server costs memory, not CPU)")
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
    parser.add_argument("--pin-cores", default="none", metavar="none|auto|CPUS;CPUS;...",
                        help="pin each replica group's processes to its own CPUs (os.sched_setaffinity; kept across "
                             "restarts): 'auto' splits the allowed CPUs evenly, or one cpu-list per group, e.g. '0-3;4-7'")
    parser.add_argument("--warm-spares", action="store_true",
                        help="keep a standby incarnation per replica group (started once the group has committed a "
                             "step: Python, imports and Trainer built, then waiting without a process group or "
                             "quorum seat); a failed group is replaced by it instead of a cold start. Costs one idle "
                             "copy of the group's processes (their memory, no CPU); helps process failures, not the "
                             "loss of the host the spare runs on")
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
        timeout=args.timeout, grace=args.grace, pin_cores=args.pin_cores, warm_spares=args.warm_spares,
    )
    raise SystemExit(result.returncode)


if __name__ == "__main__":
    main()
