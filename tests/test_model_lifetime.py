"""A sharded model lives as long as the user holds it: deleted, it is freed with its shards and optimizer state.

Oracle: the same model trained the same way without sharding (DDP and FSDP2 free theirs too). Before: each
full parameter's gradient hook held the runtime, which holds the DBuffers holding those parameters, and
the garbage collector cannot break a cycle through a tensor's hook: every model of a sweep stayed alive
(1.09 MB per model here, the Trainer and optimizer state with it under Lightning). Also: forwards with
grad enabled and no backward (inference without ``no_grad``) grew a list per group by one entry each.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import lightning_ragged as lr
from tests.models import lm_loss, make_batches, make_model
from tests.test_fully_shard import _local


def _train_and_drop(shard: bool) -> dict:
    model = make_model()
    if shard:
        lr.fully_shard(model, shard_granularity="row")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for tokens in make_batches(2, 6):
        lm_loss(model, _local(tokens) if shard else tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    refs = {"model": weakref.ref(model), "block": weakref.ref(model.blocks[0]),
            "optimizer": weakref.ref(optimizer)}
    if shard:
        refs["dbuffer"] = weakref.ref(next(iter(lr.get_state(model).dbuffers())))
        refs["state"] = weakref.ref(lr.get_state(model))
    del model, optimizer
    gc.collect()
    return {name: ref() is not None for name, ref in refs.items()}


def check_lifetime() -> dict:
    results = {"plain": _train_and_drop(False), "sharded": _train_and_drop(True)}
    model = lr.fully_shard(make_model(), shard_granularity="row")
    tokens = _local(make_batches(1, 6)[0])
    for _ in range(50):  # grad enabled, no backward, the output dropped
        model(tokens[:, :-1])
    results["backward_nodes"] = max(len(group.backward_nodes) for group in lr.get_state(model).all_groups)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_deleted_sharded_model_is_freed(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_lifetime):
        assert not any(result["plain"].values()), result  # the oracle frees all
        assert not any(result["sharded"].values()), result
        assert result["backward_nodes"] <= 1, result
