"""``torch.func.functional_call`` on a sharded model: forward computes with the tensors given.

Oracle: ``functional_call`` of the same tensors on the unsharded model, with this rank's batch (the
output and the gradients of the given tensors; nothing is reduced, as on a plain module), then the
model's own training, which the call must leave untouched, against one process on the global batch.
Before: the engine's pre-forward put its full parameters back in the slots, so the call returned
``model(x)`` with the model's own weights, silently (0.25 off the expected output at 2 ranks).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import lightning_ragged as lr
from tests.models import lm_loss, make_batches, make_model
from tests.test_fully_shard import _local, _max_diff

BATCH = 6


def _halved(model: nn.Module) -> dict[str, torch.Tensor]:
    """Other weights of the global shapes (plain leaf tensors that require grad): half the model's."""
    return {name: (param.detach() * 0.5).requires_grad_() for name, param in model.named_parameters()}


def check_functional_call() -> dict:
    tokens = make_batches(2, BATCH)
    reference, model = make_model(), lr.fully_shard(make_model(), shard_granularity="row")
    local = _local(tokens[0])
    results = {}
    for name, wrap in (("per-module", {}), ("partial", {"names": ["embed", "head"]})):
        given, expected = _halved(reference), _halved(reference)
        if wrap:  # some slots substituted, the others the model's own
            given = {k: v for k, v in given.items() if k.split(".")[0] in wrap["names"]}
            expected = {k: v for k, v in expected.items() if k.split(".")[0] in wrap["names"]}
        out = functional_call(model, given, (local[:, :-1],))
        oracle = functional_call(reference, expected, (local[:, :-1],))
        out.square().mean().backward()
        oracle.square().mean().backward()
        results[name] = {
            "out": (out - oracle).abs().max().item(),
            "grads": max((given[k].grad - expected[k].grad).abs().max().item() for k in given),
            "own_weights_would_give": (out - reference(local[:, :-1])).abs().max().item(),
        }
    reference.zero_grad()
    model.zero_grad()  # the calls' backwards reduced gradients into the shards for the slots not substituted
    # the model's own training goes on as if no call happened
    for net, batch in ((reference, tokens[1]), (model, _local(tokens[1]))):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        lm_loss(net, batch).backward()
        optimizer.step()
    results["trained"] = _max_diff(lr.full_state_dict(model), reference)
    results["refused"] = {}
    for name, values in (
        ("shards", {k: v * 0.5 for k, v in model.named_parameters()}),
        ("parameter", {"blocks.0.up.weight": nn.Parameter(torch.zeros_like(reference.blocks[0].up.weight))}),
    ):
        try:
            functional_call(lr.fully_shard(make_model(), shard_granularity="row"), values, (local[:, :-1],))
            results["refused"][name] = None
        except ValueError as error:
            results["refused"][name] = str(error)
    # a 1-D parameter whole on one rank has its global shape there: values made from the shards pass there and not
    # elsewhere; every rank refuses (before this agreement, one rank raised and the others waited in a collective)
    small = lr.fully_shard(nn.Sequential(nn.Linear(5, 2)), shard_granularity="row")
    try:
        functional_call(small, {"0.bias": small[0].bias * 0.5}, (torch.randn(3, 5),))
        results["refused"]["whole on one rank"] = None
    except ValueError as error:
        results["refused"]["whole on one rank"] = str(error)
    results["bias_shapes"] = tuple(small[0].bias.shape)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_functional_call_computes_with_the_given_tensors(dist_pool, world_size):
    results = dist_pool(world_size).run(check_functional_call)
    assert (2,) in [result["bias_shapes"] for result in results]  # the case: the bias whole on one rank
    for result in results:
        for case in ("per-module", "partial"):
            assert result[case]["out"] <= 1e-6 and result[case]["grads"] <= 1e-6, result
            assert result[case]["own_weights_would_give"] > 1e-2, result  # the substitution matters
        assert result["trained"] <= 1e-5, result
        shards, parameter = result["refused"]["shards"], result["refused"]["parameter"]
        assert shards and "1-D shards" in shards and "global shape" in shards, shards
        assert parameter and "'blocks.0.up.weight'" in parameter and "nn.Parameter" in parameter, parameter
        assert "'0.bias'" in result["refused"]["whole on one rank"], result
