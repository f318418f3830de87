"""Loading a checkpoint into an FSDP2-sharded model, from a sharded folder or from a full single file.

Why: a user moving from ``ddp`` to ``fsdp2``/``hsdp`` should just resume. Lightning's
``ModelParallelStrategy`` reads a full file, but re-keys its optimizer state by the *module's*
parameter order (FSDP1's ``rekey_optim_state_dict``) while ``torch.optim.Optimizer.state_dict``
numbers parameters in the *optimizer's* order (``configure_optimizers``' groups): with weight-decay
groups that dies inside ``set_optimizer_state_dict`` with a size mismatch, and where the shapes
happen to agree it would load moments into the wrong parameters silently.

Here a full file is converted the way ``Optimizer.load_state_dict`` itself maps state: the
``i``-th id of saved group ``g`` is the ``i``-th parameter of the current optimizer's group ``g``
(this holds for both numbering conventions in circulation: torch's and Lightning's FSDP re-keyed
one, since both keep each group's parameter list in the optimizer's order). Before anything is
applied, the model's parameter names and global shapes, the optimizers' group sizes, every state
tensor's shape and -- where the checkpoint records them -- the parameter names behind the ids are
compared, and a mismatch stops the load with an error naming both formats and what differs.
Weights are then placed with ``torch.distributed.checkpoint.state_dict``'s
``set_model_state_dict`` / ``set_optimizer_state_dict`` (``full_state_dict=True``): every rank keeps
only its shard.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from fsdp_strategies._distributed import all_gather_object, rank_and_world
from fsdp_strategies._options import listing
from fsdp_strategies.checkpoint.atomic import LIGHTNING_META_FILE
from fsdp_strategies.checkpoint.integrity import CheckpointIntegrityError
from fsdp_strategies.checkpoint.key_mismatch import KeyMismatch, StateMismatchError
from fsdp_strategies.checkpoint.object_store import (
    RemoteCheckpoint,
    read_remote_meta,
    read_version_metadata,
    verify_remote,
)
from fsdp_strategies.checkpoint.safe_load import (
    DCP_METADATA_FILE,
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    load_dcp_metadata,
    safe_fsspec_reader,
    safe_torch_load,
)
from fsdp_strategies.checkpoint.verify import load_full_file, verify_folder_before_load

__all__ = ["PARAM_NAMES_KEY", "CheckpointMismatchError", "clean_name", "load_into_sharded_model",
           "load_remote_into_sharded_model", "optimizer_param_names"]

#: Checkpoints written by this package's full-file saves record, per optimizer and group, the
#: names of the parameters behind the optimizer-state ids, so a resume can check the mapping.
PARAM_NAMES_KEY = "fsdp_strategies_optimizer_param_names"
FULL_FORMAT = "a full-state-dict file (one torch.save file, as `ddp`, `ddp_hooks` or `fsdp2` with " \
              "save_distributed_checkpoint=False write)"
SHARDED_FORMAT = "a sharded DCP folder (as `fsdp2`, `hsdp` and `ft_hsdp` write)"
_WRAPPER_TOKENS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_SHOW = 4
# State fields that torch's optimizers keep with the parameter's shape (factored ones, e.g. Adafactor's
# row/column variances, legitimately differ and are not compared)
_PARAM_SHAPED_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                                 "grad_avg", "acc_delta", "sum", "prev", "ax", "exp_inf"})


class CheckpointMismatchError(StateMismatchError):
    """The checkpoint was written for a different model or optimizer layout than the one resuming."""


def clean_name(name: str) -> str:
    for token in _WRAPPER_TOKENS:
        name = name.replace(token, "")
    return name


def optimizer_param_names(module: nn.Module, optimizers: Sequence[Optimizer]) -> list[list[list[str]]]:
    """For each optimizer, for each param group, the parameter names in the group's order."""
    names = {id(p): clean_name(n) for n, p in module.named_parameters(remove_duplicate=False)}
    return [
        [[names.get(id(p), f"<unnamed #{i}>") for i, p in enumerate(g["params"])] for g in opt.param_groups]
        for opt in optimizers
    ]


def _shape(t: Any) -> tuple[int, ...] | None:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def model_mismatch(expected: Mapping[str, tuple[int, ...] | None],
                   found: Mapping[str, tuple[int, ...] | None], *, strict: bool) -> list[str]:
    """What differs between the model's state (name -> global shape) and the checkpoint's."""
    return KeyMismatch.between(expected, found, strict=strict).problems(shown=_SHOW)


def _mismatch(
    source: Path | str, source_format: str, target: str, what: str, problems: list[str], fix: str
) -> Exception:
    return CheckpointMismatchError(
        f"Cannot resume from {source} ({source_format}) into this {target} run: the {what} differ -- "
        f"{'; '.join(problems)}. {fix}"
    )


