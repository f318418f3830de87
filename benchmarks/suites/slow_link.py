"""slow_link suite: ``ft_hsdp`` across separate hosts whose link is really slow -- ``tbf``-shaped to 10
Mbit/s -- comparing every-step cross-group reduction with local SGD, DiLoCo and ``straggler_sync``. Needs root
(network namespaces, ``tests/support/netns.py``).

    python benchmarks/suites/slow_link.py                 # 2 groups, 64 steps, 2 rounds (~8 min on 2 cores)
    python benchmarks/suites/slow_link.py --quick         # 32 steps, 1 round
    python benchmarks/run.py slow_link --rate-mbit 10

Layout: three namespace hosts on a bridge (own addresses 10.77.0.1-3): the torchft lighthouse on host 0,
replica group 0 (torchrun, 1 rank) on host 1, replica group 1 on host 2. Host 2's link is shaped with ``tbf``
to ``--rate-mbit`` in each direction, so every byte between the groups crosses a link of that rate; inside a
host nothing is shaped. Every manager advertises its host's address and gloo uses the host's interface.

Contenders (same tiny Llama, data, optimizer, steps; the shipped configs with the model shrunk, one rank per
group):
  every_step        ``configs/ft_hsdp.yaml``: gradients averaged across groups every step
  local_sgd         ``configs/ft_hsdp_local_sgd.yaml``: parameters averaged every ``sync_every`` (8) steps
  diloco            ``configs/ft_hsdp_diloco.yaml``: outer Nesterov step every 8 steps
  straggler_sync    ``configs/ft_hsdp_straggler_sync.yaml``: starts every-step, its StragglerDetector measures
                    the cross-group cost and switches every group to DiLoCo when it exceeds the threshold
  every_step_fast   ``every_step`` with the link not shaped (the reference: what the slow link costs)
Measured per run: bytes each group's host sent over its link per committed step (the interface counter,
start-up and heal traffic included), committed samples / s from the first committed step of any group to the
last (the events files), each group's train loss (mean of the last 8 logged steps) and the switches
``straggler_sync`` made.
"""

from __future__ import annotations

import csv
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

ROOT = common.ROOT
sys.path.insert(0, str(ROOT / "tests"))
from fsdp_strategies.ft.protocol import EventLog  # noqa: E402
from support import netns  # noqa: E402  (tests/support/netns.py: the namespace hosts)

SUITE = "slow_link"
CONTENDERS = ("every_step", "local_sgd", "diloco", "straggler_sync", "every_step_fast")
CONFIGS = {"every_step": "ft_hsdp.yaml", "local_sgd": "ft_hsdp_local_sgd.yaml",
           "diloco": "ft_hsdp_diloco.yaml",
           "straggler_sync": "ft_hsdp_straggler_sync.yaml", "every_step_fast": "ft_hsdp.yaml"}
GROUPS = 2
BATCH = 2
RDZV_PORT, LIGHTHOUSE_PORT = 29400, 29510
MODEL = ["--model.vocab_size=64", "--data.vocab_size=64", "--model.dim=64", "--model.n_layers=2",
         "--model.n_heads=4",
         "--model.max_seq_len=32", "--data.seq_len=32", f"--data.batch_size={BATCH}", "--data.num_train=8192",
         "--data.num_val=8"]


def _events(path: Path) -> list[dict[str, Any]]:
    """A group's events file as the launcher reads it (a line cut short by a kill is skipped; no file:
    none)."""
    return list(EventLog(path).records())


def _losses(log_dir: Path) -> list[float]:
    rows: list[float] = []
    for path in sorted(log_dir.rglob("metrics.csv")):
        with path.open() as fh:
            rows += [float(r["train_loss"]) for r in csv.DictReader(fh) if r.get("train_loss")]
    return rows


def _group_cmd(host: netns.Host, group: int, config: str, steps: int, work: Path) -> list[str]:
    script = ["fit", "--config", str(ROOT / "configs" / config), "--trainer.devices=1",
              f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
              "--trainer.enable_progress_bar=false",
              "--trainer.enable_model_summary=false", "--trainer.enable_checkpointing=false",
              "--trainer.log_every_n_steps=1", "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
              f"--trainer.logger.init_args.save_dir={work / f'logs{group}'}",
              "--trainer.logger.init_args.name=csv",
              f"--trainer.strategy.init_args.hostname={host.ip}", "--trainer.strategy.init_args.timeout_s=60",
              *MODEL]
    return [sys.executable, "-m", "torch.distributed.run", f"--local-addr={host.ip}", "--rdzv-conf=is_host=1",
            "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={host.ip}:{RDZV_PORT}",
            f"--rdzv-id=slow-link-{group}", "--max-restarts=0", str(ROOT / "examples" / "train_llama.py"),
            *script]


