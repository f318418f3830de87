"""Gradient accumulation under ``fsdp2`` / ``hsdp`` (``accumulation="sharded"``, the default), real processes.

One job per strategy checks three things at once. Every rank records, per micro-batch
(``tests/workers/fsdp_train.py --probe-accumulation``):

* the gradient bytes FSDP2 holds right after the micro-batch's backward, read from FSDP2's own state
  (``fsdp_strategies.testing.fsdp_gradient_bytes``: the sharded ``param.grad``, whole gradients kept
  between backwards, reduce-scattered gradients waiting for the cross-replica all-reduce) -- at most 1/N
  of the full model's gradient bytes, N the shard degree, at every point;
* the loss -- averaged over the ranks, equal to Lightning's ``ddp`` with the same accumulation and
  global batch;
* the collectives each mesh dimension's process group ran (``ProcessGroup.allreduce`` and its
  reduce-scatter wrapped).

All runs (gloo, fp32): ``accumulate_grad_batches=4``, 2 optimizer steps, 16 samples per micro-batch in all
(2 ranks x 8 or 4 ranks x 4: the distributed sampler gives both the same 16 samples).
``accumulation="no_sync"`` is checked in ``tests/test_fsdp_hsdp.py`` (whole gradients between
micro-batches, one reduction per step).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import WORKERS, run_python

WORKER = str(WORKERS / "fsdp_train.py")
ACCUMULATE, STEPS, GLOBAL_BATCH = 4, 2, 16
#: sharded sizes are padded to a multiple of the shard degree
PADDING = 1.02


def _run(tmp_path: Path, strategy: str, devices: int, *args: str) -> list[dict]:
    out = tmp_path / f"{strategy}.pt"
    batch = str(GLOBAL_BATCH // devices)
    run_python([WORKER, "--strategy", strategy, "--devices", str(devices), "--batch", batch,
                "--steps", str(STEPS), "--accumulate", str(ACCUMULATE), "--probe-accumulation", "1",
                "--out", str(out), *args], timeout=300)
    ranks = torch.load(out, weights_only=False)["ranks"]
    assert all(len(rank["micro_batches"]) == ACCUMULATE * STEPS for rank in ranks)
    return ranks


def _losses(ranks: list[dict]) -> torch.Tensor:
    """The loss of every micro-batch, averaged over the ranks (the global batch's loss)."""
    rows = [[row["loss"] for row in rank["micro_batches"]] for rank in ranks]
    return torch.tensor(rows, dtype=torch.float64).mean(0)


@pytest.fixture(scope="module")
def ddp_losses(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    return _losses(_run(tmp_path_factory.mktemp("ddp"), "ddp", 2))


def _held_fraction(rank: dict, row: dict) -> dict[str, float]:
    return {kind: n / rank["full_grad_bytes"] for kind, n in row["held"].items()}


def _check_losses(ranks: list[dict], ddp_losses: torch.Tensor) -> None:
    losses = _losses(ranks)
    rel = float(((losses - ddp_losses).abs() / ddp_losses.abs()).max())
    assert rel < 1e-5, f"losses differ from ddp's by {rel:.2e} (relative)\n{losses}\n{ddp_losses}"
    assert losses[ACCUMULATE:].mean() < losses[:ACCUMULATE].mean()  # the first step changed the model


@pytest.mark.multiprocess
def test_fsdp2_accumulation_holds_only_sharded_gradients_and_equals_ddp(tmp_path: Path,
                                                                         ddp_losses: torch.Tensor) -> None:
    ranks = _run(tmp_path, "fsdp2", 2)
    for rank in ranks:
        units = rank["fsdp_units"]
        assert units == 3  # 2 blocks + root
        for i, row in enumerate(rank["micro_batches"]):
            held = _held_fraction(rank, row)
            # between micro-batches too: no whole gradient outlives its backward
            assert held["unsharded"] == 0 and held["pending_all_reduce"] == 0, (i, held)
            assert held["sharded"] == pytest.approx(1 / 2, rel=PADDING - 1), (i, held)
            # every micro-batch reduce-scatters (that is what keeps the gradients sharded)
            assert row["calls"].get("reduce_scatter@shard") == units, (i, row["calls"])
    _check_losses(ranks, ddp_losses)


@pytest.mark.multiprocess
def test_hsdp_2x2_accumulation_all_reduces_across_replicas_once_per_step_and_equals_ddp(
        tmp_path: Path, ddp_losses: torch.Tensor) -> None:
    ranks = _run(tmp_path, "hsdp", 4, "--replicate", "2")
    assert len(ranks) == 4
    for rank in ranks:
        units = rank["fsdp_units"]
        assert units == 3
        rows = rank["micro_batches"]
        for i, row in enumerate(rows):
            held, last = _held_fraction(rank, row), i % ACCUMULATE == ACCUMULATE - 1
            # shard degree 2: each rank holds half the gradients, reduce-scattered inside its shard group;
            # before the last micro-batch they wait (summed) for the cross-replica all-reduce
            assert held["unsharded"] == 0, (i, held)
            assert sum(held.values()) <= (1 / 2) * PADDING, (i, held)
            waiting = held["sharded" if last else "pending_all_reduce"]
            assert waiting == pytest.approx(1 / 2, rel=PADDING - 1), (i, held)
            assert row["calls"].get("reduce_scatter@shard") == units, (i, row["calls"])
            # the cross-replica all-reduce: once per FSDP unit per optimizer step, with the last micro-batch
            assert row["calls"].get("allreduce@replicate", 0) == (units if last else 0), (i, row["calls"])
        for step in range(STEPS):
            window = rows[step * ACCUMULATE:(step + 1) * ACCUMULATE]
            assert sum(row["calls"].get("allreduce@replicate", 0) for row in window) == units
    _check_losses(ranks, ddp_losses)
