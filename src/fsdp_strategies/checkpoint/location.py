"""Where a checkpoint may live: a local or mounted path, or -- for the strategies that write object storage --
an fsspec URL. A URL is never turned into a local folder.

Why: ``pathlib.Path("s3://bucket/run")`` is the *local* relative path ``s3:/bucket/run``. Lightning's
``ModelCheckpoint`` accepts fsspec URLs for ``dirpath`` and hands the URL to the strategy's
``save_checkpoint``; a strategy that wraps it in ``Path`` writes the "remote" checkpoints into a local folder
literally named ``s3:`` -- they vanish with the node, and a later ``ckpt_path="s3://..."`` resume reads that
local copy. ``fsdp2``, ``hsdp`` and ``ft_hsdp`` write sharded checkpoints to URLs through
:mod:`fsdp_strategies.checkpoint.object_store` (commit by a manifest written last), ``ddp_hooks`` and full
files one object each. Every other path the package writes (export's output, ``pretrained=``) goes
through :func:`local_checkpoint_path`: ``file://`` URLs become their local path, any other URL (``s3://``,
``gs://``, a scheme fsspec does not know) raises :class:`CheckpointLocationError`, naming the option and the
URL, before anything is written. :func:`check_checkpoint_locations` runs the check on every
``ModelCheckpoint`` when training starts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = ["CheckpointLocationError", "check_checkpoint_locations", "is_url", "local_checkpoint_path",
           "url_or_none"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


class CheckpointLocationError(ValueError):
    """A checkpoint path is a URL this package cannot write or read there (or one it cannot reach)."""


def is_url(path: object) -> bool:
    """Whether ``path`` (as a string) starts with ``<scheme>://``."""
    return bool(_SCHEME.match(os.fspath(path) if isinstance(path, os.PathLike) else str(path)))


def url_or_none(path: object) -> str | None:
    """``path`` as a string when it is a URL other than ``file://`` (object storage), else None."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return text if is_url(text) and not text.lower().startswith("file://") else None


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
        f"{what}={text!r} is an object-storage URL ({match.group(1)}://), and this is written and read on a "
        "local "
        "or mounted file system only (object storage: sharded fsdp2 / hsdp checkpoints): without this "
        "check it "
        f"would land in a local folder named {str(Path(text))!r}. Fix: use a local path or the bucket "
        "mounted as a "
        "file system (e.g. mountpoint-s3, s3fs-fuse, gcsfuse), and copy the committed checkpoints out from "
        "there."
    )


def check_checkpoint_locations(trainer: Any, remote: Callable[[str, str], None] | None = None) -> None:
    """Check every ``ModelCheckpoint``'s ``dirpath`` (resolved by Lightning at set-up) before training starts;
    raises :class:`CheckpointLocationError`. ``remote(url, what)``: how a strategy that writes object storage
    checks a URL (other than ``file://``); without it a URL is refused."""
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        dirpath = getattr(callback, "dirpath", None)
        if dirpath is None:
            continue
        what = f"{type(callback).__name__}(dirpath=...)"
        url = url_or_none(os.fspath(dirpath) if isinstance(dirpath, os.PathLike) else dirpath)
        if remote is not None and url is not None:
            remote(url, what)
        else:
            local_checkpoint_path(dirpath, what)
