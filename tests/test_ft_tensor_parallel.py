"""ft_hsdp with tensor parallelism inside each replica group (issue #26).

Each replica group is 1 (data-parallel) x 2 (tensor-parallel) ranks of the example Llama with its explicit
plan; torchft averages the gradients across groups. The ranks of a TP group share one data shard
(``data_parallel_rank``), and a killed group heals from its peer rank by rank: TP+FSDP DTensor shards of
parameters and optimizer state arrive through torchft's transport.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import WORKERS, run_python

WORKER = str(WORKERS / "ft_train.py")
TINY = ["--trainer.logger", "false", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar",
        "false",
        "--model.vocab_size", "64", "--data.vocab_size", "64", "--model.dim", "64", "--model.n_layers", "2",
        "--model.n_heads", "4", "--model.max_seq_len", "32", "--data.seq_len", "32", "--data.batch_size", "2",
        "--data.num_train", "64", "--data.num_val", "8"]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.multiprocess
def test_two_tp_groups_kill_heal_and_end_identical(tmp_path: Path) -> None:
    max_steps = 24
    events, out = tmp_path / "events", tmp_path / "out"
    run_python(["-m", "fsdp_strategies.ft", "--groups", "2", "--ranks-per-group", "2",
                "--heartbeat-timeout-ms",
                "1000", "--join-timeout-ms", "30000", "--events-dir", str(events), "--timeout", "380",
                "--min-replicas", "1", "--kill-at-steps", "1@8", "--max-restarts", "1",
                "--", WORKER, "fit", "--config", "configs/ft_hsdp_tp.yaml", *TINY,
                "--trainer.strategy.init_args.timeout_s", "10",
                "--trainer.strategy.init_args.connect_timeout_s", "5",
                "--trainer.max_steps", str(max_steps), "--trainer.enable_checkpointing", "false"],
               env={"FT_TEST_OUT": str(out), "FT_TEST_SLEEP_ALONE": "2.0"}, timeout=400)
    launcher = _jsonl(events / "launcher.jsonl")
    exits = [(e["group"], e["code"]) for e in launcher if e["event"] == "exit"]
    assert exits[0] == (1, -9) and sorted(exits[1:]) == [(0, 0), (1, 0)], exits
    for rank in (0, 1):
        a = torch.load(out / f"group0_rank{rank}.pt", weights_only=False)
        b = torch.load(out / f"group1_rank{rank}.pt", weights_only=False)
        assert b["incarnation"] == 1 and b["ft_stats"]["heals"] >= 1  # the restarted group healed
        assert a["global_step"] == b["global_step"] == max_steps
        # the TP ranks hold different halves, the groups the same ones: bit-identical shards after the heal
        assert a["shards"].keys() == b["shards"].keys() and any(k.startswith("opt0.") for k in a["shards"])
        for key in a["shards"]:
            assert torch.equal(a["shards"][key], b["shards"][key]), key
    # the two ranks of a TP group read one data shard and compute one loss; the groups read different shards
    for group in (0, 1):
        r0, r1 = (_jsonl(out / f"group{group}_rank{r}.jsonl") for r in (0, 1))
        pairs = [(x, y) for x, y in zip(r0, r1) if x["incarnation"] == y["incarnation"] == 0]
        assert pairs and all(x["batch_sum"] == y["batch_sum"] and x["loss"] == y["loss"] for x, y in pairs)
    first = [_jsonl(out / f"group{g}_rank0.jsonl")[0]["batch_sum"] for g in (0, 1)]
    assert first[0] != first[1], first
    halves = [torch.load(out / f"group0_rank{r}.pt", weights_only=False)["shards"] for r in (0, 1)]
    planned = [k for k in halves[0] if "attention.wq" in k and not k.startswith("opt")]
    assert planned and not torch.equal(halves[0][planned[0]], halves[1][planned[0]])
