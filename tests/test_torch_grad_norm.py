"""torch's own gradient clipping on a ragged model, as FSDP2 training loops write it.

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (and torchtitan's
``get_total_norm`` + ``clip_grads_with_norm_``) must clip by the global norm over every rank's
shards, as it does on FSDP2's DTensors. Oracle: single-process training on the whole batch
with the same torch calls. Before the routing each rank clipped by its own part's norm.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.utils import clip_grad_norm_  # bound by name before any model is sharded, as scripts do

import lightning_ragged as lr
from tests.models import lm_loss, make_batches, make_model

MAX_NORM = 0.05  # below every step's norm here: each step is clipped
STEPS = 3


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    for block in model.blocks:
        lr.fully_shard(block)
    return lr.fully_shard(model)


def _train_with_torch_clipping(norm_type: float) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, sharded = make_model(0), _shard(make_model(0))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, sharded)]
    norm_diff, smallest_norm = 0.0, float("inf")
    for tokens in make_batches(STEPS, 2 * world):
        lm_loss(reference, tokens).backward()
        lm_loss(sharded, tokens[2 * rank : 2 * rank + 2]).backward()
        expected = clip_grad_norm_(reference.parameters(), MAX_NORM, norm_type)
        total = clip_grad_norm_(sharded.parameters(), MAX_NORM, norm_type)
        norm_diff = max(norm_diff, abs(total.item() - expected.item()) / expected.item())
        smallest_norm = min(smallest_norm, expected.item())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    full = lr.full_state_dict(sharded)
    param_diff = max((full[name] - value).abs().max().item() for name, value in reference.state_dict().items())
    return {"norm_diff": norm_diff, "param_diff": param_diff, "smallest_norm": smallest_norm}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_torch_clip_grad_norm_is_global(dist_pool, world_size: int, norm_type: float) -> None:
    for result in dist_pool(world_size).run(_train_with_torch_clipping, norm_type):
        assert result["smallest_norm"] > MAX_NORM, result  # every step clipped, so the coefficient mattered
        # fp32 sums in another order across ranks: relative 1e-5 on the norm, 1e-5 on weights after 3 steps
        assert result["norm_diff"] <= 1e-5 and result["param_diff"] <= 1e-5, result


def _torchtitan_pattern() -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, sharded, plain = make_model(0), _shard(make_model(0)), make_model(1)
    tokens = make_batches(1, 2 * world)[0]
    for model, batch in ((reference, tokens), (sharded, tokens[2 * rank : 2 * rank + 2]), (plain, tokens)):
        lm_loss(model, batch).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    with CommDebugMode() as sharded_comms:
        grads = [p.grad for p in sharded.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        torch.nn.utils.clip_grads_with_norm_(sharded.parameters(), MAX_NORM, total, foreach=True)
    with CommDebugMode() as plain_comms:  # a model nobody sharded: torch's own function, no collective
        plain_total = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])
    plain_oracle = torch.cat([p.grad.reshape(-1) for p in plain.parameters()]).norm()
    reference_grads = dict(reference.named_parameters())
    grad_diff = 0.0
    for name, param in sharded.named_parameters():
        start, end = param.ragged_shard.local_range
        local = reference_grads[name].grad.reshape(-1)[start:end]
        grad_diff = max(grad_diff, (param.grad - local).abs().max().item() if end > start else 0.0)
    return {
        "norm_diff": abs(total.item() - expected.item()) / expected.item(),
        "grad_diff": grad_diff,
        "sharded_collectives": sharded_comms.get_total_counts(),
        "plain_collectives": plain_comms.get_total_counts(),
        "plain_diff": abs(plain_total.item() - plain_oracle.item()) / plain_oracle.item(),
    }


def test_torchtitan_get_total_norm_is_global(dist_pool) -> None:
    for result in dist_pool(2).run(_torchtitan_pattern):
        assert result["norm_diff"] <= 1e-5 and result["grad_diff"] <= 1e-6, result
        assert result["sharded_collectives"] == 1, result  # one all-reduce: every DBuffer shards over the world
        assert result["plain_collectives"] == 0 and result["plain_diff"] <= 1e-6, result


def _nonfinite_on_one_rank() -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = _shard(make_model(0))
    lm_loss(sharded, make_batches(1, 2 * world)[0][2 * rank : 2 * rank + 2]).backward()
    if rank == 0:
        next(p for p in sharded.parameters() if p.numel()).grad[0] = float("inf")
    try:
        torch.nn.utils.clip_grad_norm_(sharded.parameters(), MAX_NORM, error_if_nonfinite=True)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_nonfinite_norm_raises_on_every_rank(dist_pool) -> None:
    # the inf sits in rank 0's part only: the global norm is inf everywhere, so every rank refuses
    for message in dist_pool(2).run(_nonfinite_on_one_rank):
        assert "non-finite" in message, message
