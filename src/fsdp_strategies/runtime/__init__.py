"""What wraps every strategy's training step: preemption, a clean interpreter exit, the resume position.

* :mod:`~fsdp_strategies.runtime.preemption` -- SIGTERM: every rank stops at the same step, optionally saving.
* :mod:`~fsdp_strategies.runtime.clean_exit` -- gloo's worker threads parked before the interpreter finalizes.
* :mod:`~fsdp_strategies.runtime.resume_position` -- a mid-epoch resume skips the batches already trained.
* :mod:`~fsdp_strategies.runtime.data_position` -- the position in global samples, re-split at another width.
"""
