"""Cross-group traffic and final loss of ``ft_hsdp``'s sync modes on the same data and steps (no faults).

Runs ``fsdp-strategies-ft`` (2 replica groups x 2 ranks, gloo, the example's tiny Llama) once per mode with
the test probe (``tests/workers/ft_train.py``), which counts the manager's cross-group all-reduces per step;
bytes come from the strategy's ``ft_stats["cross_group_bytes"]`` (this rank's reduced tensors), the final loss
is the validation loss of each group's model after the last step (identical across groups after the final
outer sync). Writes ``benchmarks/results/ft_sync-cpu.json``.

    PYTHONPATH=src:examples python benchmarks/ft_sync_compare.py [--steps 128] [--sync-every 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "ft_train.py"
MODEL = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing",
         "false", "--model.vocab_size", "64", "--data.vocab_size", "64", "--model.dim", "64", "--model.n_layers", "2",
         "--model.n_heads", "4", "--model.max_seq_len", "32", "--data.seq_len", "32", "--data.batch_size", "4",
         "--data.num_train", "4096", "--data.num_val", "64", "--trainer.limit_val_batches", "8",
         "--trainer.strategy.init_args.timeout_s", "30", "--trainer.strategy.init_args.init_sync", "false"]


def run(mode: str, steps: int, sync_every: int, out: Path) -> dict:
    config = {"every_step": "ft_hsdp", "diloco": "ft_hsdp_diloco", "local_sgd": "ft_hsdp_local_sgd"}[mode]
    args = [*MODEL, "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps)]
    if mode != "every_step":
        args += ["--trainer.strategy.init_args.sync_every", str(sync_every)]
    env = {**os.environ, "FT_TEST_OUT": str(out / mode),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")])}
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "fsdp_strategies.ft_launch", "--groups", "2", "--ranks-per-group", "2",
                    "--join-timeout-ms", "30000", "--events-dir", str(out / f"{mode}-events"), "--timeout", "1200",
                    "--", str(WORKER), "fit", "--config", f"configs/{config}.yaml", *args],
                   check=True, cwd=ROOT, env=env, capture_output=True)
    wall = time.time() - t0
    dumps = {f"g{g}r{r}": torch.load(out / mode / f"group{g}_rank{r}.pt", weights_only=False)
             for g in (0, 1) for r in (0, 1)}
    records = [json.loads(line) for line in (out / mode / "group0_rank0.jsonl").read_text().splitlines()]
    bytes_rank = [d["ft_stats"]["cross_group_bytes"] for d in dumps.values()]
    return {"mode": mode, "steps": steps, "sync_every": sync_every if mode != "every_step" else 1,
            "cross_group_bytes_per_step_per_rank": sum(bytes_rank) / len(bytes_rank) / steps,
            "cross_group_bytes_per_step_group": sum(d["ft_stats"]["cross_group_bytes"] for k, d in dumps.items()
                                                    if k.startswith("g0")) / steps,
            "manager_allreduces_rank0": sum(r.get("allreduces", 0) for r in records),
            "inner_steps_with_traffic": sum(1 for r in records if r.get("allreduces", 0) > 0),
            "val_loss": {k: d["val_loss"] for k, d in dumps.items()},
            "final_train_loss_mean_last8": sum(r["loss"] for r in records[-8:]) / 8, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--modes", default="every_step,diloco,local_sgd")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ft_sync-cpu.json"))
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(m, ns.steps, ns.sync_every, Path(tmp)) for m in ns.modes.split(",")]
    base = next((r for r in results if r["mode"] == "every_step"), None)
    for r in results:
        if base is not None:
            r["bytes_ratio_vs_every_step"] = r["cross_group_bytes_per_step_per_rank"] / base[
                "cross_group_bytes_per_step_per_rank"]
            r["val_loss_vs_every_step"] = r["val_loss"]["g0r0"] / base["val_loss"]["g0r0"] - 1
        print(json.dumps(r))
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps({"suite": "ft_sync", "device": "cpu", "groups": 2, "ranks_per_group": 2,
                                        "command": " ".join(sys.argv), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
