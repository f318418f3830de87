"""The supervisor's side of fault tolerance: what runs in the ``fsdp-strategies-ft`` launcher, never in a
training process.

* :mod:`~fsdp_strategies.ft.launch.launcher` -- a lighthouse plus N replica groups on one machine, restarted
  on failure, with fault injection (``fsdp-strategies-ft`` / ``python -m fsdp_strategies.ft``);
* :mod:`~fsdp_strategies.ft.launch.options` -- its options, declared once (argparse is derived);
* :mod:`~fsdp_strategies.ft.launch.group_start` -- one group's start (a process per group, or forked by
  :mod:`~fsdp_strategies.ft.launch.forkserver` with its imports done);
* :mod:`~fsdp_strategies.ft.launch.group_exit` -- why a group stopped (finished, left, preempted, unfixable,
  failed) and its last error;
* :mod:`~fsdp_strategies.ft.launch.process_tree` -- a whole group's processes, for signals;
* :mod:`~fsdp_strategies.ft.launch.handover` -- a group restarted with no live peer ahead resumes from the
  newest checkpoint (also run by ``examples/slurm/ft_hsdp.sbatch``).

The contract between this side and the training side (environment variables, exit codes, the events file) is
:mod:`fsdp_strategies.ft.protocol`; a training module never imports this package
(``tests/test_layout.py`` checks it).
"""
