"""Where this process stands in ``torch.distributed``: one answer to "is this distributed?" for the package.

Every check in the package asks this module instead of repeating ``dist.is_available() and
dist.is_initialized()`` (and the world-size test that usually follows). Imports nothing from the package.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["in_process_group", "is_multi_rank", "rank_and_world"]


def in_process_group() -> bool:
    """Whether a default process group exists (``torch.distributed`` is built and initialised)."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) in the default process group; ``(0, 1)`` outside one."""
    if not in_process_group():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def is_multi_rank() -> bool:
    """Whether a default process group with at least two ranks exists: a collective would reach a peer."""
    return rank_and_world()[1] > 1
