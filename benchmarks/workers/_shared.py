"""What every benchmark worker shares, so the contenders differ only in how they parallelise.

Each worker is started as a real multi-process job (``torchrun``; Lightning detects torchelastic
and uses it). The same command line gives every contender the same model (``examples/llama.py``
at a size given as JSON), the same data (``MarkovDataModule``, one global batch split over the
ranks by a ``DistributedSampler``), the same optimizer (AdamW + the example's warm-up/cosine
schedule) and the same number of steps. Step time is measured inside the worker: the wall time
from one optimizer-step end to the next (data loading, forward, backward, communication,
optimizer step and framework overhead included), after a CUDA synchronize on GPUs. The first
``--warmup`` steps are reported separately and excluded from the samples.

Rank 0 writes one JSON file (``--out``) with every rank's step times, losses and memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "examples", ROOT / "src"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from fsdp_strategies.testing import grad_bytes, optimizer_state_bytes, param_bytes  # noqa: E402
from llama import LlamaLM, MarkovDataModule, MarkovSequences  # noqa: E402


def parse_args(contenders: tuple[str, ...]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contender", required=True, choices=contenders)
    parser.add_argument("--model", required=True, help="LlamaLM keyword arguments as JSON")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first and excluded")
    parser.add_argument("--replicate", type=int, default=1, help="replica groups of a 2-D (HSDP) mesh")
    parser.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--profile", choices=("torch", "python"), default=None,
                        help="profile the measured steps (torch.profiler op table or cProfile); rank 0 "
                             "writes <out>.profile-<kind>.txt. Off in benchmark runs.")
    # variants of a contender (benchmarks/gpu.py); off in the timing suites
    parser.add_argument("--compile-blocks", action="store_true",
                        help="torch.compile each TransformerBlock before "
                             "sharding it (fsdp2/hsdp and the plain FSDP2 loops)")
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile backend for --compile-blocks "
                             "(default: inductor; 'aot_eager' on CPU smoke runs)")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="keep sharded parameters, gradients and "
                             "optimizer state on the CPU (FSDP contenders)")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="accumulate_grad_batches (Lightning contenders); "
                             "--steps / --warmup count micro-batches, "
                             "and the gradient bytes each rank holds after every backward are recorded")
    parser.add_argument("--accumulation", choices=("sharded", "no_sync"), default=None,
                        help="FSDP2Strategy(accumulation=...) of fsdp2 / hsdp (default: the strategy's own)")
    parser.add_argument("--grad-bytes", action="store_true",
                        help="record the gradient bytes each backward leaves (also without --accumulate)")
    parser.add_argument("--mfu", action="store_true",
                        help="add MFUMonitor (Lightning contenders) and "
                             "record its MFU/HFU/TFLOPS of the measured steps")
    args = parser.parse_args()
    args.model = json.loads(args.model)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.global_batch % world:
        parser.error(f"--global-batch={args.global_batch} must divide by the world size {world}")
    if world % args.replicate:
        parser.error(f"--replicate={args.replicate} must divide the world size {world}")
    args.world_size = world
    args.batch_per_rank = args.global_batch // world
    args.total_steps = args.steps + args.warmup
    return args


def datamodule(args: argparse.Namespace) -> MarkovDataModule:
    """Enough sequences for every step of every rank, identical on every rank (seeded)."""
    vocab = int(args.model.get("vocab_size", 128))
    return MarkovDataModule(
        vocab_size=vocab, seq_len=args.seq_len, num_train=args.global_batch * (args.total_steps + 1),
        num_val=args.global_batch, batch_size=args.batch_per_rank, seed=args.seed,
    )


def train_dataset(args: argparse.Namespace) -> MarkovSequences:
    dm = datamodule(args)
    dm.setup("fit")
    return MarkovSequences(dm.train_data)


def lightning_module_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_seq_len": args.seq_len, "warmup_steps": max(1, args.total_steps // 4), **args.model}


def schedule(args: argparse.Namespace, warmup_steps: int, min_lr_ratio: float = 0.1):  # type: ignore[no-untyped-def]
    """The example's warm-up + cosine factor, for the plain loops (LlamaLM.configure_optimizers's twin)."""
    total = args.total_steps
    warmup = min(warmup_steps, total)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def adamw(model: torch.nn.Module, hp: dict[str, Any]) -> torch.optim.Optimizer:
    """Same parameter groups and settings as ``LlamaLM.configure_optimizers``."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp.get("weight_decay", 0.1)},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=hp.get("lr", 3e-3), betas=(0.9, 0.95), foreach=True,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Per-step wall times: step i = end of step i - end of step i-1 (step 0 from the first batch)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.last: float | None = None
        self.times: list[float] = []
        self.losses: list[float] = []

    def start(self) -> None:
        sync(self.device)
        self.last = time.perf_counter()

    def stop(self, loss: torch.Tensor | float) -> None:
        sync(self.device)
        now = time.perf_counter()
        assert self.last is not None, "StepClock.start() was not called"
        self.times.append(now - self.last)
        self.last = now
        self.losses.append(float(loss))


