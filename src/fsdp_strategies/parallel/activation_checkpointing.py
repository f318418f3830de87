"""Activation checkpointing of transformer blocks, as a transform on an ``nn.Module`` (no Lightning).

Modes: ``full``, ``selective_op`` (keep the outputs of listed ops, recompute the rest),
``selective_layer`` (every n-th block), ``budget`` (keep the outputs of the op calls a planner chose,
:mod:`fsdp_strategies.memory.budget`; until it has chosen, nothing is kept, as ``full``) and ``none``.
:class:`fsdp_strategies.callbacks.ActivationCheckpointing` is the Lightning glue over
:func:`apply_activation_checkpointing`; :func:`fsdp_strategies.parallel.parallelize` applies it in the order
tensor parallelism -> checkpoint -> compile -> shard.

* Blocks are found with :func:`fsdp_strategies.parallel.blocks.find_transformer_blocks`, the same rule the
  sharding strategies use, so checkpoint regions and FSDP units coincide.
* Nothing is replaced: each block *instance* gets a ``forward`` attribute that runs the class's
  forward under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. The module tree,
  classes and parameter names stay as they were (``state_dict`` keys are unchanged, old
  checkpoints load), and a later ``fully_shard``/``torch.compile`` of the block wraps the very
  same object: FSDP2's hooks stay *outside* the checkpoint region and a compiled block traces the
  checkpointed forward (order: checkpoint -> compile -> shard).
* Recomputation is observable: :func:`is_recomputing` is true (in the thread running backward)
  while a checkpointed block re-runs its forward; a FLOP counter uses it to tell recomputed
  (hardware) FLOPs from model FLOPs. Each block is marked, so applying twice is a no-op.
* A recomputation that does not replay the forward (the forward read global state that changed since)
  is recognised by :func:`is_mismatch` and explained by :func:`mismatch_error` as a
  :class:`RecomputationMismatchError` naming the block and the fix.
* Which ops ``selective_op`` keeps, and which count as matmuls, are op names resolved by
  :mod:`fsdp_strategies.parallel.ops`.
* ``budget``: the blocks of one call share a :class:`BudgetDecision`: per block kind (the class name
  at the time of checkpointing; blocks of one class with parameters of different shapes are kinds of their
  own), the set of op calls ``(op name, k-th call of that op in the block)``
  whose outputs are kept. Its ``on_first_call`` hook (set by the planner) runs before a block's
  checkpointed forward in training, with the block's inner forward and inputs, so the planner can
  profile one block of each kind on the real batch. Each checkpoint call takes the decision current
  at its forward, and its recomputation uses the same one.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fsdp_strategies import _torch_seam
from fsdp_strategies._options import check_choice, check_int
from fsdp_strategies.parallel.blocks import find_transformer_blocks
from fsdp_strategies.parallel.ops import ATTENTION_OPS, MATMUL_OPS, op_name, resolve_ops

__all__ = [
    "DEFAULT_SAVE_OPS",
    "MODES",
    "BudgetDecision",
    "RecomputationMismatchError",
    "apply_activation_checkpointing",
    "block_kind",
    "budget_decision",
    "checkpointed_blocks",
    "inside_checkpointed_block",
    "is_checkpointed",
    "is_mismatch",
    "is_recomputing",
    "mismatch_error",
    "validate_options",
]

Mode = Literal["full", "selective_op", "selective_layer", "budget", "none"]
MODES: tuple[str, ...] = get_args(Mode)

# Outputs worth keeping: expensive to recompute, cheap to store relative to their cost.
DEFAULT_SAVE_OPS: tuple[str, ...] = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.linear",
    *ATTENTION_OPS,
    "_c10d_functional.reduce_scatter_tensor",
)

_MARK = "_fsdp_strategies_ac"  # on a block: the _BlockPlan applied to it
_INNER = "_fsdp_strategies_ac_inner"  # on a block: the forward that runs inside the checkpoint
_CALL = "_fsdp_strategies_ac_call"  # on a block: checkpoint() with the plan's options bound
# on a block: its kind (class name, /N by parameter shapes) when checkpointed
_KIND = "_fsdp_strategies_ac_kind"


class _RecomputeState(threading.local):
    """Per thread (the autograd engine may run backward in its own threads): recomputation depth and
    the class of the block recomputed last (named in mismatch errors)."""

    depth = 0
    last: str | None = None


_RECOMPUTE = _RecomputeState()


class _BlockDepth(threading.local):
    """Per thread: how many checkpointed blocks' forwards are running (0 = outside every block)."""

    depth = 0


