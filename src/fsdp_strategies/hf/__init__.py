"""Hugging Face interop: pretrained ``transformers`` checkpoints into shards, and trained models back out.

* :mod:`~fsdp_strategies.hf.materialize` -- a meta-built module made real, HF models through their own init
  (so non-persistent buffers such as rotary tables are computed, not left as uninitialised memory).
* :mod:`~fsdp_strategies.hf.pretrained` -- a ``save_pretrained`` folder (safetensors) read into a sharded
  model: every rank reads only its own shards (DCP's ``HuggingFaceStorageReader``).
* :mod:`~fsdp_strategies.hf.from_pretrained` -- ``from_pretrained`` called in ``configure_model`` under the
  meta device becomes a meta build plus the sharded load above.
* :mod:`~fsdp_strategies.hf.metadata` -- what a checkpoint records about the HF models a module holds.
* :mod:`~fsdp_strategies.hf.export` -- a checkpoint as a ``save_pretrained`` folder (``--format hf``).

``transformers`` and ``safetensors`` are imported only when a module actually holds an HF model.
"""
