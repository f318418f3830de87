"""Tensor parallelism from a plan: the model's own (Hugging Face ``_tp_plan``) or one given as module globs.

A plan maps module-name globs to styles. ``"auto"`` reads the plan a model carries: a Hugging Face
``PreTrainedModel`` has ``_tp_plan`` (its config's ``base_model_tp_plan`` prefixed for where the base model
sits, plus the head's entry), e.g. for Llama, Qwen2, Mistral: ``q/k/v/gate/up_proj`` column-wise,
``o/down_proj`` row-wise, the embedding vocab-parallel, the LM head column-wise with its output gathered.
The outermost submodule with such a plan is used, its globs prefixed by where it sits in the
LightningModule. A dict plan names the styles itself:

=========================  =========================================================================
style                      torch ``ParallelStyle``
=========================  =========================================================================
``colwise``                ``ColwiseParallel()``: weight rows sharded, output sharded on the last dim
``rowwise``                ``RowwiseParallel()``: weight columns sharded, output all-reduced
``colwise_gather_output``  ``ColwiseParallel(output_layouts=Replicate())`` (an LM head: full logits)
``embedding_rowwise``      ``RowwiseParallel(input_layouts=Replicate())`` (a vocab-parallel embedding)
=========================  =========================================================================

Applied with ``torch.distributed.tensor.parallel.parallelize_module`` on the mesh's ``tensor_parallel`` dim,
before ``fully_shard`` shards everything on the data-parallel dims
(:func:`fsdp_strategies.parallel.parallelize`). Parameters the plan leaves alone (norms, biases of other
modules) stay whole on every TP rank, and FSDP2 shards them on the data-parallel dims only. That is right for
modules whose input is the same on every TP rank (the embedding's or a row-wise layer's output: the norms of
Llama, Qwen2, Mistral); a per-head norm after a column-wise projection (Qwen3's ``q_norm``, a
``replicated_with_grad_allreduce`` entry in HF plans) sees other heads on each rank, so plans with that style
are refused, as are MoE and packed styles. Gradient clipping then sees DTensors on two meshes;
:func:`clip_grad_norm` computes the norm per mesh and combines them.

Checked before anything is applied: every glob matches a module; the planned modules are ``nn.Linear`` /
``nn.Embedding`` whose sharded dimension divides by the degree; for a model with a config, attention heads and
key/value heads divide by the degree (fewer KV heads than TP ranks is refused: replicating KV heads is not
implemented).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fsdp_strategies._options import OptionError, listing
from fsdp_strategies.parallel.ties import retie, tied_slots

__all__ = ["STYLES", "TensorParallelPlanError", "apply_tensor_parallel", "clip_grad_norm", "find_model_plan",
           "resolve_plan"]

STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise")


class TensorParallelPlanError(OptionError):
    """A tensor-parallel plan that cannot be applied to this model (named modules, styles, sizes): an option
    error (``tp_plan``, ``tensor_parallel_degree``)."""


def _style(name: str, style: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    raise TensorParallelPlanError(_unsupported({name: style}))


def _unsupported(entries: Mapping[str, str]) -> str:
    listed = listing((f"{style!r} for {name!r}" for name, style in entries.items()), 6, sep="; ")
    return (f"tp_plan: styles this package does not apply: {listed} (supported: {', '.join(STYLES)}; MoE "
            "experts, packed projections and per-head norms that "
            "need a gradient all-reduce are not). Fix: pass a "
            "dict plan with the supported styles for the dense attention and MLP projections, or "
            "tensor_parallel_degree: 1. Leave a module out of "
            "the plan only if its input is the same on every "
            "tensor-parallel rank (after a rowwise layer or the embedding): a per-head norm after a colwise "
            "projection sees other heads on each rank, and its weights would drift apart.")


def find_model_plan(model: nn.Module) -> dict[str, str] | None:
    """The outermost submodule's own plan (HF ``_tp_plan``), globs prefixed by its path; None if none has
    one."""
    for path, sub in model.named_modules():
        plan = getattr(sub, "_tp_plan", None)
        if isinstance(plan, Mapping) and plan:
            prefix = f"{path}." if path else ""
            return {prefix + glob: str(style) for glob, style in plan.items()}
    return None


def resolve_plan(model: nn.Module, tp_plan: str | Mapping[str, str]) -> dict[str, str]:
    """``"auto"`` -> the model's own plan (clear error when it has none); a dict is returned as given."""
    if isinstance(tp_plan, str):
        if tp_plan != "auto":
            raise TensorParallelPlanError(
                f"tp_plan={tp_plan!r}: give 'auto' or a dict of module glob -> style. "
                f"Fix: tp_plan: auto, or e.g. {{'layers.*.attn.wq': 'colwise'}}."
            )
        plan = find_model_plan(model)
        if plan is None:
            kinds = sorted({type(m).__name__ for m in model.children()}) or [type(model).__name__]
            raise TensorParallelPlanError(
                f"tp_plan='auto': the model ({type(model).__name__}, holding {', '.join(kinds)}) carries no "
                "tensor-parallel plan (Hugging Face models have one in `_tp_plan` when their config defines "
                "`base_model_tp_plan`; GPT-2, BERT and T5 do not). "
                "Fix: pass tp_plan as a dict of module glob -> "
                f"style ({', '.join(STYLES)}), e.g. {{'model.layers.*.attn.wq': 'colwise', "
                "'model.layers.*.attn.wo': 'rowwise'}."
            )
        return plan
    return {str(k): str(v) for k, v in tp_plan.items()}


