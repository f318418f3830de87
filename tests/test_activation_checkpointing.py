"""ActivationCheckpointing: same gradients, less memory kept for backward, real recomputation, and the
Lightning wiring (applied after configure_model, before the strategy wraps, or handed to a strategy that
applies it in its parallelize(); once; FSDP2 on 2 ranks)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import ROOT, WORKERS, run_python
from fsdp_strategies.callbacks import ActivationCheckpointing
from fsdp_strategies.parallel.activation_checkpointing import apply_activation_checkpointing, is_checkpointed
from fsdp_strategies.parallel.blocks import BlockNotFoundError
from fsdp_strategies.testing import KeptBytes
from llama import Llama, LlamaLM, MarkovDataModule

V, D, L, H, KV, M, S, B = 64, 64, 2, 4, 2, 128, 32, 2
LINEARS_PER_BLOCK = 7  # wq wk wv wo w1 w2 w3


class OpCounter(TorchDispatchMode):
    """How often each op runs (used around backward: forward ops there are recomputation)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _run(model: torch.nn.Module, tokens: torch.Tensor) -> dict:
    pinned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    hook_bytes = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        hook_bytes[0] += t.numel() * t.element_size()
        return t

    kept = KeptBytes()
    with kept, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))
    kept_bytes = kept.alive(pinned)
    counter = OpCounter()
    with counter:
        loss.backward()
    return {"kept": kept_bytes, "hook_bytes": hook_bytes[0], "bwd": counter.counts,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def test_modes_same_gradients_less_kept_memory_and_counted_recomputation() -> None:
    torch.manual_seed(0)
    base = Llama(V, D, L, H, KV, M, S)
    tokens = torch.randint(0, V, (B, S + 1))
    names = [n for n, _ in base.named_parameters()]
    variants = {
        "none": None,
        "full": {"mode": "full"},
        "selective_op": {"mode": "selective_op"},
        "selective_op_every_2nd_mm": {"mode": "selective_op", "save_every_nth_matmul": 2},
        "selective_op_plus_silu": {"mode": "selective_op", "save_ops": ["aten.mm", "aten.silu",
                                   "aten._scaled_dot_product_flash_attention_for_cpu"]},
        "selective_layer": {"mode": "selective_layer", "layer_interval": 2},
    }
    results = {}
    for label, kwargs in variants.items():
        model = copy.deepcopy(base)
        if kwargs is not None:
            mode = kwargs.pop("mode")
            done = apply_activation_checkpointing(model, mode, **kwargs)
            assert len(done) == (1 if mode == "selective_layer" else L)
        assert [n for n, _ in model.named_parameters()] == names  # nothing replaced or renamed
        assert type(model.layers[0]).__name__ == "TransformerBlock"
        results[label] = _run(model, tokens)

    ref = results["none"]
    for label, r in results.items():
        for name in names:
            torch.testing.assert_close(
                r["grads"][name], ref["grads"][name], rtol=1e-5, atol=1e-6, msg=f"{label}: {name}"
            )

    kept = {k: r["kept"] for k, r in results.items()}
    assert kept["none"] > kept["selective_layer"] > kept["full"], kept
    assert kept["none"] > kept["selective_op"] > kept["full"], kept
    assert kept["selective_op"] > kept["selective_op_every_2nd_mm"] > kept["full"], kept
    # saved_tensors_hooks sees autograd's saved tensors only: full checkpointing hides the blocks' insides
    assert results["none"]["hook_bytes"] > results["full"]["hook_bytes"]

    def extra(label: str, op: str) -> int:  # runs of a forward op during backward beyond plain autograd
        return results[label]["bwd"].get(op, 0) - ref["bwd"].get(op, 0)

    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    assert ref["bwd"].get("silu", 0) == 0 and ref["bwd"].get(sdpa, 0) == 0
    # full: everything in each block is recomputed (the last matmul is not needed by backward and
    # non-reentrant checkpointing stops before it)
    assert extra("full", "silu") == L and extra("full", sdpa) == L
    assert L * (LINEARS_PER_BLOCK - 1) <= extra("full", "mm") <= L * LINEARS_PER_BLOCK
    # selective_op: cheap ops recomputed, matmuls and attention served from the cache
    assert (
        extra("selective_op", "silu") == L
        and extra("selective_op", "mm") == 0
        and extra("selective_op", sdpa) == 0
    )
    # every other matmul saved: 3 of 7 recomputed per block
    assert extra("selective_op_every_2nd_mm", "mm") == L * (LINEARS_PER_BLOCK // 2)
    # a user-extended op list: silu is cached too
    assert extra("selective_op_plus_silu", "silu") == 0 and extra("selective_op_plus_silu", "mm") == 0
    # selective_layer with interval 2: one of the two blocks recomputed
    assert extra("selective_layer", "silu") == 1 and extra("selective_layer", sdpa) == 1


def test_idempotent_deepcopy_compile_and_bad_options() -> None:
    torch.manual_seed(0)
    model = Llama(V, D, L, H, KV, M, S)
    keys = list(model.state_dict())
    assert len(apply_activation_checkpointing(model, "full")) == L
    assert apply_activation_checkpointing(model, "full") == []  # once only
    assert list(model.state_dict()) == keys
    # a deep copy checkpoints its own block (its forward is re-bound to the copy)
    clone = copy.deepcopy(model)
    tokens = torch.randint(0, V, (B, S))
    clone(tokens).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in clone.parameters())

    # checkpoint -> compile (the strategy's order) on a block: same gradients as eager
    torch.manual_seed(1)
    eager = Llama(V, D, 1, H, KV, M, S)
    compiled = copy.deepcopy(eager)
    apply_activation_checkpointing(compiled, "selective_op")
    compiled.layers[0].compile(backend="aot_eager")
    for m in (eager, compiled):
        m(tokens).float().pow(2).mean().backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)

    for kwargs, words in [
        ({"mode": "selective"}, ["mode=", "selective_op"]),
        ({"mode": "selective_layer", "layer_interval": 0}, ["layer_interval=0"]),
        ({"save_ops": ["aten.mmm"]}, ["save_ops", "aten.mmm"]),
        ({"extra_save_ops": ["mm"]}, ["extra_save_ops", "'mm'"]),
        ({"mode": "full", "save_every_nth_matmul": 2}, ["selective_op"]),
        ({"save_every_nth_matmul": 0}, ["save_every_nth_matmul=0"]),
    ]:
        with pytest.raises(ValueError) as err:
            ActivationCheckpointing(**kwargs)
        assert all(w in str(err.value) for w in words), str(err.value)
    with pytest.raises(BlockNotFoundError, match="NoSuchBlock"):
        apply_activation_checkpointing(Llama(V, D, L, H, KV, M, S), "full", block_class_names=["NoSuchBlock"])


