"""Hang detection: a job that stops making progress is noticed in seconds, its culprit named, its stacks kept.

Why: when one rank stops (a stuck data worker, a deadlock in user code, a dead link, a device that stopped
answering), every other rank waits inside its next collective until the process group's timeout (30 minutes
in Lightning) and the job then dies with an error that names no rank. This callback notices the stop after
``timeout_s`` and says which rank it was.

How:

* **Progress, out of band.** Every rank records where its main thread is -- the batch (counted from the start
  of ``fit``), the phase (``data``: between two batches, loading included; ``validation``; ``checkpoint``:
  from the checkpoint's state being gathered until the next batch starts; ``forward``, ``backward``,
  ``optimizer``) and, inside a phase, how many FSDP units (or top-level submodules) its forward has entered.
  The hooks only assign integers. A daemon thread per rank publishes that position, when it changed, to the
  job's TCP store (a connection of its own to ``MASTER_ADDR:MASTER_PORT``, not the process group, which may be
  the thing blocked).
* **One monitor.** Rank 0's thread reads every rank's position each ``poll_s`` and tracks when the job as a
  whole last moved. A position that no rank changed for the limit is a hang. Any other rank whose own position
  has not changed for the limit plus three polls checks too (rank 0 itself may be the stuck one).
* **The limit.** ``timeout_s`` between two moves once every rank has finished its first batch;
  ``warmup_timeout_s`` before that (compilation, meta initialisation, the first all-gathers, the sanity
  check); ``checkpoint_timeout_s`` while any rank is in ``checkpoint`` (a slow save is not a hang).
* **Waiting for other replica groups** (``ft_hsdp``'s quorum and cross-group all-reduce; any strategy that is
  a :class:`~fsdp_strategies.protocols.PeerWaitSource`) is not a hang of this group: those waits are bounded
  by the strategy's own timeouts, and the hung group is the one they wait for. A group whose every rank waits
  for the others is never called hung; a rank of it that is stuck elsewhere still is.
* **The culprit** is the rank (or ranks) furthest behind: the others wait at a later point for it. When all
  ranks stand at the same point (a collective no rank completed: a link or device fault), the report says so.
* **The verdict** is written to the store once; every rank's thread picks it up within ``poll_s``, writes its
  Python stacks (all threads, :mod:`faulthandler`) to stderr and to ``<stacks_dir>/rank<r>-stacks.txt`` (under
  ``ft_hsdp`` ``group<g>-rank<r>-stacks.txt``: the groups share a log folder), and torch's flight recorder
  (the last collectives of every process group, where ``TORCH_FR_BUFFER_SIZE`` > 0; ``flight_recorder`` sets
  it) to ``rank<r>-flight-recorder.json``. With ``action="exit"`` every rank waits until all ranks have
  written (at most ``2 * poll_s + 10`` s) and exits with :data:`HANG_EXIT_CODE`; with ``"warn"`` training is
  left to go on and the watchdog re-arms once the job moves again.

Limits: the thread needs the GIL; a rank stuck in C code that holds it cannot write its own stacks (the others
still name it and exit). Without ``MASTER_ADDR``/``MASTER_PORT`` (one process) the rank watches only itself.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from fsdp_strategies import _torch_seam
from fsdp_strategies._options import check_choice, check_int, check_number
from fsdp_strategies.protocols import PeerWaitSource

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.hooks import RemovableHandle

__all__ = ["HANG_EXIT_CODE", "HangWatchdog"]

Action = Literal["exit", "warn"]

#: every rank's exit status after a hang with ``action="exit"``: outside ``sysexits.h``'s range (64-78) and
#: distinct from the package's others (75 preempted, 79 left the quorum, 80 unfixable), so a batch script can
#: requeue the job and exclude the node
HANG_EXIT_CODE = 81

#: phases in the order a rank passes them between two batches, then within one
PHASES = ("data", "validation", "checkpoint", "forward", "backward", "optimizer", "finished")
_DATA, _VALIDATION, _CHECKPOINT, _FORWARD, _BACKWARD, _OPTIMIZER, _FINISHED = range(len(PHASES))


class _Position:
    """Where this rank's main thread is; written by the hooks (plain int stores), read by the thread."""

    __slots__ = ("batch", "phase", "step", "sub")

    def __init__(self) -> None:
        self.batch, self.phase, self.sub, self.step = 0, _DATA, 0, 0

    def key(self) -> tuple[int, int, int]:
        return self.batch, self.phase, self.sub


def _describe(record: dict[str, Any]) -> str:
    """E.g. ``forward at step 5 (unit 1)``: unit = FSDP units (or submodules) its forward entered so far."""
    where = f"{PHASES[record['phase']]} at step {record['step']}"
    return f"{where} (unit {record['sub']})" if record["phase"] in (_FORWARD, _BACKWARD) else where


