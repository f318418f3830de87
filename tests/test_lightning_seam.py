"""One test per private name of Lightning / torch / torchft / jsonargparse this package relies on.

Every access lives in :mod:`fsdp_strategies._lightning_seam` or :mod:`fsdp_strategies._torch_seam`;
each test is named after the private name and checks the behaviour the package needs in the
*installed* version (or, where behaviour needs a process group, the name and signature), so an
upgrade that renames or changes one fails here, by name, instead of deep inside a training run.
Run against the oldest and newest supported Lightning (docs/getting-started.md: "Supported versions").
All single-process and fast (one tiny ``fit`` shared by the loop tests).
"""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

import processes
from fsdp_strategies import _lightning_seam as seam
from fsdp_strategies import _torch_seam as tseam


def _trainer(**kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
                                "enable_progress_bar": False, "enable_model_summary": False}
    return pl.Trainer(**{**defaults, **kwargs})


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
    assert all(v.device.type == "meta" for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())


def test__METADATA_FILENAME() -> None:
    from lightning.fabric.strategies import model_parallel as fabric_mp

    assert seam.LIGHTNING_META_FILE == "meta.pt"
    # Lightning's own sharded-checkpoint loader reads this file back (so our folders load there too)
    assert "_METADATA_FILENAME" in inspect.getsource(fabric_mp)


def test__set_sampler_epoch() -> None:
    loader = DataLoader(RandomDataset(2, 8), sampler=DistributedSampler(RandomDataset(2, 8), num_replicas=2, rank=0))
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
def test__setup_distributed() -> None:
    # needs a process group to run; its shape is what fsdp2's setup_environment relies on
    method = ModelParallelStrategy._setup_distributed
    assert list(inspect.signature(method).parameters) == ["self"]
    source = inspect.getsource(method)
    assert "set_world_ranks" in source and "_init_dist_connection" in source and "device_mesh" not in source


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
    assert seam.saves_distributed_checkpoint(ModelParallelStrategy(save_distributed_checkpoint=False)) is False


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
    out = seam.forward_redirection(ModelParallelStrategy(), wrapper, module, "training_step", torch.ones(2), 7)
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
    """Public hook, used for its call order: the strategies validate options there (no ``_configure_launcher``)."""
    seen: list[tuple[str, int, int, bool]] = []

    class Probe(ModelParallelStrategy):
        def set_world_ranks(self) -> None:
            super().set_world_ranks()
            seen.append((str(self.precision_plugin.precision), self.num_processes, self.num_nodes,
                         self.launcher is None))

    _trainer(devices=2, num_nodes=1, precision="bf16-true", strategy=Probe())
    assert seen and seen[0] == ("bf16-true", 2, 1, True)


def test_configure_ddp_wraps_then_registers_hooks() -> None:
    """ddp_hooks overrides the public ``configure_ddp`` instead of the private ``_register_ddp_hooks``."""
    assert "self.configure_ddp()" in inspect.getsource(DDPStrategy.setup)
    source = inspect.getsource(DDPStrategy.configure_ddp)
    assert source.index("_setup_model") < source.index("_register_ddp_hooks")
    assert DDPStrategy()._ddp_comm_hook is None  # so Lightning's own registration has nothing to register


def test_ModelParallelStrategy_setup_steps() -> None:
    """``FSDP2Strategy.setup`` re-orders these steps of the parent's ``setup``: they must all still be there."""
    source = inspect.getsource(ModelParallelStrategy.setup)
    for step in ("accelerator.setup", "_materialize_distributed_module", "convert_module", "model_to_device",
                 "barrier", "setup_optimizers", "setup_precision_plugin", "_optimizers_to_device"):
        assert step in source, step


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
        self.record["combined"] = combined is not None and list(combined.flattened) == [trainer.train_dataloader]
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
            self.record["iterator_during"] = seam.combined_loader_iterator(seam.training_combined_loader(self.trainer))
        self.record["in_hook"].append(seam.in_lightning_hook(self))
        return super().training_step(batch, batch_idx)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
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


def test__batches_that_stepped_and_optim_progress(fitted: _Probe) -> None:
    # global_step jumps to the set count and max_steps=25 stops after the third step (30)
    assert fitted.record["steps"] == [10, 20, 30]
    # the logging step is incremented after on_train_batch_end: one below the step there
    assert fitted.record["logging_steps"] == [9, 19, 29]


def test__current_fx_name(fitted: _Probe) -> None:
    assert fitted.record["in_hook"] and all(fitted.record["in_hook"])
    assert seam.in_lightning_hook(fitted) is False  # after fit: no hook running


