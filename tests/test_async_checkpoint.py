"""``async_checkpoint``: background checkpoint writes that stay atomic (issue 14).

CI (real processes, 2 ranks, gloo, the tiny example): an ``fsdp2`` run with ``async_checkpoint='thread'``
whose third background write fails on one rank (the error is raised on every rank at the start of the
next step; the previous checkpoint stays, and ``ModelCheckpoint``'s removal of it is dropped), then an
async resume from that checkpoint that must equal the uninterrupted run exactly (4 + 4 == 8 steps).
Plus fast single-process checks of the engine and the option's validation.

``make test-full`` (the ``full`` marker, its own CI stage) adds: SIGKILL in the middle of a background write,
the ``"process"`` type, ``hsdp`` and an ``ft_hsdp`` group dying mid-write.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import WORKERS, run_python
from fsdp_strategies import FSDP2Strategy, verify_checkpoint
from fsdp_strategies.checkpoint.async_writer import (
    AsyncCheckpointer,
    AsyncCheckpointError,
    validate_async_checkpoint,
)
from fsdp_strategies.hf.export import main as export_main
from fsdp_strategies.strategies import DDPHooksStrategy, HSDPStrategy

WORKER = str(WORKERS / "fsdp_train.py")
# 2 ranks x batch 4, 32 samples: 4 steps per epoch (as tests/test_checkpoint.py)
COMMON = ["--devices", "2", "--batch", "4", "--num-train", "32", "--meta-init", "1", "--steps", "8"]


def _run(tmp_path: Path, name: str, *args: str, check: bool = True, worker: str = WORKER,
         common: list[str] = COMMON) -> tuple[dict | None, object]:
    out = tmp_path / f"{name}.pt"
    proc = run_python([worker, *common, "--out", str(out), *args], check=check, timeout=400)
    return (torch.load(out, weights_only=False) if out.exists() else None), proc


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _opt_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("value", ["yes", "threads", 1])
def test_bad_value_is_refused_at_init(value: object) -> None:
    with pytest.raises(ValueError, match=r"async_checkpoint=.*Fix: one of \['off', 'thread', 'process'\]"):
        FSDP2Strategy(async_checkpoint=value)  # type: ignore[arg-type]


def test_process_type_needs_a_sharded_checkpoint() -> None:
    with pytest.raises(
        ValueError, match=r"async_checkpoint='process' needs a sharded.*Fix: async_checkpoint: thread"
    ):
        DDPHooksStrategy(async_checkpoint="process")
    with pytest.raises(ValueError, match="needs a sharded"):
        FSDP2Strategy(async_checkpoint="process", save_distributed_checkpoint=False)
    assert HSDPStrategy(async_checkpoint="process").async_checkpoint == "process"
    assert validate_async_checkpoint(None) == validate_async_checkpoint(False) == "off"


# ---------------------------------------------------------------------------------------------- engine, one
# process
def test_full_file_writer_commits_in_background_and_defers_removals(tmp_path: Path, monkeypatch) -> None:
    """One process: the save returns before the file exists; a removal waits for the commit; a second save
    waits for the first; the written file is the state at save time."""
    import fsdp_strategies.checkpoint.async_writer as engine

    gate = threading.Event()
    real_save = torch.save

    def gated_save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        assert gate.wait(60)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(engine.torch, "save", gated_save)
    old = tmp_path / "old.ckpt"
    old.write_bytes(b"previous checkpoint")
    weights = torch.arange(4.0)
    checkpointer = AsyncCheckpointer("thread", "test")
    first = tmp_path / "a.ckpt"
    checkpointer.save_full({"state_dict": {"w": weights}}, first, is_rank_zero=True)
    weights.add_(100)  # training goes on: the staged copy is what gets written
    assert checkpointer.in_flight and not first.exists()
    assert checkpointer.defer_removal(old) and old.exists()  # ModelCheckpoint removing the previous one
    checkpointer.poll()  # still running: nothing happens
    assert checkpointer.in_flight and old.exists()
    threading.Timer(0.5, gate.set).start()
    # waits for a
    checkpointer.save_full({"state_dict": {"w": weights}}, tmp_path / "b.ckpt", is_rank_zero=True)
    assert first.is_file() and not old.exists()  # committed, then the deferred removal ran
    checkpointer.finish()
    assert not checkpointer.in_flight
    monkeypatch.setattr(engine.torch, "save", real_save)
    assert verify_checkpoint(first).ok
    assert torch.equal(torch.load(first, weights_only=True)["state_dict"]["w"], torch.arange(4.0))
    assert torch.equal(
        torch.load(tmp_path / "b.ckpt", weights_only=True)["state_dict"]["w"], torch.arange(4.0) + 100
    )
    assert not list(tmp_path.glob("*.tmp"))


def test_background_error_is_raised_at_the_next_poll_and_keeps_the_previous(
    tmp_path: Path, monkeypatch
) -> None:
    import fsdp_strategies.checkpoint.async_writer as engine

    def failing_save(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(5, "Input/output error (injected)")  # a full disk (ENOSPC) is tests/test_disk_full.py's

    previous = tmp_path / "last.ckpt"
    previous.write_bytes(b"previous checkpoint")
    monkeypatch.setattr(engine.torch, "save", failing_save)
    checkpointer = AsyncCheckpointer("thread", "test")
    checkpointer.save_full({"state_dict": {"w": torch.ones(2)}}, previous, is_rank_zero=True)
    other = tmp_path / "old.ckpt"
    other.write_bytes(b"x")
    assert checkpointer.defer_removal(other)
    deadline = time.monotonic() + 60
    while checkpointer._write is not None and checkpointer._write.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(AsyncCheckpointError,
                       match=r"last.ckpt failed \(rank 0: OSError.*injected.*previous checkpoint "
                                                   r"is untouched. Fix:"):
        checkpointer.poll()
    assert previous.read_bytes() == b"previous checkpoint" and other.exists()  # removal dropped
    assert not list(tmp_path.glob("*.tmp"))
    checkpointer.poll()  # reported once; nothing in flight any more


def test_sharded_writer_single_process(tmp_path: Path) -> None:
    """No process group: DCP's async_save (no_dist) into the temp folder, manifest, atomic rename."""
    checkpointer = AsyncCheckpointer("thread", "test")
    path = tmp_path / "s.ckpt"
    state = {"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}}
    with pytest.warns(UserWarning, match="single process"):
        checkpointer.save_sharded(state, {"epoch": 3}, path, is_rank_zero=True)
        checkpointer.finish()
    assert verify_checkpoint(path).ok and (path / "meta.pt").is_file()
    assert export_main([str(path), str(tmp_path / "plain.pt")]) == 0
    assert torch.equal(torch.load(tmp_path / "plain.pt", weights_only=True)["w"], state["state_dict"]["w"])
    checkpointer.close()


def test_sharded_writer_default_group_without_cpu_backend(tmp_path: Path) -> None:
    """One GPU (world size 1, NCCL alone) as the GPU harness first ran it: DCP's async_save refuses a default
    group without a CPU backend. Reproduced here with a ``cuda:gloo`` default group (gloo bound to CUDA only).
    Three saves with one writer: torch 2.11's stager also staged only once (see
    ``default_stager_reusable``)."""
    import torch.distributed as dist

    dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        checkpointer = AsyncCheckpointer("thread", "test")
        for step in range(3):
            state = {"state_dict": {"w": torch.full((2, 3), float(step))}}
            checkpointer.save_sharded(state, {"step": step}, tmp_path / f"s{step}.ckpt", is_rank_zero=True)
        checkpointer.finish()
        checkpointer.close()
    finally:
        dist.destroy_process_group()
    for step in range(3):
        assert verify_checkpoint(tmp_path / f"s{step}.ckpt").ok
        assert export_main([str(tmp_path / f"s{step}.ckpt"), str(tmp_path / f"p{step}.pt")]) == 0
        assert torch.equal(
            torch.load(tmp_path / f"p{step}.pt", weights_only=True)["w"], torch.full((2, 3), step * 1.0)
        )


# ---------------------------------------------------------------------------------------------- real
# processes
@pytest.mark.multiprocess
@pytest.mark.torch_range
def test_fsdp2_failed_write_is_loud_and_resume_from_async_checkpoint_is_exact(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # 8 straight steps with async saves at steps 4 and 8 (top-1, no `last`); the second background write fails
    # on rank 1. fit must not return normally: the error is raised on every rank (at the latest when training
    # ends), step=4 stays (ModelCheckpoint's removal of it was deferred, then dropped), no half checkpoint.
    straight, proc = _run(tmp_path, "straight", "--ckpt-dir", str(ckpt), "--ckpt-every", "4", "--save-last",
                          "0", "--option", "async_checkpoint='thread'", "--break-write", "2:fail",
                          "--record-at-train-end", "1", check=False)
    output = proc.stdout + proc.stderr  # type: ignore[attr-defined]
    assert proc.returncode != 0, output[-3000:]  # type: ignore[attr-defined]
    assert straight is not None and straight["global_step"] == 8
    assert ("AsyncCheckpointError: fsdp2: the background write of checkpoint" in output
            and "step=8.ckpt failed (rank 1: OSError: [Errno 5] Input/output error (injected))" in output), \
        output[-4000:]
    assert _listing(ckpt) == ["step=4.ckpt"], _listing(ckpt)
    assert verify_checkpoint(ckpt / "step=4.ckpt").ok
    # fsdp-strategies-export
    assert export_main([str(ckpt / "step=4.ckpt"), str(tmp_path / "exported.pt")]) == 0

    # Exact resume from the async checkpoint: 4 steps + save + resume + 4 steps == 8 straight steps. It saves
    # asynchronously again with top-1 + `last`: the second save of each event waits for the first, said once.
    resumed, proc = _run(tmp_path, "resumed", "--resume", str(ckpt / "step=4.ckpt"), "--ckpt-dir", str(ckpt),
                         "--ckpt-every", "2", "--option", "async_checkpoint='thread'", "--record-start", "1")
    output = proc.stdout + proc.stderr  # type: ignore[attr-defined]
    assert resumed is not None
    assert output.count("is still being written; this save waits for it") == 1, output[-3000:]
    assert _equal(torch.load(tmp_path / "exported.pt", weights_only=True), resumed["start_params"])
    assert resumed["global_step"] == 8
    assert resumed["batches"] == straight["batches"][4:]
    assert _equal(resumed["params"], straight["params"])
    assert _opt_equal(resumed["opt_state"], straight["opt_state"])
    # fit returned only after the last write committed; ModelCheckpoint's removals (of step=6 and the previous
    # `last`) ran after each commit. Lightning never removes the checkpoint a run resumed from (step=4).
    assert _listing(ckpt) == ["last.ckpt", "step=4.ckpt", "step=8.ckpt"], _listing(ckpt)
    assert all(verify_checkpoint(ckpt / name).ok for name in ("last.ckpt", "step=8.ckpt"))


@pytest.mark.multiprocess
@pytest.mark.full
def test_sigkill_during_background_write_keeps_previous(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    killed, proc = _run(tmp_path, "killed", "--ckpt-dir", str(ckpt), "--ckpt-every", "2", "--save-last", "0",
                        "--option", "async_checkpoint='thread'", "--break-write", "2:kill", check=False)
    assert killed is None and proc.returncode != 0  # type: ignore[attr-defined]
    assert "SIGKILL in the middle of the background write" in proc.stderr  # type: ignore[attr-defined]
    # shards written, never committed
    assert _listing(ckpt) == ["step=2.ckpt", "step=4.ckpt.tmp"], _listing(ckpt)
    assert verify_checkpoint(ckpt / "step=2.ckpt").ok
    assert export_main([str(ckpt / "step=2.ckpt"), str(tmp_path / "exported.pt")]) == 0
    again, _ = _run(tmp_path, "again", "--resume", str(ckpt / "step=2.ckpt"), "--ckpt-dir", str(ckpt),
                    "--ckpt-every", "2", "--save-last", "0", "--option", "async_checkpoint='thread'")
    assert again is not None and again["global_step"] == 8
    # the stale temp was cleaned by the next save; the checkpoint resumed from is kept (Lightning's rule)
    assert _listing(ckpt) == ["step=2.ckpt", "step=8.ckpt"], _listing(ckpt)


@pytest.mark.multiprocess
@pytest.mark.full
@pytest.mark.parametrize("strategy", ["fsdp2_process", "hsdp_thread"])
def test_async_resume_is_exact_other_types(tmp_path: Path, strategy: str) -> None:
    name, kind = strategy.split("_")
    extra = ["--strategy", name, "--option", f"async_checkpoint='{kind}'"]
    if name == "hsdp":
        extra += ["--replicate", "1"]
    ckpt = tmp_path / "ckpt"
    full, _ = _run(tmp_path, "full", "--strategy", name, *(["--replicate", "1"] if name == "hsdp" else []))
    half, _ = _run(tmp_path, "half", "--stop-at", "4", "--ckpt-dir", str(ckpt), "--ckpt-every", "2", *extra)
    assert full is not None and half is not None
    assert _listing(ckpt) == ["last.ckpt", "step=4.ckpt"]
    resumed, _ = _run(tmp_path, "resumed", "--resume", str(ckpt / "last.ckpt"), *extra)
    assert resumed is not None and resumed["global_step"] == 8
    assert _equal(resumed["params"], full["params"]) and _opt_equal(resumed["opt_state"], full["opt_state"])


@pytest.mark.multiprocess
@pytest.mark.full
def test_ft_hsdp_group_dying_mid_write_leaves_no_half_checkpoint(tmp_path: Path) -> None:
    """2 replica groups x 2 ranks: group 0 (the writer) dies in the middle of its second background write
    (step 4); group 1 trains on alone, becomes the writer, and its next save succeeds; step 4 never
    appears."""
    from test_ft_hsdp import FT, _launch

    ckpt = tmp_path / "ckpt"
    _launch(tmp_path, "ft",
            [*FT, "--trainer.max_steps", "12", "--trainer.strategy.init_args.async_checkpoint", "thread"],
            ["--min-replicas", "1", "--max-restarts", "1"],
            {"FT_TEST_CKPT": str(ckpt), "FT_TEST_CKPT_EVERY": "2", "FT_TEST_BREAK_WRITE": "0:2",
             "FT_TEST_SLEEP_ALONE": "1.0"}, timeout=600)
    names = _listing(ckpt)
    assert "step2.ckpt" in names and "step4.ckpt" not in names, names
    assert not [n for n in names if n.endswith(".tmp")], names  # the dead group's temp was cleaned up
    assert "step6.ckpt" in names and len(names) >= 3, names
    assert all(verify_checkpoint(ckpt / n).ok for n in names), names
