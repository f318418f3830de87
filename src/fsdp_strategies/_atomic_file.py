"""One file written whole or not at all: written to ``<name>.tmp``, then renamed over ``<name>``.

Why here, in the base layer: a reader must never see half a file -- a checkpoint's manifest
(:mod:`fsdp_strategies.checkpoint.integrity`), an exported ``state_dict`` file
(:mod:`fsdp_strategies.checkpoint.export`), the straggler report (a callback, which may not import
``checkpoint/``) -- and ``os.replace`` within one folder is atomic on POSIX and Windows. A failed write
removes its temp and leaves ``<name>`` as it was. A whole checkpoint (a folder, a lock, the ``.old`` swap) is
:mod:`fsdp_strategies.checkpoint.atomic`'s, which commits through the same rename.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = ["write_atomically", "write_text_atomically"]


def write_atomically(path: Path, write: Callable[[Path], object], suffix: str = ".tmp") -> Path:
    """Call ``write(temp)`` (``temp`` = ``<path><suffix>``), then rename the temp over ``path``.

    Returns ``path``. On any error the temp is removed and the error raised; ``path`` keeps its old content
    (or stays absent)."""
    tmp = path.with_name(path.name + suffix)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp)
        elif tmp.exists() or tmp.is_symlink():
            tmp.unlink()
    return path


def write_text_atomically(path: Path, text: str, suffix: str = ".tmp") -> Path:
    """:func:`write_atomically` for a text file."""
    return write_atomically(path, lambda tmp: tmp.write_text(text), suffix)
