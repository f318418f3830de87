"""The real-models matrix: which cells exist, how they are run, and what each must satisfy.

Used by ``tests/test_real_models.py`` (the representative cut that CI runs) and by the full run::

    make matrix            # = python tests/matrix/cells.py --full
    python tests/matrix/cells.py --full --models hf_clip --merge   # one model's cells, the others' kept

which runs every cell (models x strategies x callbacks x precision, about 25 min on 2 CPU cores),
writes ``benchmarks/results/real_models_matrix-cpu.json`` and prints the README's table.

Checks per cell (:func:`check_cell`): it trains ``STEPS`` steps; every rank's losses equal the
reference run's (Lightning's ``ddp`` on the same world size, precision and data; SAC and the
monitors change no math) within :data:`TOLERANCE`; sharded strategies wrap every expected block
(both stacks of an encoder-decoder) as its own FSDP unit holding 1/shard-degree of its
parameters per rank; ``state_dict`` keys are those of a fresh build; MFU's counted model FLOPs
are within 5% of ``6 * N * tokens + 12 * L * d * S * tokens`` where the model has that form;
SAC checkpointed blocks and left ``use_cache`` as it found it; a resumed run continues exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if __name__ == "__main__":  # run as a script (`make matrix`): tests/, as pytest's `pythonpath` has it
    sys.path.insert(0, str(HERE.parent))

from matrix.ft_replay import replay  # noqa: E402
from matrix.models import MODELS  # noqa: E402
from matrix.worker import STEPS  # noqa: E402
from support import processes  # noqa: E402
from support.paths import job_pythonpath  # noqa: E402

#: relative tolerance of a cell's losses against its reference run, per precision. fp32: reduction
#: order only. bf16-mixed: FSDP2's MixedPrecisionPolicy keeps norms and other non-matmul ops in bf16
#: parameters where Lightning's ddp autocast keeps them fp32.
TOLERANCE = {"32-true": 1e-4, "bf16-mixed": 5e-2, "bf16-true": 5e-2}
MFU_TOLERANCE = 0.05

CALLBACK_SETS: list[list[str]] = [[], ["sac_full"], ["sac_selective_op"], ["sac_selective_layer"], ["mfu"],
                                  ["straggler"], ["sac_selective_op", "mfu", "straggler"]]
PRECISIONS = ["32-true", "bf16-mixed"]


def cell(model: str, strategy: str, callbacks: Iterable[str] = (), precision: str = "32-true",
         resume: bool = False, eager_init: bool = False) -> dict[str, Any]:
    """One cell. ``eager_init``: a model that builds its layers in ``configure_model`` is built for real on
    every rank (the strategy's ``meta_init=False``) from the same seed as the reference, so its losses are
    compared with the reference's instead of only checked to be finite and falling."""
    c = {"model": model, "strategy": strategy, "callbacks": list(callbacks), "precision": precision,
         "resume": resume}
    if eager_init:
        c["eager_init"] = True
    return c


def _reference(model: str, precision: str) -> dict[str, Any]:
    return cell(model, MODELS[model].reference, (), precision)


def full_cells(world: int) -> list[dict[str, Any]]:
    """Every cell of a ``world``-rank job: 2 ranks for fsdp2 / ddp_hooks, 4 ranks for hsdp (2 x 2)."""
    strategies = ["fsdp2", "ddp_hooks"] if world == 2 else ["hsdp"]
    cells = []
    for model, spec in MODELS.items():
        for precision in PRECISIONS:
            cells.append(_reference(model, precision))
            for strategy in strategies:
                if strategy == "ddp_hooks" and spec.reference != "ddp":
                    continue  # a configure_model that calls fully_shard itself cannot run under DDP
                cells += [cell(model, strategy, cbs, precision) for cbs in CALLBACK_SETS]
                if spec.meta_init and strategy in ("fsdp2", "hsdp"):  # and once built like the reference
                    cells.append(cell(model, strategy, (), precision, eager_init=True))
    if world == 2:
        cells += [_reference("hf_llama", "bf16-true"), cell("hf_llama", "fsdp2", (), "bf16-true"),
                  # hsdp: 2 replicas x 1 shard
                  cell("hf_llama", "fsdp2", (), resume=True), cell("hf_llama", "hsdp")]
    return cells


def ci_cells(world: int) -> list[dict[str, Any]]:
    """The representative cut: every model once under the sharded strategy, the rest on the HF Llama."""
    if world == 4:
        return [_reference("hf_llama", "32-true"), cell("hf_llama", "hsdp"),
                _reference("hf_llama", "bf16-mixed"),
                cell("hf_llama", "hsdp", ["sac_selective_op", "mfu"], "bf16-mixed"),
                _reference("hf_t5", "32-true"), cell("hf_t5", "hsdp"),
                _reference("hf_clip", "32-true"), cell("hf_clip", "hsdp"),
                _reference("mps_style_llama", "32-true"), cell("mps_style_llama", "hsdp"),
                _reference("example_llama", "32-true"), cell("example_llama", "hsdp", eager_init=True)]
    cells = []
    for model in MODELS:
        cells += [_reference(model, "32-true"), cell(model, "fsdp2")]
        # built on the meta device above; built like the reference here: same losses
        if MODELS[model].meta_init:
            cells.append(cell(model, "fsdp2", eager_init=True))
    cells += [
        cell("hf_llama", "fsdp2", [name]) for name in ("sac_full", "sac_selective_op", "sac_selective_layer")
    ]
    cells += [_reference("hf_llama", "bf16-mixed"),
              cell("hf_llama", "fsdp2", ["sac_selective_op", "mfu", "straggler"], "bf16-mixed"),
              cell("hf_llama", "ddp_hooks", ["sac_selective_op", "mfu", "straggler"]),
              _reference("lightning_demo", "bf16-mixed"), cell("lightning_demo", "fsdp2", (), "bf16-mixed"),
              _reference("hf_clip", "bf16-mixed"), cell("hf_clip", "fsdp2", (), "bf16-mixed"),
              cell("hf_gpt2", "fsdp2", ["mfu"]), cell("hf_bert", "fsdp2", ["mfu"]),
              _reference("hf_llama", "bf16-true"), cell("hf_llama", "fsdp2", (), "bf16-true"),
              cell("hf_llama", "fsdp2", (), resume=True),
              cell("hf_llama", "hsdp")]  # hsdp as 2 replicas x 1 shard
    return cells


def run_cells(cells: list[dict[str, Any]], world: int, work: Path, timeout: float) -> list[dict[str, Any]]:
    """Run ``cells`` in one torchrun job of ``world`` ranks; one result per cell, in order."""
    work.mkdir(parents=True, exist_ok=True)
    spec, out = work / f"cells{world}.json", work / f"results{world}.jsonl"
    spec.write_text(json.dumps(cells))
    out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": job_pythonpath()}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--nnodes=1",
           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(HERE / "worker.py"),
           "--cells", str(spec), "--out", str(out), "--tmp", str(work / f"tmp{world}")]
    proc = processes.run(cmd, timeout=timeout, env=env, cwd=str(ROOT))
    results = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if len(results) != len(cells):
        raise RuntimeError(f"the {world}-rank matrix job ran {len(results)} of {len(cells)} cells (rc "
                           f"{proc.returncode})\n--- stderr\n{proc.stderr[-6000:]}")
    return results


