"""straggler suite: hierarchical / post-local SGD vs synchronous DDP under the hierarchical-SGD blog's
straggler model, and the StragglerDetector's overhead on a clean run. 4 ranks, interleaved.

    python benchmarks/run.py straggler            # or: python benchmarks/suites/straggler.py [--quick]
    python benchmarks/suites/straggler.py --ranks 16 --period 16 --steps 320 --reps 2 --contenders clean_ddp \
        sync_ddp post_local_sgd hierarchical_sgd clean_post_local_sgd   # -> straggler_16ranks-<device>.json

Straggler model (PyTorch blog "Straggler mitigation with hierarchical SGD"): every rank independently
stalls on a step with probability ``p`` (default 2%) for ``factor`` (default 20) times a normal step,
measured on the warm-up steps of the round's clean synchronous job, so all contenders of a round get
the same stall length. The stall is injected by ``fsdp_strategies.testing.StallInjector``; every
contender draws the same stall pattern (same seed). Its kind (``--stall-kind``) defaults to
``busy_wait``: the stalled rank spins for the stall's wall time, so on this shared CPU it keeps its
share of the cores and the other ranks do not run faster while it is away (a ``sleep`` would hand its
share to them, which flatters local SGD: on separate machines nobody gains from a stalled peer).

Contenders (the same model, data, optimizer and number of steps):
  sync_ddp          Lightning's ``ddp`` (synchronous gradient all-reduce every step)
  post_local_sgd    ``ddp_hooks`` comm_hook post_local_sgd, all ranks averaged every ``--period`` (16)
                    steps, no gradient all-reduce in between
  hierarchical_sgd  ``ddp_hooks`` comm_hook hierarchical_sgd, levels {period/4: 2, period: world} (pairs
                    every 4 steps, all ranks every 16), no gradient all-reduce in between
  clean_ddp / clean_ddp_detector   synchronous DDP without stalls, without / with the detector
  clean_post_local_sgd             post_local_sgd without stalls: the part of any speed-up that comes from
                                   skipping the gradient all-reduce rather than from hiding stalls
Measured: throughput (samples/s from the first measured step to the end of the last, all ranks joined),
the loss of the final (averaged) model on held-out data, the detector's own time (hooks + gathers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

SUITE = "straggler"
STALLED = ("sync_ddp", "post_local_sgd", "hierarchical_sgd")
CLEAN = ("clean_ddp", "clean_ddp_detector", "clean_post_local_sgd")
CONTENDERS = CLEAN + STALLED  # clean_ddp first: its warm-up step time sets the round's stall length
BATCH_PER_RANK = 8
RANKS = 4
PERIOD = 16
STALL_KINDS = ("busy_wait", "sleep")


def hierarchy_levels(period: int, world: int) -> dict[int, int]:
    """Pairs every ``period / 4`` steps, all ranks every ``period`` steps."""
    if world <= 2 or period < 4:
        return {period: world}
    return {period // 4: 2, period: world}


# ---------------------------------------------------------------------------------------------- worker
def _worker(ns: argparse.Namespace) -> None:
    """One job (started by torchrun): train ``ns.contender`` and write its numbers to ``ns.out``."""
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "src"), str(root / "examples")]
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fsdp_strategies import DDPHooksStrategy
    from fsdp_strategies.callbacks import StragglerDetector
    from fsdp_strategies.testing import StallInjector, StragglerInjection
    from llama import LlamaLM, MarkovDataModule

    size = common.size_config(ns.size)
    warmup, steps = ns.warmup, ns.steps
    stalls = ns.contender in STALLED
    injector = StallInjector(StragglerInjection(
        ranks=None, delay_s=ns.stall_s, probability=ns.p, start_step=warmup, seed=ns.seed,
        kind=ns.stall_kind)) if stalls else None

    class Clock(pl.Callback):
        """Times the measured steps; sets the stall length from the synchronous warm-up steps."""

        def __init__(self) -> None:
            self.step_ends: list[float] = []
            self.losses: list[float] = []
            self.t0 = self.t1 = 0.0

        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
        ) -> None:
            if trainer.global_step == warmup:
                normal = torch.tensor([_median(self.step_ends)], dtype=torch.float64)
                dist.all_reduce(normal, op=dist.ReduceOp.MAX)  # one agreed stall length on every rank
                if injector is not None and ns.stall_s <= 0:  # no length given: 'factor' x this job's step
                    assert injector.inject is not None
                    injector.inject.delay_s = float(normal) * ns.factor
                self.normal_step_s = float(normal)
                dist.barrier()
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any,
                               i: int) -> None:
            now = time.perf_counter()
            if trainer.global_step <= warmup:
                self.step_ends.append(now - getattr(self, "_prev", now))
            self._prev = now
            self.losses.append(float(out["loss"]))

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            dist.barrier()  # every rank has finished its steps
            self.t1 = time.perf_counter()

    world = int(os.environ["WORLD_SIZE"])
    if ns.contender in ("sync_ddp", "clean_ddp", "clean_ddp_detector"):
        strategy: Any = "ddp"
    elif ns.contender in ("post_local_sgd", "clean_post_local_sgd"):
        strategy = DDPHooksStrategy(comm_hook="post_local_sgd", local_sgd_period=ns.period,
                                    local_sgd_warmup=warmup, local_group_size=1)
    else:
        strategy = DDPHooksStrategy(comm_hook="hierarchical_sgd",
                                    hierarchy_levels=hierarchy_levels(ns.period, world),
                                    local_sgd_warmup=warmup, local_group_size=1)
    clock = Clock()
    callbacks: list[pl.Callback] = [clock]
    if injector is not None:
        callbacks.append(injector)
    detector = (StragglerDetector(window=20, report_path=str(Path(ns.out).with_name("straggler_report.json")))
                if ns.contender == "clean_ddp_detector" else None)
    if detector is not None:
        callbacks.append(detector)
    pl.seed_everything(ns.seed)
    model = LlamaLM(**size["model"], max_seq_len=size["seq_len"], warmup_steps=2)
    data = MarkovDataModule(vocab_size=size["model"]["vocab_size"], seq_len=size["seq_len"],
                            batch_size=BATCH_PER_RANK, num_train=8192, num_val=256)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=warmup + steps,
                         logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=callbacks)
    trainer.fit(model, data)
    # loss of the final model (our strategy averaged the parameters at train end) on held-out data
    data.setup("fit")
    assert data.val_data is not None
    model.eval()
    with torch.no_grad():
        batch = data.val_data[:64]
        logits = model(batch[:, :-1])
        val = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)).item()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    spread = flat.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    mine = {"losses": clock.losses}
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, mine)
    if dist.get_rank() == 0:
        elapsed = clock.t1 - clock.t0
        result = {
            "contender": ns.contender, "elapsed_s": elapsed, "steps": steps,
            "samples_per_s": steps * BATCH_PER_RANK * world / elapsed, "normal_step_s": clock.normal_step_s,
            "stall_s": injector.inject.delay_s if injector is not None and injector.inject else 0.0,
            "val_loss": val, "params_identical_across_ranks": bool((spread == flat).all()),
            "train_loss_last10": sum(sum(r["losses"][-10:]) / 10 for r in per_rank) / world,
            "detector": detector.report() if detector is not None else None,
        }
        if detector is not None:
            result["detector"].pop("windows", None)
        Path(ns.out).write_text(json.dumps(result, default=float))
    dist.barrier()
    dist.destroy_process_group()  # a rank leaving with gloo connections open can abort a peer (SIGABRT)


def _median(values: list[float]) -> float:
    vals = sorted(values[1:]) or [0.0]  # the first step includes start-up
    return vals[len(vals) // 2]


# ---------------------------------------------------------------------------------------------- model
def predicted_speedup(
    p: float, factor: float, ranks: int, period: int, trials: int = 20000, seed: int = 0
) -> float:
    """Expected sync-DDP time / local-SGD time under the stall model (Monte Carlo; compute time 1 per step).

    Synchronous: every step waits for the slowest rank. Local SGD with a global sync every ``period``
    steps: a window takes ``period`` + the largest total stall of any one rank in it. Upper bound for
    ``post_local_sgd`` (no communication cost counted); hierarchical SGD sits between the two.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    stalled = rng.random((trials, period, ranks)) < p
    extra = factor - 1
    sync = period + extra * stalled.any(axis=2).sum(axis=1)
    local = period + extra * stalled.sum(axis=1).max(axis=1)
    return float(sync.mean() / local.mean())


