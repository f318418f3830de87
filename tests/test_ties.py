"""``parallel/ties``: tied weights (one parameter under several names) stay one parameter through the
transforms that untie them silently -- ``nn.Module.to_empty`` (meta-device init) and replacing a parameter
with a distributed one (tensor parallelism). One process, no process group: the multi-process runs that use
it (GPT-2's tied head under fsdp2 / TP) only show a wrong loss when this breaks."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from fsdp_strategies.parallel.ties import retie, tied_slots


class TiedLM(nn.Module):
    """An embedding and an LM head sharing one weight (as GPT-2 and tied Llama do), plus an untied layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def test_tied_slots_lists_only_parameters_registered_under_several_names() -> None:
    model = TiedLM()
    groups = tied_slots(model)
    assert groups == [[(model.embed, "weight"), (model.head, "weight")]]
    assert tied_slots(nn.Linear(2, 2)) == []


def test_to_empty_unties_and_retie_shares_one_tensor_again() -> None:
    with torch.device("meta"):
        model = TiedLM()
    groups = tied_slots(model)
    model.to_empty(device="cpu")
    assert model.head.weight is not model.embed.weight  # what retie is for: to_empty gave each slot its own
    retie(groups)
    assert model.head.weight is model.embed.weight
    assert len(list(model.parameters())) == 3  # embed (= head), body.weight, body.bias: one tensor per tie
    with torch.no_grad():
        model.embed.weight.fill_(2.0)
    assert torch.equal(model.head.weight, torch.full((8, 4), 2.0))
    assert model.body.weight is not model.embed.weight  # untied parameters are left alone


def test_retie_prefers_the_distributed_parameter() -> None:
    # a tensor-parallel plan distributes one slot (say the embedding) and leaves the other a plain tensor:
    # the tie must keep the distributed one, whichever slot comes first
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = TiedLM()
        groups = tied_slots(model)
        model.head.weight = nn.Parameter(distribute_tensor(model.head.weight.detach(), mesh, [Replicate()]))
        model.embed.weight = nn.Parameter(model.embed.weight.detach().clone())
        retie(groups)
        assert isinstance(model.embed.weight, DTensor)
        assert model.embed.weight is model.head.weight
    finally:
        dist.destroy_process_group()