class StepProfiler:
    """Optional profile of the measured steps, to find where the time goes when a target is missed."""

    def __init__(self, kind: str | None, out: Path) -> None:
        self.kind, self.out, self._prof = kind, out, None

    def start(self) -> None:
        if self.kind == "torch":
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            )
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        elif self.kind == "python":
            import cProfile

            self._prof = cProfile.Profile()
            self._prof.enable()

    def stop(self) -> None:
        if self._prof is None:
            return
        path = self.out.with_name(f"{self.out.stem}.profile-{self.kind}.txt")
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.kind == "torch":
            self._prof.__exit__(None, None, None)
            if rank == 0:
                table = self._prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
                path.write_text(table)
        else:
            import io
            import pstats

            self._prof.disable()
            if rank == 0:
                buf = io.StringIO()
                pstats.Stats(self._prof, stream=buf).sort_stats("cumulative").print_stats(45)
                path.write_text(buf.getvalue())
        self._prof = None


def memory_snapshot(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> dict[str, Any]:
    """Bytes this rank holds (local shards only), measured with ``fsdp_strategies.testing``."""
    snap: dict[str, Any] = {
        "param_bytes": param_bytes(module),
        "grad_bytes": grad_bytes(module),
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "peak_cuda_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
    }
    snap["total_bytes"] = snap["param_bytes"] + snap["grad_bytes"] + snap["optimizer_state_bytes"]
    return snap


def finish(
    args: argparse.Namespace, clock: StepClock, memory: dict[str, Any], extra: dict[str, Any] | None = None
) -> None:
    """Gather every rank's record; rank 0 writes the worker's JSON result."""
    record = {"rank": dist.get_rank() if dist.is_initialized() else 0, "times_s": clock.times,
              "losses": clock.losses, "memory": memory}
    if dist.is_initialized() and dist.get_world_size() > 1:
        records: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(records, record)
    else:
        records = [record]
    if record["rank"] != 0:
        return
    records.sort(key=lambda r: r["rank"])
    n = min(len(r["times_s"]) for r in records)
    # a step ends when the slowest rank does
    per_step = [max(r["times_s"][i] for r in records) for i in range(n)]
    result = {
        "contender": args.contender,
        "world_size": args.world_size,
        "replicate": args.replicate,
        "global_batch": args.global_batch,
        "batch_per_rank": args.batch_per_rank,
        "seq_len": args.seq_len,
        "precision": args.precision,
        "model": args.model,
        "params": count_params(args),
        "warmup_times_s": per_step[: args.warmup],
        "step_times_s": per_step[args.warmup :],
        "per_rank": records,
        "loss_first": records[0]["losses"][0] if records[0]["losses"] else None,
        "loss_last": records[0]["losses"][-1] if records[0]["losses"] else None,
        "variant": {"compile_blocks": args.compile_blocks, "compile_backend": args.compile_backend,
                    "cpu_offload": args.cpu_offload},
        **(extra or {}),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args.out)


def local_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def count_params(args: argparse.Namespace) -> int:
    """Parameters of the unsharded model, counted on the meta device (no memory, any wrapper)."""
    lm = LlamaLM(**lightning_module_kwargs(args))
    with torch.device("meta"):
        lm.configure_model()
    return sum(p.numel() for p in lm.parameters())


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """Dense peak FLOP/s of this device for the run's compute dtype, and where it came from.

    The same sources as ``MFUMonitor``: ``FSDP_STRATEGIES_PEAK_FLOPS``, else the table of
    ``fsdp_strategies.flops.peaks`` by device name; CPUs have no entry (``None``).
    """
    from fsdp_strategies.flops.peaks import PEAK_FLOPS_ENV, lookup_peak_flops, peak_flops_from_env

    env = peak_flops_from_env()
    if env is not None:
        return env, f"{PEAK_FLOPS_ENV}={env:g}"
    if device.type != "cuda":
        return None, f"no table entry for {device.type} devices"
    name = torch.cuda.get_device_name(device)
    dtype = "bf16" if precision.startswith("bf16") else "fp32"
    value = lookup_peak_flops(name, dtype)
    return value, f"fsdp_strategies.flops.peaks table, {name!r}, {dtype}"
