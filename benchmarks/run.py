"""Run benchmark suites side by side: ``python benchmarks/run.py <suite|all> [suite ...] [options]``.

Suites are the modules of ``benchmarks/suites/`` with a ``run(quick, out_dir, **options)`` function
(ddp, fsdp, hsdp, memory, and the suites of the other features: sac, mfu, straggler, ft_recovery, ...).
Each writes ``benchmarks/results/<suite>-<device>.json`` (every raw sample, medians, ratios,
versions, device) and a PNG next to it. Examples::

    python benchmarks/run.py fsdp                       # the moderate default run of one suite
    python benchmarks/run.py all --quick                # every suite, smoke-test sized
    python benchmarks/run.py fsdp ddp --sizes small --ranks 1 2 4 --reps 5
    python benchmarks/run.py --list

A round in which any contender's job fails is run again (``--retries``, default 2 more attempts), so
every contender has results from the same rounds; ratios use only rounds both sides completed, and
every failed attempt is listed (JSON ``cases[].failures`` and the printed table) with its stderr tail.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import common  # noqa: E402

PREFERRED_ORDER = ("ddp", "fsdp", "hsdp", "memory")


def discover() -> dict[str, Any]:
    """Suite name -> its ``run`` function, for every public module of ``benchmarks/suites``."""
    import suites

    found: dict[str, Any] = {}
    for info in pkgutil.iter_modules(suites.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"suites.{info.name}")
        if callable(getattr(module, "run", None)):
            found[info.name] = module.run
    ordered = [n for n in PREFERRED_ORDER if n in found] + sorted(
        n for n in found if n not in PREFERRED_ORDER
    )
    return {n: found[n] for n in ordered}


def call_suite(name: str, run: Any, quick: bool, out_dir: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Call a suite with the options its ``run`` accepts; say which ones it ignores."""
    params = inspect.signature(run).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = {k: v for k, v in options.items() if takes_all or k in params}
    ignored = sorted(set(options) - set(accepted))
    if ignored:
        print(f"[{name}] ignores --{' --'.join(o.replace('_', '-') for o in ignored)} "
              "(its run() does not take them)",
              file=sys.stderr)
    if "show_progress" in params:
        accepted["show_progress"] = True
    return run(quick=quick, out_dir=out_dir, **accepted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("suites", nargs="*", help="suite names, or 'all'")
    parser.add_argument("--list", action="store_true", help="list the suites and exit")
    parser.add_argument("--report", action="store_true",
                        help="print markdown tables of the result files "
                             "in --out-dir (for the suites named, or all)")
    common.add_common_options(parser)
    ns = parser.parse_args(argv)
    common.apply_common_options(ns)
    available = discover()
    if ns.report:
        paths = sorted(p for p in Path(ns.out_dir).glob("*.json")
                       if not ns.suites or "all" in ns.suites
                       # also straggler_16ranks
                       or any(p.stem.split("-", 1)[0].startswith(s) for s in ns.suites))
        print(common.markdown_report(paths))
        return 0
    if ns.list or not ns.suites:
        print("suites:", " ".join(available))
        return 0 if ns.list else 2
    wanted = list(available) if "all" in ns.suites else list(dict.fromkeys(ns.suites))
    unknown = [s for s in wanted if s not in available]
    if unknown:
        parser.error(f"unknown suite(s) {unknown}. Fix: choose from {list(available)} or 'all'.")
    for size in ns.sizes or []:
        common.size_config(size)  # clear error before anything runs
    options = common.suite_options(ns)
    failures: dict[str, str] = {}
    outer = common.progress(len(wanted), "suites") if len(wanted) > 1 else None
    for name in wanted:
        start = time.perf_counter()
        try:
            result = call_suite(name, available[name], ns.quick, ns.out_dir, options)
        except Exception:
            failures[name] = traceback.format_exc()
            print(f"[{name}] FAILED\n{failures[name]}", file=sys.stderr)
        else:
            print(common.format_summary(result) if isinstance(result, dict) else f"{name}: {result!r}")
            paths = [result.get(k) for k in ("json_path", "png_path")] if isinstance(result, dict) else []
            print(f"[{name}] done in {time.perf_counter() - start:.0f}s" +
                  (f": {', '.join(str(p) for p in paths if p)}" if any(paths) else ""))
        if outer is not None:
            outer.update(1)
    if outer is not None:
        outer.close()
    if failures:
        print(f"failed suites: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
