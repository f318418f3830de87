"""Achieved TFLOPS, MFU, HFU, tokens/s and samples/s per device, with min/median/max over ranks.

Definitions used here (the PaLM paper's): *model FLOPs* are the matmul/attention FLOPs the
model needs for one forward and backward pass; *hardware FLOPs* are what the device actually
executes, i.e. model FLOPs plus recomputation (activation checkpointing, and the attention
scores that fused/flash attention kernels recompute in backward). MFU = model FLOP/s / peak,
HFU = hardware FLOP/s / peak, per device.

FLOPs per batch come from one of (the log says which):

* ``count`` (default, no user code): ``torch.utils.flop_counter.FlopCounterMode`` around the
  first training batch's forward + backward on the real data, on every rank. Recomputation by
  :class:`~fsdp_strategies.callbacks.ActivationCheckpointing` is booked as hardware-only FLOPs.
  SDPA kernels without a formula in PyTorch (the CPU flash kernel) get one registered here.
  Kernels hidden from the dispatcher (``torch.compile``'d regions, custom CUDA ops) are not seen:
  use ``flops_per_batch`` or ``analytic`` there.
* ``analytic``: ``6 * N * tokens + 12 * L * H * S * tokens`` (N = non-embedding parameters,
  L = blocks, H = attention width, S = sequence length), the usual transformer estimate.
* ``flops_per_batch``: an int, or a callable ``f(batch) -> int`` given by import path in YAML.

Under tensor parallelism (a ``tensor_parallel`` mesh dim) the ranks of a TP group read one batch and
each does its share of the work: ``count`` counts the ops on this device's shards (a planned Linear
on TP 2 costs half per rank), ``analytic`` divides by the TP degree, and the batch's samples and
tokens are credited 1/TP to each device, so per-device rates and MFU mean what they mean without TP
(the sums over ranks are the global rates). ``flops_per_batch`` is taken as given (per device).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from fsdp_strategies import _torch_seam
from fsdp_strategies._options import OptionError, check_choice, check_int, check_number
from fsdp_strategies.flops.counter import StepFlopCounter, StepFlops, analytic_transformer_flops
from fsdp_strategies.flops.peaks import PeakDType, lookup_peak_flops, peak_flops_from_env
from fsdp_strategies.parallel.blocks import find_transformer_blocks

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MFUMonitor"]

FlopsSource = Literal["count", "analytic"]
_STATS = ("min", "median", "max")
_RATES = ("tflops_per_device", "mfu", "hfu", "tokens_per_sec_per_device", "samples_per_sec_per_device")


@dataclass
class _Window:
    steps: int = 0
    batches: int = 0
    samples: float = 0
    tokens: float = 0
    model_flops: float = 0.0
    hardware_flops: float = 0.0
    start: float = 0.0
    paused: float = 0.0

    def add(self, samples: float, tokens: float, flops: StepFlops, scale: float) -> None:
        self.batches += 1
        self.samples += samples
        self.tokens += tokens
        self.model_flops += flops.model * scale
        self.hardware_flops += flops.hardware * scale

    def rates(self, now: float, peak: float | None) -> list[float]:
        elapsed = max(now - self.start - self.paused, 1e-12)
        nan = float("nan")
        return [
            self.model_flops / elapsed / 1e12,
            self.model_flops / elapsed / peak if peak else nan,
            self.hardware_flops / elapsed / peak if peak else nan,
            self.tokens / elapsed,
            self.samples / elapsed,
        ]


def _tensor_parallel_degree(trainer: pl.Trainer) -> int:
    """Ranks that split each layer (a ``tensor_parallel`` mesh dim: this package's strategies, Lightning's
    ``ModelParallelStrategy``); 1 without one."""
    mesh = getattr(trainer.strategy, "device_mesh", None)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return int(mesh["tensor_parallel"].size()) if mesh is not None and "tensor_parallel" in names else 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        try:
            torch.accelerator.synchronize(device)
        except (RuntimeError, ValueError):
            pass


class MFUMonitor(Callback):
    """Log achieved TFLOPS, MFU, HFU, tokens/s and samples/s per device, min/median/max over ranks.

    Logged through ``LightningModule.log`` (so every logger and ``trainer.callback_metrics`` see
    them) every ``window`` optimizer steps, as ``{prefix}/<metric>/<stat>`` for the last window and
    ``{prefix}_cum/<metric>/<stat>`` since the end of warm-up; ``{prefix}/tokens_per_sec`` and
    ``{prefix}/samples_per_sec`` are the sums over ranks. Rates are per device and each rank's own,
    all-gathered (not rank 0 times the world size). Validation time and the first
    ``warmup_steps`` optimizer steps (compilation, allocator warm-up, FLOP counting) are excluded.

    Gradient accumulation (``accumulate_grad_batches=K``): a *batch* is one micro-batch and a *step* one
    optimizer step, i.e. all K micro-batches. Per micro-batch: the counted FLOPs (``flops``,
    ``flops_per_batch``: one micro-batch's forward + backward), and the samples and tokens each
    micro-batch adds. Per optimizer step: ``window`` and ``warmup_steps`` (windows end only after an
    optimizer step, so their time covers whole steps) and ``{prefix}/model_flops_per_step``,
    ``hardware_flops_per_step`` and ``batches_per_step`` (K x one micro-batch's). The rates (TFLOPS,
    MFU, HFU, tokens/s, samples/s) are every micro-batch's work over the window's wall time: with the same
    micro-batch size and the same time per micro-batch they are the same for every K, not K x or 1/K x.

    Args:
        window: optimizer steps per logged window.
        warmup_steps: optimizer steps excluded at the start (>= 1: the first one counts FLOPs).
        flops_per_batch: FLOPs of one batch's forward + backward on one device (int), or a callable
            ``f(batch) -> int``; skips counting. Used for MFU and HFU alike.
        flops_source: ``count`` (FlopCounterMode on the first batch) or ``analytic``.
        causal_discount: count half the attention FLOPs of causal SDPA calls / of the analytic term.
        peak_flops: dense peak FLOP/s of one device; default: ``FSDP_STRATEGIES_PEAK_FLOPS`` or the
            table in :mod:`fsdp_strategies.flops.peaks`. Needed on CPUs; without it MFU/HFU are not logged.
        peak_dtype: column of the peak table (bf16/fp16/tf32/fp8/fp32); default from the Trainer's precision.
        tokens_per_sample: tokens one sample contributes; default: the size of the first integer tensor
            of the batch divided by the batch size (token ids).
        seq_len: for ``analytic``: sequence length (default ``tokens_per_sample``).
        hidden_size: for ``analytic``: attention width (default: the largest ``nn.Embedding``'s dimension).
        block_class_names: for ``analytic``: block classes to count layers (default: heuristic).
        prog_bar: show window TFLOPS and MFU (medians) in the progress bar.
        prefix: metric name prefix.
    """

    def __init__(
        self,
        window: int = 10,
        warmup_steps: int = 2,
        flops_per_batch: int | Callable[[Any], int] | None = None,
        flops_source: FlopsSource = "count",
        causal_discount: bool = False,
        peak_flops: float | None = None,
        peak_dtype: PeakDType | None = None,
        tokens_per_sample: int | None = None,
        seq_len: int | None = None,
        hidden_size: int | None = None,
        block_class_names: list[str] | None = None,
        prog_bar: bool = True,
        prefix: str = "perf",
    ) -> None:
        super().__init__()
        for name, value in (("window", window), ("warmup_steps", warmup_steps)):
            check_int(name, value, 1)
        for name, value in (
            ("tokens_per_sample", tokens_per_sample),
            ("seq_len", seq_len),
            ("hidden_size", hidden_size),
        ):
            check_int(name, value, 1, optional=True, fix="a positive integer, or leave it unset.")
        check_choice("flops_source", flops_source, FlopsSource)
        if not callable(flops_per_batch):
            check_int("flops_per_batch", flops_per_batch, 1, optional=True, fix="a positive int, a callable "
                      "f(batch) -> int, or unset to count FLOPs automatically.")
        check_number(
            "peak_flops", peak_flops, optional=True, fix="the dense peak FLOP/s of one device, e.g. 989e12."
        )
        check_choice("peak_dtype", peak_dtype, PeakDType, optional=True)
        peak_flops_from_env()  # a bad environment value fails now, not mid-run
        self.window = window
        self.warmup_steps = warmup_steps
        self.flops_per_batch = flops_per_batch
        self.flops_source = flops_source
        self.causal_discount = causal_discount
        self.peak_flops = peak_flops
        self.peak_dtype = peak_dtype
        self.tokens_per_sample = tokens_per_sample
        self.seq_len = seq_len
        self.hidden_size = hidden_size
        self.block_class_names = list(block_class_names or [])
        self._tp_degree = 1
        self.prog_bar = prog_bar
        self.prefix = prefix
        # results, readable after (or during) training
        self.peak: float | None = None
        self.source: str | None = None
        self.flops: StepFlops | None = None  # per batch on this rank
        self.local_values: list[float] = []  # this rank's window + cumulative rates, in log order
        self.gathered: torch.Tensor | None = None  # (world, values) as all-gathered
        self._reset()

    def _reset(self) -> None:
        self._counter: StepFlopCounter | None = None
        self._counted_samples = 0
        self._measuring = False
        self._last_step = 0
        self._steps_seen = 0
        self._window = _Window()
        self._total = _Window()
        self._pause_start: float | None = None

    # ------------------------------------------------------------------ peak
    def _precision_dtype(self, trainer: pl.Trainer) -> str | None:
        flag = str(trainer.precision)
        if "bf16" in flag:
            return "bf16"
        if flag.startswith("16"):
            return "fp16"
        if "transformer-engine" in flag:
            return "fp8"
        if flag.startswith("32"):
            tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
            return "tf32" if tf32 else "fp32"
        return None

    def _resolve_peak(self, trainer: pl.Trainer) -> float | None:
        if self.peak_flops is not None:
            return float(self.peak_flops)
        env = peak_flops_from_env()
        if env is not None:
            return env
        device = trainer.strategy.root_device
        if device.type == "cpu":
            rank_zero_warn(
                "MFUMonitor: no peak FLOP/s for a CPU, so MFU/HFU are not logged (TFLOPS and tokens/s are). "
                "Fix: set peak_flops (or FSDP_STRATEGIES_PEAK_FLOPS) to your CPU's peak FLOP/s per process."
            )
            return None
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        dtype = self.peak_dtype or self._precision_dtype(trainer)
        peak = lookup_peak_flops(name, dtype) if dtype else None
        if peak is None:
            rank_zero_warn(
                f"MFUMonitor: no dense {dtype} peak known for device {name!r}, so MFU/HFU are not logged. "
                "Fix: set peak_flops (or FSDP_STRATEGIES_PEAK_FLOPS) to its dense peak FLOP/s."
            )
        return peak

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.peak = self._resolve_peak(trainer)
            self._reset()
            self._tp_degree = _tensor_parallel_degree(trainer)

    # ------------------------------------------------------------------ batch bookkeeping
    def _samples_tokens(self, batch: Any) -> tuple[int, int]:
        leaves = [t for t in _torch_seam.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
        samples = int(leaves[0].shape[0]) if leaves else 0
        if self.tokens_per_sample is not None:
            return samples, samples * self.tokens_per_sample
        ids = next((t for t in leaves if not t.is_floating_point() and not t.is_complex()), None)
        return samples, int(ids.numel()) if ids is not None else 0

    def _analytic(self, pl_module: pl.LightningModule, samples: int, tokens: int) -> StepFlops:
        embeddings = {
            id(p) for m in pl_module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
        }
        n = sum(p.numel() for p in pl_module.parameters() if id(p) not in embeddings)
        names = self.block_class_names
        names = [*names, *(f"FSDP{c}" for c in names)] or None  # FSDP2 renames wrapped classes to FSDP<Name>
        layers = len(find_transformer_blocks(pl_module, names, option="block_class_names"))
        hidden = self.hidden_size or max(
            (m.embedding_dim for m in pl_module.modules() if isinstance(m, nn.Embedding)), default=0
        )
        seq = self.seq_len or (tokens // samples if samples else 0)
        if not (layers and hidden and seq):
            raise OptionError(
                f"MFUMonitor(flops_source='analytic') could not infer layers={layers}, hidden_size={hidden}, "
                f"seq_len={seq} from the model/batch. Fix: set block_class_names, hidden_size and seq_len."
            )
        flops = analytic_transformer_flops(
            n, layers, hidden, seq, samples * seq, causal_discount=self.causal_discount
        )
        flops //= self._tp_degree  # N counts whole (global) parameters; a tensor-parallel rank does its share
        return StepFlops(flops, flops)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # a resumed run warms up again, counted from here
        self._steps_seen = 0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if (
            self.flops is None
            and self.flops_per_batch is None
            and self.flops_source == "count"
            and self._counter is None
        ):
            compiled = [type(m).__name__ for m in (trainer.model, *pl_module.modules())
                        if _torch_seam.is_compiled_module(m)]
            if compiled:
                rank_zero_warn(
                    "MFUMonitor: the model has torch.compile'd "
                    f"modules ({sorted(set(compiled))}) whose kernels "
                    "FlopCounterMode cannot see; using flops_source='analytic'. "
                    "Fix: set flops_per_batch to be exact."
                )
                return  # no counter: the first batch's end takes the analytic path
            self._counter = StepFlopCounter(self.causal_discount)
            self._counter.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        samples, tokens = self._samples_tokens(batch)
        if self.flops is None:
            self._first_batch_flops(pl_module, batch, samples, tokens)
        assert self.flops is not None
        scale = samples / self._counted_samples if self._counted_samples else 1.0
        if self._measuring:  # the ranks of a tensor-parallel group share one batch: a device gets its share
            tp = self._tp_degree
            self._window.add(samples / tp, tokens / tp, self.flops, scale)
            self._total.add(samples / tp, tokens / tp, self.flops, scale)
        if trainer.global_step == self._last_step:
            return  # a micro-batch of gradient accumulation: the optimizer step is not over yet
        self._last_step = trainer.global_step
        self._steps_seen += 1
        if not self._measuring:
            if self._steps_seen >= self.warmup_steps:
                device = trainer.strategy.root_device
                _sync(device)
                now = time.perf_counter()
                self._window, self._total = _Window(start=now), _Window(start=now)
                self._measuring = True
            return
        self._window.steps += 1
        self._total.steps += 1
        if self._window.steps >= self.window:
            self._emit(trainer, pl_module)

    def _first_batch_flops(
        self, pl_module: pl.LightningModule, batch: Any, samples: int, tokens: int
    ) -> None:
        self._counted_samples = samples
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            total = self._counter.get_total_flops()
            self.flops = StepFlops(round(total - self._counter.recomputed), int(total))
            self._counter = None
            self.source = "FlopCounterMode on the first batch" + (
                " (causal discount)" if self.causal_discount else ""
            )
            if total == 0:
                rank_zero_warn(
                    "MFUMonitor: FlopCounterMode saw no FLOPs (compiled or custom kernels?). "
                    "Fix: set flops_per_batch or flops_source='analytic'."
                )
        elif self.flops_per_batch is not None:
            value = self.flops_per_batch(batch) if callable(self.flops_per_batch) else self.flops_per_batch
            self.flops = StepFlops(int(value), int(value))
            self.source = "flops_per_batch (user)"
        else:
            self.flops = self._analytic(pl_module, samples, tokens)
            self.source = "analytic 6*N*T + 12*L*H*S*T" + (
                " (causal discount)" if self.causal_discount else ""
            )
        rank_zero_info(
            f"MFUMonitor: {self.flops.model / 1e9:.4g} GFLOP model "
            f"/ {self.flops.hardware / 1e9:.4g} GFLOP hardware "
            f"per batch of {samples} samples per device (source: {self.source}); peak "
            f"{'unknown' if self.peak is None else f'{self.peak / 1e12:.4g} TFLOP/s'} per device"
        )

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self._counter is not None:  # do not leave the dispatch mode installed
            self._counter.__exit__(None, None, None)
            self._counter = None

    # ------------------------------------------------------------------ pausing for validation
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._measuring and self._pause_start is None:
            _sync(trainer.strategy.root_device)
            self._pause_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pause_start is not None:
            _sync(trainer.strategy.root_device)
            paused = time.perf_counter() - self._pause_start
            self._window.paused += paused
            self._total.paused += paused
            self._pause_start = None

    # ------------------------------------------------------------------ logging
    def _emit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        _sync(device)
        now = time.perf_counter()
        self.local_values = self._window.rates(now, self.peak) + self._total.rates(now, self.peak)
        local = torch.tensor(self.local_values, dtype=torch.float64, device=device)
        gathered = trainer.strategy.all_gather(local)
        self.gathered = gathered.reshape(-1, local.numel()).cpu()
        steps, batches = self._window.steps, self._window.batches
        metrics: dict[str, float] = {}
        for offset, prefix in ((0, self.prefix), (len(_RATES), f"{self.prefix}_cum")):
            for i, rate in enumerate(_RATES):
                column = [float(v) for v in self.gathered[:, offset + i]]
                if rate in ("mfu", "hfu") and self.peak is None:
                    continue
                stats = (min(column), statistics.median(column), max(column))
                metrics.update({f"{prefix}/{rate}/{s}": v for s, v in zip(_STATS, stats)})
                if rate.startswith(("tokens", "samples")):
                    metrics[f"{prefix}/{rate.split('_per_sec')[0]}_per_sec"] = sum(column)
        assert self.flops is not None
        metrics[f"{self.prefix}/model_flops_per_step"] = self._window.model_flops / steps
        metrics[f"{self.prefix}/hardware_flops_per_step"] = self._window.hardware_flops / steps
        metrics[f"{self.prefix}/batches_per_step"] = batches / steps
        for name, value in metrics.items():
            show = self.prog_bar and name in (
                f"{self.prefix}/tflops_per_device/median",
                f"{self.prefix}/mfu/median",
            )
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=show, sync_dist=False,
                          rank_zero_only=False)
        now = time.perf_counter()  # logging is not part of the next window
        self._window = _Window(start=now)
