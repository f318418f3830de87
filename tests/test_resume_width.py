"""A mid-epoch resume at another data-parallel width, mesh or strategy trains every sample of the epoch once.

The real runs are chains of torchrun jobs (tests/workers/resume_width.py): each phase resumes the previous
phase's ``last.ckpt`` with another number of ranks, mesh or strategy, records the sample ids every rank
trains, and stops a few steps later (the last phase runs to the end of the epoch). Across the chain every
sample of the 200-sample epoch must be trained exactly once -- up to ``DistributedSampler``'s own padding of
the last remainder (at most ``ranks - 1`` repeats). The refusals (a loader whose position cannot be
recomputed) run in one process, on a checkpoint whose record says it was written by 2 ranks.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from conftest import WORKERS, run_torchrun
from fsdp_strategies.runtime import data_position
from fsdp_strategies.runtime.data_position import DataPositionError, split_remainder
from fsdp_strategies.runtime.resume_position import ResumePositionMixin
from workers.resume_train import TINY_MODEL, LlamaLM, ResumeData, StopAt, TwoLoaderLM

N = 200


def _chain(out: Path, phases: list[tuple[str, int, list[str], int | None]], shuffle: bool) -> dict[str, str]:
    """Run the phases one after the other, each resuming the previous one's ``last.ckpt``; their logs by
    name."""
    logs: dict[str, str] = {}
    previous = None
    for name, devices, extra, stop in phases:
        args = ["--devices", str(devices), "--phase", name, "--out", str(out), "--samples", str(N),
                "--shuffle", str(int(shuffle)), *extra]
        if stop is not None:
            args += ["--stop-at", str(stop)]
        if previous is not None:
            args += ["--resume", str(out / f"ckpt-{previous}" / "last.ckpt")]
        proc = run_torchrun(WORKERS / "resume_width.py", devices, args, timeout=400)
        logs[name] = proc.stdout + proc.stderr
        previous = name
    return logs


def _trained(out: Path, phases: list[str]) -> tuple[Counter[int], dict[str, int]]:
    """Sample id -> times trained over the chain (tensor-parallel peers counted once); samples per phase."""
    counts: Counter[int] = Counter()
    per_phase: dict[str, int] = {}
    for phase in phases:
        by_dp_rank: dict[int, list[list[int]]] = {}
        for path in sorted(out.glob(f"{phase}-rank*.json")):
            rec = json.loads(path.read_text())
            if rec["dp_rank"] in by_dp_rank:  # a tensor-parallel peer: the same batches
                assert by_dp_rank[rec["dp_rank"]] == rec["batches"], (phase, path.name)
                continue
            by_dp_rank[rec["dp_rank"]] = rec["batches"]
        assert by_dp_rank, phase
        lengths = {len(b) for b in by_dp_rank.values()}
        assert len(lengths) == 1, (phase, lengths)  # every rank trained the same number of batches (no hang)
        per_phase[phase] = 0
        for batches in by_dp_rank.values():
            for batch in batches:
                counts.update(batch)
                per_phase[phase] += len(batch)
    return counts, per_phase


def _assert_once(counts: Counter[int], max_repeats: int) -> None:
    missing = sorted(set(range(N)) - set(counts))
    twice = {i: c for i, c in counts.items() if c > 1}
    assert not missing, f"never trained: {missing}"
    assert all(c == 2 for c in twice.values()) and len(twice) <= max_repeats, (
        f"trained more than once: {twice}"
    )


@pytest.mark.multiprocess
def test_fsdp2_grown_shrunk_and_uneven_trains_every_sample_once(tmp_path: Path) -> None:
    # shuffle on (the injected DistributedSampler's seeded order): 2 ranks -> 4 -> 2 -> 3 (200 / 4 per batch)
    # the last phase trains a second epoch and validates at each epoch end
    phases = [("a", 2, [], 6), ("b", 4, [], 9), ("c", 2, [], 12),
              ("d", 3, ["--epochs", "2", "--val", "1"], None)]
    logs = _chain(tmp_path, phases, shuffle=True)
    counts, per_phase = _trained(tmp_path, [p[0] for p in phases])
    assert per_phase == {"a": 48, "b": 48, "c": 24, "d": 81}  # 80 left over 3 ranks: padded to 81
    _assert_once(counts, max_repeats=1)
    # the epoch after the resumed one is the new sampler's own again: 200 over 3 ranks (67 each, 17 batches)
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("d-rank*.json"))]
    later: Counter[int] = Counter(i for rec in ranks for batch in rec["later"] for i in batch)
    assert [len(rec["later"]) for rec in ranks] == [17] * 3 and sum(later.values()) == 201
    _assert_once(later, max_repeats=1)
    # validation ran at the end of the resumed epoch (its 7 batches) and of the next one (7 + 17)
    assert all(rec["validations"] == [[0, 7], [1, 24]] for rec in ranks), (
        [rec["validations"] for rec in ranks]
    )
    assert ("Resuming mid-epoch 0 at global sample 48 of 200: the checkpoint's data-parallel size 2 "
            "(global batch 8) -> now 4 (global batch 16)") in logs["b"]
    assert "at global sample 96 of 200: the checkpoint's data-parallel size 4" in logs["c"]
    assert "at global sample 120 of 200" in logs["d"] and "27 each (7 batches)" in logs["d"]


@pytest.mark.multiprocess
def test_strategy_and_mesh_changes_keep_the_position(tmp_path: Path) -> None:
    # shuffle off: ddp_hooks 2 ranks -> hsdp 2x2 -> fsdp2 with tensor_parallel_degree=2 on 4 ranks
    # (data-parallel size 2) -> fsdp2 on 2 ranks without tensor parallelism (same width, but the epoch was
    # split by a resume)
    phases = [("a", 2, ["--strategy", "ddp_hooks"], 4),
              ("b", 4, ["--strategy", "hsdp", "--replicate", "2"], 6),
              ("c", 4, ["--strategy", "fsdp2", "--tp", "2"], 9), ("d", 2, ["--strategy", "fsdp2"], None)]
    logs = _chain(tmp_path, phases, shuffle=False)
    counts, per_phase = _trained(tmp_path, [p[0] for p in phases])
    assert per_phase == {"a": 32, "b": 32, "c": 24, "d": 112}
    _assert_once(counts, max_repeats=0)
    assert ("at global sample 64 of 200: the checkpoint's data-parallel size 4 (global batch 16) "
            "-> now 2") in logs["c"]
    assert ("at global sample 88 of 200: the checkpoint's data-parallel size 2 (global batch 8) "
            "-> now 2") in logs["d"]


def test_split_remainder_pads_or_drops_like_distributed_sampler() -> None:
    rest = list(range(10, 17))  # 7 samples over 3 ranks
    assert [split_remainder(rest, 3, r, drop_last=False) for r in range(3)] == [[10, 13, 16], [11, 14, 10],
                                                                                  [12, 15, 11]]
    assert [split_remainder(rest, 3, r, drop_last=True) for r in range(3)] == [[10, 13], [11, 14], [12, 15]]
    assert split_remainder([5], 4, 3, drop_last=False) == [5]  # padding longer than the remainder


class _RecordingSingleDevice(ResumePositionMixin, SingleDeviceStrategy):
    """The package's resume logic on one device: saves the record, hands the loaded one over."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        checkpoint.update(data_position.record(self.lightning_module.trainer))
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=False)
        self.restored_data_position(checkpoint)
        return checkpoint


