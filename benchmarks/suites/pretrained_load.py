"""pretrained_load suite: peak host memory each rank adds while a pretrained Hugging Face model gets onto the
ranks.

    python benchmarks/run.py pretrained_load   # or: python benchmarks/suites/pretrained_load.py [--quick]

The suite writes a ``save_pretrained`` folder itself (a ``LlamaForCausalLM`` from a random config, fp32
safetensors; nothing is downloaded) and computes, with plain ``transformers`` on the model it saved, the loss
of a fixed reference batch. Contenders, on N = 2 and 4 ranks, interleaved within each case
(``benchmarks/workers/pretrained_load.py`` says exactly where each window opens and closes):

  fsdp2_configure_model  ours: ``from_pretrained`` in ``configure_model`` under ``fsdp2`` (meta build, shard,
                         each rank reads only its own shards of the safetensors)
  fsdp2_yaml             ours: ``from_config`` in ``configure_model`` + the strategy option ``pretrained=DIR``
  init_from_pretrained   baseline: ``from_pretrained`` in the LightningModule's ``__init__`` under Lightning's
                         ``ddp`` (what works today; the full model on every rank)
  transformers_single    ``AutoModelForCausalLM.from_pretrained`` in one plain process: the model-size
                         reference

Per rank: the peak RSS growth from a point before the model exists to ``on_fit_start`` (VmHWM after resetting
it: anonymous and file-backed pages together), and the peak of its anonymous part (sampled every 2 ms). The
two differ by the pages of memory-mapped files: safetensors are read through ``mmap``, and the kernel counts a
mapped page-cache page in the RSS of every process that maps it -- although N ranks reading one file share one
copy in the page cache (clean, reclaimable), and on this kernel a touched page maps its whole (large) folio,
so a rank that reads 1/N of a tensor may be charged more of the file. The anonymous peak is the memory the
rank adds privately. For both: the ratio peak / (model / N), and the target

    peak growth <= model / N + largest tensor + fixed overhead

where the fixed overhead of a route at N ranks is that route's own measured worst-rank peak growth on the
``overhead`` model: the same architecture with the same 8 layers (the same tensors, the same number of DCP
read requests, the same Lightning / FSDP set-up) at 0.1% of the bytes -- what the route costs whatever the
model's size. Every job also checks that the loaded weights are the pretrained ones (the reference-batch loss
on every rank equals the suite's within ``TOLERANCE``), so a broken load fails instead of looking cheap.
Memory is deterministic: one round.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

SUITE = "pretrained_load"
CONTENDERS = ("fsdp2_configure_model", "fsdp2_yaml", "init_from_pretrained", "transformers_single")
OURS = ("fsdp2_configure_model", "fsdp2_yaml")
BASELINE = "init_from_pretrained"
SINGLE = "transformers_single"
OVERHEAD_SIZE = "overhead"
REF_SEED, REF_BATCH, SEQ_LEN = 1234, 2, 32
TOLERANCE = 1e-5  # fp32: the bound between a sharded load and single-process transformers
_LAYERS = 8
# LlamaConfig keyword arguments. All share the layer count, so the overhead model has the tensors of the
# others.
SIZES: dict[str, dict[str, Any]] = {
    OVERHEAD_SIZE: {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": _LAYERS,
                    "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 128},
    "quick-6m": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": _LAYERS,
                 "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 2048},
    "llama-70m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": _LAYERS,
                  "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 8192},
}


def _size(name: str) -> dict[str, Any]:
    if name not in SIZES:
        raise ValueError(
            f"--sizes: unknown size {name!r} for the {SUITE} suite. Fix: choose from {sorted(SIZES)}."
        )
    return SIZES[name]


def save_model(size: str, folder: Path) -> dict[str, Any]:
    """Write the size's random Llama to ``folder`` (``save_pretrained``); its bytes and the reference loss."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**_size(size), max_position_embeddings=SEQ_LEN * 2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    # what the file holds, each tensor once
    tensors = {id(t): t for t in model.state_dict().values()}.values()
    sizes = [t.numel() * t.element_size() for t in tensors]
    ref = torch.randint(
        0, config.vocab_size, (REF_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(REF_SEED)
    )
    with torch.no_grad():
        loss = float(model(input_ids=ref, labels=ref).loss)
    (folder.parent / f"{folder.name}-ref.json").write_text(json.dumps(
        {"input_ids": ref.tolist(), "loss": loss, "tolerance": TOLERANCE, "vocab_size": config.vocab_size}))
    return {"params": sum(p.numel() for p in model.parameters()), "model_bytes": sum(sizes),
            "largest_tensor_bytes": max(sizes), "tensors": len(sizes), "ref_loss": loss,
            "file_bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors")), "config": _size(size)}


