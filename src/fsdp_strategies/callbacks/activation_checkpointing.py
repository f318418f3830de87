"""Activation checkpointing of transformer blocks as a callback: full, selective-op and selective-layer.

How it is applied (and why this way):

* Blocks are found with :func:`fsdp_strategies._blocks.find_transformer_blocks`, the same rule the
  sharding strategies use, so checkpoint regions and FSDP units coincide.
* Nothing is replaced: each block *instance* gets a ``forward`` attribute that runs the class's
  forward under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. The module tree,
  classes and parameter names stay as they were (``state_dict`` keys are unchanged, old
  checkpoints load), and a strategy that later calls ``fully_shard``/``torch.compile`` on the
  block wraps the very same object: FSDP2's hooks stay *outside* the checkpoint region and a
  compiled block traces the checkpointed forward (order: checkpoint -> compile -> shard).
* When: Lightning calls ``Callback.setup`` -> ``LightningModule.configure_model`` ->
  ``strategy.setup`` (which wraps/shards) with no callback hook in between, and models that
  build their layers in ``configure_model`` have no blocks at ``Callback.setup`` yet. So
  ``setup`` wraps the module's ``configure_model`` (instance attribute, ``functools.wraps``
  keeps Lightning's ``is_overridden`` check true) to apply checkpointing right after it runs --
  before any strategy touches the model, whether the blocks live on the meta device (fsdp2
  ``meta_init``) or on the CPU/GPU (single-device, ddp). Models without ``configure_model`` get
  it applied directly in ``setup``. Each block is marked, so later ``setup`` calls (validate,
  test) do not checkpoint it twice.
* Recomputation must see the same global state as the forward did. Hugging Face models keep a
  KV cache when ``config.use_cache`` is on (their default): the cache grows between forward and
  recomputation, and selective checkpointing then fails ("invocation index N ... not found in
  storage"). The callback switches ``use_cache`` off on every model config that has it for the
  training steps (as HF's own ``gradient_checkpointing_enable()`` does) and restores it for
  validation, test, predict and after ``fit``. Any other forward/recompute mismatch raised in
  backward is re-raised as :class:`CheckpointMismatchError` naming the block and the fix.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from typing_extensions import override

from fsdp_strategies._blocks import class_names, find_transformer_blocks

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "DEFAULT_SAVE_OPS",
    "ActivationCheckpointing",
    "CheckpointMismatchError",
    "apply_activation_checkpointing",
    "is_recomputing",
    "resolve_ops",
]

Mode = Literal["full", "selective_op", "selective_layer"]
MODES: tuple[str, ...] = ("full", "selective_op", "selective_layer")

# Outputs worth keeping: expensive to recompute, cheap to store relative to their cost.
DEFAULT_SAVE_OPS: tuple[str, ...] = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.linear",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
    "_c10d_functional.reduce_scatter_tensor",
)
# Ops that count as one matmul for ``save_every_nth_matmul``. ``aten.linear`` only reaches the policy
# where it is not decomposed, and then its inner mm/addmm is not seen separately: one linear = one matmul.
MATMUL_OPS: tuple[str, ...] = ("aten.mm", "aten.addmm", "aten.bmm", "aten.linear", "aten.baddbmm")

_MARK = "_fsdp_strategies_ac"  # on a block: the _BlockPlan applied to it
_INNER = "_fsdp_strategies_ac_inner"  # on a block: the forward that runs inside the checkpoint
_HOOKED = "_fsdp_strategies_ac_configure_model"  # on a LightningModule's wrapped configure_model

_recompute_depth = 0
_last_recomputed: str | None = None  # "<class> at <qualified path>" of the block recomputed last

# Messages torch raises when a recomputation does not replay the forward (see torch.utils.checkpoint).
_MISMATCH_MARKERS = ("not found in storage", "different metadata", "different number of tensors",
                     "global state that changed")


class CheckpointMismatchError(RuntimeError):
    """A checkpointed block's recomputation in backward did not replay its forward."""


