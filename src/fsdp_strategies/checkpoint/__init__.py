"""Everything about checkpoint files on disk; no Lightning strategy logic.

* :mod:`~fsdp_strategies.checkpoint.integrity` -- checksums (a folder's manifest, a file's embedded digest).
* :mod:`~fsdp_strategies.checkpoint.safe_load` -- loading without running code from the file.
* :mod:`~fsdp_strategies.checkpoint.atomic` -- the atomic commit (``<name>.tmp`` -> ``<name>``) and sharded/full I/O.
* :mod:`~fsdp_strategies.checkpoint.load_into_fsdp` -- a sharded folder or a full file into an FSDP2 model.
* :mod:`~fsdp_strategies.checkpoint.async_writer` -- the background writer, committing through the same code.
"""
