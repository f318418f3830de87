"""Everything about checkpoint files on disk; no Lightning strategy logic.

* :mod:`~fsdp_strategies.checkpoint.integrity` -- checksums (a folder's manifest, a file's embedded digest);
  imports nothing from the package.
* :mod:`~fsdp_strategies.checkpoint.safe_load` -- loading without running code from the file.
* :mod:`~fsdp_strategies.checkpoint.location` -- local or mounted paths only: a URL is an error naming it.
* :mod:`~fsdp_strategies.checkpoint.atomic` -- the atomic commit (``<name>.tmp`` -> ``<name>``) and the save
  steps both writers share.
* :mod:`~fsdp_strategies.checkpoint.verify` -- verification before a resume (every rank) and the
  ``fsdp-strategies-verify`` command.
* :mod:`~fsdp_strategies.checkpoint.load_into_fsdp` -- a sharded folder or a full file into an FSDP2 model.
* :mod:`~fsdp_strategies.checkpoint.async_writer` -- the background writer, committing through the same code.
* :mod:`~fsdp_strategies.checkpoint.export` -- one plain ``state_dict`` file
  (``fsdp-strategies-export --format torch``; the command is :mod:`fsdp_strategies.hf.export`).
"""
