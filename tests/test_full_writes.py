"""In-place writes to full parameters between their gather and their reshard reach the shards (``full_writes.py``).

The oracle is the same model trained in one process, where such writes simply stay in the parameter (as under
DDP). The model writes in its own forward as a momentum encoder's EMA does under ``torch.no_grad()`` (MoCo
updates its key encoder inside ``forward``; in Lightning's ``training_step`` the root's parameters are full views
too). Before ``full_writes.py`` the root's writes were lost when its full buffer was freed: 0.57 from the oracle
after 3 steps here.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_ragged as lr
from lightning_ragged.engine.api import MixedPrecisionPolicy

VOCAB, WIDTH, BATCH, STEPS = 16, 8, 4, 3


class MomentumModel(nn.Module):
    """A query and a key head on a shared trunk; each forward moves the key head toward the query head (MoCo)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(2))
        self.query = nn.Linear(WIDTH, VOCAB)
        self.key = nn.Linear(WIDTH, VOCAB)
        self.key.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for k, q in zip(self.key.parameters(), self.query.parameters()):
                k.mul_(0.5).add_(q, alpha=0.5)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.query(x) + self.key(x)


def _batches(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randint(VOCAB, (BATCH * world, 2), generator=generator) for _ in range(STEPS)]
    return [(b[:, 0], b[:, 1]) for b in batches] if rank < 0 else \
        [(b[rank * BATCH:(rank + 1) * BATCH, 0], b[rank * BATCH:(rank + 1) * BATCH, 1]) for b in batches]


def _train(model: nn.Module, batches: list) -> nn.Module:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for tokens, targets in batches:
        nn.functional.cross_entropy(model(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def check_writes_reach_the_shards(world: int) -> float:
    torch.manual_seed(0)
    model = MomentumModel()
    oracle = _train(copy.deepcopy(model), _batches(-1, world))
    sharded = _train(lr.fully_shard(model), _batches(dist.get_rank(), world))
    full = lr.full_state_dict(sharded)
    return max((full[name] - value).abs().max().item() for name, value in oracle.state_dict().items())


@pytest.mark.parametrize("world", [2, 3])
def test_writes_in_forward_train_as_in_one_process(dist_pool, world):
    assert max(dist_pool(world).run(check_writes_reach_the_shards, world)) <= 1e-6


def check_narrower_compute_dtype() -> dict:
    """bf16 full parameters: the written elements reach the fp32 shards, the others keep their fp32 bits."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    lr.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    model.unshard()
    with torch.no_grad():
        model[1].weight[0].fill_(2.0)  # one row written in the compute dtype
    model.reshard()
    after = lr.full_state_dict(model)
    untouched = {name: (after[name] - value).abs().max().item() for name, value in before.items()}
    untouched["1.weight"] = (after["1.weight"][1:] - before["1.weight"][1:]).abs().max().item()
    return {"untouched": max(untouched.values()), "written": after["1.weight"][0].tolist()}


def test_a_narrower_compute_dtype_writes_only_what_changed(dist_pool):
    for result in dist_pool(2).run(check_narrower_compute_dtype):
        assert result["untouched"] == 0.0 and result["written"] == [2.0] * WIDTH, result
