"""``from_pretrained`` in ``configure_model`` under the meta device: a meta build now, a sharded load later.

Lightning tells users to build large models in ``configure_model``; the sharded strategies run it under
``torch.device("meta")`` so that nothing is allocated before sharding. ``transformers`` refuses
``from_pretrained`` there ("You are using `from_pretrained` with a meta device context manager"), and loading
the full model on every rank is what sharding exists to avoid. While :func:`defer_from_pretrained` is active,
``PreTrainedModel.from_pretrained(folder, ...)`` called under the meta device instead

1. reads the folder's config (``config.json``, with the call's config overrides) and generation config,
2. builds the model on the meta device (as ``transformers`` would, with the call's ``dtype`` and
   ``attn_implementation``) and puts it in eval mode, as ``from_pretrained`` does,
3. records a :class:`~fsdp_strategies.hf.pretrained.PretrainedSource` for it: after sharding, the strategy
   reads the weights straight into the shards (:func:`~fsdp_strategies.hf.pretrained.load_pretrained`).

Keys behave as under ``from_pretrained``: parameters the folder lacks (a new head) keep their fresh
initialisation with a warning naming them. Options that place or quantise weights themselves (``device_map``,
``quantization_config``, ``tp_plan``...) conflict with the strategy's sharding and are refused with the fix.
Outside the meta device (``meta_init=False``), ``from_pretrained`` runs unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from fsdp_strategies.hf.pretrained import PretrainedSource, check_folder

__all__ = ["defer_from_pretrained"]

# from_pretrained options that change nothing for a local folder read into shards
_HARMLESS = {"cache_dir", "force_download", "local_files_only", "token", "revision", "proxies",
             "weights_only",
             "low_cpu_mem_usage", "trust_remote_code", "_from_auto", "_from_pipeline", "disable_mmap",
             "tqdm_class", "_commit_hash"}
# options that do their own placement, quantisation or key handling: not compatible with loading into shards
_REFUSED = {"device_map": "the strategy places every shard", "max_memory": "the strategy places every shard",
            "offload_folder": "use the strategy's cpu_offload",
            "offload_buffers": "use the strategy's cpu_offload",
            "quantization_config": "quantised loading is not supported",
            "tp_plan": "not a tensor-parallel strategy",
            "tp_size": "not a tensor-parallel strategy", "device_mesh": "the strategy builds the mesh",
            "distributed_config": "the strategy builds the mesh",
            "gguf_file": "only safetensors folders are read",
            "state_dict": "pass the weights as a folder", "variant": "only the default weight files are read",
            "key_mapping": "keys are matched as transformers saves them", "use_kernels": "not supported here",
            "adapter_kwargs": "load adapters after training starts", "adapter_name": "load adapters later",
            "ignore_mismatched_sizes": "shapes must match", "output_loading_info": "not available here",
            "use_safetensors": "only safetensors are read"}


def _refuse(cls_name: str, key: str, value: Any) -> None:
    # the Auto classes pass most of these on with their defaults: only a value that asks for something counts
    if value is None or value is False or value == {} or (key == "use_safetensors" and value is True) or (
            key == "adapter_name" and value == "default"):
        return
    raise ValueError(
        f"{cls_name}.from_pretrained({key}={value!r}) under the "
        f"sharded strategy's meta_init: {_REFUSED[key]}. The "
        "strategy builds the model on the meta device and "
        f"reads the weights into its shards. Fix: drop {key}=, "
        "or build the model outside configure_model / with meta_init: false."
    )


def _meta_build(cls: type, path: Any, model_args: tuple[Any, ...], kwargs: dict[str, Any],
                sources: list[PretrainedSource]) -> Any:
    name = cls.__name__
    if model_args:
        raise ValueError(
            f"{name}.from_pretrained(path, *model_args) under the sharded strategy's meta_init: "
            "positional model arguments are not supported. Fix: pass them as keyword config overrides."
        )
    subfolder = kwargs.pop("subfolder", "") or ""
    folder = check_folder(Path(str(path)) / subfolder if subfolder else path, f"{name}.from_pretrained")
    for key in list(kwargs):
        if key in _REFUSED:
            _refuse(name, key, kwargs.pop(key))
        elif key in _HARMLESS:
            kwargs.pop(key)
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    build: dict[str, Any] = {}
    for key in ("attn_implementation", "experts_implementation"):
        if key in kwargs:
            build[key] = kwargs.pop(key)
    generation_config = kwargs.pop("generation_config", None)
    config = kwargs.pop("config", None)
    if config is None or isinstance(config, (str, Path)):
        config, unused = cls.config_class.from_pretrained(
            config or folder, return_unused_kwargs=True, **kwargs
        )
    else:
        unused = {}
        for key, value in kwargs.items():
            if hasattr(config, key):
                setattr(config, key, value)
            else:
                unused[key] = value
    if unused:
        raise ValueError(
            f"{name}.from_pretrained: {sorted(unused)} are neither config fields nor options this "
            "strategy knows. Fix: drop them, or set them on the config."
        )
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is not None:
        build["dtype"] = dtype
    model = cls._from_config(config, **build)
    model.eval()
    if generation_config is not None:
        model.generation_config = generation_config
    elif (folder / "generation_config.json").is_file() and getattr(
        model, "generation_config", None
    ) is not None:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    origin = f"{name}.from_pretrained({str(path)!r})"
    sources.append(PretrainedSource(path=str(folder), strict=False, origin=origin, target=model))
    rank_zero_info(
        f"{origin} under meta_init: built on the meta device; its weights are read into the shards "
        "after sharding (each rank reads only its own shards)."
    )
    return model


@contextmanager
def defer_from_pretrained(sources: list[PretrainedSource]) -> Generator[None, None, None]:
    """While active, ``from_pretrained`` under the meta device builds on meta and appends to ``sources``.

    Does nothing when ``transformers`` has not been imported (a module that calls ``from_pretrained`` imports
    it)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        yield
        return
    base = transformers.PreTrainedModel  # loads the modelling code if the module has not yet (~0.1 s)
    original = base.__dict__["from_pretrained"]

    def from_pretrained(
        cls: type, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any
    ) -> Any:
        if torch.get_default_device().type != "meta":
            return original.__func__(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        return _meta_build(cls, pretrained_model_name_or_path, model_args, kwargs, sources)

    from_pretrained.__doc__ = original.__func__.__doc__
    base.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        base.from_pretrained = original