def run_job(hosts: netns.Hosts, work: Path, config: str, steps: int, rate_mbit: float | None, timeout: float,
            groups: int = GROUPS, name: str = "") -> dict[str, Any]:
    """One ft_hsdp job: the lighthouse on host 0, group g (1 rank, ``configs/CONFIG``) on host g+1, the last
    group's host link shaped to ``rate_mbit`` (None: not shaped). Returns the run's measurements (see above);
    ``straggler_switch`` runs its 4-group jobs through here too."""
    from support import processes

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    shaped = rate_mbit is not None
    if rate_mbit is not None:
        hosts.shape(hosts[groups], rate_mbit)
    else:
        hosts.unshape(hosts[groups])
    env_base = common.worker_env({"OMP_NUM_THREADS": "1"})
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        env_base.pop(key, None)
    jobs: dict[str, processes.Job] = {}
    logs = {}
    try:
        lighthouse = [str(Path(sys.executable).parent / "torchft_lighthouse"), f"--min_replicas={groups}",
                      f"--bind=[::]:{LIGHTHOUSE_PORT}", "--heartbeat_timeout_ms=5000"]
        logs["lighthouse"] = (work / "lighthouse.log").open("wb")
        jobs["lighthouse"] = hosts.start(hosts[0], lighthouse, env=env_base, stdout=logs["lighthouse"],
                                         stderr=subprocess.STDOUT)
        sent_before = {g: hosts.tx_bytes(hosts[g + 1]) for g in range(groups)}
        t0 = time.monotonic()
        for g in range(groups):
            host = hosts[g + 1]
            env = {**env_base, **host.env(), "TORCHFT_LIGHTHOUSE": f"http://{hosts[0].ip}:{LIGHTHOUSE_PORT}",
                   "REPLICA_GROUP_ID": str(g), "NUM_REPLICA_GROUPS": str(groups),
                   "FSDP_STRATEGIES_FT_EVENTS": str(work / f"group{g}.jsonl")}
            logs[f"group{g}"] = (work / f"group{g}.log").open("wb")
            jobs[f"group{g}"] = hosts.start(host, _group_cmd(host, g, config, steps, work), env=env,
                                            cwd=str(ROOT), stdout=logs[f"group{g}"], stderr=subprocess.STDOUT)
        codes = {}
        for g in range(groups):
            codes[g] = jobs[f"group{g}"].wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        wall = time.monotonic() - t0
        sent = {g: hosts.tx_bytes(hosts[g + 1]) - sent_before[g] for g in range(groups)}
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{name}: groups still running after {timeout} s (logs in {work})") from None
    finally:
        for job in jobs.values():
            job.kill_tree()
        for fh in logs.values():
            fh.close()
    if any(codes.values()):
        tail = "".join(
            (work / f"group{g}.log").read_text(errors="replace")[-3000:] for g in codes if codes[g]
        )
        raise RuntimeError(f"{name}: groups exited {codes} (logs in {work})\n{tail}")
    timelines = {g: _events(work / f"group{g}.jsonl") for g in range(groups)}
    points = [
        (r["t"], r["step"]) for tl in timelines.values() for r in tl if r.get("committed") and "step" in r
    ]
    t_first, t_last = min(t for t, _ in points), max(t for t, _ in points)
    s_first, s_last = min(s for _, s in points), max(s for _, s in points)
    committed = s_last - s_first
    losses = {g: _losses(work / f"logs{g}") for g in range(groups)}
    switches = [
        {"to": r["switch"], "step": r["switch_step"], "cost": r["cost"]}
        for r in timelines[0]
        if "switch" in r
    ]
    return {"samples_per_s": committed * BATCH * groups / (t_last - t_first), "committed_steps": committed,
            "seconds": t_last - t_first, "wall_s": wall, "final_step": s_last,
            "bytes_sent_per_step": {g: sent[g] / max(1, s_last) for g in range(groups)},
            "bytes_sent": sent,
            "loss_last8": {g: statistics.fmean(v[-8:]) if v else None for g, v in losses.items()},
            "losses_group0": losses[0], "switches": switches, "shaped": shaped}


