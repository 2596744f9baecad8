"""Run a function on W gloo ranks in fresh processes and get every rank's result back (one process tree)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, init_file: str, fn: Callable[..., Any], args: tuple, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    result = fn(rank, world, *args)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))
    dist.destroy_process_group()
    os._exit(0)  # the result is written; skip interpreter teardown, where gloo's threads can abort (pytorch#190489)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on every rank (one thread each); the JSON-able results, rank by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "pg"), fn, args, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())