def culprit_report(records: dict[int, dict[str, Any]], idle_s: float) -> tuple[list[int], str]:
    """The ranks furthest behind and the one report line, from every rank's last published position."""
    keys = {r: (rec["batch"], rec["phase"], rec["sub"]) for r, rec in records.items()}
    behind = sorted(r for r, k in keys.items() if k == min(keys.values()))
    waiting = sorted(set(records) - set(behind))
    if not waiting:
        where = _describe(records[behind[0]])
        ranks = ",".join(map(str, behind))
        return (
            [],
            f"hang: no progress for {idle_s:.0f} s; ranks {ranks} all stand in {where} (the same point: "
            "a collective that no rank completed, e.g. a link or device fault)",
        )
    culprits = "; ".join(
        f"rank {r} (host {records[r]['host']}) stuck in {_describe(records[r])}" for r in behind
    )
    groups: dict[str, list[int]] = {}
    for r in waiting:
        groups.setdefault(_describe(records[r]), []).append(r)
    waits = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} wait{'' if len(rs) > 1 else 's'} "
        f"in {where}"
        for where, rs in groups.items()
    )
    return behind, f"hang: {culprits}; {waits} (no progress for {idle_s:.0f} s)"


class HangWatchdog(Callback):
    """Notices a job that stopped making progress, names the rank(s) it waits for, writes every rank's stacks.

    Args:
        timeout_s: seconds without progress anywhere in the job (no rank started a batch, a phase or an FSDP
            unit's forward) before it is a hang, once every rank has finished its first batch. Keep it well
            above your slowest step (and validation batch).
        action: ``"exit"``: every rank writes its stacks and exits with status :data:`HANG_EXIT_CODE` (81), so
            a batch script can requeue the job (and exclude the node) and ``ft_hsdp``'s launcher restarts the
            group; ``"warn"``: the report and the stacks only, training is left waiting.
        warmup_timeout_s: the same limit before every rank has finished its first batch (compilation, meta
            initialisation, the sanity check). ``None``: ``max(10 * timeout_s, 1800)``.
        checkpoint_timeout_s: the limit while any rank is saving a checkpoint. ``None``: ``max(5 * timeout_s,
            1800)``.
        poll_s: how often each rank publishes its position and the monitor looks. ``None``: ``min(10,
            timeout_s / 6)``.
        stacks_dir: where each rank writes ``rank<r>-stacks.txt`` (and the flight recorder's dump). ``None``:
            a ``hang`` folder in the Trainer's ``log_dir`` (or ``default_root_dir``).
        flight_recorder: entries torch's flight recorder keeps per process group (``TORCH_FR_BUFFER_SIZE``;
            set here when the variable is unset, before the process group starts); 0 leaves it off.
    """

    def __init__(
        self,
        timeout_s: float = 600.0,
        action: Action = "exit",
        warmup_timeout_s: float | None = None,
        checkpoint_timeout_s: float | None = None,
        poll_s: float | None = None,
        stacks_dir: str | None = None,
        flight_recorder: int = 2000,
    ) -> None:
        prefix = "HangWatchdog: "
        check_number(
            "timeout_s", timeout_s, fix="seconds without progress, e.g. timeout_s=600", prefix=prefix
        )
        for name, value in (
            ("warmup_timeout_s", warmup_timeout_s),
            ("checkpoint_timeout_s", checkpoint_timeout_s),
            ("poll_s", poll_s),
        ):
            check_number(
                name,
                value,
                optional=True,
                fix="a positive number of seconds, or null for the default",
                prefix=prefix,
            )
        check_choice("action", action, Action, prefix=prefix)
        check_int(
            "flight_recorder",
            flight_recorder,
            0,
            fix="an entry count, e.g. flight_recorder=2000, or 0 to leave torch's flight recorder off",
            prefix=prefix,
        )
        self.timeout_s, self.action = float(timeout_s), action
        self.warmup_timeout_s = float(warmup_timeout_s or max(10 * timeout_s, 1800.0))
        self.checkpoint_timeout_s = float(checkpoint_timeout_s or max(5 * timeout_s, 1800.0))
        self.poll_s = float(poll_s or min(10.0, timeout_s / 6))
        self.stacks_dir = stacks_dir
        if flight_recorder:  # read when a process group starts: the Trainer's come later in this process
            os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(flight_recorder))
        #: hangs reported so far (this process)
        self.hangs = 0
        #: the watchdog thread's own CPU seconds and polls in the current ``fit`` (its cost while nothing
        #: hangs)
        self.thread_cpu_s, self.polls = 0.0, 0
        self._position = _Position()
        self._fits = 0
        self._hooks: list[RemovableHandle] = []
        self._thread: _WatchThread | None = None

    # ------------------------------------------------------------------ hooks: integer stores only
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._fits += 1
        self._position = _Position()
        self.thread_cpu_s, self.polls = 0.0, 0
        folder = Path(self.stacks_dir or os.path.join(trainer.log_dir or trainer.default_root_dir, "hang"))
        # store keys of this fit and of this watchdog (a second one in the same Trainer keeps its own)
        dogs = [cb for cb in trainer.callbacks if isinstance(cb, HangWatchdog)]  # type: ignore[attr-defined]
        mine = dogs.index(self)
        self._thread = _WatchThread(
            self,
            self._position,
            trainer.strategy,
            trainer.global_rank,
            trainer.world_size,
            folder,
            prefix=f"fsdp_strategies/hang/{mine}/{self._fits}",
        )
        self._thread.start()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        units = [m for m in pl_module.modules() if isinstance(m, FSDPModule)]
        for module in units or list(pl_module.children()):
            self._hooks.append(module.register_forward_pre_hook(self._entered, prepend=True))

    def _entered(self, module: nn.Module, args: Any) -> None:
        self._position.sub += 1

    def _move(self, phase: int) -> None:
        pos = self._position
        pos.phase, pos.sub = phase, 0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._position.step = trainer.global_step
        self._move(_FORWARD)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._move(_BACKWARD)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self._move(_OPTIMIZER)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        pos = self._position
        pos.step = trainer.global_step
        pos.batch += 1
        self._move(_DATA)

    @override
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._position.phase != _VALIDATION:
            self._move(_VALIDATION)
        self._position.sub += 1

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._move(_DATA)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._move(_CHECKPOINT)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._move(
            _FINISHED
        )  # what this rank still does (other callbacks' on_train_end, teardown) is not watched

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._thread is not None:
            self._thread.stop()
            self._thread = None


