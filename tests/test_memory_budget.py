"""Activation memory as a budget: ``budget`` checkpointing meets its target with no-checkpointing gradients,
recomputes less than a fixed mode keeping as much; offload keeps gradients; both under FSDP2 on 2 ranks.

Models nobody here wrote (Hugging Face Llama and Qwen2 from tiny random configs) and the example's Llama,
built by ``tests/workers/memory_fsdp.py``. Bytes kept for backward are measured with ``SavedBytes`` (storages
a forward leaves alive), weights excluded, never taken from the planner's own prediction.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from conftest import ROOT, WORKERS, run_python, run_torchrun
from fsdp_strategies.callbacks import ActivationCheckpointing
from fsdp_strategies.flops import count_step_flops
from fsdp_strategies.memory import BudgetNotMetError, BudgetPlanner
from fsdp_strategies.parallel.activation_checkpointing import apply_activation_checkpointing
from workers.memory_fsdp import VARIANTS, batch, build, loss_of, prepare, step

MODELS = ["example_llama", "hf_llama", "hf_qwen2"]
SLACK = 1.05  # the tolerance on the target


def _train(name: str, label: str, steps: int = 3) -> dict:
    model, planner = prepare(name, label)
    losses, kept, grads = [], [], None
    for i in range(steps):
        loss, alive = step(name, model, planner, batch(i, 0))
        losses.append(loss)
        kept.append(alive)
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():  # a plain SGD step, so later steps depend on the gradients too
            for p in model.parameters():
                p -= 1e-2 * p.grad
                p.grad = None
    return {"losses": losses, "kept": kept, "grads": grads, "report": planner.report() if planner else None}


@pytest.mark.parametrize("name", MODELS)
def test_budget_meets_its_targets_with_the_gradients_of_no_checkpointing(name: str) -> None:
    ref = _train(name, "none")
    none = ref["kept"][0]
    floor = _train(name, "full")["kept"][0]
    for label in ("budget_0.25", "budget_0.5", "budget_0.75"):
        budget = VARIANTS[label][1]
        run = _train(name, label)
        report = run["report"]
        # step 0 profiles (everything recomputed, as full); from step 1 on the choice is in force
        assert run["kept"][0] == floor, (label, run["kept"])
        for kept in run["kept"][1:]:
            assert kept <= budget * none * SLACK, (label, kept / none)
            assert kept > floor  # it did keep something: the budget is used, not ignored
        assert report["measured_bytes"] == run["kept"][1]
        assert abs(report["predicted_bytes"] - report["measured_bytes"]) <= 0.01 * none, report
        assert report["none_bytes"] == pytest.approx(none, rel=0.01), (report["none_bytes"], none)
        for n, g in run["grads"].items():
            assert torch.equal(g, ref["grads"][n]), (label, n)
        assert run["losses"] == ref["losses"], label


def _recomputed_flops(name: str, model: torch.nn.Module, planner: BudgetPlanner | None) -> tuple[int, int]:
    """(bytes kept, FLOPs recomputed in backward) of a step after the planner's two planning forwards."""
    for i in range(2 if planner else 0):
        step(name, model, planner, batch(i, 0))
    kept = [0]

    def one() -> None:
        _, kept[0] = step(name, model, planner, batch(5, 0))

    flops = count_step_flops(one)
    return kept[0], flops.hardware - flops.model


@pytest.mark.parametrize("name", ["example_llama", "hf_llama"])
@pytest.mark.parametrize("fixed", ["selective_layer", "selective_op"])
def test_budget_recomputes_no_more_than_a_fixed_mode_keeping_as_much(name: str, fixed: str) -> None:
    ref = _train(name, "none", steps=1)["kept"][0]
    model, _ = prepare(name, fixed)
    fixed_kept, fixed_flops = _recomputed_flops(name, model, None)
    model = build(name)
    apply_activation_checkpointing(model, "budget")
    planner = BudgetPlanner(model, fixed_kept / ref)
    budget_kept, budget_flops = _recomputed_flops(name, model, planner)
    assert budget_kept <= fixed_kept * 1.001
    # a whole block recomputed vs the cheapest ops of every block: strictly less
    if fixed == "selective_layer":
        assert budget_flops < 0.5 * fixed_flops, (budget_flops, fixed_flops)
    # selective_op keeps every matmul and attention output: budget keeps at least as much of what counts
    else:
        assert budget_flops <= fixed_flops, (budget_flops, fixed_flops)


