"""``fsdp-strategies-ft``: run fault-tolerant HSDP on this machine -- a lighthouse plus N replica groups.

    fsdp-strategies-ft --groups 2 --ranks-per-group 2 --kill-every 30 -- \\
        examples/train_llama.py fit --config configs/ft_hsdp.yaml

Each replica group is one ``torchrun`` job (``--runner torchrun``, the default: a rank that dies
takes its group down, which is what fault tolerance needs), a plain ``python SCRIPT`` that lets
Lightning's own launcher start the ranks (``--runner lightning``), or ranks forked from one server process
that has imported torch, Lightning and torchft once, with torchrun's semantics (``--runner forkserver``, see
:mod:`fsdp_strategies.ft.launch.forkserver`: a restart skips the imports). Every group gets its own OS
session (:mod:`~fsdp_strategies.ft.launch.group_start`), so a fault (``--kill-every SECONDS`` or
``--kill-at-steps``) is a SIGKILL of the whole group (:mod:`~fsdp_strategies.ft.launch.process_tree`). A group
that exits is restarted -- unless it finished, was preempted, or exhausted ``--max-restarts``
(:mod:`~fsdp_strategies.ft.launch.group_exit` tells the kinds of exit apart) -- and the restarted group heals
from a live peer. With ``--warm-spares`` each group also has a standby incarnation (its next restart) that has
already started Python, imported everything and built its Trainer, and waits (no process group, no quorum
seat) to be activated: a failure then costs the group its process-group set-up and heal, not a cold start.
Groups learn their place from the environment (:class:`~fsdp_strategies.ft.protocol.FTEnvironment`:
``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE``, ``FSDP_STRATEGIES_FT_EVENTS`` -- a
per-group JSON-lines step log (:class:`~fsdp_strategies.ft.protocol.EventLog`), which the launcher also
reads for ``--kill-at-steps`` -- and ``FT_RESTART_COUNT``). The options are declared once, in
:mod:`~fsdp_strategies.ft.launch.options`.

On a cluster the same job is ``torchft_lighthouse --min_replicas 1 --bind [::]:29510`` on one host
and one ``torchrun`` (or torchx / SLURM) job per replica group with those variables set.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_strategies.ft.launch.group_exit import GroupExit, classify_exit, last_error_line
from fsdp_strategies.ft.launch.group_start import GroupProcess, GroupStarter
from fsdp_strategies.ft.launch.handover import hand_checkpoints
from fsdp_strategies.ft.launch.options import LaunchOptions, core_sets, parse_args, parse_kill_at
from fsdp_strategies.ft.launch.process_tree import dump_stacks, kill_tree
from fsdp_strategies.ft.protocol import (
    PREEMPT_EXIT_CODE,
    EventLog,
    resume_file,
    standby_ready_file,
    torchft_runtime_env,
)

#: the supervision loop's period, and how old a group's events may be within one pass (less than the period,
#: so every pass sees what was appended before it)
LOOP_S = 0.05
LOOK_EVERY_S = 0.04

# LaunchOptions: the keyword options of run()
__all__ = ["FTLauncher", "LaunchOptions", "LauncherResult", "main", "run"]


@dataclass
class _Group:
    gid: int
    proc: GroupProcess | None = None
    restarts: int = 0
    started_at: float = 0.0
    finished: bool = False
    log: Any = None
    kills: int = 0
    abandoned: bool = False
    succeeded: bool = False  # exited 0: its training finished
    preempted: bool = False  # exited with PREEMPT_EXIT_CODE: stopped for a requeue, not restarted
    gave_up: str | None = None  # its last error, once it exhausted --max-restarts or failed unfixably
    gave_up_after: str = ""  # "3 restart(s) (--max-restarts 3)" or "an error a restart cannot fix"
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


class FTLauncher:
    """A lighthouse plus ``groups`` replica groups running ``command``: one method per concern.

    :meth:`run` is the supervision loop; each pass asks, in order: preempted? (:meth:`_preempt_step`),
    past the timeout?, has training finished somewhere (:meth:`_stop_groups_that_cannot_join`)?, which
    groups exited (:meth:`_handle_exits`: restart, leave a preempted group stopped, or give up after
    ``max_restarts``)?, all done?, does a group need a warm spare (:meth:`_tend_spares`)?, and is a fault due
    (:meth:`_inject_faults`)? Groups talk to it only through the protocol of
    :mod:`fsdp_strategies.ft.protocol` (environment, exit codes, events files).
    """

    def __init__(self, command: list[str], options: LaunchOptions) -> None:
        options.validate(command)
        self.command = command
        self.opts = options
        self.kill_plan = parse_kill_at(options.kill_at_steps, options.groups)
        self.events_dir = Path(options.events_dir)
        self.events_dir.mkdir(parents=True, exist_ok=True)
        self.logs = Path(options.log_dir) if options.log_dir else self.events_dir
        self.logs.mkdir(parents=True, exist_ok=True)
        self.launcher_log = self.events_dir / "launcher.jsonl"
        for stale in [self.launcher_log, *self.events_dir.glob("group*.jsonl")]:  # a previous job's records
            stale.unlink(missing_ok=True)
        self.rng = random.Random(options.seed)
        self.groups = [_Group(gid=i) for i in range(options.groups)]
        # one reader per group, kept: each reads only what was appended since it last looked, and looks once
        # per
        # pass of the 50 ms loop (a pass asks each reader 2-3 times: at 1,024 groups that was 2-3 thousand
        # stat()s)
        self._event_logs = {g.gid: EventLog(self.events_dir / f"group{g.gid}.jsonl", max_age_s=LOOK_EVERY_S)
                            for g in self.groups}
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
        self.starter = GroupStarter(command, options, self.logs, self.cores)

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
        o = self.opts
        bind = f"{o.bind}:{o.lighthouse_port}" if ":" not in o.bind else f"[{o.bind}]:{o.lighthouse_port}"
        with torchft_runtime_env():  # torchft's log level and the lighthouse runtime's threads
            from torchft.coordination import LighthouseServer

            self.lighthouse = LighthouseServer(
                bind=bind, min_replicas=o.min_replicas, join_timeout_ms=o.join_timeout_ms,
                quorum_tick_ms=o.quorum_tick_ms, heartbeat_timeout_ms=o.heartbeat_timeout_ms,
            )
        port = int(self.lighthouse.address().rsplit(":", 1)[1])
        host = o.bind if o.bind not in ("0.0.0.0", "::") else socket.gethostname()
        self.lighthouse_addr = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        self.starter.lighthouse_addr = self.lighthouse_addr
        self.note({"event": "lighthouse", "address": self.lighthouse_addr, "min_replicas": o.min_replicas,
                   "heartbeat_timeout_ms": o.heartbeat_timeout_ms, "join_timeout_ms": o.join_timeout_ms})

    # ------------------------------------------------------------------ one group: start and kill
    def _spawn(self, g: _Group, header: str, restart_count: int | None = None,
               standby_file: Path | None = None) -> tuple[GroupProcess, Any]:
        """Start one incarnation of the group (see :mod:`~fsdp_strategies.ft.launch.group_start`)."""
        return self.starter.start(g.gid, header, g.restarts if restart_count is None else restart_count,
                                  self.events(g).path, standby_file)

    def start(self, g: _Group) -> bool:
        """Start the group's next incarnation: activate its warm spare if one is waiting (returns True), else
        a cold start."""
        if g.log is not None:
            g.log.close()
        self._hand_checkpoints(g)
        cores = self.cores[g.gid] if self.cores is not None else None
        if g.spare is not None and g.spare.poll() is None and g.spare_go is not None:
            g.spare_go.touch()  # the spare's ranks leave wait_for_activation
            g.proc, g.log, g.spare, g.spare_log = g.spare, g.spare_log, None, None
            g.log.write(
                f"\n===== start #{g.restarts}: warm spare activated (ready: {g.spare_ready})\n".encode()
            )
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

    def _hand_checkpoints(self, g: _Group) -> None:
        """A restarted group with no live peer ahead gets the recorded checkpoints (:mod:`.handover`)."""
        if g.restarts == 0:
            resume_file(self.events(g).path).unlink(missing_ok=True)
            return
        live = {o.gid: o.started_at for o in self.groups
                if o is not g and o.proc is not None and o.proc.poll() is None}
        handed = hand_checkpoints([self.events(o) for o in self.groups], g.gid, live)
        if handed is not None:
            self.note({"event": "hand_checkpoints", "group": g.gid, "newest": handed[1], "step": handed[0],
                       "count": handed[2]})

    # ------------------------------------------------------------------ warm spares
    def start_spare(self, g: _Group) -> None:
        """Start the group's standby incarnation (restart ``g.restarts + 1``): it waits for :meth:`start`."""
        n = g.restarts + 1
        g.spare_go = self.events_dir / f"group{g.gid}.spare{n}.go"
        g.spare_go.unlink(missing_ok=True)
        standby_ready_file(g.spare_go).unlink(missing_ok=True)
        g.spare, g.spare_log = self._spawn(
            g, f"spare #{n} (on standby)", restart_count=n, standby_file=g.spare_go
        )
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
        """``--warm-spares``: each running group gets a spare once its current incarnation has committed a
        step (so a spare's start-up never competes with a start or a heal); a spare that dies on standby is
        reported and not replaced for that group (its cold restarts still work)."""
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
                self.note({"event": "spare_ready", "group": g.gid,
                           "after_s": round(time.time() - g.spare_started, 3)})
            if g.spare is None and not g.spare_failed and not g.finished \
                    and g.restarts < self.opts.max_restarts and g.proc is not None and g.proc.poll() is None \
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

    def _dump_stuck_groups(self) -> None:
        """At the timeout: every group still running prints its processes' Python stacks into its log."""
        for g in self.running():
            log = self.logs / f"group{g.gid}.log"
            self.note({"event": "stacks", "group": g.gid, "pids": dump_stacks(g.proc.pid), "log": str(log)})
            print(f"fsdp-strategies-ft: TIMEOUT: replica group {g.gid} was still running after --timeout "
                  f"{self.opts.timeout:g}; the Python stacks of its processes are at the end of {log}",
                  file=sys.stderr, flush=True)

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
    def _training_finished(self) -> bool:
        """Whether a group finished training (it exited 0, or wrote its end-of-training record)."""
        return any(g.succeeded or self.events(g).finished() for g in self.groups)

    def _stop_groups_that_cannot_join(self) -> bool:
        """Whether training finished (in a group that did not give up); if so, a group that has not committed
        yet would start over alone at step 0: stop it. Returns whether training finished."""
        finished = self._training_finished()
        if finished:
            for other in self.running():
                if not other.finished and not self.events(other).finished() and \
                        self.events(other).last_committed_step(other.started_at) < 0:
                    self.kill(other, "the job finished before this group joined")
                    other.finished, other.abandoned = True, True
        return finished

    def _handle_exits(self, training_finished: bool) -> None:
        """Record each group that exited and react to its kind of exit
        (:mod:`~fsdp_strategies.ft.launch.group_exit`): finished (0): done; preempted: not restarted;
        unfixable: given up at once; left or failed: restarted, or given up after ``max_restarts``."""
        o = self.opts
        for g in self.groups:
            if g.proc is None or g.finished:
                continue
            code = g.proc.poll()
            if code is None:
                continue
            g.exit_codes.append(code)
            left = self.events(g).left_since(g.started_at)
            kind = classify_exit(code, self.logs / f"group{g.gid}.log", left=left is not None)
            self.note({"event": "exit", "group": g.gid, "code": code, "kind": kind.value,
                       **({"left": left} if left is not None else {})})
            if kind is GroupExit.FINISHED:
                g.finished = g.succeeded = True
                self.stop_spare(g, "the group finished")
                continue
            kill_tree(g.proc.pid)  # leftovers of the group (a rank that survived its peers)
            if kind is GroupExit.PREEMPTED:  # a restart would undo the stop; the others go on without it
                self.note(
                    {"event": "not_restarted", "group": g.gid, "why": "preempted: it stopped for a requeue"}
                )
                g.finished, g.preempted, g.proc = True, True, None
                self.stop_spare(g, "the group was preempted")
                continue
            if training_finished:
                self.note({"event": "not_restarted", "group": g.gid, "why": "another group already finished"})
                g.finished, g.proc = True, None
                self.stop_spare(g, "another group already finished")
                continue
            unfixable = kind is GroupExit.UNFIXABLE  # a restart would meet the same error: never retried
            if unfixable or g.restarts >= o.max_restarts:
                log = self.logs / f"group{g.gid}.log"
                g.gave_up = last_error_line(log)
                g.gave_up_after = "an error a restart cannot fix" if unfixable else \
                    f"{g.restarts} restart(s) (--max-restarts {o.max_restarts})"
                self.note({"event": "give_up", "group": g.gid, "restarts": g.restarts, "code": code,
                           "unfixable": unfixable, "last_error": g.gave_up, "log": str(log)})
                print(f"fsdp-strategies-ft: replica group {g.gid} gave up: it exited {code} after "
                      f"{g.gave_up_after}. Last error: {g.gave_up} (log: {log})", file=sys.stderr, flush=True)
                self.returncode = 1
                g.finished, g.proc = True, None
                self.stop_spare(g, "the group gave up")
                continue
            if o.restart_delay:
                time.sleep(o.restart_delay)
            g.restarts += 1
            warm = self.start(g)
            self.restarts.append(
                {"t": time.time(), "group": g.gid, "restart": g.restarts, "warm_spare": warm}
            )

    def _all_done(self) -> bool:
        """Whether every group is done; then the job's status: 1 if a group failed for good, else
        ``PREEMPT_EXIT_CODE`` if a group was preempted and none finished training (requeue the job), else
        0."""
        if not all(g.finished for g in self.groups):
            return False
        if any(
            code != 0 for g in self.groups if not (g.abandoned or g.preempted) for code in g.exit_codes[-1:]
        ):
            self.returncode = self.returncode or 1
        elif any(g.preempted for g in self.groups) and not self._training_finished():
            self.returncode = self.returncode or PREEMPT_EXIT_CODE
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
                print(f"fsdp-strategies-ft: FAILED: replica group {g.gid} gave up after {g.gave_up_after} "
                      f"(exit codes {g.exit_codes}); last error: {g.gave_up}", file=sys.stderr, flush=True)
        return LauncherResult(returncode=self.returncode, kills=self.kills, restarts=self.restarts,
                              wall_s=wall, events_dir=self.events_dir)

    def run(self) -> LauncherResult:
        """Start everything, supervise until training ends (or a SIGTERM / the timeout), clean up."""
        o = self.opts
        self.start_lighthouse()
        self.t_start = time.time()
        for g in self.groups:
            self.start(g)
        old_int = signal.signal(signal.SIGINT, self._on_sigint)
        old_term = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.next_kill = time.time() + (
            o.first_kill_after if o.first_kill_after is not None else (o.kill_every or 0)
        )
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
                    self._dump_stuck_groups()
                    break
                finished = self._stop_groups_that_cannot_join()
                self._handle_exits(finished)
                if self._all_done():
                    break
                self._tend_spares()
                self._inject_faults(now, finished)
                time.sleep(LOOP_S)
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
    (keyword options: the fields of :class:`~fsdp_strategies.ft.launch.options.LaunchOptions`).

    SIGTERM (preemption) is forwarded to every group (its torchrun and its ranks), which stop at their next
    step and write their preemption checkpoints; groups still running ``grace`` seconds later are killed, and
    the launcher returns :data:`~fsdp_strategies.ft.protocol.PREEMPT_EXIT_CODE`. SIGINT kills every group at
    once.
    """
    return FTLauncher(command, LaunchOptions(**options)).run()


def main(argv: list[str] | None = None) -> None:
    """Console script ``fsdp-strategies-ft [options] [--] SCRIPT [ARGS...]``."""
    options, command = parse_args(argv)
    raise SystemExit(FTLauncher(command, options).run().returncode)


if __name__ == "__main__":
    main()