_BLOCK = _BlockDepth()


def inside_checkpointed_block() -> bool:
    """True while the forward of a block checkpointed by this module runs (in the thread running it).

    The memory planner uses it to tell activations the blocks create from those made outside them.
    """
    return _BLOCK.depth > 0

# Messages torch raises when a recomputation does not replay the forward (see torch.utils.checkpoint).
_MISMATCH_MARKERS = ("not found in storage", "different metadata", "different number of tensors",
                     "global state that changed")


class RecomputationMismatchError(RuntimeError):
    """A checkpointed block's recomputation in backward did not replay its forward.

    (Not to be confused with :class:`fsdp_strategies.checkpoint.load_into_fsdp.CheckpointMismatchError`, a
    checkpoint file whose layout does not fit the model.)
    """


def is_recomputing() -> bool:
    """True while a block checkpointed by this module re-runs its forward during backward.

    The FLOP monitor uses it to tell recomputed FLOPs (hardware FLOPs) from model FLOPs.
    """
    return _RECOMPUTE.depth > 0


@contextmanager
def _recomputing() -> Iterator[None]:
    _RECOMPUTE.depth += 1
    try:
        yield
    finally:
        _RECOMPUTE.depth -= 1


class _OpMatcher:
    def __init__(self, packets: frozenset[Any], overloads: frozenset[Any]) -> None:
        self.packets, self.overloads = packets, overloads

    def __contains__(self, op: Any) -> bool:
        return op in self.overloads or getattr(op, "overloadpacket", None) in self.packets


class _SelectiveOpPolicy:
    """Per checkpoint call: save listed ops' outputs; of the matmuls, every n-th only (n=1: all)."""

    def __init__(self, save: _OpMatcher, matmuls: _OpMatcher, every_nth_matmul: int) -> None:
        self.save, self.matmuls, self.every_nth_matmul = save, matmuls, every_nth_matmul
        # Older PyTorch also calls the policy during recomputation (ctx.is_recompute=True): count
        # forward and recompute separately so the decisions line up.
        self.matmul_count = {False: 0, True: 0}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in self.matmuls:
            index = self.matmul_count[ctx.is_recompute]
            self.matmul_count[ctx.is_recompute] += 1
            if op in self.save and index % self.every_nth_matmul == 0:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in self.save else CheckpointPolicy.PREFER_RECOMPUTE


class _SavedCallsPolicy:
    """Per checkpoint call (``budget``): keep the outputs of the op calls in ``keys``, recompute the rest.

    A key is ``(op name, k)``: the k-th call (from 0) of that op in the block. Forward and recomputation
    are counted separately so their decisions line up (older PyTorch calls the policy in both).
    """

    def __init__(self, keys: frozenset[tuple[str, int]]) -> None:
        self.keys = keys
        self.counts: dict[bool, dict[str, int]] = {False: {}, True: {}}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = op_name(op)
        counts = self.counts[ctx.is_recompute]
        index = counts.get(name, 0)
        counts[name] = index + 1
        return CheckpointPolicy.MUST_SAVE if (name, index) in self.keys else CheckpointPolicy.PREFER_RECOMPUTE


class BudgetDecision:
    """What ``budget`` keeps, shared by the blocks of one :func:`apply_activation_checkpointing` call.

    Attributes:
        keep: block kind -> the op calls ``(op name, k)`` whose outputs are kept; a kind missing here keeps
            nothing (the same as ``full``).
        on_first_call: called as ``hook(block, inner_forward, args, kwargs)`` before each checkpointed forward
            of a block in training (grad enabled, not in backward, not compiling); ``None``: not called.
    """

    def __init__(self) -> None:
        self.keep: dict[str, frozenset[tuple[str, int]]] = {}
        self.on_first_call: (
            Callable[[nn.Module, Callable[..., Any], tuple[Any, ...], dict[str, Any]], None] | None
        ) = None