def optimizer_state_by_name(saved: Mapping[str, Any], optimizer: Optimizer, current_names: list[list[str]],
                            shapes: Mapping[str, tuple[int, ...] | None],
                            recorded_names: list[list[str]] | None = None) -> tuple[dict[str, Any],
                                                                                    list[str]]:
    """A full optimizer state keyed by parameter name (what ``set_optimizer_state_dict`` takes), mapped
    through the current optimizer's groups; plus the list of problems found (empty: safe to load)."""
    problems: list[str] = []
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    state = saved.get("state", {}) if isinstance(saved, Mapping) else None
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        return {}, ["the optimizer state has no 'param_groups'/'state' (not a torch optimizer state_dict)"]
    if len(groups) != len(optimizer.param_groups):
        return {}, [f"the checkpoint's optimizer has {len(groups)} parameter group(s), this one "
                    f"{len(optimizer.param_groups)}"]
    by_id: dict[Any, str] = {}
    for g, (saved_group, names) in enumerate(zip(groups, current_names)):
        ids = list(saved_group.get("params", []))
        if len(ids) != len(names):
            problems.append(f"group {g} holds {len(ids)} parameters in the checkpoint, {len(names)} now")
            continue
        live = optimizer.param_groups[g]
        if ids and all(isinstance(i, str) for i in ids):  # keyed by name already
            saved_labels, now_labels = ids, names
        elif saved_group.get("param_names"):  # an optimizer built from named parameters
            saved_labels, now_labels = saved_group["param_names"], live.get("param_names") or names
        elif recorded_names is not None and g < len(recorded_names):  # recorded by this package's saves
            saved_labels, now_labels = recorded_names[g], names
        # torch's plain numbering: the position in the group is all there is (as in Optimizer.load_state_dict)
        else:
            saved_labels, now_labels = None, names
        if saved_labels is not None:
            diff = [f"#{i}: {a} vs {b}" for i, (a, b) in enumerate(zip(saved_labels, now_labels))
                    if clean_name(str(a)) != clean_name(str(b))]
            if len(saved_labels) != len(now_labels) or diff:
                problems.append(f"group {g} maps its state to other parameters than the checkpoint did "
                                f"(checkpoint vs now: {listing(diff, _SHOW) or 'different lengths'})")
        by_id.update(zip(ids, names))
    unknown = [str(k) for k in state if k not in by_id]
    if unknown:
        problems.append(f"state for parameter id(s) that no group lists: {listing(unknown, _SHOW)}")
    converted: dict[str, Any] = {}
    bad_shapes = []
    for key, entry in state.items():
        name = by_id.get(key)
        if name is None:
            continue
        for field, value in (entry.items() if isinstance(entry, Mapping) else ()):
            shape = _shape(value)
            if (
                field in _PARAM_SHAPED_STATE
                and shape
                and shapes.get(name) is not None
                and shape != shapes[name]
            ):
                bad_shapes.append(f"'{field}' of {name} is {list(shape)}, the parameter {list(shapes[name])}")
        converted[name] = entry
    if bad_shapes:
        problems.append(f"state shapes differ from their parameters: {listing(bad_shapes, _SHOW)}")
    out_groups = []
    for saved_group, names, live in zip(groups, current_names, optimizer.param_groups):
        group = {k: v for k, v in saved_group.items() if k not in ("params", "param_names")}
        if "param_names" in live:
            group["param_names"] = list(live["param_names"])
        group["params"] = list(names)
        out_groups.append(group)
    return {"state": converted, "param_groups": out_groups}, problems


def _model_shapes(module: nn.Module) -> dict[str, tuple[int, ...] | None]:
    return {clean_name(k): _shape(v) for k, v in module.state_dict().items()}


def _load_full(module: nn.Module, optimizers: Sequence[Optimizer], path: Path | RemoteCheckpoint, *,
               strict: bool, target: str) -> dict[str, Any]:
    checkpoint = load_full_file(path)
    if not isinstance(checkpoint.get("state_dict"), Mapping):
        raise CheckpointMismatchError(
            f"{path} has no 'state_dict' entry: not a checkpoint written by a Lightning strategy."
        )
    model_state = checkpoint.pop("state_dict")
    expected = _model_shapes(module)
    problems = model_mismatch(expected, {k: _shape(v) for k, v in model_state.items()}, strict=strict)
    if problems:
        raise _mismatch(path, FULL_FORMAT, target, "model parameters", problems,
                        "Fix: resume with the model configuration the checkpoint was written with.")
    saved_optimizers = checkpoint.get("optimizer_states") or []
    converted = []
    if optimizers:
        if len(saved_optimizers) != len(optimizers):
            raise _mismatch(path, FULL_FORMAT, target, "optimizers", [
                f"the checkpoint holds {len(saved_optimizers)} "
                "optimizer state(s), configure_optimizers returns "
                f"{len(optimizers)}"], "Fix: resume with the same configure_optimizers.")
        recorded = checkpoint.get(PARAM_NAMES_KEY)
        names = optimizer_param_names(module, optimizers)
        problems = []
        for i, (saved, opt) in enumerate(zip(saved_optimizers, optimizers)):
            state, found = optimizer_state_by_name(saved, opt, names[i], expected,
                                                   recorded[i] if recorded and i < len(recorded) else None)
            problems += [f"optimizer {i}: {p}" for p in found]
            converted.append(state)
        if problems:
            raise _mismatch(path, FULL_FORMAT, target, "optimizer states", problems,
                            "Fix: resume with the same model and "
                            "configure_optimizers (parameter groups in the same "
                            "order) as the run that wrote the checkpoint.")
    # nothing is applied before every check above has passed
    set_model_state_dict(
        module, dict(model_state), options=StateDictOptions(full_state_dict=True, strict=strict)
    )
    for opt, state in zip(optimizers, converted):
        set_optimizer_state_dict(module, opt, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True, strict=strict))
    return checkpoint


