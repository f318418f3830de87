"""One test per private name of Lightning / torch / torchft / jsonargparse this package relies on.

Every access lives in :mod:`fsdp_strategies._lightning_seam` or :mod:`fsdp_strategies._torch_seam`;
each test is named after the private name and exercises the behaviour the package needs in the
*installed* version -- never the library's source text -- so an upgrade that renames or changes one
fails here, by name, instead of deep inside a training run. Where that behaviour needs a process group,
the test starts a one-process gloo group in this process (:func:`_one_process_group`); torchft's
``Manager`` runs against a real in-process lighthouse. Run against the oldest and newest supported
Lightning (docs/getting-started.md: "Supported versions"). All single-process and fast.
"""

from __future__ import annotations

import inspect
import json
import pickle
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from conftest import free_port, run_python
from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies import _torch_seam as tseam
from support import processes


def _trainer(**kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {"accelerator": "cpu", "devices": 1, "logger": False,
                                "enable_checkpointing": False,
                                "enable_progress_bar": False, "enable_model_summary": False}
    return pl.Trainer(**{**defaults, **kwargs})


class _RecordingEnvironment(LightningEnvironment):
    """Lightning's own environment for one process, recording the world size / rank set on it."""

    def __init__(self) -> None:
        super().__init__()
        self.set: list[tuple[str, int, bool]] = []  # (what, value, process group already up)

    def set_world_size(self, size: int) -> None:
        self.set.append(("world_size", size, dist.is_initialized()))
        super().set_world_size(size)

    def set_global_rank(self, rank: int) -> None:
        self.set.append(("global_rank", rank, dist.is_initialized()))
        super().set_global_rank(rank)


def _one_cpu_process(strategy: Any) -> Any:
    """Give ``strategy`` what the accelerator connector would for ``accelerator="cpu", devices=1``."""
    strategy.accelerator = CPUAccelerator()
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.cluster_environment = _RecordingEnvironment()
    return strategy


@contextmanager
def _one_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModelParallelStrategy]:
    """A ``ModelParallelStrategy`` for one CPU process whose ``_setup_distributed`` (through the seam, as
    ``FSDP2Strategy.setup_environment`` calls it) started a gloo process group of world size 1; destroyed
    after."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert not dist.is_initialized()
    strategy = _one_cpu_process(ModelParallelStrategy(process_group_backend="gloo"))
    try:
        seam.init_process_group(strategy)
        yield strategy
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------ fabric helpers
def test__has_meta_device_parameters_or_buffers() -> None:
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    assert seam.has_meta_tensors(meta) is True
    assert seam.has_meta_tensors(nn.Linear(2, 2)) is False


def test__materialize_distributed_module() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    seam.materialize_meta_module(model, torch.device("cpu"))
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in model.parameters())
    assert model[0].weight.abs().sum() > 0  # reset_parameters ran (to_empty alone leaves garbage or zeros)


def test__optimizers_to_device() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert list(inspect.signature(seam._optimizers_to_device).parameters) == ["optimizers", "device"]
    seam.optimizers_to_device([opt], torch.device("meta"))
    assert all(v.device.type == "meta" for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim())


def test__METADATA_FILENAME(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our sharded folders (DCP shards + ``seam.LIGHTNING_META_FILE``) load in Lightning's own
    ``ModelParallelStrategy`` loader, and folders Lightning writes load in ours (which reads that file
    back)."""
    from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint
    from lightning.fabric.strategies.model_parallel import _load_checkpoint
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_strategies import FSDP2Strategy
    from fsdp_strategies.checkpoint.load_into_fsdp import load_into_sharded_model

    assert seam.LIGHTNING_META_FILE == "meta.pt"
    with _one_process_group(monkeypatch) as strategy:
        torch.manual_seed(0)
        model = fully_shard(nn.Linear(3, 2), mesh=init_device_mesh("cpu", (1,)))
        saved = {k: v.full_tensor().clone() for k, v in get_model_state_dict(model).items()}

        def scramble() -> None:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(-7.0)

        def loaded() -> bool:
            return all(torch.equal(v.full_tensor(), saved[k]) for k, v in get_model_state_dict(model).items())

        # ours -> Lightning's: FSDP2Strategy.save_checkpoint (DCP shards, the non-tensor part in meta.pt)
        ours = tmp_path / "ours"
        writer = _one_cpu_process(FSDP2Strategy())
        writer.save_checkpoint(
            {"state_dict": get_model_state_dict(model), "epoch": 3, "global_step": 7}, ours
        )
        assert (ours / seam.LIGHTNING_META_FILE).is_file() and _is_sharded_checkpoint(ours)
        scramble()
        rest = _load_checkpoint(ours, {"state_dict": model}, optimizer_states_from_list=True)
        assert rest == {"epoch": 3, "global_step": 7} and loaded()  # the metadata came from our meta.pt

        # the same shards without that file: not a sharded checkpoint for Lightning
        (ours / seam.LIGHTNING_META_FILE).unlink()
        assert not _is_sharded_checkpoint(ours)
        with pytest.raises(ValueError, match="does not point to a valid checkpoint"):
            _load_checkpoint(ours, {"state_dict": model}, optimizer_states_from_list=True)

        # Lightning's -> ours: ModelParallelStrategy.save_checkpoint's folder, read back through
        # seam.LIGHTNING_META_FILE
        theirs = tmp_path / "theirs"
        strategy.save_checkpoint({"state_dict": get_model_state_dict(model), "epoch": 5}, theirs)
        assert (theirs / seam.LIGHTNING_META_FILE).is_file()
        scramble()
        assert load_into_sharded_model(model, [], theirs) == {"epoch": 5} and loaded()


def test__set_sampler_epoch() -> None:
    loader = DataLoader(
        RandomDataset(2, 8), sampler=DistributedSampler(RandomDataset(2, 8), num_replicas=2, rank=0)
    )
    seam.set_sampler_epoch(loader, 3)
    assert loader.sampler.epoch == 3  # type: ignore[attr-defined]


def test__Stateful() -> None:
    class Positioned:
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    assert seam.is_stateful_loader(Positioned()) is True
    assert seam.is_stateful_loader(DataLoader(RandomDataset(2, 4))) is False


def test__update_dataloader() -> None:
    loader = DataLoader(RandomDataset(2, 8), batch_size=4, drop_last=True)
    sampler = SequentialSampler(range(8))
    rebuilt = seam.rebuild_loader_with_sampler(loader, sampler)
    assert rebuilt is not loader and rebuilt.sampler is sampler
    assert rebuilt.batch_size == 4 and rebuilt.drop_last is True and len(rebuilt) == 2


