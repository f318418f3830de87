"""FLOP accounting: what a training step computes and what the hardware could compute.

* :mod:`~fsdp_strategies.flops.counter` -- FLOPs of one real training step (``FlopCounterMode`` on the
  step itself, recomputation counted separately) and the analytic transformer formula.
* :mod:`~fsdp_strategies.flops.peaks` -- dense peak FLOPS per accelerator and dtype, by device name.

The ``MFUMonitor`` callback is a thin Lightning layer over these; benchmarks use them directly.
"""

from fsdp_strategies.flops.counter import (
    StepFlopCounter,
    StepFlops,
    analytic_transformer_flops,
    count_step_flops,
)

__all__ = ["StepFlopCounter", "StepFlops", "analytic_transformer_flops", "count_step_flops"]