class EagerLM(LlamaLM):
    """The example built in ``__init__`` instead of ``configure_model``: checkpointed in ``setup``."""

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        LlamaLM.configure_model(self)

    def configure_model(self) -> None:
        pass


class SeenByStrategy(pl.Callback):
    """Records, at the first hook after ``strategy.setup``, which blocks were checkpointed."""

    def __init__(self) -> None:
        self.checkpointed: list[bool] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.checkpointed = [is_checkpointed(b) for b in pl_module.model.layers]


@pytest.mark.parametrize("lm_class", [LlamaLM, EagerLM], ids=["configure_model", "built_in_init"])
def test_lightning_single_device_applies_once_before_strategy(lm_class: type, tmp_path: Path) -> None:
    sac, seen = ActivationCheckpointing(mode="selective_layer", layer_interval=2), SeenByStrategy()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[sac, seen], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=1, default_root_dir=tmp_path)
    model = lm_class(vocab_size=V, dim=D, n_layers=4, n_heads=H, max_seq_len=S)
    data = MarkovDataModule(vocab_size=V, seq_len=S, num_train=16, num_val=4, batch_size=4)
    trainer.fit(model, data)
    trainer.validate(model, data, verbose=False)
    assert seen.checkpointed == [False, True, False, True]
    for block in model.model.layers[1::2]:
        assert block._fsdp_strategies_ac_inner.__func__.__qualname__ == "TransformerBlock.forward"
    assert len(sac.checkpointed) == 2


