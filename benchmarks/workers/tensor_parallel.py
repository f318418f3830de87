"""Tensor-parallel contenders (2 tensor-parallel ranks x world/2 data-parallel ranks) on the example model.

Contenders:
  fsdp2_tp2         ``FSDP2Strategy(tensor_parallel_degree=2, tp_plan=<the example's plan>)``: the plan of
                    ``configs/fsdp2_tp.yaml``, read from that file, applied by the strategy
  lightning_mp_tp2  Lightning's ``ModelParallelStrategy(data_parallel_size=world/2, tensor_parallel_size=2)``
                    with the same plan written by hand in ``configure_model``
                    (:class:`HandTensorParallelLlamaLM`: ``parallelize_module`` on
                    ``device_mesh["tensor_parallel"]``, then ``fully_shard`` per block and the root on
                    ``device_mesh["data_parallel"]``, as Lightning's docs show)
  torch_tp2         a plain torch loop doing the same on an ``init_device_mesh`` (meta-device model,
                    materialised after sharding)

Everything else is shared with the other workers (``_shared``): the model (``LlamaLM`` at a size given as
JSON), the data, AdamW with the example's schedule, the step clock and the memory snapshot. The global batch
is the same as the other suites' (``--global-batch``): it is split over the *data-parallel* ranks, so each
rank of a tensor-parallel pair reads the same ``global_batch / (world / 2)`` sequences. No gradient clipping
(Lightning's ``ModelParallelStrategy`` cannot clip gradients that live on two meshes). Launch with torchrun::

    torchrun --nproc_per_node 4 benchmarks/workers/tensor_parallel.py --contender fsdp2_tp2 \\
        --model '{"vocab_size": 128, "dim": 256, "n_layers": 4, "n_heads": 8}' --seq-len 64 \\
        --global-batch 16 --steps 8 --out /tmp/r.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _shared
from lightning_fit import StepTimer
from torch_loop import build_model, materialise

from llama import LlamaLM, TransformerBlock

CONTENDERS = ("fsdp2_tp2", "lightning_mp_tp2", "torch_tp2")
TP = 2
CONFIG = _shared.ROOT / "configs" / "fsdp2_tp.yaml"


def yaml_plan() -> dict[str, str]:
    """The example's plan as ``configs/fsdp2_tp.yaml`` gives it to ``FSDP2Strategy(tp_plan=...)``."""
    config = yaml.safe_load(CONFIG.read_text())
    return dict(config["trainer"]["strategy"]["init_args"]["tp_plan"])


def hand_plan() -> dict[str, Any]:
    """The same plan as a user of ``parallelize_module`` writes it (keys relative to the ``Llama`` module)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {"embed": RowwiseParallel(input_layouts=Replicate()),
                            "head": ColwiseParallel(output_layouts=Replicate())}
    for proj in ("attention.wq", "attention.wk", "attention.wv", "mlp.w1", "mlp.w3"):
        plan[f"layers.*.{proj}"] = ColwiseParallel()
    for proj in ("attention.wo", "mlp.w2"):
        plan[f"layers.*.{proj}"] = RowwiseParallel()
    return plan


def check_same_plan() -> None:
    """The hand-written plan names the modules the YAML plan names (the YAML's are LightningModule paths)."""
    ours = {k.removeprefix("model."): v for k, v in yaml_plan().items()}
    hand = hand_plan()
    if set(ours) != set(hand):
        raise SystemExit(f"the hand-written plan {sorted(hand)} and {CONFIG.name}'s {sorted(ours)} differ")


class HandTensorParallelLlamaLM(LlamaLM):
    """What a user of Lightning's ``ModelParallelStrategy`` writes: the TP plan by hand, then
    ``fully_shard``."""

    @override
    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        if isinstance(self.model, FSDPModule):
            return
        super().configure_model()
        assert self.model is not None
        parallelize_module(self.model, self.device_mesh["tensor_parallel"], hand_plan())
        dp = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=dp)
        fully_shard(self.model, mesh=dp)


def fit(args: Any) -> None:
    import fsdp_strategies

    if args.contender == "fsdp2_tp2":
        strategy: Any = fsdp_strategies.FSDP2Strategy(block_class_names=[TransformerBlock.__name__],
                                                      tensor_parallel_degree=TP, tp_plan=yaml_plan())
        module: LlamaLM = LlamaLM(**_shared.lightning_module_kwargs(args))
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.world_size // TP, tensor_parallel_size=TP)
        module = HandTensorParallelLlamaLM(**_shared.lightning_module_kwargs(args))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
    trainer = pl.Trainer(
        accelerator="auto", devices=local, num_nodes=args.world_size // local, strategy=strategy,
        precision=args.precision, max_steps=args.total_steps, limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[StepTimer(args)],
    )
    trainer.fit(module, datamodule=_shared.datamodule(args))


def torch_loop(args: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    device = _shared.local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(args.seed)
    mesh = init_device_mesh(
        device.type, (args.world_size // TP, TP), mesh_dim_names=("data_parallel", "tensor_parallel")
    )
    dp = mesh["data_parallel"]
    bf16 = args.precision == "bf16-mixed"
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    model = build_model(args, device, on_meta=True)
    parallelize_module(model, mesh["tensor_parallel"], hand_plan())
    for block in model.layers:
        fully_shard(block, mesh=dp, mp_policy=mp)
    fully_shard(model, mesh=dp, mp_policy=mp)
    materialise(model, device)

    hp = _shared.lightning_module_kwargs(args)
    optimizer = _shared.adamw(model, hp)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _shared.schedule(args, hp["warmup_steps"]))
    dataset = _shared.train_dataset(args)
    sampler = DistributedSampler(dataset, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_per_rank, sampler=sampler, drop_last=True)
    model.train()
    clock = _shared.StepClock(device)
    batches = iter(loader)
    for step in range(args.total_steps):
        batch = next(batches).to(device, non_blocking=True)
        if step == 0:
            clock.start()
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        scheduler.step()
        clock.stop(loss.detach())
    memory = _shared.memory_snapshot(model, optimizer, device)
    _shared.finish(args, clock, memory,
                   {"tensor_parallel_degree": TP, "data_parallel_size": args.world_size // TP,
                                         "device_type": device.type})
    dist.destroy_process_group()


def main() -> None:
    args = _shared.parse_args(CONTENDERS)
    if args.world_size % TP or args.global_batch % (args.world_size // TP):
        raise SystemExit(
            f"--nproc_per_node {args.world_size}: needs a multiple of {TP} ranks whose data-parallel "
            f"count ({args.world_size // TP}) divides --global-batch={args.global_batch}"
        )
    check_same_plan()
    args.batch_per_rank = args.global_batch // (args.world_size // TP)  # per data-parallel rank
    pl.seed_everything(args.seed, verbose=False)
    if args.contender == "torch_tp2":
        torch_loop(args)
        return
    fit(args)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
