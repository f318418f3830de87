"""The Lightning seam: every use of a Lightning private name in this package goes through this module.

Why: ``lightning>=2.6,<2.7`` is the supported range, and Lightning may rename or change any private
name in a minor release. Keeping each access here -- one small function per access, named after
what it does, its docstring naming the private name it uses -- means an upgrade is checked in one
file, and ``tests/test_lightning_seam.py`` has one test per access (named after the private name)
that fails loudly when the installed Lightning changes it. Nothing outside this module imports an
underscore name from ``lightning`` or reads/writes an underscore attribute of a Lightning object.

Where a public API does the job it is used instead (and is not here):

* Option validation once devices, nodes and precision are known, before any process starts: the
  strategies override the public ``set_world_ranks`` (the accelerator connector calls it right
  before the private ``_configure_launcher``, and again in every process before the process group).
* DDP comm hooks: ``ddp_hooks`` overrides the public ``DDPStrategy.configure_ddp`` (wrap, then
  register) instead of the private ``_register_ddp_hooks``.
* The wrapped optimizer of a ``LightningOptimizer``: its public ``optimizer`` property.
* The checkpoint path type: :data:`PATH` (own alias) instead of ``lightning.fabric.utilities.types._PATH``.

jsonargparse's undocumented ``subcommand_parser`` attribute (used by the CLI's error summary) is here
too, and so are the patterns that read its error messages (:class:`JsonargparseMessage`; jsonargparse has no
structured errors, a union's error quotes each member's as text): LightningCLI is the only user of
jsonargparse in this package, and a message reworded in a jsonargparse release fails the test named after
the pattern instead of silently dropping the CLI's one-line summary.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Union

import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.init import (
    _has_meta_device_parameters_or_buffers,
    _materialize_distributed_module,
)
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch import nn

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
    from torch.optim import Optimizer
    from torch.utils.data import DataLoader, Sampler

__all__ = [
    "LIGHTNING_META_FILE",
    "PATH",
    "JsonargparseMessage",
    "before_batch_transfer",
    "combined_loader_iterator",
    "combined_loader_mode",
    "forward_redirection",
    "forward_signal_to_launched_ranks",
    "has_meta_tensors",
    "in_lightning_hook",
    "init_process_group",
    "is_stateful_loader",
    "logs_this_step",
    "materialize_meta_module",
    "optimizers_to_device",
    "rebuild_loader_with_sampler",
    "replace_sigterm_broadcast",
    "restart_training_iterators",
    "restore_sigterm_broadcast",
    "route_norm_clipping",
    "saves_distributed_checkpoint",
    "set_device_mesh",
    "set_optimizer_step_count",
    "set_sampler_epoch",
    "set_training_fetcher_length",
    "subcommand_parser",
    "training_combined_loader",
    "unwrap_module_method",
    "wrap_module_method",
    "write_to_loggers",
]

#: A checkpoint path (what Lightning's private ``_PATH`` alias means; own spelling, no import).
PATH = Union[str, "os.PathLike[str]"]

#: ``lightning.fabric.utilities.load._METADATA_FILENAME`` ("meta.pt"): the non-tensor part of a sharded
#: checkpoint folder, the file Lightning's own ``ModelParallelStrategy`` reads back.
LIGHTNING_META_FILE: str = _METADATA_FILENAME


# ------------------------------------------------------------------------------ fabric helpers (imports)
def has_meta_tensors(module: nn.Module) -> bool:
    """Whether ``module`` has parameters or buffers on the meta device
    (``_has_meta_device_parameters_or_buffers``)."""
    return bool(_has_meta_device_parameters_or_buffers(module))


def materialize_meta_module(module: nn.Module, device: torch.device) -> None:
    """``to_empty`` + ``reset_parameters`` of every meta submodule (``_materialize_distributed_module``)."""
    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Iterable[Optimizer], device: torch.device) -> None:
    """Move optimizer state tensors to ``device`` (``_optimizers_to_device``)."""
    _optimizers_to_device(optimizers, device)


def set_sampler_epoch(dataloader: object, epoch: int) -> None:
    """``set_epoch`` on the loader's (batch) sampler as Lightning's fit loop does (``_set_sampler_epoch``)."""
    _set_sampler_epoch(dataloader, epoch)


def is_stateful_loader(obj: object) -> bool:
    """Whether Lightning saves/restores ``obj``'s position itself (``isinstance(obj, _Stateful)``)."""
    return isinstance(obj, _Stateful)


