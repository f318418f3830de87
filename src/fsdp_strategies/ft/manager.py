"""A replica group's link to the others: the lighthouse check, the ``torchft.Manager``, the counted
all-reduce.

Every replica group of ``ft_hsdp`` is its own ``torch.distributed`` world; what crosses groups goes
through one ``torchft.Manager`` per rank (rank ``r`` of every group meets rank ``r`` of the others in the
manager's process group). This module builds that manager and nothing else:

* :func:`check_lighthouse` -- one TCP connection to the lighthouse while the options are validated, so a
  wrong address fails with :class:`LighthouseUnreachableError` and the way to start one, not with a quorum
  timeout minutes later.
* :func:`create_manager` -- the ``torchft.Manager`` with its process group (NCCL on CUDA, else gloo) and
  checkpoint transport (``"pg"``: send/recv over that process group; ``"http"``: torchft's HTTP server),
  given the callbacks that capture and apply the heal state.
* :func:`exit_now` -- leave the job at once (eviction): the manager stops without waiting on peers, and
  the process exits without Python's teardown (which would wait on collectives of a group being left).
* :class:`CountedManager` -- the manager as the strategy's cross-group code sees it: every ``allreduce``
  (the FSDP hook's gradient reductions, the outer sync's pseudo-gradients, the switch vote) is counted in
  ``ft_stats`` (``cross_group_allreduces``, ``cross_group_bytes``: this rank's reduced tensors). A
  test's slow link wraps the underlying manager's ``allreduce`` (``fsdp_strategies.testing.SlowLinkInjector``)
  and so sits under every one of these calls.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple, NoReturn
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions, ReduceOp

from fsdp_strategies.ft.protocol import LIGHTHOUSE_ENV, torchft_runtime_env

__all__ = ["HOW_TO_START", "CountedManager", "LighthouseUnreachableError", "QuorumView", "check_lighthouse",
           "create_manager", "exit_now", "lighthouse_host_port", "release_manager"]

#: the end of every error about a missing or unreachable lighthouse
HOW_TO_START = (
    "Start one with `torchft_lighthouse --min_replicas 1 --bind [::]:29510` (then export "
    "TORCHFT_LIGHTHOUSE=http://<host>:29510), or launch the job through `fsdp-strategies-ft`, which "
    "starts a lighthouse and the replica groups for you."
)


class LighthouseUnreachableError(ConnectionError):
    """The torchft lighthouse is not listening where the strategy was told to find it."""


def lighthouse_host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``http://host:port`` (the scheme may be left out); ``ValueError`` with a fix
    otherwise."""
    parsed = urlparse(address if "://" in address else f"http://{address}")
    if not parsed.hostname or not parsed.port:
        raise ValueError(
            f"lighthouse_addr={address!r} is not an address. Fix: give 'http://<host>:<port>' "
            f"(e.g. http://localhost:29510) or set {LIGHTHOUSE_ENV}. {HOW_TO_START}"
        )
    return parsed.hostname, parsed.port


def check_lighthouse(address: str, timeout_s: float) -> None:
    """Raise :class:`LighthouseUnreachableError` unless something accepts a TCP connection at ``address``."""
    host, port = lighthouse_host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as err:
        raise LighthouseUnreachableError(
            f"ft_hsdp: no torchft lighthouse answers at {address} (from lighthouse_addr / "
            f"{LIGHTHOUSE_ENV}; {type(err).__name__}: {err}). {HOW_TO_START}"
        ) from None


def create_manager(*, device: torch.device, rank: int, world_size: int, replica_group_id: int,
                   lighthouse_addr: str, min_replica_size: int, checkpoint_transport: str, timeout_s: float,
                   quorum_timeout_s: float,
                   connect_timeout_s: float, init_sync: bool, max_retries: int | None, hostname: str | None,
                   use_async_quorum: bool, state_dict: Callable[[], dict[str, Any]],
                   load_state_dict: Callable[[dict[str, Any]], None]) -> tuple[Any, Any]:
    """This rank's ``torchft.Manager`` (named ``ft_hsdp_<replica_group_id>``; torchft appends a uuid) and the
    cross-group process group it reconfigures at every quorum change (torchft's ``ProcessGroupGloo`` /
    ``ProcessGroupNCCL``, for :meth:`CountedManager.gradient_allreduce`).

    ``state_dict`` is called on torchft's quorum thread when a peer heals from this group, ``load_state_dict``
    on the main thread (inside ``should_commit``, or ``start_quorum`` with the synchronous quorum) when this
    group heals. The rendezvous store is the group's own (``MASTER_ADDR``/``MASTER_PORT`` of its job).
    torchft is imported and the manager's runtimes start under ``torchft_runtime_env``
    (:mod:`fsdp_strategies.ft.protocol`: torchft's log level and threads).
    """
    with torchft_runtime_env():  # torchft imported, its runtimes started: its log level and threads
        from torchft.checkpointing import HTTPTransport
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        if dist.is_initialized():  # a manager of an earlier Trainer run (fit, then validate) is released
            dist.barrier()  # first, by rank 0 (release_manager), before any rank reads the address
        timeout = timedelta(seconds=timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        if checkpoint_transport == "pg":
            transport: Any = PGTransport(pg, timeout=timeout, device=device)
        else:
            transport = HTTPTransport(timeout=timeout, num_chunks=0)
        kwargs: dict[str, Any] = {"hostname": hostname} if hostname else {}
        manager = Manager(
            pg=pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=min_replica_size,
            use_async_quorum=use_async_quorum,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timedelta(seconds=connect_timeout_s),
            rank=rank,
            world_size=world_size,
            store_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=lighthouse_addr,
            replica_id=f"ft_hsdp_{replica_group_id}",
            checkpoint_transport=transport,
            init_sync=init_sync,
            max_retries=max_retries,
            **kwargs,
        )
        return manager, pg


def release_manager(manager: Any, rank: int) -> None:
    """Shut ``manager`` down at the end of a Trainer run; rank 0 also removes the address it published in the
    group's store (torchft's ``MANAGER_ADDR_KEY`` / ``REPLICA_ID_KEY``), so that the manager of a later run in
    the same processes (``trainer.validate`` after ``fit``) is not looked up at the old, closed address."""
    manager.shutdown(wait=False)
    if rank != 0:
        return
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    try:
        store = dist.TCPStore(host_name=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                              port=int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=10))
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)
    except (KeyError, RuntimeError, ValueError):  # no store any more (the job is ending): nothing to look up
        pass


