"""Optimizer groups chosen by ``p.dim()`` after sharding: the silent no-weight-decay trap gets a warning.

nanoGPT's ``configure_optimizers`` (decay where ``p.dim() >= 2``) on FSDP2's DTensors decays the
matrices; on 1-D ragged shards it would decay nothing. Oracle for the fix the warning names
(choosing by ``p.ragged_shard.global_shape``): the same split made on the unsharded model.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import lightning_ragged as lr
from tests.models import lm_loss, make_batches, make_model


def _nanogpt_groups(model: torch.nn.Module, ndim) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if ndim(p) >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if ndim(p) < 2], "weight_decay": 0.0},
    ]


def _first_step_warnings(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    lm_loss(model, make_batches(1, 2 * world)[0][2 * rank : 2 * rank + 2]).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    return [str(w.message) for w in caught if "ragged_shard.global_shape" in str(w.message)]


def _recorded(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "ragged_shard.global_shape" in str(w.message)]


def _groups_by_shape() -> dict:
    reference = make_model(0)
    decayed_reference = {name for name, p in reference.named_parameters() if p.dim() >= 2}
    by_dim = lr.fully_shard(make_model(0))
    dim_warnings = _first_step_warnings(torch.optim.AdamW(_nanogpt_groups(by_dim, lambda p: p.dim())), by_dim)
    by_global = lr.fully_shard(make_model(0))
    groups = _nanogpt_groups(by_global, lambda p: len(p.ragged_shard.global_shape))
    global_warnings = _first_step_warnings(torch.optim.AdamW(groups), by_global)
    decayed = {name for name, p in by_global.named_parameters() if any(p is q for q in groups[0]["params"])}
    # Empty groups that are right: a matrices-only model split correctly (nothing left without decay), and a
    # frozen backbone filtered out of its group (every group keeps AdamW's default decay).
    matrices = lr.fully_shard(torch.nn.Sequential(torch.nn.Linear(5, 4, bias=False), torch.nn.Linear(4, 3, bias=False)))
    matrices(torch.randn(2, 5)).sum().backward()
    right = _nanogpt_groups(matrices, lambda p: len(p.ragged_shard.global_shape))
    legitimate = _recorded(lambda: torch.optim.AdamW(right).step())
    frozen = lr.fully_shard(make_model(0))
    for param in frozen.blocks.parameters():
        param.requires_grad_(False)
    lm_loss(frozen, make_batches(1, 2 * dist.get_world_size())[0][:2]).backward()
    backbone = [p for p in frozen.blocks.parameters() if p.requires_grad]
    rest = [p for name, p in frozen.named_parameters() if not name.startswith("blocks.")]
    legitimate += _recorded(lambda: torch.optim.AdamW([{"params": backbone, "lr": 1e-5}, {"params": rest}]).step())
    plain = torch.nn.Linear(3, 3)
    with warnings.catch_warnings(record=True) as plain_caught:  # no shards: an empty group is the user's business
        warnings.simplefilter("always")
        torch.optim.AdamW([{"params": [], "weight_decay": 0.1}, {"params": plain.parameters(), "weight_decay": 0.0}]).step()
    return {
        "rank": dist.get_rank(),
        "dim_warnings": dim_warnings,
        "global_warnings": global_warnings,
        "decayed_as_reference": decayed == decayed_reference and len(decayed) > 0,
        "plain_warnings": [str(w.message) for w in plain_caught if "ragged_shard" in str(w.message)],
        "legitimate_warnings": legitimate,
    }


def test_dim_chosen_groups_warn_and_global_shape_groups_match_unsharded(dist_pool) -> None:
    for result in dist_pool(2).run(_groups_by_shape):
        expected = 1 if result["rank"] == 0 else 0  # said once, by rank 0
        assert len(result["dim_warnings"]) == expected, result
        if expected:
            assert "parameter group(s) [0] have weight decay but no parameters" in result["dim_warnings"][0], result
        assert result["global_warnings"] == [] and result["plain_warnings"] == [], result
        assert result["legitimate_warnings"] == [], result
        assert result["decayed_as_reference"], result
