"""Checkpoints on object storage, against a real S3 server (SeaweedFS,
``tests/support/s3_server.py``; no mocked S3).

The chain (``tests/workers/object_store_train.py``, real torchrun jobs, the example Llama):

1. ``fsdp2`` on 2 ranks trains 8 steps with ``ModelCheckpoint(dirpath="s3://...", every_n_train_steps=2,
   save_top_k=2, save_last=True)``: the bucket holds step 6, step 8 and ``last``, each one committed version
   (steps 2 and 4 were removed, manifest first), nothing in a local folder named ``s3:``.
1b. The same run with ``async_checkpoint="thread"``: the same objects, each committed, the same losses.
2. A resume from the step-6 checkpoint of 1b is preempted (SIGTERM to every rank) after step 7: its
   preemption checkpoint is committed in the bucket, and a resume from that trains step 8 with the
   uninterrupted run's loss, bit for bit.
3. A resume from ``last`` whose rank 1 is SIGKILLed inside its asynchronous (``thread``) save of ``last`` at
   step 10 (shards written, nothing committed): ``last``'s manifest still names the step-8 version, the dead
   save's objects sit beside it.
4. ``hsdp`` 2x2 on 4 ranks with ``async_checkpoint="process"`` resumes from that ``last`` (the previous one:
   loadable) and its first save commits a new version in the background and removes the orphan.
5. ``fsdp-strategies-verify`` says OK for ``last``; ``fsdp-strategies-export`` reads it straight from the
   bucket (the same tensors as a local read of a copy of its objects); a truncated shard object of step 8 is
   named by verify and refused by the loader before anything is read into a model, and by the export; a URL
   without a manifest is refused as uncommitted. In one process: an unknown scheme, a closed endpoint and
   wrong credentials are clear errors naming the URL; a removal the store does not answer is a warning.

Apart (a server of its own): the S3 server SIGKILLed inside a save -- every rank stops with the same
"was not saved" error (rank 0's clean-up of the partial version must not raise botocore's own error instead);
started again on the same data, the previous checkpoints verify and the interrupted one is not committed.
And ``fsdp-strategies-export`` from the bucket to the bucket: the Hugging Face fine-tune example's sharded
checkpoint as a ``torch`` file and a Hugging Face folder (``config.json`` last, never into a prefix that holds
objects).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from conftest import ROOT, WORKERS, run_python, run_torchrun
from fsdp_strategies.checkpoint.export import read_sharded_state_dict
from fsdp_strategies.checkpoint.integrity import MANIFEST_FILE, CheckpointIntegrityError
from fsdp_strategies.checkpoint.load_into_fsdp import load_remote_into_sharded_model
from fsdp_strategies.checkpoint.location import CheckpointLocationError
from fsdp_strategies.checkpoint.object_store import (
    CheckpointNotCommittedError,
    check_writable,
    open_remote,
    remove_remote,
)
from fsdp_strategies.checkpoint.verify import verify_main
from fsdp_strategies.hf.export import main as export_main
from support.s3_server import KEY, S3Server

BUCKET = "fsdp-tests"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    fsspec.filesystem("s3").clear_instance_cache()
    return s3.env()


def _fs() -> Any:
    return fsspec.filesystem("s3", skip_instance_cache=True)


def _versions(fs: Any, path: str) -> list[str]:
    """The version folders under a checkpoint that hold objects."""
    fs.invalidate_cache()
    return sorted({p[len(path) + 1 :].split("/", 1)[0] for p in fs.find(path)} - {MANIFEST_FILE})


def _committed(fs: Any, path: str) -> str:
    fs.invalidate_cache()
    return json.loads(fs.cat_file(f"{path}/{MANIFEST_FILE}"))["data"]


def _job(
    out: Path, phase: str, args: list[str], env: dict[str, str], nproc: int = 2, check: bool = True
) -> Any:
    return run_torchrun(
        WORKERS / "object_store_train.py",
        nproc,
        ["--phase", phase, "--out", str(out), *args],
        env=env,
        timeout=400,
        check=check,
    )


def _losses(out: Path, phase: str) -> dict[str, float]:
    return json.loads((out / f"{phase}.json").read_text())["losses"]


@pytest.mark.multiprocess
def test_fsdp2_and_hsdp_save_to_s3_resume_exactly_and_survive_a_kill_mid_save(
    s3_env: dict[str, str], tmp_path: Path
) -> None:
    fs = _fs()
    run = f"{BUCKET}/chain-{os.getpid()}"
    url = f"s3://{run}"
    out = tmp_path / "out"
    env = dict(s3_env)

    # 1. 8 steps, a checkpoint every 2, the 2 newest kept, and last
    _job(out, "first", ["--dirpath", url, "--steps", "8"], env)
    fs.invalidate_cache()  # SeaweedFS lists a prefix whose objects are gone as an empty folder: count objects
    names = sorted({p[len(run) + 1 :].split("/", 1)[0] for p in fs.find(run)})
    assert names == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"], names
    for name in names:
        assert len(_versions(fs, f"{run}/{name}")) == 1 and _committed(fs, f"{run}/{name}") in _versions(
            fs, f"{run}/{name}"
        )
    assert not list(Path.cwd().glob("s3*")) and not list(tmp_path.glob("s3*")), "a URL became a local folder"

    # 1b. the same run with async_checkpoint: thread -- the same objects, each committed, the same losses
    background = f"{run}-async"
    _job(out, "async", ["--dirpath", f"s3://{background}", "--steps", "8", "--async-checkpoint", "thread"],
         env)
    fs.invalidate_cache()
    names = sorted({p[len(background) + 1 :].split("/", 1)[0] for p in fs.find(background)})
    assert names == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"], names
    for name in names:
        assert _versions(fs, f"{background}/{name}") == [_committed(fs, f"{background}/{name}")]
    assert _losses(out, "async") == _losses(out, "first")

    # 2. resumed from the background-written step 6 and preempted (SIGTERM to every rank) after step 7:
    # the preemption checkpoint is committed in the bucket; resumed from it, step 8 is the uninterrupted
    # run's, bit for bit
    proc = _job(
        out,
        "preempted",
        ["--dirpath", f"{url}-b", "--steps", "8", "--resume", f"s3://{background}/epoch=0-step=6.ckpt",
         "--sigterm-at", "7"],
        env,
        check=False,
    )
    preempt = f"{url}-b/last-preempt.ckpt"
    assert proc.returncode != 0 and f"preemption checkpoint of step 7 written to {preempt}" in proc.stderr, \
        proc.stderr[-3000:]
    assert _versions(fs, f"{run}-b/last-preempt.ckpt") == [_committed(fs, f"{run}-b/last-preempt.ckpt")]
    _job(out, "resumed", ["--dirpath", f"{url}-c", "--steps", "8", "--resume", preempt], env)
    first, resumed = _losses(out, "first"), _losses(out, "resumed")
    assert list(resumed) == ["8"] and resumed["8"] == first["8"], (first, resumed)

    # 3. a resume from last whose rank 1 is killed inside its second save of step 10 (the first is
    # epoch=0-step=10.ckpt, the second last.ckpt), written by the background thread (async_checkpoint:
    # thread): last's new version is written, not committed
    last = f"{run}/last.ckpt"
    before = _committed(fs, last)
    proc = _job(
        out,
        "killed",
        ["--dirpath", url, "--steps", "12", "--resume", f"{url}/last.ckpt", "--kill-in-save", "2",
         "--async-checkpoint", "thread"],
        env,
        check=False,
    )
    assert proc.returncode != 0
    assert _versions(fs, f"{run}/epoch=0-step=10.ckpt") == [_committed(fs, f"{run}/epoch=0-step=10.ckpt")]
    assert _committed(fs, last) == before
    orphans = [v for v in _versions(fs, last) if v != before]
    assert orphans, (
        "the killed save wrote nothing: the test did not kill it inside the save\n"
        + (proc.stdout + proc.stderr)[-4000:]
    )

    # 4. hsdp 2x2 resumes from that last (the previous one); its first commit, written by DCP's checkpoint
    # process in the background, removes the orphan
    _job(
        out,
        "hsdp",
        ["--strategy", "hsdp", "--dirpath", url, "--steps", "10", "--resume", f"{url}/last.ckpt",
         "--async-checkpoint", "process"],
        env,
        nproc=4,
    )
    assert json.loads((out / "hsdp.json").read_text())["global_step"] == 10
    now = _committed(fs, last)
    assert now != before and _versions(fs, last) == [now]

    # 5. verify; export straight from the bucket reads the very tensors a local read of the same objects gives
    assert verify_main([f"{url}/last.ckpt"]) == 0
    exported = tmp_path / "last.pt"
    assert export_main([f"{url}/last.ckpt", str(exported)]) == 0
    local = tmp_path / "last-copy"
    fs.get(f"{last}/{_committed(fs, last)}", str(local), recursive=True)
    state, copy = torch.load(exported, weights_only=True), read_sharded_state_dict(local)
    assert state.keys() == copy.keys() and len(state) > 0
    assert all(torch.equal(state[k], copy[k]) for k in state)
    # a truncated shard object is named and refused before any model is touched, or anything exported
    step8 = f"{run}/epoch=0-step=8.ckpt"
    shard = f"{step8}/{_committed(fs, step8)}/__0_0.distcp"
    fs.pipe_file(shard, fs.cat_file(shard)[:-100])
    assert verify_main([f"{url}/epoch=0-step=8.ckpt"]) == 1
    assert export_main([f"{url}/epoch=0-step=8.ckpt", str(tmp_path / "step8.pt")]) == 1
    assert not (tmp_path / "step8.pt").exists()
    with pytest.raises(CheckpointIntegrityError, match=r"__0_0\.distcp: size"):
        load_remote_into_sharded_model(None, [], open_remote(f"{url}/epoch=0-step=8.ckpt", "ckpt_path"))  # type: ignore[arg-type]
    with pytest.raises(CheckpointNotCommittedError, match="no committed checkpoint"):
        load_remote_into_sharded_model(None, [], open_remote(f"{url}/epoch=0-step=2.ckpt", "ckpt_path"))  # type: ignore[arg-type]


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy,mode", [("ddp_hooks", "thread"), ("fsdp2_full", "off")])
def test_full_file_checkpoints_are_one_object_each_and_resume_exactly(
    s3_env: dict[str, str], tmp_path: Path, strategy: str, mode: str
) -> None:
    # ddp_hooks (and fsdp2 with save_distributed_checkpoint=False) write one file per checkpoint: on object
    # storage one object, uploaded in one put by rank 0 (here ddp_hooks' from the background thread)
    fs = _fs()
    run = f"{BUCKET}/full-{strategy}-{os.getpid()}"
    out = tmp_path / "out"
    _job(out, "first", ["--strategy", strategy, "--dirpath", f"s3://{run}", "--steps", "8",
                        "--async-checkpoint", mode], dict(s3_env))
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(run)) == [
        "epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]  # top 2 + last, each one object
    assert verify_main([f"s3://{run}/last.ckpt"]) == 0
    _job(out, "resumed", ["--strategy", strategy, "--dirpath", f"s3://{run}-b", "--steps", "8",
                          "--resume", f"s3://{run}/epoch=0-step=6.ckpt"], dict(s3_env))
    first, resumed = _losses(out, "first"), _losses(out, "resumed")
    assert list(resumed) == ["7", "8"] and all(resumed[s] == first[s] for s in resumed), (first, resumed)
    exported = tmp_path / "last.pt"
    assert export_main([f"s3://{run}/last.ckpt", str(exported)]) == 0 and exported.is_file()
    step8 = f"{run}/epoch=0-step=8.ckpt"
    fs.pipe_file(step8, fs.cat_file(step8)[:-100])  # a damaged object: refused
    assert verify_main([f"s3://{step8}"]) == 1


@pytest.mark.multiprocess
def test_a_server_lost_mid_save_fails_every_rank_and_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a server of its own: it is killed, then started again on the same port and data
    server = S3Server(tmp_path / "server").start()
    try:
        env = {**server.env(), "FSDP_TESTS_S3_PID": str(server.job.pid)}
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        run = f"{BUCKET}/lost"
        # saves: step 2 (epoch=0-step=2.ckpt, then last), step 4 -- the server dies inside its first save
        proc = _job(tmp_path / "out", "lost", ["--dirpath", f"s3://{run}", "--steps", "6",
                                                "--stop-server-in-save", "3"], env, check=False)
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, output[-3000:]
        assert server.job.poll() is not None, "the server was not stopped inside the save"
        assert output.count(f"Checkpoint s3://{run}/epoch=0-step=4.ckpt was not saved") >= 2, output[-4000:]
        server.stop()
        server.start()  # the same port and data folder
        fsspec.filesystem("s3").clear_instance_cache()  # (made for another server, or before the kill)
        fs = _fs()
        fs.invalidate_cache()
        assert verify_main([f"s3://{run}/last.ckpt"]) == 0  # step 2's last: committed, every object intact
        assert json.loads(fs.cat_file(f"{run}/last.ckpt/{MANIFEST_FILE}"))["data"] in _versions(
            fs, f"{run}/last.ckpt")
        with pytest.raises(CheckpointNotCommittedError, match="no committed checkpoint"):
            step4 = open_remote(f"s3://{run}/epoch=0-step=4.ckpt", "ckpt_path")
            load_remote_into_sharded_model(None, [], step4)  # type: ignore[arg-type]
    finally:
        server.stop()


@pytest.mark.subprocess
def test_bad_urls_and_credentials_are_clear_errors_and_removal_is_best_effort(
    s3_env: dict[str, str],
) -> None:
    with pytest.raises(
        CheckpointLocationError, match=r"ckpt_path='nosuchfs://b/x'.*does not know the scheme"
    ):
        open_remote("nosuchfs://b/x", "ckpt_path")
    fast = {"retries": 1, "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    with pytest.raises(CheckpointLocationError, match=r"dirpath=\.\.\.\)='s3://b/run': cannot write there"):
        check_writable(
            "s3://b/run", "ModelCheckpoint(dirpath=...)", {**fast, "endpoint_url": "http://127.0.0.1:9"}
        )
    with pytest.raises(CheckpointLocationError, match=r"cannot write there.*credentials"):
        check_writable(
            f"s3://{BUCKET}/run", "ModelCheckpoint(dirpath=...)", {**fast, "key": KEY, "secret": "wrong"}
        )
    check_writable(f"s3://{BUCKET}/run", "ModelCheckpoint(dirpath=...)")  # the server's own credentials: fine
    # save_top_k's removal runs on rank 0 alone: an unreachable store is a warning (the checkpoint stays)
    closed = open_remote("s3://b/run/last.ckpt", "the checkpoint to remove",
                         {**fast, "endpoint_url": "http://127.0.0.1:9"})
    with pytest.warns(UserWarning, match=r"Could not remove checkpoint s3://b/run/last\.ckpt .*stays"):
        remove_remote(closed)


@pytest.mark.multiprocess
def test_export_writes_both_formats_to_s3_and_never_into_a_used_prefix(s3_env: dict[str, str],
                                                                       tmp_path: Path) -> None:
    # the fine-tune example (a tiny HF Llama, fsdp2 on 2 ranks, 2 steps) checkpoints into the bucket;
    # then `fsdp-strategies-export s3://.../CKPT s3://... --format hf` (and --format torch): the folder
    # reloads with from_pretrained once copied down (transformers reads no URLs itself), with the torch
    # export's weights
    transformers = pytest.importorskip("transformers")
    from finetune_hf import make_tiny

    fs, run = _fs(), f"{BUCKET}/export-{os.getpid()}"
    folder = make_tiny(str(tmp_path / "tiny"), "llama")
    run_python([str(ROOT / "examples" / "finetune_hf.py"), "fit", "--config", "configs/finetune_hf.yaml",
                "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                "--trainer.max_steps", "2", "--data.num_train", "32", "--trainer.default_root_dir",
                f"s3://{run}", "--model.pretrained", folder], env=dict(s3_env))
    fs.invalidate_cache()
    ckpt = next(p for p in fs.find(run) if p.endswith(MANIFEST_FILE)).rsplit("/", 1)[0]

    assert export_main([f"s3://{ckpt}", f"s3://{run}/export/plain.pt", "--strip-prefix", "model."]) == 0
    with fs.open(f"{run}/export/plain.pt", "rb") as fh:
        plain = torch.load(fh, weights_only=True)
    assert export_main([f"s3://{ckpt}", f"s3://{run}/export/hf", "--format", "hf"]) == 0
    fs.invalidate_cache()
    assert {p.rsplit("/", 1)[-1] for p in fs.find(f"{run}/export/hf")} >= {"config.json", "model.safetensors"}
    fs.get(f"{run}/export/hf", str(tmp_path / "down"), recursive=True)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "down").state_dict()
    assert reloaded.keys() == plain.keys() and all(torch.equal(reloaded[k], plain[k]) for k in plain)
    trained = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert any(not torch.equal(trained[k], plain[k]) for k in plain)  # the fine-tuned weights, not the file's
    # a prefix that holds objects is refused before anything is read or written; nothing there changes
    before = {p: fs.info(p)["ETag"] for p in fs.find(f"{run}/export/hf")}
    assert export_main([f"s3://{ckpt}", f"s3://{run}/export/hf", "--format", "hf"]) == 1
    fs.invalidate_cache()
    assert {p: fs.info(p)["ETag"] for p in fs.find(f"{run}/export/hf")} == before


def test_a_folder_upload_puts_the_named_files_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # export_hf uploads config.json last: from_pretrained reads it first, so a copy cut short has none
    from fsdp_strategies.checkpoint.object_store import upload_folder

    for name in ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "generation_config.json"):
        (tmp_path / name).write_text(name)
    memory = fsspec.filesystem("memory")
    order: list[str] = []
    real_put = memory.put_file
    monkeypatch.setattr(memory, "put_file", lambda src, dst, **kw: (order.append(Path(src).name),
                                                                   real_put(src, dst, **kw)))
    upload_folder(tmp_path, f"memory://export-{os.getpid()}", "output", last=("config.json",))
    assert order[-1] == "config.json" and len(order) == 5, order
    with pytest.raises(CheckpointLocationError, match=r"output='memory://export-\d+' already holds objects"):
        upload_folder(tmp_path, f"memory://export-{os.getpid()}", "output")
