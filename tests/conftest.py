"""Shared fixtures: one gloo worker pool per world size for the whole session."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest

from tests.distributed import DistributedPool


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[Callable[[int], DistributedPool]]:
    """``dist_pool(n)`` returns a live pool of n ranks, started on first use and reused."""
    pools: dict[int, DistributedPool] = {}

    def get(world_size: int) -> DistributedPool:
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            pools[world_size] = pool = DistributedPool(world_size)
        return pool

    yield get
    for pool in pools.values():
        pool.stop()
    for pool in pools.values():
        pool.close()
