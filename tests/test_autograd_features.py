"""Autograd features FSDP2 honours on sharded models, against one process training on the global batch:
``backward(create_graph=True)`` and hooks registered with ``register_post_accumulate_grad_hook`` on the
parameters (torch's "optimizer in backward" recipe: a per-parameter optimizer stepped inside the hook).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import lightning_ragged as lr
from tests.models import lm_loss, make_batches, make_model

WORLD_SIZES = [2, 3]
BATCH = 6  # global batch: divisible by 2 and 3 ranks
STEPS = 3


def _local(batch: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = batch.shape[0] // world
    return batch[rank * per : (rank + 1) * per]


def _params_diff(sharded: torch.nn.Module, reference: torch.nn.Module) -> float:
    full, expected = lr.full_state_dict(sharded), reference.state_dict()
    return max((full[key] - expected[key]).abs().max().item() for key in expected)


def check_create_graph() -> dict:
    """``loss.backward(create_graph=True)`` each step: the reduced gradients (detached, as FSDP2's) train the
    model as the single process's gradients (which carry a graph) do."""
    data = make_batches(STEPS, BATCH)
    reference, sharded = make_model(), lr.fully_shard(make_model())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (reference, sharded)]
    grads_with_graph = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that create_graph=True makes a reference cycle
        for step in range(STEPS):
            lm_loss(reference, data[step]).backward(create_graph=True)
            lm_loss(sharded, _local(data[step])).backward(create_graph=True)
            grads_with_graph += sum(p.grad.requires_grad for p in sharded.parameters() if p.grad is not None)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    return {"diff": _params_diff(sharded, reference), "grads_with_graph": grads_with_graph}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_backward_with_create_graph_matches_single_process(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_create_graph):
        assert result["grads_with_graph"] == 0, result
        assert result["diff"] <= 1e-5, result


def check_optimizer_in_backward() -> dict:
    """One AdamW per parameter, stepped and zeroed in its post-accumulate-grad hook; no optimizer.step()."""
    data = make_batches(STEPS, BATCH)
    reference, sharded = make_model(), lr.fully_shard(make_model())
    calls = {"reference": 0, "sharded": 0}
    for label, model in (("reference", reference), ("sharded", sharded)):
        optimizers = {param: torch.optim.AdamW([param], lr=0.01) for param in model.parameters()}

        def hook(param: torch.Tensor, label: str = label, optimizers: dict = optimizers) -> None:
            calls[label] += 1
            optimizers[param].step()
            optimizers[param].zero_grad()

        for param in model.parameters():
            param.register_post_accumulate_grad_hook(hook)
    for step in range(STEPS):
        lm_loss(reference, data[step]).backward()
        lm_loss(sharded, _local(data[step])).backward()
    left = sum(p.grad is not None for p in sharded.parameters())
    return {"diff": _params_diff(sharded, reference), **calls, "grads_left": left}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_optimizer_in_backward_hooks_match_single_process(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_optimizer_in_backward):
        assert result["sharded"] == result["reference"] > 0, result
        assert result["grads_left"] == 0, result  # every hook zeroed its gradient: none kept alive
        assert result["diff"] <= 1e-5, result