def exit_now(manager: Any, code: int) -> NoReturn:
    """Shut ``manager`` (if any) down without waiting on peers, flush stdout/stderr, and exit with ``code``
    now."""
    if manager is not None:
        try:
            manager.shutdown(wait=False)
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class QuorumView(NamedTuple):
    """What a step's cross-group all-reduces need of its quorum, read once after waiting for it (each of
    torchft's ``num_participants()`` / ``wait_quorum()`` calls opens a profiler range and takes the quorum
    future's lock: read per all-reduce, that was a third of the step's all-reduce CPU on the main thread)."""

    #: groups in the quorum (torchft's ``num_participants()``: ``AVG`` divides by it)
    participants: int
    #: this group's gradients count (torchft's ``is_participating()``; ``False`` while it heals)
    participating: bool

    @classmethod
    def of(cls, manager: Any) -> QuorumView:
        """The manager's quorum, waited for."""
        manager.wait_quorum()
        return cls(int(manager.num_participants()), bool(manager.is_participating()))


class CountedManager:
    """The manager with every ``allreduce`` counted in ``stats`` (calls and bytes); everything else passes
    through.

    torchft's ``DiLoCo`` is given this object as its manager, so its pseudo-gradient all-reduces are counted
    like the FSDP hook's. Errors of an all-reduce (a peer died) are recorded by the manager and make
    ``should_commit()`` return ``False``; they are not raised here.

    ``pg``: the manager's cross-group process group (from :func:`create_manager`), for
    :meth:`gradient_allreduce`; ``None``: that goes through ``Manager.allreduce``.
    """

    def __init__(self, manager: Any, stats: dict[str, float], pg: Any = None) -> None:
        self._manager = manager
        self._stats = stats
        self._pg = pg
        stats.setdefault("cross_group_allreduces", 0)
        stats.setdefault("cross_group_bytes", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def _count(self, tensor: torch.Tensor) -> None:
        self._stats["cross_group_allreduces"] += 1
        self._stats["cross_group_bytes"] += tensor.numel() * tensor.element_size()

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: ReduceOp = ReduceOp.AVG
    ) -> Any:
        self._count(tensor)
        return self._manager.allreduce(tensor, should_quantize=should_quantize, reduce_op=reduce_op)

    def gradient_allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp = ReduceOp.AVG,
                           quorum: QuorumView | None = None) -> Any:
        """Start the cross-group all-reduce of a gradient (in place); ``.wait()`` on the result ends it.

        What ``Manager.allreduce`` does, in the same order, with the same process group and reduction: nothing
        once the step has errored; the quorum waited for; zeros contributed while this group heals (not
        participating); a sum, divided by the participating groups for ``AVG``; an error (a peer died, the
        group's timeout) recorded with ``report_error`` -- ``should_commit()`` then returns ``False`` -- not
        raised. Without torchft's Python future chain around each call (a profiler range per function, a
        timeout registered with its event-loop thread, two ``then`` callbacks), which the rank's main thread
        paid once per FSDP unit and step (``benchmarks/suites/ft_overhead.py`` measures the difference). The
        timeout is the process group's own (created with the manager's ``timeout``).

        ``quorum``: the step's quorum, already waited for (:class:`QuorumView`, read once per step by the
        caller); ``None``: waited for and read here.
        """
        self._count(tensor)
        manager = self._manager
        if self._pg is None:
            return manager.allreduce(tensor, reduce_op=reduce_op)
        if manager.errored():
            return _GradientWork(manager, None, tensor, None)
        if quorum is None:
            quorum = QuorumView.of(manager)
        if not quorum.participating:
            tensor.zero_()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM if reduce_op == ReduceOp.AVG else reduce_op
        try:
            work = self._pg.allreduce([tensor], opts)
        except Exception as err:  # a process group already broken
            manager.report_error(err)
            return _GradientWork(manager, None, tensor, None)
        divide_by = quorum.participants if reduce_op == ReduceOp.AVG else None
        return _GradientWork(manager, work, tensor, divide_by)


class _GradientWork:
    """One started :meth:`CountedManager.gradient_allreduce`: :meth:`wait` ends it (``True``), or records its
    error with the manager (``False``: the step will not commit)."""

    def __init__(self, manager: Any, work: Any, tensor: torch.Tensor, divide_by: int | None) -> None:
        self._manager, self._work, self._tensor, self._divide_by = manager, work, tensor, divide_by

    def wait(self) -> bool:
        if self._work is None:
            return True
        work, self._work = self._work, None
        try:
            work.wait()
        except Exception as err:  # a peer died or timed out: the gradient is garbage, the step discarded
            self._manager.report_error(err)
            return False
        if self._divide_by is not None:
            self._tensor /= self._divide_by  # torchft's AVG: the sum over the participating groups, divided
        return True
