"""A checkpoint save that runs out of disk space (ENOSPC): one clear error on every rank, no partial temp
left.

The multi-process tests mount a real ``tmpfs`` that holds one checkpoint of the tiny example Llama (~1.7 MB)
but not two, and train with ``ModelCheckpoint(save_last=True, every_n_train_steps=2)`` on 2 ranks (torchrun,
gloo): the save at step 2 fits, the save at step 4 runs out of space while ``last.ckpt`` is still on disk.
Each test checks what a user sees on each rank's stderr (the checkpoint, "no space left on device", the bytes
needed and free, the last good checkpoint, one traceback), that no ``*.tmp`` is left, and that the last good
checkpoint verifies and resumes. Torchrun, not Lightning's own launcher: that one SIGKILLs the other ranks as
soon as rank 0 raises, before they print their error.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from conftest import WORKERS, run_python, run_torchrun
from fsdp_strategies import verify_checkpoint
from fsdp_strategies.checkpoint.atomic import last_good_checkpoint, temp_path
from fsdp_strategies.checkpoint.disk_full import (
    CheckpointDiskFullError,
    disk_full_evidence,
    disk_full_message,
    free_bytes,
    path_bytes,
)

WORKER = WORKERS / "disk_full_train.py"
DISK_KIB = 2500  # one checkpoint of the worker's model is ~1.7 MB (sharded folder or full file)
_MESSAGE = re.compile(
    r"CheckpointDiskFullError: Checkpoint (?P<path>\S+) was not saved: no space left on device\. "
    r"It needs about (?P<needed>[\d,]+) bytes .*?; (?P<free>[\d,]+) bytes \([\d.]+ MiB\) are free "
    r"on the filesystem of (?P<dir>\S+) \(after removing the partial (?P<tmp>\S+)\)\. The last "
    r"good checkpoint is (?P<last_good>\S+); it is untouched .*Fix: free space"
)


# ---------------------------------------------------------------------------------------------- unit tests
def _enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def test_errno_anywhere_in_the_chain_is_a_full_disk(tmp_path: Path) -> None:
    """DCP wraps each rank's failure as ``{rank: (exception, traceback)}`` in a BaseException; a cause
    chain."""
    wrapped = dcp.CheckpointException("save failed", {1: (_enospc(), None)})
    assert disk_full_evidence(wrapped, tmp_path, needed=1)
    try:
        try:
            raise _enospc()
        except OSError as inner:
            raise RuntimeError("writer failed") from inner
    except RuntimeError as outer:
        assert disk_full_evidence(outer, tmp_path, needed=1)
    assert not disk_full_evidence(dcp.CheckpointException("x", {0: (PermissionError(13, "denied"), None)}),
                                  tmp_path, needed=1)


def test_text_alone_counts_only_when_statvfs_confirms(tmp_path: Path) -> None:
    """torch's zip writer's message (what a writer in another process sends) is confirmed by the free
    space."""
    zip_error = dcp.CheckpointException("x", {0: (RuntimeError("[enforce fail at inline_container.cc:672] . "
                                                               "unexpected pos 704 vs 598"), None)})
    free = free_bytes(tmp_path)
    assert not disk_full_evidence(zip_error, tmp_path, needed=1)  # plenty of space: not a full disk
    assert disk_full_evidence(zip_error, tmp_path, needed=free + 2**30)
    assert not disk_full_evidence(RuntimeError("something else"), tmp_path, needed=free + 2**30)


def test_error_is_an_oserror_that_survives_pickling(tmp_path: Path) -> None:
    message = disk_full_message(tmp_path / "last.ckpt", needed=2000, free=1000,
                                last_good=tmp_path / "last.ckpt",
                                temp_removed=tmp_path / "last.ckpt.tmp", cause="rank 0: OSError: [Errno 28]")
    err = CheckpointDiskFullError(message, path=tmp_path / "last.ckpt", needed=2000, free=1000,
                                  last_good=tmp_path / "last.ckpt")
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and str(err) == message
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.needed, back.free, back.last_good) == (message, 2000, 1000,
                                                                   tmp_path / "last.ckpt")
    assert "no space left on device" in message and "2,000 bytes" in message and "1,000 bytes" in message
    assert message.rstrip().endswith("(ModelCheckpoint(dirpath=...)).") and "Fix:" in message


def test_last_good_checkpoint_is_the_target_or_the_newest_committed_sibling(tmp_path: Path) -> None:
    older, newer = tmp_path / "epoch=0-step=2.ckpt", tmp_path / "epoch=0-step=4.ckpt"
    older.write_bytes(b"x")
    newer.mkdir()
    os.utime(older, (1, 1))
    temp_path(tmp_path / "epoch=0-step=6.ckpt").mkdir()  # a partial temp is never "good"
    assert last_good_checkpoint(tmp_path / "epoch=0-step=6.ckpt") == newer
    assert last_good_checkpoint(older) == older
    assert last_good_checkpoint(tmp_path / "nothing" / "last.ckpt") is None


# ---------------------------------------------------------------------------------------------- real ENOSPC
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of DISK_KIB KiB (one checkpoint fits, two do not), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no `mount` command: the test needs to mount a small tmpfs")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_KIB}k", "tmpfs", str(disk)],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root / CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)


def _rank_lines(stderr: str, rank: int) -> str:
    """What rank ``rank`` wrote to stderr (torchrun prefixes each line with ``[rankN]:``)."""
    prefix = f"[rank{rank}]:"
    return "\n".join(line[len(prefix):] for line in stderr.splitlines() if line.startswith(prefix))


CASES = {
    "fsdp2-sync": [],
    "fsdp2-async-thread": ["--async", "thread"],
    "fsdp2-async-process": ["--async", "process"],
    "hsdp-sync": ["--strategy", "hsdp"],
    "hsdp-async-thread": ["--strategy", "hsdp", "--async", "thread"],
    "fsdp2-full-file": ["--full-file"],
    # through the package's commit path, not Lightning's CheckpointIO
    "ddp_hooks-sync": ["--strategy", "ddp_hooks"],
    "ddp_hooks-async-thread": ["--strategy", "ddp_hooks", "--async", "thread"],
}
#: resumed for real (one per checkpoint format and strategy); the async cases' checkpoints are the same format
RESUME = {"fsdp2-sync", "hsdp-sync", "fsdp2-full-file", "ddp_hooks-sync"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_full_disk_gives_one_clear_error_on_every_rank(case: str, small_disk: Path, tmp_path: Path) -> None:
    proc = run_torchrun(WORKER, 2, ["--dir", str(small_disk), "--steps", "6", "--every", "2", *CASES[case]],
                        timeout=120, check=False)
    last = small_disk / "last.ckpt"
    assert proc.returncode != 0, f"the save on a full disk did not fail:\n{proc.stderr[-3000:]}"
    for rank in (0, 1):
        out = _rank_lines(proc.stderr, rank)
        found = _MESSAGE.findall(out)
        assert len(found) == 1, (
            f"rank {rank}: expected the disk-full error once, got {len(found)}:\n{out[-4000:]}"
        )
        match = _MESSAGE.search(out)
        assert match is not None
        assert (match["path"], match["dir"], match["last_good"], match["tmp"]) == (str(last), str(small_disk),
                                                                                str(last), "last.ckpt.tmp")
        needed, free = int(match["needed"].replace(",", "")), int(match["free"].replace(",", ""))
        assert needed >= path_bytes(last) > free, (needed, free, path_bytes(last))
        # measured after cleanup
        assert abs(free - free_bytes(small_disk)) <= 16 * 4096, (free, free_bytes(small_disk))
        assert out.count("Traceback") <= 1, f"rank {rank} printed more than one traceback:\n{out[-6000:]}"
        assert "CheckpointException" not in out.split("CheckpointDiskFullError:")[0], out[-6000:]
    leftovers = [p.name for p in small_disk.iterdir() if p.name.endswith((".tmp", ".tmp.lock", ".old"))]
    assert not leftovers, f"partial temps left on the full disk: {leftovers}"
    assert verify_checkpoint(last).ok, verify_checkpoint(last).message
    if case not in RESUME:
        return
    resumed = run_torchrun(WORKER, 2,
                           ["--dir", str(tmp_path / "resume"), "--steps", "4", "--resume", str(last),
                                       *CASES[case]], timeout=120)
    assert "RESUMED 0 global_step=4" in resumed.stdout and "RESUMED 1 global_step=4" in resumed.stdout, (
        resumed.stdout
    )


@pytest.mark.multiprocess
def test_ft_hsdp_full_disk_is_one_clear_error_on_the_writing_group(small_disk: Path, tmp_path: Path) -> None:
    """ft_hsdp, 2 replica groups x 1 rank (``fsdp-strategies-ft``, default restarts), ``step<N>.ckpt`` every 2
    steps.

    Only the group ranked 0 in the current quorum writes (FTHSDPStrategy._is_checkpoint_writer): the writer
    saves one good checkpoint, and its next save runs out of space -- it raises the disk-full error and exits.
    The other group, which did not write, is not told: it trains on alone (the lighthouse drops the writer
    within --heartbeat-timeout-ms), is then the quorum's rank 0, so it writes -- on the same full disk -- and
    ends with the same clear error naming its own file. Neither group hangs, nor is restarted into the full
    disk (the error exits with UNFIXABLE_EXIT_CODE): the launcher reports both given up at once, long before
    the run's timeout, and the first checkpoint is the intact last good one. Which group writes first depends
    on which started first (a group alone at the start trains and writes alone; the worker sleeps after a step
    it commits alone so that the other usually joins), so the checks hold for either order.
    """
    from test_ft_hsdp import FT

    events = tmp_path / "events"
    proc = run_python(
        ["-m", "fsdp_strategies.ft", "--groups", "2", "--ranks-per-group", "1", "--heartbeat-timeout-ms",
         "1000",
         "--join-timeout-ms", "500", "--events-dir", str(events), "--timeout", "150", "--min-replicas", "1",
         "--", str(WORKERS / "ft_train.py"), "fit", *FT, "--trainer.devices", "1",
         "--trainer.max_steps", "8", "--trainer.enable_checkpointing", "true"],
        env={"FT_TEST_OUT": str(tmp_path / "out"), "FT_TEST_CKPT": str(small_disk), "FT_TEST_CKPT_EVERY": "2",
             "FT_TEST_SLEEP_ALONE": "1.0"},
        timeout=180, check=False)
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    launcher = [
        json.loads(line) for line in (events / "launcher.jsonl").read_text().splitlines() if line.strip()
    ]
    gave_up = {e["group"]: e for e in launcher if e["event"] == "give_up"}
    assert sorted(gave_up) == [0, 1], launcher  # neither group hung: both exited and were given up on
    # ... at once, under the default --max-restarts: a restart would run into the same full disk
    assert all(e["unfixable"] and e["restarts"] == 0 and e["code"] == 1 for e in gave_up.values()), gave_up
    assert not [e for e in launcher if e["event"] == "start" and e["restart"] > 0], launcher
    assert "gave up after an error a restart cannot fix" in proc.stderr, proc.stderr[-3000:]
    assert all("CheckpointDiskFullError: Checkpoint" in e["last_error"] for e in gave_up.values()), gave_up
    on_disk = sorted(small_disk.iterdir())
    assert len(on_disk) == 1 and on_disk[0].suffix == ".ckpt", on_disk  # no temp, lock or partial second file
    good = on_disk[0]
    failed = {}
    for group in (0, 1):
        log = _rank_lines((events / f"group{group}.log").read_text(), 0)  # the rank's output, not torchrun's
        found = _MESSAGE.findall(log)
        assert len(found) == 1, (
            f"group {group}: expected the disk-full error once, got {len(found)}:\n{log[-4000:]}"
        )
        match = _MESSAGE.search(log)
        assert match is not None
        failed[group] = Path(match["path"])
        assert (match["dir"], match["last_good"], match["tmp"]) == (
            str(small_disk), str(good), failed[group].name + ".tmp"), match.groups()
        assert failed[group].parent == small_disk and failed[group] != good, (failed[group], good)
        needed, free = int(match["needed"].replace(",", "")), int(match["free"].replace(",", ""))
        assert needed >= path_bytes(good) > free, (group, needed, free, path_bytes(good))
        assert log.count("Traceback") <= 1, f"group {group} printed more than one traceback:\n{log[-6000:]}"
    assert failed[0] != failed[1], failed  # each group failed at its own save, not one shared error
    assert verify_checkpoint(good).ok, verify_checkpoint(good).message
