"""Parts of ``benchmarks/gpu.py`` that run inside one process on one device (no torchrun).

    python benchmarks/workers/single_device.py sac   --model JSON --seq-len S --batch B --out FILE.json ...
    python benchmarks/workers/single_device.py smoke --runs NAME [NAME ...] --out FILE.jsonl [--quick]

``sac``: the sac suite (``benchmarks/suites/sac.py``) on the harness's model: every activation
checkpointing mode on the same weights and batch, interleaved, with bytes kept for backward, step
time, model/hardware FLOPs and (on a GPU) peak CUDA memory. Its result's case goes to ``--out``.

``smoke``: short ``Trainer.fit`` runs that must *run* at world size 1 on the device (NCCL on a GPU,
gloo on a CPU), one after the other in this process. Before each run a ``started`` line and after it
a result line go to ``--out`` (JSON lines), so the caller can tell which run a crash interrupted and
start the rest again in a fresh process. Runs (``--runs``):

  fsdp2, hsdp       ``FSDP2Strategy`` and ``HSDPStrategy`` (a 1 x 1 mesh); the mesh's dimensions are recorded.
  ddp_hooks:<hook>  ``DDPHooksStrategy(comm_hook=<hook>)`` for every hook of ``COMM_HOOKS``; records the
                    hook's own state afterwards (PowerSGD's compression counters, the local-SGD averager's
                    step) to show the hook ran, not only registered.
  ft_hsdp           ``FTHSDPStrategy`` with one replica group and a lighthouse started in this process
                    (torchft ``ProcessGroupNCCL`` on a GPU); every step must commit.
  async_checkpoint:<mode>  ``FSDP2Strategy(async_checkpoint=<mode>)`` (``thread``, ``process``) saving every
                    2 steps; the last checkpoint must pass ``verify_checkpoint`` and a resume from it
                    continue.
  activation_offload  ``ActivationCheckpointing(mode="none", offload=True)`` (pinned host copies on a side
                    stream): bytes offloaded, peak memory and losses next to the same run without offload.
  straggler         ``StragglerDetector`` (CUDA-event timing on a GPU, process CPU time on a CPU) next to the
                    same quantity measured by hand at the same hooks (``torch.cuda.Event`` / CPU time),
                    per window.
  mfu_peak          the dense-peak table lookup on the real device name, and the peak ``MFUMonitor``
                    resolves for a short run on the device (no override).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _p in (ROOT / "benchmarks", ROOT / "examples", ROOT / "src"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# ft_hsdp last: a hang in its replica process group (the riskiest path) costs only what comes after it
SMOKE_RUNS = ("fsdp2", "hsdp", "async_checkpoint:thread", "async_checkpoint:process", "activation_offload",
              "straggler", "mfu_peak", "ddp_hooks:allreduce", "ddp_hooks:bf16_compress",
              "ddp_hooks:fp16_compress",
              "ddp_hooks:powersgd", "ddp_hooks:post_local_sgd", "ddp_hooks:hierarchical_sgd", "ft_hsdp")


# ---------------------------------------------------------------------------------------------- sac
def sac_main(ns: argparse.Namespace) -> None:
    import common
    from suites import sac

    # sac.run takes sizes by name and trains half of a size's global batch: register the harness's model
    name = "gpu-harness"
    common.SIZES[name] = {"model": json.loads(ns.model), "seq_len": ns.seq_len, "global_batch": 2 * ns.batch}
    with tempfile.TemporaryDirectory(prefix="gpu-sac-") as tmp:
        result = sac.run(quick=False, out_dir=Path(tmp), sizes=[name], reps=ns.reps, steps=ns.steps,
                         warmup=ns.warmup, precision=ns.precision)
    [case] = result["cases"]
    out = {
        "config": result["config"],
        "case": case,
        "device_type": "cuda" if torch.cuda.is_available() else "cpu",
    }
    _write_json(Path(ns.out), out)


# ---------------------------------------------------------------------------------------------- smoke runs
def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, default=str))
    tmp.replace(path)


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(record, default=str) + "\n")


def _size(quick: bool, gpu_size: str) -> dict[str, Any]:
    import common

    return common.SIZES["tiny" if quick else gpu_size]


class StepRecorder(pl.Callback):
    """Per-step losses and wall times of a smoke run (any strategy)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.times: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, *_: Any) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *_: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))
        self.times.append(time.perf_counter() - self._t)