def _load_sharded(module: nn.Module, optimizers: Sequence[Optimizer], path: Path, *, strict: bool,
                  target: str) -> dict[str, Any]:
    verify_folder_before_load(path)  # every byte as written, before anything is unpickled

    def meta() -> dict[str, Any]:
        return safe_torch_load(path / LIGHTNING_META_FILE, name=str(path / LIGHTNING_META_FILE))

    return _apply_sharded(module, optimizers, str(path), load_dcp_metadata(path),
                          lambda: SafeFileSystemReader(path), meta, strict=strict, target=target)


def _apply_sharded(module: nn.Module, optimizers: Sequence[Optimizer], where: str, metadata: Any,
                   reader: Callable[[], Any], meta: Callable[[], dict[str, Any]], *, strict: bool,
                   target: str) -> dict[str, Any]:
    """Check a verified DCP checkpoint's layout against ``module``, then load it (``reader``: a new DCP
    storage reader; ``meta``: Lightning's ``meta.pt``, read with the restricted loader)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = "state_dict."
    found = {k[len(prefix):]: (tuple(m.size) if isinstance(m, TensorStorageMetadata) else None)
             for k, m in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    problems = model_mismatch(_model_shapes(module), found, strict=strict)
    if problems:
        raise _mismatch(where, SHARDED_FORMAT, target, "model parameters", problems,
                        "Fix: resume with the model configuration the checkpoint was written with.")
    planner = {"allow_partial_load": not strict}
    model_state = {"state_dict": get_model_state_dict(module)}
    dcp.load(model_state, storage_reader=reader(), planner=SafeLoadPlanner(**planner))
    set_model_state_dict(module, model_state["state_dict"], options=StateDictOptions(strict=strict))
    for i, opt in enumerate(optimizers):
        key = f"optimizer_{i}"
        opt_state = {key: get_optimizer_state_dict(module, opt)}
        dcp.load(opt_state, storage_reader=reader(), planner=SafeLoadPlanner(**planner))
        set_optimizer_state_dict(module, opt, optim_state_dict=opt_state[key])
    try:
        return meta()
    except UnsafeCheckpointError:
        raise
    except Exception as err:
        raise CheckpointIntegrityError(
            f"{where}/{LIGHTNING_META_FILE} is unreadable ({type(err).__name__}: {err}).") from None


def load_remote_into_sharded_model(module: nn.Module, optimizers: Sequence[Optimizer],
                                   ckpt: RemoteCheckpoint, *, strict: bool = True,
                                   target: str = "fsdp2") -> dict[str, Any]:
    """Every rank: :func:`load_into_sharded_model` for a checkpoint on object storage
    (:mod:`~fsdp_strategies.checkpoint.object_store`): only a committed one (its manifest exists), verified
    object by object (the ranks share the hashing) before anything is unpickled; or a full-file checkpoint
    there (one object), checked against its embedded digest."""
    if ckpt.is_full_file():
        return _load_full(module, optimizers, ckpt, strict=strict, target=target)
    rank, world = rank_and_world()
    result, found = verify_remote(ckpt, rank=rank, world_size=world, all_gather=all_gather_object)
    version = found.version  # no manifest: CheckpointNotCommittedError
    result.require_intact()
    data_url = ckpt.url_of(version)
    return _apply_sharded(module, optimizers, ckpt.url, read_version_metadata(ckpt, version),
                          lambda: safe_fsspec_reader(data_url, ckpt.storage_options),
                          lambda: read_remote_meta(ckpt, version), strict=strict, target=target)


def load_into_sharded_model(module: nn.Module, optimizers: Sequence[Optimizer], path: str | os.PathLike[str],
                            *, strict: bool = True, target: str = "fsdp2") -> dict[str, Any]:
    """Every rank: load a sharded folder or a full file into the FSDP2 ``module`` and its optimizers.

    Verifies the checksums first, reads without running code from the files, checks the layout
    (model names/shapes, optimizer groups/state) and only then applies it. Returns the rest of the
    checkpoint (loops, callbacks, schedulers...) for Lightning to restore.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / DCP_METADATA_FILE).is_file() and not any(path.glob("*.distcp")):
            raise CheckpointMismatchError(f"{path} is a folder but not a checkpoint: it has no DCP "
                                          f"'{DCP_METADATA_FILE}' file.")
        return _load_sharded(module, optimizers, path, strict=strict, target=target)
    if path.is_file():
        return _load_full(module, optimizers, path, strict=strict, target=target)
    raise FileNotFoundError(f"{path}: no such checkpoint file or folder.")
