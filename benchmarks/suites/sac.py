"""sac suite: activation memory kept for backward against step time -- checkpointing modes, ``budget``,
offload.

Contenders, side by side in one process on the same weights and batch (the example Llama, and a Hugging Face
``LlamaForCausalLM`` from a random config): ``none``; the fixed modes ``full``, ``selective_op`` (matmul +
attention outputs kept), ``selective_op_2nd_mm`` (every other matmul kept), ``selective_layer`` (every 2nd
block fully checkpointed); ``budget`` at 0.25 / 0.5 / 0.75 of ``none``'s bytes; activation offload
(``offload``: no checkpointing, every block's saved tensors to host memory; ``selective_layer+offload``: the
blocks ``selective_layer`` leaves alone offloaded); and ``budget`` at the kept fraction *measured* for
``selective_op`` and for ``selective_layer`` (``budget@selective_op``, ``budget@selective_layer``): equal
bytes, so their recomputed FLOPs compare directly.

Per contender and model, every figure from a step *after* ``budget``'s two planning forwards:

- kept bytes: storages created in forward still alive when it ends (autograd's saved tensors plus what
  selective checkpointing caches; weights excluded), ``fsdp_strategies.memory.SavedBytes`` -- exact on CPU;
  with offload also the bytes moved to host memory in that forward and the bytes left on the device
  (kept - host copies: what an accelerator would hold; on the CPU host and device are one memory);
- step time (forward + backward): contenders interleaved step by step; against ``none`` the median of the
  per-cycle ratios (a slow phase of a shared machine hits both sides of a ratio);
- model vs hardware FLOPs (``count_step_flops``); the recomputation a mode adds is its hardware - model
  FLOPs less ``none``'s (the attention-score recompute every SDPA backward does);
- ``budget``: the target (fraction x ``none``'s kept bytes), measured / target, the planner's prediction;
- memory saved per % of step time lost: (1 - kept/none) in % over the step-time overhead in %;
- gradients of one fp32 step equal to ``none``'s (``torch.equal``; the suite stops if one is not);
- on a GPU: peak CUDA memory of the step as well.

    python benchmarks/run.py sac            # or: python benchmarks/suites/sac.py [--quick]
    python benchmarks/suites/sac.py --sizes gpu-350m hf-llama-350m --precision bf16-mixed   # on a GPU
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

sys.path.insert(0, str(common.ROOT / "examples"))
from fsdp_strategies.flops import count_step_flops
from fsdp_strategies.memory import BudgetNotMetError, BudgetPlanner, SavedBytes, apply_activation_offload
from fsdp_strategies.parallel.activation_checkpointing import apply_activation_checkpointing
from llama import Llama

#: name -> options: ``mode`` (absent: no checkpointing), the mode's options, ``memory_budget`` (a fraction, or
#: ``"match:<contender>"``: that contender's measured kept fraction), ``offload``.
CONTENDERS: dict[str, dict[str, Any]] = {
    "none": {},
    "full": {"mode": "full"},
    "selective_op": {"mode": "selective_op"},
    "selective_op_2nd_mm": {"mode": "selective_op", "save_every_nth_matmul": 2},
    "selective_layer": {"mode": "selective_layer", "layer_interval": 2},
    "budget_0.25": {"mode": "budget", "memory_budget": 0.25},
    "budget_0.5": {"mode": "budget", "memory_budget": 0.5},
    "budget_0.75": {"mode": "budget", "memory_budget": 0.75},
    "offload": {"offload": True},
    "selective_layer+offload": {"mode": "selective_layer", "layer_interval": 2, "offload": True},
    "budget@selective_op": {"mode": "budget", "memory_budget": "match:selective_op"},
    "budget@selective_layer": {"mode": "budget", "memory_budget": "match:selective_layer"},
}
#: the fixed modes that ``budget@<mode>`` is compared with at equal kept bytes
MATCHED = ("selective_op", "selective_layer")

#: this suite's own models (any name of ``common.SIZES`` is the example Llama at that size, half its global
#: batch)
SIZES: dict[str, dict[str, Any]] = {
    "example-384": {"family": "example",
                    "model": {"vocab_size": 1024, "dim": 384, "n_layers": 4, "n_heads": 6,
                                                   "n_kv_heads": 3, "mlp_hidden": 1024}, "seq_len": 256,
                                                   "batch": 2},
    "hf-llama-384": {"family": "hf_llama",
                     "model": {"vocab_size": 1024, "hidden_size": 384, "intermediate_size": 1024,
                                                     "num_hidden_layers": 4, "num_attention_heads": 6,
                                                     "num_key_value_heads": 3}, "seq_len": 256, "batch": 2},
    "hf-llama-tiny": {"family": "hf_llama",
                      "model": {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
                                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2}, "seq_len": 32, "batch": 4},
    "hf-llama-350m": {"family": "hf_llama", "model": {"vocab_size": 2048, "hidden_size": 1024,
                                                      "intermediate_size": 2816, "num_hidden_layers": 24,
                                                      "num_attention_heads": 16, "num_key_value_heads": 16},
                      "seq_len": 1024, "batch": 8},
}


def _spec(size: str) -> dict[str, Any]:
    if size in SIZES:
        return SIZES[size]
    if size not in common.SIZES:
        raise ValueError(
            f"--sizes: unknown size {size!r} for the sac suite. Fix: choose from {sorted(SIZES)} (this "
            f"suite's models) or {sorted(common.SIZES)} (the example)."
        )
    cfg = common.size_config(size)  # the example at a runner size: its model, half its global batch
    m = dict(cfg["model"])
    m["n_kv_heads"] = m.get("n_kv_heads") or m["n_heads"]
    m["mlp_hidden"] = m.get("mlp_hidden") or int(8 * m["dim"] / 3 / 64 + 0.999) * 64
    return {"family": "example", "model": m, "seq_len": cfg["seq_len"],
            "batch": max(1, cfg["global_batch"] // 2)}


def _build(
    spec: dict[str, Any], device: torch.device
) -> tuple[torch.nn.Module, Callable[[Any, torch.Tensor], Any]]:
    """The model (seed 0) and how to get its logits from input ids."""
    torch.manual_seed(0)
    m, seq = spec["model"], spec["seq_len"]
    if spec["family"] == "example":
        model = Llama(
            m["vocab_size"], m["dim"], m["n_layers"], m["n_heads"], m["n_kv_heads"], m["mlp_hidden"], seq
        )
        return model.to(device), lambda mod, x: mod(x)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**m, max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(device), lambda mod, x: mod(input_ids=x).logits


def _loss(logits_of: Callable[[Any, torch.Tensor], Any], model: torch.nn.Module, tokens: torch.Tensor,
          vocab: int, bf16: bool) -> torch.Tensor:
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = logits_of(model, tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(model: torch.nn.Module, step: dict[str, Any]) -> float:
    """Wall time of one forward + backward."""
    _sync(step["device"])
    t0 = time.perf_counter()
    _loss(step["logits_of"], model, step["tokens"], step["vocab"], step["bf16"]).backward()
    _sync(step["device"])
    elapsed = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return elapsed


def _shared_copy(base: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``base`` with its own modules (checkpointing wraps each block instance) but the very same
    parameters and buffers: one set of weights however many contenders (steps run one at a time, and every
    step ends with ``zero_grad(set_to_none=True)``)."""
    memo = {id(t): t for t in [*base.parameters(), *base.buffers()]}
    return copy.deepcopy(base, memo)


