"""Parameters and buffers of unusual memory or types: aliases refused by name, the types gloo lacks sent as bytes.

Oracles: one process (views that share no element train as independent weights), rank 0's values (what
DDP's and our broadcasts give every rank), the errors the fixes name. Before: a parameter that is a view of
another (``nn.Parameter(w.data[:, :4])``) or of itself (``expand``) was copied into the DBuffer and trained
apart from its alias silently (0.03 from DDP after 3 AdamW steps; DDP keeps one memory, FSDP2 refuses the
non-contiguous ones); an int16 buffer or frozen int16 parameter stopped ``fully_shard`` with gloo's bare
"Invalid scalar type"; ``param.data = tensor`` after sharding was reported as a move or cast.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_ragged as lr


def _linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))


def _refusal(model: nn.Module) -> str | None:
    try:
        lr.fully_shard(model)
    except ValueError as error:
        return str(error)
    return None


def check_aliases_refused() -> dict:
    results = {}
    view = _linears()
    view[1].weight = nn.Parameter(view[0].weight.data[:4, :6])  # strided: shares 24 of 0.weight's elements
    results["view"] = _refusal(view)
    row = _linears()
    row[1].bias = nn.Parameter(row[0].weight.data[0, :4])  # contiguous: a piece of one row
    results["row"] = _refusal(row)
    expanded = _linears()
    expanded[1].bias = nn.Parameter(torch.randn(1).expand(4))
    results["expanded"] = _refusal(expanded)
    return results


class _Views(nn.Module):
    """Views of one tensor that share no element: column halves (interleaved spans) and slices of a flat buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        whole, flat = torch.randn(6, 8), torch.randn(30)
        self.left, self.right = nn.Parameter(whole[:, :4]), nn.Parameter(whole[:, 4:])
        self.out, self.bias = nn.Parameter(flat[:24].view(4, 6)), nn.Parameter(flat[24:28])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(x @ torch.cat([self.left, self.right], dim=1).T)
        return hidden @ self.out.T + self.bias


def check_disjoint_views_train_apart() -> float:
    """They are independent weights, as in one process."""
    torch.manual_seed(1)
    batch = torch.randn(dist.get_world_size() * 3, 8)
    reference, model = _Views(), lr.fully_shard(_Views(), shard_granularity="element")
    assert model.left.ragged_shard is not None  # sharded (the case), not left whole
    rank = dist.get_rank()
    for net, x in ((reference, batch), (model, batch[rank * 3:(rank + 1) * 3])):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            net(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    full = lr.full_state_dict(model)
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


def check_types_gloo_lacks() -> dict:
    torch.manual_seed(dist.get_rank())  # every rank starts apart: rank 0's values must reach all
    model = _linears()
    model[0].register_buffer("codes", torch.randint(0, 1000, (5,), dtype=torch.int16))
    model[0].register_buffer("wide", torch.randint(0, 1000, (2, 3), dtype=torch.uint16))
    model[1].register_parameter("table", nn.Parameter(torch.randint(0, 99, (6,), dtype=torch.int16),
                                                      requires_grad=False))
    mine = {k: (v.tolist(), v.dtype) for k, v in model.state_dict().items()}  # torch pickles no uint16 tensor
    lr.fully_shard(model)
    model(torch.randn(2, 8))  # broadcast_buffers: rank 0's buffers again before the forward
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    full = lr.full_state_dict(model)
    return {k: (full[k].tolist(), full[k].dtype) == ranks[0][k] for k in mine}


def check_data_assignment_named() -> str | None:
    model = lr.fully_shard(_linears())
    model[1].bias.data = torch.zeros(4)
    try:
        model(torch.randn(2, 8))
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("world_size", [2, 3])
def test_parameters_sharing_memory_are_refused_by_name(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_aliases_refused):
        assert "'0.weight' and '1.weight'" in result["view"] and "share memory" in result["view"], result
        assert "'0.weight' and '1.bias'" in result["row"], result
        assert "'1.bias'" in result["expanded"] and "stride 0" in result["expanded"], result


@pytest.mark.parametrize("world_size", [2, 3])
def test_views_sharing_no_element_train_as_independent_weights(dist_pool, world_size):
    # one process sums the batch at once, the ranks their means: rounding, ~1e-7 per step on weights near 1
    assert max(dist_pool(world_size).run(check_disjoint_views_train_apart)) <= 1e-6


@pytest.mark.parametrize("world_size", [2, 3])
def test_int16_and_uint16_tensors_are_broadcast_as_bytes(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_types_gloo_lacks):
        assert result and all(result.values()), result


def test_a_replaced_shard_is_named_as_such(dist_pool):
    for error in dist_pool(2).run(check_data_assignment_named):
        assert error and "'1.bias'" in error and "param.data = tensor" in error and "moved or cast" not in error, error
