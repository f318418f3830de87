"""Tensor parallelism and the rest of the package (issue #26, item 3): checkpoints, export, FLOPs,
accumulation, precision, activation checkpointing, compile.

Every run is ``tests/workers/tp_train.py`` on 4 ranks with the real-models matrix's HF Llama (GQA; built in
``__init__`` from one seed, so every run starts from the same weights), AdamW with a scheduler, clipping on.

Checkpoints across meshes: a 2 x 2 run (TP 2, 4 samples per data-parallel rank) and a 4 x 1 run (2 samples per
rank) train on the same global batches (the sampler's rank d of R reads d, d+R, ...; 8 samples a step either
way), so the mean over data-parallel ranks of each step's loss is the same in both and their gradients agree.
A checkpoint written under one mesh is resumed under the other (DCP reshards the DTensors, Adam's moments
included) and must continue with the losses of the run that never stopped.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import WORKERS, run_python
from fsdp_strategies.hf.export import main as export_main
from workers.tp_train import LOGITS_BATCH  # the batch the worker computes the trained module's logits on

WORKER = str(WORKERS / "tp_train.py")
TOL = 1e-4
BF16_TOL = 5e-2  # the real-models matrix's bf16-mixed tolerance


def _run(out: Path, *args: str, timeout: float = 400) -> list[dict]:
    run_python([WORKER, "--out", str(out), "--model", "hf_llama", "--clip", "1.0", *args], timeout=timeout)
    return sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])


def _mean_loss_by_step(run: list[dict]) -> dict[int, float]:
    """The loss of each optimizer step averaged over data-parallel ranks (one record per DP rank)."""
    first = {r["dp_rank"]: r for r in reversed(run)}
    steps: dict[int, list[float]] = {}
    for record in first.values():
        for step, loss in zip(record["steps"], record["losses"]):
            steps.setdefault(step, []).append(loss)
    return {s: sum(v) / len(v) for s, v in steps.items()}


def _same_steps(got: dict[int, float], want: dict[int, float], steps: list[int], tol: float = TOL) -> None:
    assert set(steps) <= set(got) and set(steps) <= set(want), (sorted(got), sorted(want))
    for step in steps:
        assert abs(got[step] - want[step]) <= tol * abs(want[step]), (step, got, want)


def _same_as_ddp(run: list[dict], reference: list[dict], tol: float) -> None:
    by_dp = {r["dp_rank"]: r["losses"] for r in reference}
    for record in run:
        want = by_dp[record["dp_rank"]]
        assert len(record["losses"]) == len(want) > 1
        for got, exp in zip(record["losses"], want):
            assert math.isfinite(got) and abs(got - exp) <= tol * abs(exp), (
                record["rank"],
                record["losses"],
                want,
            )


@pytest.fixture(scope="module")
def tp2x2(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """fsdp2 2 x 2, 6 steps, a sharded checkpoint after step 3, MFUMonitor counting."""
    tmp = tmp_path_factory.mktemp("tp2x2")
    run = _run(tmp / "out", "--strategy", "fsdp2", "--tp", "2", "--devices", "4", "--batch", "4", "--steps",
               "6", "--save-at", "3", "--ckpt-dir", str(tmp / "ckpt"), "--mfu")
    return run, tmp / "ckpt"


@pytest.fixture(scope="module")
def dp4x1(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """fsdp2 4 x 1 (no TP), the same global batches, sharded checkpoints after steps 3 and 6, MFUMonitor."""
    tmp = tmp_path_factory.mktemp("dp4x1")
    run = _run(tmp / "out", "--strategy", "fsdp2", "--tp", "1", "--devices", "4", "--batch", "2", "--steps",
               "6", "--save-at", "3,6", "--ckpt-dir", str(tmp / "ckpt"), "--mfu")
    return run, tmp / "ckpt"


@pytest.mark.multiprocess
def test_2x2_and_4x1_train_alike(tp2x2: tuple[list[dict], Path], dp4x1: tuple[list[dict], Path]) -> None:
    _same_steps(_mean_loss_by_step(tp2x2[0]), _mean_loss_by_step(dp4x1[0]), [1, 2, 3, 4, 5, 6])


@pytest.mark.multiprocess
def test_save_under_2x2_resume_under_4x1(tmp_path: Path, tp2x2: tuple[list[dict], Path]) -> None:
    uninterrupted, ckpt = tp2x2
    resumed = _run(tmp_path, "--strategy", "fsdp2", "--tp", "1", "--devices", "4", "--batch", "2", "--steps",
                   "6", "--resume", str(ckpt / "step3"))
    assert all(r["steps"] == [4, 5, 6] for r in resumed), [r["steps"] for r in resumed]
    _same_steps(_mean_loss_by_step(resumed), _mean_loss_by_step(uninterrupted), [4, 5, 6])


@pytest.mark.multiprocess
def test_save_under_4x1_resume_under_2x2_and_save_a_full_file(
    tmp_path: Path, dp4x1: tuple[list[dict], Path]
) -> None:
    uninterrupted, ckpt = dp4x1
    resumed = _run(tmp_path / "out", "--strategy", "fsdp2", "--tp", "2", "--devices", "4", "--batch", "4",
                   "--steps", "6", "--resume", str(ckpt / "step3"), "--full-file", "--save-at", "6",
                   "--ckpt-dir", str(tmp_path / "ckpt"))
    assert all(r["steps"] == [4, 5, 6] for r in resumed), [r["steps"] for r in resumed]
    _same_steps(_mean_loss_by_step(resumed), _mean_loss_by_step(uninterrupted), [4, 5, 6])
    # the full file written under TP holds whole tensors: those of the uninterrupted 4 x 1 run after step 6
    assert export_main([str(ckpt / "step6"), str(tmp_path / "dp_step6.pt")]) == 0
    want = torch.load(tmp_path / "dp_step6.pt", weights_only=True)
    full = torch.load(tmp_path / "ckpt" / "step6", weights_only=False)
    got = full["state_dict"]
    assert set(got) == set(want) and len(want) > 10
    for name, tensor in want.items():
        assert type(got[name]) is torch.Tensor and got[name].shape == tensor.shape, name
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert len(full["optimizer_states"]) == 1 and full["optimizer_states"][0]["state"]


@pytest.mark.multiprocess
def test_export_of_a_2x2_checkpoint_loads_in_plain_transformers(tmp_path: Path,
                                                                 tp2x2: tuple[list[dict], Path]) -> None:
    from transformers import AutoModelForCausalLM

    _, ckpt = tp2x2
    assert export_main([str(ckpt / "step3"), str(tmp_path / "plain.pt")]) == 0
    assert export_main(["--format", "hf", str(ckpt / "step3"), str(tmp_path / "hf")]) == 0
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"
    state = model.state_dict()
    assert set(f"model.{k}" for k in state) == set(plain)
    for name, tensor in state.items():  # whole tensors, the global shapes
        assert torch.equal(tensor, plain[f"model.{name}"]), name
    # logits equal to the trained (2 x 2 sharded) module's on the batch the worker used
    trained = torch.load(ckpt / "logits_step3.pt", weights_only=True)
    with torch.no_grad():
        logits = model.eval()(input_ids=LOGITS_BATCH).logits
    torch.testing.assert_close(logits, trained, rtol=1e-4, atol=1e-5)


@pytest.mark.multiprocess
def test_mfu_counts_what_each_device_does(
    tp2x2: tuple[list[dict], Path], dp4x1: tuple[list[dict], Path]
) -> None:
    # 2 x 2: a TP pair shares 4 samples, each device does half of their matmuls; 4 x 1: 2 samples per device.
    # Same work per device, so the same FLOPs per device (FlopCounterMode sees DTensor ops with their global
    # shapes: counted on the local shards, not twice), and the same samples/tokens credited to each device
    tp = [r["flops"] for r in tp2x2[0]]
    dp = [r["flops"] for r in dp4x1[0]]
    assert {f["samples"] for f in tp} == {4} and {f["samples"] for f in dp} == {2}
    for got in tp:
        want = dp[0]
        assert abs(got["model"] - want["model"]) <= 0.01 * want["model"], (got, want)
        assert abs(got["hardware"] - want["hardware"]) <= 0.01 * want["hardware"], (got, want)
        assert got["measured_steps"] == want["measured_steps"] > 0
        assert got["credited_samples"] == want["credited_samples"] > 0
        assert got["credited_tokens"] == want["credited_tokens"] > 0


@pytest.fixture(scope="module")
def ddp_accumulate(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _run(
        tmp_path_factory.mktemp("ddp_acc"), "--strategy", "ddp", "--devices", "2", "--accumulate", "2"
    )


@pytest.mark.multiprocess
def test_accumulation_and_full_activation_checkpointing_under_2x2_equal_ddp(
    tmp_path: Path, ddp_accumulate: list[dict]
) -> None:
    run = _run(
        tmp_path, "--strategy", "fsdp2", "--tp", "2", "--devices", "4", "--accumulate", "2", "--ac", "full"
    )
    assert run[0]["steps"] == [0, 1, 1, 2, 2, 3]  # two micro-batches per optimizer step
    _same_as_ddp(run, ddp_accumulate, TOL)


@pytest.mark.multiprocess
def test_bf16_selective_activation_checkpointing_and_compiled_blocks_under_2x2(tmp_path: Path) -> None:
    reference = _run(tmp_path / "ddp", "--strategy", "ddp", "--devices", "2", "--precision", "bf16-mixed")
    run = _run(tmp_path / "tp", "--strategy", "fsdp2", "--tp", "2", "--devices", "4", "--precision",
               "bf16-mixed", "--ac", "selective_op", "--compile", timeout=560)
    assert all(r["compiled"] >= 2 for r in run), [r["compiled"] for r in run]  # both decoder blocks
    _same_as_ddp(run, reference, BF16_TOL)
