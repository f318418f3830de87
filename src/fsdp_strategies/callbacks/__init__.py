"""Callbacks for an unmodified Lightning project."""

from fsdp_strategies.callbacks.activation_checkpointing import ActivationCheckpointing
from fsdp_strategies.callbacks.straggler import StragglerDetector, StragglerInjection
from fsdp_strategies.callbacks.throughput import MFUMonitor

__all__: list[str] = ["ActivationCheckpointing", "MFUMonitor", "StragglerDetector", "StragglerInjection"]
