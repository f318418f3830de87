"""Parameters ``fully_shard`` cannot shard, kept whole on every rank and trained as data parallel.

Why: FSDP2 shards every parameter on dim 0, so a 0-d parameter -- CLIP's ``logit_scale``, SigLIP's
``logit_bias``, any learned temperature -- makes ``fully_shard`` raise ("fully_shard doesn't support
scalar parameters"), from inside torch, after the process group started. Lightning's ``ddp`` trains
such models. Reshaping them to ``[1]`` would change the model's ``state_dict`` and broadcasting
(a scalar loss would become shape ``[1]``), so they are left as they are instead:

* :func:`scalar_params` finds them; :func:`~fsdp_strategies.parallel.parallelize.apply_fsdp` passes
  them to every ``fully_shard`` call as ``ignored_params``: they stay plain tensors, the same full
  value on every rank, with the model's ``state_dict`` keys and shapes unchanged.
* :class:`ReplicatedParams` makes them train as the sharded parameters do: a gradient hook averages
  each one's gradient over the whole data-parallel mesh (``all_reduce`` SUM over each mesh dimension,
  then a division by the mesh size: the mean FSDP2's reduce-scatter gives the sharded gradients, over
  both dimensions of an HSDP mesh; SUM because gloo has no AVG), in the policy's ``reduce_dtype``
  when it has one. At the root's first forward -- FSDP2's own lazy-init point, after any meta-device
  materialisation -- they are broadcast from the mesh's first rank, as ``DistributedDataParallel``
  does when it wraps a model, so ranks that initialised them differently (an unseeded ``reset_parameters``)
  start from one value.
* :meth:`ReplicatedParams.set_all_reduce_hook` mirrors ``FSDPModule.set_all_reduce_hook``: a hook that
  sees each averaged gradient (in place) before it is accumulated; :func:`set_all_reduce_hook` sets one
  hook on every FSDP unit and on the replicated parameters (``ft_hsdp`` averages across replica groups
  there). After the hook every rank takes the first rank's result: torchft decides per rank which groups
  take part in a step (at a heal), which a sharded parameter (on one rank) tolerates and a replicated one
  would not (its copies would drift apart).

Everything else treats them as ordinary parameters: the optimizer steps them on every rank with the
same averaged gradient (so they stay equal), their optimizer state is a plain tensor, DCP writes them
once (identical on every rank) and reads them on every rank, a full ``state_dict`` and the export
include them, gradient clipping counts them once in the total norm.

Limits:

* The averaging runs for every backward, also on the non-final micro-batches of gradient accumulation
  (where FSDP2 skips its reduce-scatter): the sum of the micro-batches' means is the mean of their sum,
  at the cost of a few bytes per micro-batch.
* One small ``all_reduce`` per scalar per backward (not bucketed); models have a handful of them.
* As under ``ddp`` without ``find_unused_parameters``, every rank must use each trainable scalar in
  each backward (the gradient hooks are the collectives); frozen ones (``requires_grad=False``) get no hook.
* The mixed-precision policy does not cast them: they compute in their own dtype (under ``bf16-mixed``
  an fp32 0-d tensor does not promote bf16 activations; autocast handles the rest).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_strategies.parallel.outside_calls import nested_unit_params

__all__ = ["ReplicatedParams", "replicate_params", "replicated_params", "scalar_params",
           "set_all_reduce_hook"]

#: the root module -> its replicated parameters (one handle per model; weak: it goes with the model)
_HANDLES: weakref.WeakKeyDictionary[nn.Module, ReplicatedParams] = weakref.WeakKeyDictionary()


def scalar_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``model``'s 0-d parameters (name, parameter), each once; DTensors (already sharded) excluded."""
    return [(name, p) for name, p in model.named_parameters() if p.ndim == 0 and not isinstance(p, DTensor)]