# ------------------------------------------------------------------------------ strategy internals
def test__setup_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``FSDP2Strategy.setup_environment`` relies on: world ranks set and the default process group up
    (world size 1 here, the strategy's backend), but no device mesh -- the strategy builds its own right
    after."""
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp_strategies.parallel.mesh import ParallelDims, build_mesh

    meshes: list[Any] = []
    original_init = DeviceMesh.__init__

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        meshes.append(self)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(DeviceMesh, "__init__", counting_init)
    with _one_process_group(monkeypatch) as strategy:
        environment = strategy.cluster_environment
        assert isinstance(environment, _RecordingEnvironment)
        # world ranks set first (Lightning's connection reads them), then the process group
        assert ("world_size", 1, False) in environment.set and ("global_rank", 0, False) in environment.set
        assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == 0
        assert dist.get_backend() == "gloo" and (strategy.global_rank, strategy.world_size) == (0, 1)
        assert meshes == [] and strategy._device_mesh is None  # no mesh: Lightning's own would be dp x tp
        # what fsdp2 builds next
        mesh = build_mesh(strategy.root_device, ParallelDims.fsdp(strategy.world_size, strategy.world_size))
        assert meshes and mesh.size() == 1  # (the counter sees a mesh being built)
    assert not dist.is_initialized()


def test__device_mesh() -> None:
    strategy = ModelParallelStrategy()
    module = BoringModel()
    strategy.connect(module)
    mesh = object()
    seam.set_device_mesh(strategy, mesh)
    assert strategy.device_mesh is mesh
    assert module.device_mesh is mesh


def test__save_distributed_checkpoint() -> None:
    assert seam.saves_distributed_checkpoint(ModelParallelStrategy(save_distributed_checkpoint=True)) is True
    assert (
        seam.saves_distributed_checkpoint(ModelParallelStrategy(save_distributed_checkpoint=False)) is False
    )


def test__forward_redirection() -> None:
    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.inner(*args, **kwargs)

    class Module(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return {"loss": batch.sum() * 2, "idx": batch_idx}

    module = Module()
    wrapper = Wrapper(module)
    calls: list[int] = []
    wrapper.register_forward_pre_hook(lambda *_: calls.append(1))
    out = seam.forward_redirection(
        ModelParallelStrategy(), wrapper, module, "training_step", torch.ones(2), 7
    )
    assert out["idx"] == 7 and out["loss"].item() == 4.0
    assert calls == [1]  # the step ran through the wrapper's __call__ (its hooks fired)
    assert module.forward.__func__ is BoringModel.forward  # type: ignore[attr-defined]  # restored


def test__launcher_procs_and_kill() -> None:
    trainer = _trainer(devices=2, strategy="ddp")
    launcher = trainer.strategy.launcher
    assert launcher is not None and launcher.procs == []  # type: ignore[attr-defined]
    assert "signum" in inspect.signature(launcher.kill).parameters
    assert seam.forward_signal_to_launched_ranks(trainer.strategy, 15) is False  # nothing launched yet


def test_set_world_ranks_is_called_before_the_launcher_with_devices_and_precision() -> None:
    """Public hook, used for its call order: the strategies validate options there (no
    ``_configure_launcher``)."""
    seen: list[tuple[str, int, int, bool]] = []

    class Probe(ModelParallelStrategy):
        def set_world_ranks(self) -> None:
            super().set_world_ranks()
            seen.append((str(self.precision_plugin.precision), self.num_processes, self.num_nodes,
                         self.launcher is None))

    _trainer(devices=2, num_nodes=1, precision="bf16-true", strategy=Probe())
    assert seen and seen[0] == ("bf16-true", 2, 1, True)


def _trainer_in(fn: TrainerFn = TrainerFn.FITTING) -> Any:
    """The part of a ``Trainer`` a strategy's ``setup`` reads."""
    return SimpleNamespace(state=SimpleNamespace(fn=fn))


def test_configure_ddp_wraps_then_registers_hooks() -> None:
    """ddp_hooks overrides the public ``configure_ddp`` instead of the private ``_register_ddp_hooks``:
    ``setup`` calls it while fitting, before the optimizers; it wraps first, and Lightning's own registration
    (a ``DDPStrategy`` given no hook, as ddp_hooks' is) registers nothing, so ours is the one hook DDP
    accepts."""
    from torch.nn.parallel import DistributedDataParallel

    calls: list[Any] = []

    class Wrapped(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

    class Recording(DDPStrategy):
        def _setup_model(self, model: nn.Module) -> nn.Module:
            calls.append("_setup_model")
            return Wrapped(model)

        def _register_ddp_hooks(self) -> None:
            # what it sees: the wrapped model
            calls.append(("_register_ddp_hooks", type(self.model).__name__))

        def configure_ddp(self) -> None:
            calls.append("configure_ddp")
            super().configure_ddp()

        def model_to_device(self) -> None:
            calls.append("model_to_device")

        def setup_optimizers(self, trainer: Any) -> None:
            calls.append("setup_optimizers")

    strategy = _one_cpu_process(Recording())
    strategy.connect(BoringModel())
    strategy.setup(_trainer_in())
    assert calls == ["model_to_device", "configure_ddp", "_setup_model", ("_register_ddp_hooks", "Wrapped"),
                     "setup_optimizers"]
    assert isinstance(strategy.model, Wrapped)
    calls.clear()
    strategy = _one_cpu_process(Recording())
    strategy.connect(BoringModel())
    with mock.patch("lightning.pytorch.strategies.ddp._sync_module_states"):  # (needs a process group)
        strategy.setup(_trainer_in(TrainerFn.VALIDATING))
    assert calls == ["model_to_device"]  # not fitting: no DDP wrapper, no hooks

    # Lightning's own registration (it acts on CUDA only): nothing without a hook, the given hook otherwise
    for given, registered in ((None, 0), (lambda state, bucket: bucket.buffer(), 1)):
        lightning = DDPStrategy(parallel_devices=[torch.device("cuda", 0)], ddp_comm_hook=given)
        lightning.model = mock.create_autospec(DistributedDataParallel, instance=True)
        lightning._register_ddp_hooks()
        assert lightning.model.register_comm_hook.call_count == registered  # type: ignore[attr-defined]


def test_ModelParallelStrategy_setup_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``FSDP2Strategy.setup`` re-implements the parent's ``setup`` with its steps re-ordered (the strategy
    shards and bf16-true casts before materialising, instead of a user ``configure_model`` that shards):
    the parent's steps must be exactly these, so a step Lightning adds or drops shows up here."""
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import model_parallel as pl_mp

    calls: list[str] = []

    def record(name: str) -> Any:
        return lambda *args, **kwargs: calls.append(name)

    monkeypatch.setattr(pl_mp, "_materialize_distributed_module", record("_materialize_distributed_module"))
    monkeypatch.setattr(pl_mp, "_optimizers_to_device", record("_optimizers_to_device"))

    class Module(BoringModel):
        def configure_model(self) -> None:  # the parent requires it (it shards there)
            pass

    class RecordingPrecision(Precision):
        def convert_module(self, module: nn.Module) -> nn.Module:
            calls.append("convert_module")
            return module

    class Recording(ModelParallelStrategy):
        def model_to_device(self) -> None:
            calls.append("model_to_device")

        def barrier(self, *args: Any, **kwargs: Any) -> None:
            calls.append("barrier")

        def setup_optimizers(self, trainer: Any) -> None:
            calls.append("setup_optimizers")

        def setup_precision_plugin(self) -> None:
            calls.append("setup_precision_plugin")

    for fn, optimizer_steps in ((TrainerFn.FITTING, True), (TrainerFn.VALIDATING, False)):
        calls.clear()
        strategy = _one_cpu_process(Recording())
        strategy.accelerator = mock.Mock(setup=record("accelerator.setup"))
        strategy.precision_plugin = RecordingPrecision()
        strategy.connect(Module())
        strategy.setup(_trainer_in(fn))
        expected = ["accelerator.setup", "_materialize_distributed_module", "convert_module",
                    "model_to_device",
                    "barrier", "setup_optimizers", "setup_precision_plugin", "_optimizers_to_device"]
        if not optimizer_steps:
            expected = [
                step for step in expected if step not in ("setup_optimizers", "_optimizers_to_device")
            ]
        assert calls == expected, fn


def test_LightningOptimizer_optimizer() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    assert LightningOptimizer(opt).optimizer is opt  # public; replaces ``._optimizer``


# ------------------------------------------------------------------------------ loop internals (one tiny fit)
class _Probe(BoringModel):
    """Exercises every loop access of the seam from inside a real ``fit``."""

    def __init__(self) -> None:
        super().__init__()
        self.record: dict[str, Any] = {"steps": [], "logging_steps": [], "first": None, "in_hook": []}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 8), batch_size=2)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch + 1000.0 if batch.dim() == 2 and batch.shape[-1] == 32 else batch

    def on_train_start(self) -> None:
        trainer = self.trainer
        combined = seam.training_combined_loader(trainer)
        self.record["combined"] = combined is not None and list(combined.flattened) == [
            trainer.train_dataloader
        ]
        self.record["mode"] = seam.combined_loader_mode(combined)
        self.record["iterator_before"] = seam.combined_loader_iterator(combined)
        # swap the loader for one over other data and restart the iterators, as _resume/_ft_data do
        marked = DataLoader([torch.full((32,), -5.0)] * 8, batch_size=2)
        combined.flattened = [marked]
        seam.restart_training_iterators(trainer)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.record["first"] is None:
            self.record["first"] = float(batch[0, 0])
            self.record["transfer"] = float(seam.before_batch_transfer(self, torch.zeros(2, 32))[0, 0])
            self.record["iterator_during"] = seam.combined_loader_iterator(
                seam.training_combined_loader(self.trainer)
            )
        self.record["in_hook"].append(seam.in_lightning_hook(self))
        return super().training_step(batch, batch_idx)

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        optimizer.step(closure=optimizer_closure)
        seam.set_optimizer_step_count(self.trainer, 10 * (batch_idx + 1))  # as ft_hsdp does after a heal

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.record["steps"].append(self.trainer.global_step)
        self.record["logging_steps"].append(self.trainer.fit_loop.epoch_loop._batches_that_stepped)


