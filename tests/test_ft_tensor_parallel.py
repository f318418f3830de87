"""ft_hsdp and tensor parallelism (issue #26): not implemented inside a replica group, refused up front.

ft_hsdp's data layout (the sampler's shard ``rank + group_size * group``, the redistribution of a failed
group's samples, the samples per DiLoCo round) and its heal treat every rank of a group as a data-parallel
rank; with tensor parallelism the ranks of a TP group share one shard. Until that is adapted, the strategy
refuses ``tensor_parallel_degree > 1`` when it is built -- before any process group, lighthouse or launcher.
"""

from __future__ import annotations

import pytest

from fsdp_strategies import FTHSDPStrategy


def test_tensor_parallel_under_ft_hsdp_is_a_clear_error_before_anything_starts() -> None:
    # no lighthouse, no replica group id, no process group: the TP check comes first
    with pytest.raises(ValueError, match=r"ft_hsdp: tensor_parallel_degree=2 is not supported.*Fix: "
                                         r"tensor_parallel_degree: 1 for ft_hsdp.*fsdp2/hsdp"):
        FTHSDPStrategy(tensor_parallel_degree=2, tp_plan="auto")


def test_ft_hsdp_without_tensor_parallelism_is_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    strategy = FTHSDPStrategy(replica_group_id=0, num_replica_groups=2, tensor_parallel_degree=1)
    assert strategy.tensor_parallel_degree == 1
