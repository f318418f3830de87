"""Where the checkout's parts are, and the one ``PYTHONPATH`` every job a test starts gets.

Why one place: the tests' jobs (``tests/workers/*.py``, the matrix, the trial scripts) import the package
from this checkout's ``src`` (not an installed copy), the example model from ``examples/`` (``llama``) and
the test helpers from ``tests/`` (``support``, ``matrix``, ``workers``). pytest puts ``examples`` and
``tests`` on its own ``sys.path`` (``pythonpath`` in pyproject.toml); a job gets the same folders through
:func:`job_pythonpath` instead of each script inserting them itself.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["EXAMPLES", "ROOT", "SRC", "TESTS", "WORKERS", "job_pythonpath"]

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
EXAMPLES = ROOT / "examples"
TESTS = ROOT / "tests"
WORKERS = TESTS / "workers"


def job_pythonpath(inherited: str | None = None) -> str:
    """``PYTHONPATH`` for a job: ``src``, ``examples``, ``tests``, then ``inherited`` (e.g. ``make
    test-lightning-range``'s Lightning folder, which must stay behind this checkout's package)."""
    return os.pathsep.join([str(SRC), str(EXAMPLES), str(TESTS), *filter(None, [inherited])])