def run_ft_cell(model: str, work: Path, *, precision: str = "32-true", callbacks: Iterable[str] = (),
                steps: int = 30, kill_at: int = 4, sleep_alone: float = 1.5,
                timeout: float = 300) -> dict[str, Any]:
    """One ft_hsdp cell: 2 replica groups x 1 rank, group 1 SIGKILLed at committed step ``kill_at``, then
    healed.

    The survivor trains alone at ``sleep_alone`` s per step, so the killed group's restart (a fresh Python
    with torch, Lightning and transformers to import) has ``(steps - kill_at) * sleep_alone`` seconds to
    rejoin before the survivor finishes; once it has healed, the steps run at full speed.
    """
    out, events = work / f"ft-{model}-{precision}", work / f"ft-{model}-{precision}-events"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": job_pythonpath()}
    cmd = [sys.executable, "-m", "fsdp_strategies.ft", "--groups", "2", "--ranks-per-group", "1",
           "--min-replicas", "1", "--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "500",
           "--kill-at-steps", f"1@{kill_at}", "--max-restarts", "2", "--events-dir", str(events),
           "--timeout", str(timeout - 20), "--", str(HERE / "ft_worker.py"), "--model", model, "--precision",
           precision,
           "--callbacks", ",".join(callbacks), "--steps", str(steps), "--sleep-alone", str(sleep_alone),
           "--out", str(out)]
    proc = processes.run(cmd, timeout=timeout, env=env, cwd=str(ROOT))
    launcher = [json.loads(line) for line in (events / "launcher.jsonl").read_text().splitlines()] \
        if (events / "launcher.jsonl").exists() else []
    groups = (
        {p.name: json.loads(p.read_text()) for p in sorted(out.glob("group*_rank*.json"))}
        if out.exists()
        else {}
    )
    return {"cell": cell(model, "ft_hsdp", callbacks, precision), "returncode": proc.returncode,
            "steps": steps,
            "out": str(out), "launcher": launcher, "groups": groups, "stderr_tail": proc.stderr[-3000:]}


# ---------------------------------------------------------------------------------------------- checks
def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-8)


