"""The precision plugin of ``fsdp2`` / ``hsdp`` / ``ft_hsdp`` under ``bf16-mixed``.

FSDP2's ``MixedPrecisionPolicy`` casts the parameters; this plugin adds autocast for what the policy does not
reach (see the class). It is a Lightning ``Precision`` so that the Trainer's connectors handle it like any
other plugin; the strategy installs it when the Trainer's precision flag is ``bf16-mixed``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

__all__ = ["ShardedMixedPrecision"]


class ShardedMixedPrecision(Precision):
    """``bf16-mixed`` under FSDP2: the ``MixedPrecisionPolicy`` casts parameters, autocast casts the rest.

    The policy casts parameters only. A model that adds an fp32 buffer or a plain fp32 tensor to
    bf16 activations (a positional-encoding table, an fp32 island) promotes them to fp32, and the
    next bf16 matmul fails ("expected m1 and m2 to have the same dtype"). Lightning's ``ddp``
    trains such models because it runs autocast; so does this plugin (``autocast=True``), on top
    of the policy. Parameters are bf16 already, so autocast's casts of them are no-ops; only
    activations that fell back to fp32 are cast. ``autocast=False`` runs the policy alone.
    """

    def __init__(self, precision: str, autocast: bool = True) -> None:
        super().__init__()
        self.precision = precision  # type: ignore[assignment]
        self.autocast = autocast
        self.device_type = "cpu"  # set by the strategy once its root device is known

    @contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        if not self.autocast:
            yield
            return
        with torch.autocast(self.device_type, dtype=torch.bfloat16, cache_enabled=False):
            yield
