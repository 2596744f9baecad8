"""Runs of the tiled optimizers (Shampoo, SOAP) on ragged shards, shared by their test files.

Each rank gets its slice of the same full random gradients a single-process reference steps on,
so the optimizer alone is compared. ``LAYOUTS`` are the shardings tested: ``"block4"`` keeps
every 4-row tile band whole on one rank (0 collectives), the others cut tiles — ``"block6"``
because 6-row blocks are not a multiple of the 4-row tiles.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from lightning_ragged import checkpoint as ck
from lightning_ragged import full_state_dict, fully_shard

LAYOUTS = {
    "block4": dict(shard_granularity="block", block_rows=4),
    "block6": dict(shard_granularity="block", block_rows=6),
    "row": dict(shard_granularity="row"),
    "element": dict(shard_granularity="element"),
}


def gradients(model: nn.Module, steps: int, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    """``steps`` dicts of full random gradients, one per parameter of ``model``."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    return [{name: torch.randn(shape, generator=generator) for name, shape in shapes.items()} for _ in range(steps)]


def _set_grads(model: nn.Module, step_grads: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        start, end = param.ragged_shard.local_range
        param.grad = step_grads[name].reshape(-1)[start:end].clone()


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, grads: list[dict[str, torch.Tensor]],
           count: bool = False) -> list[int]:
    """Step on each gradient; with ``count``, the collectives each ``optimizer.step()`` issued.

    Counted by torch's ``CommDebugMode`` (every c10d op, not only the all-to-alls expected); it
    dispatches every op through Python, so runs that check numerics only skip it.
    """
    counts = []
    for step_grads in grads:
        _set_grads(model, step_grads)
        if count:
            with CommDebugMode() as comm:
                optimizer.step()
            counts.append(comm.get_total_counts())
        else:
            optimizer.step()
    return counts


def train_sharded(make_model: Callable[[], nn.Module], make_optimizer: Callable, layout: str, steps: int,
                  count: bool = True) -> dict:
    """The full parameters after ``steps`` sharded steps, collectives per step (``count``), and the tile plan."""
    model = fully_shard(make_model(), **LAYOUTS[layout])
    optimizer = make_optimizer(model.named_parameters())
    counts = _steps(model, optimizer, gradients(make_model(), steps), count)
    return dict(
        params=full_state_dict(model),
        counts=counts,
        split=optimizer.tile_plan.split,
        owned=optimizer.tile_plan.owned,
        tiles=sum(len(s.get("tiles", {})) for s in optimizer.state.values()),
    )


def _local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards and every tensor of its optimizer state (nested tile dicts flattened)."""
    out = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}

    def flatten(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix] = value.detach().clone()
        elif isinstance(value, dict):
            for key, inner in value.items():
                flatten(f"{prefix}.{key}", inner)

    for name, state in optimizer.state_dict()["state"].items():
        flatten(f"opt.{name}", state)
    return out


def resume_matches_uninterrupted(make_model: Callable[[], nn.Module], make_optimizer: Callable, layout: str,
                                 steps: int, root: str) -> dict:
    """Save after ``steps // 2`` steps, load into a fresh model and optimizer, finish: equal to one run?

    Returns per-entry ``torch.equal`` against the uninterrupted run (parameters and every optimizer
    state tensor, split tiles' state on their owners included) and how many tiles were split.
    """
    grads = gradients(make_model(), steps)
    half = steps // 2
    model = fully_shard(make_model(), **LAYOUTS[layout])
    optimizer = make_optimizer(model.named_parameters())
    _steps(model, optimizer, grads)
    uninterrupted = _local_state(model, optimizer)

    first = fully_shard(make_model(), **LAYOUTS[layout])
    first_optimizer = make_optimizer(first.named_parameters())
    _steps(first, first_optimizer, grads[:half])
    ck.save(f"{root}/{layout}", first, [first_optimizer], {"step": half})
    dist.barrier()  # rank 0 publishes the directory last

    resumed = fully_shard(make_model(), **LAYOUTS[layout])
    with torch.no_grad():
        for param in resumed.parameters():
            param.zero_()  # the load must overwrite
    resumed_optimizer = make_optimizer(resumed.named_parameters())
    extra = ck.load(f"{root}/{layout}", resumed, [resumed_optimizer])
    _steps(resumed, resumed_optimizer, grads[extra["step"]:])
    got = _local_state(resumed, resumed_optimizer)
    return dict(
        same_keys=got.keys() == uninterrupted.keys(),
        unequal=sorted(key for key in got if not torch.equal(got[key], uninterrupted.get(key, torch.empty(0)))),
        split=resumed_optimizer.tile_plan.split,
    )
