"""Operator names shared by the transforms and the FLOP counter, and how a name becomes a ``torch.ops``
object.

Ops are named by strings ``namespace.op[.overload]`` (``"aten.mm"``, ``"aten.mm.default"``) so that YAML can
list them. ``aten.mm`` means every overload of the op (an ``OpOverloadPacket``), ``aten.mm.default`` one
overload. A name this PyTorch build does not know resolves to an error naming the option it came from, or,
for the package's own default lists (which name kernels that exist only on some builds), to ``None``.

* :data:`ATTENTION_OPS` -- the fused attention kernels' forward ops. Activation checkpointing keeps their
  outputs by default (:data:`fsdp_strategies.parallel.activation_checkpointing.DEFAULT_SAVE_OPS`); the FLOP
  counter books the share of their backward ops (:func:`attention_backward_name`) that recomputes the scores.
* :data:`MATMUL_OPS` -- the ops that count as one matmul for selective checkpointing's
  ``save_every_nth_matmul``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fsdp_strategies import _torch_seam

__all__ = ["ATTENTION_OPS", "MATMUL_OPS", "attention_backward_name", "op_name", "resolve_op", "resolve_ops",
           "resolve_or_none"]

#: Fused attention forward kernels (SDPA's flash / memory-efficient / cuDNN / CPU-flash / overrideable
#: backends and the raw flash / efficient kernels under them); each is missing from some PyTorch builds.
ATTENTION_OPS: tuple[str, ...] = (
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
)

#: Ops that count as one matmul. ``aten.linear`` only reaches a checkpoint policy where it is not
#: decomposed, and then its inner mm/addmm is not seen separately: one linear = one matmul.
MATMUL_OPS: tuple[str, ...] = ("aten.mm", "aten.addmm", "aten.bmm", "aten.linear", "aten.baddbmm")


def attention_backward_name(forward: str) -> str:
    """The backward op of an attention forward op: ``..._attention`` -> ``..._attention_backward``,
    ``aten._flash_attention_forward`` -> ``aten._flash_attention_backward``."""
    return forward.removesuffix("_forward") + "_backward"


def op_name(op: Any) -> str:
    """The name of an op as it reaches a dispatch mode, without the overload: ``aten.mm.default`` ->
    ``"aten.mm"``."""
    return str(getattr(op, "overloadpacket", op))


def resolve_op(name: str, option: str) -> Any:
    """``"aten.mm"`` -> ``torch.ops.aten.mm`` (all overloads); ``"aten.mm.default"`` -> that overload.

    Raises ``ValueError`` naming ``option`` (the setting the name came from) for a malformed or unknown name.
    """
    text = name.strip()
    if text.startswith("torch.ops."):
        text = text[len("torch.ops.") :]
    parts = text.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(
            f"{option}: {name!r} is not an op name. Fix: write 'namespace.op' or 'namespace.op.overload', "
            "e.g. 'aten.mm' or '_c10d_functional.reduce_scatter_tensor.default'."
        )
    try:
        namespace = getattr(torch.ops, parts[0])
        packet = getattr(namespace, parts[1])
        return getattr(packet, parts[2]) if len(parts) == 3 else packet
    except (AttributeError, RuntimeError) as err:
        raise ValueError(
            f"{option}: {name!r} is not an operator of this "
            f"PyTorch build ({torch.__version__}). Fix: check the "
            "spelling against torch.ops (e.g. 'aten.mm', 'aten._scaled_dot_product_flash_attention')."
        ) from err


def resolve_or_none(name: str) -> Any:
    """The op named ``name``, or ``None`` when this PyTorch build has no such op."""
    try:
        return resolve_op(name, "op name")
    except ValueError:
        return None


def resolve_ops(
    names: Sequence[str], option: str, *, strict: bool = True
) -> tuple[frozenset[Any], frozenset[Any]]:
    """Split op names into (overload packets, specific overloads). ``strict=False`` skips names unknown
    here."""
    packets, overloads = set(), set()
    for name in names:
        op = resolve_op(name, option) if strict else resolve_or_none(name)
        if op is None:
            continue
        (overloads if _torch_seam.is_op_overload(op) else packets).add(op)
    return frozenset(packets), frozenset(overloads)