# ---------------------------------------------------------------------------------------------- suite
def _add_options(parser: argparse.ArgumentParser) -> None:
    """This suite's own flags (``run``'s keyword arguments of the same names)."""
    parser.add_argument("--p", type=float, default=0.02, help="stall probability per rank and step")
    parser.add_argument("--factor", type=float, default=20.0, help="stall length in normal steps")
    parser.add_argument("--period", type=int, default=PERIOD, help="global averaging period of local SGD")
    parser.add_argument("--stall-kind", default="busy_wait", choices=STALL_KINDS)


def run(quick: bool, out_dir: Path, sizes: list[str] | None = None, ranks: list[int] | None = None,
        reps: int | None = None, steps: int | None = None, warmup: int | None = None,
        precision: str | None = None, contenders: list[str] | None = None, show_progress: bool = True,
        p: float = 0.02, factor: float = 20.0, period: int = PERIOD,
        stall_kind: str = "busy_wait") -> dict[str, Any]:
    size = (sizes or ["tiny"])[0]
    n = (ranks or [RANKS])[0]
    reps = reps or (1 if quick else 2)
    steps = steps or (24 if quick else 320)
    warmup = warmup or (4 if quick else 6)
    if stall_kind not in STALL_KINDS:
        raise ValueError(f"--stall-kind {stall_kind!r} is unknown. Fix: one of {list(STALL_KINDS)}.")
    if period < 1:
        raise ValueError(f"--period {period} is invalid. Fix: a positive number of steps, e.g. 16.")
    names = [c for c in CONTENDERS if not contenders or c in contenders]
    if "clean_ddp" not in names and any(c in STALLED for c in names):
        names.insert(0, "clean_ddp")  # its warm-up steps set the stall length
    levels = hierarchy_levels(period, n)
    config = {"size": size, "model": common.size_config(size), "ranks": n, "reps": reps, "steps": steps,
              "warmup": warmup, "precision": precision or "32-true", "stall_probability_per_rank_step": p,
              "stall_factor": factor, "stall_kind": stall_kind, "batch_per_rank": BATCH_PER_RANK,
              "post_local_sgd_period": period, "hierarchy_levels": levels,
              "contenders": names, "quick": quick,
              "throughput": "global samples / wall time from the first measured step to the end of the last "
                            "(barrier on every rank), warm-up excluded"}
    result = common.header(SUITE, config)

    stall_by_round: dict[int, float] = {}
    flakes: list[str] = []

    def run_one(name: str, rep: int) -> dict[str, Any]:
        args = ["--worker", "--contender", name, "--size", size, "--steps", str(steps), "--warmup",
                str(warmup), "--p", str(p), "--factor", str(factor), "--seed", str(rep), "--stall-s",
                str(stall_by_round.get(rep, 0)), "--period", str(period), "--stall-kind", stall_kind]
        try:
            out = common.run_worker(Path(__file__).resolve(), n, args, timeout=1200)
        # a job killed by a signal on the shared machine: one retry, recorded
        except common.WorkerError as exc:
            flakes.append(f"{name} round {rep}: {str(exc)[-400:]}")
            out = common.run_worker(Path(__file__).resolve(), n, args, timeout=1200)
        if name == "clean_ddp":
            stall_by_round[rep] = out["normal_step_s"] * factor
        return out

    bar = common.progress(len(names) * reps, SUITE) if show_progress else None
    try:
        runs = common.interleave(names, reps, run_one, bar)
    finally:
        if bar is not None:
            bar.close()
    per: dict[str, Any] = {}
    for name, rs in runs.items():
        ok = [r for r in rs if isinstance(r, dict)]
        # per round, None where the job failed, so rounds stay paired
        per[name] = {"runs": ok, "errors": [str(r) for r in rs if not isinstance(r, dict)],
                     "samples_per_s": [r["samples_per_s"] if isinstance(r, dict) else None for r in rs],
                     "elapsed_s": [r["elapsed_s"] if isinstance(r, dict) else None for r in rs],
                     "val_loss": [r["val_loss"] if isinstance(r, dict) else None for r in rs],
                     "median_samples_per_s": common.median(r["samples_per_s"] for r in ok),
                     "median_val_loss": common.median(r["val_loss"] for r in ok)}
    summary = []
    base = per.get("sync_ddp", {})
    for name in ("post_local_sgd", "hierarchical_sgd"):
        if name not in per or not base.get("runs") or not per[name]["runs"]:
            continue
        ratio = common.paired_ratio(per[name]["elapsed_s"], base["elapsed_s"])
        loss_rel = [abs(a / b - 1) for a, b in zip(per[name]["val_loss"], base["val_loss"]) if a and b]
        summary.append({"ratio": f"{name}/sync_ddp time for the same steps", "value": ratio["value"],
                        "per_round": ratio["per_round"], "target": 0.5,
                        "met": None if ratio["value"] is None else ratio["value"] <= 0.5,
                        "throughput_x": None if not ratio["value"] else 1 / ratio["value"]})
        summary.append({"ratio": f"|{name}/sync_ddp final val loss - 1|", "value": common.median(loss_rel),
                        "per_round": loss_rel, "target": 0.02,
                        "met": None if not loss_rel else (common.median(loss_rel) or 0) <= 0.02})
    if per.get("clean_ddp", {}).get("runs") and per.get("clean_post_local_sgd", {}).get("runs"):
        ratio = common.paired_ratio(per["clean_post_local_sgd"]["elapsed_s"], per["clean_ddp"]["elapsed_s"])
        summary.append({"ratio": "clean_post_local_sgd/clean_ddp time "
                                 "(no stalls: the all-reduce saving alone)",
                        "value": ratio["value"], "per_round": ratio["per_round"], "target": None, "met": None,
                        "throughput_x": None if not ratio["value"] else 1 / ratio["value"]})
    if per.get("clean_ddp", {}).get("runs") and per.get("clean_ddp_detector", {}).get("runs"):
        ratio = common.paired_ratio(per["clean_ddp_detector"]["elapsed_s"], per["clean_ddp"]["elapsed_s"])
        own = [r["detector"]["detector_overhead_frac"] for r in per["clean_ddp_detector"]["runs"]]
        summary.append({"ratio": "detector overhead: clean time with / without - 1",
                        "value": None if ratio["value"] is None else ratio["value"] - 1,
                        "per_round": [x - 1 for x in ratio["per_round"]], "target": 0.01,
                        "met": None if ratio["value"] is None else ratio["value"] - 1 <= 0.01})
        summary.append({"ratio": "detector own wall time / train time "
                                 "(hooks + gathers, incl. waiting for a core)",
                        "value": common.median(own), "per_round": own, "target": 0.01,
                        "met": (common.median(own) or 1) <= 0.01})
        cpu = [r["detector"]["detector_cpu_frac"] for r in per["clean_ddp_detector"]["runs"]]
        summary.append({"ratio": "detector own CPU time / train time (its code, this thread)",
                        "value": common.median(cpu), "per_round": cpu, "target": 0.01,
                        "met": (common.median(cpu) or 1) <= 0.01})
    result["flaky_jobs_retried"] = flakes
    result["contenders"] = per
    result["summary"] = summary
    result["model_prediction"] = {
        "post_local_sgd_upper_bound": predicted_speedup(p, factor, n, period),
        "infinite_period_upper_bound": (1 + (factor - 1) * (1 - (1 - p) ** n)) / (1 + (factor - 1) * p),
        "upper_bound_by_ranks_period_8_16_32": {
            r: [predicted_speedup(p, factor, r, q, trials=4000) for q in (8, 16, 32)]
            for r in (4, 16, 64, 256)
        },
        "note": "Monte Carlo of the stall model with free "
        "communication and no CPU sharing: the most a local-SGD "
        "global period can gain by hiding stalls (a synchronous step waits for any stalled rank, a local "
        "window only for the rank with the most stall time in it). The gain grows with the rank count: "
        "the blog's 2.08-3.25x were at 64-256 GPUs, where almost every synchronous step holds a stall.",
    }
    path = common.write_result(SUITE if n == RANKS else f"{SUITE}_{n}ranks", result, Path(out_dir))
    result["json_path"] = str(path)
    result["png_path"] = str(_plot(result, path.with_suffix(".png")))
    return result


def _plot(result: dict[str, Any], path: Path) -> Path:
    plt = common._pyplot()
    per = result["contenders"]
    names = [n for n in per if per[n]["runs"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in (
        (axes[0], "samples_per_s", "throughput (samples/s)"),
        (axes[1], "val_loss", "final val loss"),
    ):
        common.bars_with_points(ax, names, [common.median(per[n][key]) for n in names],
                                [per[n][key] for n in names],
                                ["C1" if n in STALLED else "C0" for n in names], ylabel=label, rotation=20,
                                fontsize=8)
    cfg = result["config"]
    fig.suptitle(f"straggler: {cfg['ranks']} ranks, stalls p={cfg['stall_probability_per_rank_step']} x"
                 f"{cfg['stall_factor']} step, {cfg['steps']} steps, {result['device_name']}", fontsize=9)
    return common.save_figure(fig, path)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker(common.parse_worker_args((("--contender", str), ("--size", str), ("--steps", int),
                                          ("--warmup", int),
                                     ("--p", float), ("--factor", float), ("--seed", int),
                                     ("--stall-s", float),
                                     ("--out", str), ("--period", int), ("--stall-kind", str))))
    else:
        common.suite_main(run, __doc__ or "", add_options=_add_options)