def test__on_before_batch_transfer(fitted: _Probe) -> None:
    assert fitted.record["transfer"] == 1000.0


def test__broadcast_sigterm_tensor() -> None:
    method = _TrainingEpochLoop._broadcast_sigterm_tensor
    assert list(inspect.signature(method).parameters) == ["self"]
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    trainer = _trainer()
    calls: list[int] = []
    loop = seam.replace_sigterm_broadcast(trainer, lambda: calls.append(1))
    assert loop is trainer.fit_loop.epoch_loop
    loop._broadcast_sigterm_tensor()
    assert calls == [1]
    seam.restore_sigterm_broadcast(loop)
    assert loop._broadcast_sigterm_tensor.__func__ is method


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
    names = [a.name for a in tseam.op_schema(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu).arguments]
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


def test__get_raw_and__count_flops() -> None:
    got: list[Any] = []

    def raw_mm(a: Any, b: Any, out_val: Any = None, **_: Any) -> int:
        got.append(type(a))
        return 7

    class Counter(tseam.HookedFlopCounter):
        def on_flops(self, func_packet: Any, flops: int, args: Any) -> None:
            got.append((func_packet, flops))

    with Counter(display=False, custom_mapping={torch.ops.aten.mm: tseam.raw_tensor_formula(raw_mm)}) as counter:
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


def test_UntypedStorage__new_with_weak_ptr() -> None:
    from torch.multiprocessing.reductions import StorageWeakRef

    t = torch.ones(256)
    ref = StorageWeakRef(t.untyped_storage())
    live = tseam.live_storage(ref)
    assert live is not None and live.nbytes() == 1024 and live.data_ptr() == t.data_ptr()
    t.untyped_storage().resize_(0)  # what FSDP2 does to its all-gathered parameters: read now, not at creation
    assert tseam.live_storage(ref).nbytes() == 0
    del t, live
    assert tseam.live_storage(ref) is None


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
        torch.load(buffer, weights_only=True)  # without them: refused, so the allow-list is what makes it load


# ------------------------------------------------------------------------------ torchft
def test_torchft_DiLoCo__fragments() -> None:
    # _ft_sync drives each fragment's prepare_sync/perform_sync itself (and save_parameters when straggler_sync
    # starts rounds from the current weights): the list and those methods must exist
    import inspect

    from torchft.local_sgd import DiLoCo, _StreamingDiLoCoFragment

    assert "self._fragments" in inspect.getsource(DiLoCo.__init__)
    for name in ("prepare_sync", "perform_sync", "save_parameters"):
        assert callable(getattr(_StreamingDiLoCoFragment, name))

    class Fake:
        _fragments = ("a", "b")

    assert tseam.diloco_fragments(Fake()) == ["a", "b"]


def test_torchft_Manager__quorum_id_and__quorum_future() -> None:
    from torchft.manager import Manager

    source = inspect.getsource(Manager)
    assert "self._quorum_id" in source and "self._quorum_future" in source

    class Fake:
        _quorum_id = 4
        _quorum_future = None

    assert tseam.quorum_id(Fake()) == 4 and tseam.quorum_started(Fake()) is False


def test_atexit__run_exitfuncs(tmp_path: Path) -> None:
    """A process that ends with ``os._exit`` runs its atexit handlers only through the seam."""
    import sys

    marker = tmp_path / "ran"
    code = (
        "import atexit, os\n"
        "from fsdp_strategies._torch_seam import run_exit_handlers\n"
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
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    if node.attr in inherited:
                        found.append(f"{where}:{node.lineno} self.{node.attr} (a Lightning base-class private)")
                elif isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                    if node.attr in inherited:
                        found.append(f"{where}:{node.lineno} super().{node.attr}")
                elif ast.unparse(node) != "os._exit":
                    found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.FunctionDef) and node.name in inherited:
                found.append(f"{where}:{node.lineno} overrides {node.name}")
    assert not found, "private names outside fsdp_strategies/_lightning_seam.py / _torch_seam.py:\n" + "\n".join(found)


def test_no_callback_imports_a_concrete_strategy() -> None:
    import ast

    for path in sorted((_SRC / "callbacks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(m.startswith("fsdp_strategies.strategies") for m in modules), (path.name, modules)
                if isinstance(node, ast.ImportFrom) and node.module == "fsdp_strategies":
                    assert not any(a.name.endswith("Strategy") for a in node.names), (path.name, node.lineno)
