"""Jobs exit 0 after success: no ``terminate called without an active exception`` (SIGABRT) at interpreter
exit.

The CI cut of ``tests/trials/exit_trials.py`` (the full check: ``python tests/trials/exit_trials.py
--runs 50``, and the
control ``--mode collectives --without-fix``): 5 jobs of the pattern that aborts without the fix (4-6 times in
10 here) -- 200 gloo all-reduces, then the end of the script -- with ``import fsdp_strategies``, which
installs the exit handling (see ``fsdp_strategies.runtime.clean_exit``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import python_executable, zygote_vars
from fsdp_strategies.runtime.clean_exit import quiesce_collective_threads
from trials.exit_trials import run_once


@pytest.mark.multiprocess
def test_back_to_back_gloo_jobs_exit_zero(tmp_path: Path) -> None:
    # Without the exit handling each such job aborted with probability 0.4-0.6 here (all 5 passing: ~3-8%).
    results = [run_once("collectives", tmp_path / str(i), python=python_executable(), extra_env=zygote_vars())
               for i in range(5)]
    assert [code for code, _ in results] == [0] * 5, [out[-2000:] for code, out in results if code]


def test_quiesce_returns_at_once_without_collective_threads() -> None:
    assert quiesce_collective_threads(timeout_s=1.0)
