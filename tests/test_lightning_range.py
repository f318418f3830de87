"""The supported Lightning range (``lightning>=2.6,<2.7`` in pyproject.toml), as ``make test-lightning-range``
runs it.

That target installs the oldest supported release and the newest within the pin, each into its own
folder first on ``PYTHONPATH``, and runs the fast tests against each; ``tests/conftest.py`` stops the
run if another Lightning is imported. This file adds what only that run does: one process that fits
(and for ``fsdp2`` resumes) every strategy through the example's LightningCLI on one CPU device, so each
Lightning version meets the strategies' hooks and the private names they rely on. In ``make test``
(the venv's Lightning) the same strategies run on 2-4 ranks in the other files; there, only the pin
checks below run, the smoke needs ``FSDP_STRATEGIES_EXPECT_LIGHTNING`` or ``FSDP_STRATEGIES_FULL=1``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import lightning
import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from conftest import ROOT, WORKERS, free_port, run_python
from support.multinode import start_lighthouse

RANGE_RUN = bool(os.environ.get("FSDP_STRATEGIES_EXPECT_LIGHTNING"))
FULL = os.environ.get("FSDP_STRATEGIES_FULL") == "1"


def _pin() -> SpecifierSet:
    (spec,) = re.findall(
        r'^\s*"lightning\s*([<>=!~][^"]*)",?\s*$', (ROOT / "pyproject.toml").read_text(), re.M
    )
    return SpecifierSet(spec)


def test_imported_lightning_is_within_the_pin_and_the_oldest_is_its_lower_bound() -> None:
    pin = _pin()
    assert Version(lightning.__version__) in pin, f"lightning {lightning.__version__} is outside {pin}"
    oldest = re.search(r"^LIGHTNING_OLDEST \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert oldest, "Makefile: LIGHTNING_OLDEST is not set"
    lower = [s.version for s in pin if s.operator == ">="]
    assert lower and Version(oldest.group(1)) == Version(lower[0]), (oldest.group(1), str(pin))
    assert f"`{oldest.group(1)}`" in (ROOT / "README.md").read_text(), (
        "README does not state the oldest supported"
    )


TINY = ["--trainer.logger=false", "--trainer.limit_val_batches=0", "--trainer.val_check_interval=1.0",
        "--trainer.enable_progress_bar=false",
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1", "--model.vocab_size=64",
        "--data.vocab_size=64", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4",
        "--model.max_seq_len=32",
        "--data.seq_len=32", "--data.batch_size=2", "--data.num_train=16", "--data.num_val=8"]


@pytest.mark.subprocess
@pytest.mark.skipif(
    not (RANGE_RUN or FULL),
    reason="make test-lightning-range (or FSDP_STRATEGIES_FULL=1) runs it; "
    "make test fits every strategy on 2-4 ranks in test_configs / test_fsdp_hsdp / test_ft_hsdp",
)
def test_one_fit_per_strategy_and_a_resume_on_this_lightning(tmp_path: Path) -> None:
    fits = [
        ("FSDP2Strategy", ["--config", "configs/fsdp2.yaml", "--trainer.max_steps=2",
                           f"--trainer.default_root_dir={tmp_path / 'fsdp2'}"]),
        ("FSDP2Strategy", ["--config", "configs/fsdp2.yaml", "--trainer.max_steps=4",
                           f"--trainer.default_root_dir={tmp_path / 'fsdp2'}",
                           f"--ckpt_path={tmp_path / 'fsdp2' / 'checkpoints' / 'epoch=0-step=2.ckpt'}"]),
        ("HSDPStrategy",
         ["--config", "configs/hsdp.yaml", "--trainer.strategy.init_args.replicate_degree=auto",
                          "--trainer.strategy.init_args.shard_degree=auto", "--trainer.max_steps=2",
                          "--trainer.enable_checkpointing=false"]),
        ("DDPHooksStrategy", ["--config", "configs/ddp_hooks_powersgd.yaml", "--trainer.max_steps=2",
                              "--trainer.enable_checkpointing=false"]),
        ("FTHSDPStrategy", ["--config", "configs/ft_hsdp.yaml", "--trainer.max_steps=2",
                            "--trainer.enable_checkpointing=false",
                            "--trainer.strategy.init_args.timeout_s=30"]),
    ]
    argv: list[str] = []
    for _, args in fits:
        argv += [*(["::"] if argv else []), "fit", *args, *TINY]
    port = free_port()
    lighthouse = start_lighthouse(
        port=port, min_replicas=1, heartbeat_timeout_ms=1000, log=tmp_path / "lighthouse.log"
    )
    try:
        run_python([str(WORKERS / "multinode_train.py"), *argv], timeout=400,
                   env={"MN_OUT": str(tmp_path / "out"), "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
                        "REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "1"})
    finally:
        lighthouse.kill()
        lighthouse.wait()
    for index, (strategy, _) in enumerate(fits):
        record = json.loads((tmp_path / "out" / f"{index}_rank0.json").read_text())
        assert record["strategy"] == strategy
        steps = [s["global_step"] for s in record["steps"]]
        # index 1 resumed at step 2
        assert steps == ([3, 4] if index == 1 else [1, 2]), (index, strategy, steps)
        assert all(s["loss"] is not None for s in record["steps"])