class _WatchThread(threading.Thread):
    """Publishes this rank's position, watches the job (rank 0, or a rank that stopped), acts on a verdict."""

    def __init__(
        self,
        owner: HangWatchdog,
        position: _Position,
        owner_strategy: Any,
        rank: int,
        world: int,
        folder: Path,
        prefix: str,
    ) -> None:
        super().__init__(name="fsdp-strategies-hang-watchdog", daemon=True)
        self.owner, self.position, self.rank, self.world = owner, position, rank, world
        self.peers = owner_strategy if isinstance(owner_strategy, PeerWaitSource) else None
        self.folder, self.prefix = folder, prefix
        group = getattr(owner_strategy, "replica_group_id", None)  # ft_hsdp: groups share one log folder
        self.name_prefix = "" if group is None else f"group{group}-"
        self.host = (
            os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        )  # SLURM's name: what --exclude takes
        self._stopped = threading.Event()
        self._store = self._connect() if world > 1 else None
        self._published: tuple | None = None
        self._own_moved = self._job_moved = time.monotonic()
        self._own_key: tuple[int, int, int] | None = None
        self._job_keys: dict[int, tuple[int, int, int]] = {}
        self._verdicts_seen = 0
        self._reported_at: tuple | None = None

    def _connect(self) -> Any:
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            return None
        try:
            return dist.TCPStore(
                addr, int(port), is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False
            )
        except Exception as err:  # the watchdog degrades to watching this rank alone
            print(
                f"[HangWatchdog rank {self.rank}] cannot reach the job's store at {addr}:{port} ({err}); "
                "watching this rank alone",
                file=sys.stderr,
                flush=True,
            )
            return None

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=self.owner.poll_s + 5)

    def run(self) -> None:
        while not self._stopped.wait(self.owner.poll_s):
            try:
                self._tick()
                self.owner.polls += 1
                self.owner.thread_cpu_s = time.thread_time()
            except Exception as err:  # a store that went away (the job is ending): watch locally
                if self._stopped.is_set() or self.position.phase == _FINISHED:  # rank 0 tore its store down
                    return
                print(
                    f"[HangWatchdog rank {self.rank}] store error ({err}); watching this rank alone",
                    file=sys.stderr,
                    flush=True,
                )
                self._store = None

    # ------------------------------------------------------------------ one poll
    def _record(self) -> dict[str, Any]:
        pos = self.position
        peer = self.peers is not None and self.peers.peer_wait_s() is not None
        return {
            "batch": pos.batch,
            "phase": pos.phase,
            "sub": pos.sub,
            "step": pos.step,
            "host": self.host,
            "peer": peer,
        }

    def _limit(self, records: list[dict[str, Any]]) -> float:
        owner = self.owner
        if any(rec["phase"] == _CHECKPOINT for rec in records):
            return owner.checkpoint_timeout_s
        if any(rec["batch"] < 1 for rec in records):
            return owner.warmup_timeout_s
        return owner.timeout_s

    def _tick(self) -> None:
        now, mine = time.monotonic(), self._record()
        key = (mine["batch"], mine["phase"], mine["sub"])
        if key != self._own_key or mine["peer"]:  # waiting for other replica groups is their hang, not ours
            self._own_key, self._own_moved = key, now
        store = self._store
        if store is None:
            if mine["phase"] == _FINISHED:
                return
            if now - self._own_moved > self._limit([mine]) and self._reported_at != key:
                self._reported_at = key
                self._act({self.rank: mine}, now - self._own_moved)
            return
        if self._published != (*key, mine["step"], mine["peer"]):
            store.set(f"{self.prefix}/rank/{self.rank}", json.dumps(mine))
            self._published = (*key, mine["step"], mine["peer"])
        seen = store.add(f"{self.prefix}/verdicts", 0)
        if seen > self._verdicts_seen:
            self._verdicts_seen = seen
            verdict = json.loads(store.get(f"{self.prefix}/verdict/{seen}"))
            self._act(
                {int(r): rec for r, rec in verdict["records"].items()}, verdict["idle_s"], verdict["report"]
            )
            return
        stalled = now - self._own_moved > self._limit([mine]) + 3 * self.owner.poll_s
        if self.rank == 0 or stalled:
            self._watch_job(store, now)

    def _watch_job(self, store: Any, now: float) -> None:
        keys = [f"{self.prefix}/rank/{r}" for r in range(self.world)]
        if not store.check(keys):  # a rank has not published yet: still starting (one round trip for all)
            return
        raw = store.multi_get(keys)
        records = {r: rec for r, v in enumerate(raw) if (rec := json.loads(v))["phase"] != _FINISHED}
        if not records or all(rec["peer"] for rec in records.values()):  # all wait for other groups: not us
            self._job_keys, self._job_moved = {}, now
            return
        moving = {
            r: (rec["batch"], rec["phase"], rec["sub"]) for r, rec in records.items() if not rec["peer"]
        }
        if moving != self._job_keys:
            self._job_keys, self._job_moved = moving, now
            return
        idle = now - self._job_moved
        if idle <= self._limit(list(records.values())) or self._reported_at == tuple(sorted(moving.items())):
            return
        self._reported_at = tuple(sorted(moving.items()))
        _, report = culprit_report(records, idle)
        number = self._verdicts_seen + 1  # one rank writes verdict ``number``: the first to claim it
        if store.compare_set(f"{self.prefix}/owner/{number}", "", str(self.rank)) != str(self.rank).encode():
            return
        store.set(
            f"{self.prefix}/verdict/{number}",
            json.dumps({"records": records, "idle_s": idle, "report": report, "by": self.rank}),
        )
        store.add(f"{self.prefix}/verdicts", 1)
        print(report, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ the verdict
    def _act(self, records: dict[int, dict[str, Any]], idle_s: float, report: str | None = None) -> None:
        owner = self.owner
        owner.hangs += 1
        if report is None:  # watching alone
            report = (
                f"hang: rank {self.rank} (host {self.host}) made no progress for {idle_s:.0f} s in "
                f"{_describe(records[self.rank])}"
            )
            print(report, file=sys.stderr, flush=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        header = (
            f"{report}\nrank {self.rank} (host {self.host}, pid {os.getpid()}) at {_describe(self._record())}"
        )
        stacks = self.folder / f"{self.name_prefix}rank{self.rank}-stacks.txt"
        with open(stacks, "w") as fh:
            fh.write(header + "\n\n")
            fh.flush()
            faulthandler.dump_traceback(fh, all_threads=True)
        print(
            f"[HangWatchdog rank {self.rank}] Python stacks of every thread (also in {stacks}):",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        trace = _torch_seam.flight_recorder_json()
        if trace is not None:
            (self.folder / f"{self.name_prefix}rank{self.rank}-flight-recorder.json").write_bytes(trace)
        if owner.action != "exit":
            return
        if self._store is not None:
            self._store.add(f"{self.prefix}/written", 1)
            deadline = time.monotonic() + 2 * owner.poll_s + 10
            while self._store.add(f"{self.prefix}/written", 0) < self.world and time.monotonic() < deadline:
                time.sleep(0.02)  # every rank leaves within a few ms of the others (torchrun stops the rest)
        print(
            f"[HangWatchdog rank {self.rank}] exiting with status {HANG_EXIT_CODE} (hang)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(HANG_EXIT_CODE)