def _module(sampler: str) -> pl.LightningModule:
    return TwoLoaderLM(**TINY_MODEL) if sampler == "two" else LlamaLM(**TINY_MODEL)


def _as_if_written_by_two_ranks(tmp_path: Path, sampler: str) -> str:
    """A mid-epoch checkpoint (step 3 of 6) whose record says 2 data-parallel ranks wrote it."""
    pl.seed_everything(7)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="mid", every_n_train_steps=3,
                           save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=_RecordingSingleDevice(torch.device("cpu")),
                         max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[StopAt(3), ckpt])
    trainer.fit(_module(sampler), ResumeData(sampler, num_train=48))
    path = tmp_path / "ckpt" / "mid.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    checkpoint[data_position.KEY]["data_parallel_size"] = 2
    torch.save(checkpoint, path)
    return str(path)


@pytest.mark.parametrize(("sampler", "reason"), [
    ("stateful", "is a stateful loader (its saved state is per rank)"),
    ("iterable", "iterates an `IterableDataset`"),
    ("two", "there are 2 training dataloaders"),
])
def test_a_position_that_cannot_be_recomputed_is_refused(tmp_path: Path, sampler: str, reason: str) -> None:
    path = _as_if_written_by_two_ranks(tmp_path, sampler)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=_RecordingSingleDevice(torch.device("cpu")),
                         max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    with pytest.raises(DataPositionError) as err:
        trainer.fit(_module(sampler), ResumeData(sampler, num_train=48), ckpt_path=path)
    message = str(err.value)
    assert ("at data-parallel size 1: the checkpoint was written at data-parallel size 2 after 3 "
            "batches") in message
    assert reason in message and "Fix: resume at data-parallel size 2" in message


def test_refuse_policy_names_both_sizes(tmp_path: Path) -> None:
    # what ft_hsdp does (data_width_change="refuse") when the number of groups or the group size changed
    path = _as_if_written_by_two_ranks(tmp_path, "default")
    strategy = _RecordingSingleDevice(torch.device("cpu"))
    strategy.data_width_change = "refuse"
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=6, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(DataPositionError,
                       match=r"another data-parallel size \(the checkpoint's: 2, now: 1\)"):
        trainer.fit(LlamaLM(**TINY_MODEL), ResumeData("default", num_train=48), ckpt_path=path)
