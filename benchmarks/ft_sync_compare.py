"""Cross-group traffic and final loss of ``ft_hsdp``'s sync modes on the same data and steps (no faults).

Runs ``fsdp-strategies-ft`` (2 replica groups x 2 ranks, gloo, the example's tiny Llama) once per mode with
the test probe (``tests/workers/ft_train.py``), which counts the manager's cross-group all-reduces per step;
bytes come from the strategy's ``ft_stats["cross_group_bytes"]`` (this rank's reduced tensors). The final loss
is measured here, in one process, on the *same* held-out set for every mode: each group's full parameters
after the last step (identical across groups after the final outer sync; checked) evaluated on all
``--num-val`` validation sequences, next to the loss of the true Markov chain on those tokens (the floor no
model beats in expectation), so the comparison is also given as loss above that floor. Writes
``benchmarks/results/ft_sync-cpu.json`` and a PNG (training loss per step of each mode, bytes per step).

    PYTHONPATH=src:examples python benchmarks/ft_sync_compare.py [--steps 512] [--sync-every 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "ft_train.py"
MODEL = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
         "--trainer.enable_checkpointing",
         "false", "--model.vocab_size", "64", "--data.vocab_size", "64", "--model.dim", "64",
         "--model.n_layers", "2",
         "--model.n_heads", "4", "--model.max_seq_len", "32", "--data.seq_len", "32", "--data.batch_size",
         "4", "--data.num_train", "4096", "--trainer.limit_val_batches", "0",
         "--trainer.strategy.init_args.timeout_s", "30", "--trainer.strategy.init_args.init_sync", "false"]


#: the model and data of MODEL, for the offline evaluation
MODEL_CFG = {"vocab_size": 64, "dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32}
DATA_CFG = {"vocab_size": 64, "seq_len": 32, "num_train": 4096, "batch_size": 4}


def evaluate(full: dict[str, torch.Tensor], num_val: int, seed: int = 0) -> float:
    """Mean next-token loss of a model with parameters ``full`` over every validation sequence (one
    process)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from llama import LlamaLM, MarkovDataModule

    data = MarkovDataModule(**DATA_CFG, num_val=num_val, seed=seed)
    data.setup("fit")
    lm = LlamaLM(**MODEL_CFG)
    lm.configure_model()
    lm.load_state_dict(full)
    lm.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in data.val_dataloader():
            n = batch[:, 1:].numel()
            total += float(lm._loss(batch)) * n
            tokens += n
    return total / tokens


def bayes_floor(num_val: int, seed: int = 0) -> float:
    """The loss of the true chain on the same held-out tokens: ``-mean log p(x_t | x_{t-1})`` over every
    predicted token (order-1 chain; a successor listed twice counts with both probabilities). No model can do
    better on this set in expectation, so it is the floor the modes' excess loss is measured from."""
    sys.path.insert(0, str(ROOT / "examples"))
    from llama import MarkovDataModule, markov_chain

    data = MarkovDataModule(**DATA_CFG, num_val=num_val, seed=seed)
    data.setup("fit")
    h = data.hparams
    if h.order != 1:
        raise ValueError(f"bayes_floor: order={h.order}; only order-1 chains are handled")
    successors, probs = markov_chain(h.vocab_size, h.branching, h.concentration, h.seed, h.order)
    val = data.val_data
    prev, nxt = val[:, :-1], val[:, 1:]
    p = (probs[prev] * (successors[prev] == nxt.unsqueeze(-1))).sum(-1)
    return float(-p.clamp_min(1e-12).log().mean())


def run(mode: str, steps: int, sync_every: int, out: Path, num_val: int, seed: int = 0,
        outer: dict[str, float] | None = None) -> dict:
    """One mode on one seed: ``seed`` picks the Markov chain and its sequences (``--data.seed``) and offsets
    the configs' ``seed_everything`` (model initialisation, shuffling); seed 0 is the configs as they are."""
    config = {"every_step": "ft_hsdp", "diloco": "ft_hsdp_diloco", "local_sgd": "ft_hsdp_local_sgd"}[mode]
    args = [*MODEL, "--data.num_val", str(num_val), "--trainer.max_steps", str(steps), "--data.seed",
            str(seed)]
    if seed:
        args += ["--seed_everything", str(1234 + seed)]
    if mode == "diloco":
        for key, value in (outer or {}).items():  # its outer optimizer, when not the config's
            args += [f"--trainer.strategy.init_args.{key}", str(value)]
    out = out / f"seed{seed}"
    if mode != "every_step":
        args += ["--trainer.strategy.init_args.sync_every", str(sync_every)]
    env = {**os.environ, "FT_TEST_OUT": str(out / mode),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "examples"),
                                          os.environ.get("PYTHONPATH", "")])}
    t0 = time.time()
    # no restarts: a group that fails makes the comparison invalid, and says why
    proc = subprocess.run([sys.executable, "-m", "fsdp_strategies.ft", "--groups", "2", "--ranks-per-group",
                           "2", "--join-timeout-ms", "30000", "--max-restarts", "0", "--events-dir",
                           str(out / f"{mode}-events"), "--timeout", "1800", "--", str(WORKER), "fit",
                           "--config",
                           f"configs/{config}.yaml", *args], cwd=ROOT, env=env, capture_output=True,
                           text=True)
    if proc.returncode != 0:
        logs = "".join(f"\n--- {p.name} (tail)\n" + p.read_text(errors="replace")[-3000:]
                       for p in sorted((out / f"{mode}-events").glob("group*.log")))
        raise SystemExit(f"ft_sync_compare: the {mode} run failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}{logs}")
    wall = time.time() - t0
    dumps = {f"g{g}r{r}": torch.load(out / mode / f"group{g}_rank{r}.pt", weights_only=False)
             for g in (0, 1) for r in (0, 1)}
    records = [json.loads(line) for line in (out / mode / "group0_rank0.jsonl").read_text().splitlines()]
    bytes_rank = [d["ft_stats"]["cross_group_bytes"] for d in dumps.values()]
    group_diff = max(float((dumps["g0r0"]["full"][k] - dumps["g1r0"]["full"][k]).abs().max())
                     for k in dumps["g0r0"]["full"])
    return {"mode": mode, "seed": seed, "steps": steps,
            "sync_every": sync_every if mode != "every_step" else 1,
            "cross_group_bytes_per_step_per_rank": sum(bytes_rank) / len(bytes_rank) / steps,
            "cross_group_bytes_per_step_group": sum(d["ft_stats"]["cross_group_bytes"] for k,
                                                    d in dumps.items()
                                                    if k.startswith("g0")) / steps,
            "manager_allreduces_rank0": sum(r.get("allreduces", 0) for r in records),
            "inner_steps_with_traffic": sum(1 for r in records if r.get("allreduces", 0) > 0),
            "heldout_loss": evaluate(dumps["g0r0"]["full"], num_val, seed),
            "groups_max_abs_param_diff": group_diff,
            "final_train_loss_mean_last32": sum(r["loss"] for r in records[-32:]) / len(records[-32:]),
            "train_loss_group0": [r["loss"] for r in records], "wall_s": wall}


