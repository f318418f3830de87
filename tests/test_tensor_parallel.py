"""Tensor parallelism (issue #26): 2-D (FSDP x TP) and 3-D (replicate x shard x TP) meshes from the model's
plan.

Multi-process runs use ``tests/workers/tp_train.py``: models from the real-models matrix (HF Llama with GQA,
HF Qwen2 -- built in ``__init__`` with one seed, so every strategy starts from the same weights), gradient
clipping on. The reference for a 4-rank run with tensor_parallel_degree 2 is Lightning's ``ddp`` on 2 ranks:
data-parallel rank d of the TP run reads what ddp rank d reads, so their losses must agree step for step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from conftest import WORKERS, run_python
from fsdp_strategies import FSDP2Strategy, HSDPStrategy
from fsdp_strategies.parallel.tensor_parallel import (
    TensorParallelPlanError,
    _check_sizes,
    _expand,
    find_model_plan,
    resolve_plan,
)
from matrix.models import MODELS

WORKER = str(WORKERS / "tp_train.py")
TOL = 1e-4


def _run(out: Path, *args: str, clip: bool = True) -> list[dict]:
    run_python([WORKER, "--out", str(out), *(["--clip", "1.0"] if clip else []), *args], timeout=400)
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def _same_losses(run: list[dict], reference: list[dict]) -> None:
    by_dp = {r["dp_rank"]: r["losses"] for r in reference}
    for record in run:
        want = by_dp[record["dp_rank"]]
        assert len(record["losses"]) == len(want) > 1
        for got, exp in zip(record["losses"], want):
            assert abs(got - exp) <= TOL * abs(exp), (record["rank"], record["losses"], want)


def _planned_are_2d(record: dict, planned: tuple[str, ...], dp_dims: list[str]) -> None:
    for name, info in record["params"].items():
        if name.endswith(planned):
            assert info["mesh"] == [*dp_dims, "tensor_parallel"], (name, info)
            assert "S(" in info["placements"][-1], (name, info)  # sharded on the TP dim
            # and by FSDP on the shard dim (HSDP: whole on the replicate dim)
            assert all("S(" in p or (p == "R" and d == "replicate") for p, d in
                       zip(info["placements"][:-1], dp_dims)), (name, info)
    # ~1/4 of the parameters per rank on 4 ranks; a module the model's own plan leaves out of tensor
    # parallelism is sharded by FSDP alone, 1/2 per rank (transformers 5.17's Llama plan has no embed_tokens,
    # 5.24's has it)
    split = [i for i in record["params"].values() if i["mesh"] == [*dp_dims, "tensor_parallel"]]
    fsdp_only = [i for i in record["params"].values() if i["mesh"] == dp_dims]
    assert len(split) + len(fsdp_only) == len(record["params"]), record["params"]
    local, total = sum(i["local"] for i in split), sum(i["global"] for i in split)
    assert local / total <= 0.26, local / total
    assert all(i["local"] <= i["global"] // 2 + 1 for i in fsdp_only), fsdp_only
    everything = sum(i["global"] for i in record["params"].values())
    assert total > 0.6 * everything, "most parameters are tensor-parallel"


@pytest.fixture(scope="module")
def ddp_llama(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _run(
        tmp_path_factory.mktemp("ddp_llama"), "--model", "hf_llama", "--strategy", "ddp", "--devices", "2"
    )


@pytest.mark.multiprocess
def test_fsdp2_2x2_hf_llama_gqa_equals_ddp(tmp_path: Path, ddp_llama: list[dict]) -> None:
    run = _run(tmp_path, "--model", "hf_llama", "--strategy", "fsdp2", "--tp", "2", "--devices", "4")
    assert sorted(r["dp_rank"] for r in run) == [0, 0, 1, 1]
    _same_losses(run, ddp_llama)
    for record in run:
        _planned_are_2d(
            record, ("q_proj.weight", "k_proj.weight", "o_proj.weight", "down_proj.weight"), ["shard"]
        )


@pytest.mark.multiprocess
def test_fsdp2_2x2_tied_embeddings_stay_one_tensor_and_equal_ddp(tmp_path: Path) -> None:
    # the embedding (vocab-parallel rows) and the head (column-wise: the same rows) are one parameter: still
    # one after the plan and FSDP, updated once, so the losses follow ddp's
    reference = _run(tmp_path / "ddp", "--model", "hf_llama_tied", "--strategy", "ddp", "--devices", "2")
    run = _run(
        tmp_path / "tp", "--model", "hf_llama_tied", "--strategy", "fsdp2", "--tp", "2", "--devices", "4"
    )
    assert all(r["tied"] for r in run + reference)
    _same_losses(run, reference)


@pytest.mark.multiprocess
@pytest.mark.torch_range
def test_hsdp_1x2x2_hf_llama_equals_ddp(tmp_path: Path, ddp_llama: list[dict]) -> None:
    """Also with activation checkpointing to a memory budget (profiled on DTensor blocks, one choice for all
    ranks): the same losses as ddp without checkpointing, and the budget met on every rank."""
    run = _run(tmp_path, "--model", "hf_llama", "--strategy", "hsdp", "--tp", "2", "--devices", "4",
               "--ac", "budget", "--memory-budget", "0.5")
    _same_losses(run, ddp_llama)
    for record in run:
        _planned_are_2d(record, ("q_proj.weight", "up_proj.weight"), ["replicate", "shard"])
        budget = record["budget"]
        # (the whole record in the message: CI once measured 16 KiB over the prediction on torch 2.14.1)
        assert budget["floor_bytes"] < budget["measured_bytes"] <= 0.5 * budget["none_bytes"] * 1.05, \
            json.dumps(budget)
        assert budget["kept_calls"] == run[0]["budget"]["kept_calls"]


@pytest.mark.multiprocess
def test_fsdp2_2x2_hf_qwen2_equals_ddp(tmp_path: Path) -> None:
    reference = _run(tmp_path / "ddp", "--model", "hf_qwen2", "--strategy", "ddp", "--devices", "2")
    run = _run(tmp_path / "tp", "--model", "hf_qwen2", "--strategy", "fsdp2", "--tp", "2", "--devices", "4")
    _same_losses(run, reference)


@pytest.mark.multiprocess
def test_own_plan_configure_model_runs_unchanged_like_lightning_model_parallel(tmp_path: Path) -> None:
    # written for Lightning's ModelParallelStrategy (parallelize_module + fully_shard in configure_model). No
    # clipping here: Lightning's ModelParallelStrategy cannot clip these gradients (DTensors on two meshes:
    # "All operands in aten.stack.default must have the same mesh"); fsdp2 clips them, see the HF runs
    reference = _run(
        tmp_path / "mp", "--model", "own_plan", "--strategy", "lightning_mp", "--tp", "2", clip=False
    )
    run = _run(tmp_path / "ours", "--model", "own_plan", "--strategy", "fsdp2", "--tp", "2", clip=False)
    _same_losses(run, reference)


@pytest.mark.multiprocess
def test_the_example_with_an_explicit_plan_trains(tmp_path: Path) -> None:
    run = _run(tmp_path, "--model", "example_llama", "--strategy", "fsdp2", "--tp", "2", "--plan", "example",
               "--steps", "6")
    for record in run:
        assert all(loss == loss for loss in record["losses"]) and record["losses"][-1] < record["losses"][0]
        _planned_are_2d(record, ("attention.wq.weight", "mlp.w2.weight"), ["shard"])
    assert run[0]["losses"] == run[1]["losses"]  # the two ranks of a TP group see one loss


# ---------------------------------------------------------------------------------------------- the mesh
def test_the_mesh_is_init_device_meshs_and_answers_to_lightnings_dim_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``build_mesh`` makes the mesh ``init_device_mesh`` would (same ranks, names, equality) as a
    ``DataParallelNamedMesh`` from the start, which also answers to ``"data_parallel"`` (1-D: itself; HSDP:
    the 2-D replicate x shard mesh) and names the fix for a missing ``"tensor_parallel"`` dim."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from conftest import free_port
    from fsdp_strategies.parallel.mesh import DataParallelNamedMesh, ParallelDims, build_mesh

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cpu = torch.device("cpu")
        fsdp = build_mesh(cpu, ParallelDims.fsdp(1, 1))
        hsdp = build_mesh(cpu, ParallelDims(1, 1, 1, hybrid=True))
        assert type(fsdp) is DataParallelNamedMesh and type(hsdp) is DataParallelNamedMesh
        assert fsdp == init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        assert hsdp == init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        assert fsdp["data_parallel"] is fsdp and hsdp["data_parallel"] is hsdp
        assert hsdp["shard"].mesh_dim_names == ("shard",) and type(hsdp["shard"]) is not DataParallelNamedMesh
        with pytest.raises(KeyError, match=r"no tensor-parallel dim .*Fix: set the strategy's tensor_par"):
            hsdp["tensor_parallel"]
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- bad input
def test_degree_must_divide_the_devices_of_a_node() -> None:
    import lightning.pytorch as pl

    with pytest.raises(
        ValueError, match=r"tensor_parallel_degree=3 does not divide the 4 devices.*\[1, 2, 4\]"
    ):
        pl.Trainer(accelerator="cpu", devices=4, strategy=FSDP2Strategy(tensor_parallel_degree=3))
    with pytest.raises(ValueError, match="tensor_parallel_degree"):
        FSDP2Strategy(tensor_parallel_degree=0)
    with pytest.raises(ValueError, match="tp_plan='colwise'"):
        HSDPStrategy(tensor_parallel_degree=2, tp_plan="colwise")


class _Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def test_auto_reads_the_models_own_plan_prefixed_and_refuses_a_model_without_one() -> None:
    llama = _Holder(MODELS["hf_llama"].build().model)
    plan = resolve_plan(llama, "auto")
    assert plan["model.model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.model.layers.*.mlp.down_proj"] == "rowwise"
    assert find_model_plan(nn.Linear(2, 2)) is None
    with pytest.raises(
        TensorParallelPlanError, match=r"holding GPT2LMHeadModel\) carries no tensor-parallel plan.*dict"
    ):
        resolve_plan(MODELS["hf_gpt2"].build(), "auto")


def test_a_glob_that_matches_nothing_and_sizes_that_do_not_split_are_refused() -> None:
    llama = _Holder(MODELS["hf_llama"].build().model)
    with pytest.raises(TensorParallelPlanError, match=r"\['model.layers.\*.attn.wq'\] match no module"):
        _expand(llama, {"model.layers.*.attn.wq": "colwise"})
    exact = _expand(llama, resolve_plan(llama, "auto"))
    _check_sizes(llama, exact, 2)  # 4 heads, 2 KV heads: fine
    with pytest.raises(TensorParallelPlanError, match=r"num_key_value_heads=2.*tensor_parallel_degree=4"):
        _check_sizes(llama, exact, 4)


@pytest.mark.parametrize("family", ["mixtral", "qwen3"])
def test_plans_with_styles_this_package_does_not_apply_are_refused_by_style(family: str) -> None:
    # Mixtral's plan names expert parameters with MoE/packed styles; Qwen3's per-head q_norm/k_norm need a
    # gradient all-reduce over the TP ranks: applying the rest and leaving those whole would train wrongly
    import torch
    import transformers

    from fsdp_strategies.parallel.tensor_parallel import STYLES, apply_tensor_parallel, resolve_plan

    sizes = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    with torch.device("meta"):
        if family == "mixtral":
            model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=2, **sizes))
        else:
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**sizes))
    style = {"mixtral": "moe_tp_experts", "qwen3": "replicated_with_grad_allreduce"}[family]
    if family == "mixtral" and style not in resolve_plan(model, "auto").values():
        # transformers 5.25's Mixtral plan has no experts (5.17's has; they stay whole on every TP rank):
        # what is left is attention, embedding and head, all styles this package applies
        assert set(resolve_plan(model, "auto").values()) <= set(STYLES), resolve_plan(model, "auto")
        return
    with pytest.raises(TensorParallelPlanError, match=rf"does not apply: .*'{style}'.*Fix: pass a dict plan"):
        apply_tensor_parallel(model, object(), "auto")


def test_a_glob_naming_a_parameter_says_so() -> None:
    llama = _Holder(MODELS["hf_llama"].build().model)
    with pytest.raises(TensorParallelPlanError, match=r"names parameters, not modules.*drop the '\.weight'"):
        _expand(llama, {"model.model.layers.*.self_attn.q_proj.weight": "colwise"})
