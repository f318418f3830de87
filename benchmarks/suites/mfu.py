"""mfu suite: MFU / HFU / TFLOPS of the example as MFUMonitor logs them, next to torchtitan's formula.

One Lightning run per contender (``fsdp2`` on one device; ``fsdp2+sac_full`` adds full activation
checkpointing, so HFU rises while MFU's numerator stays), the example LlamaLM, ``MFUMonitor`` with
its FLOP counter. For the same run the suite also computes MFU with torchtitan's estimate of FLOPs
per token, ``6 * N_non_embedding + 12 * L * H * Q * T`` (H heads, Q head dim, T sequence length),
from the measured tokens/s, so both definitions are compared on identical timings.

On a GPU the peak comes from the device table (bf16 for ``bf16-mixed``); the default sizes are
``gpu-1b`` (>= 1B parameters). On a CPU there is no peak: TFLOPS and the FLOP-count agreement are
reported, MFU is not (pass ``FSDP_STRATEGIES_PEAK_FLOPS`` to get one).

    python benchmarks/run.py mfu           # or: python benchmarks/suites/mfu.py [--quick]
    python benchmarks/suites/mfu.py --sizes gpu-1b --steps 20   # on an H100/H200
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

sys.path.insert(0, str(common.ROOT / "examples"))
import lightning.pytorch as pl

import fsdp_strategies  # noqa: F401  (registers fsdp2)
from fsdp_strategies.callbacks import ActivationCheckpointing, MFUMonitor
from llama import LlamaLM, MarkovDataModule

CONTENDERS = ("fsdp2", "fsdp2+sac_full")


def _torchtitan_flops_per_token(
    model: torch.nn.Module, n_layers: int, n_heads: int, head_dim: int, seq: int
) -> int:
    params = sum(p.numel() for p in model.parameters())
    embedding = sum(
        p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()
    )
    return 6 * (params - embedding) + 12 * n_layers * n_heads * head_dim * seq


def _one_run(name: str, size: str, steps: int, warmup: int, precision: str, batch: int) -> dict[str, Any]:
    cfg = common.size_config(size)
    m, seq = dict(cfg["model"]), cfg["seq_len"]
    monitor = MFUMonitor(window=steps, warmup_steps=warmup, tokens_per_sample=seq, prog_bar=False)
    callbacks: list[pl.Callback] = [monitor]
    if name.endswith("sac_full"):
        callbacks.insert(0, ActivationCheckpointing(mode="full"))
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="auto", devices=1, strategy="fsdp2", precision=precision,
                         max_steps=warmup + steps,
                         callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    model = LlamaLM(**m, max_seq_len=seq)
    data = MarkovDataModule(vocab_size=m["vocab_size"], seq_len=seq, batch_size=batch,
                            num_train=batch * (warmup + steps + 1), num_val=batch, shuffle=False)
    trainer.fit(model, data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("perf")}
    heads = m["n_heads"]
    tt_per_token = _torchtitan_flops_per_token(model, m["n_layers"], heads, m["dim"] // heads, seq)
    tokens_per_s = metrics.get("perf_cum/tokens_per_sec_per_device/median")
    record: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "batch": batch, "seq_len": seq, "peak_flops": monitor.peak, "flop_source": monitor.source,
        "counted_model_flops_per_batch": monitor.flops.model if monitor.flops else None,
        "counted_hardware_flops_per_batch": monitor.flops.hardware if monitor.flops else None,
        "torchtitan_flops_per_batch": tt_per_token * batch * seq,
        "tflops_per_device": metrics.get("perf_cum/tflops_per_device/median"),
        "mfu": metrics.get("perf_cum/mfu/median"),
        "hfu": metrics.get("perf_cum/hfu/median"),
        "tokens_per_sec_per_device": tokens_per_s,
        "metrics": metrics,
    }
    if tokens_per_s is not None:
        record["torchtitan_tflops_per_device"] = tokens_per_s * tt_per_token / 1e12
        record["torchtitan_mfu"] = tokens_per_s * tt_per_token / monitor.peak if monitor.peak else None
    if torch.cuda.is_available():
        record["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    del trainer, model, data
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return record


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, steps: int | None = None,
        warmup: int | None = None, precision: str | None = None, contenders: list[str] | None = None,
        **_: Any) -> dict[str, Any]:
    gpu = torch.cuda.is_available()
    sizes = common.pick(sizes, quick, ["tiny"], ["gpu-1b"] if gpu else ["small", "medium"])
    steps = common.pick(steps, quick, 3, 20 if gpu else 6)
    warmup = common.pick(warmup, quick, 1, 3)
    precision = precision or ("bf16-mixed" if gpu else "32-true")
    names = [n for n in CONTENDERS if not contenders or n in contenders]
    config = {"contenders": names, "sizes": sizes, "steps": steps, "warmup": warmup, "precision": precision,
              "quick": quick, "strategy": "fsdp2 on one device",
              "reported": "cumulative over the measured steps",
              "torchtitan_formula": "6 * N_non_embedding + 12 * L * H * Q * T FLOPs per token"}
    result = common.header("mfu", config)
    cases = []
    for size in sizes:
        batch = max(1, common.size_config(size)["global_batch"] // 2)
        case = {
            "size": size,
            "contenders": {n: _one_run(n, size, steps, warmup, precision, batch) for n in names},
        }
        cases.append(case)
    result["cases"] = cases
    summary = []
    for case in cases:
        for name, rec in case["contenders"].items():
            if rec.get("counted_model_flops_per_batch"):
                summary.append({"size": case["size"], "ratio": f"{name}: counted / torchtitan FLOPs",
                                "value": rec["counted_model_flops_per_batch"]
                                / rec["torchtitan_flops_per_batch"]})
            for key in ("mfu", "torchtitan_mfu", "hfu", "tflops_per_device"):
                if rec.get(key) is not None:
                    summary.append({"size": case["size"], "ratio": f"{name}: {key}", "value": rec[key]})
    result["summary"] = summary
    json_path = common.write_result("mfu", result, out_dir)
    png_path = plot(result, json_path.with_suffix(".png"))
    result.update({"json_path": str(json_path), "png_path": str(png_path)})
    return result


def plot(result: dict[str, Any], path: Path) -> Path:
    plt = common._pyplot()
    cases = result["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.2), squeeze=False)
    for col, case in enumerate(cases):
        ax = axes[0][col]
        names = list(case["contenders"])
        has_peak = any(r.get("mfu") is not None for r in case["contenders"].values())
        keys = (("mfu", "MFU (FlopCounterMode)"), ("torchtitan_mfu", "MFU (torchtitan formula)"),
                ("hfu", "HFU")) \
            if has_peak else (("tflops_per_device", "TFLOPS (FlopCounterMode)"),
                              ("torchtitan_tflops_per_device", "TFLOPS (torchtitan formula)"))
        width = 0.8 / len(keys)
        for i, (key, label) in enumerate(keys):
            values = [case["contenders"][n].get(key) or 0.0 for n in names]
            xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(names))]
            ax.bar(xs, [v * (100 if has_peak else 1) for v in values], width=width, label=label)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("% of dense peak" if has_peak else "TFLOP/s per device")
        params = next(iter(case["contenders"].values()))["params"]
        ax.set_title(f"{case['size']} ({params / 1e6:.1f}M params)")
        ax.legend(fontsize=7)
    fig.suptitle(
        f"MFU of the example with fsdp2 on {result['device_name']} ({result['config']['precision']})",
        fontsize=9,
    )
    return common.save_figure(fig, path)


if __name__ == "__main__":
    common.suite_main(run, __doc__.splitlines()[0])
