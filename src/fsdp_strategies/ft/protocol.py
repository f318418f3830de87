"""The contract between the ``ft_hsdp`` strategy (inside each replica group) and the launcher.

Written once, here, and used by both sides:

* **Environment** (:class:`FTEnvironment`): what a replica group learns from whoever started it
  (``fsdp-strategies-ft``, SLURM, torchx). ``TORCHFT_LIGHTHOUSE`` is torchft's own variable; the
  others are this package's launcher convention.
* **Warm spares** (:func:`wait_for_activation`): a group the launcher starts ahead of a failure
  (``STANDBY_ENV``) imports, parses its config and builds its Trainer, then waits before any process
  group or lighthouse contact until the launcher creates its activation file; it exits if the launcher
  is gone (``LAUNCHER_PID_ENV``).
* **Exit codes**: :data:`LEAVE_EXIT_CODE` (79: a group left the quorum on purpose, e.g. evicted as a
  straggler -- the launcher restarts it and it heals from a live peer) and :data:`PREEMPT_EXIT_CODE` (75,
  ``EX_TEMPFAIL``: stopped by SIGTERM, checkpoint written, requeue -- the launcher does not restart it, and
  exits with it once no group can finish), and :data:`UNFIXABLE_EXIT_CODE` (80: an error a restart would meet
  again -- not restarted). Distinct so the launcher can tell them apart
  (:mod:`fsdp_strategies.ft.launch.group_exit`); it returns ``PREEMPT_EXIT_CODE`` itself after a forwarded
  SIGTERM.
* **torchft's runtime** (:func:`torchft_runtime_env`): the environment torchft's Rust code reads when it
  starts (its log level, ``RUST_LOG``; its threads per runtime, ``TOKIO_WORKER_THREADS``), with this
  package's defaults where the environment sets neither; the launcher applies it to its lighthouse and
  forkserver, the strategy to its manager.
* **Events** (:class:`EventLog`): a JSON-lines file per group, appended by the group's rank 0 -- one
  ``step`` record per optimizer step, a ``left`` record before leaving, a ``finished`` record at the end
  of training -- and read by the launcher (fault injection at a committed step, "training finished",
  whether a group left, the data-loss summary). Both the writer and the readers are methods of that one class.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from array import array
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from fsdp_strategies.runtime.clean_exit import PREEMPT_EXIT_CODE

__all__ = [
    "EVENTS_ENV",
    "LAUNCHER_PID_ENV",
    "LEAVE_EXIT_CODE",
    "LIGHTHOUSE_ENV",
    "NUM_GROUPS_ENV",
    "PREEMPT_EXIT_CODE",
    "REPLICA_GROUP_ENV",
    "RESTART_COUNT_ENV",
    "STANDBY_ENV",
    "TORCHFT_RUNTIME_DEFAULTS",
    "UNFIXABLE_EXIT_CODE",
    "EventLog",
    "FTEnvironment",
    "resume_file",
    "standby_ready_file",
    "torchft_runtime_env",
    "wait_for_activation",
]

#: torchft's own variable: ``http://host:port`` of the lighthouse.
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: this group's id in ``[0, NUM_REPLICA_GROUPS)``.
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
#: the most groups that ever train at once (the data is sharded over them).
NUM_GROUPS_ENV = "NUM_REPLICA_GROUPS"
#: path of this group's events file (``{replica_group_id}`` is substituted).
EVENTS_ENV = "FSDP_STRATEGIES_FT_EVENTS"
#: how many times the launcher has restarted this group (0 on the first start).
RESTART_COUNT_ENV = "FT_RESTART_COUNT"
#: set on a warm spare only: the file whose creation (by the launcher) activates it.
STANDBY_ENV = "FSDP_STRATEGIES_FT_STANDBY"
#: set on a warm spare only: the launcher's pid; a waiting spare exits once it is gone.
LAUNCHER_PID_ENV = "FSDP_STRATEGIES_FT_LAUNCHER_PID"
#: exit status of a replica group that left the quorum on purpose (``leave_quorum``, e.g. evicted as a
#: straggler); the ``fsdp-strategies-ft`` launcher restarts it. 79: the first status after the ``sysexits.h``
#: range (64-78), so no scheduler reads a meaning into it, and distinct from :data:`PREEMPT_EXIT_CODE` (75,
#: requeue), which the launcher treats differently.
LEAVE_EXIT_CODE = 79
#: exit status of a replica group stopped by an error that a restart would meet again -- a bad option, a full
#: disk, a damaged or mismatched input file (:func:`fsdp_strategies.ft.leave.restart_cannot_fix`); the
#: launcher does not restart it. 80: next after :data:`LEAVE_EXIT_CODE`, outside ``sysexits.h``'s range.
UNFIXABLE_EXIT_CODE = 80
#: torchft's Rust runtime where the environment does not say: ``RUST_LOG`` (read once, when torchft is first
#: imported in a process) ``warn`` -- torchft's default ``info`` writes about nine lines per step per replica
#: group (each rank's quorum and commit vote) and twelve from the lighthouse, each formatted, timestamped and
#: written to stderr by a runtime thread; the events file has every step already -- and
#: ``TOKIO_WORKER_THREADS`` (read when each runtime starts: a manager's server and client, the lighthouse)
#: ``1`` instead of min(4, CPUs): two RPCs per rank and step need no thread pool, and each extra worker is
#: woken to steal work. Less log volume and fewer threads, not speed: ``benchmarks/suites/ft_overhead.py``
#: measured the manager threads' CPU 1.55 -> 1.14 ms a step and the step time unchanged
#: (``ft_overhead_runtime_env-cpu.json``).
TORCHFT_RUNTIME_DEFAULTS = {"RUST_LOG": "warn", "TOKIO_WORKER_THREADS": "1"}


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(
            f"Environment variable {name}={value!r} is not an integer. Fix: set it to a number."
        ) from None


@dataclass(frozen=True)
class FTEnvironment:
    """What a replica group reads from its environment (each field ``None`` when unset)."""

    lighthouse_addr: str | None = None
    replica_group_id: int | None = None
    num_replica_groups: int | None = None
    events_file: str | None = None
    restart_count: int = 0
    standby_file: str | None = None
    launcher_pid: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FTEnvironment:
        """Read the variables (from ``os.environ`` by default); a non-integer number is an error naming it."""
        env = os.environ if env is None else env
        return cls(
            lighthouse_addr=env.get(LIGHTHOUSE_ENV) or None,
            replica_group_id=_env_int(env, REPLICA_GROUP_ENV),
            num_replica_groups=_env_int(env, NUM_GROUPS_ENV),
            events_file=env.get(EVENTS_ENV) or None,
            restart_count=_env_int(env, RESTART_COUNT_ENV) or 0,
            standby_file=env.get(STANDBY_ENV) or None,
            launcher_pid=_env_int(env, LAUNCHER_PID_ENV),
        )

    def to_env(self) -> dict[str, str]:
        """The variables to set for a group (what the launcher passes; unset fields are left out)."""
        out = {LIGHTHOUSE_ENV: self.lighthouse_addr, REPLICA_GROUP_ENV: self.replica_group_id,
               NUM_GROUPS_ENV: self.num_replica_groups, EVENTS_ENV: self.events_file,
               RESTART_COUNT_ENV: self.restart_count, STANDBY_ENV: self.standby_file,
               LAUNCHER_PID_ENV: self.launcher_pid}
        return {k: str(v) for k, v in out.items() if v is not None}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def resume_file(events_file: str | os.PathLike[str]) -> Path:
    """Beside a group's events file: the checkpoints (newest first, one path a line) the launcher hands a
    restarted incarnation of the group, to resume from the first that verifies when no live peer is ahead of
    it."""
    return Path(events_file).with_suffix(".resume")


def standby_ready_file(standby_file: str | os.PathLike[str]) -> Path:
    """The file a warm spare's ranks create once they wait for activation (all imports and set-up done)."""
    return Path(f"{os.fspath(standby_file)}.ready")