def plot(results: list[dict], floor: float, path: Path) -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    plt = common._pyplot()
    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for r in results:
        losses = r["train_loss_group0"]
        window = 16
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax_loss.plot(range(1, len(smooth) + 1), smooth,
                     label=f"{r['mode']} (held-out {r['heldout_loss']:.4f})")
    ax_loss.axhline(floor, color="k", ls=":", lw=1, label=f"true chain on the held-out set {floor:.4f}")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss, group 0 (16-step mean)")
    ax_loss.set_yscale("log")
    ax_loss.legend(fontsize=8)
    names = [r["mode"] for r in results]
    ax_bytes.bar(names, [r["cross_group_bytes_per_step_per_rank"] / 1e3 for r in results], color="tab:blue")
    ax_bytes.set_ylabel("cross-group kB per step per rank")
    fig.suptitle("ft_hsdp sync modes, 2 groups x 2 ranks, same data and steps (no faults)")
    return common.save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--modes", default="every_step,diloco,local_sgd")
    parser.add_argument(
        "--num-val", type=int, default=512, help="held-out sequences every mode is evaluated on"
    )
    parser.add_argument("--seeds", default="0",
                        help="comma-separated data/initialisation seeds; "
                             "every mode runs on each (0: the configs as is)")
    parser.add_argument(
        "--outer-lr", type=float, default=None, help="diloco's outer_lr (default: the config's)"
    )
    parser.add_argument("--outer-momentum", type=float, default=None,
                        help="diloco's outer_momentum (default: the config's)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ft_sync-cpu.json"))
    ns = parser.parse_args()
    seeds = [int(x) for x in ns.seeds.split(",")]
    outer = {
        k: v for k, v in (("outer_lr", ns.outer_lr), ("outer_momentum", ns.outer_momentum)) if v is not None
    }
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(m, ns.steps, ns.sync_every, Path(tmp), ns.num_val, seed, outer) for seed in seeds
                   for m in ns.modes.split(",")]
    floors = {seed: bayes_floor(ns.num_val, seed) for seed in seeds}
    for r in results:
        base = next((b for b in results if b["mode"] == "every_step" and b["seed"] == r["seed"]), None)
        if base is not None:
            r["bytes_ratio_vs_every_step"] = r["cross_group_bytes_per_step_per_rank"] / base[
                "cross_group_bytes_per_step_per_rank"]
            r["heldout_loss_vs_every_step"] = r["heldout_loss"] / base["heldout_loss"] - 1
            floor = floors[r["seed"]]
            r["excess_over_floor_vs_every_step"] = (r["heldout_loss"] - floor) / (
                base["heldout_loss"] - floor
            ) - 1
        print(json.dumps({k: v for k, v in r.items() if k != "train_loss_group0"}))
    by_mode = {}
    for m in ns.modes.split(","):
        rel = [
            r["heldout_loss_vs_every_step"]
            for r in results
            if r["mode"] == m and "heldout_loss_vs_every_step" in r
        ]
        if rel and m != "every_step":
            by_mode[m] = {"heldout_loss_vs_every_step_per_seed": rel, "median": statistics.median(rel),
                          "max": max(rel), "within_2pct_seeds": sum(1 for v in rel if v <= 0.02)}
            print(f"{m}: held-out loss vs every_step per seed {[f'{v:+.2%}' for v in rel]} "
                  f"(median {statistics.median(rel):+.2%}, "
                  f"{by_mode[m]['within_2pct_seeds']}/{len(rel)} within 2%)")
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    png = plot(
        [r for r in results if r["seed"] == seeds[0]], floors[seeds[0]], Path(ns.out).with_suffix(".png")
    )
    Path(ns.out).write_text(json.dumps({"suite": "ft_sync", "device": "cpu", "groups": 2,
                                        "ranks_per_group": 2, "command": " ".join(sys.argv), "seeds": seeds,
                                        "outer_overrides": outer, "bayes_floor": floors[seeds[0]],
                                        "bayes_floor_per_seed": floors, "num_val": ns.num_val,
                                        "png_path": png.name, "by_mode": by_mode, "results": results}) + "\n")


if __name__ == "__main__":
    main()
