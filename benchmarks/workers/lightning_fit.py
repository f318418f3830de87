"""Lightning ``Trainer.fit`` contenders: this package's strategies and Lightning's built-in ones.

Contenders:
  fsdp2                     ``fsdp_strategies.FSDP2Strategy`` (blocks = ``TransformerBlock``)
  hsdp                      ``fsdp_strategies.HSDPStrategy`` (``--replicate`` x world/replicate)
  ddp_hooks                 this package's DDP strategy (registry name ``ddp_hooks``), default hook
  lightning_ddp             Lightning's ``DDPStrategy`` (``strategy="ddp"``)
  lightning_fsdp            Lightning's ``FSDPStrategy`` (FSDP1), auto-wrapping each ``TransformerBlock``
  lightning_model_parallel  Lightning's ``ModelParallelStrategy`` with ``fully_shard`` written by hand
                            in ``configure_model`` (:class:`HandShardedLlamaLM` below)

The LightningModule is the unmodified example ``LlamaLM`` (except for the hand-sharded
subclass that ``ModelParallelStrategy`` requires). Launch with torchrun (see ``torch_loop.py``).

Variants (``benchmarks/gpu.py``): ``--compile-blocks`` / ``--cpu-offload`` set the strategy's own
options (fsdp2, hsdp; offload also for lightning_fsdp); ``--mfu`` adds ``MFUMonitor`` after the
step timer and records what it logged for the measured steps. ``--accumulation sharded|no_sync`` sets
fsdp2's / hsdp's ``accumulation`` (``benchmarks/suites/accumulation.py``); with ``--accumulate K`` (or
``--grad-bytes``) every backward's gradient bytes are recorded: the local ``.grad`` tensors, and for the
FSDP2 contenders FSDP2's own state (``fsdp_strategies.testing.fsdp_gradient_bytes``: under ``no_sync`` the
unsharded gradients are kept outside ``.grad``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _shared

from llama import LlamaLM, TransformerBlock

#: the contenders whose model FSDP2 shards (``fully_shard``): their gradients are read from FSDP2's state too
FSDP2_CONTENDERS = ("fsdp2", "fsdp2_no_autocast", "fsdp2_hang_watchdog", "hsdp", "lightning_model_parallel")
CONTENDERS = ("fsdp2", "fsdp2_no_autocast", "fsdp2_hang_watchdog", "hsdp", "ddp_hooks", "lightning_ddp",
              "lightning_fsdp", "lightning_model_parallel")


class HandShardedLlamaLM(LlamaLM):
    """What a user of Lightning's ``ModelParallelStrategy`` writes: ``fully_shard`` per block, then the
    model."""

    @override
    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule):
            return
        super().configure_model()
        assert self.model is not None
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class StepTimer(Callback):
    """Times every optimizer step from Lightning's hooks and writes the worker's result at the end."""

    def __init__(self, args: Any, mfu: Any = None) -> None:
        self.args = args
        self.mfu = mfu  # an MFUMonitor placed after this callback (--mfu), read at the end
        self.clock: _shared.StepClock | None = None
        self.profiler = _shared.StepProfiler(args.profile, args.out)
        # --accumulate > 1: after every backward, the bytes of this rank's local ``.grad`` tensors (FSDP2
        # without gradient sync keeps unsharded gradients outside ``.grad``: the device's allocated bytes show
        # those)
        self.grad_bytes_held: list[int] = []
        self.allocated_after_backward: list[int] = []
        self.fsdp_grad_bytes: list[dict[str, int]] = []  # FSDP2's own state after every backward, by kind

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.args.accumulate > 1 or self.args.grad_bytes:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            self.grad_bytes_held.append(sum(g.numel() * g.element_size() for g in local))
            if pl_module.device.type == "cuda":
                self.allocated_after_backward.append(torch.cuda.memory_allocated(pl_module.device))
            if self.args.contender in FSDP2_CONTENDERS:
                from fsdp_strategies.testing import fsdp_gradient_bytes

                self.fsdp_grad_bytes.append(fsdp_gradient_bytes(pl_module))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.clock is None:
            self.clock = _shared.StepClock(pl_module.device)
            self.clock.start()
        if batch_idx == self.args.warmup:
            self.profiler.start()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self.clock is not None
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.clock.stop(loss.detach())

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.clock is not None
        self.profiler.stop()
        memory = _shared.memory_snapshot(pl_module, trainer.optimizers[0], pl_module.device)
        strategy = trainer.strategy
        peak, peak_source = _shared.peak_flops(pl_module.device, self.args.precision)
        _shared.finish(self.args, self.clock, memory, {
            "strategy_class": f"{type(strategy).__module__}.{type(strategy).__qualname__}",
            "precision_plugin": type(trainer.precision_plugin).__name__,
            "device_type": pl_module.device.type,
            "peak_flops": peak,
            "peak_flops_source": peak_source,
            "mfu_monitor": self._mfu_record(trainer),
            "accumulate_grad_batches": self.args.accumulate,
            "grad_bytes_held_after_backward": self.grad_bytes_held or None,
            "cuda_allocated_after_backward": self.allocated_after_backward or None,
            "fsdp_grad_bytes_after_backward": self.fsdp_grad_bytes or None,
            "accumulation": self.args.accumulation,
            "extras": self._extras(trainer),
        })

    def _extras(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Contender-specific figures of rank 0 (``fsdp2_hang_watchdog``: its watchdog thread's CPU time)."""
        from fsdp_strategies.callbacks import HangWatchdog

        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, HangWatchdog):
                wall = time.monotonic() - self.fit_started
                return {"hang_watchdog": {"thread_cpu_s": cb.thread_cpu_s, "polls": cb.polls,
                                          "poll_s": cb.poll_s, "fit_wall_s": wall}}
        return {}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit_started = time.monotonic()

    def _mfu_record(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """What MFUMonitor logged for the measured steps (its window = the measured steps)."""
        if self.mfu is None:
            return None
        prefix = f"{self.mfu.prefix}_cum"
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix + "/")}
        flops = self.mfu.flops
        return {
            "mfu": metrics.get(f"{prefix}/mfu/median"), "hfu": metrics.get(f"{prefix}/hfu/median"),
            "tflops_per_device": metrics.get(f"{prefix}/tflops_per_device/median"),
            "tokens_per_sec_per_device": metrics.get(f"{prefix}/tokens_per_sec_per_device/median"),
            "peak_flops": self.mfu.peak, "flop_source": self.mfu.source,
            "model_flops_per_batch": flops.model if flops else None,
            "hardware_flops_per_batch": flops.hardware if flops else None,
            "metrics": metrics,
        }


