"""Checkpoints and events files written by an older version still verify, resume and read.

The fixtures in ``tests/fixtures/legacy_checkpoints`` were written by 627942a (before the private modules
moved into sub-packages) with ``make_fixtures.py`` there; ``expected.json`` holds what that code measured when
it resumed them. This module uses public names only (``fsdp_strategies.verify_checkpoint``, the strategy
registry names, ``fsdp_strategies.ft.protocol.EventLog``), so it keeps testing the same thing whatever the
modules behind them are called. The resumes are real 2-rank gloo jobs (Lightning's launcher) of
``train_tiny.py``, the script that wrote the fixtures, running against this checkout's ``src``.
"""

from __future__ import annotations

import json
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp_strategies
from conftest import run_python
from fsdp_strategies.ft.protocol import EventLog

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "legacy_checkpoints"
TRAIN = FIXTURES / "train_tiny.py"
EXPECTED: dict[str, Any] = json.loads((FIXTURES / "expected.json").read_text())
CHECKPOINTS = ["fsdp2", "ddp_hooks_powersgd"]


def _fixture(name: str) -> Path:
    return FIXTURES / EXPECTED[name]["path"]


def _copy(name: str, tmp_path: Path) -> Path:
    src, dst = _fixture(name), tmp_path / EXPECTED[name]["path"]
    (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    return dst


def _damage(path: Path) -> str:
    """Invert 64 bytes inside tensor data, size unchanged (what a reader without checksums loads silently).
    Returns the name of the damaged file."""
    if path.is_dir():
        target, start = path / "__0_0.distcp", None
    else:  # a torch zip file: inside the largest stored tensor record (torch does not check the zip's CRCs)
        with zipfile.ZipFile(path) as archive:
            info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        assert info.compress_type == zipfile.ZIP_STORED and info.file_size >= 128
        target = path
        header = path.read_bytes()[info.header_offset:info.header_offset + 30]
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        start = info.header_offset + 30 + name_len + extra_len + (info.file_size - 64) // 2
    data = bytearray(target.read_bytes())
    at = len(data) // 2 if start is None else start
    data[at:at + 64] = bytes(b ^ 0xFF for b in data[at:at + 64])
    target.write_bytes(bytes(data))
    return target.name


def _resume(name: str, ckpt: Path, out: Path, check: bool = True) -> Any:
    return run_python([str(TRAIN), "--strategy", EXPECTED[name]["strategy"], "--devices",
                       str(EXPECTED[name]["devices"]),
                       "--max-steps", str(EXPECTED[name]["max_steps"]), "--resume", str(ckpt), "--out",
                       str(out)],
                      timeout=300, check=check)


def test_fixtures_stay_small() -> None:
    assert sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file()) < 512 * 1024


# ------------------------------------------------------------------------------------------- verification
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_old_checkpoint_verifies(name: str) -> None:
    result = fsdp_strategies.verify_checkpoint(_fixture(name))
    assert result.ok, result.message
    assert result.status == EXPECTED[name]["old_verify"]["status"] == "ok"


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_damaged_copy_of_old_checkpoint_is_refused(name: str, tmp_path: Path) -> None:
    copy = _copy(name, tmp_path)
    assert fsdp_strategies.verify_checkpoint(copy).ok  # the copy itself is intact
    damaged = _damage(copy)
    result = fsdp_strategies.verify_checkpoint(copy)
    assert not result.ok and result.status == "corrupt", result.message
    if copy.is_dir():  # the folder's manifest names the damaged shard
        assert damaged in result.message, result.message


# ----------------------------------------------------------------------------------------------- resuming
def _check_restored(got: dict[str, Any], expected: dict[str, Any]) -> None:
    """Right after the resume: the exact bytes the old code restored (digests), the loop position, the LR."""
    assert (got["global_step"], got["epoch"]) == (expected["global_step"], expected["epoch"]) == (3, 0)
    assert got["lr"] == pytest.approx(expected["lr"], rel=1e-12)
    for key in ("params", "opt_state"):
        assert got[key].keys() == expected[key].keys(), key
        wrong = sorted(k for k in expected[key] if got[key][k] != expected[key][k])
        assert not wrong, f"{key} restored differently from the old code: {wrong}"
    assert got.get("powersgd") == expected.get("powersgd")  # ddp_hooks: every rank's own PowerSGD state


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_old_checkpoint_resumes_to_the_numbers_the_old_code_reached(name: str, tmp_path: Path) -> None:
    expected = EXPECTED[name]
    out = tmp_path / "resumed.json"
    _resume(name, _copy(name, tmp_path), out)
    got = json.loads(out.read_text())
    _check_restored(got["start"], expected["restored"])
    # mid-epoch resume: steps 4..10 train the batches the uninterrupted run trained (epoch 0 from batch 3,
    # then epoch 1 in its own shuffled order), at the same LR, to the same per-rank losses
    position = ("step", "epoch", "batch_idx", "batch_sums")
    assert [tuple(s[k] for k in position) for s in got["steps"]] == [tuple(s[k] for k in position)
                                                                     for s in expected["steps"]]
    assert (
        got["steps"][0]["step"] == expected["saved_at_step"] + 1
        and got["global_step"] == expected["max_steps"]
    )
    for mine, old in zip(got["steps"], expected["steps"]):
        assert mine["lr"] == pytest.approx(old["lr"], rel=1e-12), mine["step"]
        assert mine["losses"] == pytest.approx(old["losses"], rel=1e-5, abs=1e-6), mine["step"]
    assert got["final_params"].keys() == expected["final_params"].keys()
    for key, value in expected["final_params"].items():
        torch.testing.assert_close(torch.tensor(got["final_params"][key]), torch.tensor(value), rtol=1e-5,
                                   atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_resuming_a_damaged_old_checkpoint_stops_before_training(name: str, tmp_path: Path) -> None:
    copy = _copy(name, tmp_path)
    _damage(copy)
    out = tmp_path / "resumed.json"
    proc = _resume(name, copy, out, check=False)
    assert proc.returncode != 0
    # refused, naming the file
    assert "corrupt" in proc.stderr and copy.name in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()  # no step ran


# ---------------------------------------------------------------------------------------------- ft events
def test_old_ft_events_files_read_as_they_did() -> None:
    expected = EXPECTED["ft_events"]
    folder = FIXTURES / expected["path"]
    for name, old in expected["groups"].items():
        log = EventLog(folder / name)
        records = list(log.records())
        assert len(records) == old["records"]
        assert len([r for r in records if "step" in r and "committed" in r]) == old["step_records"]
        assert log.last_committed_step() == old["last_committed_step"]
        since, step = old["last_committed_step_since"]
        assert log.last_committed_step(since) == step
        assert log.finished() is old["finished"] is True
        assert all(r["group"] == int(name[len("group"):-len(".jsonl")]) for r in records)
    assert EventLog.data_summary(folder) == expected["data_summary"]


def test_old_ft_events_file_cut_short_by_a_kill(tmp_path: Path) -> None:
    # the old file with its last line torn (as a SIGKILL mid-write leaves it): that record is skipped
    name = "group0.jsonl"
    lines = (FIXTURES / EXPECTED["ft_events"]["path"] / name).read_bytes().splitlines(keepends=True)
    torn = tmp_path / name
    torn.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    log = EventLog(torn)
    assert len(list(log.records())) == EXPECTED["ft_events"]["groups"][name]["records"] - 1
    assert not log.finished()  # the torn line was the end-of-training record
