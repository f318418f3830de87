"""Callbacks for an unmodified Lightning project."""

from fsdp_strategies.callbacks.activation_checkpointing import ActivationCheckpointing
from fsdp_strategies.callbacks.garbage_collection import GarbageCollection
from fsdp_strategies.callbacks.hang_watchdog import HangWatchdog
from fsdp_strategies.callbacks.mfu import MFUMonitor
from fsdp_strategies.callbacks.nonfinite_guard import NonFiniteGuard
from fsdp_strategies.callbacks.straggler import StragglerDetector

__all__: list[str] = ["ActivationCheckpointing", "GarbageCollection", "HangWatchdog", "MFUMonitor",
                      "NonFiniteGuard", "StragglerDetector"]
