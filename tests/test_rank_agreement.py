"""``fully_shard`` refuses ranks that hold different models or arguments, naming the first difference.

The reference is DDP, which refuses such models in its constructor ("appears not to match sizes of the same
param in process 0"; not called here: only the ranks that differ raise there, the others wait). Before: ``Embedding(10, 8)`` on rank 0 and
``Embedding(11, 8)`` on rank 1 (a vocabulary size read from a rank-local file) trained two different models
silently (each rank's full weights differed); a parameter more on one rank, or another ``dbuffer_size``,
aborted the processes inside gloo ("Received data size doesn't match") with no Python error.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_ragged as lr
from tests.models import lm_loss, make_batches, make_model
from tests.test_fully_shard import _local


def _model(vocab: int, extra: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, 8), nn.Linear(8, 8))
    if extra:
        model[1].register_parameter("scale", nn.Parameter(torch.ones(8)))
    return model


def _refusal(call) -> str | None:
    try:
        call()
    except (ValueError, RuntimeError) as error:
        return str(error)
    return None


def check_different_models_refused() -> dict:
    rank = dist.get_rank()
    last = rank == dist.get_world_size() - 1
    return {
        "vocab": _refusal(lambda: lr.fully_shard(_model(10 + last))),
        "extra": _refusal(lambda: lr.fully_shard(_model(10, extra=last))),
        "frozen": _refusal(lambda: lr.fully_shard(_model(10)[0].requires_grad_(not last))),
        "dbuffer_size": _refusal(lambda: lr.fully_shard(_model(10), dbuffer_size=2**20 * (1 + last))),
        "granularity": _refusal(lambda: lr.fully_shard(_model(10), shard_granularity="element" if last else "row")),
    }


def check_the_same_model_trains() -> float:
    """FSDP2's call pattern: the blocks' uneven shards differ by rank, their global shapes do not."""
    model, reference = make_model(), make_model()
    for block in model.blocks:
        lr.fully_shard(block, shard_granularity="element")
    lr.fully_shard(model, shard_granularity="element")
    for net, tokens in ((model, _local(make_batches(1, 6)[0])), (reference, make_batches(1, 6)[0])):
        lm_loss(net, tokens).backward()
        torch.optim.SGD(net.parameters(), lr=0.1).step()
    full = lr.full_state_dict(model)
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_with_different_models_are_refused_by_name(dist_pool, world_size):
    last = world_size - 1
    for result in dist_pool(world_size).run(check_different_models_refused):
        assert f"parameter '0.weight' is (10, 8) torch.float32 requires_grad=True on rank 0 and (11, 8)" \
               f" torch.float32 requires_grad=True on rank {last}" in result["vocab"], result
        assert "parameter '1.scale' is absent on rank 0" in result["extra"], result
        assert "requires_grad=True on rank 0 and " in result["frozen"], result
        assert "argument dbuffer_size is 1048576 on rank 0 and 2097152" in result["dbuffer_size"], result
        assert "argument shard_granularity is 'row' on rank 0 and 'element'" in result["granularity"], result


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_same_model_in_fsdp2_call_pattern_is_not_refused(dist_pool, world_size):
    assert max(dist_pool(world_size).run(check_the_same_model_trains)) <= 1e-6