def max_loss_deviation(result: dict[str, Any], reference: dict[str, Any]) -> float:
    return max((_rel(a, b) for ours, ref in zip(result["losses"], reference["losses"], strict=True)
                for a, b in zip(ours, ref, strict=True)), default=0.0)


def analytic_flops(inputs: dict[str, Any]) -> float:
    tokens = inputs["samples"] * inputs["seq"]
    return (
        6 * inputs["matmul_params"] * tokens
        + 12 * inputs["layers"] * inputs["attn_width"] * inputs["seq"] * tokens
    )


def check_cell(result: dict[str, Any], reference: dict[str, Any] | None) -> list[str]:
    """What is wrong with one cell's result (empty: it passes)."""
    c = result["cell"]
    if "error" in result:
        return [f"error: {result['error'].splitlines()[0][:300]}"]
    problems = []
    if result["global_step"] != STEPS:
        problems.append(f"trained {result['global_step']} steps, not {STEPS}")
    meta_init = (
        MODELS[c["model"]].meta_init and c["strategy"] in ("fsdp2", "hsdp") and not c.get("eager_init")
    )
    if reference is None and c != _reference(c["model"], c["precision"]) and not meta_init:
        problems.append(
            f"no result of its reference cell ({MODELS[c['model']].reference}, {c['precision']}) to "
            "compare with: a cell without a reference proves nothing"
        )
    if meta_init:
        for rank, losses in enumerate(result["losses"]):
            if not all(x == x for x in losses) or not losses[-1] < losses[0]:
                problems.append(f"rank {rank}: losses {losses} are not finite and falling")
    elif reference is not None and result is not reference:
        if "error" in reference:
            problems.append(f"reference failed: {reference['error'][:200]}")
        else:
            deviation = max_loss_deviation(result, reference)
            if not deviation <= TOLERANCE[c["precision"]]:
                problems.append(f"losses differ from {reference['cell']['strategy']} by {deviation:.2e} "
                                f"(> {TOLERANCE[c['precision']]:.0e})")
    if c["strategy"] in ("fsdp2", "hsdp"):
        shard = result["world"] if c["strategy"] == "fsdp2" else result["world"] // 2
        for name, count in MODELS[c["model"]].blocks.items():
            found = result["blocks"].get(name, [])
            if len(found) != count or not all(b["fsdp_unit"] for b in found):
                problems.append(f"{sum(b['fsdp_unit'] for b in found)} of {count} {name} are FSDP units")
            bad = [round(b["fraction"], 3) for b in found if abs(b["fraction"] - 1 / shard) > 0.05]
            if bad:
                problems.append(f"{name} hold {bad} of their parameters per rank, not 1/{shard}")
    if not result["state_dict_keys_equal"]:
        problems.append(f"state_dict keys changed: {result['state_dict_keys_diff']}")
    mfu = result.get("mfu")
    if mfu and mfu["analytic_inputs"]:
        expected = analytic_flops(mfu["analytic_inputs"])
        if _rel(mfu["model_flops"], expected) > MFU_TOLERANCE:
            problems.append(f"MFU counted {mfu['model_flops']:.4g} model FLOPs, formula {expected:.4g}")
    if any(name.startswith("sac_") for name in c["callbacks"]):
        if not result.get("sac_checkpointed"):
            problems.append("ActivationCheckpointing checkpointed no block")
        if c["model"].startswith("hf_") and result.get("use_cache_after_fit") is False:
            problems.append("config.use_cache was not restored after fit")
    if c.get("resume"):
        for rank, (straight, resumed) in enumerate(
            zip(result["losses"], result["resumed_losses"], strict=True)
        ):
            if resumed is None or any(_rel(a, b) > 1e-5 for a, b in zip(resumed, straight[2:], strict=True)) \
                    or len(resumed) != len(straight) - 2:
                problems.append(f"rank {rank}: resumed losses {resumed} != uninterrupted {straight[2:]}")
    return problems


def check_ft_cell(result: dict[str, Any]) -> list[str]:
    problems = []
    if result["returncode"] != 0:
        problems.append(f"fsdp-strategies-ft exited {result['returncode']}: {result['stderr_tail'][-300:]}")
    kills = [e for e in result["launcher"] if e["event"] == "kill"]
    starts = [e for e in result["launcher"] if e["event"] == "start"]
    if len(kills) != 1 or len(starts) != 3:
        problems.append(
            f"expected one kill and one restart, launcher saw {len(kills)} kills, {len(starts)} starts"
        )
    groups = result["groups"]
    if len(groups) != 2:
        return [*problems, f"{len(groups)} of 2 groups wrote results"]
    steps = {g["global_step"] for g in groups.values()} | {g["manager_step"] for g in groups.values()}
    if steps != {result["steps"]}:
        problems.append(f"groups ended at steps {steps}, not {result['steps']}")
    if len({g["digest"] for g in groups.values()}) != 1:
        problems.append("the groups' parameters differ at the end")
    for g in groups.values():
        if any(not b["fsdp_unit"] for blocks in g["blocks"].values() for b in blocks):
            problems.append("a block is not an FSDP unit")
        if not g["losses"] or any(x != x for x in g["losses"]):
            problems.append("no or NaN losses")
    if result["cell"]["precision"] == "32-true" and not result["cell"]["callbacks"]:
        problems += replay_problems(result)
    return problems


