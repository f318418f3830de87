"""FLOPs of one training step, counted or estimated -- the calculator under
:class:`~fsdp_strategies.callbacks.MFUMonitor`.

*Model FLOPs* are the matmul/attention FLOPs the model needs for one forward and backward pass;
*hardware FLOPs* are what the device executes: model FLOPs plus recomputation (activation
checkpointing, and the attention scores that fused/flash attention kernels recompute in backward).

* :func:`count_step_flops`: ``torch.utils.flop_counter.FlopCounterMode`` around a step. Recomputation
  by a block checkpointed with :mod:`fsdp_strategies.parallel.activation_checkpointing` is booked as
  hardware-only FLOPs (it reports recomputation through :func:`~fsdp_strategies.parallel.is_recomputing`).
  SDPA kernels without a formula in PyTorch (the CPU flash kernel) get one registered here. Exact on
  meta tensors; kernels hidden from the dispatcher (``torch.compile``'d regions) are not seen.
  Under tensor parallelism an op on DTensors reaches the counter with the *global* shapes, while the
  device runs it on its local shards: every formula here is given the local tensors, so the count is
  what this device executes (a column-/row-wise Linear on TP 2: half its FLOPs per rank). Exact for
  ops whose inputs need no redistribution first (the matmuls of a TP plan).
* :func:`analytic_transformer_flops`: ``(6 N + 12 L H S) * tokens``, the usual transformer estimate.

Usable without Lightning (the benchmarks call it on plain modules).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import register_flop_formula

from fsdp_strategies import _torch_seam
from fsdp_strategies.parallel.activation_checkpointing import is_recomputing
from fsdp_strategies.parallel.ops import ATTENTION_OPS, attention_backward_name, resolve_or_none

__all__ = ["OpFlopCounter", "StepFlopCounter", "StepFlops", "analytic_transformer_flops", "count_step_flops"]

aten = torch.ops.aten


def _register_missing_sdpa_formulas() -> None:
    """PyTorch has no FLOP formula for these SDPA kernels; give them the generic SDPA one (grouped-query
    attention included on every supported torch: see ``_torch_seam.sdpa_flop_count``)."""
    forward = [
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
    ]
    for name in forward:
        packet = getattr(aten, name, None)
        if packet is not None and packet not in flop_counter.flop_registry:

            @register_flop_formula(packet)
            def _sdpa(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
                      **kwargs: Any) -> int:
                return _torch_seam.sdpa_flop_count(query_shape, key_shape, value_shape)

        backward = getattr(aten, name + "_backward", None)
        if backward is not None and backward not in flop_counter.flop_registry:

            @register_flop_formula(backward)
            def _sdpa_backward(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any,
                               *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
                return _torch_seam.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape,
                                                            value_shape)


_register_missing_sdpa_formulas()

_ATTENTION_FORWARD = tuple(p for p in map(resolve_or_none, ATTENTION_OPS) if p is not None)
_ATTENTION_BACKWARD = tuple(
    p for p in (resolve_or_none(attention_backward_name(name)) for name in ATTENTION_OPS) if p is not None
)


def _is_causal_getter(packet: Any) -> Callable[[tuple[Any, ...], dict[str, Any]], bool] | None:
    schema = _torch_seam.op_schema(packet)
    names = [a.name for a in schema.arguments]
    if "is_causal" not in names:
        return None
    index = names.index("is_causal")
    default = schema.arguments[index].default_value

    def get(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if "is_causal" in kwargs:
            return bool(kwargs["is_causal"])
        return bool(args[index]) if len(args) > index else bool(default)

    return get


def _causal_mapping() -> dict[Any, Any]:
    """SDPA formulas that count half the attention FLOPs when ``is_causal`` (the masked half is skipped)."""
    mapping: dict[Any, Any] = {}
    for packet in (*_ATTENTION_FORWARD, *_ATTENTION_BACKWARD):
        formula = flop_counter.flop_registry.get(packet)
        get_causal = _is_causal_getter(packet)
        if formula is None or get_causal is None:
            continue

        def discounted(
            *args: Any, _f: Any = formula, _c: Any = get_causal, out_val: Any = None, **kwargs: Any
        ) -> int:
            flops = _f(*args, out_val=out_val, **kwargs)
            return flops // 2 if _c(args, kwargs) else flops

        # FlopCounterMode passes tensors, not shapes
        mapping[packet] = _torch_seam.raw_tensor_formula(discounted)
    return mapping


def _local_shard(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, (list, tuple)) and any(isinstance(v, DTensor) for v in value):
        return type(value)(_local_shard(v) for v in value)
    return value


def _on_local_shards(formula: Callable[..., int]) -> Callable[..., int]:
    """A formula that counts an op on DTensors by the shards this device holds (see the module docstring)."""

    def local(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        args = tuple(_local_shard(a) for a in args)
        kwargs = {k: _local_shard(v) for k, v in kwargs.items()}
        return formula(*args, out_val=_local_shard(out_val), **kwargs)

    return _torch_seam.raw_tensor_formula(local)  # the registry's formulas take tensors and read their shapes


def _formulas(causal_discount: bool) -> dict[Any, Any]:
    mapping = dict(flop_counter.flop_registry)
    if causal_discount:
        mapping.update(_causal_mapping())
    return {packet: _on_local_shards(formula) for packet, formula in mapping.items()}


def _score_recompute_fraction(args: tuple[Any, ...]) -> float:
    """Share of an SDPA backward formula that recomputes ``q @ k^T``: d_q / (3 d_q + 2 d_v)."""
    d_q, d_v = args[1].shape[-1], args[3].shape[-1]
    return d_q / (3 * d_q + 2 * d_v)


class StepFlopCounter(_torch_seam.HookedFlopCounter):
    """FlopCounterMode that also books the recomputed share of the FLOPs (hardware-only FLOPs)."""

    def __init__(self, causal_discount: bool = False) -> None:
        super().__init__(display=False, custom_mapping=_formulas(causal_discount))
        self.recomputed = 0.0

    def on_flops(self, func_packet: Any, flops: int, args: Any) -> None:
        if is_recomputing():
            self.recomputed += flops
        elif func_packet in _ATTENTION_BACKWARD:
            self.recomputed += flops * _score_recompute_fraction(args)


class OpFlopCounter(_torch_seam.HookedFlopCounter):
    """FlopCounterMode that reports each op's FLOPs (counted on this device's shards) to
    ``on_op(packet, flops)``.

    The memory planner enters it below its own dispatch mode to learn what each op call would cost to
    recompute.
    """

    def __init__(self, on_op: Callable[[Any, int], None]) -> None:
        super().__init__(display=False, custom_mapping=_formulas(False))
        self._on_op = on_op

    def on_flops(self, func_packet: Any, flops: int, args: Any) -> None:
        self._on_op(func_packet, flops)


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one forward + backward: ``model`` (for MFU) and ``hardware`` (executed, for HFU)."""

    model: int
    hardware: int


def count_step_flops(step: Callable[[], Any], *, causal_discount: bool = False) -> StepFlops:
    """Run ``step`` (forward + backward) under FlopCounterMode; works on meta tensors too."""
    counter = StepFlopCounter(causal_discount)
    with counter:
        step()
    total = counter.get_total_flops()
    return StepFlops(model=round(total - counter.recomputed), hardware=int(total))


def analytic_transformer_flops(
    non_embedding_params: int, n_layers: int, hidden_size: int, seq_len: int, tokens: int, *,
    causal_discount: bool = False
) -> int:
    """``(6 N + 12 L H S) * tokens``: dense matmuls 2 (fwd) + 4 (bwd) FLOPs per parameter and token, plus
    attention."""
    attention = 12 * n_layers * hidden_size * seq_len
    if causal_discount:
        attention //= 2
    return (6 * non_embedding_params + attention) * tokens
