"""MkDocs hook: every benchmark figure on the site is generated at build time from benchmarks/results/.

A page asks for generated content with one of these lines (a marker the hook does not know, or a
result file that does not exist, fails the build):

* ``{{ benchmarks }}``: a section per ``benchmarks/results/*.json`` (the performance page), so a new
  result file appears without editing any page;
* ``{{ benchmark NAME.json }}``: one file's section;
* ``{{ gpu_results }}``: the sections of every file measured on a GPU, or the statement that there is none;
* ``{{ matrix NAME.json }}``: the real-models compatibility matrix (``make matrix`` writes the file);
* ``{{ pretrained_load NAME.json }}``: the pretrained-load memory table and figure (docs/pretrained.md);
* ``{{ memory_per_rank NAME.json }}``: a timing suite's worst-rank bytes and peak RSS per contender and case
  (docs/strategies/tensor_parallel.md);
* ``{{ summary_table }}``: one table of every comparison a result file states a target for (the last --
  largest -- case of each), with its value, target and verdict, linked to the file's section;
* ``{{ diff A B }}``: the unified diff between two files of the repository (e.g. the worked port in
  docs/port.md, whose files a test trains), so the page shows exactly what is tested;
* ``{{ hf_tp_plans }}``: which model families of the installed ``transformers`` carry a tensor-parallel plan
  in their config (``base_model_tp_plan``) and whether this package applies every style in it.

The PNGs next to the JSON files are copied into the site (``assets/benchmarks/``) and embedded. No
figure is typed into a page: rerunning a benchmark and rebuilding updates the site.
"""

from __future__ import annotations

import json
import posixpath
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import common as bench_common  # noqa: E402  (benchmarks/common.py: the one table renderer of suite results)

RESULTS = ROOT / "benchmarks" / "results"
ASSETS = "assets/benchmarks"
MARKER = re.compile(r"^\{\{\s*(\w+)\s*([^}]*?)\s*\}\}\s*$", re.M)


# ------------------------------------------------------------------------------------------------ helpers
def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e5 else f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(c if isinstance(c, str) else _fmt(c) for c in row) + " |" for row in rows]
    return [*out, ""]


def _met(row: dict[str, Any]) -> str:
    met = row.get("met")
    return "-" if met is None else ("met" if met else "**missed**")


def _target(row: dict[str, Any]) -> str:
    if row.get("target") is not None:
        return f"<= {_fmt(row['target'])}"
    if row.get("target_min") is not None:
        return f">= {_fmt(row['target_min'])}"
    return "-"


def _load(name: str) -> Any:
    path = RESULTS / name
    if not path.is_file():
        raise PluginError(f"docs: benchmark result {path} does not exist (named by a page marker)")
    return json.loads(path.read_text())


def _png(stem: str, data: dict[str, Any]) -> Path | None:
    name = data.get("png_path") if isinstance(data, dict) else None
    for candidate in ([Path(name).name] if name else []) + [f"{stem}.png"]:
        if (RESULTS / candidate).is_file():
            return RESULTS / candidate
    return None


def _result_files() -> list[Path]:
    return sorted(p for p in RESULTS.glob("*.json") if isinstance(json.loads(p.read_text()), dict))


# ------------------------------------------------------------------------------------------------ sections
def _cases(data: dict[str, Any]) -> list[str]:
    """Timing and memory suites: per case the contenders' medians and the ratios with their targets."""
    return [*bench_common.case_table(data), ""] if bench_common.has_case_table(data) else []


_RUN_COLUMNS = {"samples_per_s": "samples/s", "elapsed_s": "wall s",
                "median_stall_s": "stall per checkpoint s",
                "cpu_s": "CPU s", "val_loss": "final val loss", "checkpoint_bytes": "checkpoint bytes"}


def _contenders(data: dict[str, Any]) -> list[str]:
    """Suites that keep runs per contender (checkpoint, straggler): each round's values."""
    contenders = data.get("contenders")
    if not isinstance(contenders, dict) or not all(
        isinstance(v, dict) and "runs" in v for v in contenders.values()
    ):
        return []
    runs = [r for v in contenders.values() for r in v["runs"] if isinstance(r, dict)]
    keys = [k for k in _RUN_COLUMNS if any(r.get(k) is not None for r in runs)]
    rows = [[f"`{name}`", *[[r.get(k) for r in v["runs"] if isinstance(r, dict)] for k in keys]]
            for name, v in contenders.items()]
    return ["Per round:", "", *_table(["contender", *[_RUN_COLUMNS[k] for k in keys]], rows)]