def _grads(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


# CUDA: kernels built on atomics (the embedding backward) sum in a run-dependent order, so even none's own
# gradients differ between two runs at the last bits (2.6e-11 on the H200's embedding); a configuration that
# computes something else differs by orders of magnitude more. CPU kernels here are deterministic: bitwise.
CUDA_GRAD_RTOL = 1e-5


def _grad_check(name: str, grads: list[torch.Tensor | None], ref: list[torch.Tensor | None],
                names: list[str]) -> dict[str, Any]:
    """Equality with ``none``'s gradients (bitwise on a CPU, within ``CUDA_GRAD_RTOL`` of each tensor's
    largest entry on CUDA); raises (the suite stops) on the first that differs."""
    worst = 0.0
    for pname, g, r in zip(names, grads, ref):
        cuda = g is not None and g.device.type == "cuda"
        if (g is None) != (r is None):
            ok = False
        elif g is None or r is None:
            ok = True
        elif cuda:
            scale = float(r.abs().max()) or 1.0
            worst = max(worst, float((g - r).abs().max()) / scale)
            ok = torch.allclose(g, r, rtol=0.0, atol=CUDA_GRAD_RTOL * scale)
        else:
            ok = torch.equal(g, r)
        if not ok:
            diff = None if g is None or r is None else float((g - r).abs().max())
            raise AssertionError(
                f"sac: contender {name!r}: the gradient of {pname} differs from none's (max abs "
                f"difference {diff}): this configuration does not compute what no checkpointing "
                "computes, so its figures would be meaningless."
            )
    cuda = any(g is not None and g.device.type == "cuda" for g in grads)
    compared = (f"max |diff| <= {CUDA_GRAD_RTOL:g} x the tensor's "
                "largest |entry| (CUDA atomics), every parameter"
                if cuda else "torch.equal, fp32, every parameter")
    return {"equal_to_none": True, "compared": compared, "params": len(names),
            "max_relative_difference": worst if cuda else 0.0}


def _prepare(name: str, opts: dict[str, Any], base: torch.nn.Module, budget: float | None,
             offload_min_bytes: int) -> tuple[torch.nn.Module, BudgetPlanner | None, Any]:
    model = _shared_copy(base)
    mode = opts.get("mode")
    if mode is not None:
        kwargs = {k: v for k, v in opts.items() if k not in ("mode", "memory_budget", "offload")}
        apply_activation_checkpointing(model, mode, **kwargs)
    stats = apply_activation_offload(model, min_bytes=offload_min_bytes) if opts.get("offload") else None
    planner = BudgetPlanner(model, budget) if mode == "budget" else None
    return model, planner, stats


@contextlib.contextmanager
def _planning(planner: BudgetPlanner | None) -> Iterator[None]:
    with planner.forward() if planner is not None else contextlib.nullcontext():
        yield


def _measure(name: str, opts: dict[str, Any], base: torch.nn.Module, step: dict[str, Any],
             budget: float | None, ref: dict[str, Any]) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Prepare one contender, run ``budget``'s planning steps, then measure one step: kept bytes (and
    offloaded bytes, peak CUDA), gradients against ``none``'s, FLOPs."""
    device, tokens, vocab, bf16 = step["device"], step["tokens"], step["vocab"], step["bf16"]
    logits_of = step["logits_of"]
    model, planner, stats = _prepare(name, opts, base, budget, step["offload_min_bytes"])
    for _ in range(2 if planner is not None else 0):  # profile, then measure the choice
        with _planning(planner):
            loss = _loss(logits_of, model, tokens, vocab, bf16)
        loss.backward()
        model.zero_grad(set_to_none=True)
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if gpu else 0
    offloaded_before = stats.bytes if stats is not None else 0
    kept = SavedBytes()
    with kept:
        loss = _loss(logits_of, model, tokens, vocab, bf16)
    kept_bytes = kept.alive(weights)
    offloaded = (stats.bytes - offloaded_before) if stats is not None else 0
    loss.backward()
    record: dict[str, Any] = {"kept_bytes": kept_bytes, "step_s": []}
    if stats is not None:
        record.update({"offloaded_bytes": offloaded, "kept_on_device_bytes": kept_bytes - offloaded,
                       "offload_min_bytes": stats.min_bytes, "offloaded_blocks": stats.blocks})
    if gpu:
        record["peak_cuda_bytes_over_weights"] = torch.cuda.max_memory_allocated(device) - before
    if bf16:  # the gradient check runs in fp32 (bitwise equality is the claim there)
        model.zero_grad(set_to_none=True)
        _loss(logits_of, model, tokens, vocab, False).backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    if name == "none":
        ref["grads"] = grads
        record["gradients"] = {"reference": True}
    else:
        record["gradients"] = _grad_check(name, grads, ref["grads"], [n for n, _ in model.named_parameters()])
    del grads
    flops = count_step_flops(lambda: _loss(logits_of, model, tokens, vocab, bf16).backward())
    model.zero_grad(set_to_none=True)
    record.update({"model_flops": flops.model, "hardware_flops": flops.hardware,
                   "recompute_overhead": flops.hardware / flops.model - 1})
    if planner is not None:
        report = planner.report()
        record["budget"] = {k: report.get(k) for k in ("memory_budget", "none_bytes", "floor_bytes",
                                                       "predicted_bytes", "measured_bytes", "recompute_flops",
                                                       "full_recompute_flops", "kept_calls")}
    return model, record