def _worst(record: dict[str, Any], key: str) -> int | None:
    values = [
        r["memory"][key] for r in record.get("per_rank") or [] if r.get("memory", {}).get(key) is not None
    ]
    return max(values) if values else None


def _summarise(run: Any) -> dict[str, Any]:
    if not isinstance(run, dict):
        return {"errors": [str(run)]}
    per_rank = run["per_rank"]
    keys = ("peak_growth_bytes", "peak_anon_growth_bytes", "peak_file_growth_bytes", "end_growth_bytes")
    return {"per_rank": per_rank, "weights_ok": run["weights_ok"],
            "ref_loss_per_rank": [r["ref_loss"] for r in per_rank],
            "train_loss_per_rank": [r["train_loss"] for r in per_rank],
            "worst_rank": {k: _worst(run, k) for k in keys},
            "load_s": max(r["memory"]["load_s"] for r in per_rank), "errors": []}


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, ranks: list[int] | None = None,
        reps: int | None = None, contenders: list[str] | None = None,
        show_progress: bool = True) -> dict[str, Any]:
    sizes = common.pick(sizes, quick, ["quick-6m"], ["llama-70m"])
    for s in sizes:
        _size(s)
    ranks = common.pick(ranks, quick, [2], [2, 4])
    reps = common.pick(reps, quick, 1, 1)  # bytes are deterministic: one round is enough
    names = [c for c in CONTENDERS if contenders is None or c in contenders]
    if not names:
        raise ValueError(f"--contenders {' '.join(contenders or [])}: none of them is in the {SUITE} suite. "
                         f"Fix: choose from {list(CONTENDERS)}.")
    if any(n < 1 for n in ranks):
        raise ValueError(f"--ranks {ranks}: process counts must be positive. Fix: e.g. --ranks 2 4.")
    all_sizes = [OVERHEAD_SIZE, *[s for s in sizes if s != OVERHEAD_SIZE]]
    config = {
        "sizes": {s: _size(s) for s in all_sizes}, "ranks": ranks, "reps": reps, "quick": quick,
        "precision": "32-true (fp32 file into fp32 parameters)", "overhead_size": OVERHEAD_SIZE,
        "contenders": {n: {"role": "ours" if n in OURS else "baseline" if n == BASELINE else "reference",
                           "worker": "pretrained_load.py"} for n in names},
        "measured": "per rank: VmHWM at on_fit_start minus VmRSS at "
                    "a fixed point before the model exists (the peak "
                    "counter reset there via /proc/self/clear_refs); "
                    "the Lightning routes open the window in a "
                    "Callback's setup (before configure_model and "
                    "the strategy's setup), init_from_pretrained and "
                    "transformers_single just before the model is "
                    "constructed. Anonymous / file-backed peaks are "
                    "sampled every 2 ms (lower bounds). Everything "
                    "the routes import is imported before the window.",
        "target": "worst-rank peak growth <= model_bytes/N + "
                  "largest_tensor_bytes + fixed overhead, for the RSS peak "
                  "(VmHWM: anonymous + mapped file pages, shared "
                  "page cache counted in every rank) and for the "
                  "anonymous peak (private to the rank) separately",
        "fixed_overhead": "the same route's worst-rank peak growth at "
                          f"the same N on the {OVERHEAD_SIZE!r} model "
                          f"(same {_LAYERS} layers and tensors, ~0.1% "
                          "of the bytes): what the route costs whatever "
                          "the model's size",
        "weights_check": "every rank's loss on a fixed reference batch "
                         "equals the suite's plain-transformers loss of "
                         f"the saved model within {TOLERANCE} (else the job fails)",
        "note": common.CPU_NOTE + " Memory figures do not depend on the machine's load.",
    }
    result = common.header(SUITE, config)
    cases: list[dict[str, Any]] = []
    plan = [(s, n) for s in all_sizes for n in ranks]
    jobs = sum(len([c for c in names if c != SINGLE]) for _ in plan) + (
        len(all_sizes) if SINGLE in names else 0
    )
    bar = common.progress(jobs * reps, SUITE) if show_progress else None
    try:
        with tempfile.TemporaryDirectory(prefix="pretrained-load-") as tmp:
            models = {s: save_model(s, Path(tmp) / s) for s in all_sizes}
            for size in all_sizes:
                model = models[size]
                case_plan = ([(1, [SINGLE])] if SINGLE in names else []) + [
                    (n, [c for c in names if c != SINGLE]) for n in ranks]
                for n, active in case_plan:
                    if not active:
                        continue

                    def run_one(name: str, rep: int, size: str = size, n: int = n) -> dict[str, Any]:
                        args = ["--contender", name, "--folder", str(Path(tmp) / size),
                                "--ref", str(Path(tmp) / f"{size}-ref.json")]
                        return common.run_worker("pretrained_load.py", n, args, timeout=900)

                    runs = common.interleave(active, reps, run_one, bar)
                    per = {name: _summarise(rs[-1]) for name, rs in runs.items()}
                    cases.append({"size": size, "ranks": n, "params": model["params"], "contenders": per,
                                  "failures": runs.failures})
    finally:
        if bar is not None:
            bar.close()
    result["models"] = {s: {k: v for k, v in m.items() if k != "config"} for s, m in models.items()}
    _targets(result, cases)
    result["cases"] = cases
    path = common.write_result(SUITE, result, Path(out_dir))
    result["json_path"] = str(path)
    result["png_path"] = str(plot(result, path.with_suffix(".png")))
    return result