def _expand(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    names = [name for name, _ in model.named_modules() if name]
    exact: dict[str, str] = {}
    unmatched = []
    for glob, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if not hits:
            unmatched.append(glob)
        for name in hits:
            exact[name] = style
    params = [name for name, _ in model.named_parameters()]
    for glob in unmatched:
        if any(fnmatch.fnmatchcase(p, glob) for p in params):
            raise TensorParallelPlanError(
                f"tp_plan: {glob!r} names parameters, not modules. Fix: name the module "
                "that holds them (its Linear or Embedding), e.g. drop the '.weight'."
            )
    if unmatched:
        sample = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
        raise TensorParallelPlanError(f"tp_plan: {unmatched} match no module "
                                      f"of the model (its modules: {sample}). "
                                      "Fix: write the globs against the LightningModule's module names, "
                                      "e.g. 'model.layers.*.self_attn.q_proj'.")
    return exact


def _configs(model: nn.Module) -> Iterable[Any]:
    for sub in model.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "num_attention_heads"):
            yield config


def _check_sizes(model: nn.Module, exact: Mapping[str, str], degree: int) -> None:
    problems = []
    for name, style in exact.items():
        module = model.get_submodule(name)
        if style in ("colwise", "colwise_gather_output", "rowwise") and not isinstance(module, nn.Linear):
            problems.append(f"{name} is a {type(module).__name__}, not an nn.Linear ({style})")
            continue
        if style == "embedding_rowwise" and not isinstance(module, nn.Embedding):
            problems.append(f"{name} is a {type(module).__name__}, not an nn.Embedding ({style})")
            continue
        size = {"rowwise": lambda m: m.in_features}.get(style, lambda m: m.weight.shape[0])(module)
        if size % degree:
            problems.append(f"{name} ({style}) has {size} rows/columns to split, not divisible by {degree}")
    for config in _configs(model):
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        if heads % degree or kv % degree:
            problems.append(
                f"{type(config).__name__}: num_attention_heads={heads}, num_key_value_heads={kv}: each "
                f"must divide by tensor_parallel_degree={degree} (KV heads are not replicated)"
            )
    if problems:
        raise TensorParallelPlanError("tensor parallelism cannot split this model: " + "; ".join(problems) +
                                      ". Fix: choose a tensor_parallel_degree "
                                      "that divides these sizes (often 2 or "
                                      "the number of KV heads), or leave those modules out of tp_plan.")


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether a parameter of ``model`` is a DTensor already (a ``configure_model`` applied its own plan)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, tp_plan: str | Mapping[str, str]) -> dict[str, str]:
    """Check, then apply ``tp_plan`` to ``model`` on the 1-D ``tp_mesh``; returns the module -> style
    applied."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = resolve_plan(model, tp_plan)
    unsupported = {glob: style for glob, style in plan.items() if style not in STYLES}
    if unsupported:  # before the globs: an MoE plan names parameters, and the style is the real problem
        raise TensorParallelPlanError(_unsupported(unsupported))
    exact = _expand(model, plan)
    styles = {name: _style(name, style) for name, style in exact.items()}
    _check_sizes(model, exact, tp_mesh.size())
    ties = tied_slots(model)
    parallelize_module(model, tp_mesh, styles)
    retie(ties)
    return exact


@torch.no_grad()
def clip_grad_norm(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients that are DTensors on different meshes (and plain
    tensors).

    The norm is computed per mesh with torch's ``get_total_norm`` (made full with ``full_tensor``), the
    per-mesh norms combined with ``vector_norm``, and the gradients scaled with ``clip_grads_with_norm_``.
    Returns the total norm (a plain tensor)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else p.grad.device
        groups.setdefault(key, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
    return total