def _figures(data: dict[str, Any]) -> list[str]:
    """Fault-tolerance suites (ft_recovery, its pooled rounds, straggler_switch)."""
    figures = data.get("figures")
    if not isinstance(figures, dict):
        return []
    out: list[str] = []
    recovery, switch = [], []
    for name, fig in figures.items():
        if not isinstance(fig, dict):
            continue
        if "rounds" in fig:
            rows = [[i, r.get("measured_utc"), r.get("goodput_vs_nofault"),
                     r.get("goodput_vs_nofault_step_normalised"), r.get("post_fault_step_ratio"),
                     f"{_fmt(min(r['local_lost_s']))} to {_fmt(max(r['local_lost_s']))}"
                         if r.get("local_lost_s") else "-",
                     r.get("downtime_median_s"), r.get("stall_max_s")] for i,
                     r in enumerate(fig["rounds"], 1)]
            out += [f"`{name}`, round by round:", "", *_table(
                ["round", "measured (UTC)", "goodput", "goodput at equal step time",
                 "step time after a fault / before",
                 "lost per fault (local) s", "killed group down, median s", "survivors' stall, max s"], rows)]
        elif "goodput" in fig:
            local = fig.get("local_loss") or {}
            valid = fig.get("step_normalised_valid")
            norm = fig.get("goodput_vs_nofault_step_normalised")
            recovery.append([f"`{name}`", fig.get("faults"), fig["goodput"].get("samples_per_s"),
                             fig.get("goodput_vs_nofault"),
                             "n/c" if norm is not None and valid is False else norm,
                             (fig.get("post_fault_step_ratio") or {}).get("median"),
                             local.get("median_lost_s"), local.get("goodput_at_kill_every"),
                             (fig.get("downtime_s") or {}).get("median"),
                             (fig.get("stall_s") or {}).get("median"), (fig.get("stall_s") or {}).get("max")])
        elif "median_samples_per_s" in fig:
            switches = [", ".join(f"to {s.get('to')} at step {s.get('step')} (cost {_fmt(s.get('cost'))})"
                                  for s in run)
                        or "none" for run in fig.get("switches", [])]
            switch.append(
                [f"`{name}`", fig.get("median_samples_per_s"), fig.get("samples_per_s"), "; ".join(switches)]
            )
    if recovery:
        out += _table(["run", "faults", "committed samples/s", "goodput",
                       "at equal step time (n/c: not comparable)",
                       "step time after a fault / before", "lost per fault (local, median) s",
                       "goodput at the kill period",
                       "killed group down, median s", "survivors' stall median s", "stall max s"], recovery)
    if switch:
        out += _table(["contender", "median samples/s", "per round", "switches per round"], switch)
    return out


def _ft_sync(data: dict[str, Any]) -> list[str]:
    """ft_sync_compare: held-out loss and cross-group traffic per sync mode and seed."""
    if data.get("suite") != "ft_sync":
        return []
    results = data.get("results", [])
    floor = data.get("bayes_floor_per_seed", {})
    base = {r["seed"]: r["heldout_loss"] for r in results if r.get("mode") == "every_step"}
    rows = []
    for r in results:
        ref = base.get(r["seed"])
        delta = f"{(r['heldout_loss'] / ref - 1) * 100:+.2f}%" if ref and r["mode"] != "every_step" else "-"
        rows.append([f"`{r['mode']}`", r["seed"], r.get("sync_every"), r.get("heldout_loss"), delta,
                     floor.get(str(r["seed"])), r.get("cross_group_bytes_per_step_per_rank"),
                     r.get("inner_steps_with_traffic"), r.get("groups_max_abs_param_diff")])
    out = _table(["mode", "seed", "sync_every", "held-out loss", "vs `every_step`", "true chain (floor)",
                  "cross-group bytes per step and rank", "steps with cross-group traffic",
                  "max parameter difference across groups"], rows)
    by_mode = data.get("by_mode") or {}
    if by_mode:
        out += _table(["mode", "held-out loss vs `every_step`, per seed", "median", "max", "seeds within 2%"],
                      [[f"`{m}`",
                        [f"{v * 100:+.2f}%" for v in b.get("heldout_loss_vs_every_step_per_seed", [])],
                        f"{b.get('median', 0) * 100:+.2f}%", f"{b.get('max', 0) * 100:+.2f}%",
                        b.get("within_2pct_seeds")]
                       for m, b in by_mode.items()])
    if data.get("outer_overrides"):
        out += [f"Outer optimizer overrides: {_fmt(data['outer_overrides'])}.", ""]
    return out


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def _verdict(met: Any) -> str:
    return "-" if met is None else ("yes" if met else "**no**")


