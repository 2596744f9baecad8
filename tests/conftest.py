"""Shared fixtures: one gloo worker pool per world size for the whole session; the metrics callback's fits."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
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


@pytest.fixture(scope="session")
def metrics_fits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tests/metrics_fits.py`` once (the fits of test_observability and test_tuning, one 2-process start-up):
    the directory holding ``observability.json`` and ``tuning.json``."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("metrics_fits")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(root / "tests" / "metrics_fits.py"), str(out), str(port)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def main_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``tests/lightning_runs.py main`` once: the Trainer checks of test_strategy, test_hf_models (``"hf"``) and
    test_optim_lightning (``"muon"``) in one 2-process start-up."""
    from tests.test_strategy import _run_mode

    return _run_mode("main", tmp_path_factory)
