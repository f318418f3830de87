"""Checkpoints of fsdp2 with real processes: exact resume, crash-safe saves, top-k, export, meta init."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import WORKERS, run_python
from fsdp_strategies import export_consolidated

pytestmark = pytest.mark.multiprocess
WORKER = str(WORKERS / "fsdp_train.py")
# 2 ranks x batch 4, 32 samples: 4 steps per epoch; the half-way checkpoint is at an epoch boundary.
COMMON = ["--devices", "2", "--batch", "4", "--num-train", "32", "--meta-init", "1", "--steps", "8"]


def _run(tmp_path: Path, name: str, *args: str, check: bool = True) -> tuple[dict | None, int]:
    out = tmp_path / f"{name}.pt"
    proc = run_python([WORKER, *COMMON, "--out", str(out), *args], check=check, timeout=300)
    return (torch.load(out, weights_only=False) if out.exists() else None), proc.returncode


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _opt_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)


def test_resume_is_exact_and_saves_are_atomic(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    full, _ = _run(tmp_path, "full")
    half, _ = _run(tmp_path, "half", "--stop-at", "4", "--ckpt-dir", str(ckpt), "--ckpt-every", "2")
    assert full is not None and half is not None

    # Meta-device init: configure_model built every parameter on meta; after setup each rank holds
    # real (non-meta) local shards of half the bytes -- the full model was never materialised.
    assert half["built_on_meta"] is True
    assert all(not r["local_is_meta"] for r in half["ranks"])
    full_bytes = sum(p.numel() for p in half["params"].values()) * 4
    assert all(r["param_bytes"] == pytest.approx(full_bytes / 2, rel=0.02) for r in half["ranks"])
    assert all(torch.isfinite(p).all() for p in half["params"].values())

    # ModelCheckpoint(save_top_k=1, save_last=True) through the strategy: step=2 was removed.
    assert sorted(p.name for p in ckpt.iterdir()) == ["last.ckpt", "step=4.ckpt"]
    assert (ckpt / "step=4.ckpt").is_dir()  # sharded DCP folder

    # Consolidated export: one plain state_dict, loadable into the unmodified model.
    exported = export_consolidated(ckpt / "last.ckpt", tmp_path / "consolidated.pt")
    from llama import LlamaLM
    from workers.fsdp_train import MODEL

    plain = LlamaLM(**MODEL)
    plain.configure_model()
    plain.load_state_dict(torch.load(exported, weights_only=True))
    assert _equal({n: p.detach() for n, p in plain.named_parameters()}, half["params"])

    # Exact resume: 4 steps + save + resume + 4 steps == 8 steps (parameters, optimizer state, step).
    resumed, _ = _run(tmp_path, "resumed", "--resume", str(ckpt / "last.ckpt"))
    assert resumed is not None
    assert resumed["global_step"] == full["global_step"] == 8
    assert resumed["batches"] == full["batches"][4:]
    assert _equal(resumed["params"], full["params"])
    assert _opt_equal(resumed["opt_state"], full["opt_state"])

    # A crash in the middle of the next save (shards written, not committed) leaves the last good
    # checkpoint intact and loadable; resuming from it still reproduces the full run exactly.
    crash_dir = tmp_path / "crash"
    shutil.copytree(ckpt, crash_dir)
    crashed, code = _run(tmp_path, "crashed", "--resume", str(crash_dir / "last.ckpt"), "--ckpt-dir",
                         str(crash_dir), "--ckpt-every", "2", "--crash-on-save", "1", check=False)
    assert crashed is None and code != 0
    leftovers = sorted(p.name for p in crash_dir.iterdir())
    assert any(name.endswith(".tmp") for name in leftovers), leftovers  # the interrupted write
    survivor = export_consolidated(crash_dir / "last.ckpt", tmp_path / "after_crash.pt")
    assert _equal(torch.load(survivor, weights_only=True), half["params"])
    again, _ = _run(tmp_path, "again", "--resume", str(crash_dir / "last.ckpt"), "--ckpt-dir", str(crash_dir),
                    "--ckpt-every", "2")
    assert again is not None and _equal(again["params"], full["params"])
    assert not any(p.name.endswith(".tmp") for p in crash_dir.iterdir())  # the next save cleaned up