def _worst_mark(rec: dict[str, Any], mark: str, key: str) -> int | None:
    values = [r["memory"]["marks"][mark][key] for r in rec.get("per_rank") or []
              if mark in (r.get("memory") or {}).get("marks", {})]
    return max(values) if values else None


def _pretrained_notes(data: dict[str, Any], overhead_size: Any) -> list[str]:
    """What the table's columns do not show: the two reference routes' intermediate peaks."""
    notes = []
    for case in data.get("cases") or []:
        if case["size"] == overhead_size:
            continue
        where = f"{case['size']}, {case['ranks']} rank{'s' if case['ranks'] > 1 else ''}"
        single = case["contenders"].get("transformers_single") or {}
        if single.get("worst_rank") and _worst_mark(single, "after_forward", "peak_growth_bytes") is not None:
            notes.append(
                f"- `transformers_single` ({where}): {_mib(single['worst_rank']['peak_growth_bytes'])} MiB "
                "peak RSS when `from_pretrained` returns -- the "
                "parameters stay memory-mapped, untouched -- and "
                f"{_mib(_worst_mark(single, 'after_forward', 'peak_growth_bytes'))} "
                "MiB once a forward has read "
                f"every weight ({_mib(_worst_mark(single, 'after_forward', 'file_growth_bytes'))} MiB of it "
                "file-backed pages)."
            )
        init = case["contenders"].get("init_from_pretrained") or {}
        if init.get("worst_rank") and _worst_mark(init, "after_init", "peak_growth_bytes") is not None:
            notes.append(f"- `init_from_pretrained` ({where}): "
                         f"{_mib(_worst_mark(init, 'after_init', 'peak_growth_bytes'))}"
                         " MiB peak RSS after `__init__` (the weights mapped, untouched), "
                         f"{_mib(init['worst_rank']['peak_growth_bytes'])} MiB by `on_fit_start` "
                         f"({_mib(init['worst_rank']['peak_anon_growth_bytes'])} "
                         "MiB anonymous): Lightning's `ddp` set-up "
                         "reads and copies the full model on every rank "
                         "(DDP's broadcast from rank 0, its gradient "
                         "buckets).")
    return [*notes, ""] if notes else []


