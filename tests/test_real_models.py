"""The real-models matrix, representative cut (the full matrix: ``make matrix``; see tests/matrix/cells.py).

Models nobody here wrote (Hugging Face Llama, Qwen2, GPT-2, BERT, T5, ViT, CLIP with tiny random configs;
Lightning's demo Transformer; a ``configure_model`` written for Lightning's ``ModelParallelStrategy``)
and this repo's example, trained by real processes (gloo) under ``fsdp2`` (2 ranks), ``hsdp`` (2 x 2),
``ddp_hooks`` and ``ft_hsdp`` (2 groups, one SIGKILL + live heal), with the callbacks, each cell
compared with Lightning's ``ddp`` on the same data. All cells of one world size share one torchrun job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from matrix.cells import (
    check_cell,
    check_ft_cell,
    ci_cells,
    reference_for,
    replay_problems,
    run_cells,
    run_ft_cell,
)
from matrix.ft_replay import committed_steps

pytestmark = pytest.mark.multiprocess


def _ids(cells: list[dict[str, Any]]) -> list[str]:
    return [f"{c['model']}-{c['strategy']}-{'+'.join(c['callbacks']) or 'none'}-{c['precision']}"
            + ("-resume" if c["resume"] else "") + ("-eager_init"
                                                    if c.get("eager_init") else "") for c in cells]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    work = tmp_path_factory.mktemp("matrix")
    return {world: run_cells(ci_cells(world), world, work, timeout=900) for world in (2, 4)}


@pytest.mark.parametrize("index", range(len(ci_cells(2))), ids=_ids(ci_cells(2)))
def test_two_rank_cell(results: dict[int, list[dict[str, Any]]], index: int) -> None:
    result = results[2][index]
    assert result["cell"] == ci_cells(2)[index]
    assert check_cell(result, reference_for(result, results[2])) == []


@pytest.mark.parametrize("index", range(len(ci_cells(4))), ids=_ids(ci_cells(4)))
def test_hsdp_four_rank_cell(results: dict[int, list[dict[str, Any]]], index: int) -> None:
    result = results[4][index]
    assert result["cell"] == ci_cells(4)[index]
    assert check_cell(result, reference_for(result, results[4])) == []


def test_t5_every_block_of_both_stacks_is_an_fsdp_unit(results: dict[int, list[dict[str, Any]]]) -> None:
    t5 = next(r for r in results[2] if r["cell"]["model"] == "hf_t5" and r["cell"]["strategy"] == "fsdp2")
    assert [b["fsdp_unit"] for b in t5["blocks"]["T5Block"]] == [True] * 5  # 2 encoder + 3 decoder blocks
    assert [round(b["fraction"], 3) for b in t5["blocks"]["T5Block"]] == [0.5] * 5


def test_lightning_style_configure_model_gets_hybrid_sharding_under_hsdp(
    results: dict[int, list[dict[str, Any]]],
) -> None:
    # fully_shard(..., mesh=self.device_mesh["data_parallel"]) under hsdp (2 x 2) shards over 2 ranks and
    # replicates over 2: each rank holds 1/2 of every block, not 1/4.
    mps = next(
        r for r in results[4] if r["cell"]["model"] == "mps_style_llama" and r["cell"]["strategy"] == "hsdp"
    )
    assert [round(b["fraction"], 3) for b in mps["blocks"]["TransformerBlock"]] == [0.5, 0.5]


def test_ft_hsdp_hf_llama_kill_and_heal(tmp_path: Path) -> None:
    """Two groups, one SIGKILLed and healed; the committed steps must equal a plain-torch replay of them (the
    mean gradient of the groups that took part in each step, ft_replay.py), which a wrong learning rate
    misses."""
    result = run_ft_cell("hf_llama", tmp_path)
    assert check_ft_cell(result) == []
    alone = [k for k, (groups, _) in committed_steps(Path(result["out"])).items() if len(groups) == 1]
    assert alone, "no step was trained by one group alone: the replay did not see a fault"
    assert replay_problems(result, lr_scale=1.1), "the replay cannot tell a 10% different learning rate"


def test_a_cell_whose_reference_is_missing_fails() -> None:
    """No silent pass: a cell compared with nothing is a problem (the reference cell itself is not)."""
    from matrix.cells import STEPS, cell

    def result(c: dict[str, Any]) -> dict[str, Any]:
        return {"cell": c, "global_step": STEPS, "world": 2, "losses": [[2.0, 1.0]], "blocks": {},
                "state_dict_keys_equal": True}

    ours = result(cell("hf_llama", "ddp_hooks"))
    assert any("no result of its reference cell" in p for p in check_cell(ours, None))
    reference = result(cell("hf_llama", "ddp"))
    assert check_cell(reference, None) == []
    assert check_cell(ours, reference) == []