@pytest.fixture(scope="module")
def fitted() -> _Probe:
    model = _Probe()
    _trainer(max_steps=25, max_epochs=1).fit(model)
    return model


def test__combined_loader(fitted: _Probe) -> None:
    assert fitted.record["combined"] is True


def test__mode(fitted: _Probe) -> None:
    assert fitted.record["mode"] == "max_size_cycle"


def test__iterator(fitted: _Probe) -> None:
    assert fitted.record["iterator_during"] is not None


def test__data_fetcher(fitted: _Probe) -> None:
    # the swapped loader's data (-5, plus the module's on_before_batch_transfer +1000) arrived: the restart
    # re-created the iterators from ``combined.flattened``
    assert fitted.record["first"] == 995.0


def test__data_fetcher_length() -> None:
    # the fetcher's length decides `is_last_batch`: cut to 3, the epoch of 8 batches ends after 3 (every epoch
    # re-counts it from the loader, so the second epoch has 8 again)
    class Cut(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seam.set_training_fetcher_length(trainer, 3)

    model = BoringModel()
    model.train_dataloader = (  # type: ignore[method-assign]
        lambda: DataLoader(RandomDataset(32, 16), batch_size=2)
    )
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[Cut()])
    trainer.fit(model)
    assert trainer.global_step == 3 + 8


def test__batches_that_stepped_and_optim_progress(fitted: _Probe) -> None:
    # global_step jumps to the set count and max_steps=25 stops after the third step (30)
    assert fitted.record["steps"] == [10, 20, 30]
    # the logging step is incremented after on_train_batch_end: one below the step there
    assert fitted.record["logging_steps"] == [9, 19, 29]


def test__current_fx_name(fitted: _Probe) -> None:
    assert fitted.record["in_hook"] and all(fitted.record["in_hook"])
    assert seam.in_lightning_hook(fitted) is False  # after fit: no hook running


def test__logger_connector() -> None:
    """``logs_this_step`` inside a training step is true exactly at the steps whose ``on_step`` metrics
    reach the loggers (every ``log_every_n_steps``-th), as ``ft_hsdp`` relies on to log its metrics there;
    ``write_to_loggers`` there writes at the step value Lightning writes that step's logged metrics at."""
    from lightning.pytorch.loggers import Logger

    class Steps(Logger):
        name, version = "steps", 0
        written: list[int] = []
        at: dict[str, list[int | None]] = {"m": [], "w": []}

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            if "m" in metrics:
                self.written.append(int(metrics["m"]))
            for key in self.at:
                if key in metrics:
                    self.at[key].append(step)

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

    asked: list[int] = []

    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if seam.logs_this_step(self.trainer):
                asked.append(batch_idx + 1)
                seam.write_to_loggers(self.trainer, {"w": float(batch_idx + 1)})
            self.log("m", float(batch_idx + 1), on_step=True, on_epoch=False)
            return super().training_step(batch, batch_idx)

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=7, log_every_n_steps=3, logger=Steps(),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    trainer.fit(Model())
    assert asked == Steps.written == [3, 6]
    assert Steps.at["w"] == Steps.at["m"] and len(Steps.at["m"]) == 2
    assert trainer.logged_metrics["w"] == 6.0


def test__on_before_batch_transfer(fitted: _Probe) -> None:
    assert fitted.record["transfer"] == 1000.0


def test__should_accumulate(tmp_path: Path) -> None:
    """At ``on_train_batch_end``: ``True`` on the non-final micro-batches of each optimizer step (no step
    ran), ``False`` where the optimizer stepped, the epoch's last batch included (Lightning steps there)."""
    seen: list[tuple[bool, int]] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            seen.append((seam.accumulating_gradients(trainer), trainer.global_step))

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=7,
                         limit_val_batches=0,
                         accumulate_grad_batches=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
                         default_root_dir=str(tmp_path))
    trainer.fit(BoringModel())
    assert seen == [(True, 0), (True, 0), (False, 1), (True, 1), (True, 1), (False, 2), (False, 3)]