def pretrained_load(data: dict[str, Any]) -> list[str]:
    """pretrained_load: per model size, rank count and route the worst rank's peak memory while the pretrained
    model gets onto the ranks, against model/N and the budget model/N + largest tensor + the route's fixed
    overhead."""
    if data.get("suite") != "pretrained_load" or not isinstance(data.get("models"), dict):
        return []
    overhead_size = (data.get("config") or {}).get("overhead_size")
    out: list[str] = []
    rows, fixed = [], []
    for case in data.get("cases") or []:
        model = data["models"].get(case["size"], {})
        for name, rec in case["contenders"].items():
            if not rec.get("worst_rank"):
                rows.append([case["size"], case["ranks"], f"`{name}`",
                             "failed: " + _fmt((rec.get("errors") or ["-"])[0]
                                                                                        .splitlines()[0])]
                            + ["-"] * 8)
                continue
            worst, targets = rec["worst_rank"], rec.get("targets") or {}
            rss, anon = targets.get("rss") or {}, targets.get("anon") or {}
            if case["size"] == overhead_size:
                fixed.append([case["ranks"], f"`{name}`", _mib(worst["peak_growth_bytes"]),
                              _mib(worst["peak_anon_growth_bytes"]), _verdict(rec.get("weights_ok"))])
                continue
            rows.append([f"{case['size']} ({model.get('params', 0) / 1e6:.1f}M, "
                         f"{_mib(model.get('model_bytes'))} MiB)",
                         case["ranks"], f"`{name}`", _verdict(rec.get("weights_ok")),
                         _mib(worst["peak_growth_bytes"]), _mib(worst["peak_anon_growth_bytes"]),
                         _mib(worst["peak_file_growth_bytes"]), _mib(rec.get("model_share_bytes")),
                         f"{rss['ratio_to_share']:.2f}" if rss else "-",
                         f"{anon['ratio_to_share']:.2f}" if anon else "-",
                         f"{_mib(rss.get('budget_bytes'))} / {_mib(anon.get('budget_bytes'))}",
                         f"{_verdict(rss.get('met'))} / {_verdict(anon.get('met'))}"])
    out += _table(["model (params, fp32 bytes)", "ranks", "route", "weights = pretrained", "peak RSS MiB",
                   "peak anonymous MiB", "peak file-backed MiB", "model/N MiB", "RSS / (model/N)",
                   "anonymous / (model/N)", "budget MiB (RSS / anonymous)",
                   "within budget (RSS / anonymous)"], rows)
    out += _pretrained_notes(data, overhead_size)
    sizes = ", ".join(f"`{s}` {_mib(m.get('model_bytes'))} MiB, largest "
                      f"tensor {_mib(m.get('largest_tensor_bytes'))} "
                      f"MiB" for s, m in data["models"].items() if s != overhead_size)
    if fixed:
        out += ["Fixed overhead of each route (its worst-rank peak "
                f"on the `{overhead_size}` model, the same layers and "
                f"tensors at {_mib(data['models'].get(overhead_size, {}).get('model_bytes'))} "
                "MiB); model sizes: "
                f"{sizes}.", "",
                *_table(["ranks", "route", "overhead RSS MiB", "overhead anonymous MiB",
                         "weights = pretrained"], fixed)]
    return out


def _sac(data: dict[str, Any]) -> list[str]:
    """The sac suite (checkpointing modes, ``budget``, offload): per model a row per contender, with the
    suite's own renderer (``benchmarks/suites/sac.py``)."""
    cases = data.get("cases") if data.get("suite") == "sac" else None
    if not isinstance(cases, list) or not cases or not all("family" in c for c in cases):
        return []
    import importlib.util  # the suite by its path (imports torch and the package)

    spec = importlib.util.spec_from_file_location(
        "bench_suite_sac", ROOT / "benchmarks" / "suites" / "sac.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.markdown(data)


def _summary(data: dict[str, Any]) -> list[str]:
    rows = data.get("summary")
    if not isinstance(rows, list) or not rows:
        return []
    where = any("size" in r or "ranks" in r for r in rows)
    head = ["size", "ranks"] if where else []
    table = [[*([r.get("size", "-"), r.get("ranks", "-")] if where else []), r.get("ratio"), r.get("value"),
              r.get("per_round", "-"), r.get("throughput_x", "-"), _target(r), _met(r)] for r in rows]
    has_x = any("throughput_x" in r for r in rows)
    if not has_x:
        table = [row[:-3] + row[-2:] for row in table]
    return ["Summary:", "",
            *_table([*head, "measure", "value", "per round", *(["throughput x"] if has_x else []),
                                     "target", "target met"], table)]


def _extra(data: dict[str, Any]) -> list[str]:
    pred = data.get("model_prediction")
    if not isinstance(pred, dict):
        return []
    return ["Stall model's prediction:", "", *[f"- `{k}`: {_fmt(v)}" for k, v in pred.items()], ""]


def memory_per_rank(data: dict[str, Any]) -> list[str]:
    """Per case and contender: the worst rank's parameter / gradient / optimizer-state bytes (local shards)
    and peak RSS, with the loss of each round's first and last step (the contenders train the same model)."""
    out: list[str] = []
    for case in data.get("cases") or []:
        rows = []
        for name, rec in case["contenders"].items():
            per_rank = rec.get("memory_per_rank") if isinstance(rec, dict) else None
            if not per_rank:
                rows.append(
                    [f"`{name}`", *["-"] * 7, rec.get("skipped", "failed") if isinstance(rec, dict) else "-"]
                )
                continue
            worst = {k: max(m[k] for m in per_rank) for k in ("param_bytes", "grad_bytes",
                                                              "optimizer_state_bytes",
                                                              "total_bytes", "max_rss_bytes")}
            losses = ", ".join(
                f"{a:.3f} -> {b:.3f}" for a, b in zip(rec.get("loss_first") or [], rec.get("loss_last") or [])
            )
            rows.append([f"`{name}`", rec.get("median_s") and f"{rec['median_s'] * 1e3:.1f}", len(per_rank),
                         *[_mib(worst[k]) for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes",
                                                    "total_bytes", "max_rss_bytes")], losses or "-"])
        params = f", {case['params'] / 1e6:.2f}M params" if case.get("params") else ""
        out += [f"`{case['size']}`{params}, {case['ranks']} ranks (worst rank; MiB):", "",
                *_table(["contender", "median step ms", "ranks reporting", "params", "grads",
                         "optimizer state",
                         "params + grads + optimizer", "peak RSS", "loss, first -> last step, per round"],
                         rows)]
    return out


