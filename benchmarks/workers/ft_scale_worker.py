"""The processes of the ft_scale suite (``benchmarks/suites/ft_scale.py``): a lighthouse, simulated replica
groups, and the launcher's supervision loop over their events files.

    python ft_scale_worker.py lighthouse --addr-file F --min-replicas 1 --join-timeout-ms 1000 \\
        --quorum-tick-ms 100 --heartbeat-timeout-ms 2000
    python ft_scale_worker.py groups --lighthouse http://host:port --groups 0,1,2 --events-dir D \\
        --step-s 0.1 [--restart 0] [--heartbeat-ms 100] [--quorum-timeout-s 60]
    python ft_scale_worker.py launcher --events-dir D --groups N --ready-file F --out F

``lighthouse``: torchft's Rust lighthouse (``torchft._torchft.LighthouseServer``, what ``fsdp-strategies-ft``
starts, with its options) alone in this process, so its CPU time and memory can be read from ``/proc/<pid>``.

``groups``: one thread per simulated replica group, each with its own ``ManagerServer`` (the Rust manager a
real ``torchft.Manager`` runs on its group's rank 0: it heartbeats to the lighthouse every ``--heartbeat-ms``
and forwards quorum requests) and a ``ManagerClient`` (what every rank of a real group calls), running
``ft_hsdp``'s per-step protocol with no model: ``_quorum`` (blocks until the lighthouse forms the step's
quorum), the heal handshake when the quorum says so (``_checkpoint_metadata`` from the recovery source; the
step jumps to the quorum's max step), ``--step-s`` of "training" (a sleep: forward, backward, all-reduce),
``should_commit``. Each step appends one line to ``<events-dir>/group<G>.jsonl`` in
:class:`fsdp_strategies.ft.protocol.EventLog`'s step format (``t``, ``group``, ``step``, ``committed``,
``participants``, ``quorum_id``, ``healed``, ``quorum_s``, ``commit_s``, ``step_s``) plus ``heal_s``, ``pid``,
``restart`` and ``error``; a ``started`` record carries the incarnation's replica id, and the ``--observer``
group's step records carry each new quorum's ``members``. Many groups share one process (threads: the Rust
calls release the GIL), so 1,024 fit on a small machine. The module loads ``torchft/_torchft*.so`` by itself,
without ``import torchft`` (which imports torch): a restarted group costs a process start, not a torch import.

``launcher``: the real :class:`fsdp_strategies.ft.launch.launcher.FTLauncher` for N groups, whose supervision
pass (the concerns of its ``run`` loop: finished? exits? spares? faults?) runs every 50 ms over the groups'
events files as they grow. Writes per-pass wall and CPU seconds and its own RSS over time to ``--out`` when it
gets SIGTERM.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import signal
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any


def torchft_core() -> Any:
    """``torchft._torchft`` (the Rust extension) loaded from its file, without importing the torchft
    package."""
    if "torchft._torchft" in sys.modules:
        return sys.modules["torchft._torchft"]
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("ft_scale: torchft is not installed. Fix: pip install torchft")
    found = sorted(glob.glob(os.path.join(next(iter(spec.submodule_search_locations)), "_torchft*.so")))
    if not found:
        raise SystemExit(f"ft_scale: no _torchft*.so in {spec.submodule_search_locations}")
    ext = importlib.util.spec_from_file_location("torchft._torchft", found[0])
    module = importlib.util.module_from_spec(ext)  # type: ignore[arg-type]
    ext.loader.exec_module(module)  # type: ignore[union-attr]
    sys.modules["torchft._torchft"] = module
    return module


# ---------------------------------------------------------------------------------------------- lighthouse
def lighthouse_main(ns: argparse.Namespace) -> None:
    core = torchft_core()
    server = core.LighthouseServer(bind="127.0.0.1:0", min_replicas=ns.min_replicas,
                                   join_timeout_ms=ns.join_timeout_ms, quorum_tick_ms=ns.quorum_tick_ms,
                                   heartbeat_timeout_ms=ns.heartbeat_timeout_ms)
    port = int(server.address().rsplit(":", 1)[1])
    tmp = Path(f"{ns.addr_file}.tmp")
    tmp.write_text(f"http://127.0.0.1:{port}")
    tmp.replace(ns.addr_file)
    signal.signal(signal.SIGTERM, lambda *_: (server.shutdown(), os._exit(0)))
    while True:
        time.sleep(3600)


# ---------------------------------------------------------------------------------------------- simulated
# groups
def _participant(core: Any, gid: int, ns: argparse.Namespace, stop: threading.Event) -> None:
    connect = timedelta(seconds=10)
    quorum_timeout = timedelta(seconds=ns.quorum_timeout_s)
    rpc_timeout = timedelta(seconds=30)
    path = Path(ns.events_dir) / f"group{gid}.jsonl"
    with path.open("a", buffering=1) as fh:
        def write(record: dict[str, Any]) -> None:
            fh.write(json.dumps({"t": time.time(), "group": gid, "pid": os.getpid(), "restart": ns.restart,
                                 **record}) + "\n")

        replica_id = f"ft_hsdp_{gid}:{uuid.uuid4()}"
        try:
            server = core.ManagerServer(replica_id=replica_id, lighthouse_addr=ns.lighthouse,
                                        hostname="127.0.0.1", bind="127.0.0.1:0", store_addr="127.0.0.1:0",
                                        world_size=1,
                                        heartbeat_interval=timedelta(milliseconds=ns.heartbeat_ms),
                                        connect_timeout=connect, quorum_retries=0)
            client = core.ManagerClient(server.address(), connect_timeout=connect)
        except Exception as exc:
            write({"error": f"start: {type(exc).__name__}: {exc}"[:300]})
            return
        write({"started": True, "replica_id": replica_id})
        step, last_quorum = 0, None
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                q = client._quorum(group_rank=0, step=step, checkpoint_metadata=f"sim:{gid}:{step}",
                                   shrink_only=False,
                                   timeout=quorum_timeout, commit_failures=0, init_sync=True)
            except Exception as exc:
                write({"error": f"quorum: {type(exc).__name__}: {exc}"[:300],
                       "quorum_s": time.perf_counter() - t0})
                continue
            t_quorum = time.perf_counter()
            heal_s = None
            if q.heal:
                try:
                    source = core.ManagerClient(q.recover_src_manager_address, connect_timeout=connect)
                    source._checkpoint_metadata(0, timeout=rpc_timeout)
                    step = q.max_step
                except Exception as exc:
                    write({"error": f"heal: {type(exc).__name__}: {exc}"[:300]})
                heal_s = time.perf_counter() - t_quorum
            time.sleep(ns.step_s)  # forward, backward and the cross-group all-reduce of a real group
            t_commit = time.perf_counter()
            try:
                ok = bool(client.should_commit(0, step, True, rpc_timeout))
            except Exception as exc:
                write({"error": f"commit: {type(exc).__name__}: {exc}"[:300]})
                continue
            done = time.perf_counter()
            if ok:
                step += 1
            members = {}
            # one group records each new quorum's members
            if gid == ns.observer and q.quorum_id != last_quorum:
                members, last_quorum = {"members": list(q.replica_ids)}, q.quorum_id
            write({"step": step, "committed": ok, "participants": q.replica_world_size,
                   "quorum_id": q.quorum_id,
                   "healed": bool(q.heal), "quorum_s": t_quorum - t0, "commit_s": done - t_commit,
                   "step_s": done - t0, "heal_s": heal_s, **members})
        server.shutdown()


def groups_main(ns: argparse.Namespace) -> None:
    core = torchft_core()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    Path(ns.events_dir).mkdir(parents=True, exist_ok=True)
    gids = [int(g) for g in ns.groups.split(",") if g]
    threads = [threading.Thread(target=_participant, args=(core, g, ns, stop), daemon=True, name=f"group{g}")
               for g in gids]
    for t in threads:
        t.start()
    while not stop.is_set():
        stop.wait(0.5)
    deadline = time.time() + 5
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.time()))
    os._exit(0)


# ---------------------------------------------------------------------------------------------- the
# launcher's loop
class _Running:
    """Stands in for a group's process: alive (the suite, not this launcher, kills and restarts the
    groups)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode = None

    def poll(self) -> None:
        return None


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def launcher_main(ns: argparse.Namespace) -> None:
    try:
        from fsdp_strategies.ft.launch.launcher import FTLauncher, LaunchOptions
    except ImportError:  # a checkout before ft/launch/ (--src of an earlier commit)
        from fsdp_strategies.ft.launcher import FTLauncher, LaunchOptions  # type: ignore[no-redef]

    launcher = FTLauncher([sys.executable, "-c", "pass"],
                          LaunchOptions(groups=ns.groups, events_dir=ns.events_dir, runner="lightning"))
    for g in launcher.groups:
        g.proc, g.started_at = _Running(0), time.time()  # type: ignore[assignment]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    passes: list[list[float]] = []  # [t, wall_s, cpu_s]
    rss: list[list[float]] = [[time.time(), _rss_bytes()]]
    Path(ns.ready_file).touch()
    next_rss = time.time() + 1.0
    while not stop.is_set():
        now = time.time()
        t0, c0 = time.perf_counter(), time.thread_time()
        finished = launcher._stop_groups_that_cannot_join()
        launcher._handle_exits(finished)
        launcher._tend_spares()
        launcher._inject_faults(now, finished)
        passes.append([now, time.perf_counter() - t0, time.thread_time() - c0])
        if now >= next_rss:
            rss.append([now, _rss_bytes()])
            next_rss = now + 1.0
        stop.wait(0.05)
    rss.append([time.time(), _rss_bytes()])
    retained = sum(len(getattr(launcher.events(g), "_records", ())) for g in launcher.groups)
    Path(ns.out).write_text(json.dumps({"passes": passes, "rss": rss, "records_retained": retained}))
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    lh = sub.add_parser("lighthouse")
    lh.add_argument("--addr-file", required=True)
    lh.add_argument("--min-replicas", type=int, default=1)
    lh.add_argument("--join-timeout-ms", type=int, default=1000)
    lh.add_argument("--quorum-tick-ms", type=int, default=100)
    lh.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    gr = sub.add_parser("groups")
    gr.add_argument("--lighthouse", required=True)
    gr.add_argument("--groups", required=True, help="comma-separated group ids")
    gr.add_argument("--events-dir", required=True)
    gr.add_argument("--step-s", type=float, default=0.1)
    gr.add_argument("--restart", type=int, default=0)
    gr.add_argument("--heartbeat-ms", type=int, default=100)
    gr.add_argument("--quorum-timeout-s", type=float, default=60.0)
    gr.add_argument(
        "--observer", type=int, default=-1, help="this group records every new quorum's replica ids"
    )
    la = sub.add_parser("launcher")
    la.add_argument("--events-dir", required=True)
    la.add_argument("--groups", type=int, required=True)
    la.add_argument("--ready-file", required=True)
    la.add_argument("--out", required=True)
    ns = parser.parse_args()
    {"lighthouse": lighthouse_main, "groups": groups_main, "launcher": launcher_main}[ns.mode](ns)


if __name__ == "__main__":
    main()