def test__broadcast_sigterm_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a distributed fit (process group up, world size > 1) the epoch loop calls it once before each
    training batch: the replacement installed at ``on_train_start`` (as the preemption mixin does) runs
    instead, once per step; after :func:`seam.restore_sigterm_broadcast` the class's method applies again."""
    method = _TrainingEpochLoop._broadcast_sigterm_tensor
    checks: list[int] = []

    class TwoRanks(SingleDeviceStrategy):  # one process that the loop takes for a 2-rank job
        @property
        def world_size(self) -> int:
            return 2

        @world_size.setter
        def world_size(self, _: int) -> None:  # (SingleDeviceStrategy.__init__ sets 1)
            pass

        def on_train_start(self) -> None:
            super().on_train_start()
            assert self.lightning_module is not None
            trainer = self.lightning_module.trainer
            self.replaced = seam.replace_sigterm_broadcast(
                trainer, lambda: checks.append(trainer.global_step)
            )

    strategy = TwoRanks(device=torch.device("cpu"))
    with _one_process_group(monkeypatch):
        fit_trainer = _trainer(strategy=strategy, max_steps=3, limit_val_batches=0)
        assert fit_trainer.world_size == 2
        fit_trainer.fit(BoringModel())
    assert strategy.replaced is fit_trainer.fit_loop.epoch_loop
    assert checks == [0, 1, 2]  # before each of the three steps, with the step count so far

    trainer = _trainer()
    calls: list[int] = []
    loop = seam.replace_sigterm_broadcast(trainer, lambda: calls.append(1))
    assert loop is trainer.fit_loop.epoch_loop
    loop._broadcast_sigterm_tensor()
    assert calls == [1]
    seam.restore_sigterm_broadcast(loop)
    assert loop._broadcast_sigterm_tensor.__func__ is method