def _fit(strategy: Any, size: dict[str, Any], steps: int, precision: str, callbacks: list[Any],
         batch: int | None = None, ckpt_path: str | None = None,
         **trainer_kwargs: Any) -> tuple[pl.Trainer, StepRecorder]:
    """One short fit of the example on the one device; returns (trainer, step recorder)."""
    from llama import LlamaLM, MarkovDataModule

    m, seq = size["model"], size["seq_len"]
    batch = batch or size["global_batch"]
    recorder = StepRecorder()
    pl.seed_everything(0, verbose=False)
    kwargs = {"logger": False, "enable_checkpointing": False, **trainer_kwargs}
    trainer = pl.Trainer(accelerator="auto", devices=1, strategy=strategy, precision=precision,
                         max_steps=steps, callbacks=[recorder, *callbacks], enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, **kwargs)
    model = LlamaLM(**m, max_seq_len=seq, warmup_steps=1)
    data = MarkovDataModule(vocab_size=m["vocab_size"], seq_len=seq, batch_size=batch,
                            num_train=batch * (steps + 1), num_val=batch)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, recorder


def _common_record(trainer: Any, recorder: Any, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    losses = recorder.losses
    ok = trainer.global_step == steps and len(losses) == steps and all(math.isfinite(v) for v in losses)
    return {
        "status": "ok" if ok else "failed",
        "reason": None if ok else f"global_step={trainer.global_step} of {steps}, losses={losses}",
        "steps": trainer.global_step, "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None, "step_times_s": recorder.times,
        "device": str(trainer.strategy.root_device),
        "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
        "strategy_class": type(trainer.strategy).__name__,
    }


def smoke_fsdp(name: str, quick: bool, precision: str) -> dict[str, Any]:
    from fsdp_strategies import FSDP2Strategy, HSDPStrategy

    steps = 6
    blocks = ["TransformerBlock"]
    strategy = (FSDP2Strategy(block_class_names=blocks) if name == "fsdp2"
                else HSDPStrategy(replicate_degree=1, shard_degree=1, block_class_names=blocks))
    trainer, recorder = _fit(strategy, _size(quick, "medium"), steps, precision, [])
    rec = _common_record(trainer, recorder, steps)
    mesh = getattr(strategy, "device_mesh", None)
    rec["mesh"] = (
        {"dim_names": list(mesh.mesh_dim_names or ()), "shape": list(mesh.shape)}
        if mesh is not None
        else None
    )
    if cuda_peak := _cuda_peak():
        rec["peak_cuda_bytes"] = cuda_peak
    return rec


def _cuda_peak() -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def smoke_async_checkpoint(mode: str, quick: bool, precision: str) -> dict[str, Any]:
    """Async saves every 2 steps, then the last one verified and resumed from."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fsdp_strategies import FSDP2Strategy, verify_checkpoint

    steps, size = 6, _size(quick, "medium")
    with tempfile.TemporaryDirectory(prefix="gpu-async-") as tmp:
        def run(max_steps: int, ckpt: str | None) -> tuple[Any, Any]:
            saver = ModelCheckpoint(dirpath=tmp, every_n_train_steps=2, save_top_k=-1, save_last=True)
            strategy = FSDP2Strategy(block_class_names=["TransformerBlock"], async_checkpoint=mode)
            return _fit(strategy, size, max_steps, precision, [saver], ckpt_path=ckpt,
                        enable_checkpointing=True, default_root_dir=tmp)

        t0 = time.perf_counter()
        trainer, recorder = run(steps, None)
        rec = _common_record(trainer, recorder, steps)
        rec["first_fit_wall_s"] = time.perf_counter() - t0
        saved = sorted(p.name for p in Path(tmp).iterdir() if p.name.endswith(".ckpt"))
        last = Path(tmp) / "last.ckpt"
        verdict = verify_checkpoint(last) if last.exists() else None
        rec.update({"checkpoints": saved, "verify_last": None if verdict is None else
                    {"status": str(verdict.status), "message": verdict.message}})
        resumed, resumed_rec = run(steps + 2, str(last)) if last.exists() else (None, None)
    if rec["status"] == "ok" and (verdict is None or not verdict.ok):
        rec.update(status="failed", reason=f"last.ckpt missing or not verified: {rec['verify_last']}")
    elif rec["status"] == "ok" and (resumed is None or resumed.global_step != steps + 2
                                    or len(resumed_rec.losses) != 2):
        rec.update(status="failed", reason=f"resume from last.ckpt did not run steps {steps}..{steps + 2}: "
                                           f"global_step={getattr(resumed, 'global_step', None)}")
    if resumed_rec is not None:
        rec["resumed_losses"] = resumed_rec.losses
    return rec


def smoke_activation_offload(quick: bool, precision: str) -> dict[str, Any]:
    """Offload on and off on the same weights and batches: bytes moved, peak memory, identical losses."""
    from fsdp_strategies import ActivationCheckpointing

    steps = 4
    size = _size(quick, "gpu-350m")
    batch = None if quick else 4
    runs: dict[str, Any] = {}
    for offload in (False, True):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        cb = (
            [ActivationCheckpointing(mode="none", offload=True, offload_min_bytes=1 << 16)] if offload else []
        )
        trainer, recorder = _fit("fsdp2", size, steps, precision, cb, batch=batch)
        stats = cb[0].offload_stats if cb else None
        runs["offload" if offload else "baseline"] = {
            **_common_record(trainer, recorder, steps), "losses": recorder.losses,
            "peak_cuda_bytes": _cuda_peak(),
            "offloaded": None if stats is None else {"blocks": stats.blocks, "tensors": stats.tensors,
                                                     "bytes": stats.bytes}}
    base, off = runs["baseline"], runs["offload"]
    diffs = [abs(a - b) for a, b in zip(base["losses"], off["losses"])]
    rec = {**off, "baseline": base, "losses_max_abs_diff": max(diffs, default=None)}
    if rec["status"] == "ok" and not (off["offloaded"] and off["offloaded"]["bytes"]):
        rec.update(status="failed", reason=f"nothing was offloaded: {off['offloaded']}")
    elif rec["status"] == "ok" and (not diffs or max(diffs) > 1e-3 * max(1.0, abs(base["losses"][-1]))):
        rec.update(status="failed", reason=f"offload changed the losses: {base['losses']} vs {off['losses']}")
    return rec


def smoke_ddp_hooks(hook: str, quick: bool, precision: str) -> dict[str, Any]:
    from fsdp_strategies import DDPHooksStrategy

    steps = 6 if quick else 8
    strategy = DDPHooksStrategy(comm_hook=hook, powersgd_start_iter=2, local_sgd_period=2, local_sgd_warmup=2)
    trainer, recorder = _fit(strategy, _size(quick, "medium"), steps, precision, [])
    rec = _common_record(trainer, recorder, steps)
    state = strategy.comm_state_dict()  # the hook's own counters: proof it ran, not only registered
    rec["comm_state"] = {k: v for k, v in state.items() if k in ("comm_hook", "post_local_sgd", "averager",
                                                                     "local_sgd_enabled")}
    if "powersgd" in state:
        ps = state["powersgd"]
        rec["comm_state"]["powersgd"] = {"iter": ps["iter"],
                                         "numel_before_compression": ps["total_numel_before_compression"],
                                         "numel_after_compression": ps["total_numel_after_compression"]}
        if rec["status"] == "ok" and not ps["total_numel_after_compression"]:
            rec.update(
                status="failed", reason="PowerSGD never compressed a gradient (numel_after_compression=0)"
            )
    if hook in ("post_local_sgd", "hierarchical_sgd") and rec["status"] == "ok" \
            and not state.get("averager", {}).get("step"):
        rec.update(status="failed", reason=f"the {hook} averager never stepped")
    return rec


def smoke_ft_hsdp(quick: bool, precision: str) -> dict[str, Any]:
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as exc:
        return {"status": "skipped", "reason": f"torchft is not importable here ({exc}). Fix: install it "
                                               "(benchmarks/gpu_pack.py packs a "
                                               "wheel for machines without network)."}
    from fsdp_strategies import FTHSDPStrategy

    steps = 4 if quick else 6
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=5000)
    try:
        port = int(lighthouse.address().rsplit(":", 1)[1])
        strategy = FTHSDPStrategy(lighthouse_addr=f"http://127.0.0.1:{port}", replica_group_id=0,
                                  num_replica_groups=1,
                                  min_replica_size=1, init_sync=False, timeout_s=120, quorum_timeout_s=120,
                                  block_class_names=["TransformerBlock"])
        trainer, recorder = _fit(strategy, _size(quick, "medium"), steps, precision, [])
    finally:
        lighthouse.shutdown()
    rec = _common_record(trainer, recorder, steps)
    rec["ft_stats"] = dict(strategy.ft_stats)
    rec["replica_pg"] = (
        "torchft ProcessGroupNCCL" if strategy.root_device.type == "cuda" else "torchft ProcessGroupGloo"
    )
    if rec["status"] == "ok" and strategy.ft_stats["committed"] != steps:
        rec.update(status="failed", reason=f"{strategy.ft_stats['committed']} of {steps} steps committed")
    return rec


def smoke_straggler(quick: bool, precision: str) -> dict[str, Any]:
    """The detector's per-window busy time next to the same quantity measured by hand at the same hooks."""
    from fsdp_strategies.callbacks.straggler import StragglerDetector

    window, skip_first = 5, 2
    windows = 3 if quick else 4
    steps = window * windows
    cuda = torch.cuda.is_available()

    class HandTimer(pl.Callback):
        """Around the detector's own hooks (placed first): CUDA events on a GPU, process CPU time on a CPU."""

        def __init__(self) -> None:
            self.rows: list[tuple[Any, Any, float, float]] = []

        def on_train_batch_start(self, *_: Any) -> None:
            self._t, self._c = time.perf_counter(), time.process_time()
            self._ev = torch.cuda.Event(enable_timing=True) if cuda else None
            if self._ev is not None:
                self._ev.record()

        def on_train_batch_end(self, *_: Any) -> None:
            ev = torch.cuda.Event(enable_timing=True) if cuda else None
            if ev is not None:
                ev.record()
            self.rows.append((self._ev, ev, time.perf_counter() - self._t, time.process_time() - self._c))

    hand = HandTimer()
    with tempfile.TemporaryDirectory(prefix="gpu-straggler-") as tmp:
        detector = StragglerDetector(
            window=window, skip_first=skip_first, report_path=str(Path(tmp) / "r.json")
        )
        size = _size(quick, "gpu-350m")
        trainer, recorder = _fit("fsdp2", size, steps, precision, [hand, detector],
                                 batch=None if quick else max(1, size["global_batch"] // 2))
    rec = _common_record(trainer, recorder, steps)
    if cuda:
        torch.cuda.synchronize()
    per_batch = []
    for ev0, ev1, wall, cpu in hand.rows:
        busy = ev0.elapsed_time(ev1) / 1e3 if cuda else cpu
        per_batch.append({"wall_s": wall, "busy_s": busy, "busy_clamped_s": min(busy, wall)})
    # the detector measures batch b when b >= max(1, skip_first) and closes window k after batch k*window-1
    compare = []
    first = max(1, skip_first)
    for k, window_result in enumerate(detector.history, start=1):
        batches = [b for b in range((k - 1) * window, k * window) if b >= first and b < len(per_batch)]
        if not batches:
            continue
        hand_busy = sum(per_batch[b]["busy_clamped_s"] for b in batches) / len(batches)
        det_busy = window_result["mean_self"][0] - window_result["data"][0]
        compare.append({"window": k, "batches": batches, "detector_busy_s": det_busy,
                        "hand_busy_s": hand_busy,
                        "hand_raw_busy_s": sum(per_batch[b]["busy_s"] for b in batches) / len(batches),
                        "relative_difference": det_busy / hand_busy - 1 if hand_busy else None})
    rec.update({
        "timing": "CUDA events (torch.cuda.Event) on both sides" if cuda else
                  "process CPU time on both sides (no CUDA device: the detector's CPU path)",
        "windows_scored": len(detector.history), "per_window": compare, "per_batch_hand": per_batch,
        "max_abs_relative_difference": max((abs(c["relative_difference"]) for c in compare
                                            if c["relative_difference"] is not None), default=None),
    })
    if rec["status"] == "ok" and not compare:
        rec.update(status="failed", reason="the detector scored no window")
    if not cuda:
        rec["cuda_event_check"] = {"skipped": "no CUDA device: the CUDA-event timing path runs on GPUs only"}
    return rec


def smoke_mfu_peak(quick: bool, precision: str) -> dict[str, Any]:
    """Table lookup on the real device name, and what MFUMonitor resolves on its own for a short run."""
    from fsdp_strategies.callbacks import MFUMonitor
    from fsdp_strategies.flops.peaks import DTYPES, PEAK_FLOPS_ENV, device_key, lookup_peak_flops

    cuda = torch.cuda.is_available()
    if cuda:
        name = torch.cuda.get_device_name(0)
    else:
        import common

        name = common.device_name()
    saved = os.environ.pop(PEAK_FLOPS_ENV, None)  # the real lookup, not an override
    try:
        monitor = MFUMonitor(window=2, warmup_steps=1, prog_bar=False)
        trainer, recorder = _fit("fsdp2", _size(quick, "small"), 3, precision, [monitor])
    finally:
        if saved is not None:
            os.environ[PEAK_FLOPS_ENV] = saved
    rec = _common_record(trainer, recorder, 3)
    dtype = "bf16" if precision.startswith("bf16") else "fp32"
    rec.update({"device_name": name, "table_key": device_key(name),
                "table_peaks": {d: lookup_peak_flops(name, d) for d in DTYPES},
                "mfu_monitor_peak": monitor.peak, "mfu_monitor_dtype": dtype,
                "agrees": monitor.peak == lookup_peak_flops(name, dtype)})
    if not cuda:
        rec["peak_check"] = {
            "skipped": "no CUDA device name to look up (CPUs have no table entry; MFUMonitor "
            "resolved None, as documented)"
        }
    elif rec["table_key"] is None and rec["status"] == "ok":
        rec.update(status="failed", reason=f"no peak-table entry matches the device name {name!r}")
    if rec["status"] == "ok" and not rec["agrees"]:
        rec.update(status="failed", reason=f"MFUMonitor resolved {monitor.peak}, the table has "
                                           f"{lookup_peak_flops(name, dtype)} for {dtype}")
    return rec


def smoke_one(name: str, quick: bool, precision: str) -> dict[str, Any]:
    if name in ("fsdp2", "hsdp"):
        return smoke_fsdp(name, quick, precision)
    if name.startswith("async_checkpoint:"):
        return smoke_async_checkpoint(name.split(":", 1)[1], quick, precision)
    if name == "activation_offload":
        return smoke_activation_offload(quick, precision)
    if name.startswith("ddp_hooks:"):
        return smoke_ddp_hooks(name.split(":", 1)[1], quick, precision)
    if name == "ft_hsdp":
        return smoke_ft_hsdp(quick, precision)
    if name == "straggler":
        return smoke_straggler(quick, precision)
    if name == "mfu_peak":
        return smoke_mfu_peak(quick, precision)
    raise ValueError(f"--runs: unknown smoke run {name!r}. Fix: choose from {list(SMOKE_RUNS)}.")


def smoke_main(ns: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")  # keep the caller's error tails about errors
    out = Path(ns.out)
    precision = ns.precision or ("bf16-mixed" if torch.cuda.is_available() else "32-true")
    runs = ns.runs or list(SMOKE_RUNS)
    for name in runs:
        if name not in SMOKE_RUNS:
            raise SystemExit(f"--runs: unknown smoke run {name!r}. Fix: choose from {list(SMOKE_RUNS)}.")
    _append(out, {"event": "plan", "runs": runs})
    for name in runs:
        _append(out, {"name": name, "event": "started", "pid": os.getpid()})
        t0 = time.perf_counter()
        try:
            rec = smoke_one(name, ns.quick, precision)
        except Exception as exc:  # recorded; the next run goes on in this process
            rec = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                   "error_tail": "".join(traceback.format_exc()).splitlines()[-25:]}
        rec.update(
            {"name": name, "event": "done", "wall_s": time.perf_counter() - t0, "precision": precision}
        )
        _append(out, rec)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("sac")
    p.add_argument("--model", required=True, help="LlamaLM keyword arguments as JSON")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precision", default=None, choices=("32-true", "bf16-mixed"))
    p.add_argument("--out", required=True)
    p = sub.add_parser("smoke")
    p.add_argument("--runs", nargs="+", default=None, help=f"default: all of {list(SMOKE_RUNS)}")
    p.add_argument("--quick", action="store_true", help="tiny models")
    p.add_argument("--precision", default=None, choices=("32-true", "bf16-mixed"))
    p.add_argument("--out", required=True)
    ns = parser.parse_args(argv)
    if ns.cmd == "sac":
        sac_main(ns)
    else:
        smoke_main(ns)


if __name__ == "__main__":
    main()
