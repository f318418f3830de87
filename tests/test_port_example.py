"""docs/port.md's worked port trains: the project before the port under fsdp2 with only the import added, the
ported project, and the failure the page warns about (a meta-built module without ``reset_parameters``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT, run_python

BEFORE, AFTER = ROOT / "examples" / "port" / "before.py", ROOT / "examples" / "port" / "after.py"
START_LOSS = 4.85  # ln(128): the untrained model


def _final_loss(out: str) -> float:
    found = re.findall(r"final train_loss (\S+)", out)
    assert found, out[-3000:]
    return float(found[-1])


@pytest.mark.multiprocess
def test_the_port_in_the_docs_trains(tmp_path: Path) -> None:
    # step 1 of the page: the unchanged project, plus `import fsdp_strategies` and strategy="fsdp2"
    step1 = ("import runpy, sys; import fsdp_strategies; sys.argv = [sys.argv[0], '--devices', '2', "
             f"'--strategy', 'fsdp2']; runpy.run_path({str(BEFORE)!r}, run_name='__main__')")
    proc = run_python(["-c", step1], timeout=300)
    out = proc.stdout + proc.stderr
    assert "fsdp2: sharded 4 blocks (blocks: 4 x Block) + root over mesh {'shard': 2}" in out, out[-3000:]
    assert _final_loss(out) < 0.05 * START_LOSS
    # the ported project (built in configure_model on the meta device, Attention with reset_parameters)
    proc = run_python([str(AFTER), "--devices", "2"], timeout=300)
    out = proc.stdout + proc.stderr
    assert "fsdp2: sharded 4 blocks" in out and "Parameter initialization incomplete" not in out, out[-3000:]
    assert _final_loss(out) < 0.05 * START_LOSS
    # without the reset_parameters the page explains: Lightning's warning (the loss then depends on whatever
    # the uninitialised memory held: not asserted)
    broken = tmp_path / "after_without_reset.py"
    source = AFTER.read_text().replace("self.attn = Attention(", "self.attn = nn.MultiheadAttention(")
    broken.write_text(source)
    proc = run_python([str(broken), "--devices", "2", "--max-steps", "3"], timeout=300)
    out = proc.stdout + proc.stderr
    assert "Parameter initialization incomplete" in out and "MultiheadAttention" in out, out[-3000:]
