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
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _shared

from llama import LlamaLM, TransformerBlock

CONTENDERS = ("fsdp2", "hsdp", "ddp_hooks", "lightning_ddp", "lightning_fsdp", "lightning_model_parallel")


class HandShardedLlamaLM(LlamaLM):
    """What a user of Lightning's ``ModelParallelStrategy`` writes: ``fully_shard`` per block, then the model."""

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

    def __init__(self, args: Any) -> None:
        self.args = args
        self.clock: _shared.StepClock | None = None
        self.profiler = _shared.StepProfiler(args.profile, args.out)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
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
        _shared.finish(self.args, self.clock, memory, {
            "strategy_class": f"{type(strategy).__module__}.{type(strategy).__qualname__}",
            "precision_plugin": type(trainer.precision_plugin).__name__,
            "device_type": pl_module.device.type,
        })


def make_strategy(args: Any) -> Any:
    import fsdp_strategies

    blocks = ["TransformerBlock"]
    if args.contender == "fsdp2":
        return fsdp_strategies.FSDP2Strategy(block_class_names=blocks)
    if args.contender == "fsdp2_no_autocast":
        return fsdp_strategies.FSDP2Strategy(block_class_names=blocks, autocast=False)
    if args.contender == "hsdp":
        return fsdp_strategies.HSDPStrategy(replicate_degree=args.replicate,
                                            shard_degree=args.world_size // args.replicate, block_class_names=blocks)
    if args.contender == "ddp_hooks":
        from lightning.pytorch.strategies import StrategyRegistry

        if "ddp_hooks" not in StrategyRegistry:
            raise SystemExit("strategy 'ddp_hooks' is not registered by fsdp_strategies (not implemented yet)")
        return "ddp_hooks"
    if args.contender == "lightning_ddp":
        return "ddp"
    if args.contender == "lightning_fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(auto_wrap_policy={TransformerBlock}, sharding_strategy="FULL_SHARD")
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
    trainer = pl.Trainer(
        accelerator="auto", devices=local, num_nodes=args.world_size // local, strategy=make_strategy(args),
        precision=args.precision, max_steps=args.total_steps, limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[StepTimer(args)],
    )
    trainer.fit(model, datamodule=_shared.datamodule(args))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