def make_strategy(args: Any) -> Any:
    import fsdp_strategies

    blocks = ["TransformerBlock"]
    variant = {"cpu_offload": args.cpu_offload, "compile_blocks": args.compile_blocks,
               "compile_options": {"backend": args.compile_backend} if args.compile_backend else None}
    supported = {"fsdp2", "hsdp"} | ({"lightning_fsdp"} if not args.compile_blocks else set())
    if (args.cpu_offload or args.compile_blocks) and args.contender not in supported:
        raise SystemExit(f"--cpu-offload / --compile-blocks: not available for contender {args.contender!r}. "
                         f"Fix: use them with {sorted(supported)}.")
    if args.accumulation is not None:
        if args.contender not in ("fsdp2", "hsdp"):
            raise SystemExit(f"--accumulation: an option of fsdp2 / hsdp, not of {args.contender!r}.")
        variant["accumulation"] = args.accumulation
    if args.contender in ("fsdp2", "fsdp2_hang_watchdog"):
        return fsdp_strategies.FSDP2Strategy(block_class_names=blocks, **variant)
    if args.contender == "fsdp2_no_autocast":
        return fsdp_strategies.FSDP2Strategy(block_class_names=blocks, autocast=False, **variant)
    if args.contender == "hsdp":
        return fsdp_strategies.HSDPStrategy(replicate_degree=args.replicate,
                                            shard_degree=args.world_size // args.replicate,
                                            block_class_names=blocks, **variant)
    if args.contender == "ddp_hooks":
        from lightning.pytorch.strategies import StrategyRegistry

        if "ddp_hooks" not in StrategyRegistry:
            raise SystemExit(
                "strategy 'ddp_hooks' is not registered by fsdp_strategies (not implemented yet)"
            )
        return "ddp_hooks"
    if args.contender == "lightning_ddp":
        return "ddp"
    if args.contender == "lightning_fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(auto_wrap_policy={TransformerBlock}, sharding_strategy="FULL_SHARD",
                            cpu_offload=args.cpu_offload)
    if args.contender == "lightning_model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=args.world_size, tensor_parallel_size=1)
    raise ValueError(args.contender)


def main() -> None:
    args = _shared.parse_args(CONTENDERS)
    pl.seed_everything(args.seed, verbose=False)
    module_cls = HandShardedLlamaLM if args.contender == "lightning_model_parallel" else LlamaLM
    model = module_cls(**_shared.lightning_module_kwargs(args))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
    callbacks: list[Callback] = []
    monitor = None
    if args.mfu:  # after the timer: its end-of-window gather is not part of a timed step
        from fsdp_strategies.callbacks import MFUMonitor

        skip = max(1, args.warmup)  # MFUMonitor's first step counts FLOPs, so at least one is excluded
        monitor = MFUMonitor(window=max(1, args.total_steps - skip), warmup_steps=skip,
                             tokens_per_sample=args.seq_len, prog_bar=False)
    callbacks.append(StepTimer(args, monitor))
    if args.contender == "fsdp2_hang_watchdog":  # polling every second: 10x the store traffic of the default
        from fsdp_strategies.callbacks import HangWatchdog

        callbacks.insert(0, HangWatchdog(timeout_s=300, poll_s=1.0))
    if monitor is not None:
        callbacks.append(monitor)
    trainer = pl.Trainer(
        accelerator="auto", devices=local, num_nodes=args.world_size // local, strategy=make_strategy(args),
        precision=args.precision, max_steps=-(-args.total_steps // args.accumulate),
        accumulate_grad_batches=args.accumulate, limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=_shared.datamodule(args))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
