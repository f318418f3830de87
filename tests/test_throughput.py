"""MFUMonitor: FLOP counts against the analytic formula, peak lookup by real device names, and the
logged values under single-device (with accumulation and SAC) and DDP on 2 ranks."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger

from conftest import ROOT, WORKERS, run_python
from fsdp_strategies.callbacks import ActivationCheckpointing, MFUMonitor
from fsdp_strategies.flops import analytic_transformer_flops, count_step_flops
from fsdp_strategies.flops import peaks as _peak_flops
from llama import Llama, LlamaLM, MarkovDataModule

V, D, L, H, M, S = 64, 64, 2, 4, 128, 32


def _analytic(dim: int, layers: int, heads: int, kv: int, hidden: int, vocab: int, batch: int, seq: int,
              causal: bool = False) -> tuple[int, int, int]:
    """(model FLOPs, hardware FLOPs, linear parameter count) of the example's forward + backward."""
    head_dim = dim // heads
    linear_params = (
        layers * (2 * dim * heads * head_dim + 2 * dim * kv * head_dim + 3 * dim * hidden) + dim * vocab
    )
    tokens = batch * seq
    attention_fwd = layers * 2 * (2 * batch * heads * seq * seq * head_dim)  # q@k^T and p@v, every head
    scale = 0.5 if causal else 1.0
    model = 3 * 2 * tokens * linear_params + int(3 * attention_fwd * scale)
    # q@k^T again in backward
    flash_recompute = int(layers * 2 * batch * heads * seq * seq * head_dim * scale)
    return model, model + flash_recompute, linear_params


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_counted_flops_equal_analytic_formula(device: str) -> None:
    torch.manual_seed(0)
    batch, kv = 3, 2  # grouped-query attention: the kernel sees all query heads
    with torch.device(device):
        model = Llama(V, D, L, H, kv, M, S)
    tokens = torch.randint(0, V, (batch, S + 1)).to(device)

    def step() -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1)).backward()

    model_flops, hardware_flops, linear_params = _analytic(D, L, H, kv, M, V, batch, S)
    counted = count_step_flops(step)
    assert counted.model == model_flops
    # the library's analytic helper is the same formula when N counts the matmul weights
    assert analytic_transformer_flops(linear_params, L, D, S, batch * S) == model_flops
    if device == "cpu":  # the CPU flash kernel (formula registered here) recomputes q@k^T in backward
        assert counted.hardware == hardware_flops
        causal = count_step_flops(step, causal_discount=True)
        assert (causal.model, causal.hardware) == _analytic(D, L, H, kv, M, V, batch, S, causal=True)[:2]
    else:  # on meta, SDPA runs the unfused math path (plain bmm): nothing recomputed
        assert counted.hardware == model_flops


@pytest.mark.parametrize(("name", "key", "bf16_tflops"), [
    ("NVIDIA H100 80GB HBM3", "h100-sxm", 989),
    ("NVIDIA H100 PCIe", "h100-pcie", 756),
    ("NVIDIA H100 NVL", "h100-nvl", 835),
    ("NVIDIA H200", "h200-sxm", 989),
    ("NVIDIA H200 NVL", "h200-nvl", 835),
    ("NVIDIA GH200 480GB", "gh200", 989),
    ("NVIDIA B200", "b200", 2250),
    ("NVIDIA GB200", "gb200", 2500),
    ("NVIDIA A100-SXM4-80GB", "a100", 312),
    ("NVIDIA A100 80GB PCIe", "a100", 312),
    ("NVIDIA L4", "l4", 121),
    ("NVIDIA L40S", "l40s", 362),
    ("NVIDIA A10G", "a10g", 125),
    ("AMD Instinct MI300X", "mi300x", 1307),
    ("AMD Instinct MI355X", "mi355x", 2516),
    ("TPU v5p", "tpu-v5p", 459),
    ("TPU v5 lite", "tpu-v5e", 197),
    ("TPU v6e", "tpu-v6e", 918),
    ("trn1", "trn1", 95),
])
def test_peak_lookup_by_real_device_names(name: str, key: str, bf16_tflops: int) -> None:
    assert _peak_flops.device_key(name) == key
    assert int(_peak_flops.lookup_peak_flops(name, "bf16") / 1e12) == bf16_tflops


