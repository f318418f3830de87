"""A checkpoint URL is never turned into a local folder: every entry point names it in one error (issue 42).

``memory://`` is fsspec's in-memory file system: Lightning's ``ModelCheckpoint`` accepts it like ``s3://``
(fsspec knows it without extra packages), so it reproduces what a user's ``s3://`` bucket did -- the
checkpoints landed in a local folder named ``memory:`` (``s3:``) -- without a server.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT, run_python
from fsdp_strategies.checkpoint.location import CheckpointLocationError, is_url, local_checkpoint_path
from fsdp_strategies.hf.export import main as export_main
from fsdp_strategies.hf.pretrained import PretrainedFolderNotFoundError, check_folder


def test_local_paths_pass_file_urls_become_paths_and_other_urls_raise(tmp_path: Path) -> None:
    assert local_checkpoint_path(tmp_path / "a.ckpt", "x") == tmp_path / "a.ckpt"
    assert local_checkpoint_path("relative/dir", "x") == Path("relative/dir")
    assert local_checkpoint_path(f"file://{tmp_path}/b%20c.ckpt", "x") == tmp_path / "b c.ckpt"
    for url in ("s3://bucket/run/last.ckpt", "gs://b/x", "hdfs://nn/x", "nosuchscheme://x", "memory://run"):
        assert is_url(url)
        with pytest.raises(CheckpointLocationError) as err:
            local_checkpoint_path(url, "ModelCheckpoint(dirpath=...)")
        message = str(err.value)
        assert message.startswith(f"ModelCheckpoint(dirpath=...)={url!r} is an object-storage URL"), message
        assert "would land in a local folder named" in message and "Fix:" in message
    with pytest.raises(CheckpointLocationError, match="a file:// URL with a host"):
        local_checkpoint_path("file://otherhost/x", "x")
    assert not is_url("s3:/collapsed") and not is_url("C:/windows")


_FIT = """
import os, sys
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
import fsdp_strategies
from fsdp_strategies.checkpoint.location import CheckpointLocationError
kwargs = dict(accelerator="cpu", devices=1, strategy=sys.argv[1], max_steps=2, logger=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
try:
    if sys.argv[2] == "dirpath":
        pl.Trainer(callbacks=[ModelCheckpoint(dirpath="memory://run", every_n_train_steps=1)],
                   **kwargs).fit(BoringModel())
    else:  # the file exists (in memory): Lightning hands the URL to the strategy's load_checkpoint
        import fsspec
        fsspec.filesystem("memory").pipe("/run/last.ckpt", b"not read")
        pl.Trainer(**kwargs).fit(BoringModel(), ckpt_path="memory://run/last.ckpt")
except CheckpointLocationError as err:
    print("REFUSED:", err)
except FileNotFoundError as err:  # a URL without a manifest holds no committed checkpoint
    print("NOT COMMITTED:", err)
except Exception as err:  # an object that is not a torch file
    print("CORRUPT:", type(err).__name__, err)
import fsspec
print("MEMORY:", sorted(fsspec.filesystem("memory").find("/run")))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp_hooks"])
def test_a_url_checkpoint_dir_is_refused_before_training_or_written_there(
    tmp_path: Path, strategy: str
) -> None:
    # before the URL check: the fit "succeeded" and wrote ./memory:/run/*.ckpt (fsdp2 and ddp_hooks) -- the
    # URL collapsed into a local relative path. Now fsdp2 writes the URL (commit by manifest) and ddp_hooks
    # one object per checkpoint (tests/test_object_store.py runs both against a real S3 server)
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent(_FIT))
    env = {"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for where in ("dirpath", "ckpt_path"):
        work = tmp_path / where
        work.mkdir()
        out = run_python([str(script), strategy, where], cwd=work, env=env, timeout=120).stdout
        assert not (work / "memory:").exists()  # nothing written to a local folder named after the URL
        if where == "dirpath":  # written into the in-memory file system
            assert "REFUSED" not in out, out[-2000:]
            listing = out.split("MEMORY:", 1)[1]
            if strategy == "fsdp2":  # each checkpoint committed by its manifest
                assert "/run/epoch=0-step=2.ckpt/fsdp_strategies_manifest.json" in listing, listing
            else:  # ddp_hooks: a full file, one object each
                assert "'/run/epoch=0-step=2.ckpt'" in listing, listing
        else:  # an object that is not a checkpoint is refused, named, before anything is applied
            corrupt = "CORRUPT: CheckpointIntegrityError memory://run/last.ckpt is not a readable checkpoint"
            assert corrupt in out, out[-2000:]


def test_export_and_verify_name_the_url(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert export_main([str(tmp_path / "missing.ckpt"), "nosuchfs://bucket/out.pt"]) == 1
    err = capsys.readouterr().err
    assert ("fsdp-strategies-export: error: output='nosuchfs://bucket/out.pt': fsspec does not know the "
            "scheme nosuchfs://" in err)
    from fsdp_strategies.checkpoint.verify import verify_main

    assert verify_main(["nosuchfs://bucket/run/last.ckpt"]) == 1
    out = capsys.readouterr().out
    assert "PATH='nosuchfs://bucket/run/last.ckpt': fsspec does not know the scheme nosuchfs://" in out


def test_a_url_pretrained_folder_is_refused_with_the_fix() -> None:
    with pytest.raises(PretrainedFolderNotFoundError,
                       match=r"pretrained='s3://b/llama' is a URL.*Fix: copy"):
        check_folder("s3://b/llama", "pretrained")
