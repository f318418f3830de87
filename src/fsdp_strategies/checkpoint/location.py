"""Where a checkpoint may live: a local or mounted path. A URL is an error naming it, never a local folder.

Why: ``pathlib.Path("s3://bucket/run")`` is the *local* relative path ``s3:/bucket/run``. Lightning's
``ModelCheckpoint`` accepts fsspec URLs for ``dirpath`` and hands the URL to the strategy's
``save_checkpoint``; a strategy that wraps it in ``Path`` writes the "remote" checkpoints into a local folder
literally named ``s3:`` -- they vanish with the node, and a later ``ckpt_path="s3://..."`` resume reads that
local copy. The package's commit path (temp + rename, manifest with digests), its async writer, verify and
export need a POSIX file system, so until object storage is supported every path the package writes or
reads goes through :func:`local_checkpoint_path`: ``file://`` URLs become their local path, any other URL
(``s3://``, ``gs://``, ``hdfs://``, a scheme fsspec does not know) raises :class:`CheckpointLocationError`,
naming the option and the URL, before anything is written. :func:`check_checkpoint_locations` runs the same
check on every ``ModelCheckpoint`` when training starts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = ["CheckpointLocationError", "check_checkpoint_locations", "is_url", "local_checkpoint_path"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


class CheckpointLocationError(ValueError):
    """A checkpoint path is a URL this package cannot write or read (object storage is not supported yet)."""


def is_url(path: object) -> bool:
    """Whether ``path`` (as a string) starts with ``<scheme>://``."""
    return bool(_SCHEME.match(os.fspath(path) if isinstance(path, os.PathLike) else str(path)))


def local_checkpoint_path(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a local :class:`~pathlib.Path` (``file://`` URLs included); any other URL raises.

    ``what`` names the option or the role of the path in the error (e.g. ``"ModelCheckpoint(dirpath=...)"``).
    """
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    match = _SCHEME.match(text)
    if match is None:
        return Path(text)
    if match.group(1).lower() == "file":
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise CheckpointLocationError(
                f"{what}={text!r}: a file:// URL with a host ({parsed.netloc}) is not a local path. Fix: "
                "file:///absolute/path, or the plain path.")
        return Path(unquote(parsed.path))
    raise CheckpointLocationError(
        f"{what}={text!r} is an object-storage URL ({match.group(1)}://), and this package's checkpoints are "
        f"written and read on a local or mounted file system only (its commit is a rename, its manifest and "
        f"verification read files): without this check the checkpoints would land in a local folder named "
        f"{str(Path(text))!r}. Fix: use a local path or the bucket mounted as a file system (e.g. "
        "mountpoint-s3, s3fs-fuse, gcsfuse), and copy the committed checkpoints to object storage from there."
    )


def check_checkpoint_locations(trainer: Any) -> None:
    """Check every ``ModelCheckpoint``'s ``dirpath`` (resolved by Lightning at set-up) before training starts;
    raises :class:`CheckpointLocationError`."""
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        dirpath = getattr(callback, "dirpath", None)
        if dirpath is not None:
            local_checkpoint_path(dirpath, f"{type(callback).__name__}(dirpath=...)")