class _BlockPlan:
    """What to do inside a block's checkpoint; one instance is shared by the blocks of one call."""

    def __init__(self, mode: str, save: _OpMatcher | None, matmuls: _OpMatcher | None, every_nth_matmul: int,
                 preserve_rng_state: bool) -> None:
        self.mode = mode
        self.save, self.matmuls, self.every_nth_matmul = save, matmuls, every_nth_matmul
        self.preserve_rng_state = preserve_rng_state
        self.budget = BudgetDecision() if mode == "budget" else None

    def context_fn(self, kind: str) -> Callable[[], Any]:
        """``checkpoint(context_fn=...)`` for a block of ``kind``: a fresh selective policy per call. A plain
        function, not a bound method: ``torch.compile`` keeps the function it is given and calls it without
        ``self``."""
        if self.budget is not None:
            budget = self.budget

            def budget_contexts() -> Any:
                return create_selective_checkpoint_contexts(
                    _SavedCallsPolicy(budget.keep.get(kind, frozenset()))
                )

            return budget_contexts
        save, matmuls, nth = self.save, self.matmuls, self.every_nth_matmul
        assert save is not None and matmuls is not None

        def selective_contexts() -> Any:
            return create_selective_checkpoint_contexts(_SelectiveOpPolicy(save, matmuls, nth))

        return selective_contexts

    def checkpoint_fn(self, kind: str) -> Callable[..., Any]:
        """``torch.utils.checkpoint.checkpoint`` with this plan's options bound (a ``functools.partial``, the
        shape ``torch.compile`` traces through, as torch's own ``checkpoint_wrapper`` builds it)."""
        options: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": self.preserve_rng_state}
        # full: torch's default context (noop_context_fn breaks compile)
        if self.mode in ("selective_op", "budget"):
            options["context_fn"] = self.context_fn(kind)
        return functools.partial(checkpoint, **options)