def run(quick: bool, out_dir: Path, steps: int | None = None, reps: int | None = None,
        contenders: list[str] | None = None, rate_mbit: float | None = None, **_: Any) -> dict[str, Any]:
    reason = netns.unavailable()
    if reason:
        raise SystemExit(f"slow_link: network-namespace hosts cannot be built here: {reason}")
    steps = common.pick(steps, quick, 32, 64)
    if steps % 8:
        raise SystemExit(f"slow_link: --steps={steps} must be a multiple of sync_every (8). Fix: e.g. 64.")
    reps = common.pick(reps, quick, 1, 2)
    rate_mbit = common.pick(rate_mbit, quick, 10.0, 10.0)
    names = [n for n in CONTENDERS if not contenders or n in contenders]
    work = Path(out_dir) / f"{SUITE}-work"
    bar = common.progress(len(names) * reps, SUITE)
    with netns.Hosts(3) as hosts:
        rounds = common.interleave(names, reps, lambda name, rep: run_job(
            hosts, work / f"{name}-{rep}", CONFIGS[name], steps,
            None if name == "every_step_fast" else rate_mbit, 600.0, name=name), bar)
    bar.close()
    figures: dict[str, Any] = {}
    for name in names:
        ok = [r for r in rounds[name] if isinstance(r, dict)]
        figures[name] = {
            "samples_per_s": [r["samples_per_s"] for r in ok],
            "median_samples_per_s": statistics.median(r["samples_per_s"] for r in ok) if ok else None,
            "bytes_per_step": [statistics.fmean(r["bytes_sent_per_step"].values()) for r in ok],
            "loss_last8": [statistics.fmean(v for v in r["loss_last8"].values()
                                            if v is not None) for r in ok],
            "switches": [r["switches"] for r in ok], "runs": ok}
    summary: list[dict[str, Any]] = []
    base = "every_step"
    for name in names:
        fig = figures[name]
        if fig["bytes_per_step"]:
            summary.append({"ratio": f"{name}: bytes each group's host sent per committed step",
                            "value": statistics.median(fig["bytes_per_step"]), "met": None})
        if fig["loss_last8"]:
            summary.append({"ratio": f"{name}: train loss, mean of the last 8 steps", "value":
                            statistics.median(fig["loss_last8"]), "met": None})
        if name != base and base in names:
            ratio = common.paired_ratio(
                [r["samples_per_s"] if isinstance(r, dict) else None for r in rounds[name]],
                [r["samples_per_s"] if isinstance(r, dict) else None for r in rounds[base]])
            figures[f"{name}_vs_{base}"] = ratio
            if ratio.get("value") is not None:
                summary.append({"ratio": f"{name} / {base} throughput (committed samples/s)",
                                "value": ratio["value"], "met": None, "rounds": ratio["rounds_paired"]})
    config = {"groups": GROUPS, "ranks_per_group": 1, "steps": steps, "reps": reps, "batch_per_rank": BATCH,
              "link": {"shaped_host": "group 1's host", "qdisc": "tbf", "rate_mbit": rate_mbit,
                       "directions": "both"},
              "layout": "lighthouse on host 0, group g on host g+1 (network namespaces on a bridge)",
              "configs": CONFIGS, "model": MODEL, "quick": quick,
              "note": "2 replica groups x 1 rank on separate "
                      "network-namespace hosts; group 1's link tbf-shaped to "
                      f"{rate_mbit:g} Mbit/s (every_step_fast: not "
                      f"shaped); {steps} steps; the shipped configs."}
    result = {**common.header(SUITE, config), "figures": figures, "summary": summary,
              "failures": rounds.failures}
    result["png_path"] = str(
        _plot(figures, names, rate_mbit, Path(out_dir) / f"{SUITE}-{common.device_slug()}.png")
    )
    result["json_path"] = str(common.write_result(SUITE, result, Path(out_dir)))
    shutil.rmtree(work, ignore_errors=True)
    return result


def _plot(figures: dict[str, Any], names: list[str], rate_mbit: float, path: Path) -> Path:
    plt = common._pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    colors = ["#c44", "#48c", "#4a4", "#c84", "#888"][: len(names)]
    common.bars_with_points(axes[0], names, [figures[n]["median_samples_per_s"] for n in names],
                            [figures[n]["samples_per_s"] for n in names], colors,
                            ylabel="committed samples / s")
    common.bars_with_points(axes[1], names, [statistics.median(figures[n]["bytes_per_step"]) / 1e3
                                             if figures[n]["bytes_per_step"] else None for n in names],
                            [[b / 1e3 for b in figures[n]["bytes_per_step"]] for n in names], colors,
                            ylabel="kB sent per committed step (per host)")
    for name, color in zip(names, colors, strict=True):
        for run in figures[name]["runs"][:1]:
            axes[2].plot(
                range(1, len(run["losses_group0"]) + 1), run["losses_group0"], color=color, label=name, lw=1
            )
    axes[2].set_xlabel("step (group 0)")
    axes[2].set_ylabel("train loss")
    axes[2].legend(fontsize=7)
    for ax in axes[:2]:
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.suptitle(
        f"ft_hsdp, 2 groups on separate hosts, cross-group link tbf {rate_mbit:g} Mbit/s", fontsize=9
    )
    fig.tight_layout()
    return common.save_figure(fig, path)


def _add_options(parser: Any) -> None:
    parser.add_argument(
        "--rate-mbit", type=float, default=None, help="the shaped link's rate (Mbit/s, default 10)"
    )


if __name__ == "__main__":
    common.suite_main(run, (__doc__ or "").split("\n\n")[0], add_options=_add_options)
