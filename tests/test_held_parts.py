"""The parts a strategy holds: the agreement group, and the preemption guard <-> async checkpointing
interface.

Real objects throughout: a real gloo group (one rank, or two spawned ranks), a real background writer writing
real files. Only the strategy and the Trainer the preemption guard asks for its checkpoint are stand-ins with
the few public attributes it reads.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.trainer.states import TrainerFn

import fsdp_strategies.checkpoint.async_writer as engine
from fsdp_strategies._distributed import AgreementGroup
from fsdp_strategies.runtime.async_checkpointing import AsyncCheckpointing
from fsdp_strategies.runtime.preemption import Preempted, PreemptionGuard


# ------------------------------------------------------------------ the agreement group
def test_agreement_without_a_process_group_answers_for_this_rank() -> None:
    group = AgreementGroup()
    assert group.group() is None and group.group(single_rank=True) is None
    assert group.agree_sum(2, 0, 5) == (2, 0, 5)
    assert group.agree_any(True, False) == (True, False)
    assert group.all_gather_object({"a": 1}) == [{"a": 1}]


def test_one_rank_gets_a_group_only_when_asked_and_a_new_one_for_a_new_default_group(tmp_path: Path) -> None:
    group = AgreementGroup()
    firsts = []
    for i in range(2):  # two fits in one process: the default group is replaced in between
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'store{i}'}", rank=0, world_size=1)
        try:
            assert group.group() is None  # no peer: the per-step checks need no collective
            first = group.group(single_rank=True)  # DCP's async_save needs a CPU group even alone
            # created once per default group
            assert first is not None and group.group(single_rank=True) is first
            firsts.append(first)
        finally:
            dist.destroy_process_group()
    assert firsts[0] is not firsts[1]


def _two_ranks(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        group = AgreementGroup()
        sums = group.agree_sum(rank + 1, 10 * rank)
        anys = group.agree_any(rank == 1, False)
        gathered = group.all_gather_object(f"rank{rank}")
        torch.save({"sums": sums, "anys": anys, "gathered": gathered}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_ranks_agree_on_the_same_answers(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    mp.spawn(_two_ranks, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    for rank in (0, 1):  # a flag set on one rank only is seen by both; sums and gathers are in rank order
        got = torch.load(f"{out}.{rank}", weights_only=True)
        assert got == {"sums": (3, 10), "anys": (True, False), "gathered": ["rank0", "rank1"]}, (rank, got)


# ------------------------------------------------------------------ preemption guard <-> async checkpointing
def _parts(tmp_path: Path, *, check_due: Any = None, name: str = "last-preempt.ckpt"):
    """A guard and an async part wired as a strategy wires them, on a stand-in strategy and Trainer."""
    saves: list[tuple[str, bool, bool]] = []
    trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), sanity_checking=False,
                              received_sigterm=False,
                              checkpoint_callback=SimpleNamespace(dirpath=str(tmp_path)),
                              default_root_dir=str(tmp_path), global_step=7)
    strategy = SimpleNamespace(lightning_module=SimpleNamespace(trainer=trainer), broadcast=lambda obj: obj)
    agreement = AgreementGroup()
    guard = PreemptionGuard(strategy, True, 30.0, agreement=agreement, check_due=check_due,  # type: ignore[arg-type]
                            checkpoint_name=name)
    part = AsyncCheckpointing("thread", full_file=True, name="test", timeout=None, agreement=agreement,
                              preemption=guard)

    def save_checkpoint(path: str) -> None:  # what the strategy's save asks at its start
        background = part.use_background()
        saves.append((path, background, part.writer.in_flight))

    trainer.save_checkpoint = save_checkpoint
    return guard, part, saves


def test_a_preemption_save_waits_for_the_write_in_flight_and_is_synchronous(
    tmp_path: Path, monkeypatch
) -> None:
    gate = threading.Event()
    real_save = engine.torch.save

    def gated_save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        assert gate.wait(60)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(engine.torch, "save", gated_save)
    guard, part, saves = _parts(tmp_path, name="last-preempt-group1.ckpt")
    assert part.use_background() and not guard.is_saving()  # an ordinary save goes to the background
    first = tmp_path / "step-6.ckpt"
    part.writer.save_full({"w": torch.arange(3.0)}, first, is_rank_zero=True)
    assert part.writer.in_flight and not first.exists()
    threading.Timer(0.3, gate.set).start()
    guard.on_exception(Preempted("SIGTERM reached 1 of 1 ranks"))  # writes the preemption checkpoint
    # during it: synchronous, and the write that was in flight had committed before it started
    assert saves == [(str(tmp_path / "last-preempt-group1.ckpt"), False, False)], saves
    assert first.is_file() and not guard.is_saving()
    assert part.use_background()  # after it, saves go to the background again


def test_the_per_step_check_runs_only_on_the_steps_the_guard_allows(tmp_path: Path) -> None:
    due = {"now": False}
    _, part, _ = _parts(tmp_path, check_due=lambda: due["now"])
    part.writer.save_full({"w": torch.zeros(2)}, tmp_path / "a.ckpt", is_rank_zero=True)
    part.writer._write.thread.join()  # type: ignore[union-attr]  # finished, not yet agreed on
    part.poll_if_due()  # a local step (ranks do not meet): no agreement, the write stays in flight
    assert part.writer.in_flight
    due["now"] = True
    part.poll_if_due()  # ranks meet: the check runs, the finished write is done with
    assert not part.writer.in_flight and (tmp_path / "a.ckpt").is_file()