MEASURES = {"rss": ("peak_growth_bytes", "peak RSS"), "anon": ("peak_anon_growth_bytes", "peak anonymous")}


def _targets(result: dict[str, Any], cases: list[dict[str, Any]]) -> None:
    """Per case and contender, for the RSS peak (VmHWM: anonymous + file-backed) and the anonymous peak: the
    ratio to model/N, the budget model/N + largest tensor + that route's fixed overhead, met or not; the
    summary rows."""
    overhead = {(c["ranks"], name, m): rec["worst_rank"][key]
                for c in cases if c["size"] == OVERHEAD_SIZE
                for name, rec in c["contenders"].items() if rec.get("worst_rank")
                for m, (key, _) in MEASURES.items()}
    summary = []
    for case in cases:
        model = result["models"][case["size"]]
        n = case["ranks"]
        share = model["model_bytes"] / n
        for name, rec in case["contenders"].items():
            if not rec.get("worst_rank"):
                continue
            rec["model_share_bytes"] = share
            rec["targets"] = {}
            for m, (key, label) in MEASURES.items():
                peak, fixed = rec["worst_rank"].get(key), overhead.get((n, name, m))
                if peak is None:
                    continue
                entry: dict[str, Any] = {"peak_bytes": peak, "ratio_to_share": peak / share,
                                         "ratio_to_model": peak / model["model_bytes"],
                                         "fixed_overhead_bytes": fixed, "budget_bytes": None, "met": None}
                rec["targets"][m] = entry
                if case["size"] == OVERHEAD_SIZE or fixed is None or name == SINGLE:
                    # the overhead runs define the overhead; the single process is the size reference
                    continue
                entry["budget_bytes"] = share + model["largest_tensor_bytes"] + fixed
                entry["met"] = peak <= entry["budget_bytes"]
                summary.append({"size": case["size"], "ranks": n, "ratio": f"{name}: {label} / (model/N)",
                                "value": entry["ratio_to_share"], "target": entry["budget_bytes"] / share,
                                "met": entry["met"],
                                "peak_MiB": round(peak / 2**20, 1),
                                "budget_MiB": round(entry["budget_bytes"] / 2**20, 1)})
    result["summary"] = summary