def replay_problems(result: dict[str, Any], lr_scale: float = 1.0) -> list[str]:
    """The cell against its independent reference: its committed steps replayed in plain torch
    (ft_replay.py)."""
    try:
        rep = replay(result["cell"]["model"], Path(result["out"]), lr_scale)
    except (AssertionError, FileNotFoundError) as e:
        return [f"replay: {e}"]
    tol = TOLERANCE["32-true"]
    problems = []
    if rep["steps"] != result["steps"] or rep["finals"] != 2 or rep["losses_compared"] < rep["steps"]:
        problems.append(
            f"replay: {rep['steps']} committed steps (want {result['steps']}), {rep['finals']} final "
            f"weights, {rep['losses_compared']} losses compared"
        )
    if rep["loss_deviation"] > tol or rep["weight_deviation"] > tol:
        problems.append(f"replay: losses differ by {rep['loss_deviation']:.2e}, weights by "
                        f"{rep['weight_deviation']:.2e} (tolerance {tol:.0e})")
    return problems


def reference_for(result: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any] | None:
    c = result["cell"]
    want = _reference(c["model"], c["precision"])
    return next((r for r in results if r["cell"] == want and r["world"] == result["world"]), None)


# ---------------------------------------------------------------------------------------------- full run
def _label(c: dict[str, Any]) -> str:
    return "+".join(c["callbacks"]) or "none"


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per model x strategy, one column per callback set; each cell: passes per
    precision."""
    rows: dict[tuple[str, str], dict[str, list[str]]] = {}
    for r in results:
        c = r["cell"]
        problems = r["problems"]
        mark = (
            f"{'ok' if not problems else 'FAIL'} {c['precision'].replace('-true', '').replace('-mixed', 'm')}"
        )
        if c.get("resume"):
            mark += " +resume"
        if c.get("eager_init"):
            mark += " +eager_init"
        rows.setdefault((c["model"], c["strategy"]), {}).setdefault(_label(c), []).append(mark)
    columns = ["none", *("+".join(s) for s in CALLBACK_SETS[1:])]
    lines = ["| model | strategy | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 2)]
    for (model, strategy), by in rows.items():
        lines.append(
            f"| {model} | {strategy} | " + " | ".join(", ".join(by.get(col, ["-"])) for col in columns) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="every cell (default: the CI cut)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "real_models_matrix-cpu.json"))
    parser.add_argument("--skip-ft", action="store_true")
    parser.add_argument("--only-ft", action="store_true", help="only the ft_hsdp cells")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), help="only these models' cells")
    parser.add_argument("--merge", action="store_true",
                        help="with --models: replace only these models' "
                             "cells in --out, keep the other models' cells")
    args = parser.parse_args()

    def pick(world: int) -> list[dict[str, Any]]:
        cells = full_cells(world) if args.full else ci_cells(world)
        return [c for c in cells if args.models is None or c["model"] in args.models]

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in (() if args.only_ft else (2, 4)):
            batch = run_cells(pick(world), world, Path(tmp), timeout=3600)
            for r in batch:
                r["problems"] = check_cell(r, reference_for(r, batch))
            results += batch
            print(
                f"{world} ranks: {sum(not r['problems'] for r in batch)}/{len(batch)} cells pass", flush=True
            )
        if not args.skip_ft:
            ft_models = [m for m in MODELS if MODELS[m].reference == "ddp"] if args.full else ["hf_llama"]
            ft_models = [m for m in ft_models if args.models is None or m in args.models]
            for model in ft_models:
                for precision in (PRECISIONS if args.full else ["32-true"]):
                    r = run_ft_cell(model, Path(tmp), precision=precision,
                                    callbacks=["sac_selective_op", "mfu",
                                               "straggler"] if precision != "32-true" else ())
                    r["problems"] = check_ft_cell(r)
                    r.pop("stderr_tail", None) if not r["problems"] else None
                    results.append(r)
                    print(
                        f"ft_hsdp {model} {precision}: {'ok' if not r['problems'] else r['problems']}",
                        flush=True,
                    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.merge and args.models and Path(args.out).exists():
        kept = [r for r in json.loads(Path(args.out).read_text()) if r["cell"]["model"] not in args.models]
        results = kept + results
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))
    failed = [(r["cell"], r["problems"]) for r in results if r["problems"]]
    for c, problems in failed:
        print(f"FAIL {c}: {problems}")
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
