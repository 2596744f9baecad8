"""Modules changed before sharding by forward pre-hooks or parametrizations train as in one process.

Pruning (``torch.nn.utils.prune``) and the old ``weight_norm``/``spectral_norm`` recompute ``weight`` in a
forward pre-hook registered before ``fully_shard``: the engine's own pre-hooks are prepended (as FSDP2's), so
the user's runs on the full parameters, not the 1-D shards (before: "size of tensor a (16) must match ... (240)",
and heap corruption for weight_norm, where a Linear was a group of its own). A module with two parametrized
tensors holds two ``ParametrizationList``s: parts of one computation, never groups of their own (before: each was,
and a parametrization returning its parameter's alias had its output freed before the module used it).
The oracle is the same model trained in one process; fp32 SGD, bound 1e-6 (the runs measured 3e-8 to 9e-8).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize, prune

import lightning_ragged as lr

WIDTH, BATCH, STEPS = 16, 4, 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))


def _surgery(model: nn.Sequential, kind: str) -> nn.Sequential:
    for linear in (model[0], model[2], model[4]):
        if kind == "prune":
            prune.l1_unstructured(linear, "weight", amount=0.5)
        elif kind == "weight_norm":
            torch.nn.utils.weight_norm(linear)
        elif kind == "spectral_norm":
            torch.nn.utils.spectral_norm(linear)
        else:  # two parametrized tensors, each returning (an alias of) its parameter
            parametrize.register_parametrization(linear, "weight", nn.Identity())
            parametrize.register_parametrization(linear, "bias", nn.Identity())
    return model


def _train(model: nn.Module, rank: int, world: int) -> nn.Module:
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        x = torch.randn(BATCH * world, WIDTH, generator=generator)
        y = torch.randn(BATCH * world, 4, generator=generator)
        if rank >= 0:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def check_hooked_modules(kind: str, each_linear: bool) -> float:
    world = dist.get_world_size()
    oracle = _train(_surgery(_model(), kind), -1, world)  # built twice: a pruned module cannot be deep-copied
    model = _surgery(_model(), kind)
    if each_linear:  # FSDP2's pattern: each Linear a group of its own, then the model
        for index in (0, 2, 4):
            lr.fully_shard(model[index])
    sharded = _train(lr.fully_shard(model), dist.get_rank(), world)
    full = lr.full_state_dict(sharded)
    return max((full[name] - value).abs().max().item() for name, value in oracle.state_dict().items())


@pytest.mark.parametrize("kind", ["prune", "weight_norm", "spectral_norm", "two_parametrizations"])
@pytest.mark.parametrize("each_linear", [True, False], ids=["each-linear", "one-call"])
def test_hooked_modules_train_as_in_one_process(dist_pool, kind, each_linear):
    assert max(dist_pool(2).run(check_hooked_modules, kind, each_linear)) <= 1e-6


def check_surgery_after_sharding(kind: str) -> str:
    """The same surgery after ``fully_shard``: every rank refuses at the next forward, naming the parameter."""
    model = _model()
    for index in (0, 2, 4):
        lr.fully_shard(model[index])
    lr.fully_shard(model)
    _surgery(model, kind)
    # the model's name of the first layer's weight (each Linear was sharded by a call of its own)
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' .* no longer registered .* before fully_shard"):
        model(torch.randn(BATCH, WIDTH))
    return "refused"


@pytest.mark.parametrize("kind", ["prune", "two_parametrizations"])
def test_surgery_after_sharding_is_refused_by_name(dist_pool, kind):
    assert dist_pool(2).run(check_surgery_after_sharding, kind) == ["refused", "refused"]


def _reads_weight(module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
    """A forward hook whose output depends on the module's whole weight (a weight-dependent term)."""
    return output + 0.01 * module.weight.sum()


def check_forward_hooks_registered_after_sharding(grouping: str) -> float:
    """Hooks registered on sharded modules after ``fully_shard`` run before the group's reshard: they read the full
    weight, as hooks registered before. Before: the 1-D shard (shape (128,) on one rank, (0,) on another), a
    per-rank output, 1.4e-3 from one process after 2 steps, silently (FSDP2 raises on its DTensors)."""
    world = dist.get_world_size()
    oracle = _model()
    for index in (0, 2):
        oracle[index].register_forward_hook(_reads_weight)
    oracle = _train(oracle, -1, world)
    model = _model()
    if grouping == "each-linear":
        for index in (0, 2, 4):
            lr.fully_shard(model[index])
    else:  # FSDP2's list call: one group of two modules, resharded after the last of them
        lr.fully_shard([model[0], model[2]])
    lr.fully_shard(model)
    for index in (0, 2):
        model[index].register_forward_hook(_reads_weight)
    full = lr.full_state_dict(_train(model, dist.get_rank(), world))
    return max((full[name] - value).abs().max().item() for name, value in oracle.state_dict().items())


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("grouping", ["each-linear", "list"])
def test_forward_hooks_registered_after_sharding_read_full_weights(dist_pool, world_size, grouping):
    assert max(dist_pool(world_size).run(check_forward_hooks_registered_after_sharding, grouping)) <= 1e-6


def check_hook_after_sharding_keeps_the_embedding_freed() -> dict:
    """The same hook on an embedding's own group (freed after its forward: its backward reads no weight) keeps it
    freed: the engine's direct-read probe ends its window after the user's hook (the review of the hook order found
    the group marked read outside its forward and held whole from forward to backward every step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(40, WIDTH), nn.Linear(WIDTH, 3))
    lr.fully_shard(model[0])
    lr.fully_shard(model)
    model[0].register_forward_hook(_reads_weight)
    for _ in range(2):
        model(torch.randint(0, 40, (4, 5))).sum().backward()
    group = next(g for g in lr.get_state(model).all_groups if not g.is_root)
    return {"read_outside": group.read_outside_forward, "held": group.held_through_forward}


def test_a_hook_after_sharding_does_not_hold_an_embedding(dist_pool):
    assert dist_pool(2).run(check_hook_after_sharding_keeps_the_embedding_freed) == [
        {"read_outside": False, "held": False}] * 2