def rebuild_loader_with_sampler(dataloader: DataLoader, sampler: Sampler[Any]) -> DataLoader:
    """A copy of a training loader with another sampler, built as Lightning injects its own
    (``_update_dataloader``)."""
    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)


# ------------------------------------------------------------------------------ strategy internals
def init_process_group(strategy: Any) -> None:
    """``ModelParallelStrategy._setup_distributed``: world ranks + ``init_process_group`` (no mesh)."""
    strategy._setup_distributed()


def set_device_mesh(strategy: Any, mesh: Any) -> None:
    """Publish ``mesh`` as ``strategy.device_mesh`` and ``LightningModule.device_mesh`` (both read
    ``_device_mesh``)."""
    strategy._device_mesh = mesh
    module = strategy.lightning_module
    if module is not None:
        module._device_mesh = mesh


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """``ModelParallelStrategy(save_distributed_checkpoint=...)``, stored as
    ``_save_distributed_checkpoint``."""
    return bool(strategy._save_distributed_checkpoint)


def forward_redirection(strategy: Any, wrapper: nn.Module, original: pl.LightningModule, method: str,
                        *args: Any, **kwargs: Any) -> Any:
    """Run ``original.<method>`` through ``wrapper.__call__`` so its forward hooks fire
    (``_forward_redirection``)."""
    return strategy._forward_redirection(wrapper, original, method, *args, **kwargs)


# ------------------------------------------------------------------------------ loop internals
def training_combined_loader(trainer: pl.Trainer) -> Any:
    """The fit loop's ``CombinedLoader`` (``FitLoop._combined_loader``); ``None`` before ``setup_data``."""
    return trainer.fit_loop._combined_loader


def combined_loader_mode(combined: Any) -> str:
    """``CombinedLoader._mode`` (``"max_size_cycle"`` for training)."""
    return str(combined._mode)


def combined_loader_iterator(combined: Any) -> Any:
    """The mode iterator of a ``CombinedLoader`` (``_iterator``); ``None`` before ``iter()``."""
    return combined._iterator


def set_training_fetcher_length(trainer: pl.Trainer, length: int) -> None:
    """The batches the running training data fetcher counts to (``FitLoop._data_fetcher.length``)."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None and fetcher.length is not None:
        fetcher.length = length


def restart_training_iterators(trainer: pl.Trainer) -> None:
    """Re-create every training iterator (``iter(FitLoop._data_fetcher)``)."""
    iter(trainer.fit_loop._data_fetcher)


def set_optimizer_step_count(trainer: pl.Trainer, target: int, pending: int = 1) -> None:
    """Make ``trainer.global_step`` become ``target`` when the running ``optimizer_step`` returns.

    Call from inside ``optimizer_step`` (automatic optimization): Lightning increments the step's
    ``completed`` counters right after it returns, so they are set ``pending`` (1) below here; the logging
    step (``TrainingEpochLoop._batches_that_stepped``, incremented after the batch) likewise. ``pending=0``:
    outside an optimizer step (e.g. in ``on_train_start``).
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    progress = epoch_loop.automatic_optimization.optim_progress.optimizer.step
    delta = target - (progress.total.completed + pending)
    if delta:
        progress.total.completed += delta
        progress.current.completed += delta
    progress.total.ready = progress.total.completed + pending
    progress.current.ready = progress.current.completed + pending
    epoch_loop._batches_that_stepped = target - pending


def accumulating_gradients(trainer: pl.Trainer) -> bool:
    """Whether the training batch running now is a non-final micro-batch of gradient accumulation (no
    optimizer step at its end): Lightning's own decision, ``TrainingEpochLoop._should_accumulate()``.
    ``False`` without accumulation and under manual optimization."""
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


def replace_sigterm_broadcast(trainer: pl.Trainer, check: Callable[[], None]) -> Any:
    """Run ``check`` where the training epoch loop broadcasts its SIGTERM flag before each batch.

    Shadows ``TrainingEpochLoop._broadcast_sigterm_tensor`` on the loop *instance*; returns the loop
    for :func:`restore_sigterm_broadcast`, or ``None`` when this Lightning has no such method.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is None or not hasattr(loop, "_broadcast_sigterm_tensor"):
        return None
    loop._broadcast_sigterm_tensor = check
    return loop


def restore_checkpoint(trainer: Any, path: str) -> None:
    """Restore everything a ``fit(ckpt_path=path)`` would (model, callbacks, loops, optimizers, schedulers),
    now, from inside the strategy's ``setup`` (``trainer._checkpoint_connector.restore``)."""
    trainer._checkpoint_connector.restore(path)


