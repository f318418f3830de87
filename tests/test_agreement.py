"""``checkpoint/agreement``: "did any rank ...?" answered identically on every rank, on a gloo group of its
own created at its first use. Preemption and the async checkpoint writer rely on it inside multi-process
fits; here it runs alone: without a process group, on a one-rank group, and on two real processes."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import run_torchrun
from fsdp_strategies.checkpoint.agreement import AgreementGroup, AgreementMixin, all_gather_object


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A default process group of one rank (gloo, an in-memory store): a process group, but no peer."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_without_a_process_group_every_answer_is_this_ranks_own() -> None:
    assert not dist.is_initialized()
    agreement = AgreementGroup()
    assert agreement.group() is None and agreement.group(single_rank=True) is None
    assert agreement.agree_sum(3, 0, -2) == (3, 0, -2)
    assert agreement.agree_any(True, False) == (True, False)
    assert agreement.all_gather_object({"rank": 0}) == [{"rank": 0}]
    assert all_gather_object("x") == ["x"]


def test_a_one_rank_group_creates_a_gloo_group_only_when_asked_and_again_for_a_new_default_group(
        one_rank_group: None) -> None:
    agreement = AgreementGroup()
    assert agreement.group() is None  # no peer: nothing to agree with, no group created
    assert agreement.agree_any(False, True) == (False, True)
    group = agreement.group(single_rank=True)  # DCP's async_save needs a CPU group even at world size 1
    assert group is not None and dist.get_backend(group) == "gloo"
    assert agreement.group(single_rank=True) is group  # created once per default group
    # a new fit in the same process replaces the default group: the old side group is gone with it
    dist.destroy_process_group()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    assert agreement.group(single_rank=True) is not group


def test_a_strategy_gets_one_agreement_group_with_its_collective_timeout() -> None:
    from datetime import timedelta

    class Strategy(AgreementMixin):
        _timeout = timedelta(seconds=42)

    strategy = Strategy()
    assert strategy.agreement is strategy.agreement  # preemption and the async writer share it
    assert strategy.agreement.timeout == timedelta(seconds=42)
    assert AgreementMixin().agreement.timeout is None  # a strategy without one: gloo's default
    assert Strategy().agreement is not strategy.agreement  # one per strategy instance


AGREE = """
import json, sys
import torch.distributed as dist
from fsdp_strategies.checkpoint.agreement import AgreementGroup

dist.init_process_group("gloo")
rank = dist.get_rank()
agreement = AgreementGroup()
out = {"sum": agreement.agree_sum(rank + 1, 10), "any_rank1": agreement.agree_any(rank == 1, False),
       "gathered": agreement.all_gather_object({"rank": rank}),
       "side_group": agreement.group() is not dist.group.WORLD}
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as fh:
    json.dump(out, fh)
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
def test_two_ranks_agree_on_sums_flags_and_objects(tmp_path: Path) -> None:
    import json

    script = tmp_path / "agree.py"
    script.write_text(textwrap.dedent(AGREE))
    run_torchrun(script, 2, [str(tmp_path)], timeout=180)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:  # identical on every rank
        assert result == {"sum": [3, 20], "any_rank1": [True, False],
                          "gathered": [{"rank": 0}, {"rank": 1}], "side_group": True}
