"""Mid-epoch resume with plain DataLoaders: stopped + resumed must equal the uninterrupted fit, bit for bit.

Each case trains the example Llama (tiny) for ``steps`` optimizer steps, and separately for ``stop_at``
steps (checkpoint mid-epoch, same ``max_steps``) + a resume from that checkpoint; the batches seen and
the final parameters must be identical. See tests/workers/resume_train.py for the harness.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.strategies import SingleDeviceStrategy

from conftest import WORKERS, run_python
from workers.resume_train import SkipSingleDevice, StatefulLoader, stop_and_resume

BATCH = 8
_LIGHTNING_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


def _assert_same_run(run: dict[str, Any]) -> None:
    seen = run["first_batches"] + run["resumed_batches"]
    assert len(seen) == len(run["full_batches"])
    for i, (got, want) in enumerate(zip(seen, run["full_batches"])):
        assert torch.equal(got, want), f"batch {i} differs from the uninterrupted run"
    assert run["resumed_batch_idx"] == run["full_batch_idx"][len(run["first_batches"]):]
    assert run["resumed_global_step"] == run["full_global_step"]
    for name, want in run["full_params"].items():
        assert torch.equal(run["resumed_params"][name], want), f"{name} differs from the uninterrupted run"


def _our_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "cannot be restored" in str(w.message)]


@pytest.mark.parametrize(
    ("case", "kwargs", "skipped"),
    [
        # 6 batches per epoch; checkpoint after batch 4 of epoch 0
        ("sequential", {"steps": 10, "stop_at": 4, "data_kwargs": {"num_train": 48, "shuffle": False}}, 4),
        # the same with the function called twice in on_train_start (e.g. by a subclass): no double skip
        ("sequential_called_twice", {"steps": 10, "stop_at": 4, "calls": 2,
                                     "data_kwargs": {"num_train": 48, "shuffle": False}}, 4),
        # a seeded shuffle (order from seed + set_epoch), a worker process, accumulation 2: 3 steps per epoch,
        # checkpoint after step 5 = batch 4 of epoch 1, whose order differs from epoch 0
        ("seeded_epoch1_accumulate", {"steps": 8, "stop_at": 5, "sampler": "seeded", "accumulate": 2,
                                      "data_kwargs": {"num_train": 48, "num_workers": 1}}, 4),
        # checkpoint written by validation at batch 4 (a different restart stage than on_train_batch_end)
        ("checkpoint_at_validation", {"steps": 10, "stop_at": 4, "val_check_interval": 4,
                                      "data_kwargs": {"num_train": 48, "shuffle": False}}, 4),
        # two loaders (6 and 4 batches, max_size_cycle): at batch 5 the short one is 1 batch into its 2nd
        # cycle
        ("two_loaders", {"steps": 10, "stop_at": 5, "sampler": "two", "data_kwargs": {"num_train": 48}}, 5),
    ],
)
def test_mid_epoch_resume_equals_uninterrupted_run(tmp_path: Path, case: str, kwargs: dict[str, Any],
                                                  skipped: int) -> None:
    kwargs = dict(kwargs)
    calls = kwargs.pop("calls", 1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run = stop_and_resume(tmp_path, strategy=lambda: SkipSingleDevice("cpu", calls=calls), **kwargs)
    assert run["skipped"] == skipped
    _assert_same_run(run)
    if not kwargs["data_kwargs"].get("num_workers"):  # (workers prefetch beyond the last step)
        # skipped batches are dropped as indices: only the samples of the batches trained after resuming are
        # loaded
        assert run["samples_loaded"] == sum(b.shape[0] * b.shape[1] for b in run["resumed_batches"])
    assert not _our_warnings(record)
    assert not [w for w in record if _LIGHTNING_NOT_RESUMABLE in str(w.message)]  # no longer true: not shown
    # the rebuilt loaders wrap the original sampler, and skip in their first iteration only
    loader = run["train_loader"]
    for dl in loader.values() if isinstance(loader, dict) else [loader]:
        assert type(dl.sampler).__name__ == "_SkipFirstIterationSampler"
        assert dl.sampler.skip == 0
        assert len(list(iter(dl))) == len(dl)


def test_without_the_skip_the_resume_replays_batches(tmp_path: Path) -> None:
    # the control: Lightning alone restarts the epoch from its first batch, which the comparison detects
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run = stop_and_resume(tmp_path, strategy=lambda: SingleDeviceStrategy("cpu"), steps=10, stop_at=4,
                              data_kwargs={"num_train": 48, "shuffle": False})
    assert [w for w in record if _LIGHTNING_NOT_RESUMABLE in str(w.message)]  # Lightning's own warning
    seen = run["first_batches"] + run["resumed_batches"]
    assert len(seen) == len(run["full_batches"])
    assert torch.equal(seen[4], run["full_batches"][0])  # batch 0 of epoch 0 trained again
    assert not all(torch.equal(a, b) for a, b in zip(seen, run["full_batches"]))


def test_random_sampler_keeps_epoch_length_and_warns_order_is_new(tmp_path: Path) -> None:
    with pytest.warns(PossibleUserWarning, match="RandomSampler"):
        run = stop_and_resume(tmp_path, strategy=lambda: SkipSingleDevice("cpu"), steps=10, stop_at=4,
                              data_kwargs={"num_train": 48, "shuffle": True}, uninterrupted=False)
    assert run["skipped"] == 4
    assert run["resumed_batch_idx"] == [4, 5, 0, 1, 2, 3]  # rest of epoch 0, then epoch 1
    assert run["samples_loaded"] == 6 * BATCH


def test_iterable_dataset_warns_once_that_data_is_replayed(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run = stop_and_resume(tmp_path, strategy=lambda: SkipSingleDevice("cpu"), steps=6, stop_at=3,
                              sampler="iterable", data_kwargs={"num_train": 64}, uninterrupted=False)
    assert run["skipped"] == 0
    ours = _our_warnings(record)
    assert len(ours) == 1, ours
    assert "replays" in ours[0] and "IterableDataset" in ours[0] and "StatefulDataLoader" in ours[0]


def test_stateful_loader_is_left_to_lightning(tmp_path: Path) -> None:
    StatefulLoader.loaded_states.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run = stop_and_resume(tmp_path, strategy=lambda: SkipSingleDevice("cpu"), steps=10, stop_at=4,
                              sampler="stateful", data_kwargs={"num_train": 48}, uninterrupted=False)
    assert run["skipped"] == 0
    assert type(run["train_loader"]) is StatefulLoader  # not rebuilt
    assert StatefulLoader.loaded_states == [{"marker": 1}]  # Lightning restored it from the checkpoint
    assert not _our_warnings(record)


@pytest.mark.multiprocess
def test_two_ranks_resume_with_injected_distributed_sampler(tmp_path: Path) -> None:
    # One real 2-rank job (Lightning's launcher, gloo) runs the comparison with Lightning's DDPStrategy
    # (one-file checkpoint) and the package's FSDP2Strategy (sharded DCP checkpoint). 96 samples / 2 ranks /
    # batch 8 =
    # 6 batches per epoch; checkpoint at step 8 = batch 2 of epoch 1; shuffle=True makes Lightning inject a
    # DistributedSampler, so the resumed epoch's order depends on set_epoch reaching it through the wrapper.
    out = tmp_path / "resume.pt"
    run_python([str(WORKERS / "resume_train.py"), "--out", str(out), "--devices", "2", "--steps", "16",
                "--stop-at", "8", "--num-train", "96", "--strategies", "ddp,fsdp2,ddp_hooks"], timeout=600)
    results = torch.load(out, weights_only=False)
    assert sorted(results) == ["ddp", "ddp_hooks", "fsdp2"]
    for name, ranks in results.items():
        assert len(ranks) == 2, name
        for rank in ranks:
            # the test's own strategy subclass records the count; FSDP2Strategy calls it built in
            if name == "ddp":
                assert rank["skipped"] == 2, name
            assert rank["sampler_type"] == "DistributedSampler", name  # the injected one, under the wrapper
            _assert_same_run(rank)  # FSDP2: this rank's parameter shards
            assert rank["samples_loaded"] == len(rank["resumed_batches"]) * BATCH, name
        # the ranks trained on different shards of the data
        assert not torch.equal(ranks[0]["full_batches"][0], ranks[1]["full_batches"][0]), name
    for key, p in results["ddp"][0]["resumed_params"].items():  # DDP replicas stay identical
        assert torch.equal(p, results["ddp"][1]["resumed_params"][key])
