"""sac suite: what activation checkpointing trades -- activation memory kept for backward against step time.

Contenders, side by side on the example Llama (one process, the same weights and batch):
``none``, ``selective_op`` (matmul + attention outputs kept), ``selective_op_2nd_mm`` (every other
matmul kept), ``selective_layer`` (every 2nd block fully checkpointed), ``full``.

Per contender and size:
- kept bytes: storages created in forward that are still alive when forward ends (autograd's
  saved tensors plus what selective checkpointing caches; weights excluded), via a dispatch mode
  and storage weak references -- works on CPU;
- step time (forward + backward), median over steps, contenders interleaved round by round;
- model vs hardware FLOPs of one step (``count_step_flops``): the recomputation each mode costs;
- on a GPU: peak CUDA memory of the step (``torch.cuda.max_memory_allocated``) as well.

    python benchmarks/run.py sac            # or: python benchmarks/suites/sac.py [--quick]
    python benchmarks/suites/sac.py --sizes gpu-350m gpu-1b --precision bf16-mixed   # on a GPU
"""

from __future__ import annotations

import copy
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

sys.path.insert(0, str(common.ROOT / "examples"))
from fsdp_strategies.callbacks.activation_checkpointing import apply_activation_checkpointing
from fsdp_strategies.flops import count_step_flops
from fsdp_strategies.testing import KeptBytes
from llama import Llama

CONTENDERS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "selective_op": {"mode": "selective_op"},
    "selective_op_2nd_mm": {"mode": "selective_op", "save_every_nth_matmul": 2},
    "selective_layer": {"mode": "selective_layer", "layer_interval": 2},
    "full": {"mode": "full"},
}