def test_peak_unknown_override_env_and_bad_options(monkeypatch: pytest.MonkeyPatch) -> None:
    for unknown in ("NVIDIA GeForce RTX 4090", "Intel(R) Xeon(R) Platinum 8481C CPU", "Tesla V100-SXM2-16GB"):
        assert _peak_flops.lookup_peak_flops(unknown) is None, unknown
    assert _peak_flops.lookup_peak_flops("NVIDIA A100-SXM4-40GB", "fp8") is None  # no FP8 on Ampere
    assert _peak_flops.lookup_peak_flops("NVIDIA H100 80GB HBM3", "tf32") == pytest.approx(494.7e12)

    def fake_trainer(device: str, precision: str = "bf16-mixed") -> SimpleNamespace:
        return SimpleNamespace(
            strategy=SimpleNamespace(root_device=torch.device(device)), precision=precision
        )

    monkeypatch.delenv(_peak_flops.PEAK_FLOPS_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert MFUMonitor()._resolve_peak(fake_trainer("cuda:0")) == pytest.approx(989.4e12)
    assert MFUMonitor()._resolve_peak(fake_trainer("cuda:0", "16-mixed")) == pytest.approx(989.4e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    with pytest.warns(
        UserWarning, match="no dense bf16 peak known for device 'NVIDIA GeForce RTX 4090'"
    ) as record:
        assert MFUMonitor()._resolve_peak(fake_trainer("cuda:0")) is None
    assert len(record) == 1
    with pytest.warns(UserWarning, match="CPU"):
        assert MFUMonitor()._resolve_peak(fake_trainer("cpu")) is None
    assert MFUMonitor(peak_flops=5e12)._resolve_peak(fake_trainer("cpu")) == 5e12
    monkeypatch.setenv(_peak_flops.PEAK_FLOPS_ENV, "7e12")
    assert MFUMonitor()._resolve_peak(fake_trainer("cuda:0")) == 7e12
    monkeypatch.setenv(_peak_flops.PEAK_FLOPS_ENV, "fast")
    with pytest.raises(ValueError, match="FSDP_STRATEGIES_PEAK_FLOPS='fast'"):
        MFUMonitor()
    monkeypatch.delenv(_peak_flops.PEAK_FLOPS_ENV)
    for kwargs, words in [({"peak_flops": -1.0}, "peak_flops=-1.0"), ({"window": 0}, "window=0"),
                          ({"warmup_steps": 0}, "warmup_steps=0"),
                          ({"flops_per_batch": 0}, "flops_per_batch=0"),
                          ({"flops_source": "guess"}, "flops_source='guess'"),
                          ({"peak_dtype": "int4"}, "peak_dtype")]:
        with pytest.raises(ValueError, match=words):
            MFUMonitor(**kwargs)


def _fit(tmp_path: Path, callbacks: list[pl.Callback], name: str) -> tuple[pl.Trainer, list[dict[str, str]]]:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=5, accumulate_grad_batches=2,
                         callbacks=callbacks, logger=CSVLogger(tmp_path, name=name), log_every_n_steps=1,
                         enable_checkpointing=False,
                         enable_model_summary=False, limit_val_batches=1, val_check_interval=6)
    model = LlamaLM(vocab_size=V, dim=D, n_layers=L, n_heads=H, mlp_hidden=M, max_seq_len=S)
    trainer.fit(model, MarkovDataModule(vocab_size=V, seq_len=S, num_train=64, num_val=4, batch_size=4))
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return trainer, list(csv.DictReader(f))


def test_single_device_accumulation_sac_and_sources(tmp_path: Path) -> None:
    batch = 4
    model_flops, hardware_flops, _ = _analytic(D, L, H, H, M, V, batch, S)
    runs = {}
    for name, sac in [("plain", None), ("full_sac", ActivationCheckpointing(mode="full"))]:
        monitor = MFUMonitor(window=2, warmup_steps=1, peak_flops=1e11, tokens_per_sample=S)
        trainer, rows = _fit(tmp_path, [monitor] + ([sac] if sac else []), name)
        runs[name] = (monitor, trainer.callback_metrics, rows, trainer.progress_bar_metrics)
    plain, sac = runs["plain"][0], runs["full_sac"][0]
    assert (plain.flops.model, plain.flops.hardware) == (model_flops, hardware_flops)
    assert sac.flops.model == plain.flops.model  # MFU's numerator ignores recomputation ...
    assert sac.flops.hardware > plain.flops.hardware  # ... HFU's counts it
    for monitor, metrics, rows, bar in runs.values():
        # gradient accumulation: one step = 2 batches
        assert float(metrics["perf/batches_per_step"]) == 2
        assert float(metrics["perf/model_flops_per_step"]) == pytest.approx(2 * monitor.flops.model, rel=1e-6)
        assert float(metrics["perf/hfu/median"]) / float(metrics["perf/mfu/median"]) == pytest.approx(
            monitor.flops.hardware / monitor.flops.model, rel=1e-4)
        assert float(metrics["perf/mfu/median"]) == pytest.approx(
            float(metrics["perf/tflops_per_device/median"]) * 1e12 / 1e11, rel=1e-4)
        assert float(metrics["perf/tokens_per_sec"]) == pytest.approx(
            float(metrics["perf/samples_per_sec"]) * S, rel=1e-4)
        assert {"perf/tflops_per_device/median", "perf/mfu/median"} <= set(bar)
        logged = [r for r in rows if r.get("perf/mfu/median")]
        assert logged and all(float(r["perf/mfu/median"]) > 0 for r in logged)  # reached the CSV logger

    # docs/callbacks/mfu_monitor.md lists exactly the names the callback logs (default prefix: perf)
    page = (ROOT / "docs" / "callbacks" / "mfu_monitor.md").read_text().split("## Metric names", 1)[1]
    documented = set(re.findall(r"`(perf(?:_cum)?/[\w/]+)`", page.split("\n## ", 1)[0]))
    logged = {k for k in runs["plain"][1] if k.startswith("perf")}
    assert documented == logged, (sorted(logged - documented), sorted(documented - logged))

    # user-given and analytic sources
    given = MFUMonitor(window=2, warmup_steps=1, flops_per_batch=lambda batch: 1000 * batch.shape[0])
    analytic = MFUMonitor(
        window=2, warmup_steps=1, flops_source="analytic", tokens_per_sample=S, prefix="perf2"
    )
    _fit(tmp_path, [given, analytic], "sources")
    assert given.flops.model == 4000 and given.source == "flops_per_batch (user)"
    norm_params = (2 * L + 1) * D  # the analytic formula's N also counts the RMSNorm weights
    linear_params = _analytic(D, L, H, H, M, V, batch, S)[2]
    assert analytic.flops.model == analytic_transformer_flops(linear_params + norm_params, L, D, S, batch * S)


class _Tick(pl.Callback):
    """A fake clock for MFUMonitor: every micro-batch takes exactly one second (listed before the monitor)."""

    def __init__(self) -> None:
        self.now = 0.0

    def on_train_batch_end(self, *args: object) -> None:
        self.now += 1.0


def test_accumulation_keeps_mfu_and_tokens_per_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same micro-batch, same time per micro-batch: accumulation 1 and 4 report the same MFU, TFLOPS, tokens/s
    and samples/s (per micro-batch rates, not 4x or 1/4x); only the per-optimizer-step figures are 4x.

    Measured on today's code, nothing to fix: the monitor books every micro-batch's FLOPs, tokens and samples
    and divides by the wall time of whole optimizer steps (a window ends only after an optimizer step).
    """
    from fsdp_strategies.callbacks import mfu

    tick = _Tick()
    monkeypatch.setattr(mfu, "time", SimpleNamespace(perf_counter=lambda: tick.now))
    batch, results = 4, {}
    for acc in (1, 4):
        monitor = MFUMonitor(window=2, warmup_steps=1, peak_flops=1e9, tokens_per_sample=S, prog_bar=False)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=5, accumulate_grad_batches=acc,
                             logger=False, callbacks=[tick, monitor], enable_checkpointing=False,
                             enable_model_summary=False, enable_progress_bar=False, limit_val_batches=0)
        model = LlamaLM(vocab_size=V, dim=D, n_layers=L, n_heads=H, mlp_hidden=M, max_seq_len=S)
        trainer.fit(
            model, MarkovDataModule(vocab_size=V, seq_len=S, num_train=128, num_val=4, batch_size=batch)
        )
        results[acc] = ({k: float(v) for k, v in trainer.callback_metrics.items()}, monitor.flops.model)
    (one, flops), (four, flops4) = results[1], results[4]
    assert flops == flops4  # FLOPs of one micro-batch (counted on the first)
    for name in ("mfu/median", "tflops_per_device/median", "tokens_per_sec", "samples_per_sec",
                 "mfu_cum/median"):
        key = f"perf/{name}" if not name.startswith("mfu_cum") else "perf_cum/mfu/median"
        assert four[key] == pytest.approx(one[key], rel=1e-6), name
    # one micro-batch per second (logged values are float32)
    assert one["perf/mfu/median"] == pytest.approx(flops / 1.0 / 1e9, rel=1e-6)
    assert one["perf/tokens_per_sec"] == pytest.approx(batch * S, rel=1e-6)
    assert four["perf/model_flops_per_step"] == pytest.approx(4 * one["perf/model_flops_per_step"], rel=1e-6)
    assert (one["perf/batches_per_step"], four["perf/batches_per_step"]) == (1.0, 4.0)


@pytest.mark.multiprocess
def test_ddp_two_ranks_mfu_config(tmp_path: Path) -> None:
    batch = 4
    run_python([
        str(WORKERS / "mfu_cli.py"), "fit", "--config", str(ROOT / "configs" / "mfu.yaml"),
        "--trainer.max_steps", "5", "--trainer.val_check_interval", "4", "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), "--trainer.callbacks.window", "2",
        "--trainer.callbacks.warmup_steps", "1", "--trainer.callbacks.tokens_per_sample", str(S),
        f"--model.vocab_size={V}", f"--model.dim={D}", f"--model.n_layers={L}", f"--model.n_heads={H}",
        f"--model.mlp_hidden={M}", f"--model.max_seq_len={S}", f"--data.vocab_size={V}",
        f"--data.seq_len={S}", f"--data.batch_size={batch}", "--data.num_train=128", "--data.num_val=8",
    ], env={"MFU_OUT": str(tmp_path), "FSDP_STRATEGIES_PEAK_FLOPS": "1e11"}, timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    model_flops, hardware_flops, _ = _analytic(D, L, H, H, M, V, batch, S)
    gathered = torch.tensor(ranks[0]["gathered"], dtype=torch.float64)
    for r in ranks:
        assert r["strategy"] == "DDPStrategy" and r["world"] == 2 and r["peak"] == 1e11
        assert r["flops"] == [model_flops, hardware_flops]
        assert r["gathered"] == ranks[0]["gathered"]  # every rank holds every rank's own values ...
        assert r["gathered"][r["rank"]] == r["local_values"]  # ... row r is rank r's measurement
        metrics = r["metrics"]
        for i, rate in enumerate(["tflops_per_device", "mfu", "hfu", "tokens_per_sec_per_device"]):
            column = gathered[:, i]
            assert metrics[f"perf/{rate}/min"] == pytest.approx(float(column.min()), rel=1e-5)
            assert metrics[f"perf/{rate}/max"] == pytest.approx(float(column.max()), rel=1e-5)
            assert metrics[f"perf/{rate}/median"] == pytest.approx(float(column.mean()), rel=1e-5)  # 2 ranks
        assert metrics["perf/tokens_per_sec"] == pytest.approx(float(gathered[:, 3].sum()), rel=1e-5)
        assert metrics["perf/batches_per_step"] == 2  # accumulate_grad_batches: 2 in the config
        assert metrics["perf/model_flops_per_step"] == pytest.approx(2 * model_flops, rel=1e-6)
