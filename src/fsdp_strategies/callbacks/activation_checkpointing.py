"""Activation checkpointing as a callback: Lightning glue over
:mod:`fsdp_strategies.parallel.activation_checkpointing`.

What the transform does (full, selective-op, selective-layer; nothing replaced; its place in the order
tensor parallelism -> checkpoint -> compile -> shard) is described there. This callback adds what Lightning
needs:

* When: Lightning calls ``Callback.setup`` -> ``LightningModule.configure_model`` ->
  ``strategy.setup`` (which wraps/shards) with no callback hook in between, and models that
  build their layers in ``configure_model`` have no blocks at ``Callback.setup`` yet. A strategy that
  applies checkpointing itself (:class:`~fsdp_strategies.protocols.ActivationCheckpointingTarget`:
  ``fsdp2``, ``hsdp``, ``ft_hsdp``) is handed :meth:`ActivationCheckpointing.apply` in ``setup`` and calls
  it in :func:`fsdp_strategies.parallel.parallelize`, after tensor parallelism and before compile and
  sharding. For other strategies (single-device, ``ddp``) ``setup`` wraps the module's ``configure_model``
  (:func:`fsdp_strategies._lightning_seam.wrap_module_method`) to apply checkpointing right after it runs,
  before the strategy touches the model; models without ``configure_model`` get it applied directly in
  ``setup``. Each block is marked, so later ``setup`` calls (validate, test) do not checkpoint it twice.
* Recomputation must see the same global state as the forward did. Hugging Face models keep a
  KV cache when ``config.use_cache`` is on (their default): the cache grows between forward and
  recomputation, and selective checkpointing then fails ("invocation index N ... not found in
  storage"). The callback switches ``use_cache`` off on every model config that has it for the
  training steps (as HF's own ``gradient_checkpointing_enable()`` does) and restores it for
  validation, test, predict and after ``fit``. Any other forward/recompute mismatch raised in
  backward is re-raised as
  :class:`~fsdp_strategies.parallel.activation_checkpointing.RecomputationMismatchError` naming the block and
  the fix (the module's ``backward`` is wrapped: a callback hook, ``on_exception``, sees the error but cannot
  replace the one ``fit`` raises).
* ``mode: budget`` (:mod:`fsdp_strategies.memory.budget`): the module's ``training_step`` is wrapped (on the
  instance, removed again at the end of ``fit``; a mode opened from callback hooks instead would nest among
  the other callbacks' modes in the order of the callback list, not inside them) so that a
  :class:`~fsdp_strategies.memory.BudgetPlanner` sees the first two training forwards whole, inside any
  dispatch mode another callback opened for the step: the first profiles and chooses (rank 0's choice
  broadcast by the strategy, so every rank recomputes alike), the second measures. The choice, the
  prediction and the measurement are logged (rank 0) and kept in
  :attr:`ActivationCheckpointing.budget_report`.
* ``offload`` wraps the blocks with :func:`fsdp_strategies.memory.apply_activation_offload`, after
  checkpointing and before the strategy shards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies._options import OptionError, check_bool, check_int, check_number
from fsdp_strategies.memory.budget import BudgetChoice, BudgetPlanner
from fsdp_strategies.memory.offload import OffloadStats, apply_activation_offload
from fsdp_strategies.parallel.activation_checkpointing import (
    DEFAULT_SAVE_OPS,
    Mode,
    RecomputationMismatchError,
    apply_activation_checkpointing,
    checkpointed_blocks,
    is_mismatch,
    mismatch_error,
    validate_options,
)
from fsdp_strategies.parallel.blocks import class_names
from fsdp_strategies.parallel.ops import resolve_ops, resolve_or_none
from fsdp_strategies.protocols import ActivationCheckpointingTarget

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ActivationCheckpointing"]


class ActivationCheckpointing(Callback):
    """Recompute transformer-block activations in backward instead of storing them.

    Args:
        mode: ``full`` -- every block keeps only its input and recomputes everything in backward.
            ``selective_op`` -- inside every block, keep the outputs of the ops in ``save_ops``
            (matmuls, attention kernels, reduce-scatter: costly to recompute) and recompute the
            rest (norms, activations, rotary, elementwise: cheap but memory-hungry).
            ``selective_layer`` -- fully checkpoint every ``layer_interval``-th block only.
            ``budget`` -- keep what fits ``memory_budget`` and costs most to recompute: the first training
            step profiles one block per kind on the real batch and chooses which op outputs to keep, the
            second measures (both logged); see :mod:`fsdp_strategies.memory.budget`.
            ``none`` -- checkpoint nothing (with ``offload: true``: offload only).
        memory_budget: for ``budget``: bytes kept for backward as a fraction (0 < f <= 1) of what the step
            keeps without checkpointing (the whole model: blocks, embeddings, head and loss). A value below
            what recomputing every block keeps is an error at the first step naming the lowest reachable
            fraction.
        offload: move what autograd saves inside the blocks that are not checkpointed to host memory (pinned,
            asynchronous copies on CUDA) and back for backward: every block with ``none``, the blocks between
            ``selective_layer``'s checkpointed ones (with the other modes every block is checkpointed and
            nothing is left to move: a warning says so); see :mod:`fsdp_strategies.memory.offload`.
        offload_min_bytes: saved tensors smaller than this stay on the device.
        block_class_names: class names of the blocks; empty: the same heuristic as the strategies.
        layer_interval: for ``selective_layer``, checkpoint blocks ``n-1, 2n-1, ...`` (1 = all).
        save_ops: op names whose outputs ``selective_op`` keeps, as ``namespace.op[.overload]``
            strings (default
            :data:`~fsdp_strategies.parallel.activation_checkpointing.DEFAULT_SAVE_OPS`); replaces the default
            list.
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
        memory_budget: float | None = None,
        offload: bool = False,
        offload_min_bytes: int = 1 << 20,
    ) -> None:
        super().__init__()
        validate_options(mode, layer_interval, save_every_nth_matmul)
        check_bool("offload", offload, prefix="ActivationCheckpointing: ")
        check_int("offload_min_bytes", offload_min_bytes, 0, prefix="ActivationCheckpointing: ")
        if mode == "budget":
            if memory_budget is None:
                raise OptionError(
                    "ActivationCheckpointing: mode='budget' needs memory_budget. Fix: set memory_budget to "
                    "the fraction of activation memory to keep, e.g. memory_budget: 0.5."
                )
            check_number("memory_budget", memory_budget, prefix="ActivationCheckpointing: ",
                         fix="a fraction 0 < memory_budget <= 1, e.g. 0.5.")
            if memory_budget > 1:
                raise OptionError(
                    f"ActivationCheckpointing: memory_budget={memory_budget!r} is above 1. Fix: a fraction "
                    "0 < memory_budget <= 1 of the activation memory kept without checkpointing (1 = "
                    "keep as much as without checkpointing, recompute as little as possible)."
                )
        elif memory_budget is not None:
            raise OptionError(
                f"ActivationCheckpointing: memory_budget only applies to mode='budget', got mode={mode!r}. "
                "Fix: remove memory_budget or set mode: budget."
            )
        if mode == "none" and not offload:
            raise OptionError(
                "ActivationCheckpointing: mode='none' without offload does nothing. Fix: offload: true, "
                "or a checkpointing mode (full, selective_op, selective_layer, budget)."
            )
        if isinstance(block_class_names, str):
            block_class_names = [block_class_names]
        if mode != "selective_op" and (save_ops is not None or extra_save_ops or save_every_nth_matmul != 1):
            raise OptionError(
                "save_ops / extra_save_ops / save_every_nth_matmul "
                f"only apply to mode='selective_op', got mode={mode!r}. "
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
        self.memory_budget = memory_budget
        self.offload = offload
        self.offload_min_bytes = offload_min_bytes
        self.offload_stats: OffloadStats | None = None
        self.budget_report: dict[str, Any] = {}
        self._planner: BudgetPlanner | None = None
        self.checkpointed: list[nn.Module] = []
        self._cache_configs: dict[int, tuple[Any, Any]] = {}  # id(config) -> (config, its own use_cache)
        self._told_cache = False

    def apply(self, module: nn.Module) -> list[nn.Module]:
        """Checkpoint ``module``'s blocks now (idempotent); returns the blocks newly checkpointed."""
        new = apply_activation_checkpointing(
            module, self.mode, block_class_names=self.block_class_names or None,
            layer_interval=self.layer_interval,
            save_ops=[n for n in self.save_ops if resolve_or_none(n) is not None],
            save_every_nth_matmul=self.save_every_nth_matmul, preserve_rng_state=self.preserve_rng_state,
        )
        self.checkpointed = checkpointed_blocks(module)
        if self.offload and self.offload_stats is None:
            self.offload_stats = apply_activation_offload(
                module, block_class_names=self.block_class_names or None, min_bytes=self.offload_min_bytes)
            if self.offload_stats.blocks:
                rank_zero_info(
                    f"ActivationCheckpointing: offloading saved activations of >= {self.offload_min_bytes} "
                    f"bytes in {self.offload_stats.blocks} uncheckpointed block(s) to host memory"
                )
            else:
                rank_zero_warn(
                    "ActivationCheckpointing: offload: true moves "
                    f"nothing with mode={self.mode!r}: every block "
                    "is checkpointed, and a checkpointed block keeps only its input (and what selective "
                    "checkpointing keeps, which stays on the device). Fix: mode: selective_layer (offload "
                    "the blocks in between) or mode: none (offload every block), or offload: false."
                )
        if self.mode == "none":
            return new
        if new:
            rank_zero_info(
                f"ActivationCheckpointing: mode={self.mode} on {len(new)} block(s) "
                f"({', '.join(class_names(new))})"
                + (f", keeping the outputs of {len(self.save_ops)} op kinds"
                   + (f" (1 in {self.save_every_nth_matmul} matmuls)"
                      if self.save_every_nth_matmul > 1 else "")
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
        if isinstance(trainer.strategy, ActivationCheckpointingTarget):
            trainer.strategy.set_activation_checkpointing(self.apply)  # applied in its parallelize()
        elif is_overridden("configure_model", pl_module):
            then_checkpoint = functools.partial(self._apply_after, pl_module)
            seam.wrap_module_method(pl_module, "configure_model", self, then_checkpoint)
        else:
            self.apply(pl_module)
        seam.wrap_module_method(pl_module, "backward", self, self._explain_mismatches)

    def _apply_after(self, pl_module: pl.LightningModule,
                     configure_model: Callable[[], None]) -> Callable[[], None]:
        """``configure_model``, then checkpointing (a strategy that does not apply it itself)."""

        def configure_then_checkpoint() -> None:
            configure_model()
            self.apply(pl_module)

        return configure_then_checkpoint

    def _explain_mismatches(self, backward: Callable[..., None]) -> Callable[..., None]:
        """``LightningModule.backward`` with recompute mismatches re-raised as RecomputationMismatchError."""

        def explaining_backward(*args: Any, **kwargs: Any) -> None:
            try:
                backward(*args, **kwargs)
            except RecomputationMismatchError:
                raise
            except RuntimeError as err:
                if self.checkpointed and is_mismatch(err):
                    raise mismatch_error(err, self.mode) from err
                raise

        return explaining_backward

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
                "ActivationCheckpointing: set config.use_cache=False "
                f"on {sorted(set(switched))} for training steps "
                "(a KV cache changes between forward and recomputation); it is restored for validation, test "
                "and predict."
            )

    def _restore_caches(self) -> None:
        for config, value in self._cache_configs.values():
            config.use_cache = value

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
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
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore_caches()
        seam.unwrap_module_method(pl_module, "training_step", self)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.checkpointed = checkpointed_blocks(pl_module)
        if self.mode == "budget" and self.checkpointed:
            self._plan_budget(trainer, pl_module)

    # ------------------------------------------------------------------ budget: plan on the first two
    # training forwards
    def _plan_budget(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.memory_budget is not None

        def agree(choice: BudgetChoice | BaseException) -> BudgetChoice | BaseException:
            return trainer.strategy.broadcast(choice, src=0)

        def log(line: str) -> None:
            rank_zero_info(line)
            if self._planner is not None and self._planner.done and trainer.is_global_zero:
                report = self._planner.report()
                metrics = {
                    f"ac/budget/{k}": float(v) for k, v in report.items() if isinstance(v, (int, float))
                }
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)

        planner = self._planner = BudgetPlanner(pl_module, self.memory_budget, agree=agree, log=log)

        def planned(training_step: Callable[..., Any]) -> Callable[..., Any]:
            def planned_training_step(*args: Any, **kwargs: Any) -> Any:
                with planner.forward():
                    out = training_step(*args, **kwargs)
                self.budget_report = planner.report()
                return out

            return planned_training_step

        seam.unwrap_module_method(pl_module, "training_step", self)  # a fit before this one that did not end
        seam.wrap_module_method(pl_module, "training_step", self, planned)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seam.unwrap_module_method(pl_module, "training_step", self)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        seam.unwrap_module_method(pl_module, "training_step", self)