def _build(size: str, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
    cfg = common.size_config(size)
    m = dict(cfg["model"])
    heads = m["n_heads"]
    hidden = m.get("mlp_hidden") or int(8 * m["dim"] / 3 / 64 + 0.999) * 64
    seq = cfg["seq_len"]
    model = Llama(m["vocab_size"], m["dim"], m["n_layers"], heads, m.get("n_kv_heads") or heads, hidden, seq).to(device)
    return model, {"seq_len": seq, "batch": max(1, cfg["global_batch"] // 2), "vocab": m["vocab_size"], **m}


def _loss(model: torch.nn.Module, tokens: torch.Tensor, vocab: int, bf16: bool) -> torch.Tensor:
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, reps: int | None = None,
        steps: int | None = None, warmup: int | None = None, precision: str | None = None,
        contenders: list[str] | None = None, **_: Any) -> dict[str, Any]:
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    sizes = common.pick(sizes, quick, ["tiny"], ["gpu-350m", "gpu-1b"] if gpu else ["small", "medium"])
    reps = common.pick(reps, quick, 1, 3)
    steps = common.pick(steps, quick, 2, 5)
    warmup = common.pick(warmup, quick, 1, 2)
    precision = precision or ("bf16-mixed" if gpu else "32-true")
    bf16 = precision == "bf16-mixed"
    names = [n for n in CONTENDERS if not contenders or n in contenders]
    config = {"contenders": {n: CONTENDERS[n] for n in names}, "sizes": sizes, "reps": reps, "steps": steps,
              "warmup": warmup, "precision": precision, "quick": quick,
              "kept_bytes": "storages created in forward still alive after it (weights excluded)",
              "step": "forward + backward of one batch, one process"}
    result = common.header("sac", config)
    cases = []
    for size in sizes:
        torch.manual_seed(0)
        base, info = _build(size, device)
        tokens = torch.randint(0, info["vocab"], (info["batch"], info["seq_len"] + 1), device=device)
        models = {}
        case: dict[str, Any] = {"size": size, "params": sum(p.numel() for p in base.parameters()),
                                "batch": info["batch"], "seq_len": info["seq_len"], "contenders": {}}
        for name in names:
            model = copy.deepcopy(base)
            if CONTENDERS[name] is not None:
                kwargs = dict(CONTENDERS[name])
                apply_activation_checkpointing(model, kwargs.pop("mode"), **kwargs)
            models[name] = model
            pinned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
            kept = KeptBytes()
            if gpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device) if gpu else 0
            with kept:
                loss = _loss(model, tokens, info["vocab"], bf16)
            kept_bytes = kept.alive(pinned)
            loss.backward()
            record: dict[str, Any] = {"kept_bytes": kept_bytes, "step_s": []}
            if gpu:
                record["peak_cuda_bytes_over_weights"] = torch.cuda.max_memory_allocated(device) - before
            model.zero_grad(set_to_none=True)
            flops = count_step_flops(lambda m=model, t=tokens, v=info["vocab"]: _loss(m, t, v, bf16).backward())
            model.zero_grad(set_to_none=True)
            record.update({"model_flops": flops.model, "hardware_flops": flops.hardware,
                           "recompute_overhead": flops.hardware / flops.model - 1})
            case["contenders"][name] = record
        for _rep in range(reps):  # interleaved: A B C ... A B C
            for name in names:
                model = models[name]
                times = []
                for i in range(warmup + steps):
                    _sync(device)
                    t0 = time.perf_counter()
                    _loss(model, tokens, info["vocab"], bf16).backward()
                    _sync(device)
                    if i >= warmup:
                        times.append(time.perf_counter() - t0)
                    model.zero_grad(set_to_none=True)
                case["contenders"][name]["step_s"].extend(times)
        base_rec = case["contenders"].get("none")
        for rec in case["contenders"].values():
            rec["median_step_s"] = statistics.median(rec["step_s"])
            if base_rec:
                rec["kept_vs_none"] = rec["kept_bytes"] / base_rec["kept_bytes"]
                rec["time_vs_none"] = rec["median_step_s"] / base_rec["median_step_s"]
        cases.append(case)
        del models, base
        gc.collect()
    result["cases"] = cases
    result["summary"] = [
        {"size": c["size"], "ratio": f"{n}: {label} / none", "value": rec.get(key)}
        for c in cases for n, rec in c["contenders"].items() if n != "none"
        for label, key in (("kept bytes", "kept_vs_none"), ("step time", "time_vs_none"))
    ]
    json_path = common.write_result("sac", result, out_dir)
    png_path = plot(result, json_path.with_suffix(".png"))
    result.update({"json_path": str(json_path), "png_path": str(png_path)})
    return result


def plot(result: dict[str, Any], path: Path) -> Path:
    plt = common._pyplot()
    cases = result["cases"]
    fig, axes = plt.subplots(2, len(cases), figsize=(5.5 * len(cases), 7), squeeze=False)
    for col, case in enumerate(cases):
        names = list(case["contenders"])
        recs = [case["contenders"][n] for n in names]
        ax = axes[0][col]
        ax.bar(names, [r["kept_bytes"] / 2**20 for r in recs], color="tab:blue")
        if recs and "peak_cuda_bytes_over_weights" in recs[0]:
            ax.plot(names, [r["peak_cuda_bytes_over_weights"] / 2**20 for r in recs], "o-", color="tab:red",
                    label="peak CUDA (over weights)")
            ax.legend(fontsize=7)
        ax.set_ylabel("activation bytes kept for backward (MiB)")
        ax.set_title(f"{case['size']} ({case['params'] / 1e6:.1f}M params, batch {case['batch']}x{case['seq_len']})")
        ax.tick_params(axis="x", labelrotation=20, labelsize=7)
        ax = axes[1][col]
        ax.bar(names, [r["median_step_s"] * 1e3 for r in recs], color="tab:orange")
        for i, r in enumerate(recs):
            ax.scatter([i] * len(r["step_s"]), [t * 1e3 for t in r["step_s"]], s=6, color="black", zorder=3)
            ax.annotate(f"hw/model FLOPs +{r['recompute_overhead'] * 100:.0f}%", (i, r["median_step_s"] * 1e3),
                        ha="center", va="bottom", fontsize=7)
        ax.set_ylabel("forward+backward time (ms), median")
        ax.tick_params(axis="x", labelrotation=20, labelsize=7)
    fig.suptitle(f"activation checkpointing on {result['device_name']} ({result['config']['precision']})", fontsize=9)
    return common.save_figure(fig, path)


if __name__ == "__main__":
    common.suite_main(run, __doc__.splitlines()[0])