def test_a_budget_below_the_floor_is_a_clear_error_naming_the_best_reachable() -> None:
    model = build("example_llama")
    apply_activation_checkpointing(model, "budget")
    planner = BudgetPlanner(model, 0.01)
    with pytest.raises(
        BudgetNotMetError, match=r"memory_budget=0.01 cannot be met.*Fix: memory_budget >= 0\.\d+"
    ):
        step("example_llama", model, planner, batch(0, 0))
    assert planner.done and model.layers[0].forward  # the planner gave up; the model still runs (as full)
    step("example_llama", model, planner, batch(1, 0))


@pytest.mark.parametrize("backward_in_autocast", [False, True])
def test_budget_under_bf16_autocast_has_the_gradients_of_no_checkpointing(backward_in_autocast: bool) -> None:
    """Lightning's bf16-mixed runs the forward under autocast, whose cast cache would make the k-th cast of a
    block a different tensor in forward and recomputation (after the profiled extra forward; or when backward
    runs inside the autocast region): budget keeps no cast, and the profile leaves no cached cast behind."""
    grads = {}
    for label in ("none", "budget_0.5"):
        model, planner = prepare("example_llama", label)
        for i in range(3):
            region = torch.autocast("cpu", dtype=torch.bfloat16)
            with region, planner.forward() if planner is not None else contextlib.nullcontext():
                loss = loss_of("example_llama", model, batch(i, 0))
                if backward_in_autocast:
                    loss.backward()
            if not backward_in_autocast:
                loss.backward()
            if i == 0:
                grads[label] = {n: p.grad.clone() for n, p in model.named_parameters()}
            for p in model.parameters():
                p.grad = None
        assert planner is None or (planner.done and "aten._to_copy" not in str(planner.choice.kept_calls))
    for n, g in grads["none"].items():
        assert torch.equal(grads["budget_0.5"][n], g), n


def test_blocks_that_were_never_profiled_are_a_clear_error() -> None:
    from fsdp_strategies.memory.budget import BudgetNotProfiledError

    model = build("example_llama")
    apply_activation_checkpointing(model, "budget")
    planner = BudgetPlanner(model, 0.5)
    with (pytest.raises(BudgetNotProfiledError, match=r"nothing to profile.*Fix: do not compile the blocks"),
          planner.forward(), torch.no_grad()):  # the blocks run, but not a training forward
        loss_of_example = model(batch(0, 0))
    assert planner.done and loss_of_example is not None