class ReplicatedParams:
    """Whole copies of ``root``'s parameters ``names`` on every rank of ``mesh``, trained with the mean
    gradient.

    The parameters are looked up by name at the root's first forward, not kept from construction:
    materialising a meta-device model (``to_empty``) replaces the ``Parameter`` objects.

    Args:
        root: the model's root module (its first forward broadcasts and installs the gradient hooks).
        names: the parameters' names in ``root.named_parameters()``.
        mesh: the data-parallel ``DeviceMesh`` (1-D: FSDP, 2-D: HSDP); gradients are averaged over all of it.
        reduce_dtype: dtype the gradients are averaged in (``None``: their own), as
            ``MixedPrecisionPolicy``'s.
    """

    def __init__(self, root: nn.Module, names: Sequence[str], mesh: Any,
                 reduce_dtype: torch.dtype | None = None) -> None:
        self.names = list(names)
        self.groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
        self.size = int(mesh.size())
        self.reduce_dtype = reduce_dtype
        self._root = weakref.ref(root)
        self._all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self._grad_hooks: list[Any] = []
        self._first_forward = root.register_forward_pre_hook(self._on_first_forward)

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters as the root holds them now."""
        root = self._root()
        if root is None:
            return []
        named = dict(root.named_parameters())
        return [named[name] for name in self.names]

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None) -> None:
        """Call ``hook(grad)`` on each averaged gradient (modifying it in place) before it is accumulated.

        Args:
            hook: the hook, as for ``FSDPModule.set_all_reduce_hook``; ``None`` removes it.
        """
        self._all_reduce_hook = hook

    def _average(self, grad: torch.Tensor) -> torch.Tensor:
        out = grad.to(self.reduce_dtype or grad.dtype, copy=True)
        if self.size > 1:
            for group in self.groups:
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
            out.div_(self.size)
        if self._all_reduce_hook is not None:
            self._all_reduce_hook(out)
            # The hook's result can differ between this mesh's ranks: torchft decides per rank which replica
            # groups take part (at a heal, rank 0's peer may be healing while rank 1's is not). A sharded
            # parameter lives on one rank, so that is consistent; a replicated one must stay equal on all.
            self.agree([out])
        return out.to(grad.dtype)

    def agree(self, tensors: Sequence[torch.Tensor]) -> None:
        """Give every rank of the mesh the first rank's values of ``tensors`` (in place; one broadcast per
        tensor and mesh dimension): after a hook whose result may differ between ranks."""
        for group in self.groups:  # one dimension after the other: (r, s) <- (r, 0) <- (0, 0)
            if dist.get_world_size(group) > 1:
                src = dist.get_global_rank(group, 0)
                for t in tensors:
                    dist.broadcast(t, src=src, group=group)

    @torch.no_grad()
    def broadcast(self) -> None:
        """Give every rank the values of the mesh's first rank (one broadcast per mesh dimension)."""
        self.agree([p.detach() for p in self.params])

    def _on_first_forward(self, *_: Any) -> None:
        self._first_forward.remove()
        params = self.params
        with torch.inference_mode(False):
            self.broadcast()
        self._grad_hooks = [p.register_hook(self._average) for p in params if p.requires_grad]

    def remove(self) -> None:
        """Remove the gradient hooks (and the first-forward hook, if it has not run)."""
        self._first_forward.remove()
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []


def replicate_params(model: nn.Module, mesh: Any, params: Sequence[nn.Parameter], *,
                     reduce_dtype: torch.dtype | None = None) -> ReplicatedParams | None:
    """Keep ``params`` replicated over ``mesh`` (see the module docstring); ``None`` if there are none.
    Idempotent.

    Args:
        model: the root module (the handle is found from it with :func:`replicated_params`).
        mesh: the data-parallel ``DeviceMesh`` the rest of ``model`` is sharded over.
        params: the parameters ``fully_shard`` ignored (``ignored_params``).
        reduce_dtype: dtype the gradients are averaged in (``None``: their own).
    """
    if model in _HANDLES:
        return _HANDLES[model]
    if not params:
        return None
    names = {id(p): name for name, p in model.named_parameters()}
    handle = ReplicatedParams(model, [names[id(p)] for p in params], mesh, reduce_dtype)
    _HANDLES[model] = handle
    return handle


def replicated_params(model: nn.Module) -> ReplicatedParams | None:
    """The :class:`ReplicatedParams` of a model wrapped by ``apply_fsdp`` (``None``: it has none).

    Args:
        model: the root module passed to ``apply_fsdp`` / ``parallelize``.
    """
    return _HANDLES.get(model)


GradHook = Callable[[torch.Tensor], None]


def set_all_reduce_hook(model: nn.Module, hook: GradHook,
                        unit_hook: Callable[[list[nn.Parameter]], GradHook] | None = None) -> None:
    """Set ``hook`` on every gradient reduction of ``model``: each FSDP unit's and the replicated parameters'.

    Args:
        model: the root module passed to ``apply_fsdp`` / ``parallelize``.
        hook: ``hook(reduced_grad)``, modifying it in place (``FSDPModule.set_all_reduce_hook``'s contract).
        unit_hook: if given, each FSDP unit gets ``unit_hook(params)`` instead, ``params`` the parameters
            that unit shards (not its nested units', not the replicated ones).
    """
    from torch.distributed.fsdp import FSDPModule

    replicated = replicated_params(model)
    skip = {id(p) for p in replicated.params} if replicated is not None else set()
    units = [sub for sub in model.modules() if isinstance(sub, FSDPModule)]
    for unit in units:
        if unit_hook is None:
            unit.set_all_reduce_hook(hook)
            continue
        left_out = nested_unit_params(unit) | skip
        unit.set_all_reduce_hook(unit_hook([p for p in unit.parameters() if id(p) not in left_out]))
    if replicated is not None:
        replicated.set_all_reduce_hook(hook)
