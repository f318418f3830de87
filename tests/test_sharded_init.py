"""A model built on the meta device and sharded starts from the draws of the unsharded model, on CPU too.

On CPU DTensor has no per-shard random stream: before ``parallel/sharded_init.py`` every rank drew the same
values for its own shard, so the two tensor-parallel halves of a projection were copies (and stayed copies
through training), and a weight sharded over FSDP ranks repeated every 1/N of its rows. Two real ranks
(gloo): tensor-parallel colwise/rowwise, FSDP, a (replicate x shard) mesh, and a Hugging Face Llama built from
a tiny random config through its own ``initialize_weights``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import WORKERS, run_torchrun


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("sharded_init")
    run_torchrun(WORKERS / "sharded_init.py", 2, [str(out)], timeout=240)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["tp_colwise_rowwise", "fsdp", "replicate_x_shard"])
def test_a_seeded_meta_model_starts_where_the_eager_one_does(ranks: list[dict], case: str) -> None:
    for rank in ranks:
        got = rank[case]
        assert got["full"].keys() == got["eager"].keys()
        for name, full in got["full"].items():
            assert torch.equal(full, got["eager"][name]), (case, name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["tp_colwise_rowwise", "fsdp", "hf_llama_fsdp"])
def test_the_shards_of_a_weight_are_not_copies_of_each_other(ranks: list[dict], case: str) -> None:
    sharded = [name for name, t in ranks[0][case]["local"].items()
               if t.dim() == 2 and ranks[0][case]["full"][name].shape != t.shape]
    assert sharded, case
    for name in sharded:
        a, b = ranks[0][case]["local"][name], ranks[1][case]["local"][name]
        assert a.shape == b.shape and not torch.equal(a, b), (case, name)
        # both ranks see one model (the shards were cut from the same full draws)
        assert torch.equal(ranks[0][case]["full"][name], ranks[1][case]["full"][name]), (case, name)


@pytest.mark.multiprocess
def test_hugging_face_init_keeps_its_distribution_on_every_shard(ranks: list[dict]) -> None:
    # LlamaConfig's initializer_range 0.02: the projections are N(0, 0.02) as a whole, the norms ones
    full = ranks[0]["hf_llama_fsdp"]["full"]
    q = full["model.layers.0.self_attn.q_proj.weight"]
    assert abs(float(q.std()) - 0.02) < 0.004
    assert torch.equal(full["model.norm.weight"], torch.ones_like(full["model.norm.weight"]))
