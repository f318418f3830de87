"""Separate "hosts" on one machine: Linux network namespaces with their own addresses on a bridge.

A :class:`Hosts` (a context manager) builds up to 8 hosts ``fsdpns0``, ``fsdpns1``, ...: each is a network
namespace with its loopback up and one interface ``eth0`` (a veth pair whose other end, ``fsdpnsv<i>``, is a
port of the bridge ``fsdpnsbr`` in the root namespace) holding ``10.77.0.<i+1>/24``. Traffic between two hosts
crosses both hosts' veth pairs and the bridge; traffic inside one host (its ranks talking to its own address)
stays on that namespace's loopback. So:

* a host's **link is cut** by setting its bridge-side end down (:meth:`Hosts.cut` / :meth:`Hosts.restore`,
  :meth:`Hosts.cut_for`): the host keeps its address and its sockets, and its packets are dropped in both
  directions, as when a cable or a top-of-rack switch fails -- nobody is told, TCP retransmits until the link
  is back or a timeout fires;
* a host's **link is shaped** with the ``tbf`` qdisc on both ends of its veth pair (:meth:`Hosts.shape`):
  traffic to and from the host is limited to the rate; inside the host nothing changes. (``netem`` is not in
  every kernel -- not in this machine's -- so there is no added delay, only a bandwidth limit.)

Processes run in a host through ``ip netns exec`` (:meth:`Host.argv`), which enters the namespace and
``exec``s the command: the pid is the one :mod:`processes` started, so :meth:`Hosts.start` / :meth:`Hosts.run`
are the usual tree-killing helpers and the suite's leak check sees everything a test left
behind. Only the network is separate: file system, pids and hostname are shared (``socket.gethostname()``
resolves to 127.0.0.1 everywhere, so programs must be told their host's address: torchrun ``--local-addr``
and, on the rendezvous host, ``--rdzv-conf=is_host=1``; ``GLOO_SOCKET_IFNAME`` (:meth:`Host.env`); ft_hsdp's
``hostname``).

The names are fixed, so one :class:`Hosts` exists at a time on the machine: it holds an exclusive ``flock`` on
``$TMPDIR/fsdp_strategies_netns.lock`` while it lives, and on entry removes whatever an earlier, killed run
left (namespaces, bridge, veth ends with these names) -- safe because that run no longer holds the lock.
Teardown (also after a failure) deletes the namespaces, the veth ends and the bridge.

:func:`unavailable` says why hosts cannot be built here (not root, no ``ip``, namespaces refused), for a skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support import processes

PREFIX = "fsdpns"
BRIDGE = f"{PREFIX}br"
SUBNET = "10.77.0"
IFNAME = "eth0"
MAX_HOSTS = 8
LOCK = Path(os.environ.get("TMPDIR", "/tmp")) / "fsdp_strategies_netns.lock"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip ARGS`` (a short configuration command; fails loudly with its stderr when ``check``)."""
    proc = processes.run(["ip", *args], timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _tc(*args: str, netns: str | None = None) -> None:
    argv = ["ip", "netns", "exec", netns, "tc", *args] if netns else ["tc", *args]
    proc = processes.run(argv, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` exited {proc.returncode}: {proc.stderr.strip()}")


_UNAVAILABLE: list[str | None] = []


def unavailable() -> str | None:
    """Why network-namespace hosts cannot be built on this machine (None: they can). Checked once per
    process."""
    if _UNAVAILABLE:
        return _UNAVAILABLE[0]
    reason = None
    if os.geteuid() != 0:
        reason = f"network namespaces need root (ip netns add); this process runs as uid {os.geteuid()}"
    elif not (shutil.which("ip") and shutil.which("tc")):
        reason = "the iproute2 commands `ip` and `tc` are not installed"
    else:
        probe = f"{PREFIX}probe{os.getpid()}"
        made = processes.run(["ip", "netns", "add", probe], timeout=30)
        if made.returncode != 0:
            reason = f"`ip netns add` is refused here: {made.stderr.strip()}"
        else:
            processes.run(["ip", "netns", "delete", probe], timeout=30)
    _UNAVAILABLE.append(reason)
    return reason


@dataclass(frozen=True)
class Host:
    """One namespace host: ``name`` (the namespace), its address ``ip`` on ``eth0``, and ``veth``, the
    bridge-side end of its link in the root namespace."""

    index: int
    name: str
    ip: str
    veth: str

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run inside this host."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def env(self) -> dict[str, str]:
        """Variables a distributed program in this host needs: gloo on the host's interface (not the loopback
        that the shared hostname resolves to)."""
        return {"GLOO_SOCKET_IFNAME": IFNAME, "TP_SOCKET_IFNAME": IFNAME}


class Hosts:
    """``n`` namespace hosts on a bridge (see the module docstring); use as ``with Hosts(2) as hosts:``."""

    def __init__(self, n: int, lock_timeout_s: float = 600.0) -> None:
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"Hosts(n={n}): between 1 and {MAX_HOSTS} hosts. Fix: pass n in that range.")
        self.hosts = [Host(i, f"{PREFIX}{i}", f"{SUBNET}.{i + 1}", f"{PREFIX}v{i}") for i in range(n)]
        self.lock_timeout_s = lock_timeout_s
        self._lock: Any = None
        self._timers: list[threading.Thread] = []

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> Hosts:
        reason = unavailable()
        if reason:
            raise RuntimeError(f"network-namespace hosts cannot be built: {reason}")
        self._acquire()
        try:
            cleanup()
            _ip("link", "add", BRIDGE, "type", "bridge")
            _ip("link", "set", BRIDGE, "up")
            for h in self.hosts:
                _ip("netns", "add", h.name)
                _ip("link", "add", h.veth, "type", "veth", "peer", "name", f"{PREFIX}p{h.index}")
                _ip("link", "set", f"{PREFIX}p{h.index}", "netns", h.name)
                _ip("-n", h.name, "link", "set", f"{PREFIX}p{h.index}", "name", IFNAME)
                _ip("-n", h.name, "addr", "add", f"{h.ip}/24", "dev", IFNAME)
                _ip("-n", h.name, "link", "set", IFNAME, "up")
                _ip("-n", h.name, "link", "set", "lo", "up")
                _ip("link", "set", h.veth, "master", BRIDGE)
                _ip("link", "set", h.veth, "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            cleanup()
        finally:
            if self._lock is not None:
                self._lock.close()  # releases the flock
                self._lock = None

    def _acquire(self) -> None:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        fh = LOCK.open("a+")
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    fh.close()
                    raise TimeoutError(
                        f"another run has held {LOCK} (namespace hosts) for {self.lock_timeout_s} s: "
                        "only one set of hosts exists at a time. Fix: wait for it, or end it."
                    ) from None
                time.sleep(0.5)
        self._lock = fh

    # ------------------------------------------------------------------ processes
    def start(self, host: Host, cmd: Sequence[str], **popen_kwargs: Any) -> processes.Job:
        """Start ``cmd`` inside ``host`` (a :class:`processes.Job`: its whole tree is killed when it is
        closed)."""
        return processes.start(host.argv(cmd), **popen_kwargs)

    def run(
        self, host: Host, cmd: Sequence[str], *, timeout: float, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """:func:`processes.run` of ``cmd`` inside ``host``."""
        return processes.run(host.argv(cmd), timeout=timeout, **kwargs)

    # ------------------------------------------------------------------ links
    def cut(self, host: Host) -> None:
        """Cut ``host``'s link: its packets to and from every other host are dropped until :meth:`restore`."""
        _ip("link", "set", host.veth, "down")

    def restore(self, host: Host) -> None:
        """Bring ``host``'s link back (after :meth:`cut`)."""
        _ip("link", "set", host.veth, "up")

    def cut_for(self, host: Host, seconds: float) -> threading.Thread:
        """Cut ``host``'s link now and restore it ``seconds`` later (in a background thread, returned: join it
        to wait for the restore). The link also comes back at teardown."""
        self.cut(host)

        def restore_later() -> None:
            time.sleep(seconds)
            with contextlib.suppress(RuntimeError):  # torn down meanwhile
                self.restore(host)

        thread = threading.Thread(target=restore_later, name=f"restore-{host.name}", daemon=True)
        thread.start()
        self._timers.append(thread)
        return thread

    def shape(self, host: Host, rate_mbit: float) -> None:
        """Limit ``host``'s link to ``rate_mbit`` Mbit/s in each direction
        (``tbf`` on both ends of its veth pair: the bridge side shapes what the host receives, ``eth0`` inside
        it what it sends)."""
        if rate_mbit <= 0:
            raise ValueError(f"shape(rate_mbit={rate_mbit}): a rate in Mbit/s > 0. Fix: e.g. 10.")
        rate_bytes = rate_mbit * 1e6 / 8
        # the bucket must hold at least one timer tick of traffic (HZ >= 100) and a few full-size packets; the
        # queue holds 100 ms at the rate (more is dropped, as a real bottleneck's buffer does)
        burst = max(16 * 1024, int(rate_bytes / 100))
        args = ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
        _tc("qdisc", "replace", "dev", host.veth, *args)
        _tc("qdisc", "replace", "dev", IFNAME, *args, netns=host.name)

    def unshape(self, host: Host) -> None:
        """Remove :meth:`shape`'s limit."""
        for argv, netns in (([host.veth], None), ([IFNAME], host.name)):
            with contextlib.suppress(RuntimeError):
                _tc("qdisc", "del", "dev", *argv, "root", netns=netns)

    def tx_bytes(self, host: Host) -> int:
        """Bytes ``host`` has sent over its link (``eth0``'s counter inside it; loopback traffic not
        counted)."""
        proc = processes.run(host.argv(["cat", f"/sys/class/net/{IFNAME}/statistics/tx_bytes"]), timeout=30)
        return int(proc.stdout.strip())


def cleanup() -> None:
    """Remove every namespace, veth end and bridge with this module's names (an earlier run's leftovers
    too)."""
    listed = processes.run(["ip", "-o", "netns", "list"], timeout=30).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0].strip()
        if name.startswith(PREFIX):
            _ip("netns", "delete", name, check=False)
    for i in range(MAX_HOSTS):
        if Path(f"/sys/class/net/{PREFIX}v{i}").exists():
            _ip("link", "del", f"{PREFIX}v{i}", check=False)
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        _ip("link", "del", BRIDGE, check=False)