def _run_inner(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    inner = getattr(block, _INNER)
    if not torch.compiler.is_compiling() and _torch_seam.inside_autograd_backward():
        _RECOMPUTE.last = type(block).__name__
        with _recomputing():  # called by the autograd engine: this is the recomputation
            return inner(*args, **kwargs)
    return inner(*args, **kwargs)


def is_mismatch(err: BaseException) -> bool:
    """Whether ``err`` is torch's report of a recomputation that did not replay its forward."""
    from torch.utils.checkpoint import CheckpointError

    return isinstance(err, CheckpointError) or (
        isinstance(err, RuntimeError) and any(marker in str(err) for marker in _MISMATCH_MARKERS)
    )


def mismatch_error(err: BaseException, mode: str) -> RecomputationMismatchError:
    """``err`` (a mismatch, see :func:`is_mismatch`) restated with the block recomputed last and the fix."""
    block = _RECOMPUTE.last or "a checkpointed block"
    return RecomputationMismatchError(
        f"ActivationCheckpointing(mode={mode!r}): recomputing {block} in backward did not replay its forward "
        f"(torch: {str(err).splitlines()[0][:300]}). Likely "
        "cause: the block's forward depends on global state "
        "that changed between forward and backward -- a cache that grows (a KV cache: use_cache=True), a "
        "step counter, or a Python-side random choice. Fix: make the forward depend only on its inputs "
        "during training (turn caches off, e.g. model.config.use_cache=False), or use mode='full', "
        "or leave this block class out with block_class_names."
    )


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # traced: no profiling hook, no thread-local state for dynamo to guard on
    if torch.compiler.is_compiling():
        return getattr(self, _CALL)(functools.partial(_run_inner, self), *args, **kwargs)
    budget = getattr(self, _MARK).budget
    if (budget is not None and budget.on_first_call is not None and torch.is_grad_enabled()
            and not _torch_seam.inside_autograd_backward()):
        budget.on_first_call(self, getattr(self, _INNER), args, kwargs)
    _BLOCK.depth += 1
    try:
        return getattr(self, _CALL)(functools.partial(_run_inner, self), *args, **kwargs)
    finally:
        _BLOCK.depth -= 1


def _checkpoint_block(block: nn.Module, plan: _BlockPlan, kind: str) -> bool:
    if getattr(block, _MARK, None) is not None:
        return False  # applied already (setup runs again for validate/test)
    object.__setattr__(block, _INNER, block.forward)  # bound method: deepcopy re-binds it to the copy
    object.__setattr__(block, _MARK, plan)
    object.__setattr__(block, _KIND, kind)
    object.__setattr__(block, _CALL, plan.checkpoint_fn(kind))
    object.__setattr__(block, "forward", types.MethodType(_checkpointed_forward, block))
    return True


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` is a block checkpointed by this module."""
    return getattr(module, _MARK, None) is not None


def checkpointed_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` checkpointed by this module, in module order."""
    return [m for m in model.modules() if is_checkpointed(m)]


def block_kind(block: nn.Module) -> str:
    """A checkpointed block's kind: its class name when it was checkpointed (FSDP2 renames the class later),
    with a shape-set number where blocks of one class differ in parameter shapes (``ConvNextStage/2``)."""
    return str(getattr(block, _KIND))


def budget_decision(model: nn.Module) -> BudgetDecision | None:
    """The :class:`BudgetDecision` shared by ``model``'s ``budget``-checkpointed blocks; ``None`` for other
    modes."""
    for block in checkpointed_blocks(model):
        return getattr(block, _MARK).budget
    return None


def apply_activation_checkpointing(
    model: nn.Module,
    mode: Mode = "selective_op",
    *,
    block_class_names: Sequence[str] | None = None,
    layer_interval: int = 2,
    save_ops: Sequence[str] | None = None,
    save_every_nth_matmul: int = 1,
    preserve_rng_state: bool = True,
) -> list[nn.Module]:
    """Checkpoint ``model``'s transformer blocks in place; returns the blocks newly checkpointed.

    Idempotent: blocks already checkpointed are skipped. Usable without Lightning. ``mode="none"``
    checkpoints nothing; ``mode="budget"`` keeps nothing until a planner fills :func:`budget_decision`
    (:class:`fsdp_strategies.memory.BudgetPlanner`).
    """
    validate_options(mode, layer_interval, save_every_nth_matmul)
    if mode == "none":
        return []
    save = matmuls = None
    if mode == "selective_op":
        names = list(DEFAULT_SAVE_OPS if save_ops is None else save_ops)
        save = _OpMatcher(*resolve_ops(names, "save_ops", strict=save_ops is not None))
        matmuls = _OpMatcher(*resolve_ops(MATMUL_OPS, "matmul ops", strict=False))
    plan = _BlockPlan(mode, save, matmuls, save_every_nth_matmul, preserve_rng_state)
    if any(is_checkpointed(m) for m in model.modules()):
        # applied already (setup runs again for validate/test, maybe after FSDP2 renamed the classes)
        return []
    blocks = find_transformer_blocks(model, block_class_names)
    if mode == "selective_layer":
        blocks = [b for i, b in enumerate(blocks) if (i + 1) % layer_interval == 0]
    kinds = _block_kinds(blocks)
    return [b for b, kind in zip(blocks, kinds) if _checkpoint_block(b, plan, kind)]


def _block_kinds(blocks: Sequence[nn.Module]) -> list[str]:
    """Each block's kind: its class name, or -- where blocks of one class hold parameters of different shapes
    (ConvNeXt's stages of widths 16/32/64 are all ``ConvNextStage``) -- the class name and the shape set's
    number in order of appearance (``ConvNextStage/2``), so that ``budget`` profiles each size, not one for
    all."""
    shapes = [tuple(tuple(p.shape) for p in block.parameters()) for block in blocks]
    names = [type(block).__name__ for block in blocks]
    per_class: dict[str, list[tuple]] = {}
    for name, sig in zip(names, shapes):
        seen = per_class.setdefault(name, [])
        if sig not in seen:
            seen.append(sig)
    return [name if len(per_class[name]) == 1 else f"{name}/{per_class[name].index(sig) + 1}"
            for name, sig in zip(names, shapes)]


def validate_options(mode: str, layer_interval: int, save_every_nth_matmul: int) -> None:
    """The checks of :func:`apply_activation_checkpointing`'s options (also run by the callback at
    ``__init__``)."""
    check_choice("mode", mode, Mode)
    for name, value in (("layer_interval", layer_interval), ("save_every_nth_matmul", save_every_nth_matmul)):
        check_int(name, value, 1, fix="an integer >= 1 (1 = every block / every matmul).")
