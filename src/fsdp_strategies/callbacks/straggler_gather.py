"""The exchange of :class:`~fsdp_strategies.callbacks.StragglerDetector`'s windows: one fixed-size
``all_gather`` per window, started without waiting and read one step later.

Why asynchronous: it overlaps the next step, so no rank blocks on the others here. In synchronous training the
next step's gradient all-reduce would wait for the slowest rank anyway, and with local SGD a rank should not
be held back by a collective of the detector. Every rank reads the same gathered rows, so every rank scores
and acts alike without a further collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fsdp_strategies._distributed import in_process_group

__all__ = ["WindowGather"]


class WindowGather:
    """At most one window in flight: :meth:`start` it at the end of a window, :meth:`finish` it a step later.

    ``strategy`` supplies the device for ``nccl`` (its ``root_device``); the world is the strategy's process
    group.
    """

    def __init__(self, world_size: int = 1, strategy: Any = None) -> None:
        self.world_size, self.strategy = world_size, strategy
        self._pending: tuple[Callable[[], np.ndarray], int] | None = None  # the wait and the window's step

    @property
    def pending(self) -> bool:
        """Whether a window's gather is in flight."""
        return self._pending is not None

    def start(self, local: np.ndarray, step: int) -> None:
        """Start gathering this rank's window, which ended at ``step``, without waiting."""
        assert self._pending is None, "the previous window was not finished"
        self._pending = (self._all_gather(local, step), step)

    def finish(self) -> tuple[np.ndarray, int]:
        """Wait for the window in flight: the gathered rows (one per rank) and the step the window ended
        at."""
        assert self._pending is not None
        wait, step = self._pending
        self._pending = None
        return wait(), step

    def _all_gather(self, local: np.ndarray, step: int) -> Callable[[], np.ndarray]:
        """Start the collective; the returned function waits for it."""
        if self.world_size == 1 or not in_process_group():
            return lambda: local[None, :]
        device = self.strategy.root_device if dist.get_backend() == "nccl" else torch.device("cpu")
        mine = torch.from_numpy(local).to(device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(out, mine, async_op=True)

        def wait() -> np.ndarray:
            assert work is not None and mine is not None  # keep the input alive until the gather is done
            work.wait()
            return torch.stack(out).cpu().numpy()

        return wait