def restore_sigterm_broadcast(loop: Any) -> None:
    """Undo :func:`replace_sigterm_broadcast` (the class's own method applies again)."""
    if loop is not None:
        vars(loop).pop("_broadcast_sigterm_tensor", None)


def in_lightning_hook(module: Any) -> bool:
    """Whether Lightning is inside one of ``module``'s hooks, where ``self.log`` works
    (``_current_fx_name``)."""
    return module is not None and getattr(module, "_current_fx_name", None) is not None


def logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether the Trainer's loggers write this training step's ``on_step`` metrics: every
    ``log_every_n_steps``-th step, or one after which training stops
    (``LoggerConnector.should_update_logs``)."""
    return bool(trainer._logger_connector.should_update_logs)


def write_to_loggers(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Write ``metrics`` to every logger of the Trainer as Lightning writes a step's logged metrics (at the
    loop's logging step value, with ``epoch``; also in ``trainer.logged_metrics``), without
    ``LightningModule.log`` (``LoggerConnector.log_metrics``)."""
    trainer._logger_connector.log_metrics(dict(metrics))


def before_batch_transfer(module: pl.LightningModule, batch: Any, dataloader_idx: int = 0) -> Any:
    """The ``on_before_batch_transfer`` hooks (module's, datamodule's) as the loop applies them
    (``LightningModule._on_before_batch_transfer``)."""
    return module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)


def forward_signal_to_launched_ranks(strategy: Any, signum: int) -> bool:
    """Send ``signum`` to the processes Lightning's subprocess launcher started (its ``procs``); False if
    none."""
    launcher = getattr(strategy, "launcher", None)
    if launcher is None or not getattr(launcher, "procs", None):
        return False
    launcher.kill(signum)
    return True


# ------------------------------------------------------------------------------ hooks of one LightningModule
_WRAPPED_BY = "_fsdp_strategies_wrapped_by"  # on a wrapper: the owner of every wrap in its chain
_WRAPS = "_fsdp_strategies_wraps"  # on a wrapper: (its owner, the method it wraps)