def wait_for_activation(env: FTEnvironment, poll_s: float = 0.02) -> float:
    """A warm spare's pause: return once ``env.standby_file`` exists (at once where none is set).

    Why: a restarted replica group spends most of its downtime starting Python, importing torch and
    Lightning and building its Trainer; a spare has done all that before the failure, so its activation
    costs only the process group, the quorum and the heal. Called before any process group or lighthouse
    contact, so a waiting spare holds no rendezvous and no quorum seat. Raises ``SystemExit`` (with the
    reason) if ``env.launcher_pid`` is set and that process is gone: nobody is left to activate it.
    Returns the seconds waited.
    """
    if not env.standby_file:
        return 0.0
    path, t0 = Path(env.standby_file), time.monotonic()
    standby_ready_file(path).touch()  # the launcher reports the spare as ready (every rank touches it)
    while not path.exists():
        if env.launcher_pid is not None and not _alive(env.launcher_pid):
            raise SystemExit(
                f"ft_hsdp warm spare: its launcher (pid {env.launcher_pid}) is gone before activating "
                f"it ({STANDBY_ENV}={path}); exiting without training."
            )
        time.sleep(poll_s)
    restore_normal_scheduling()
    return time.monotonic() - t0


def restore_normal_scheduling() -> None:
    """Put every thread of this process back from ``SCHED_IDLE`` to ``SCHED_OTHER``.

    The launcher starts a spare under ``SCHED_IDLE`` so that its start-up uses only CPU time the training
    processes leave idle (a spare shares its group's cores); once activated it must train at normal priority.
    Threads created later inherit the policy of the thread that creates them. Leaving ``SCHED_IDLE`` needs
    ``CAP_SYS_NICE`` or ``RLIMIT_NICE`` >= 20 (``ulimit -e 20``); without either this warns and the group
    trains at idle priority (harmless only where nothing else runs on its cores). No-op elsewhere.
    """
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is None or os.sched_getscheduler(0) != idle:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    try:
        for tid in tids:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
    except PermissionError:
        warnings.warn("ft_hsdp warm spare: cannot leave SCHED_IDLE after activation (needs CAP_SYS_NICE or "
                      "RLIMIT_NICE >= 20); this replica group trains "
                      "at idle CPU priority. Fix: `ulimit -e 20` in "
                      "the launcher's shell, or run without --warm-spares.", stacklevel=2)