def _derive(case: dict[str, Any]) -> None:
    """Ratios against ``none`` and the budget figures, from the measured records."""
    recs = case["contenders"]
    base = recs.get("none")
    for rec in recs.values():
        rec["median_step_s"] = statistics.median(rec["step_s"])
    if not base:
        return
    steps = len(base["step_s"]) // max(1, case["reps"])
    for rec in recs.values():
        rec["rep_medians_s"] = [
            statistics.median(rec["step_s"][i : i + steps]) for i in range(0, len(rec["step_s"]), steps)
        ]
    base_extra = base["hardware_flops"] - base["model_flops"]
    for name, rec in recs.items():
        rec["kept_vs_none"] = rec["kept_bytes"] / base["kept_bytes"]
        device_kept = rec.get("kept_on_device_bytes", rec["kept_bytes"])
        rec["kept_on_device_vs_none"] = device_kept / base["kept_bytes"]
        # paired: each cycle's step against none's step of the same cycle, then the median over cycles
        rec["time_vs_none"] = statistics.median(t / b for t, b in zip(rec["step_s"], base["step_s"]))
        rec["median_vs_median_none"] = rec["median_step_s"] / base["median_step_s"]
        rec["time_overhead_pct"] = (rec["time_vs_none"] - 1) * 100
        rec["recompute_flops"] = rec["hardware_flops"] - rec["model_flops"] - base_extra
        saved_pct = (1 - rec["kept_on_device_vs_none"]) * 100
        rec["memory_saved_pct"] = saved_pct
        rec["memory_saved_pct_per_pct_time_lost"] = (
            saved_pct / rec["time_overhead_pct"] if name != "none" and rec["time_overhead_pct"] > 0 else None)
        b = rec.get("budget")
        if b:
            b["target_bytes"] = b["memory_budget"] * base["kept_bytes"]
            b["measured_over_target"] = rec["kept_bytes"] / b["target_bytes"]
            b["met"] = b["measured_over_target"] <= 1.05
            b["predicted_over_target"] = b["predicted_bytes"] / b["target_bytes"]
            b["planner_none_over_measured_none"] = b["none_bytes"] / base["kept_bytes"]
    comparisons = []
    for fixed in MATCHED:
        budget_name = f"budget@{fixed}"
        if fixed in recs and budget_name in recs:
            f, b = recs[fixed], recs[budget_name]
            comparisons.append({
                "fixed": fixed, "budget": budget_name, "kept_vs_none": [f["kept_vs_none"], b["kept_vs_none"]],
                "recompute_flops": [f["recompute_flops"], b["recompute_flops"]],
                "time_vs_none": [f["time_vs_none"], b["time_vs_none"]],
                "budget_recomputes_less": b["recompute_flops"] < f["recompute_flops"],
                "budget_recomputes_at_most": b["recompute_flops"] <= f["recompute_flops"],
                "budget_keeps_at_most": b["kept_bytes"] <= f["kept_bytes"] * 1.05})
    case["equal_bytes"] = comparisons


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, reps: int | None = None,
        steps: int | None = None, warmup: int | None = None, precision: str | None = None,
        contenders: list[str] | None = None, offload_min_bytes: int | None = None, note: str | None = None,
        threads: int | None = None, **_: Any) -> dict[str, Any]:
    gpu = torch.cuda.is_available()
    # SavedBytes.alive() runs gc.collect() (several times per budget contender): leave the objects of the
    # imports (torch, Lightning, transformers) out of every collection -- seconds per run on a small CPU
    from transformers import LlamaForCausalLM  # noqa: F401  (imported before the freeze)

    gc.freeze()
    # one intra-op thread: on a small shared CPU, spinning OpenMP threads make tiny ops 10-100x slower
    if not gpu:
        torch.set_num_threads(threads or 1)
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    sizes = common.pick(sizes, quick, ["tiny", "hf-llama-tiny"],
                        ["gpu-350m", "hf-llama-350m"] if gpu else ["example-384", "hf-llama-384"])
    reps = common.pick(reps, quick, 1, 3)
    steps = common.pick(steps, quick, 2, 6)
    warmup = common.pick(warmup, quick, 1, 2)
    offload_min_bytes = common.pick(offload_min_bytes, quick, 0, 1 << 20 if gpu else 0)
    precision = precision or ("bf16-mixed" if gpu else "32-true")
    bf16 = precision == "bf16-mixed"
    names = [n for n in CONTENDERS if not contenders or n in contenders]
    if contenders and not names:
        raise ValueError(f"--contenders {' '.join(contenders)}: none of them is in the sac suite. "
                         f"Fix: choose from {list(CONTENDERS)}.")
    config = {"contenders": {n: CONTENDERS[n] for n in names}, "sizes": {s: _spec(s) for s in sizes},
              "reps": reps, "steps": steps, "warmup": warmup, "precision": precision, "quick": quick,
              "offload_min_bytes": offload_min_bytes, "torch_threads": torch.get_num_threads(),
              "kept_bytes": "storages created in forward still alive "
                            "after it (weights excluded), on a step after "
                            "budget's two planning steps",
              "recompute_flops": "hardware - model FLOPs of one step "
                                 "(count_step_flops) less none's (the attention "
                                 "scores every SDPA backward recomputes)",
              "memory_saved_pct_per_pct_time_lost": "(1 - kept on device / none) x "
                                                    "100 over the step-time overhead "
                                                    "in %; None where no step time is lost",
              "budget_met": "kept bytes <= memory_budget x none's kept bytes x 1.05",
              "budget_at": "budget@<mode>: memory_budget = <mode>'s "
                           "kept bytes / none's, rounded up at 1e-6 (the "
                           "planner compares floats: exactly the fraction can miss the same set by rounding)",
              "step": "forward + backward of one batch, one process; "
                      "after warmup steps each, the contenders take "
                      "one step each in turn (reps x steps cycles, the starting contender rotating)",
              "time_vs_none": "median over cycles of a contender's step time / none's in the same cycle"}
    result = common.header("sac", config)
    if note:
        result["note"] = f"{result['note']} {note}"
    cases = []
    for size in sizes:
        spec = _spec(size)
        base, logits_of = _build(spec, device)
        vocab = spec["model"]["vocab_size"]
        tokens = torch.randint(0, vocab, (spec["batch"], spec["seq_len"] + 1), device=device,
                               generator=torch.Generator(device=device).manual_seed(1))
        step = {"device": device, "tokens": tokens, "vocab": vocab, "bf16": bf16, "logits_of": logits_of,
                "offload_min_bytes": offload_min_bytes}
        case: dict[str, Any] = {"size": size, "family": spec["family"],
                                "params": sum(p.numel() for p in base.parameters()),
                                "batch": spec["batch"], "seq_len": spec["seq_len"], "reps": reps,
                                "contenders": {}, "skipped": {}, "failed": {}}
        models, ref = {}, {}
        for name in names:
            opts = CONTENDERS[name]
            budget = opts.get("memory_budget")
            if isinstance(budget, str):
                match = budget.split(":", 1)[1]
                if match not in case["contenders"] or "none" not in case["contenders"]:
                    case["skipped"][name] = f"needs the contenders none and {match} measured first"
                    continue
                # rounded up at 1e-6 of none: exactly the fraction can miss the very same set by float
                # rounding
                budget = math.ceil(1e6 * case["contenders"][match]["kept_bytes"]
                                   / case["contenders"]["none"]["kept_bytes"]) / 1e6
            if name != "none" and "grads" not in ref:
                raise ValueError(
                    f"sac: contender {name!r} is compared with none's gradients. Fix: keep none in "
                    "--contenders."
                )
            try:
                models[name], case["contenders"][name] = _measure(name, opts, base, step, budget, ref)
            except BudgetNotMetError as err:
                case["skipped"][name] = str(err)
            except AssertionError:
                raise  # gradients differ from none's: stop, nothing here may be reported as measured
            # a configuration that does not run is reported, the others still measured
            except Exception as err:
                case["failed"][name] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        ref.clear()
        for model in models.values():
            for _ in range(warmup):
                _timed_step(model, step)
        order = list(models)
        # interleaved step by step (A B C, B C A, ...): a slow phase hits all alike
        for cycle in range(reps * steps):
            for name in order[cycle % len(order):] + order[:cycle % len(order)]:
                case["contenders"][name]["step_s"].append(_timed_step(models[name], step))
        _derive(case)
        cases.append(case)
        del models, base
        gc.collect()
    result["cases"] = cases
    result["summary"] = summary(cases)
    json_path = common.write_result("sac", result, out_dir)
    png_path = plot(result, json_path.with_suffix(".png"))
    result.update({"json_path": str(json_path), "png_path": str(png_path)})
    print("\n".join(markdown(result)))
    gc.unfreeze()
    return result


