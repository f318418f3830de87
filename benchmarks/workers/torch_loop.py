"""Plain torch training loops (no Lightning) -- the baselines the strategies are measured against.

Contenders:
  torch_ddp    ``DistributedDataParallel`` with its defaults.
  torch_fsdp2  ``fully_shard`` per ``TransformerBlock`` then the root, on a 1-D mesh of all ranks.
  torch_hsdp   the same on a 2-D ``("replicate", "shard")`` mesh (``--replicate`` groups).

The model is the example's ``Llama`` (built by ``LlamaLM.configure_model``, used as a plain
``nn.Module``); FSDP2 models are built on the meta device and materialised per shard, as a
hand-written large-model loop would. ``--compile-blocks`` compiles each block before sharding it
(the strategy's order: both call ``fsdp_strategies.parallel.parallelize``), ``--cpu-offload`` passes
``CPUOffloadPolicy`` to ``fully_shard`` (FSDP2 loops). Launch with torchrun, e.g.::

    torchrun --nproc_per_node 2 benchmarks/workers/torch_loop.py --contender torch_fsdp2 \\
        --model '{"dim": 128, "n_layers": 2, "n_heads": 4}' --seq-len 64 --global-batch 16 \\
        --steps 8 --out /tmp/r.json
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _shared

from llama import LlamaLM, TransformerBlock

CONTENDERS = ("torch_ddp", "torch_fsdp2", "torch_hsdp")


def build_model(args, device: torch.device, on_meta: bool) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    lm = LlamaLM(**_shared.lightning_module_kwargs(args))
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        lm.configure_model()  # builds lm.model (Llama) and, off meta, the example's init
    model = lm.model
    assert model is not None
    return model if on_meta else model.to(device)


def shard(model: torch.nn.Module, mesh, mp_policy, offload: bool = False,  # type: ignore[no-untyped-def]
          compile_blocks: bool = False, compile_backend: str | None = None) -> None:
    """The package's transform order without Lightning: (``torch.compile`` each block ->) ``fully_shard`` per
    block, then the root (:func:`fsdp_strategies.parallel.parallelize`, the function the strategies call)."""
    from fsdp_strategies.parallel import parallelize

    parallelize(model, mesh, block_class_names=[TransformerBlock.__name__], compile_blocks=compile_blocks,
                compile_options={"backend": compile_backend} if compile_backend else None,
                mp_policy=mp_policy, cpu_offload=offload)


def materialise(model: torch.nn.Module, device: torch.device) -> None:
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()


def main() -> None:
    args = _shared.parse_args(CONTENDERS)
    device = _shared.local_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    bf16 = args.precision == "bf16-mixed"
    if args.mfu:
        raise SystemExit("--mfu: MFUMonitor is a Lightning callback; the plain loops report step times only.")
    if (args.compile_blocks or args.cpu_offload) and args.contender == "torch_ddp":
        raise SystemExit(
            "--compile-blocks / --cpu-offload: not available for torch_ddp. Fix: use them with the "
            "FSDP2 loops (torch_fsdp2, torch_hsdp)."
        )

    if args.contender == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel

        model: torch.nn.Module = build_model(args, device, on_meta=False)
        raw = model
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if args.contender == "torch_fsdp2":
            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
        else:
            mesh = init_device_mesh(device.type, (args.replicate, world // args.replicate),
                                    mesh_dim_names=("replicate", "shard"))
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy()
        )
        model = build_model(args, device, on_meta=True)
        shard(model, mesh, mp, offload=args.cpu_offload, compile_blocks=args.compile_blocks,
              compile_backend=args.compile_backend)
        from fsdp_strategies.parallel import buffers_to, parameter_device

        # CPUOffloadPolicy: parameters on the CPU
        materialise(model, parameter_device(device, args.cpu_offload))
        if args.cpu_offload:
            buffers_to(model, device)
        raw = model
    # the DDP loop autocasts for bf16-mixed; FSDP2 casts through its MixedPrecisionPolicy instead
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if bf16 and args.contender == "torch_ddp"
                else contextlib.nullcontext())

    hp = _shared.lightning_module_kwargs(args)
    optimizer = _shared.adamw(raw, hp)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _shared.schedule(args, hp["warmup_steps"]))
    dataset = _shared.train_dataset(args)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_per_rank, sampler=sampler, drop_last=True)

    model.train()
    clock = _shared.StepClock(device)
    profiler = _shared.StepProfiler(args.profile, args.out)
    step = 0
    batches = iter(loader)
    while step < args.total_steps:
        batch = next(batches).to(device, non_blocking=True)
        if step == 0:
            clock.start()
        if step == args.warmup:
            profiler.start()
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        scheduler.step()
        clock.stop(loss.detach())
        step += 1
    profiler.stop()
    memory = _shared.memory_snapshot(raw, optimizer, device)
    peak, peak_source = _shared.peak_flops(device, args.precision)
    _shared.finish(args, clock, memory, {"backend": backend, "device_type": device.type, "peak_flops": peak,
                                         "peak_flops_source": peak_source})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