def test_offload_keeps_gradients_and_moves_the_uncheckpointed_blocks_saved_tensors() -> None:
    from fsdp_strategies.memory import apply_activation_offload

    ref = _train("hf_llama", "none", steps=2)
    for label in ("offload", "offload_selective_layer", "offload_full"):
        run = _train("hf_llama", label, steps=2)
        assert run["losses"] == ref["losses"], label
        for n, g in run["grads"].items():
            assert torch.equal(g, ref["grads"][n]), (label, n)
    model = build("hf_llama")
    stats = apply_activation_offload(model, min_bytes=0)
    assert stats.blocks == len(model.model.layers)
    step("hf_llama", model, None, batch(0, 0))
    # one host copy per saved tensor, not one per op that saves it (q, k and v save the same input)
    assert stats.bytes < ref["kept"][0]
    params = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    assert stats.tensors > 0 and stats.bytes > 0
    # weights stay where they are: what moved is activations only (less than the blocks' weights would add)
    assert all(p.grad is not None for p in model.model.layers.parameters())
    assert apply_activation_offload(model) is stats  # idempotent
    checkpointed = build("hf_llama")
    apply_activation_checkpointing(checkpointed, "full")
    assert apply_activation_offload(checkpointed).blocks == 0  # checkpointed blocks are left to checkpointing
    assert params > 0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"mode": "budget"}, "mode='budget' needs memory_budget"),
    ({"mode": "budget", "memory_budget": 0}, "memory_budget"),
    ({"mode": "budget", "memory_budget": 1.5}, "above 1"),
    ({"mode": "budget", "memory_budget": "half"}, "memory_budget"),
    ({"mode": "full", "memory_budget": 0.5}, "only applies to mode='budget'"),
    ({"mode": "none"}, "mode='none' without offload does nothing"),
    ({"mode": "none", "offload": "yes"}, "offload"),
    ({"mode": "none", "offload": True, "offload_min_bytes": -1}, "offload_min_bytes"),
    ({"mode": "sometimes"}, "mode"),
])
def test_option_errors_name_the_option_and_the_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        ActivationCheckpointing(**kwargs)
    assert "Fix" in str(info.value) or "Valid" in str(info.value) or "one of" in str(info.value)


def test_lightning_fit_plans_logs_and_unwraps(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils.data import DataLoader

    from matrix.models import HFCausalLM, TokenSequences

    module = HFCausalLM(lambda: build("hf_qwen2"))
    plain_step = type(module).training_step
    callback = ActivationCheckpointing(mode="budget", memory_budget=0.5)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                         default_root_dir=tmp_path)
    with caplog.at_level("INFO"):
        trainer.fit(module, DataLoader(TokenSequences(), batch_size=4))
    report = callback.budget_report
    assert report["phase"] == "done" and report["memory_budget"] == 0.5
    assert report["measured_bytes"] <= 0.5 * report["none_bytes"] * SLACK
    assert report["floor_bytes"] < report["measured_bytes"]
    assert "training_step" not in module.__dict__ and type(module).training_step is plain_step
    text = caplog.text
    assert "mode='budget', memory_budget=0.5): keeping" in text and "measured" in text


@pytest.mark.multiprocess
def test_fsdp2_two_ranks_budget_targets_and_offload_gradients(tmp_path: Path) -> None:
    # those: other tests
    variants = [v for v in VARIANTS if v not in ("full", "selective_op", "selective_layer")]
    run_torchrun(WORKERS / "memory_fsdp.py", 2,
                 ["--out", str(tmp_path), "--steps", "2", "--variants", ",".join(variants)], timeout=400)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for record in ranks:
        assert record["world"] == 2
        runs = record["runs"]
        for name in MODELS:
            ref = runs[f"{name}/none"]
            none = ref["kept"][0]
            for label in variants:
                mode, budget, _ = VARIANTS[label]
                run = runs[f"{name}/{label}"]
                # same gradients (this rank's shards) and so the same losses as no checkpointing
                assert run["grad_checksum"] == ref["grad_checksum"], (name, label)
                assert run["losses"] == ref["losses"], (name, label)
                # uncheckpointed blocks: their saved tensors moved
                if label in ("offload", "offload_selective_layer"):
                    assert min(run["offloaded"]) > 0
                    # what stays besides the host copies (the device's share, on a GPU) is less than without
                    # offload
                    assert run["kept"][-1] - run["offloaded"][-1] < ref["kept"][-1], (name, label, run)
                elif label.startswith("offload"):  # every block checkpointed: nothing left to move
                    assert max(run["offloaded"]) == 0
                if mode == "budget":
                    assert budget is not None
                    assert max(run["kept"][1:]) <= budget * none * SLACK, (name, label, run["kept"], none)
                    assert run["budget"]["measured_bytes"] == run["kept"][1]
    for name in MODELS:  # every rank made the same choice (rank 0's)
        for label in ("budget_0.25", "budget_0.5", "budget_0.75"):
            kept = [r["runs"][f"{name}/{label}"]["budget"]["kept_calls"] for r in ranks]
            assert kept[0] == kept[1]