class TakesCheckpointing:
    """A strategy that checkpoints in its parallelize() (protocols.ActivationCheckpointingTarget)."""

    def __init__(self) -> None:
        self.apply: Any = None

    def set_activation_checkpointing(self, apply: Any) -> None:
        self.apply = apply


def test_a_strategy_that_checkpoints_itself_is_handed_the_choice_and_configure_model_is_left_alone() -> None:
    sac, strategy = ActivationCheckpointing(mode="selective_layer", layer_interval=2), TakesCheckpointing()
    model = LlamaLM(vocab_size=V, dim=D, n_layers=4, n_heads=H, max_seq_len=S)
    for stage in ("fit", "validate"):  # setup runs again for validate
        sac.setup(SimpleNamespace(strategy=strategy), model, stage)
    assert "configure_model" not in vars(model)  # not wrapped: the strategy's parallelize() applies it
    assert strategy.apply == sac.apply
    model.configure_model()
    assert not any(is_checkpointed(b) for b in model.model.layers)
    strategy.apply(model)
    strategy.apply(model)  # a later set-up: nothing checkpointed twice
    assert [is_checkpointed(b) for b in model.model.layers] == [False, True, False, True]
    assert len(sac.checkpointed) == 2


def _analytic_flops(hp: dict, batch: int, seq: int) -> tuple[int, int]:
    """(model, hardware) FLOPs of forward + backward of the example, from its hyperparameters."""
    dim, layers, heads = hp["dim"], hp["n_layers"], hp["n_heads"]
    kv, hidden, vocab = hp.get("n_kv_heads") or heads, hp["mlp_hidden"], hp["vocab_size"]
    head_dim = dim // heads
    linear_params = (
        layers * (2 * dim * heads * head_dim + 2 * dim * kv * head_dim + 3 * dim * hidden) + dim * vocab
    )
    tokens = batch * seq
    attention_fwd = layers * 2 * (2 * batch * heads * seq * seq * head_dim)  # q@k^T and p@v
    model = 3 * (2 * tokens * linear_params + attention_fwd)
    flash_recompute = layers * 2 * batch * heads * seq * seq * head_dim  # q@k^T again in the fused backward
    return model, model + flash_recompute


@pytest.mark.multiprocess
def test_fsdp2_two_ranks_selective_op_config(tmp_path: Path) -> None:
    hp = {"vocab_size": V, "dim": D, "n_layers": L, "n_heads": H, "mlp_hidden": M, "max_seq_len": S}
    batch = 4
    run_python([
        str(WORKERS / "mfu_cli.py"), "fit", "--config", str(ROOT / "configs" / "sac_selective_op.yaml"),
        "--trainer.max_steps", "5", "--trainer.val_check_interval", "3", "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), "--trainer.callbacks.window", "2",
        "--trainer.callbacks.warmup_steps", "1", "--trainer.callbacks.tokens_per_sample", str(S),
        *[f"--model.{k}={v}" for k, v in hp.items()], f"--data.vocab_size={V}", f"--data.seq_len={S}",
        f"--data.batch_size={batch}", "--data.num_train=64", "--data.num_val=8",
    ], env={"MFU_OUT": str(tmp_path), "FSDP_STRATEGIES_PEAK_FLOPS": "1e11"}, timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    plain = LlamaLM(**hp)
    plain.configure_model()
    model_flops, hardware_flops = _analytic_flops(hp, batch, S)
    for r in ranks:
        assert r["strategy"] == "FSDP2Strategy" and r["world"] == 2 and r["loss_finite"]
        # checkpointed before fully_shard (which renamed the class), once, even after validate's setup
        assert r["checkpointed"] == ["FSDPTransformerBlock"] * L
        assert r["inner_forwards"] == ["TransformerBlock.forward"] * L
        assert r["state_dict_keys"] == sorted(plain.state_dict())
        # matmuls and attention are cached: selective_op recomputes no FLOPs, only flash's own q@k^T
        assert r["flops"] == [model_flops, hardware_flops]
        assert r["gathered"][r["rank"]] == r["local_values"]
    assert ranks[0]["gathered"] == ranks[1]["gathered"]
    assert ranks[0]["metrics"]["perf/mfu/median"] > 0