def is_recomputing() -> bool:
    """True while a block checkpointed by this module re-runs its forward during backward.

    The FLOP monitor uses it to tell recomputed FLOPs (hardware FLOPs) from model FLOPs.
    """
    return _recompute_depth > 0


@contextmanager
def _recomputing() -> Iterator[None]:
    global _recompute_depth
    _recompute_depth += 1
    try:
        yield
    finally:
        _recompute_depth -= 1


def _resolve_op(name: str, option: str) -> Any:
    """``"aten.mm"`` -> ``torch.ops.aten.mm`` (all overloads); ``"aten.mm.default"`` -> that overload."""
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
            f"{option}: {name!r} is not an operator of this PyTorch build ({torch.__version__}). Fix: check the "
            "spelling against torch.ops (e.g. 'aten.mm', 'aten._scaled_dot_product_flash_attention')."
        ) from err


def resolve_ops(names: Sequence[str], option: str, *, strict: bool = True) -> tuple[frozenset[Any], frozenset[Any]]:
    """Split op names into (overload packets, specific overloads). ``strict=False`` skips names unknown here."""
    packets, overloads = set(), set()
    for name in names:
        try:
            op = _resolve_op(name, option)
        except ValueError:
            if strict:
                raise
            continue
        (overloads if isinstance(op, torch._ops.OpOverload) else packets).add(op)
    return frozenset(packets), frozenset(overloads)


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


class _BlockPlan:
    """What to do inside a block's checkpoint; one instance is shared by the blocks of one call."""

    def __init__(self, mode: str, save: _OpMatcher | None, matmuls: _OpMatcher | None, every_nth_matmul: int,
                 preserve_rng_state: bool) -> None:
        self.mode = mode
        self.save, self.matmuls, self.every_nth_matmul = save, matmuls, every_nth_matmul
        self.preserve_rng_state = preserve_rng_state

    def context_fn(self) -> Any:
        if self.mode != "selective_op":
            from torch.utils.checkpoint import noop_context_fn

            return noop_context_fn()
        assert self.save is not None and self.matmuls is not None
        return create_selective_checkpoint_contexts(_SelectiveOpPolicy(self.save, self.matmuls, self.every_nth_matmul))