@contextmanager
def torchft_runtime_env() -> Iterator[dict[str, str]]:
    """Within: the variables of :data:`TORCHFT_RUNTIME_DEFAULTS` as torchft will read them -- the
    environment's value where it sets one (a user's ``RUST_LOG=info`` wins), else the default; yields them.
    The defaults are removed again on exit, so that nothing else in the process (another Rust library's
    runtime) inherits them.

    Import torchft and create its runtimes inside: the log level applies only if this is where torchft's
    native module is first imported in the process (a forkserver's preload, a script's own ``import
    torchft`` before the strategy's: then that import's environment decides).
    """
    added = {k: v for k, v in TORCHFT_RUNTIME_DEFAULTS.items() if not os.environ.get(k)}
    os.environ.update(added)
    try:
        yield {k: os.environ[k] for k in TORCHFT_RUNTIME_DEFAULTS}
    finally:
        for k, v in added.items():
            if os.environ.get(k) == v:
                del os.environ[k]


#: one writer at a time in this process: the open file is shared by every line, and ``leave_quorum`` (public)
#: may be called from a thread of the user's beside the step's line
_WRITING = threading.Lock()


def _names(path: Path, fh: TextIO) -> bool:
    """Whether ``path`` still names the file open as ``fh``."""
    try:
        here = path.stat()
    except OSError:
        return False
    there = os.fstat(fh.fileno())
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _parse(lines: list[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects of ``lines``; a line cut short by a kill (and whatever the next writer appended to it)
    is skipped."""
    for line in lines:
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(record, dict):
            yield record


class EventLog:
    """One replica group's JSON-lines events file: written by the group, read by the launcher.

    Records (every one has ``t``, wall time, and ``group``):

    * step: ``step`` (the quorum's committed step after this one), ``committed``, ``participants``,
      ``quorum_id``, ``healed``, ``step_s``, ``quorum_s``, ``commit_s``, ``pid`` and ``data_*`` (what the
      step trained and missed: ``data_step``, ``data_missed_samples``, ``data_redistributed_samples``...);
    * ``left``: the reason the group left the quorum;
    * ``finished``: the committed step at the end of training (written before the slow teardown);
    * ``checkpoint``: the path of a checkpoint this group wrote, at committed step ``checkpoint_step`` (what a
      restarted group resumes from when no live peer is ahead of it, :func:`resume_file`);
    * ``switch``: ``straggler_sync`` changed mode (``every_step`` or the fallback) at committed step
      ``switch_step``, with the agreed ``cost`` (max over groups) and the per-group ``costs``.
    """

    def __init__(self, path: str | os.PathLike[str], max_age_s: float = 0.0) -> None:
        self.path = Path(path)
        #: a read within this many seconds of the last look at the file reuses it (the launcher asks each
        #: group's reader several times per pass of its 50 ms loop; one look per pass is enough). 0: look
        #: every time.
        self.max_age_s = max_age_s
        self._writer: TextIO | None = None  # the file this process appends to (kept open)
        self._reset()

    def _reset(self) -> None:
        # reading is incremental: the launcher asks several times per 50 ms loop, and re-parsing a growing
        # file each time cost it a whole core after a few thousand steps (on the cores the groups train on). A
        # reader keeps only what its questions need, 16 bytes per committed step: keeping every parsed record
        # grew the launcher by ~1.5 KB per group-step (ft_scale: ~5 GiB an hour at 1,024 groups stepping once
        # a second)
        self._offset = 0
        self._looked = -float("inf")  # time.monotonic() of the last look at the file
        self._partial = b""  # an unfinished last line (its writer may still be writing it)
        self._committed_t = array("d")  # t of the committed step records, in file order
        self._committed_step = array("q")  # and their steps
        self._left: list[tuple[float, str]] = []  # (t, reason) of left records
        self._max_since: dict[float, tuple[int, int]] = {}  # since -> (committed records scanned, max step)
        self._finished = False

    # ------------------------------------------------------------------ writing (the group's rank 0)
    def _append(self, record: dict[str, Any]) -> None:
        """One line, in one ``write`` (``O_APPEND``: whole lines however many processes append). The file
        stays open between lines (opening, creating the folder and closing it again per line was most of a
        step's events cost); it is opened again when the path no longer names it (removed or replaced)."""
        line = json.dumps({"t": time.time(), **record}) + "\n"
        with _WRITING:
            fh = self._writer
            if fh is None or not _names(self.path, fh):
                self._close()
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fh = self._writer = self.path.open("a")
            fh.write(line)
            fh.flush()

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickled, deep-copied) opens the file itself when it writes."""
        return {**self.__dict__, "_writer": None}

    def close(self) -> None:
        """Close the file this process appends to (it is opened again by the next line)."""
        with _WRITING:
            self._close()

    def _close(self) -> None:
        fh, self._writer = self._writer, None
        if fh is not None:
            fh.close()

    def write_step(self, group: int, step: int, committed: bool, **fields: Any) -> None:
        """One optimizer step of this group (``fields``: see the class docstring)."""
        self._append({"group": group, "step": step, "committed": committed, **fields})

    def write_left(self, group: int, reason: str, step: int | None = None) -> None:
        self._append({"group": group, "left": reason, **({"step_left": step} if step is not None else {})})

    def write_finished(self, group: int, step: int) -> None:
        self._append({"group": group, "finished": step})

    def write_checkpoint(self, group: int, step: int, path: str) -> None:
        self._append({"group": group, "checkpoint": path, "checkpoint_step": step})

    def write_switch(self, group: int, step: int, to: str, cost: float, costs: list[float]) -> None:
        self._append({"group": group, "switch": to, "switch_step": step, "cost": cost, "costs": costs})

    # ------------------------------------------------------------------ reading (the launcher)
    def _refresh(self, fresh: bool = False) -> None:
        """Parse what was appended since the last call (the whole file again if it shrank: a new job's file);
        within ``max_age_s`` of the last look, nothing (unless ``fresh``)."""
        now = time.monotonic()
        if not fresh and now - self._looked < self.max_age_s:
            return
        self._looked = now
        try:
            size = self.path.stat().st_size
            if size < self._offset:
                self._reset()
                self._looked = now
            if size == self._offset:
                return
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for record in _parse(lines):
            if record.get("committed"):
                self._committed_t.append(float(record.get("t", 0)))
                self._committed_step.append(int(record.get("step", -1)))
            if "left" in record:
                self._left.append((float(record.get("t", 0)), str(record["left"])))
            self._finished = self._finished or "finished" in record

    def records(self) -> Iterator[dict[str, Any]]:
        """Every complete record (a line cut short by a kill is skipped), read from the file now (not
        kept)."""
        try:
            data = self.path.read_bytes()
        except OSError:
            return
        lines = data.split(b"\n")
        lines.pop()  # an unfinished last line, or the empty string after the last newline
        yield from _parse(lines)

    def last_committed_step(self, since: float = 0.0) -> int:
        """Highest committed step in records written at or after ``since``; -1 if none."""
        self._refresh()
        scanned, best = self._max_since.get(since, (0, -1))
        times, steps = self._committed_t, self._committed_step
        for i in range(scanned, len(times)):
            if times[i] >= since and steps[i] > best:
                best = steps[i]
        self._max_since[since] = (len(times), best)
        return best

    def checkpoints(self) -> list[tuple[int, str]]:
        """``(committed step, path)`` of every checkpoint this group recorded, in file order."""
        return [(int(r["checkpoint_step"]), str(r["checkpoint"]))
                for r in self.records() if "checkpoint" in r]

    def left_since(self, since: float = 0.0) -> str | None:
        """The reason of the last ``left`` record written at or after ``since``; None if the group did not
        leave."""
        self._refresh(fresh=True)  # asked once a group exited: its last record may be a few ms old
        return next((reason for t, reason in reversed(self._left) if t >= since), None)

    def finished(self) -> bool:
        """Whether the group wrote its end-of-training record."""
        self._refresh()
        return self._finished

    @staticmethod
    def data_summary(events_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
        """Samples the committed steps missed (``data_on_failure="skip"``) or took over from missing groups
        (``"redistribute"``), merged over every ``group*.jsonl`` of ``events_dir``.

        Each participating group reports, per committed step, the samples of the groups that were not in
        the step; steps are merged over groups (a step's reporter may have died before writing it).
        """
        missed: dict[int, int] = {}
        redistributed: dict[tuple[int, int], int] = {}
        for path in sorted(Path(events_dir).glob("group*.jsonl")):
            for rec in EventLog(path).records():
                if rec.get("committed") and rec.get("data_missed_samples") is not None:
                    missed[int(rec["data_step"])] = int(rec["data_missed_samples"])
                    redistributed[int(rec["data_step"]), int(rec["group"])] = int(
                        rec.get("data_redistributed_samples", 0))
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
        return {"committed_steps": len(missed), "missed_samples": sum(missed.values()),
                "missed_stretches": stretches, "redistributed_samples": sum(redistributed.values())}