def plot(result: dict[str, Any], path: Path) -> Path:
    """Per model size: worst-rank peak growth per route vs ranks, stacked anon / file-backed, with model/N and
    the budget drawn as lines."""
    plt = common._pyplot()
    sizes = [s for s in dict.fromkeys(c["size"] for c in result["cases"]) if s != OVERHEAD_SIZE] or [
        OVERHEAD_SIZE
    ]
    fig, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes), 4.6), squeeze=False)
    names = list(result["config"]["contenders"])
    for col, size in enumerate(sizes):
        ax = axes[0][col]
        model = result["models"][size]
        cases = [c for c in result["cases"] if c["size"] == size]
        width = 0.8 / max(1, len(names))
        labelled: set[str] = set()
        for i, name in enumerate(names):
            for j, case in enumerate(cases):
                rec = case["contenders"].get(name)
                if not rec or not rec.get("worst_rank") or rec["worst_rank"]["peak_growth_bytes"] is None:
                    continue
                worst = rec["worst_rank"]
                x = j + (i - (len(names) - 1) / 2) * width
                total = worst["peak_growth_bytes"] / 2**20
                ax.bar(x, total, width=width, color=f"C{i}", label=None if name in labelled else name)
                labelled.add(name)
                used = [r["memory"]["marks"]["after_forward"]["peak_growth_bytes"] for r in rec["per_rank"]
                        if "after_forward" in r["memory"].get("marks", {})]
                if used:
                    ax.scatter([x], [max(used) / 2**20], marker="x", color="black", zorder=3,
                               label=f"{name} after a forward (every weight read)")
                anon = min(worst["peak_anon_growth_bytes"] / 2**20, total)
                ax.bar(x, anon, width=width, color="none", edgecolor="black", hatch="//", linewidth=0.5)
                budget = (rec.get("targets", {}).get("anon") or {}).get("budget_bytes")
                if budget:
                    ax.hlines(budget / 2**20, x - width / 2, x + width / 2, colors="red", linewidth=1.5)
        for j, case in enumerate(cases):
            ax.hlines(model["model_bytes"] / case["ranks"] / 2**20, j - 0.45, j + 0.45, colors="grey",
                      linestyles=":")
        ax.set_xticks(range(len(cases)), [f"{c['ranks']} rank{'s' if c['ranks'] > 1 else ''}" for c in cases])
        ax.set_ylabel("worst-rank peak RSS growth (MiB)")
        ax.set_title(f"{size}: {model['params'] / 1e6:.1f}M params, "
                     f"{model['model_bytes'] / 2**20:.0f} MiB fp32 "
                     f"(largest tensor {model['largest_tensor_bytes'] / 2**20:.0f} MiB)", fontsize=9)
        handles, labels = ax.get_legend_handles_labels()
        seen = dict(zip(labels, handles, strict=False))
        ax.legend(seen.values(), seen.keys(), fontsize=7)
    fig.suptitle(
        "pretrained load: peak RSS growth per rank (bar), "
        "its anonymous part (hatched),\nthe budget model/N + "
        f"largest tensor + anonymous overhead (red), model/N (dotted); {result['device_name']}",
        fontsize=8,
    )
    return common.save_figure(fig, path)


if __name__ == "__main__":
    common.suite_main(run, __doc__ or "")
