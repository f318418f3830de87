"""fsdp2 / hsdp with real processes on CPU (gloo): numerics, sharding, accumulation, clipping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import WORKERS, run_python
from support.reference import max_abs_diff, reference_run

pytestmark = pytest.mark.multiprocess
WORKER = str(WORKERS / "fsdp_train.py")


def _train(tmp_path: Path, name: str, *args: str, timeout: float = 300) -> dict:
    out = tmp_path / f"{name}.pt"
    run_python([WORKER, "--out", str(out), *args], timeout=timeout)
    return torch.load(out, weights_only=False)


def _full_numel(params: dict[str, torch.Tensor]) -> int:
    return sum(p.numel() for p in params.values())


@pytest.mark.lightning_range
@pytest.mark.torch_range
def test_fsdp2_two_ranks_matches_single_process_with_accumulation_and_clipping(tmp_path: Path) -> None:
    # 2 ranks x batch 4 x 2 micro-batches == one process with batch 16; clipping at 0.5 is active.
    # accumulation="no_sync" here (the default, "sharded", is tests/test_accumulation.py's).
    steps = 4
    run = _train(tmp_path, "fsdp2", "--strategy", "fsdp2", "--devices", "2", "--steps", str(steps),
                 "--batch", "4", "--accumulate", "2", "--clip", "0.5", "--option", "accumulation='no_sync'",
                 "--probe-accumulation", "1")
    ref = reference_run(global_batch=16, steps=steps, num_train=256, clip=0.5)
    assert run["global_step"] == steps
    assert run["param_types"] == ["DTensor"]
    diff = max_abs_diff(run["params"], ref)
    assert diff < 2e-5, f"fsdp2 parameters differ from the single-process run by {diff}"
    # no_sync skips the gradient reduction on the non-final micro-batch: one reduce per
    # FSDP unit (2 blocks + root) per optimizer step, not per micro-batch...
    for rank in run["ranks"]:
        assert rank["reduce_calls"] == steps * 3
    # ... and keeps every parameter's whole gradient on every rank until then (FSDP2's own state)
    for rank in run["ranks"]:
        for i, row in enumerate(rank["micro_batches"]):
            kept = row["held"]["unsharded"] / rank["full_grad_bytes"]
            sharded = row["held"]["sharded"] / rank["full_grad_bytes"]
            assert (kept, sharded) == ((0.0, pytest.approx(0.5, rel=0.02)) if i % 2 else (1.0, 0.0)), (i, row)
    # Parameter all-gathers per micro-batch: each block in forward and again in backward, the root
    # once (kept through backward). The example's step calls self(...): after the first step the
    # strategy stops routing it through the root's __call__, so the root is not gathered twice --
    # only that first detection step pays one extra root gather.
    micro_batches = steps * 2
    for rank in run["ranks"]:
        assert rank["gather_calls"] == micro_batches * (2 * 2 + 1) + 1
    # Sharding is measured: each rank holds half the parameter and optimizer-state bytes.
    full_bytes = _full_numel(run["params"]) * 4
    for rank in run["ranks"]:
        assert rank["param_bytes"] == pytest.approx(full_bytes / 2, rel=0.02)
        assert rank["opt_bytes"] == pytest.approx(2 * full_bytes / 2, rel=0.02)  # AdamW: exp_avg + exp_avg_sq


def test_hsdp_2x2_matches_single_process(tmp_path: Path) -> None:
    steps = 3
    # This user builds the network in __init__ (no configure_model): the strategy wraps it all the same.
    run = _train(tmp_path, "hsdp", "--strategy", "hsdp", "--devices", "4", "--replicate", "2", "--steps",
                 str(steps), "--batch", "4", "--clip", "1.0", "--eager-build", "1", timeout=400)
    ref = reference_run(global_batch=16, steps=steps, num_train=256, clip=1.0)
    diff = max_abs_diff(run["params"], ref)
    assert diff < 2e-5, f"hsdp parameters differ from the single-process run by {diff}"
    # This step calls self.model(...) only, so it keeps being routed through the root: 5 gathers a step.
    assert all(rank["gather_calls"] == steps * 5 for rank in run["ranks"])
    # 2 replicas x 2 shards: each rank holds 1/2 (its shard group's half), not 1/4.
    full_bytes = _full_numel(run["params"]) * 4
    assert len(run["ranks"]) == 4
    for rank in run["ranks"]:
        assert rank["param_bytes"] == pytest.approx(full_bytes / 2, rel=0.02)


def test_fsdp2_bf16_mixed_uses_fsdp_policy_plus_autocast_and_compiles_blocks(tmp_path: Path) -> None:
    run = _train(tmp_path, "bf16", "--strategy", "fsdp2", "--devices", "2", "--steps", "4", "--precision",
                 "bf16-mixed",
                 "--option", "compile_blocks=True", "--option", "compile_options={'backend': 'aot_eager'}")
    probe = run["precision_probe"]
    assert probe["compute_weight"] == "torch.bfloat16"  # all-gathered params are cast for compute
    assert probe["activation"] == "torch.bfloat16"
    assert probe["master_weight"] == "torch.float32"  # sharded master weights stay fp32
    assert probe["fsdp_param_dtype"] == "torch.bfloat16"
    assert probe["fsdp_reduce_dtype"] == "torch.float32"  # gradients are reduced in fp32
    # autocast on top of the policy (autocast=True, the default): models with fp32 buffers train too
    assert probe["autocast"] == "True"
    assert run["compiled"] == [True, True]
    losses = run["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_sharded_bf16_mixed_plugin_runs_autocast_only_when_asked() -> None:
    import torch

    from fsdp_strategies.strategies.precision import ShardedMixedPrecision

    for autocast in (True, False):
        plugin = ShardedMixedPrecision("bf16-mixed", autocast=autocast)
        with plugin.train_step_context():
            assert torch.is_autocast_enabled("cpu") is autocast
            if autocast:
                assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert not torch.is_autocast_enabled("cpu")