@pytest.mark.multiprocess
def test_config_sac_budget_fsdp2_two_ranks_meets_the_budget(tmp_path: Path) -> None:
    """configs/sac_budget.yaml through the example's LightningCLI: rank 0's choice, measured within the
    budget."""
    proc = run_python(
        ["examples/train_llama.py", "fit", "--config", str(ROOT / "configs" / "sac_budget.yaml"),
         "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
         "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir",
         str(tmp_path / "logs"),
         "--trainer.enable_progress_bar", "false", "--model.dim", "128", "--model.n_layers", "2",
         "--model.max_seq_len", "64", "--data.seq_len", "64", "--data.num_train", "64", "--data.num_val",
         "8"],
        timeout=400,
    )
    out = proc.stdout + proc.stderr
    assert "`Trainer.fit` stopped: `max_steps=4` reached." in out
    chosen = re.findall(r"memory_budget=0.5\): keeping (\d+) op output\(s\)", out)
    measured = re.findall(r"measured ([\d.]+) MiB kept for backward \(predicted ([\d.]+) MiB; ([\d.]+) of no "
                          r"checkpointing, budget 0.5\)", out)
    assert len(chosen) == 1 and int(chosen[0]) > 0, out[-3000:]  # logged once (rank 0), something kept
    assert len(measured) == 1, out[-3000:]
    fraction = float(measured[0][2])
    assert 0.3 < fraction <= 0.5 * SLACK, measured
    metrics = (tmp_path / "logs").rglob("metrics.csv")
    header = next(metrics).read_text().splitlines()[0]
    assert "ac/budget/measured_bytes" in header and "ac/budget/predicted_bytes" in header


def _convnext_step(model: torch.nn.Module, planner: BudgetPlanner | None, seed: int) -> int:
    from fsdp_strategies.memory.saved_bytes import SavedBytes, plain_tensors, storage_key

    g = torch.Generator().manual_seed(seed)
    pixels, labels = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 5, (4,), generator=g)
    weights = {storage_key(t) for t in plain_tensors([*model.parameters(), *model.buffers()])}
    kept = SavedBytes()
    with kept, planner.forward() if planner is not None else contextlib.nullcontext():
        loss = model(pixel_values=pixels, labels=labels).loss
    alive = kept.alive(weights)
    loss.backward()
    return alive


def test_budget_profiles_each_size_of_a_block_class() -> None:
    """HF ConvNeXt's stages of widths 16/32/64 are all ``ConvNextStage``: profiling one and charging it to all
    mispredicted the no-checkpointing baseline 1.6x. Each parameter-shape set is now a kind of its own."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    def build_convnext() -> torch.nn.Module:
        torch.manual_seed(0)
        config = ConvNextConfig(
            num_stages=3, hidden_sizes=[16, 32, 64], depths=[1, 1, 1], num_labels=5, image_size=32
        )
        return ConvNextForImageClassification(config)

    none = _convnext_step(build_convnext(), None, 0)
    model = build_convnext()
    apply_activation_checkpointing(model, "budget", block_class_names=["ConvNextStage"])
    planner = BudgetPlanner(model, 0.5)
    for i in range(2):
        _convnext_step(model, planner, i)
    report = planner.report()
    assert report["none_bytes"] == pytest.approx(none, rel=0.01), (report["none_bytes"], none)
    assert abs(report["predicted_bytes"] - report["measured_bytes"]) <= 0.01 * none, report
    assert report["measured_bytes"] <= 0.5 * none * SLACK, report["measured_bytes"] / none
    assert sorted(report["kept_calls"]) == ["ConvNextStage/1", "ConvNextStage/2", "ConvNextStage/3"], report
