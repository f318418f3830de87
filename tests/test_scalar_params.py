"""0-d parameters (CLIP's ``logit_scale``, learned temperatures) under fsdp2, hsdp and ft_hsdp (real
processes, gloo).

``fully_shard`` cannot shard a 0-d parameter; the strategies keep them replicated with data-parallel
gradients (:mod:`fsdp_strategies.parallel.replicated_params`). The model (tests/workers/scalar_train.py) has a
learned temperature at the root, a 0-d gate in each block and a frozen 0-d offset. Every run is compared
with Lightning's ``ddp`` on the same world size and data, step for step, in fp32, with clipping active.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import WORKERS, run_python, run_torchrun

pytestmark = pytest.mark.multiprocess
WORKER = WORKERS / "scalar_train.py"
STEPS, CLIP = 6, 0.05  # as in the worker
TOLERANCE = 1e-5  # fp32: reduction order only (measured: <= 5e-7)
SCALARS = {"temperature", "layers.0.gate", "layers.1.gate", "offset"}


def _torchrun(tmp: Path, world: int, *args: str) -> dict[str, Any]:
    out = tmp / f"scalars{world}.json"
    run_torchrun(WORKER, world, ["--out", str(out), *args], timeout=400)
    return json.loads(out.read_text())


def _deviation(ours: list[list[float]], ref: list[list[float]]) -> float:
    assert [len(x) for x in ours] == [len(x) for x in ref]
    return max(abs(a - b) / abs(b) for x, y in zip(ours, ref, strict=True) for a, b in zip(x, y, strict=True))


def _check_like_ddp(run: dict[str, Any], ddp: dict[str, Any]) -> None:
    assert run["global_step"] == ddp["global_step"] == STEPS
    assert set(run["types"]) == SCALARS and set(run["types"].values()) == {"Parameter"}  # whole, not DTensors
    # clipping changed every step (the total norm includes the 0-d grads)
    assert min(ddp["grad_norms"]) > CLIP
    deviation = _deviation(run["losses"], ddp["losses"])
    assert deviation <= TOLERANCE, f"losses differ from ddp's by {deviation:.2e}"
    assert all(final == run["final"][0] for final in run["final"]), "the ranks' 0-d parameters differ"
    for name, value in run["final"][0].items():
        assert value == pytest.approx(ddp["final"][0][name], rel=TOLERANCE), name
    assert run["final"][0]["temperature"] != 1.5 and run["final"][0]["offset"] == 0.25  # trained; frozen kept


def _check_resume(run: dict[str, Any], micro_batches_per_step: int) -> None:
    # the sharded checkpoint at step 2 restores the 0-d parameters and their AdamW state exactly, on every
    # rank
    assert run["checkpoint"], "no step-2 checkpoint"
    saved = run["saved"]
    assert (
        saved["optimizer"]["temperature"]["step"] == 2.0
        and saved["optimizer"]["temperature"]["exp_avg"] != 0.0
    )
    for restored in run["restored"]:
        assert restored["values"] == saved["values"]
        assert restored["optimizer"] == saved["optimizer"]
    skip = 2 * micro_batches_per_step
    for straight, resumed in zip(run["losses"], run["resumed_losses"], strict=True):
        assert resumed == pytest.approx(straight[skip:], rel=1e-6)


def _check_export(checkpoint: str, saved: dict[str, Any], tmp: Path) -> None:
    # fsdp-strategies-export writes them like every other parameter: 0-d tensors with the saved values
    from fsdp_strategies.checkpoint.safe_load import safe_torch_load
    from fsdp_strategies.hf.export import main as export_main

    assert export_main([checkpoint, str(tmp / "exported.pt")]) == 0
    exported = safe_torch_load(tmp / "exported.pt")
    state = exported.get("state_dict", exported)
    for name, value in saved["values"].items():
        assert state[name].shape == () and float(state[name]) == value, name


def test_fsdp2_two_ranks_trains_0d_params_as_ddp_with_accumulation_and_resume(tmp_path: Path) -> None:
    result = _torchrun(tmp_path, 2, "--runs", "ddp,fsdp2,fsdp2_meta", "--ckpt", "fsdp2", "--accumulate", "2")
    _check_like_ddp(result["fsdp2"], result["ddp"])
    _check_resume(result["fsdp2"], micro_batches_per_step=2)
    _check_export(result["fsdp2"]["checkpoint"][0], result["fsdp2"]["saved"], tmp_path)
    # built on the meta device in configure_model, each rank seeded differently: reset_parameters drew a
    # different gate on each rank, yet every rank trained from rank 0's value and ends equal
    meta = result["fsdp2_meta"]
    assert meta["start"][0]["layers.0.gate"] != meta["start"][1]["layers.0.gate"]
    assert meta["final"][0] == meta["final"][1]
    assert all(x == x for losses in meta["losses"] for x in losses) and meta["global_step"] == STEPS


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """ddp and hsdp (2 x 2) on 4 ranks; hsdp also saves at step 2 and resumes."""
    return _torchrun(tmp_path_factory.mktemp("scalars4"), 4, "--runs", "ddp,hsdp", "--ckpt", "hsdp")


def test_hsdp_2x2_trains_0d_params_as_ddp_and_resumes(four_ranks: dict[str, Any]) -> None:
    _check_like_ddp(four_ranks["hsdp"], four_ranks["ddp"])
    _check_resume(four_ranks["hsdp"], micro_batches_per_step=1)


@pytest.mark.parametrize("init_sync", [True, False], ids=["init_sync", "no_init_sync"])
def test_ft_hsdp_two_groups_keep_0d_params_identical(tmp_path: Path, request: pytest.FixtureRequest,
                                                     init_sync: bool) -> None:
    # init_sync (the default): the first step heals, and torchft picks per rank which group is healing, so the
    # ranks of a group see different cross-group averages; the 0-d parameters must stay identical all the
    # same.
    # Without it: 2 groups x 2 ranks x batch 4 = ddp on 4 ranks with the same data layout (group g, rank r =
    # ddp
    # rank 2g + r), so the losses must be ddp's.
    out = tmp_path / "ft"
    run_python(["-m", "fsdp_strategies.ft", "--groups", "2", "--ranks-per-group", "2", "--min-replicas", "2",
                "--max-restarts", "0", "--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "500",
                "--events-dir", str(tmp_path / "events"), "--timeout", "280", "--", str(WORKER), "--ft",
                "--out", str(out), *([] if init_sync else ["--no-init-sync"])], timeout=300)
    groups = {
        (g, r): json.loads((out / f"group{g}_rank{r}.json").read_text()) for g in (0, 1) for r in (0, 1)
    }
    finals = [run["final"] for run in groups.values()]
    assert all(final == finals[0] for final in finals), f"0-d parameters differ across groups/ranks: {finals}"
    assert finals[0]["temperature"] != 1.5 and finals[0]["offset"] == 0.25
    for run in groups.values():
        assert run["global_step"] == STEPS and set(run["types"].values()) == {"Parameter"}
    if init_sync:
        return
    ddp = request.getfixturevalue("four_ranks")["ddp"]
    for name, value in finals[0].items():
        assert value == pytest.approx(ddp["final"][0][name], rel=TOLERANCE), name
    for (g, r), run in groups.items():
        deviation = _deviation([run["losses"]], [ddp["losses"][2 * g + r]])
        assert deviation <= TOLERANCE, f"group {g} rank {r}: losses differ from ddp's by {deviation:.2e}"