def summary(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets: each ``budget`` met (measured / target <= 1.05), and ``budget`` against the fixed mode
    with the same kept bytes (recomputed GFLOP, fixed -> budget)."""
    rows: list[dict[str, Any]] = []
    for c in cases:
        for name, rec in c["contenders"].items():
            b = rec.get("budget")
            if b:
                rows.append({"size": c["size"],
                             "ratio": f"{name}: kept / target ({b['memory_budget']:.3f} x none)",
                             "value": b["measured_over_target"], "target": 1.05, "met": b["met"]})
        for cmp in c.get("equal_bytes", []):
            f, b = (x / 1e9 for x in cmp["recompute_flops"])
            rows.append({"size": c["size"], "ratio": f"recompute GFLOP at kept {cmp['kept_vs_none'][0]:.3f}: "
                                                     f"{cmp['fixed']} -> {cmp['budget']}",
                         "value": f"{f:.3g} -> {b:.3g}", "met": cmp["budget_recomputes_at_most"]})
        for name, reason in c.get("skipped", {}).items():
            rows.append(
                {"size": c["size"], "ratio": f"{name}: skipped", "value": reason.split(". Fix")[0][-120:]}
            )
        for name, error in c.get("failed", {}).items():
            rows.append({"size": c["size"], "ratio": f"{name}: FAILED", "value": error[:160], "met": False})
    return rows


def markdown(result: dict[str, Any]) -> list[str]:
    """Per model: one row per contender (the suite's table, printed by the suite and rendered on the docs
    site)."""
    out: list[str] = []
    for c in result.get("cases", []):
        recs = c["contenders"]
        out += [f"`{c['size']}` ({c['family']}, {c['params'] / 1e6:.2f}M "
                f"params, batch {c['batch']} x {c['seq_len']} "
                f"tokens; kept bytes of `none`: {recs['none']['kept_bytes'] / 2**20:.1f} MiB)"
                    if "none" in recs
                else f"`{c['size']}`", "",
                "| contender | kept MiB | kept / none | on device / none | step ms | step time vs none | "
                "recompute GFLOP | % memory saved per % time lost "
                "| budget: target -> predicted, measured / target | "
                "grads = none |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for name, rec in recs.items():
            b = rec.get("budget")
            per = rec.get("memory_saved_pct_per_pct_time_lost")
            budget_cell = (
                (
                    f"{b['memory_budget']:.3f} -> {b['predicted_bytes'] / max(b['none_bytes'], 1):.3f}, "
                    f"**{b['measured_over_target']:.3f}**{'' if b['met'] else ' (missed)'}"
                )
                if b
                else "-"
            )
            grads = rec.get("gradients", {})
            grads_cell = "reference" if grads.get("reference") else (
                "bitwise" if grads.get("equal_to_none") else "?")
            out.append(
                f"| `{name}` | {rec['kept_bytes'] / 2**20:.1f} | {rec.get('kept_vs_none', 0):.3f} | "
                f"{rec.get('kept_on_device_vs_none', 0):.3f} | {rec['median_step_s'] * 1e3:.1f} | "
                f"{rec.get('time_overhead_pct', 0):+.1f}% | {rec.get('recompute_flops', 0) / 1e9:.3g} | "
                f"{'-' if per is None else f'{per:.2f}'} | {budget_cell} | "
                f"{grads_cell} |")
        out.append("")
        for cmp in c.get("equal_bytes", []):
            f, b = (x / 1e9 for x in cmp["recompute_flops"])
            out.append(
                f"- equal bytes: `{cmp['fixed']}` keeps {cmp['kept_vs_none'][0]:.3f} and recomputes {f:.3g} "
                f"GFLOP; `{cmp['budget']}` keeps {cmp['kept_vs_none'][1]:.3f} and recomputes {b:.3g} GFLOP "
                f"(step time {cmp['time_vs_none'][0]:.3f} vs {cmp['time_vs_none'][1]:.3f} of none)."
            )
        for name, reason in c.get("skipped", {}).items():
            out.append(f"- `{name}` skipped: {reason}")
        for name, error in c.get("failed", {}).items():
            out.append(f"- `{name}` **failed**: {error}")
        out.append("")
    return out


def plot(result: dict[str, Any], path: Path) -> Path:
    plt = common._pyplot()
    cases = result["cases"]
    fig, axes = plt.subplots(2, len(cases), figsize=(6.5 * len(cases), 9), squeeze=False)
    for col, case in enumerate(cases):
        recs = case["contenders"]
        ax = axes[0][col]
        for i, (name, rec) in enumerate(recs.items()):
            if "kept_vs_none" not in rec:
                continue
            budget, offload = name.startswith("budget"), "offloaded_bytes" in rec
            color = "tab:red" if budget else ("tab:green" if offload else "tab:blue")
            y = rec["kept_on_device_vs_none"]
            ax.scatter([rec["time_overhead_pct"]], [y], s=40, color=color, marker="s" if offload else "o",
                       facecolors="none" if offload else color, zorder=3)
            label = name
            if budget:
                label += f" (target {rec['budget']['memory_budget']:.2f})"
            if offload:
                label += " [device bytes]"
            ax.annotate(label, (rec["time_overhead_pct"], y), xytext=(4, 3 - 9 * (i % 2)),
                        textcoords="offset points", fontsize=7,
                        color=color)
        ax.axvline(0, color="grey", lw=0.5)
        ax.set_xlabel("step time over none (%), median")
        ax.set_ylabel("activation bytes kept for backward / none")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{case['size']} ({case['family']}, "
                     f"{case['params'] / 1e6:.1f}M params, batch {case['batch']}x"
                     f"{case['seq_len']})", fontsize=9)
        ax = axes[1][col]
        names = [n for n in recs if "recompute_flops" in recs[n]]
        ax.bar(names, [recs[n]["recompute_flops"] / 1e9 for n in names],
               color=["tab:red" if n.startswith("budget") else "tab:blue" for n in names])
        ax.set_ylabel("recomputed GFLOP per step (hardware - model, less none's)")
        ax.tick_params(axis="x", labelrotation=35, labelsize=7)
    fig.suptitle(f"activation checkpointing, budget and offload on {result['device_name']} "
                 f"({result['config']['precision']}); offload: "
                 "bytes left on the device (host copies excluded)",
                 fontsize=9)
    return common.save_figure(fig, path)


def _options(parser: Any) -> None:
    parser.add_argument("--offload-min-bytes", type=int, default=None,
                        help="saved tensors smaller than this stay on the "
                             "device (default: 1 MiB on GPUs, 0 on CPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU (default 1)")
    parser.add_argument("--note", default=None, help="appended to the result's note (e.g. what else ran)")


if __name__ == "__main__":
    common.suite_main(run, __doc__.splitlines()[0], _options)
