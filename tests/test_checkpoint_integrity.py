"""Checkpoint integrity, safe loading, cross-strategy resume and the export/verify commands.

One module-scoped set of real 2-rank jobs (Lightning's launcher, gloo) provides the checkpoints:
``ddp`` trains 4 steps uninterrupted (the reference), ``ddp`` trains 2 steps and saves (one full
file, Lightning's own format), ``fsdp2`` resumes that file and trains to step 4, saving a sharded
folder with a manifest. The corruption cases copy that folder and are checked in-process (verify
command, export command); one more 2-rank job resumes a corrupted copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ROOT, WORKERS, _env, run_python
from fsdp_strategies.checkpoint.atomic import atomic_save_full, commit_save, prepare_save
from fsdp_strategies.checkpoint.integrity import MANIFEST_FILE, embed_digest
from fsdp_strategies.checkpoint.load_into_fsdp import (
    model_mismatch,
    optimizer_param_names,
    optimizer_state_by_name,
)
from fsdp_strategies.checkpoint.safe_load import UnsafeCheckpointError, safe_torch_load
from fsdp_strategies.checkpoint.verify import verify_checkpoint, verify_main
from fsdp_strategies.hf.export import main as export_main
from support import processes

WORKER = str(WORKERS / "fsdp_train.py")
COMMON = ["--devices", "2", "--batch", "4", "--num-train", "32", "--steps", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("integrity")
    out: dict[str, Any] = {"root": root}
    run_python([WORKER, *COMMON, "--strategy", "ddp", "--out", str(root / "ref.pt")], timeout=600)
    run_python([WORKER, *COMMON, "--strategy", "ddp", "--stop-at", "2", "--ckpt-dir", str(root / "ddp"),
                "--ckpt-every", "2", "--out", str(root / "ddp.pt")], timeout=600)
    proc = run_python([WORKER, *COMMON, "--strategy", "fsdp2", "--resume", str(root / "ddp" / "last.ckpt"),
                       "--record-start", "1", "--ckpt-dir", str(root / "fsdp2"), "--ckpt-every", "2",
                       "--out", str(root / "fsdp2.pt")], timeout=600)
    out["resume_stderr"] = proc.stderr
    for name in ("ref", "ddp", "fsdp2"):
        out[name] = torch.load(root / f"{name}.pt", weights_only=False)
    out["sharded"] = root / "fsdp2" / "step=4.ckpt"
    out["ddp_file"] = root / "ddp" / "step=2.ckpt"
    return out


# ------------------------------------------------------------------------------------ cross-strategy resume
@pytest.mark.multiprocess
def test_ddp_checkpoint_resumes_under_fsdp2(runs: dict[str, Any]) -> None:
    ddp, fsdp2, ref = runs["ddp"], runs["fsdp2"], runs["ref"]
    # Right after the resume, every parameter and every optimizer moment (looked up by parameter name, so a
    # moment loaded into the wrong parameter fails) equals the ddp run's final state, i.e. its checkpoint.
    # The example's optimizer groups parameters (decay / no decay) in another order than the module does.
    assert fsdp2["start_params"].keys() == ddp["params"].keys()
    for name, value in ddp["params"].items():
        assert torch.equal(fsdp2["start_params"][name], value), name
    assert fsdp2["start_opt_state"].keys() == ddp["opt_state"].keys()
    for name, state in ddp["opt_state"].items():
        for key, value in state.items():
            assert torch.equal(fsdp2["start_opt_state"][name][key], value), (name, key)
    # Training continues as the uninterrupted ddp run did (tolerance: another reduction order is allowed).
    assert fsdp2["global_step"] == ref["global_step"] == 4
    assert fsdp2["losses"] == pytest.approx(ref["losses"][2:], rel=1e-5)
    for name, value in ref["params"].items():
        torch.testing.assert_close(fsdp2["params"][name], value, rtol=1e-5, atol=1e-6)
    # Lightning's ddp file has no digest: loaded with a warning, not refused
    assert "cannot be verified" in runs["resume_stderr"]


def test_optimizer_state_maps_through_the_optimizer_order_even_when_shapes_match() -> None:
    # Two parameters of the same shape, listed by the optimizer in the reverse of the module's order.
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    a, b = module[0].weight, module[1].weight

    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": [b]}, {"params": [a], "weight_decay": 0.0}], lr=0.1)

    saving = optimizer()
    module(torch.randn(3, 4)).sum().backward()
    saving.step()
    saved = saving.state_dict()  # ids 0 -> b, 1 -> a (the optimizer's numbering)
    names = optimizer_param_names(module, [saving])[0]
    assert names == [["1.weight"], ["0.weight"]]
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    converted, problems = optimizer_state_by_name(saved, optimizer(), names, shapes)
    assert problems == []
    assert torch.equal(converted["state"]["0.weight"]["exp_avg"], saving.state[a]["exp_avg"])
    assert torch.equal(converted["state"]["1.weight"]["exp_avg"], saving.state[b]["exp_avg"])
    # a wrong mapping would show
    assert not torch.equal(saving.state[a]["exp_avg"], saving.state[b]["exp_avg"])
    assert [g["params"] for g in converted["param_groups"]] == [["1.weight"], ["0.weight"]]
    assert converted["param_groups"][1]["weight_decay"] == 0.0

    # the names recorded at save time (this package's full-file saves) catch a mapping that shapes cannot
    _, problems = optimizer_state_by_name(
        saved, optimizer(), names, shapes, recorded_names=[["0.weight"], ["1.weight"]]
    )
    assert len(problems) == 2 and "group 0 maps its state to other parameters" in problems[0]
    assert "#0: 0.weight vs 1.weight" in problems[0]
    # ... as do the names of an optimizer built from named parameters
    named = dict(
        saved,
        param_groups=[
            dict(g, param_names=[n]) for g, n in zip(saved["param_groups"], ["0.weight", "1.weight"])
        ],
    )
    _, problems = optimizer_state_by_name(named, optimizer(), names, shapes)
    assert problems and "0.weight vs 1.weight" in problems[0]


def test_optimizer_and_model_mismatches_are_named() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(module.parameters())
    module(torch.randn(2, 4)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    names = optimizer_param_names(module, [opt])[0]
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    two_groups = torch.optim.AdamW([{"params": [module[0].weight, module[0].bias]},
                                    {"params": [module[1].weight, module[1].bias]}])
    _, problems = optimizer_state_by_name(
        saved, two_groups, optimizer_param_names(module, [two_groups])[0], shapes
    )
    assert problems == ["the checkpoint's optimizer has 1 parameter group(s), this one 2"]
    fewer = torch.optim.AdamW([module[0].weight, module[1].weight, module[1].bias])
    _, problems = optimizer_state_by_name(saved, fewer, optimizer_param_names(module, [fewer])[0], shapes)
    assert problems[0] == "group 0 holds 4 parameters in the checkpoint, 3 now"
    wrong = dict(shapes, **{"0.weight": (8, 4)})
    _, problems = optimizer_state_by_name(saved, opt, names, wrong)
    assert "'exp_avg' of 0.weight is [4, 4], the parameter [8, 4]" in problems[0]
    problems = model_mismatch(
        {"a": (4,), "b": (2, 2), "c": (1,)}, {"a": (4,), "b": (4, 2), "d": (3,)}, strict=True
    )
    assert problems == ["missing in the checkpoint: c", "in the checkpoint but not in the model: d",
                        "shape differs: b checkpoint [4, 2] vs model [2, 2]"]
    assert model_mismatch({"a": (4,)}, {"a": (4,), "extra": (1,)}, strict=False) == []


def test_every_loader_reports_a_key_mismatch_alike_and_one_except_catches_them() -> None:
    from fsdp_strategies.checkpoint.key_mismatch import KeyMismatch, StateMismatchError
    from fsdp_strategies.checkpoint.load_into_fsdp import CheckpointMismatchError
    from fsdp_strategies.ft.heal_state import HealStateMismatchError
    from fsdp_strategies.hf.export import HFExportError, HFExportMismatchError
    from fsdp_strategies.hf.pretrained import PretrainedMismatchError

    for error in (CheckpointMismatchError, PretrainedMismatchError, HFExportMismatchError,
                  HealStateMismatchError):
        assert issubclass(error, StateMismatchError) and issubclass(error, ValueError), error
    assert issubclass(HFExportMismatchError, HFExportError)
    assert issubclass(HealStateMismatchError, RuntimeError)
    keys = [f"layers.{i}.weight" for i in range(10)]
    mismatch = KeyMismatch.between(keys, [keys[0], "head.weight"])
    assert not KeyMismatch.between(keys, keys) and mismatch
    assert mismatch.describe("healed state", shown=3) == (
        "missing in the healed state: layers.1.weight, layers.2.weight, layers.3.weight, ... and 6 more; "
        "in the healed state but not in the model: head.weight")


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    from fsdp_strategies._atomic_file import write_atomically, write_text_atomically

    target = tmp_path / "report.json"
    write_text_atomically(target, "old")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        write_atomically(target, half_then_fail)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    write_text_atomically(target, "new")
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


# ------------------------------------------------------------------------------------------- corruptions
def _flip(path: Path, rng: random.Random, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    at = rng.randrange(0, max(1, len(data) - n))
    data[at:at + n] = bytes(x ^ 0xFF for x in data[at:at + n])
    path.write_bytes(bytes(data))


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name("swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


CORRUPTIONS: dict[str, tuple[Callable[[Path, random.Random], None], str]] = {
    "flip_bytes_in_shard": (lambda d, r: _flip(d / "__0_0.distcp", r), "__0_0.distcp: sha256 mismatch"),
    "flip_one_byte_in_other_shard": (lambda d, r: _flip(d / "__1_0.distcp", r, 1),
                                     "__1_0.distcp: sha256 mismatch"),
    "truncate_shard": (lambda d, r: os.truncate(d / "__1_0.distcp",
                                                r.randrange(1, (d / "__1_0.distcp").stat().st_size)),
                       "__1_0.distcp: size"),
    "append_to_shard": (lambda d, r: (d / "__0_0.distcp").open("ab").write(r.randbytes(16)),
                        "__0_0.distcp: size"),
    "delete_shard": (lambda d, r: (d / "__1_0.distcp").unlink(), "__1_0.distcp: missing"),
    "swap_shards": (lambda d, r: _swap(d / "__0_0.distcp", d / "__1_0.distcp"), "__0_0.distcp"),
    "flip_bytes_in_dcp_metadata": (lambda d, r: _flip(d / ".metadata", r, 8), ".metadata: sha256 mismatch"),
    "delete_dcp_metadata": (lambda d, r: (d / ".metadata").unlink(), ".metadata: missing"),
    "flip_bytes_in_lightning_meta": (lambda d, r: _flip(d / "meta.pt", r, 8), "meta.pt: sha256 mismatch"),
    "unknown_file": (lambda d, r: (d / "notes.txt").write_text("hello"), "notes.txt: unknown file"),
    "damaged_manifest": (lambda d, r: os.truncate(d / MANIFEST_FILE, 20), "unreadable manifest"),
}


@pytest.mark.multiprocess
def test_intact_checkpoint_verifies_and_exports(
    runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert verify_main([str(runs["sharded"])]) == 0
    assert capsys.readouterr().out.startswith("OK: ")
    assert export_main([str(runs["sharded"]), str(tmp_path / "model.pt")]) == 0
    assert capsys.readouterr().out.startswith("wrote ")
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    for name, value in runs["fsdp2"]["params"].items():
        assert torch.equal(exported[name], value), name
    # Lightning's own ddp file: no digest -> "no manifest" (rc 2), still exportable (read without running
    # code)
    assert verify_main([str(runs["ddp_file"])]) == 2
    assert capsys.readouterr().out.startswith("NO MANIFEST: ")
    assert export_main([str(runs["ddp_file"]), str(tmp_path / "ddp.pt")]) == 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_every_corruption_is_detected(case: str, runs: dict[str, Any], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    corrupt, expected = CORRUPTIONS[case]
    folder = tmp_path / "step=4.ckpt"
    shutil.copytree(runs["sharded"], folder)
    corrupt(folder, random.Random(case))
    assert verify_main([str(folder)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("CORRUPT: ") and expected in lines[0], lines
    assert str(folder) in lines[0]
    out = tmp_path / "model.pt"
    assert export_main([str(folder), str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and "Traceback" not in err[0], err
    assert not out.exists() and not out.with_name("model.pt.tmp").exists()


@pytest.mark.parametrize("case", ["flip_tensor_bytes", "truncate", "digest_removed_and_data_changed"])
def test_single_file_corruption_is_detected(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weight = torch.arange(4096, dtype=torch.float32)
    path = tmp_path / "full.ckpt"
    atomic_save_full(
        {"state_dict": {"w": weight}, "epoch": 3, "hyper_parameters": {"root": Path("/data")}}, path
    )
    assert verify_checkpoint(path).ok
    data = bytearray(path.read_bytes())
    at = data.find(weight[1000:1004].numpy().tobytes())
    assert at > 0
    if case == "flip_tensor_bytes":  # torch.load itself does not notice (no CRC check on read)
        data[at:at + 64] = bytes(64)
        path.write_bytes(bytes(data))
        safe_torch_load(path)
        expected = "does not match the digest"
    elif case == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
        expected = "not a readable checkpoint"
    else:
        loaded = safe_torch_load(path)
        loaded["state_dict"]["w"][5] = 1.0
        torch.save(loaded, path)  # an edited file keeping the old digest
        expected = "does not match the digest"
    assert verify_main([str(path)]) == 1
    assert expected in capsys.readouterr().out
    assert export_main([str(path), str(tmp_path / "out.pt")]) == 1
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "out.pt.tmp").exists()


@pytest.mark.multiprocess
def test_resuming_a_corrupted_checkpoint_stops_before_training(runs: dict[str, Any], tmp_path: Path) -> None:
    folder = tmp_path / "step=4.ckpt"
    shutil.copytree(runs["sharded"], folder)
    # the case: bytes inside a weight, size unchanged
    _flip(folder / "__0_0.distcp", random.Random(7))
    out, ckpts = tmp_path / "resumed.pt", tmp_path / "new"
    proc = run_python([WORKER, *COMMON[:-1], "6", "--strategy", "fsdp2", "--resume", str(folder),
                       "--ckpt-dir",
                       str(ckpts), "--ckpt-every", "1", "--out", str(out)], timeout=300, check=False)
    assert proc.returncode != 0
    assert f"checkpoint {folder} is corrupted: __0_0.distcp: sha256 mismatch" in proc.stderr
    assert not out.exists()  # no step ran ...
    assert not ckpts.exists() or not any(ckpts.iterdir())  # ... and no checkpoint (NaN or not) was written


# ------------------------------------------------------------------------------------------- safe loading
class _Payload:
    """Unpickling this runs ``touch MARKER``: what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_export_and_verify_refuse_a_file_that_runs_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "payload": _Payload(marker)}, evil)
    torch.load(evil, weights_only=False)  # the control: an unrestricted load runs the payload
    assert marker.exists()
    marker.unlink()

    assert export_main([str(evil), str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refused to load" in err[0] and "system" in err[0], err
    assert verify_main([str(evil)]) == 1
    assert "refused to load" in capsys.readouterr().out
    with pytest.raises(UnsafeCheckpointError, match="add_safe_globals"):
        safe_torch_load(evil)
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "out.pt.tmp").exists()


@pytest.mark.multiprocess
def test_hostile_dcp_metadata_is_never_unpickled(runs: dict[str, Any], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "pwned"
    folder = tmp_path / "evil.ckpt"
    shutil.copytree(runs["sharded"], folder)
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    assert verify_main([str(folder)]) == 1  # the manifest catches the swap before anything is unpickled
    assert ".metadata: size" in capsys.readouterr().out
    # an attacker who also rewrites the manifest gets past the checksum, not past the restricted unpickler
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    data = (folder / ".metadata").read_bytes()
    manifest["files"][".metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert verify_main([str(folder)]) == 1
    assert "refused to load" in capsys.readouterr().out
    assert export_main([str(folder), str(tmp_path / "out.pt")]) == 1
    assert "refused to load" in capsys.readouterr().err
    assert not marker.exists()
    with contextlib.suppress(AttributeError):  # (it then fails on the payload's return value)
        FileSystemReader(str(folder)).read_metadata()  # the control: torch's own reader runs it
    assert marker.exists()


def test_allow_list_round_trips_what_lightning_checkpoints_hold(tmp_path: Path) -> None:
    import argparse
    import datetime

    import jsonargparse
    import numpy as np

    content = {
        "state_dict": {"w": torch.randn(3, 2), "b": torch.zeros(2, dtype=torch.bfloat16)},
        "hyper_parameters": {"data_dir": Path("/data/x"), "ns": argparse.Namespace(a=1, b="c"),
                             "cli": jsonargparse.Namespace(lr=0.1, sub=jsonargparse.Namespace(x=[1, 2])),
                             "every": datetime.timedelta(minutes=5), "when": datetime.date(2026, 1, 2),
                             "score": np.float64(0.5), "count": np.int64(3), "dtype": torch.float32,
                             "array": np.arange(3, dtype=np.float32)},
        "loops": {"step": 7, "nested": [1, (2.5, None), {"k": True}]},
    }
    path = tmp_path / "c.ckpt"
    torch.save(embed_digest(content), path)
    loaded = safe_torch_load(path)
    array = loaded["hyper_parameters"].pop("array")
    assert np.array_equal(array, content["hyper_parameters"].pop("array"))
    assert loaded["hyper_parameters"] == content["hyper_parameters"]
    assert type(loaded["hyper_parameters"]["cli"]) is jsonargparse.Namespace
    assert verify_checkpoint(path).ok  # the digest is the same after the round trip


# ---------------------------------------------------------------------------------- export CLI and temps
def _export_cli(*args: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from fsdp_strategies.hf.export import main; sys.exit(main())"
    return processes.run([sys.executable, "-c", code, *args], timeout=120, env=_env(), cwd=str(ROOT))


def _make_source(kind: str, src: Path) -> str:
    if kind == "folder_not_checkpoint":
        src.mkdir()
        (src / "readme.txt").write_text("not a checkpoint")
    elif kind == "text_file":
        src.write_text("epoch: 3\nthis is not a checkpoint\n")
    elif kind == "empty_file":
        src.write_bytes(b"")
    return {"missing": "no such checkpoint", "folder_not_checkpoint": "not a checkpoint",
            "text_file": "not a readable checkpoint", "empty_file": "not a readable checkpoint"}[kind]


@pytest.mark.parametrize("kind", ["missing", "folder_not_checkpoint", "text_file", "empty_file"])
def test_export_gives_one_line_errors(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out = tmp_path / "src.ckpt", tmp_path / "out.pt"
    expected = _make_source(kind, src)
    assert export_main([str(src), str(out)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("fsdp-strategies-export: error: ") and str(src) in lines[0]
    ), lines
    assert expected in lines[0]
    assert not out.exists() and not out.with_name("out.pt.tmp").exists()


@pytest.mark.subprocess
def test_export_command_process_exits_1_without_traceback(tmp_path: Path) -> None:
    src, out = tmp_path / "notes.ckpt", tmp_path / "out.pt"
    expected = _make_source("text_file", src)
    code = "import sys; from fsdp_strategies.hf.export import main; sys.exit(main())"
    proc = processes.run(
        [sys.executable, "-c", code, str(src), str(out)], timeout=300, env=_env(), cwd=str(ROOT)
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("fsdp-strategies-export: error: ")
            and expected in line], proc.stderr
    assert not out.exists() and not out.with_name("out.pt.tmp").exists()


# A writer as this package's saves are (an flock on `.<name>.tmp.lock` held while `<name>.tmp` is written), in
# a bare interpreter: importing torch + lightning per child would cost seconds on a loaded machine.
_WRITER = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.makedirs(sys.argv[2])
open(os.path.join(sys.argv[2], "__0_0.distcp"), "wb").write(b"x")
print("ready", flush=True)
os._exit(9) if sys.argv[3] == "crash" else time.sleep(120)
"""
_PROBE = """import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("free")
except OSError:
    print("held")
"""


def _writer(directory: Path, name: str, mode: str) -> processes.Job:
    tmp = directory / f"{name}.tmp"
    proc = processes.start([sys.executable, "-c", _WRITER, str(directory / f".{name}.tmp.lock"), str(tmp),
                            mode],
                           stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.subprocess
def test_next_save_of_any_name_removes_stale_temps_but_not_live_ones(tmp_path: Path) -> None:
    # our writer side: while a save is in progress its lock is held, so no other process would remove its temp
    tmp = prepare_save(tmp_path / "mine.ckpt")
    lock = tmp_path / ".mine.ckpt.tmp.lock"
    probe = processes.run([sys.executable, "-c", _PROBE, str(lock)], timeout=60)
    assert probe.stdout.strip() == "held"
    torch.save({}, tmp)
    commit_save(tmp_path / "mine.ckpt")
    assert not lock.exists() and (tmp_path / "mine.ckpt").is_file()

    live = _writer(tmp_path, "step=3.ckpt", "live")  # e.g. another ft_hsdp replica group, saving right now
    try:
        crashed = _writer(tmp_path, "step=2.ckpt", "crash")  # killed mid-save: its lock dies with it
        assert crashed.wait(timeout=60) == 9
        (tmp_path / "user.tmp").write_text("not ours")  # a *.tmp without this package's lock: never touched
        atomic_save_full({"state_dict": {"w": torch.ones(2)}}, tmp_path / "last.ckpt")
        names = sorted(p.name for p in tmp_path.iterdir())
        assert "step=2.ckpt.tmp" not in names and ".step=2.ckpt.tmp.lock" not in names  # the crashed save's
        assert "step=3.ckpt.tmp" in names and ".step=3.ckpt.tmp.lock" in names  # the live writer's
        assert "user.tmp" in names and "last.ckpt" in names
        assert not any(n.startswith(".last.ckpt") for n in names)  # our own lock is gone after the commit
    finally:
        live.kill_tree()
    # once its writer is gone, the next save cleans it
    atomic_save_full({"state_dict": {}}, tmp_path / "other.ckpt")
    assert not (tmp_path / "step=3.ckpt.tmp").exists()
    assert verify_checkpoint(tmp_path / "last.ckpt").ok
