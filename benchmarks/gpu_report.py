"""The report side of ``benchmarks/gpu.py``: the printed table, the markdown tables (``--report``) and the
PNGs.

Pure functions of a result dict (what ``gpu.py`` writes to ``gpu-<device>.json``); no measurement here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _fmt_bytes(value: float | None) -> str:
    return (
        "-" if value is None else f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"
    )


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def table(result: dict[str, Any], sections: Sequence[str]) -> str:
    """The short plain-text table printed at the end."""
    sec = result["sections"]
    lines = [
        f"gpu harness on {result['device_name']} (torch {result['versions'].get('torch')}, lightning "
        f"{result['versions'].get('lightning')}, {result['config']['precision']}"
        f"{', --quick: CPU smoke, figures say nothing about speed' if result['config']['quick'] else ''})"
    ]
    row = "  {:<12} {:<28} {:>9} {:>10} {:>7} {:>7} {:>7} {:>11}"
    lines.append(row.format("section", "run", "step ms", "tokens/s", "MFU", "HFU", "tt-MFU", "peak mem"))
    for name in ("contenders", "compile"):
        s = sec.get(name)
        if not s:
            continue
        if s.get("status") == "failed" and "contenders" not in s:
            lines.append(f"  {name:<12} FAILED: {(s.get('error_tail') or ['?'])[-1][:90]}")
            continue
        for cname, rec in s.get("contenders", {}).items():
            if "skipped" in rec:
                lines.append(f"  {name:<12} {cname:<28} skipped: {rec['skipped'][:70]}")
                continue
            if rec.get("errors") and not rec.get("median_s"):
                lines.append(f"  {name:<12} {cname:<28} FAILED: {rec['errors'][-1].splitlines()[-1][:70]}")
                continue
            mon = rec.get("mfu_monitor") or {}
            lines.append(row.format(name, cname, _fmt(rec["median_s"] and rec["median_s"] * 1e3, ".1f"),
                                    _fmt(rec.get("tokens_per_s"), ".0f"), _fmt(mon.get("mfu")),
                                    _fmt(mon.get("hfu")), _fmt(rec["torchtitan"].get("mfu")),
                                    _fmt_bytes(rec.get("peak_memory_bytes"))))
        for rname, ratio in s.get("ratios", {}).items():
            verdict = "" if ratio.get("met") is None else ("ok" if ratio["met"] else "MISSED")
            target = (
                ""
                if ratio.get("target") is None
                else f"(target {ratio.get('direction', '<=')} {ratio['target']})"
            )
            lines.append(f"  {name:<12} {rname:<44} {_fmt(ratio.get('value'))} {target} {verdict}")
    s = sec.get("sac")
    if s:
        if s.get("status") == "failed":
            lines.append(f"  {'sac':<12} FAILED: {(s.get('error_tail') or ['?'])[-1][:90]}")
        for mode, rec in s.get("modes", {}).items():
            mem = rec.get("peak_cuda_bytes_over_weights")
            lines.append(row.format("sac", mode, _fmt(rec["median_step_s"] * 1e3, ".1f"),
                                    _fmt(rec["tokens_per_s"], ".0f"),
                                    "", "", "", _fmt_bytes(mem if mem is not None else rec["kept_bytes"])))
    s = sec.get("memory")
    if s:
        if s.get("status") == "failed":
            lines.append(f"  {'memory':<12} FAILED: {(s.get('error_tail') or ['?'])[-1][:90]}")
        for key, rec in s.get("strategies", {}).items():
            if "skipped" in rec:
                continue
            lines.append(row.format("memory", key,
                                    _fmt(rec.get("median_step_s") and rec["median_step_s"] * 1e3, ".1f"),
                                    "", "", "", "", _fmt_bytes(rec.get("peak_memory_bytes"))))
        fit = s.get("largest_fitting", {})
        if "skipped" in fit:
            lines.append(f"  {'memory':<12} largest fitting size: skipped ({fit['skipped'][:70]})")
        else:
            for key in ("no_offload", "cpu_offload"):
                f = fit.get(key, {})
                lines.append(f"  {'memory':<12} largest fitting, {key}: {f.get('largest')}"
                             f"{' (inconclusive)' if f.get('inconclusive') else ''}")
    s = sec.get("smoke")
    if s:
        runs = s.get("runs", {})
        ok = [n for n, r in runs.items() if r.get("status") == "ok"]
        lines.append(
            f"  {'smoke':<12} {len(ok)}/{len(runs)} ok"
            + (f"; failed: {', '.join(s.get('failed_runs', []))}" if s.get("failed_runs") else "")
        )
        if s.get("status") == "failed" and not runs:
            lines.append(f"  {'smoke':<12} FAILED: {(s.get('error_tail') or ['?'])[-1][:90]}")
        st = runs.get("straggler", {})
        if st.get("max_abs_relative_difference") is not None:
            lines.append(
                f"  {'smoke':<12} straggler detector vs hand-measured ({st.get('timing', '')[:40]}): "
                f"max |diff| {st['max_abs_relative_difference']:.2%}"
            )
        mp = runs.get("mfu_peak", {})
        if mp:
            lines.append(f"  {'smoke':<12} peak lookup {mp.get('device_name')!r}: key {mp.get('table_key')}, "
                         f"bf16 {_fmt(mp.get('table_peaks', {}).get('bf16'), '.4g')}")
    for name in sections:
        s = sec.get(name)
        if s is None:
            lines.append(f"  {name:<12} not run in this result")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """Markdown tables of a result, printed by ``--report``."""
    sec, cfg = result["sections"], result["config"]
    out = [f"**{result['device_name']}**, torch {result['versions'].get('torch')}, lightning "
           f"{result['versions'].get('lightning')}, {cfg['precision']}, model {cfg['model_source']} "
           f"({_fmt_params(cfg['params']['total'])} params), "
           f"batch {cfg['batch_per_device']} x {cfg['seq_len']}, "
           f"`{result.get('command', '')}`, {result.get('created_utc')}", ""]
    out += [
        "| run | step (ms) | tokens/s | MFU (MFUMonitor) | HFU | MFU (torchtitan formula) | peak memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("contenders", "compile"):
        for cname, rec in (sec.get(name) or {}).get("contenders", {}).items():
            if "skipped" in rec or not rec.get("median_s"):
                reason = (
                    rec.get("skipped")
                    or "; ".join(e.splitlines()[-1] for e in rec.get("errors") or [])
                    or "failed"
                )
                out.append(f"| {cname} | not measured: {reason[:120]} | | | | | |")
                continue
            mon = rec.get("mfu_monitor") or {}
            out.append(f"| {cname} | {rec['median_s'] * 1e3:.1f} | {_fmt(rec.get('tokens_per_s'), '.0f')} | "
                       f"{_fmt(mon.get('mfu'))} | {_fmt(mon.get('hfu'))} "
                       f"| {_fmt(rec['torchtitan'].get('mfu'))} | "
                       f"{_fmt_bytes(rec.get('peak_memory_bytes'))} |")
    ratios = [
        (r, v)
        for name in ("contenders", "compile")
        for r, v in (sec.get(name) or {}).get("ratios", {}).items()
    ]
    if ratios:
        out += ["", "| ratio | value | target |", "|---|---|---|"]
        for r, v in ratios:
            met = "" if v.get("met") is None else (" met" if v["met"] else " **missed**")
            target = "-" if v.get("target") is None else f"{v.get('direction', '<=')} {v['target']}{met}"
            out.append(f"| {r} | {_fmt(v.get('value'))} | {target} |")
    sac = (sec.get("sac") or {}).get("modes", {})
    if sac:
        out += ["", "| SAC mode | step (ms) | tokens/s | peak CUDA over weights | vs none (memory / time) |",
                "|---|---|---|---|---|"]
        for mode, rec in sac.items():
            out.append(f"| {mode} | {rec['median_step_s'] * 1e3:.1f} | {_fmt(rec['tokens_per_s'], '.0f')} | "
                       f"{_fmt_bytes(rec.get('peak_cuda_bytes_over_weights'))} | "
                       f"{_fmt(rec.get('peak_vs_none') or rec.get('kept_vs_none'), '.2f')} / "
                       f"{_fmt(rec.get('time_vs_none'), '.2f')} |")
    mem = sec.get("memory") or {}
    if mem.get("strategies"):
        out += ["", "| strategy | peak memory | step (ms) |", "|---|---|---|"]
        for key, rec in mem["strategies"].items():
            if "skipped" not in rec:
                out.append(f"| {key} | {_fmt_bytes(rec.get('peak_memory_bytes'))} | "
                           f"{_fmt(rec.get('median_step_s') and rec['median_step_s'] * 1e3, '.1f')} |")
        fit = mem.get("largest_fitting", {})
        if "skipped" not in fit:
            out.append("")
            out.append(f"Largest fitting size (fsdp2, one device): without offload "
                       f"{fit.get('no_offload', {}).get('largest')}, with cpu_offload "
                       f"{fit.get('cpu_offload', {}).get('largest')}.")
    smoke = (sec.get("smoke") or {}).get("runs", {})
    if smoke:
        out += ["", "Smoke runs: " + ", ".join(f"`{n}` {r.get('status')}" for n, r in smoke.items())]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- plots
def plot(result: dict[str, Any], path: Path) -> Path:
    """Step-time bars (round medians as dots), MFU by both definitions, peak memory per strategy."""
    import common

    plt = common._pyplot()
    sec = result["sections"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    bars = [(f"{s}: {n}", r) for s in ("contenders", "compile")
            for n, r in (sec.get(s) or {}).get("contenders", {}).items() if r.get("median_s")]
    ax = axes[0]
    for i, (label, rec) in enumerate(bars):
        ax.bar(i, rec["median_s"] * 1e3, color="C1" if label.startswith("compile") else "C0")
        dots = [m * 1e3 for m in rec["rep_medians_s"] if m is not None]
        ax.scatter([i] * len(dots), dots, s=10, color="black", zorder=3)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("median step time (ms); dots: round medians")
    ax.set_title("step time, world size 1")
    ax = axes[1]
    mfu = [(label, rec) for label, rec in bars if rec.get("torchtitan", {}).get("tflops")]
    keys = (("mfu_monitor", "mfu", "MFU (MFUMonitor)"), ("mfu_monitor", "hfu", "HFU (MFUMonitor)"),
            ("torchtitan", "mfu", "MFU (torchtitan formula)"))
    for k, (group, key, label) in enumerate(keys):
        xs = [i + (k - 1) * 0.27 for i in range(len(mfu))]
        ax.bar(xs, [((rec.get(group) or {}).get(key) or 0) * 100 for _, rec in mfu], width=0.27, label=label)
    ax.set_xticks(range(len(mfu)), [m[0] for m in mfu], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("% of dense peak" + (" (nominal peak: --quick)" if result["config"]["quick"] else ""))
    ax.set_title("MFU / HFU")
    ax.legend(fontsize=7)
    ax = axes[2]
    rows = [(k, r) for k, r in ((sec.get("memory") or {}).get("strategies") or {}).items()
            if r.get("peak_memory_bytes")]
    ax.bar(range(len(rows)), [r["peak_memory_bytes"] / 2**30 for _, r in rows],
           color=["C2" if "offload" in k else "C0" for k, _ in rows])
    ax.set_xticks(range(len(rows)), [k for k, _ in rows], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("peak CUDA memory (GiB)" if result["device"] != "cpu" else "peak RSS of the process (GiB)")
    ax.set_title("memory per strategy (green: cpu_offload)")
    cfg = result["config"]
    fig.suptitle(f"gpu harness on {result['device_name']}: "
                 f"{cfg['model_source']} ({_fmt_params(cfg['params']['total'])} "
                 f"params), batch {cfg['batch_per_device']}x{cfg['seq_len']}, {cfg['precision']}, torch "
                 f"{result['versions'].get('torch')}", fontsize=9)
    return common.save_figure(fig, path)


def plot_sac(result: dict[str, Any], path: Path) -> Path | None:
    """Memory vs throughput of the activation-checkpointing modes."""
    import common

    modes = (result["sections"].get("sac") or {}).get("modes") or {}
    if not modes:
        return None
    plt = common._pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    gpu = any(r.get("peak_cuda_bytes_over_weights") is not None for r in modes.values())
    for name, rec in modes.items():
        mem = rec["peak_cuda_bytes_over_weights"] if gpu else rec["kept_bytes"]
        ax.scatter(rec["tokens_per_s"], mem / 2**20, s=30)
        ax.annotate(
            name, (rec["tokens_per_s"], mem / 2**20), textcoords="offset points", xytext=(4, 4), fontsize=8
        )
    ax.set_xlabel("throughput (tokens/s, forward + backward)")
    ax.set_ylabel("peak CUDA memory over the weights (MiB)" if gpu else "bytes kept for backward (MiB)")
    ax.set_title(f"activation checkpointing on {result['device_name']}", fontsize=9)
    return common.save_figure(fig, path)
