"""``ddp_hooks``' resume machinery: the comm hook's and averager's state in a checkpoint, restored exactly.

A resumed ``ddp_hooks`` run must compress and average on the schedule the uninterrupted run would have
followed. What is saved, per rank (PowerSGD's error feedback and warm-start matrices differ per rank),
under the checkpoint key ``ddp_hooks_state``:

* PowerSGD: iteration, error-feedback / P / Q memories per bucket index, the RNG, the compression
  counters, and the parameters behind each bucket index (see :meth:`CommHookStateMixin._powersgd_hook`:
  DDP rebuilds its buckets after the first backward, so a resumed run replays the saved layout once);
* post-local SGD: the hook's iteration and the local-SGD start;
* the model averager's step and warm-up, and whether local SGD is on;
* under local SGD, every rank's own optimizer state (local steps make it differ per rank; Lightning keeps
  rank 0's only).

Rank 0 gathers the per-rank states into the checkpoint; on resume each rank takes its own (or rank 0's
when the world size changed, with a message).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

from fsdp_strategies._distributed import in_process_group

if TYPE_CHECKING:
    from torch.distributed.algorithms.model_averaging.averagers import ModelAverager
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["CHECKPOINT_KEY", "LOCAL_SGD_HOOKS", "CommHookStateMixin"]

#: the comm hooks that take local steps between parameter averagings
LOCAL_SGD_HOOKS = ("post_local_sgd", "hierarchical_sgd")
#: checkpoint key of the per-rank hook/averager states
CHECKPOINT_KEY = "ddp_hooks_state"


def _rng_state(rng: np.random.RandomState) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = rng.get_state()
    return {"name": name, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _set_rng_state(rng: np.random.RandomState, state: Mapping[str, Any]) -> None:
    rng.set_state((state["name"], state["keys"].numpy().astype(np.uint32), state["pos"], state["has_gauss"],
                   state["cached_gaussian"]))


class _SavedBucket:
    """A flat gradient buffer presented to a comm hook as a DDP bucket (what ``dist.GradBucket`` offers it).

    Used to replay a checkpoint's bucket layout; ``gradients()`` are views into ``buffer()``, as DDP's are.
    """

    def __init__(
        self, index: int, buffer: torch.Tensor, last: bool, shapes: list[torch.Size] | None = None
    ) -> None:
        self._index, self._buffer, self._last = index, buffer, last
        self._shapes = shapes

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def is_last(self) -> bool:
        return self._last

    def gradients(self) -> list[torch.Tensor]:
        shapes = self._shapes or [self._buffer.shape]
        sizes = [int(torch.Size(shape).numel()) for shape in shapes]
        return [chunk.view(shape) for chunk, shape in zip(self._buffer.split(sizes), shapes)]


class CommHookStateMixin:
    """Strategy mixin of :class:`~fsdp_strategies.strategies.ddp_hooks.DDPHooksStrategy`: the hook's and
    averager's state in checkpoints (see the module docstring). The strategy sets ``comm_hook``,
    ``_hook_state`` (the registered hook's state) and ``_averager``, registers PowerSGD through
    :meth:`_powersgd_hook`, and routes its checkpoint through :meth:`_with_comm_state` (save, every rank)
    and :meth:`_with_own_optimizer_state` / :meth:`_restore_comm_state` (load)."""

    comm_hook: str
    strategy_name: str
    _hook_state: Any = None
    _averager: ModelAverager | None = None
    _local_sgd_enabled: bool = True
    if TYPE_CHECKING:
        root_device: torch.device
        is_global_zero: bool
        global_rank: int
        world_size: int

    def _init_comm_state(self) -> None:
        # PowerSGD: bucket index -> its parameters' positions
        self._bucket_layout: dict[int, tuple[int, ...]] = {}
        # ... as saved, until checked after a resume
        self._restored_layout: dict[int, tuple[int, ...]] | None = None
        self._steps_since_restore = 0

    def _powersgd_hook(self, model: DistributedDataParallel, inner: Callable[..., Any]) -> Callable[..., Any]:
        """torch's PowerSGD hook (``inner``), with its per-bucket state tied to the bucket layout it belongs
        to.

        PowerSGD keeps error feedback and warm-start matrices per bucket *index*. DDP builds its
        buckets twice: at wrap time (parameters in reverse order) and again after the first backward
        (in the order gradients became ready). A fresh run compresses only from ``powersgd_start_iter
        >= 2``, so its state always belongs to the rebuilt layout; a resumed run wraps again and starts
        with the initial layout, where an index names other parameters (a size mismatch at best,
        another parameter's error added silently at worst). So each bucket's parameters (positions in
        ``model.parameters()``) are saved with the state, and the first step after a restore runs the
        hook on the saved buckets: the real buckets' futures wait until the last bucket's gradients
        are ready, then the saved buckets are compressed one after another (as the uninterrupted run
        did), and the results are copied back. Resume stays exact. If the checkpoint's buckets do not
        cover this model's parameters, that step is all-reduced uncompressed; a rebuilt layout that
        still differs from the saved one (another ``bucket_cap_mb``) restarts PowerSGD's state for
        those buckets.
        """
        position = {id(p): i for i, p in enumerate(model.parameters())}
        deferred: list[tuple[torch.futures.Future, torch.Tensor, tuple[int, ...], list[torch.Tensor]]] = []
        dropped: list[int] = []
        current: dict[int, tuple[int, ...]] = {}

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # unannotated: DDP checks hook annotations
            index = bucket.index()
            layout = tuple(position[id(p)] for p in bucket.parameters())
            current[index] = layout
            if bucket.is_last():  # the step's layout is complete: it is what a checkpoint saves
                self._bucket_layout = dict(current)
                current.clear()
            restored = self._restored_layout
            if restored is None:
                return inner(state, bucket)
            if self._steps_since_restore == 0:
                fut: torch.futures.Future = torch.futures.Future()
                deferred.append((fut, bucket.buffer(), layout, bucket.gradients()))
                if bucket.is_last():
                    try:
                        self._run_restored_layout(state, inner, restored, deferred)
                    except BaseException as err:  # DDP waits on every bucket's future: fail them, not hang
                        for waiting, *_ in deferred:
                            if not waiting.done():
                                waiting.set_exception(err)
                        raise
                    finally:
                        deferred.clear()
                    self._steps_since_restore = 1
                return fut
            memories = (state.error_dict, state.p_memory_dict, state.q_memory_dict)
            if restored.get(index) != layout and any(index in memory for memory in memories):
                for memory in memories:
                    memory.pop(index, None)
                dropped.append(index)
            if bucket.is_last():
                self._restored_layout = None  # the rebuilt layout has been checked
                for memory in memories:
                    for gone in [i for i in memory if i not in self._bucket_layout]:
                        del memory[gone]  # an index this layout does not have
                        dropped.append(gone)
                if dropped:
                    rank_zero_info(
                        f"{self.strategy_name}: DDP buckets {sorted(set(dropped))} hold other parameters "
                        "than in the checkpoint (another bucket_cap_mb?): PowerSGD restarts their error "
                        "feedback."
                    )
            return inner(state, bucket)

        return hook

    def _run_restored_layout(self, state: Any, inner: Callable[..., Any],
                             restored: Mapping[int, tuple[int, ...]],
                             deferred: list[tuple[torch.futures.Future, torch.Tensor, tuple[int, ...],
                                                  list[torch.Tensor]]]) -> None:
        """The first step after a restore: run the hook on the checkpoint's buckets, then answer DDP's."""
        grads = {pos: grad for _, _, layout, views in deferred for pos, grad in zip(layout, views)}
        saved_positions = sorted(pos for layout in restored.values() for pos in layout)
        if saved_positions == sorted(grads) and sorted(restored) == list(range(len(restored))):
            last = len(restored) - 1
            # in index order, each finished before the next: as DDP runs them
            for index in range(len(restored)):
                views = [grads[pos] for pos in restored[index]]
                flat = torch.cat([v.reshape(-1) for v in views])
                bucket = _SavedBucket(index, flat, index == last, [v.shape for v in views])
                out = inner(state, bucket).wait()
                if out is not flat:
                    flat.copy_(out)
                for view, result in zip(views, bucket.gradients()):
                    view.copy_(result)
        else:
            rank_zero_warn(
                f"{self.strategy_name}: the checkpoint's PowerSGD buckets do not match this model's "
                "parameters: the first step after resuming is all-reduced uncompressed."
            )
            for i, (_, buffer, _, _) in enumerate(deferred):
                bucket = _SavedBucket(i, buffer, i == len(deferred) - 1)
                default_hooks.allreduce_hook(state.process_group, bucket).wait()
                state.maybe_increase_iter(bucket)  # one count per step, as torch's hook does
        for fut, buffer, _, _ in deferred:
            fut.set_result(buffer)

    def comm_state_dict(self) -> dict[str, Any]:
        """This rank's hook + averager state as tensors and primitives (loadable with ``weights_only``)."""
        out: dict[str, Any] = {"comm_hook": self.comm_hook}
        state = self._hook_state
        if isinstance(state, powerSGD_hook.PowerSGDState):
            out["powersgd"] = {
                "iter": state.iter,
                "error_dict": {int(k): v.detach().cpu().clone() for k, v in state.error_dict.items()},
                "p_memory_dict": {int(k): v.detach().cpu().clone() for k, v in state.p_memory_dict.items()},
                "q_memory_dict": {int(k): v.detach().cpu().clone() for k, v in state.q_memory_dict.items()},
                "rng": _rng_state(state.rng),
                "total_numel_before_compression": state.total_numel_before_compression,
                "total_numel_after_compression": state.total_numel_after_compression,
                # the layout the state belongs to: the checkpoint's until the rebuilt one has been checked
                "bucket_params": {
                    int(k): list(v) for k, v in (self._restored_layout or self._bucket_layout).items()
                },
            }
        elif isinstance(state, PostLocalSGDState):
            out["post_local_sgd"] = {"iter": state.iter, "start_localSGD_iter": state.start_localSGD_iter}
        if self._averager is not None:
            out["averager"] = {"step": self._averager.step,
                               "warmup_steps": getattr(self._averager, "warmup_steps", 0)}
            out["local_sgd_enabled"] = self._local_sgd_enabled
        return out

    def load_comm_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore :meth:`comm_state_dict` so a resumed run compresses and averages on the same schedule."""
        if saved.get("comm_hook") != self.comm_hook:
            rank_zero_info(
                f"{self.strategy_name}: checkpoint has comm_hook={saved.get('comm_hook')!r}, this run uses "
                f"{self.comm_hook!r}; hook state not restored."
            )
            return
        state = self._hook_state
        device = self.root_device
        if isinstance(state, powerSGD_hook.PowerSGDState) and "powersgd" in saved:
            ps = saved["powersgd"]
            state.iter = int(ps["iter"])
            state.error_dict = {int(k): v.to(device) for k, v in ps["error_dict"].items()}
            state.p_memory_dict = {int(k): v.to(device) for k, v in ps["p_memory_dict"].items()}
            state.q_memory_dict = {int(k): v.to(device) for k, v in ps["q_memory_dict"].items()}
            _set_rng_state(state.rng, ps["rng"])
            state.total_numel_before_compression = ps["total_numel_before_compression"]
            state.total_numel_after_compression = ps["total_numel_after_compression"]
            if "bucket_params" in ps:
                self._restored_layout = {int(k): tuple(v) for k, v in ps["bucket_params"].items()}
                self._steps_since_restore = 0
        elif isinstance(state, PostLocalSGDState) and "post_local_sgd" in saved:
            state.iter = int(saved["post_local_sgd"]["iter"])
            state.start_localSGD_iter = int(saved["post_local_sgd"]["start_localSGD_iter"])
        if self._averager is not None and "averager" in saved:
            self._averager.step = int(saved["averager"]["step"])
            if hasattr(self._averager, "warmup_steps"):
                self._averager.warmup_steps = int(saved["averager"]["warmup_steps"])
            self._local_sgd_enabled = bool(saved.get("local_sgd_enabled", self._local_sgd_enabled))


    def _with_comm_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Every rank, while a checkpoint is saved: gather every rank's :meth:`comm_state_dict` (and, under
        local SGD, its optimizer state) to rank 0; rank 0 gets a copy of ``checkpoint`` carrying them, the
        others ``checkpoint`` itself."""
        mine = self.comm_state_dict()
        if self.comm_hook in LOCAL_SGD_HOOKS and not self.is_global_zero:
            # Local steps make every rank's optimizer state its own (AdamW moments of its own gradients);
            # Lightning keeps only rank 0's, which would hand rank 0's moments to every rank on resume.
            mine["optimizer_states"] = apply_to_collection(
                checkpoint.get("optimizer_states", []), torch.Tensor, lambda t: t.detach().cpu())
        if in_process_group() and self.comm_hook in ("powersgd", *LOCAL_SGD_HOOKS):
            gathered: list[Any] = [None] * dist.get_world_size() if self.is_global_zero else []
            dist.gather_object(mine, gathered if self.is_global_zero else None, dst=0)
            per_rank = gathered
        else:
            per_rank = [mine]
        return {**checkpoint, CHECKPOINT_KEY: {"per_rank": per_rank}} if self.is_global_zero else checkpoint

    def _per_rank(self, checkpoint: Mapping[str, Any]) -> list[dict[str, Any]]:
        saved = checkpoint.get(CHECKPOINT_KEY)
        return saved["per_rank"] if saved else []

    def _with_own_optimizer_state(self, checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
        """``checkpoint`` with this rank's own optimizer state (saved under local SGD) instead of rank 0's."""
        per_rank = self._per_rank(checkpoint)
        own = per_rank[self.global_rank] if len(per_rank) == self.world_size else {}
        if "optimizer_states" in own:
            return {**checkpoint, "optimizer_states": own["optimizer_states"]}
        if len(per_rank) != self.world_size and any("optimizer_states" in r for r in per_rank):
            rank_zero_warn(
                f"{self.strategy_name}: the checkpoint holds optimizer states for {len(per_rank)} ranks, "
                f"this run has {self.world_size}: every rank resumes with rank 0's optimizer state."
            )
        return checkpoint

    def _restore_comm_state(self, checkpoint: Mapping[str, Any]) -> None:
        """This rank's hook/averager state from the checkpoint (rank 0's when the world size changed)."""
        per_rank = self._per_rank(checkpoint)
        if not per_rank:
            return
        if len(per_rank) != self.world_size:
            rank_zero_info(f"{self.strategy_name}: checkpoint from {len(per_rank)} ranks, resuming on "
                           f"{self.world_size}: rank 0's hook state is used everywhere.")
        self.load_comm_state_dict(
            per_rank[self.global_rank] if len(per_rank) == self.world_size else per_rank[0]
        )