def wrap_module_method(module: pl.LightningModule, name: str, owner: object,
                       wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Make this one module instance's hook ``name`` ``wrapper(current)``, once per ``owner``; ``False`` when
    ``owner`` has wrapped it already (``setup`` runs again for validate / test).

    Why: a callback that must act where Lightning gives it no hook (the ``ActivationCheckpointing`` callback:
    right after ``configure_model`` under a strategy that does not apply checkpointing itself, around
    ``backward`` to restate a recomputation error, around ``training_step`` to see the whole forward inside
    any dispatch mode another callback opened) wraps the module's own method. This relies on how Lightning
    calls a module's hooks, which it does not document: it looks each one up on the instance
    (``getattr(pl_module, hook_name)`` in ``trainer.call._call_lightning_module_hook``, ``model.backward`` in
    the precision plugin), so an instance attribute shadows the class's method; and ``is_overridden`` follows
    ``__wrapped__`` (``functools.wraps``) to the user's own method, so ``configure_model`` still counts as
    overridden. The class, and every other instance, are left alone.
    """
    current = getattr(module, name)
    if owner in getattr(current, _WRAPPED_BY, ()):
        return False
    wrapped = functools.wraps(current)(wrapper(current))
    setattr(wrapped, _WRAPPED_BY, (*getattr(current, _WRAPPED_BY, ()), owner))
    setattr(wrapped, _WRAPS, (owner, current))
    object.__setattr__(module, name, wrapped)
    return True


def unwrap_module_method(module: pl.LightningModule, name: str, owner: object) -> None:
    """Undo :func:`wrap_module_method` by ``owner`` when its wrap is the outermost one: the method it wrapped
    applies again (the class's own method: the instance attribute is removed)."""
    current = vars(module).get(name)
    by, previous = getattr(current, _WRAPS, (None, None))
    if current is None or by is not owner:
        return
    own = getattr(type(module), name, None)
    if getattr(previous, "__self__", None) is module and previous.__func__ is own:
        del vars(module)[name]
    else:
        object.__setattr__(module, name, previous)


# ------------------------------------------------------------------------------ precision plugin
class _NormClipping:
    """The plugin's ``clip_grad_by_norm(optimizer, clip_val)``: ``clip(main_params(optimizer), clip_val)``."""

    def __init__(self, plugin: Precision, clip: Callable[[Iterable[torch.Tensor], float], Any]) -> None:
        self.plugin, self.clip = plugin, clip

    def __call__(self, optimizer: Optimizer, clip_val: float) -> None:
        self.clip(self.plugin.main_params(optimizer), clip_val)


def route_norm_clipping(plugin: Precision, clip: Callable[[Iterable[torch.Tensor], float], Any]) -> None:
    """Make a precision plugin's clipping by norm call ``clip(parameters, max_norm)``; same object and type.

    Lightning gives a strategy no say in how gradients are clipped: ``LightningModule.clip_gradients`` calls
    ``trainer.precision_plugin.clip_gradients``, which calls the plugin's ``clip_grad_by_norm``. The plugin
    is the user's (or the accelerator connector's) object, and its class is what Lightning sees (a checkpoint
    keys the plugin's state by it), so neither a swapped class nor a wrapping object will do: the one method
    is set on the instance. Relies on Lightning looking ``clip_grad_by_norm`` up on the instance when it
    clips by norm (and not when it clips by value); the seam test checks both through a Trainer run."""
    plugin.clip_grad_by_norm = _NormClipping(plugin, clip)  # type: ignore[method-assign]


# ------------------------------------------------------------------------------ jsonargparse (LightningCLI)
def subcommand_parser(error: BaseException | None) -> Any:
    """The parser of the subcommand (``fit``...) an error was raised in: jsonargparse's undocumented
    ``subcommand_parser`` attribute of its ``ArgumentError``; ``None`` when absent."""
    return getattr(error, "subcommand_parser", None)


class JsonargparseMessage:
    """Patterns for the lines of jsonargparse's error messages that ``cli.explain_error`` reads.

    jsonargparse reports a bad value inside a union (a strategy is ``str | Strategy``, callbacks
    ``list[Callback] | Callback | None``) as text quoting every member's attempt, indented one level per
    union; it has no error objects to read instead. Each pattern has a test in
    ``tests/test_lightning_seam.py`` (``test_jsonargparse_message[<name>]``) that raises the real error and
    matches it."""

    #: ``- Problem with given class_path 'pkg.Class':`` (a union member tried with the user's class);
    #: groups: the indent, the class path
    CLASS_PATH = re.compile(r"^(\s*)- Problem with given class_path '([^']+)':\s*$")
    #: ``Parser key "trainer.strategy":`` (the option the lines below are about); group: the key
    PARSER_KEY = re.compile(r'^\s*Parser key "([^"]+)":\s*$')
    #: ``Expected a typing.Literal['a', 'b']. Got value: c``; groups: the values (Python literals), the value
    LITERAL_GOT = re.compile(r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)$")
    #: ``Subtypes: [typing.Literal['a', 'b'], <class 'NoneType'>]`` (an optional Literal); group: the values
    LITERAL_IN_UNION = re.compile(r"Subtypes: \[typing\.Literal\[(.*?)\]")
    #: ``Given value: c`` (after a union's errors); group: the value
    GIVEN = re.compile(r"^\s*Given value: (.*)$")
    #: ``Option 'mod' is not accepted`` (an init argument the class does not have); group: the option
    NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted")
    #: ``Group 'trainer' does not accept option 'max_stepz'`` (a config file's key); groups: group, option
    GROUP_OPTION = re.compile(r"Group '([^']+)' does not accept option '([^']+)'")
    #: ``unrecognized arguments: --trainer.max_stepz 5`` (the command line's); group: the arguments
    UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)$", re.IGNORECASE)
    #: ``Expected a dot import path string: ddp`` (a name given options as if a class); group: the name
    DOT_PATH = re.compile(r"Expected a dot import path string: (\S+)")
    #: ``Given value: Namespace(class_path='pkg.Class', ...)`` (a union member's class that raised while
    #: instantiated); group: the class name
    UNION_CLASS = re.compile(r"class_path='(?:[\w.]+\.)?(\w+)'")
    #: ``  - <message>`` (one union member's error, as quoted in the union's); group: the message
    UNION_MEMBER_ERROR = re.compile(r"^\s*- (.*)$")