def hf_tp_plans() -> str:
    """The model families of the installed ``transformers`` (``CONFIG_MAPPING``: model type -> config class)
    whose config class declares ``base_model_tp_plan`` (a class attribute: nothing is instantiated), split by
    whether every style in it is one this package applies; and the families without a plan."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    from fsdp_strategies.parallel.tensor_parallel import STYLES

    applied, partly, without = [], [], []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        try:
            config_class = CONFIG_MAPPING[model_type]
        except Exception:  # a config whose optional dependency is missing: not listed as either
            continue
        plan = getattr(config_class, "base_model_tp_plan", None)
        if not plan:
            without.append(model_type)
            continue
        styles = sorted(set(plan.values()))
        other = [s for s in styles if s not in STYLES]
        row = [f"`{model_type}`", f"`{config_class.__name__}`", len(plan),
               ", ".join(f"`{s}`" for s in styles)]
        if other:
            partly.append([*row, ", ".join(f"`{s}`" for s in other)])
        else:
            applied.append(row)
    head = ["model type", "config class", "plan entries", "styles"]
    return "\n".join([
        f"Generated from the installed `transformers` {transformers.__version__} when this site was built: "
        f"{len(CONFIG_MAPPING_NAMES)} model types, **{len(applied)}** "
        "with a plan that uses only the styles above, "
        f"**{len(partly)}** with a plan that uses styles this "
        f"package does not apply, **{len(without)}** without "
        "a plan.", "",
        f"### Families whose plan uses only the styles above ({len(applied)})", "",
        "`tp_plan: auto` applies these plans as they are (a "
        "plan of few entries splits only those layers: see the "
        "entries column).", "", *_table(head, applied),
        f"### Families whose plan uses other styles ({len(partly)})", "",
        "`tp_plan: auto` refuses these before training: it "
        "names the style it does not apply, or, for packed MoE "
        "experts, the plan entries that name parameters rather "
        "than modules. A dict plan may name the layers that take "
        "the four styles, but what it leaves out stays whole "
        "on every TP rank, which is right only where that "
        "parameter's gradient is the same on every TP rank "
        "(not for a norm applied per head after a column-wise "
        "projection, such as Qwen3's `q_norm` / `k_norm`, which "
        "their plans mark `replicated_with_grad_allreduce`). "
        "Not tested here.", "",
        *_table([*head, "styles not applied here"], partly),
        f"### Families without a plan ({len(without)})", "",
        "These need a dict `tp_plan` (or a `configure_model` "
        "that applies its own). Composite models are listed by "
        "their top-level config: one whose language model has a "
        "config of its own with a plan (e.g. a vision-language "
        "model) is listed here; `auto` uses the outermost "
        "submodule that carries a plan, and whether it finds the "
        "language model's is not tested.", "",
        '??? note "The model types without a plan"', "", "    " + ", ".join(f"`{t}`" for t in without), "",
    ])


def section(path: Path, page_dir: str, level: int = 3) -> str:
    data = json.loads(path.read_text())
    stem = path.stem
    versions = data.get("versions") or {}
    when = data.get("created_utc") or data.get("measured_utc")
    facts = [f"suite `{data.get('suite')}`", f"device: {data.get('device_name') or data.get('device')}"]
    if isinstance(when, str):
        facts.append(f"written {when}")
    if versions:
        facts.append(
            ", ".join(
                f"{k} {versions[k]}" for k in ("torch", "lightning", "torchft", "git_commit") if k in versions
            )
        )
    if data.get("host_load_at_start") is not None:
        facts.append(f"host load at start {_fmt(data['host_load_at_start'])}")
    lines = [f"{'#' * level} `{path.name}` {{ #{stem} }}", "", " · ".join(facts), ""]
    if data.get("command"):
        lines += ["```bash", str(data["command"]), "```", ""]
    note = data.get("note") or (data.get("config") or {}).get("note")
    if note:
        lines += [f"> {_fmt(note)}", ""]
    for part in (_cases, _contenders, _figures, _ft_sync, pretrained_load, _sac, _summary, _extra):
        lines += part(data)
    png = _png(stem, data)
    if png is not None:
        lines += [f"![{stem}]({posixpath.relpath(f'{ASSETS}/{png.name}', page_dir or '.')})", ""]
    return "\n".join(lines)


def matrix(path_name: str) -> str:
    """Real-models matrix: one row per model x strategy, one column per callback set, the precisions that
    pass."""
    results = _load(path_name)
    rows: dict[tuple[str, str], dict[str, list[str]]] = {}
    columns: list[str] = ["none"]
    for r in results:
        c = r["cell"]
        label = "+".join(c["callbacks"]) or "none"
        if label not in columns:
            columns.append(label)
        mark = (
            f"{'ok' if not r['problems'] else 'FAIL'} "
            f"{c['precision'].replace('-true', '').replace('-mixed', 'm')}"
        )
        if c.get("resume"):
            mark += " +resume"
        rows.setdefault((c["model"], c["strategy"]), {}).setdefault(label, []).append(mark)
    # a callback set's name may wrap after "_" and "+" (not inside a word): nine columns fit a 1400 px window
    heads = [col.replace("_", "_<wbr>").replace("+", "+<wbr>") for col in columns]
    lines = _table(
        ["model", "strategy", *heads],
        [[m, s, *(", ".join(by.get(col, ["-"])) for col in columns)] for (m, s), by in rows.items()],
    )
    passed = sum(not r["problems"] for r in results)
    lines.append(f"**{passed} of {len(results)} cells pass** (`benchmarks/results/{path_name}`).")
    return "\n".join(lines)


def gpu_results(page_dir: str) -> str:
    files = [p for p in _result_files() if json.loads(p.read_text()).get("device", "cpu") != "cpu"]
    if not files:
        return ("!!! note \"No GPU figures have been measured yet\"\n"
                "    `benchmarks/results/` holds no result measured "
                "on a GPU: every figure on this site comes from "
                "a CPU. A GPU result file appears here when it is added and the site rebuilt.\n")
    return "\n".join(section(p, page_dir) for p in files)


def all_benchmarks(page_dir: str) -> str:
    by_suite: dict[str, list[Path]] = {}
    for p in _result_files():
        by_suite.setdefault(str(json.loads(p.read_text()).get("suite")), []).append(p)
    out = []
    for suite, paths in by_suite.items():
        out += [f"## {suite_title(suite)} {{ #{suite} }}", "", *[section(p, page_dir) for p in paths]]
    return "\n".join(out)


def suite_title(suite: str) -> str:
    """What a suite measures, from the first sentence of the docstring of the script that writes it
    (``benchmarks/suites/<suite>.py``: ``accumulation suite: gradient memory per rank ...``; the stand-alone
    scripts ``benchmarks/*.py``), followed by its name; the name alone when no script names it."""
    import ast

    scripts = {"ft_sync": "ft_sync_compare.py", "goodput": "goodput.py", "gpu": "gpu.py"}
    path = ROOT / "benchmarks" / scripts.get(suite, f"suites/{suite}.py")
    doc = ast.get_docstring(ast.parse(path.read_text())) if path.is_file() else None
    if not doc:
        return f"`{suite}`"
    text = " ".join(doc.split("\n\n")[0].split())
    text = text.partition("suite:")[2].strip() if "suite:" in text else text.partition(":")[2].strip() or text
    text = re.split(r"\.\s|\s--\s|;\s", text + " ")[0].strip().rstrip(".").replace("``", "`")
    if text.count("(") > text.count(")"):  # the sentence was cut inside a parenthesis: drop the parenthesis
        text = text[:text.rindex("(")].strip()
    return f"{text[:1].upper()}{text[1:]} (`{suite}`)" if text else f"`{suite}`"


def summary_table() -> str:
    """Every targeted comparison of every result file, its last (largest) case: value, target, verdict."""
    rows = []
    for path in _result_files():
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("summary"), list):
            continue
        last: dict[str, dict[str, Any]] = {}
        for row in data["summary"]:
            if isinstance(row, dict) and (row.get("target") is not None or row.get("target_min") is not None):
                last[str(row.get("ratio"))] = row
        for name, row in last.items():
            where = ", ".join(f"{k} {row[k]}" for k in ("size", "ranks") if row.get(k) is not None)
            target = (f"<= {_fmt(row['target'])}" if row.get("target") is not None
                      else f">= {_fmt(row['target_min'])}")
            ci = row.get("ci95")
            value = _fmt(row.get("value")) + (f" [{_fmt(ci[0])}, {_fmt(ci[1])}]" if ci else "")
            undecided = str(row.get("verdict", "")).startswith("undecided")
            verdict = "undecided" if undecided else _verdict(row.get("met"))
            rows.append([f"[`{path.name}`](#{path.stem})", f"{name}" + (f" ({where})" if where else ""),
                         value, target, verdict])
    return "\n".join(_table(["result file", "comparison", "value", "target", "met"], rows))


def file_diff(a: str, b: str) -> str:
    """A fenced ``diff`` block: ``b`` against ``a`` (paths relative to the repository)."""
    import difflib

    paths = [ROOT / a, ROOT / b]
    for path in paths:
        if not path.is_file():
            raise PluginError(f"docs: {{{{ diff {a} {b} }}}}: {path} does not exist")
    lines = difflib.unified_diff(paths[0].read_text().splitlines(), paths[1].read_text().splitlines(), a, b,
                                 lineterm="", n=2)
    return "\n".join(["```diff", *lines, "```"])


# ------------------------------------------------------------------------------------------------ mkdocs
# events
def on_files(files: Files, config: Any) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"{ASSETS}/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    page_dir = posixpath.dirname(page.file.src_uri)

    def render(match: re.Match[str]) -> str:
        kind, arg = match.group(1), match.group(2).strip()
        if kind == "benchmarks" and not arg:
            return all_benchmarks(page_dir)
        if kind == "benchmark" and arg:
            _load(arg)
            return section(RESULTS / arg, page_dir)
        if kind == "gpu_results" and not arg:
            return gpu_results(page_dir)
        if kind == "matrix" and arg:
            return matrix(arg)
        if kind == "pretrained_load" and arg:
            data = _load(arg)
            png = _png(Path(arg).stem, data)
            figure = (
                [f"![{Path(arg).stem}]({posixpath.relpath(f'{ASSETS}/{png.name}', page_dir or '.')})", ""]
                if png
                else []
            )
            return "\n".join([*pretrained_load(data), *figure])
        if kind == "memory_per_rank" and arg:
            return "\n".join(memory_per_rank(_load(arg)))
        if kind == "hf_tp_plans" and not arg:
            return hf_tp_plans()
        if kind == "summary_table" and not arg:
            return summary_table()
        if kind == "diff" and len(arg.split()) == 2:
            return file_diff(*arg.split())
        raise PluginError(f"docs: {page.file.src_uri}: unknown marker {match.group(0)!r}")

    return MARKER.sub(render, markdown)
