"""``budget`` activation checkpointing: keep what fits a memory target and costs most to recompute (eager, no
compile).

How a :class:`BudgetPlanner` chooses, on the real model and batch:

1. **Profile** (first training forward). The blocks start with nothing kept (as ``full``). Before the
   first block of each kind (class) runs its checkpointed forward, the planner runs that block's plain
   forward once more on the same inputs, under a dispatch mode that notes every op call: the bytes of
   the new storages it creates and what recomputing it costs (its FLOPs from ``FlopCounterMode``'s
   formulas; ops without a formula -- norms, activations, elementwise -- one FLOP per output element).
   Ops after the last producer of a tensor autograd saves cost nothing: non-reentrant checkpointing stops
   recomputing before them. The RNG state is forked around it, so dropout draws are unchanged, and the
   autocast cast cache is cleared after it (the real forward must cast as its recomputation will); the
   result is dropped.
   Meanwhile :class:`~fsdp_strategies.memory.saved_bytes.SavedBytes` notes what the whole forward
   creates, tagged inside/outside the checkpointed blocks. When the forward returns, the storages still
   alive give the bytes kept *outside* the blocks (embeddings, head, loss) and the blocks' outputs.
2. **Choose**. Without checkpointing the step would keep ``outside + sum(blocks' plain-forward bytes)``
   (``none``); recomputing everything keeps ``outside + block outputs`` (the floor). The budget is a
   fraction of ``none``. The room above the floor is filled greedily with the op calls of highest
   recompute cost per byte (a call whose output *is* the block's output is free), counting each call
   once per block of its kind. Calls whose outputs a later in-place op overwrites are never kept.
   A budget below the floor is a :class:`BudgetNotMetError` naming the best reachable fraction.
   Every rank must checkpoint alike (a recomputed collective would otherwise hang): ``agree`` (the
   strategy's broadcast from rank 0) makes the choice one.
3. **Measure** (second training forward): the bytes kept by the whole forward with the choice in
   force, next to the prediction.

Gradients are those of no checkpointing (selective checkpointing recomputes the same ops on the same
inputs). Blocks whose forward updates state (BatchNorm running statistics) would update it twice in the
profiled step.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import SAC_IGNORED_OPS

from fsdp_strategies import _torch_seam
from fsdp_strategies.flops.counter import OpFlopCounter
from fsdp_strategies.memory.saved_bytes import (
    SavedBytes,
    input_tensors,
    is_activation_op,
    plain_tensors,
    storage_id,
)
from fsdp_strategies.parallel.activation_checkpointing import (
    block_kind,
    budget_decision,
    checkpointed_blocks,
    inside_checkpointed_block,
)
from fsdp_strategies.parallel.ops import op_name

__all__ = ["BlockProfile", "BudgetChoice", "BudgetNotMetError", "BudgetNotProfiledError", "BudgetPlanner",
           "OpCall", "choose", "profile_block"]


#: Ops whose number of calls in a block can differ between its forward and its recomputation, so that "the
#: k-th call" names different tensors in the two: autocast's casts (its cast cache may hold a weight's cast in
#: one pass and not in the other, e.g. when backward runs inside the autocast region). Never kept; cheap to
#: recompute anyway.
_UNKEYABLE = frozenset({"aten._to_copy"})


class BudgetNotMetError(RuntimeError):
    """The memory budget is below what recomputing every block keeps (a bad ``memory_budget``: an option
    error)."""

    option_error = True


class BudgetNotProfiledError(RuntimeError):
    """No block could be profiled in the first training forward (compiled blocks, or no grad)."""


@dataclass(frozen=True)
class OpCall:
    """One op call in a block's forward: ``(name, index)`` is its key in a decision (``index``-th call of
    ``name``).

    Attributes:
        bytes: new storage it creates that saving it would keep (0 for its block's own output).
        cost: what recomputing it costs: FLOPs, or output elements for ops without a FLOP formula; 0 for the
            ops recomputation never reaches (after the last producer of a tensor autograd saves).
        flops: its FLOPs from the formulas (0 without one, or when recomputation never reaches it).
        keepable: False when a later in-place op overwrites its output (selective checkpointing would refuse
            it).
    """

    name: str
    index: int
    bytes: int
    cost: float
    flops: int
    keepable: bool = True


@dataclass
class BlockProfile:
    """What one block's plain forward did: its op calls, what it keeps for backward, its output's size."""

    kind: str
    calls: list[OpCall]
    none_bytes: int
    output_bytes: int


class _Profiler(SavedBytes):
    """Dispatch mode that notes each op call (see :func:`profile_block`); :class:`OpFlopCounter` runs below
    it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.raw: list[dict[str, Any]] = []
        self.producer: dict[int, int] = {}  # storage key -> index in raw
        self._flops = 0

    def on_flops(self, packet: Any, flops: int) -> None:
        self._flops += flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        # selective checkpointing's policy never sees these: keep the counts alike
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        name = op_name(func)
        index = self.counts.get(name, 0)
        self.counts[name] = index + 1
        if name.endswith("_") or "out" in kwargs:  # in place: whatever made the written tensor cannot be kept
            for t in plain_tensors([*args[:1], kwargs.get("out")]):
                made = self.producer.get(storage_id(t))
                if made is not None:
                    self.raw[made]["keepable"] = False
        self._flops = 0
        out = func(*args, **kwargs)
        outs = list(plain_tensors(out))
        new = self.note(outs, input_tensors(args, kwargs)) if is_activation_op(func) else []
        # now: freed later, maybe
        sizes = {k: _torch_seam.live_storage(self.refs[k][0]).nbytes() for k in new}
        self.raw.append({"name": name, "index": index, "new": sizes, "flops": self._flops,
                         "elements": sum(t.numel() for t in outs), "keepable": True})
        for key in new:
            self.producer[key] = len(self.raw) - 1
        return out


def profile_block(
    kind: str, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> BlockProfile:
    """Run ``forward(*args, **kwargs)`` once (grad enabled, RNG forked) and note its op calls; the result is
    dropped."""
    profiler = _Profiler()
    saved: set[int] = set()

    # what autograd keeps: recomputation must reach its producer
    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.update(storage_id(t) for t in plain_tensors(tensor))
        # a detached alias keeps the storage alive as autograd would; the tensor itself would tie an output to
        # its own grad_fn, a cycle only a backward breaks -- this graph is dropped without one (measured: the
        # profiled block's activations then stayed alive through the step)
        return tensor.detach()

    devices = (
        [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    )
    with (torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          OpFlopCounter(profiler.on_flops), profiler):
        out = forward(*args, **kwargs)
    # Autocast caches its casts of the weights for the rest of the region: the block's real forward would then
    # dispatch fewer casts than its recomputation (which starts with an empty cache) and selective
    # checkpointing would find casts it never stored. Forget what this extra forward cached.
    torch.clear_autocast_cache()
    out_keys = {storage_id(t) for t in plain_tensors(_torch_seam.tree_leaves(out))}
    none_bytes = profiler.alive()
    output_bytes = profiler.alive(ids=out_keys)
    del out
    # Non-reentrant checkpointing stops recomputing once every tensor autograd saved is back: the ops after
    # the last producer of one (typically the block's last matmul and residual add) never run again -- keeping
    # their outputs would cost memory and save nothing.
    last_needed = max(
        (profiler.producer[k] for k in saved if k in profiler.producer), default=len(profiler.raw) - 1
    )
    calls = []
    for position, raw in enumerate(profiler.raw):
        extra = sum(n for k, n in raw["new"].items() if k not in out_keys)
        recomputed = position <= last_needed
        cost = (raw["flops"] or (raw["elements"] if raw["new"] else 0)) if recomputed else 0
        calls.append(OpCall(raw["name"], raw["index"], extra, float(cost), raw["flops"] if recomputed else 0,
                            raw["keepable"]))
    return BlockProfile(kind, calls, none_bytes, output_bytes)


@dataclass
class BudgetChoice:
    """What ``budget`` keeps and what it predicts (bytes are per rank, for one forward).

    Attributes:
        keep: block kind -> op-call keys kept.
        memory_budget: the target as a fraction of ``none_bytes``.
        none_bytes: kept without any checkpointing (outside + every block's plain forward).
        floor_bytes: kept when every block recomputes everything (outside + block outputs).
        predicted_bytes: kept with this choice.
        recompute_flops: FLOPs recomputed in backward with this choice (formula FLOPs, all blocks).
        full_recompute_flops: the same if everything were recomputed (``full``).
        kept_calls: kind -> readable list of the calls kept.
    """

    keep: dict[str, frozenset[tuple[str, int]]]
    memory_budget: float
    none_bytes: int
    floor_bytes: int
    predicted_bytes: int
    recompute_flops: int
    full_recompute_flops: int
    kept_calls: dict[str, list[str]] = field(default_factory=dict)


def choose(profiles: dict[str, BlockProfile], counts: dict[str, int], outside_bytes: int, outputs_bytes: int,
           memory_budget: float) -> BudgetChoice:
    """The calls to keep so that the step keeps at most ``memory_budget`` of ``none`` while recomputing
    least."""
    none = outside_bytes + sum(counts[k] * p.none_bytes for k, p in profiles.items())
    floor = outside_bytes + outputs_bytes
    target = memory_budget * none
    if floor > target:
        raise BudgetNotMetError(
            "ActivationCheckpointing(mode='budget'): "
            f"memory_budget={memory_budget:g} cannot be met: even recomputing "
            f"everything in every block keeps {floor / 2**20:.2f} MiB = {floor / max(none, 1):.3f} of the "
            f"{none / 2**20:.2f} MiB kept without checkpointing "
            f"({outside_bytes / 2**20:.2f} MiB outside the blocks "
            f"-- embeddings, head, loss -- and {outputs_bytes / 2**20:.2f} MiB of block outputs). Fix: "
            f"memory_budget >= {math.ceil(1000 * floor / max(none, 1)) / 1000:g}, "
            "or offload: true, or checkpoint more "
            "of the model (block_class_names)."
        )
    candidates = [(kind, call) for kind, p in profiles.items() for call in p.calls
                  if call.keepable and call.cost > 0 and (call.bytes > 0 or call.flops > 0)
                      and call.name not in _UNKEYABLE]
    candidates.sort(key=lambda kc: (-(kc[1].cost / kc[1].bytes if kc[1].bytes else math.inf), kc[0],
                                    kc[1].name, kc[1].index))
    used, keep = 0.0, {kind: set() for kind in profiles}
    for kind, call in candidates:
        extra = counts[kind] * call.bytes
        # whole bytes: a target computed as a fraction may round just below
        if floor + used + extra <= target + 1:
            keep[kind].add((call.name, call.index))
            used += extra
    recompute = sum(
        counts[k] * c.flops for k, p in profiles.items() for c in p.calls if (c.name, c.index) not in keep[k]
    )
    full = sum(counts[k] * c.flops for k, p in profiles.items() for c in p.calls)
    return BudgetChoice(
        keep={k: frozenset(v) for k, v in keep.items()}, memory_budget=memory_budget, none_bytes=int(none),
        floor_bytes=int(floor), predicted_bytes=int(floor + used), recompute_flops=int(recompute),
        full_recompute_flops=int(full),
        kept_calls={k: [f"{n}#{i}" for n, i in sorted(v)] for k, v in keep.items()},
    )


class BudgetPlanner:
    """Drives ``budget`` checkpointing over a model's first two training forwards (see the module docstring).

    Args:
        model: a module whose blocks were checkpointed with ``mode="budget"``.
        memory_budget: target bytes kept for backward, as a fraction (0..1] of those kept without
            checkpointing.
        agree: makes every rank's result one (e.g. a broadcast from rank 0): given this rank's choice or its
            :class:`BudgetNotMetError`, returns the one to use; ``None``: single process.
        log: called with a line after choosing and after measuring.

    Use: ``with planner.forward(): loss = step(batch)`` around each training forward (backward after the
    block).
    """

    def __init__(self, model: nn.Module, memory_budget: float, *,
                 agree: Callable[[BudgetChoice | BaseException], BudgetChoice | BaseException] | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        decision = budget_decision(model)
        if decision is None:
            raise ValueError(
                "BudgetPlanner: the model has no blocks checkpointed with mode='budget'. Fix: call "
                "apply_activation_checkpointing(model, 'budget') first."
            )
        self.decision = decision
        self.memory_budget = memory_budget
        self.counts = Counter(block_kind(block) for block in checkpointed_blocks(model))
        self.agree, self.log = agree, log
        self.phase = "profile"
        self.profiles: dict[str, BlockProfile] = {}
        self.choice: BudgetChoice | None = None
        self.measured_bytes: int | None = None
        #: the measured bytes saved outside the checkpointed blocks and inside them (where a surprise is)
        self.measured_by_tag: dict[str, int] = {}

    @property
    def done(self) -> bool:
        """Whether the choice is made and measured."""
        return self.phase == "done"

    def _profile(
        self, block: nn.Module, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        kind = block_kind(block)
        if kind not in self.profiles:
            self.profiles[kind] = profile_block(kind, inner, args, kwargs)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around one training forward: profiles (first), measures (second), nothing after that.

        The forward's outputs must still be alive when the block ends (call backward after it).
        """
        if self.done:
            yield
            return
        tracker = SavedBytes(tag=lambda: "block" if inside_checkpointed_block() else "outside")
        if self.phase == "profile":
            self.decision.on_first_call = self._profile
        try:
            with tracker:
                yield
        finally:
            self.decision.on_first_call = None
        self._finish(tracker)

    def _finish(self, tracker: SavedBytes) -> None:
        if self.phase == "profile":
            outside, outputs = tracker.alive(tag="outside"), tracker.alive(tag="block")
            if not self.profiles:
                self.phase = "done"
                raise BudgetNotProfiledError(
                    "ActivationCheckpointing(mode='budget'): no "
                    "checkpointed block ran a training forward in the first "
                    "step, so there was nothing to profile (the blocks "
                    "ran compiled -- compile_blocks or torch.compile "
                    "trace past the profiling hook -- or the forward "
                    "ran under torch.no_grad). The blocks stay fully "
                    "checkpointed. Fix: do not compile the blocks with mode='budget', or use a fixed mode "
                    "(selective_op, full) with compiled blocks."
                )
            missing = sorted(set(self.counts) - set(self.profiles))
            # a block kind not run in this forward keeps nothing (as full) until a later step runs it
            if missing:
                self.profiles.update({k: BlockProfile(k, [], 0, 0) for k in missing})
            result: BudgetChoice | BaseException
            try:
                result = choose(self.profiles, self.counts, outside, outputs, self.memory_budget)
            except BudgetNotMetError as err:
                result = err
            if self.agree is not None:  # rank 0's result, error included, so that every rank does the same
                result = self.agree(result)
            if isinstance(result, BaseException):
                self.phase = "done"
                raise result
            choice = self.choice = result
            self.decision.keep = dict(choice.keep)
            self.phase = "measure"
            if self.log is not None:
                kept = sum(len(v) for v in choice.keep.values())
                self.log(
                    "ActivationCheckpointing(mode='budget', "
                    f"memory_budget={choice.memory_budget:g}): keeping {kept} op "
                    f"output(s) per block set {choice.kept_calls}; "
                    f"predicted {choice.predicted_bytes / 2**20:.2f} MiB "
                    f"kept for backward = {choice.predicted_bytes / max(choice.none_bytes, 1):.3f} of "
                    f"{choice.none_bytes / 2**20:.2f} MiB without "
                    "checkpointing (floor with everything recomputed: "
                    f"{choice.floor_bytes / max(choice.none_bytes, 1):.3f}); recomputes "
                    f"{choice.recompute_flops / 1e9:.4g} of "
                    f"{choice.full_recompute_flops / 1e9:.4g} GFLOP that full would"
                )
        else:
            self.measured_bytes = tracker.alive()
            self.measured_by_tag = {tag: tracker.alive(tag=tag) for tag in ("outside", "block")}
            self.phase = "done"
            if self.log is not None and self.choice is not None:
                self.log(
                    "ActivationCheckpointing(mode='budget'): measured "
                    f"{self.measured_bytes / 2**20:.2f} MiB kept for "
                    f"backward (predicted {self.choice.predicted_bytes / 2**20:.2f} MiB; "
                    f"{self.measured_bytes / max(self.choice.none_bytes, 1):.3f} of no checkpointing, budget "
                    f"{self.choice.memory_budget:g})"
                )

    def report(self) -> dict[str, Any]:
        """The choice, the prediction and the measurement, as plain values (for logs and tests)."""
        c = self.choice
        if c is None:
            return {"phase": self.phase}
        return {"phase": self.phase, "memory_budget": c.memory_budget, "none_bytes": c.none_bytes,
                "floor_bytes": c.floor_bytes, "predicted_bytes": c.predicted_bytes,
                "measured_bytes": self.measured_bytes, "measured_by_tag": dict(self.measured_by_tag),
                "recompute_flops": c.recompute_flops, "full_recompute_flops": c.full_recompute_flops,
                "kept_calls": c.kept_calls}
