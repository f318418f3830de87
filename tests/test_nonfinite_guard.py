"""``NonFiniteGuard``: a NaN on one rank skips that optimizer step on every rank, exactly (issue 39, item 2).

Real processes (2 ranks, torchrun, gloo): rank 1's loss is NaN at step 3 under ``fsdp2``, ``hsdp`` (2 x 1),
``ddp_hooks`` and Lightning's ``ddp``. On every rank, the local parameters (shards), the optimizer state and
the LR schedule after that step are bitwise those before it, the run goes on to its last step and ends with
finite weights. Without the guard the same run ends with NaN weights (checked once, under ``fsdp2``). Two bad
steps in a row with ``max_consecutive=2`` stop the run on every rank with the error naming the step, the rank
whose loss was NaN and the first non-finite gradient.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest

from conftest import WORKERS, run_torchrun
from fsdp_strategies.callbacks import NonFiniteGuard

WORKER = WORKERS / "nonfinite_train.py"


def _records(out: Path) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["fsdp2", "hsdp", "ddp_hooks", "ddp"])
def test_nan_on_one_rank_skips_the_step_on_every_rank_exactly(strategy: str, tmp_path: Path) -> None:
    out = tmp_path / strategy
    run_torchrun(
        WORKER,
        2,
        ["--strategy", strategy, "--nan-steps", "3", "--nan-rank", "1", "--steps", "6", "--out", str(out)],
        timeout=300,
    )
    for rec in _records(out):
        assert rec["global_step"] == 6 and rec["skipped"] == 1 and rec["finite_at_end"], rec
        [check] = rec["checks"]
        assert check["step"] == 3 and check["opt_states"] > 0, rec
        assert check["params_equal"] and check["opt_equal"] and check["lr_schedule_equal"], rec
    if strategy == "fsdp2":  # what the guard prevents: the same run without it
        bare = tmp_path / "bare"
        run_torchrun(
            WORKER,
            2,
            ["--strategy", strategy, "--nan-steps", "3", "--steps", "6", "--no-guard", "--out", str(bare)],
            timeout=300,
        )
        for rec in _records(bare):
            assert not rec["finite_at_end"] and not rec["checks"][0]["params_equal"], rec


@pytest.mark.multiprocess
def test_max_consecutive_stops_with_the_step_rank_and_parameter(tmp_path: Path) -> None:
    proc = run_torchrun(
        WORKER,
        2,
        [
            "--strategy",
            "fsdp2",
            "--nan-steps",
            "2",
            "3",
            "--nan-rank",
            "1",
            "--steps",
            "6",
            "--max-consecutive",
            "2",
            "--out",
            str(tmp_path / "mc"),
        ],
        timeout=300,
        check=False,
    )
    assert proc.returncode != 0
    for rank in (0, 1):
        lines = [
            ln
            for ln in proc.stderr.splitlines()
            if ln.startswith(f"[rank{rank}]:") and "NonFiniteGradientError:" in ln
        ]
        assert len(lines) == 1, proc.stderr[-4000:]
        assert (
            "2 optimizer steps in a row" in lines[0]
            and "at step 3: a non-finite loss on rank(s) [1]" in lines[0]
            and "rank 1: model.embed.weight" in lines[0]
            and "Fix:" in lines[0]
        ), lines[0]
    assert "step 2 skipped on every rank: a non-finite loss on rank(s) [1]" in proc.stderr


def test_bad_options_and_unsupported_setups_are_refused() -> None:
    with pytest.raises(ValueError, match="NonFiniteGuard: max_consecutive"):
        NonFiniteGuard(max_consecutive=0)

    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"manual optimization is not supported.*Fix:"):
        NonFiniteGuard().setup(trainer, Manual(), "fit")