# ------------------------------------------------------------------------------ hooks of one LightningModule
def test_wrap_module_method_hooks_are_looked_up_on_the_instance() -> None:
    """Lightning calls a module's hooks through the instance (``getattr`` in ``_call_lightning_module_hook``,
    ``model.backward`` in the precision plugin) and ``is_overridden`` follows ``__wrapped__``: the wrappers
    run in fit, each once per owner, and unwrapping gives back the method wrapped (the class's own)."""
    import functools

    from lightning.pytorch.utilities.model_helpers import is_overridden

    calls: list[str] = []

    class Built(BoringModel):
        def configure_model(self) -> None:
            calls.append("configure_model")

    def recording(label: str, current: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(label)
            return current(*args, **kwargs)

        return wrapper

    hooks = ("configure_model", "training_step", "backward")
    model, owner, other = Built(), object(), object()
    for name in hooks:
        assert seam.wrap_module_method(model, name, owner, functools.partial(recording, f"wrapped {name}"))
        assert not seam.wrap_module_method(model, name, owner, functools.partial(recording, "twice"))
    assert seam.wrap_module_method(model, "training_step", other, functools.partial(recording, "other"))
    plain = BoringModel()
    assert seam.wrap_module_method(plain, "configure_model", owner, functools.partial(recording, "plain"))
    assert is_overridden("configure_model", model) and not is_overridden("configure_model", plain)
    _trainer(max_steps=1, limit_val_batches=0).fit(model)
    assert calls == ["wrapped configure_model", "configure_model", "other", "wrapped training_step",
                     "wrapped backward"]
    outer = vars(model)["training_step"]
    seam.unwrap_module_method(model, "training_step", owner)  # not the outermost wrap: left as it is
    assert vars(model)["training_step"] is outer
    seam.unwrap_module_method(model, "training_step", other)
    assert vars(model)["training_step"] is not outer  # owner's wrap again
    for name in hooks:
        assert name in vars(model)
        seam.unwrap_module_method(model, name, owner)
        assert name not in vars(model) and getattr(model, name).__func__ is getattr(Built, name)


# ------------------------------------------------------------------------------ precision plugin
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_precision_clip_grad_by_norm_on_the_instance(algorithm: str) -> None:
    """Through a Trainer run: ``gradient_clip_val`` -> ``LightningModule.clip_gradients`` ->
    ``trainer.precision_plugin.clip_gradients`` reaches the instance's ``clip_grad_by_norm`` when clipping by
    norm (with the plugin's main parameters and the value), not when clipping by value; the plugin keeps its
    object and class."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    calls: list[tuple[list[torch.Tensor], float]] = []

    def clip(parameters: Any, max_norm: float) -> None:
        params = list(parameters)
        calls.append((params, max_norm))
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    for plugin in (pl.plugins.precision.Precision(), HalfPrecision("bf16-true")):
        kind, method = type(plugin), type(plugin).clip_grad_by_norm
        seam.route_norm_clipping(plugin, clip)
        assert type(plugin) is kind and kind.clip_grad_by_norm is method  # the class is untouched
    trainer = _trainer(max_steps=2, limit_val_batches=0, gradient_clip_val=0.25,
                       gradient_clip_algorithm=algorithm)
    plugin = trainer.precision_plugin
    kind = type(plugin)
    seam.route_norm_clipping(plugin, clip)
    model = BoringModel()
    trainer.fit(model)
    assert trainer.precision_plugin is plugin and type(plugin) is kind
    if algorithm == "value":
        assert calls == []
        return
    assert len(calls) == 2 and all(max_norm == 0.25 for _, max_norm in calls)
    assert [id(p) for p in calls[0][0]] == [id(p) for p in model.parameters()]


# ------------------------------------------------------------------------------ jsonargparse
def test_subcommand_parser() -> None:
    from jsonargparse import ArgumentParser, Namespace

    from fsdp_strategies.cli import ArgumentParser as OurParser

    parser = ArgumentParser(exit_on_error=False)
    sub = ArgumentParser(exit_on_error=False)
    sub.add_argument("--lr", type=float, default=0.1)
    parser.add_subcommands().add_subcommand("fit", sub)
    with pytest.raises(Exception) as info:
        parser.check_config(Namespace(subcommand="fit", fit=Namespace(lr=0.1, lrr=1.0)))
    error = info.value.__context__ or info.value
    while error is not None and seam.subcommand_parser(error) is None:
        error = error.__cause__ or error.__context__
    assert error is not None and seam.subcommand_parser(error) is sub
    # our parser's error() receives the exception (jsonargparse's signature)
    assert list(inspect.signature(ArgumentParser.error).parameters)[:3] == ["self", "message", "ex"]
    assert "ex" in inspect.signature(OurParser.error).parameters


class _Widget(pl.Callback):
    """A callback with a Literal, an optional Literal and an option error (for jsonargparse's messages)."""

    def __init__(self, mode: Literal["full", "none"] = "full", dtype: Literal["bf16", "fp32"] | None = None,
                 every: int = 1) -> None:
        super().__init__()
        if every < 1:
            raise ValueError(f"every={every} is not positive. Fix: every: 1 or more.")


class _Trainer:
    def __init__(self, max_steps: int = 1, strategy: str | pl.Callback = "auto") -> None:
        pass


def _jsonargparse_error(argv: list[str], config: str | None = None, instantiate: bool = False) -> str:
    """The message of the error the installed jsonargparse raises for ``argv`` (and a YAML ``config``)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--callbacks", type=list[pl.Callback] | pl.Callback | None)
    parser.add_class_arguments(_Trainer, "trainer")
    parser.add_argument("--config", action="config")
    with tempfile.TemporaryDirectory() as folder, pytest.raises(Exception) as info:
        if config is not None:
            (Path(folder) / "config.yaml").write_text(config)
            argv = ["--config", str(Path(folder) / "config.yaml"), *argv]
        cfg = parser.parse_args(argv)
        if instantiate:
            parser.instantiate(cfg)
    return str(info.value)


_WIDGET = f"{__name__}._Widget"
_RAISING = ["--trainer.strategy", _WIDGET, "--trainer.strategy.every", "0"]  # _Widget.__init__ raises
# pattern name -> (the real error's message, a line or all of it to match, the groups the CLI reads)
_MESSAGES: dict[str, tuple[Callable[[], str], Callable[[str], list[str]], tuple[str, ...]]] = {
    "CLASS_PATH": (lambda: _jsonargparse_error([f"--callbacks={_WIDGET}", "--callbacks.mode", "ful"]),
                   lambda text: text.splitlines(), ("    ", _WIDGET)),
    "PARSER_KEY": (lambda: _jsonargparse_error([f"--callbacks={_WIDGET}", "--callbacks.mode", "ful"]),
                   lambda text: text.splitlines()[:1], ("callbacks",)),
    "LITERAL_GOT": (lambda: _jsonargparse_error([f"--callbacks={_WIDGET}", "--callbacks.mode", "ful"]),
                    lambda text: text.splitlines(), ("'full', 'none'", "ful")),
    "LITERAL_IN_UNION": (lambda: _jsonargparse_error([f"--callbacks={_WIDGET}", "--callbacks.dtype", "bf61"]),
                         lambda text: text.splitlines()[3:], ("'bf16', 'fp32'",)),
    "GIVEN": (lambda: _jsonargparse_error([f"--callbacks={_WIDGET}", "--callbacks.dtype", "bf61"]),
              lambda text: text.splitlines(), ("bf61",)),
    "NOT_ACCEPTED": (lambda: _jsonargparse_error([f"--callbacks={_WIDGET}", "--callbacks.mod", "full"]),
                     lambda text: text.splitlines(), ("mod",)),
    "GROUP_OPTION": (lambda: _jsonargparse_error([], config="trainer:\n  max_stepz: 3\n"),
                     lambda text: [text], ("trainer", "max_stepz")),
    "UNRECOGNIZED": (lambda: _jsonargparse_error(["--trainer.max_stepz", "5"]),
                     lambda text: text.splitlines()[:1], ("--trainer.max_stepz 5",)),
    "DOT_PATH": (lambda: _jsonargparse_error(["--trainer.strategy", "ddp", "--trainer.strategy.mode", "x"]),
                 lambda text: [text], ("ddp",)),
    "UNION_CLASS": (lambda: _jsonargparse_error(_RAISING, instantiate=True), lambda text: [text],
                    ("_Widget",)),
    "UNION_MEMBER_ERROR": (lambda: _jsonargparse_error(_RAISING, instantiate=True),
                           lambda text: [line for line in text.splitlines() if "Fix: " in line],
                           ("every=0 is not positive. Fix: every: 1 or more.",)),
}


def test_jsonargparse_message_patterns_each_have_a_case() -> None:
    patterns = {name for name, value in vars(seam.JsonargparseMessage).items()
                if isinstance(value, re.Pattern)}
    assert patterns == set(_MESSAGES)


@pytest.mark.parametrize("name", sorted(_MESSAGES))
def test_jsonargparse_message(name: str) -> None:
    """The installed jsonargparse's real message still has the line ``JsonargparseMessage.<name>`` reads,
    with the groups the CLI's summary is built from."""
    make, lines, groups = _MESSAGES[name]
    pattern: re.Pattern[str] = getattr(seam.JsonargparseMessage, name)
    text = make()
    found = [m.groups() for m in map(pattern.search, lines(text)) if m]
    assert found, f"jsonargparse's message no longer matches JsonargparseMessage.{name}:\n{text}"
    assert found[0] == groups, (found, text)


# ------------------------------------------------------------------------------ torch
def test__pytree_tree_leaves() -> None:
    assert tseam.tree_leaves({"a": [1, (2, 3)], "b": 4}) == [1, 2, 3, 4]


def test__compiled_call_impl_and__orig_mod() -> None:
    block = nn.Linear(2, 2)
    assert not tseam.is_compiled_module(block)
    block.compile()  # lazy: nothing is compiled until called
    assert tseam.is_compiled_module(block)
    assert tseam.is_compiled_module(torch.compile(nn.Linear(2, 2)))


def test__ops_OpOverload_and__schema() -> None:
    assert tseam.is_op_overload(torch.ops.aten.mm.default) and not tseam.is_op_overload(torch.ops.aten.mm)
    names = [
        a.name for a in tseam.op_schema(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu).arguments
    ]
    assert "is_causal" in names


def test__current_graph_task_id() -> None:
    seen: list[bool] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            seen.append(tseam.inside_autograd_backward())
            return grad * 2

    x = torch.ones(2, requires_grad=True)
    assert tseam.inside_autograd_backward() is False
    Probe.apply(x).sum().backward()
    assert seen == [True]


def test_queue_backward_callback_runs_once_the_backward_has_finished() -> None:
    """ft_hsdp waits for its cross-group all-reduces there: after every gradient of the backward (also the
    leaf's, accumulated last) and after the callbacks queued before it, once per backward."""
    from fsdp_strategies import _torch_seam as tseam

    seen: list[str] = []
    x = torch.ones(2, requires_grad=True)

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            return t.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            tseam.queue_backward_callback(lambda: seen.append("first"))
            tseam.queue_backward_callback(lambda: seen.append(f"second, leaf grad {x.grad is not None}"))
            seen.append("backward")
            return grad

    Probe.apply(x).sum().backward()
    assert seen == ["backward", "first", "second, leaf grad True"]
    Probe.apply(x).sum().backward()
    assert len(seen) == 6


def test_sdpa_flop_count_and_sdpa_backward_flop_count_with_grouped_query_attention() -> None:
    """torch 2.11's formulas assert that key/value have the query's heads (found by make test-torch-range: an
    AssertionError in the FLOP count of a GQA Llama); the seam counts GQA as the kernel runs it, key/value
    heads broadcast to the query's, on every version: the counts of the same attention with key/value
    repeated."""
    from torch.utils import flop_counter

    import fsdp_strategies.flops.counter  # registers the CPU flash-attention formulas through the seam

    q, kv, full = (2, 8, 16, 32), (2, 2, 16, 32), (2, 8, 16, 32)
    two_bmms = 2 * 2 * (2 * 8) * 16 * 32 * 16  # scores and output, each 2 * (b * h_q) * s_q * d * s_k
    assert tseam.sdpa_flop_count(q, kv, kv) == flop_counter.sdpa_flop_count(q, full, full) == two_bmms
    backward = flop_counter.sdpa_backward_flop_count(q, q, full, full)
    assert tseam.sdpa_backward_flop_count(q, q, kv, kv) == backward
    assert tseam.sdpa_flop_count(q, full, full) == two_bmms  # MHA: unchanged

    def counted(gqa: bool) -> int:
        torch.manual_seed(0)
        query = torch.randn(1, 4, 8, 16, requires_grad=True)
        key, value = torch.randn(1, 2 if gqa else 4, 8, 16), torch.randn(1, 2 if gqa else 4, 8, 16)
        with flop_counter.FlopCounterMode(display=False) as mode:
            torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=False,
                                                             enable_gqa=gqa).sum().backward()
        return mode.get_total_flops()

    assert fsdp_strategies.flops.counter is not None
    assert counted(gqa=True) == counted(gqa=False) > 0


def test__get_raw_and__count_flops() -> None:
    got: list[Any] = []

    def raw_mm(a: Any, b: Any, out_val: Any = None, **_: Any) -> int:
        got.append(type(a))
        return 7

    class Counter(tseam.HookedFlopCounter):
        def on_flops(self, func_packet: Any, flops: int, args: Any) -> None:
            got.append((func_packet, flops))

    with Counter(
        display=False, custom_mapping={torch.ops.aten.mm: tseam.raw_tensor_formula(raw_mm)}
    ) as counter:
        torch.ones(2, 3) @ torch.ones(3, 4)
    assert got == [torch.Tensor, (torch.ops.aten.mm, 7)]  # tensors (not shapes) in; each count reported
    assert counter.get_total_flops() == 7


def test__python_dispatch_TorchDispatchMode() -> None:
    from fsdp_strategies.testing import KeptBytes

    ops: list[str] = []

    class Seen(tseam.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2) + 1
    assert any("add" in op for op in ops)
    with KeptBytes() as kept:
        kept_tensor = torch.ones(256) * 2
    assert kept.alive(set()) >= 1024 and kept_tensor is not None


def test_Tensor__version() -> None:
    t = torch.zeros(3)
    before = tseam.tensor_version(t)
    t.add_(1)
    assert tseam.tensor_version(t) == before + 1
    assert tseam.tensor_version(t.view(3)) == before + 1  # views share the counter


def test__random_is_rng_supported_mesh(
    monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    """``dtensor_rng_per_shard``: a CPU mesh has no per-shard DTensor RNG (what sharded_init works around),
    and the answer comes without torch's warning about it."""
    from torch.distributed.device_mesh import init_device_mesh

    with _one_process_group(monkeypatch):
        assert tseam.dtensor_rng_per_shard(init_device_mesh("cpu", (1,))) is False
    assert not [w for w in recwarn if "random" in str(w.message)]


def test_DTensor__local_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """``local_shard`` is the shard ``to_local()`` gives (same storage, same values), as a plain tensor with
    no autograd node even with grad enabled; an FSDP2 parameter's shard is the one the optimizer updates."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    with _one_process_group(monkeypatch):
        model = fully_shard(torch.nn.Linear(4, 3), mesh=init_device_mesh("cpu", (1,)))
        weight = model.weight
        assert isinstance(weight, DTensor) and weight.requires_grad
        shard = tseam.local_shard(weight)
        assert type(shard) is torch.Tensor and shard.grad_fn is None
        assert shard.untyped_storage().data_ptr() == weight.to_local().untyped_storage().data_ptr()
        model(torch.ones(2, 4)).sum().backward()
        before = shard.clone()
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        assert not torch.equal(before, shard) and torch.equal(shard, weight.to_local().detach())


def test_UntypedStorage__new_with_weak_ptr() -> None:
    from torch.multiprocessing.reductions import StorageWeakRef

    t = torch.ones(256)
    ref = StorageWeakRef(t.untyped_storage())
    live = tseam.live_storage(ref)
    assert live is not None and live.nbytes() == 1024 and live.data_ptr() == t.data_ptr()
    # what FSDP2 does to its all-gathered parameters: read now, not at creation
    t.untyped_storage().resize_(0)
    assert tseam.live_storage(ref).nbytes() == 0
    del t, live
    assert tseam.live_storage(ref) is None


def test__get_fsdp_state__lazy_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fsdp_lazy_init`` makes the module the root before any forward: a sub-unit called first then runs as a
    sub-unit (its own all-gather) instead of claiming the root role, after which the parent's forward would
    fail ("requires running forward through the root module first")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with _one_process_group(monkeypatch):
        mesh = init_device_mesh("cpu", (1,))
        for init_first in (True, False):
            model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 2))
            fully_shard(model[0], mesh=mesh)
            fully_shard(model, mesh=mesh)
            if init_first:
                tseam.fsdp_lazy_init(model)
            model[0](torch.ones(2, 4))  # the sub-unit alone, as self.model(...) in a hook
            if init_first:
                assert model(torch.ones(2, 4)).shape == (2, 2)
            else:
                with pytest.raises(RuntimeError, match="root module first"):
                    model(torch.ones(2, 4))


def test__get_fsdp_state__fsdp_param_groups__unsharded_param__partial_reduce_output(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``fsdp_gradient_holders`` sees each place FSDP2 keeps a gradient: whole gradients under
    ``set_requires_gradient_sync(False)``, the pending reduce-scattered one under
    ``set_requires_all_reduce(False)`` on a (replicate, shard) mesh, the sharded ``param.grad`` after. Each
    counted once (torch 2.15 made ``unsharded_accumulated_grad`` a property returning the unsharded grad)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def held() -> dict[str, int]:
        out = {"sharded": 0, "unsharded": 0, "pending_all_reduce": 0}
        for kind, tensor in tseam.fsdp_gradient_holders(model):
            out[kind] += tensor.numel()
        return out

    def backward() -> None:
        model(torch.ones(2, 4)).sum().backward()

    with _one_process_group(monkeypatch):
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        full = sum(p.numel() for p in model.parameters())
        assert held() == {"sharded": 0, "unsharded": 0, "pending_all_reduce": 0}
        model.set_requires_gradient_sync(False)
        backward()
        assert held() == {"sharded": 0, "unsharded": full, "pending_all_reduce": 0}
        model.set_requires_gradient_sync(True)
        backward()  # reduces the kept gradients with this one's
        assert held() == {"sharded": full, "unsharded": 0, "pending_all_reduce": 0}
        model.zero_grad(set_to_none=True)
        model.set_requires_all_reduce(False)
        backward()
        assert held() == {"sharded": 0, "unsharded": 0, "pending_all_reduce": full}
        model.set_requires_all_reduce(True)
        backward()
        assert held() == {"sharded": full, "unsharded": 0, "pending_all_reduce": 0}


def test__iterator_and__shutdown_workers() -> None:
    loader = DataLoader(list(range(4)), num_workers=1, persistent_workers=True)
    assert tseam.loader_iterator(loader) is None
    iterator = iter(loader)
    assert tseam.loader_iterator(loader) is iterator
    next(iterator)
    tseam.shutdown_loader_workers(iterator)
    assert iterator._shutdown is True  # type: ignore[attr-defined]
    tseam.shutdown_loader_workers(iter(DataLoader([1])))  # single-process iterator: nothing to stop


def test__metadata_fn_and_dcp_metadata_classes(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from fsdp_strategies.checkpoint.safe_load import load_dcp_metadata

    dcp.save({"w": torch.arange(4.0), "step": 3}, checkpoint_id=str(tmp_path))
    assert (tmp_path / tseam.DCP_METADATA_FILE).is_file() and tseam.DCP_METADATA_FILE == ".metadata"
    metadata = load_dcp_metadata(tmp_path)  # only the allow-listed classes (incl. the private ones) resolve
    assert set(metadata.state_dict_metadata) == {"w", "step"}
    assert ("torch.serialization", "_get_layout") in tseam.dcp_metadata_globals()


def test__fsspec_filesystem_FsspecWriter_and_FsspecReader() -> None:
    """DCP's fsspec writer and reader take a URL and fsspec's storage options, and round-trip a state."""
    import uuid

    import fsspec
    import torch.distributed.checkpoint as dcp

    url = f"memory://seam-{uuid.uuid4().hex}/ckpt"
    writer = tseam.fsspec_storage("writer")(url, skip_instance_cache=False)
    dcp.save({"w": torch.arange(4.0), "step": 3}, storage_writer=writer)
    fs, root = fsspec.core.url_to_fs(url)
    assert fs.isfile(f"{root}/{tseam.DCP_METADATA_FILE}")
    state = {"w": torch.zeros(4), "step": 0}
    dcp.load(state, storage_reader=tseam.fsspec_storage("reader")(url))
    assert torch.equal(state["w"], torch.arange(4.0)) and state["step"] == 3
    fs.rm(root, recursive=True)


def test_numpy__reconstruct() -> None:
    import io

    import numpy as np

    buffer = io.BytesIO()
    torch.save({"a": np.arange(3), "s": np.float64(2.5)}, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals(tseam.numpy_pickle_globals()):
        out = torch.load(buffer, weights_only=True)
    assert out["s"] == 2.5 and list(out["a"]) == [0, 1, 2]
    with pytest.raises(pickle.UnpicklingError):
        buffer.seek(0)
        # without them: refused, so the allow-list is what makes it load
        torch.load(buffer, weights_only=True)


# ------------------------------------------------------------------------------ torchft
class _OneReplicaManager:
    """Single-process stand-in for ``torchft.Manager`` as DiLoCo uses it: the only replica (the all-reduce
    average is the tensor itself); ``commit`` decides each outer step."""

    _use_async_quorum = False  # DiLoCo refuses an async quorum

    def __init__(self) -> None:
        self.commit = True
        self.fns: dict[str, Any] = {}

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.fns[key] = (load, save)

    def allreduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(wait=lambda *a, **k: True)

    def should_commit(self, *args: Any, **kwargs: Any) -> bool:
        return self.commit

    def current_step(self) -> int:
        return 0


def test_torchft_DiLoCo__fragments() -> None:
    """``OuterSync`` drives each fragment itself, in model order: ``prepare_sync``/``perform_sync`` (rolls the
    fragment's parameters back to its backup, outer step on commit) and ``save_parameters`` (straggler_sync
    starts rounds from the current weights)."""
    from torchft.local_sgd import DiLoCo

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    parts = [model[0], model[1]]
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = [torch.optim.SGD(p.parameters(), lr=1.0) for p in parts]
    manager = _OneReplicaManager()
    diloco = DiLoCo(manager, parts, inner, outer, sync_every=2, pin_memory=False)  # type: ignore[arg-type]

    def params(i: int) -> list[torch.Tensor]:
        return [p.detach().clone() for p in parts[i].parameters()]

    def inner_step() -> None:
        inner.zero_grad()
        model(torch.ones(4, 2)).sum().backward()
        inner.step()

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    fragments = tseam.diloco_fragments(diloco)
    assert isinstance(fragments, list) and len(fragments) == 2
    start = [params(0), params(1)]
    inner_step()
    local = [params(0), params(1)]
    assert not same(local[0], start[0]) and not same(local[1], start[1])

    manager.commit = False  # a discarded sync of fragment 0: its parameters (and only its) roll back
    fragments[0].prepare_sync()
    assert fragments[0].perform_sync() is False
    assert same(params(0), start[0]) and same(params(1), local[1])

    inner_step()
    moved = params(0)
    manager.commit = True  # one replica, outer lr 1: the committed outer step lands on the local weights
    fragments[0].prepare_sync()
    assert fragments[0].perform_sync() is True
    assert all(torch.allclose(a, b) for a, b in zip(params(0), moved))

    fragments[1].save_parameters()  # fragment 1's rollback point becomes its current weights...
    saved = params(1)
    assert not same(saved, start[1])
    inner_step()
    manager.commit = False
    fragments[1].prepare_sync()
    assert fragments[1].perform_sync() is False
    assert same(params(1), saved)  # ...so a discarded sync returns there, not to the start


@pytest.fixture
def ft_manager() -> Iterator[Any]:
    """A real ``torchft.Manager`` (rank 0 of a one-rank group, synchronous quorum) against a real lighthouse
    and TCPStore in this process."""
    from datetime import timedelta

    from torchft.coordination import LighthouseServer
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=10,
                                  heartbeat_timeout_ms=5000)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=30)
    manager = None
    try:
        manager = Manager(pg=ProcessGroupGloo(), load_state_dict=lambda state: None, state_dict=lambda: {},
                          min_replica_size=1, use_async_quorum=False, rank=0, world_size=1,
                          store_addr="127.0.0.1",
                          store_port=store.port, lighthouse_addr=lighthouse.address(), replica_id="seam",
                          port=0, hostname="127.0.0.1", timeout=timeout, quorum_timeout=timeout,
                          connect_timeout=timeout)
        yield manager
    finally:
        if manager is not None:
            manager.shutdown(wait=False)
        lighthouse.shutdown()
        del store


def test_torch_DefaultStager_stages_once_or_again() -> None:
    """``default_stager_reusable`` (a behaviour, not a name): torch 2.11's ``DefaultStager.stage`` closes its
    ``StateDictStager`` after each call (the second raises ``KeyError``), 2.13's does not. The answer is the
    probe's, cached; a stager the writer keeps stages again exactly when it says so."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    answer = tseam.default_stager_reusable()
    assert answer is tseam.default_stager_reusable()
    known = {(2, 11): False, (2, 13): True}.get(tuple(int(x) for x in torch.__version__.split(".")[:2]))
    assert known is None or answer is known
    stager = DefaultStager(StagingOptions(False, False, False, False))
    state = {"w": torch.arange(3.0), "step": 1}
    try:
        assert torch.equal(stager.stage(state)["w"], state["w"])
        try:
            again = stager.stage(state)
        except KeyError:
            again = None
    finally:
        stager.close()
    assert (again is not None) is answer


def test_torchft_Manager__quorum_id_and__quorum_future(ft_manager: Any) -> None:
    """``ft_hsdp`` asks whether a quorum was started (before the first ``start_quorum`` there is nothing to
    wait for or commit) and records the quorum's id with each step."""
    assert tseam.quorum_started(ft_manager) is False and tseam.quorum_id(ft_manager) == -1
    ft_manager.start_quorum()
    assert tseam.quorum_started(ft_manager) is True
    first = tseam.quorum_id(ft_manager)
    assert first >= 0 and ft_manager.num_participants() == 1
    assert ft_manager.should_commit() is True
    ft_manager.start_quorum()  # same members: the same quorum
    assert tseam.quorum_started(ft_manager) is True and tseam.quorum_id(ft_manager) == first


@pytest.mark.subprocess
def test__distributed_c10d__dump_fr_trace_json() -> None:
    """torch's flight recorder through the seam: gloo's collectives and their sequence numbers; off by
    default."""
    code = (
        "import json, os, sys, torch, torch.distributed as dist\n"
        "from fsdp_strategies._torch_seam import flight_recorder_json\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:' + sys.argv[1], rank=0,\n"
        "                        world_size=1)\n"
        "dist.all_reduce(torch.ones(2)); dist.all_gather([torch.ones(1)], torch.ones(1))\n"
        "raw = flight_recorder_json()\n"
        "print(json.dumps(None if raw is None else [(e['profiling_name'], e['collective_seq_id'])\n"
        "                                           for e in json.loads(raw)['entries']]))\n"
        "dist.destroy_process_group()\n"
    )
    for size, expected in (("64", [["gloo:all_reduce", 1], ["gloo:all_gather", 2]]), ("0", None)):
        # (forked from the test zygote: the variable is read when the process group starts, not at import)
        proc = run_python(["-c", code, str(free_port())], env={"TORCH_FR_BUFFER_SIZE": size}, timeout=120)
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected, proc.stdout


@pytest.mark.subprocess
def test_atexit__run_exitfuncs(tmp_path: Path) -> None:
    """A process that ends with ``os._exit`` runs its atexit handlers only through the seam."""
    import sys

    marker = tmp_path / "ran"
    seam_file = Path(tseam.__file__)  # loaded alone: the package's front door (every layer) is not needed
    code = (
        "import atexit, os, importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('torch_seam', {str(seam_file)!r})\n"
        "seam = importlib.util.module_from_spec(spec); spec.loader.exec_module(seam)\n"
        "run_exit_handlers = seam.run_exit_handlers\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'w').write('x'))\n"
        "import sys\n"
        "if sys.argv[1] == 'seam':\n"
        "    run_exit_handlers()\n"
        "os._exit(0)\n"
    )
    for mode, expected in (("skip", False), ("seam", True)):
        processes.run([sys.executable, "-c", code, mode], capture_output=False, check=True, timeout=120)
        assert marker.exists() is expected, mode


# ------------------------------------------------------------------------------ the seam is the only place
_SRC = Path(__file__).resolve().parents[1] / "src" / "fsdp_strategies"
_SEAMS = {"_lightning_seam.py", "_torch_seam.py"}
_FOREIGN = ("lightning", "torch", "torchft", "jsonargparse", "numpy")


def _lightning_private_members() -> set[str]:
    """Underscore names Lightning's strategy base classes define or assign on ``self``."""
    import re

    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    names: set[str] = set()
    for base in (ModelParallelStrategy, DDPStrategy):
        for klass in base.__mro__:
            if not klass.__module__.startswith("lightning"):
                continue
            names |= {n for n in vars(klass) if n.startswith("_") and not n.startswith("__")}
            names |= set(re.findall(r"self\.(_[a-zA-Z]\w*)", inspect.getsource(klass)))
    return names


def test_no_private_name_outside_the_seams() -> None:
    """No module but the two seams imports, reads, writes or overrides a foreign private name."""
    import ast

    inherited = _lightning_private_members()
    found: list[str] = []
    for path in sorted(_SRC.rglob("*.py")):
        if path.name in _SEAMS:
            continue
        tree = ast.parse(path.read_text())
        where = path.relative_to(_SRC)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _FOREIGN:
                private_module = any(part.startswith("_") for part in (node.module or "").split("."))
                names = [a.name for a in node.names if a.name.startswith("_")]
                if private_module or names:
                    found.append(f"{where}:{node.lineno} from {node.module} import {names or '...'}")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    if node.attr in inherited:
                        found.append(
                            f"{where}:{node.lineno} self.{node.attr} (a Lightning base-class private)"
                        )
                elif (
                    isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"
                ):
                    if node.attr in inherited:
                        found.append(f"{where}:{node.lineno} super().{node.attr}")
                elif ast.unparse(node) != "os._exit":
                    found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.FunctionDef) and node.name in inherited:
                found.append(f"{where}:{node.lineno} overrides {node.name}")
    assert not found, (
        "private names outside fsdp_strategies/_lightning_seam.py / _torch_seam.py:\n" + "\n".join(found)
    )


def test_no_callback_imports_a_concrete_strategy() -> None:
    import ast

    for path in sorted((_SRC / "callbacks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                )
                assert not any(m.startswith("fsdp_strategies.strategies") for m in modules), (
                    path.name,
                    modules,
                )
                if isinstance(node, ast.ImportFrom) and node.module == "fsdp_strategies":
                    assert not any(a.name.endswith("Strategy") for a in node.names), (path.name, node.lineno)


def test__checkpoint_connector_restore(tmp_path: Path) -> None:
    """``restore_checkpoint`` from inside a strategy's ``setup`` restores what ``fit(ckpt_path=...)`` would:
    the weights, the optimizer state and the loop position (the run goes on at the checkpoint's step)."""
    first = _trainer(max_steps=3, default_root_dir=tmp_path)
    first.fit(BoringModel())
    ckpt = tmp_path / "three.ckpt"
    first.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)

    class Restoring(SingleDeviceStrategy):
        def setup(self, trainer: pl.Trainer) -> None:
            super().setup(trainer)
            seam.restore_checkpoint(trainer, str(ckpt))
            restored = self.lightning_module.state_dict()
            assert all(torch.equal(restored[k], v) for k, v in saved["state_dict"].items())
            assert (trainer.optimizers[0].state_dict()["state"].keys()
                    == saved["optimizer_states"][0]["state"].keys())

    class Counting(BoringModel):
        steps = 0

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            Counting.steps += 1
            return super().training_step(batch, batch_idx)

    trainer = _trainer(max_steps=5, strategy=Restoring(device=torch.device("cpu")), default_root_dir=tmp_path)
    trainer.fit(Counting())
    assert trainer.global_step == 5 and Counting.steps == 2  # went on from step 3