def _run_inner(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    global _last_recomputed
    inner = getattr(block, _INNER)
    if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
        _last_recomputed = type(block).__name__
        with _recomputing():  # called by the autograd engine: this is the recomputation
            return inner(*args, **kwargs)
    return inner(*args, **kwargs)


def _is_mismatch(err: BaseException) -> bool:
    from torch.utils.checkpoint import CheckpointError

    return isinstance(err, CheckpointError) or (
        isinstance(err, RuntimeError) and any(marker in str(err) for marker in _MISMATCH_MARKERS)
    )


def _mismatch_error(err: BaseException, mode: str) -> CheckpointMismatchError:
    block = _last_recomputed or "a checkpointed block"
    return CheckpointMismatchError(
        f"ActivationCheckpointing(mode={mode!r}): recomputing {block} in backward did not replay its forward "
        f"(torch: {str(err).splitlines()[0][:300]}). Likely cause: the block's forward depends on global state "
        "that changed between forward and backward -- a cache that grows (a KV cache: use_cache=True), a "
        "step counter, or a Python-side random choice. Fix: make the forward depend only on its inputs "
        "during training (turn caches off, e.g. model.config.use_cache=False), or use mode='full', "
        "or leave this block class out with block_class_names."
    )


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    plan: _BlockPlan = getattr(self, _MARK)
    return checkpoint(
        functools.partial(_run_inner, self), *args, use_reentrant=False, context_fn=plan.context_fn,
        preserve_rng_state=plan.preserve_rng_state, **kwargs,
    )


def _checkpoint_block(block: nn.Module, plan: _BlockPlan) -> bool:
    if getattr(block, _MARK, None) is not None:
        return False  # applied already (setup runs again for validate/test)
    object.__setattr__(block, _INNER, block.forward)  # bound method: deepcopy re-binds it to the copy
    object.__setattr__(block, _MARK, plan)
    object.__setattr__(block, "forward", types.MethodType(_checkpointed_forward, block))
    return True


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` is a block checkpointed by this module."""
    return getattr(module, _MARK, None) is not None


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

    Idempotent: blocks already checkpointed are skipped. Usable without Lightning.
    """
    _validate(mode, layer_interval, save_every_nth_matmul)
    save = matmuls = None
    if mode == "selective_op":
        names = list(DEFAULT_SAVE_OPS if save_ops is None else save_ops)
        save = _OpMatcher(*resolve_ops(names, "save_ops", strict=save_ops is not None))
        matmuls = _OpMatcher(*resolve_ops(MATMUL_OPS, "matmul ops", strict=False))
    plan = _BlockPlan(mode, save, matmuls, save_every_nth_matmul, preserve_rng_state)
    if any(is_checkpointed(m) for m in model.modules()):
        return []  # applied already (setup runs again for validate/test, maybe after FSDP2 renamed the classes)
    blocks = find_transformer_blocks(model, block_class_names)
    if mode == "selective_layer":
        blocks = [b for i, b in enumerate(blocks) if (i + 1) % layer_interval == 0]
    return [b for b in blocks if _checkpoint_block(b, plan)]


def _validate(mode: str, layer_interval: int, save_every_nth_matmul: int) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported. Fix: use one of {MODES}.")
    for name, value in (("layer_interval", layer_interval), ("save_every_nth_matmul", save_every_nth_matmul)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid. Fix: an integer >= 1 (1 = every block / every matmul).")


class ActivationCheckpointing(Callback):
    """Recompute transformer-block activations in backward instead of storing them.

    Args:
        mode: ``full`` -- every block keeps only its input and recomputes everything in backward.
            ``selective_op`` -- inside every block, keep the outputs of the ops in ``save_ops``
            (matmuls, attention kernels, reduce-scatter: costly to recompute) and recompute the
            rest (norms, activations, rotary, elementwise: cheap but memory-hungry).
            ``selective_layer`` -- fully checkpoint every ``layer_interval``-th block only.
        block_class_names: class names of the blocks; empty: the same heuristic as the strategies.
        layer_interval: for ``selective_layer``, checkpoint blocks ``n-1, 2n-1, ...`` (1 = all).
        save_ops: op names whose outputs ``selective_op`` keeps, as ``namespace.op[.overload]``
            strings (default :data:`DEFAULT_SAVE_OPS`); replaces the default list.
        extra_save_ops: op names added to ``save_ops`` (extend the default from YAML).
        save_every_nth_matmul: keep only every n-th matmul output in a block (2 = every other,
            recomputing the rest); attention and other listed ops are always kept.
        preserve_rng_state: replay the RNG state in recomputation (needed with dropout).
    """

    def __init__(
        self,
        mode: Mode = "selective_op",
        block_class_names: list[str] | None = None,
        layer_interval: int = 2,
        save_ops: list[str] | None = None,
        extra_save_ops: list[str] | None = None,
        save_every_nth_matmul: int = 1,
        preserve_rng_state: bool = True,
    ) -> None:
        super().__init__()
        _validate(mode, layer_interval, save_every_nth_matmul)
        if isinstance(block_class_names, str):
            block_class_names = [block_class_names]
        if mode != "selective_op" and (save_ops is not None or extra_save_ops or save_every_nth_matmul != 1):
            raise ValueError(
                f"save_ops / extra_save_ops / save_every_nth_matmul only apply to mode='selective_op', got mode={mode!r}. "
                "Fix: remove them or set mode: selective_op."
            )
        ops = list(DEFAULT_SAVE_OPS if save_ops is None else save_ops) + list(extra_save_ops or [])
        if save_ops is not None:
            resolve_ops(save_ops, "save_ops")  # fail now, with the option's name, on a typo
        if extra_save_ops:
            resolve_ops(extra_save_ops, "extra_save_ops")
        self.mode = mode
        self.block_class_names = list(block_class_names or [])
        self.layer_interval = layer_interval
        self.save_ops = ops  # default names missing from this torch build are skipped when applied
        self.save_every_nth_matmul = save_every_nth_matmul
        self.preserve_rng_state = preserve_rng_state
        self.checkpointed: list[nn.Module] = []
        self._cache_configs: dict[int, tuple[Any, Any]] = {}  # id(config) -> (config, its own use_cache)
        self._told_cache = False

    def apply(self, module: nn.Module) -> list[nn.Module]:
        """Checkpoint ``module``'s blocks now (idempotent); returns the blocks newly checkpointed."""
        new = apply_activation_checkpointing(
            module, self.mode, block_class_names=self.block_class_names or None, layer_interval=self.layer_interval,
            save_ops=[n for n in self.save_ops if _resolve_or_none(n) is not None],
            save_every_nth_matmul=self.save_every_nth_matmul, preserve_rng_state=self.preserve_rng_state,
        )
        self.checkpointed = [m for m in module.modules() if is_checkpointed(m)]
        if new:
            rank_zero_info(
                f"ActivationCheckpointing: mode={self.mode} on {len(new)} block(s) "
                f"({', '.join(class_names(new))})"
                + (f", keeping the outputs of {len(self.save_ops)} op kinds"
                   + (f" (1 in {self.save_every_nth_matmul} matmuls)" if self.save_every_nth_matmul > 1 else "")
                   if self.mode == "selective_op" else "")
            )
        elif not self.checkpointed:
            rank_zero_warn(
                "ActivationCheckpointing: no transformer blocks found, nothing is checkpointed. Fix: set "
                "block_class_names to your block's class name."
            )
        return new

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if is_overridden("configure_model", pl_module):
            self._apply_after_configure_model(pl_module)
        else:
            self.apply(pl_module)
        self._explain_mismatches_in_backward(pl_module)

    def _explain_mismatches_in_backward(self, pl_module: pl.LightningModule) -> None:
        """Re-raise torch's recompute-mismatch errors from ``LightningModule.backward`` as CheckpointMismatchError."""
        current: Callable[..., None] = pl_module.backward
        if self in getattr(current, _HOOKED, ()):
            return

        @functools.wraps(current)
        def backward(*args: Any, **kwargs: Any) -> None:
            try:
                current(*args, **kwargs)
            except CheckpointMismatchError:
                raise
            except RuntimeError as err:
                if self.checkpointed and _is_mismatch(err):
                    raise _mismatch_error(err, self.mode) from err
                raise

        setattr(backward, _HOOKED, (*getattr(current, _HOOKED, ()), self))
        object.__setattr__(pl_module, "backward", backward)

    # ------------------------------------------------------------------ caches (global state) off in training
    def _disable_caches(self, pl_module: pl.LightningModule) -> None:
        if not self.checkpointed:
            return
        switched = []
        for module in pl_module.modules():
            config = getattr(module, "config", None)
            if config is None or not getattr(config, "use_cache", False):
                continue
            if id(config) not in self._cache_configs:
                self._cache_configs[id(config)] = (config, config.use_cache)
            config.use_cache = False
            switched.append(type(module).__name__)
        if switched and not self._told_cache:
            self._told_cache = True
            rank_zero_info(
                f"ActivationCheckpointing: set config.use_cache=False on {sorted(set(switched))} for training steps "
                "(a KV cache changes between forward and recomputation); it is restored for validation, test "
                "and predict."
            )

    def _restore_caches(self) -> None:
        for config, value in self._cache_configs.values():
            config.use_cache = value

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._disable_caches(pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_caches()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_caches()

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_caches()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_caches()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_caches()

    def _apply_after_configure_model(self, pl_module: pl.LightningModule) -> None:
        current: Callable[[], None] = pl_module.configure_model
        if self in getattr(current, _HOOKED, ()):
            return

        @functools.wraps(current)
        def configure_model() -> None:
            current()
            self.apply(pl_module)

        setattr(configure_model, _HOOKED, (*getattr(current, _HOOKED, ()), self))
        object.__setattr__(pl_module, "configure_model", configure_model)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.checkpointed = [m for m in pl_module.modules() if is_checkpointed(m)]


def _resolve_or_none(name: str) -> Any:
    try:
        return _resolve_op(name, "save_ops")
    except ValueError:
        return None
