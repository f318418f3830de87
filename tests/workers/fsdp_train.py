"""Worker for the fsdp2/hsdp tests: trains the example for a few steps and dumps what the test checks.

Started as ``python fsdp_train.py --devices N ...``; Lightning's launcher re-executes it once per
rank (real processes, gloo). Rank 0 writes ``--out`` (torch.save) with the full parameters, the
full optimizer state, the step counters and each rank's measured bytes.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

import fsdp_strategies
from fsdp_strategies import testing as _memory
from llama import LlamaLM, MarkovDataModule

MODEL = {"vocab_size": 64, "dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32, "lr": 1e-2,
         "warmup_steps": 2}


def data_module(batch_size: int, num_train: int) -> MarkovDataModule:
    return MarkovDataModule(
        vocab_size=64, seq_len=32, batch_size=batch_size, num_train=num_train, num_val=16, shuffle=False
    )


class ProbedLM(LlamaLM):
    """The example, plus a record of whether configure_model built on the meta device."""

    built_on_meta: bool | None = None

    def configure_model(self) -> None:
        super().configure_model()
        if ProbedLM.built_on_meta is None:
            ProbedLM.built_on_meta = all(p.is_meta for p in self.parameters())


class EagerLM(ProbedLM):
    """A user who builds the network in ``__init__``, never writes ``configure_model`` and whose
    steps call the inner network (``self.model(...)``), not ``self(...)``."""

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        LlamaLM.configure_model(self)

    def configure_model(self) -> None:
        pass

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)
        )


class ProbePrecision(pl.Callback):
    """Records the dtype a block computes in, the master-weight dtype, and whether autocast is on."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx:
            return
        linear = pl_module.model.layers[0].attention.wq

        def hook(module, args, output):  # type: ignore[no-untyped-def]
            self.seen["compute_weight"] = str(module.weight.dtype)  # unsharded param during forward
            self.seen["activation"] = str(output.dtype)
            self.seen["autocast"] = str(torch.is_autocast_enabled("cpu"))

        self.handle = linear.register_forward_hook(hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx == 0:
            self.handle.remove()
            self.seen["master_weight"] = str(pl_module.model.layers[0].attention.wq.weight.dtype)
            self.seen["loss"] = str(outputs["loss"].dtype)
            state = (
                pl_module.model.layers[0]._get_fsdp_state()
                if hasattr(pl_module.model.layers[0], "_get_fsdp_state")
                else None
            )
            if state is not None:
                self.seen["fsdp_param_dtype"] = str(state._mp_policy.param_dtype)
                self.seen["fsdp_reduce_dtype"] = str(state._mp_policy.reduce_dtype)


class CountCollectives(pl.Callback):
    """Counts FSDP2 parameter all-gathers and gradient reductions (per FSDP unit and call)."""

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

        self.reduces = 0
        self.gathers = 0
        reduce, gather = pg.foreach_reduce, pg.foreach_all_gather

        def counting_reduce(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.reduces += 1
            return reduce(*args, **kwargs)

        def counting_gather(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.gathers += 1
            return gather(*args, **kwargs)

        pg.foreach_reduce, pg.foreach_all_gather = counting_reduce, counting_gather


class AccumulationProbe(pl.Callback):
    """Per micro-batch on this rank: the gradient bytes FSDP2 holds right after its backward (read from
    FSDP2's own state, ``fsdp_strategies.testing.fsdp_gradient_bytes``), the loss, and the collectives since
    the previous micro-batch on each mesh dimension's process group, counted by wrapping ``ProcessGroup``'s
    ``allreduce`` and reduce-scatter methods (whoever calls them)."""

    OPS = {"allreduce": "allreduce", "reduce_scatter_single": "reduce_scatter",
           "_reduce_scatter_base": "reduce_scatter"}

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.calls: dict[tuple[str, str], int] = {}
        self.group_names: dict[str, str] = {}
        self.full_grad_bytes = 0
        self.fsdp_units = 0
        pg_class = dist.ProcessGroup
        for method, op in self.OPS.items():
            real = getattr(pg_class, method, None)
            if real is None:
                continue

            def counted(pg, *args, _real=real, _op=op, **kwargs):  # type: ignore[no-untyped-def]
                key = (_op, self.group_names.get(pg.group_name, pg.group_name))
                self.calls[key] = self.calls.get(key, 0) + 1
                return _real(pg, *args, **kwargs)

            setattr(pg_class, method, counted)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.group_names[dist.group.WORLD.group_name] = "world"
        mesh = getattr(trainer.strategy, "device_mesh", None)
        for name in (mesh.mesh_dim_names or ()) if mesh is not None else ():
            self.group_names[mesh.get_group(name).group_name] = name
        trainable = [p for p in pl_module.parameters() if p.requires_grad]
        self.full_grad_bytes = sum(p.numel() * p.element_size() for p in trainable)  # DTensor: global numel
        self.fsdp_units = sum(isinstance(m, FSDPModule) for m in pl_module.modules())
        self.calls.clear()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.fsdp_units:
            held = _memory.fsdp_gradient_bytes(pl_module)
        else:
            held = {"sharded": _memory.grad_bytes(pl_module)}
        self.rows.append({"step": trainer.global_step, "held": held})

    def on_train_batch_end(self, trainer, pl_module, outputs, *args):  # type: ignore[no-untyped-def]
        calls = {f"{op}@{group}": n for (op, group), n in self.calls.items()}
        self.rows[-1].update(loss=float(outputs["loss"]), calls=calls)
        self.calls.clear()


class CrashOnSave(pl.Callback):
    """Kill the process in the middle of the N-th checkpoint write (after the shards, before commit)."""

    def __init__(self, nth: int) -> None:
        import fsdp_strategies.checkpoint.atomic as ckpt

        self.count = 0
        real_save = ckpt.dcp.save

        def crashing_save(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.count += 1
            result = real_save(*args, **kwargs)
            if self.count >= nth:
                os._exit(17)
            return result

        ckpt.dcp.save = crashing_save


class BreakWrite(pl.Callback):
    """Sabotage the ``nth`` DCP ``write_data`` call of this process (the background write under
    ``async_checkpoint='thread'``): ``fail`` raises an OSError on rank ``rank`` only; ``kill`` lets the write
    finish its files, then SIGKILLs this rank before the write returns (every rank)."""

    def __init__(self, nth: int, mode: str, rank: int = 1) -> None:
        self.nth, self.mode, self.rank, self.count = nth, mode, rank, 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        import signal

        from torch.distributed.checkpoint import FileSystemWriter

        real, me = FileSystemWriter.write_data, trainer.global_rank

        def write_data(writer, plan, planner):  # type: ignore[no-untyped-def]
            self.count += 1
            if self.count == self.nth and self.mode == "fail" and me == self.rank:
                raise OSError(5, "Input/output error (injected)")  # a full disk: tests/test_disk_full.py
            result = real(writer, plan, planner)
            if self.count == self.nth and self.mode == "kill":
                result.wait()
                print(
                    f"rank {me}: SIGKILL in the middle of the background write", file=sys.stderr, flush=True
                )
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        FileSystemWriter.write_data = write_data  # type: ignore[method-assign]


class DumpAtTrainEnd(pl.Callback):
    """Write the record when training ends, before the strategy's ``on_train_end`` (which may raise)."""

    def __init__(self, dump) -> None:  # type: ignore[no-untyped-def]
        self.dump = dump

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.dump()


class RecordBatches(pl.Callback):
    """(global_step, epoch, checksum of this rank's batch) for every micro-batch: resume must not replay
    data."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int
    ) -> None:  # type: ignore[no-untyped-def]
        self.seen.append((trainer.global_step, trainer.current_epoch, int(batch.sum())))


class RecordLosses(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.values.append(float(outputs["loss"]))


class RecordStartState(pl.Callback):
    """Full parameters and optimizer state (by parameter name) when training starts, i.e. right after a
    resume."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self.opt_state: dict[str, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.params = {n: full(p) for n, p in pl_module.named_parameters()}
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.opt_state = {names[id(p)]: {k: full(v) for k, v in s.items()}
                          for p, s in trainer.optimizers[0].state.items()}


class StopAt(pl.Callback):
    """Stop after ``step`` optimizer steps while ``max_steps`` (and so the LR schedule) stays the full
    run's."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def dump(trainer: pl.Trainer, model: pl.LightningModule, a: argparse.Namespace, batches: RecordBatches,
         probe: ProbePrecision, losses: RecordLosses, counter: CountCollectives | None,
         start: RecordStartState | None, accumulation: AccumulationProbe | None = None) -> None:
    """Every rank (collectives): gather what the test checks; rank 0 writes ``a.out``."""
    optimizer = trainer.optimizers[0]
    params = {n: full(p) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    opt_state = {names[id(p)]: {k: full(v) for k, v in s.items()} for p, s in optimizer.state.items()}
    record = {
        "params": params, "opt_state": opt_state, "global_step": trainer.global_step,
        "param_bytes": _memory.param_bytes(model), "opt_bytes": _memory.optimizer_state_bytes(optimizer),
        "reduce_calls": counter.reduces if counter else None,
        "gather_calls": counter.gathers if counter else None, "built_on_meta": ProbedLM.built_on_meta,
        "local_is_meta": any(getattr(p, "to_local", lambda p=p: p)().is_meta for p in model.parameters()),
        "batches": batches.seen, "precision_probe": probe.seen, "losses": losses.values,
        "compiled": [getattr(b, "_compiled_call_impl", None) is not None for b in model.model.layers],
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
        "start_params": start.params if start else None,
        "start_opt_state": start.opt_state if start else None,
    }
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered: list[dict | None] = [None] * world
    small = {k: record[k] for k in ("param_bytes", "opt_bytes", "reduce_calls", "gather_calls",
                                    "built_on_meta", "local_is_meta")}
    if accumulation is not None:
        small.update(micro_batches=accumulation.rows, full_grad_bytes=accumulation.full_grad_bytes,
                     fsdp_units=accumulation.fsdp_units)
    if world > 1:
        dist.all_gather_object(gathered, small)
    else:
        gathered = [small]
    if trainer.is_global_zero:
        record["ranks"] = gathered
        torch.save(record, a.out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="fsdp2")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--replicate", type=int, default=0)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--num-train", type=int, default=256)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--meta-init", type=int, default=0)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--eager-build", type=int, default=0)
    p.add_argument("--option", action="append", default=[], help="extra strategy option NAME=PYTHON_LITERAL")
    p.add_argument("--ckpt-dir", default="")
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--resume", default="")
    p.add_argument("--stop-at", type=int, default=0)
    p.add_argument("--crash-on-save", type=int, default=0)
    p.add_argument("--save-last", type=int, default=1)
    p.add_argument("--record-at-train-end", type=int, default=0)
    p.add_argument("--break-write", default="", help="N:fail or N:kill (see BreakWrite)")
    p.add_argument("--record-start", type=int, default=0, help="record the state right after a resume")
    p.add_argument("--probe-accumulation", type=int, default=0, help="AccumulationProbe's rows, every rank")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    pl.seed_everything(1234, verbose=False)
    import ast

    options = {"block_class_names": ["TransformerBlock"], "meta_init": bool(a.meta_init)}
    options.update({k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in a.option)})
    if a.strategy == "fsdp2":
        strategy = fsdp_strategies.FSDP2Strategy(**options)
    elif a.strategy == "hsdp":
        shard = a.devices // a.replicate // options.get("tensor_parallel_degree", 1)
        strategy = fsdp_strategies.HSDPStrategy(replicate_degree=a.replicate, shard_degree=shard, **options)
    else:
        strategy = a.strategy
    batches, probe, losses = RecordBatches(), ProbePrecision(), RecordLosses()
    callbacks: list[pl.Callback] = [batches, probe, losses]
    counter = CountCollectives() if a.strategy in ("fsdp2", "hsdp") else None
    if counter:
        callbacks.append(counter)
    if a.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=a.ckpt_dir, every_n_train_steps=a.ckpt_every, save_top_k=1,
                                         save_last=bool(a.save_last), filename="{step}"))
    if a.stop_at:
        callbacks.append(StopAt(a.stop_at))
    if a.crash_on_save:
        callbacks.append(CrashOnSave(a.crash_on_save))
    if a.break_write:
        nth, mode = a.break_write.split(":")
        callbacks.append(BreakWrite(int(nth), mode))
    accumulation = AccumulationProbe() if a.probe_accumulation else None
    if accumulation:
        callbacks.append(accumulation)
    start = RecordStartState() if a.record_start else None
    if start:
        callbacks.append(start)
    if a.record_at_train_end:  # before the strategy's own on_train_end (e.g. a failing background write)
        callbacks.append(
            DumpAtTrainEnd(lambda: dump(trainer, model, a, batches, probe, losses, counter, start))
        )
    trainer = pl.Trainer(
        accelerator="cpu", devices=a.devices, strategy=strategy, max_steps=a.steps, precision=a.precision,
        accumulate_grad_batches=a.accumulate, gradient_clip_val=a.clip or None, callbacks=callbacks,
        enable_progress_bar=False, logger=False, enable_checkpointing=bool(a.ckpt_dir), limit_val_batches=0,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    model = (EagerLM if a.eager_build else ProbedLM)(**MODEL)
    trainer.fit(model, datamodule=data_module(a.batch, a.num_train), ckpt_path=a.resume or None)
    if not a.record_at_train_end:
        dump(trainer, model, a, batches, probe, losses, counter, start, accumulation)


if __name__ == "__main__":
    main()
