"""Runs of the tiled optimizers (Shampoo, SOAP) on ragged shards, shared by their test files.

Each rank gets its slice of the same full random gradients a single-process reference steps on,
so the optimizer alone is compared. ``LAYOUTS`` are the shardings tested: ``"block4"`` keeps
every 4-row tile band whole on one rank (0 collectives), the others cut tiles — ``"block6"``
because 6-row blocks are not a multiple of the 4-row tiles. ``before_step`` hooks edit a step
(drop a gradient, add a param group) the way a training loop would; runs that could hang on a
mismatched collective shard over ``timeout_group()``, whose collectives give up after
``COLLECTIVE_TIMEOUT_S`` instead of the pool's task timeout.
"""

from __future__ import annotations

import functools
import math
from contextlib import nullcontext
from datetime import timedelta
from typing import Callable, Optional
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from lightning_ragged import checkpoint as ck
from lightning_ragged import full_state_dict, fully_shard
from lightning_ragged.optim.eigh import EigendecompositionError

COLLECTIVE_TIMEOUT_S = 30
_TIMEOUT_GROUPS: dict[int, dist.ProcessGroup] = {}
BeforeStep = Callable[[int, nn.Module, torch.optim.Optimizer], None]  # (1-based step, model, optimizer)

LAYOUTS = {
    "block4": dict(shard_granularity="block", block_rows=4),
    "block6": dict(shard_granularity="block", block_rows=6),
    "row": dict(shard_granularity="row"),
    "element": dict(shard_granularity="element"),
}


def timeout_group() -> dist.ProcessGroup:
    """All ranks in one gloo group whose collectives time out after ``COLLECTIVE_TIMEOUT_S`` (made once per pool)."""
    world = dist.get_world_size()
    if world not in _TIMEOUT_GROUPS:
        _TIMEOUT_GROUPS[world] = dist.new_group(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return _TIMEOUT_GROUPS[world]


def tile_touches(global_shape, flat_range: tuple[int, int], i: int, j: int, dim: int) -> bool:
    """Whether tile (i, j) of a (shape[0] x rest) matrix view, in dim x dim tiles, has an element in ``flat_range``."""
    rows = int(global_shape[0]) if len(global_shape) else 1
    index = torch.arange(torch.Size(global_shape).numel()).view(rows, -1)
    block = index[i * dim : (i + 1) * dim, j * dim : (j + 1) * dim]
    start, end = flat_range
    return bool(((block >= start) & (block < end)).any())


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
           count: bool = False, before_step: Optional[BeforeStep] = None) -> list[int]:
    """Step on each gradient; with ``count``, the collectives each ``optimizer.step()`` issued.

    Counted by torch's ``CommDebugMode`` (every c10d op, not only the all-to-alls expected); it
    dispatches every op through Python, so runs that check numerics only skip it.
    """
    counts = []
    for t, step_grads in enumerate(grads, start=1):
        _set_grads(model, step_grads)
        if before_step is not None:
            before_step(t, model, optimizer)
        if count:
            with CommDebugMode() as comm:
                optimizer.step()
            counts.append(comm.get_total_counts())
        else:
            optimizer.step()
    return counts


def train_sharded(make_model: Callable[[], nn.Module], make_optimizer: Callable, layout: str, steps: int,
                  count: bool = True, before_step: Optional[BeforeStep] = None,
                  process_group: Optional[dist.ProcessGroup] = None) -> dict:
    """The full parameters after ``steps`` sharded steps, collectives per step (``count``), and the tile plan."""
    model = fully_shard(make_model(), process_group=process_group, **LAYOUTS[layout])
    optimizer = make_optimizer(model.named_parameters())
    counts = _steps(model, optimizer, gradients(make_model(), steps), count, before_step)
    return dict(
        params=full_state_dict(model),
        ranges={name: p.ragged_shard.rank_ranges for name, p in model.named_parameters()},
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


def _max_diff(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((got[n] - expected[n]).abs().max().item() for n in expected)


# ------------------------------------------------------------------ a rank without a gradient
Drops = dict[int, tuple[int, str]]  # step: (the rank that sets the gradient to None, parameter)


def _drop_gradients(drops: Drops, t: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    rank, name = drops.get(t, (None, None))
    if rank == dist.get_rank():
        dict(model.named_parameters())[name].grad = None


def missing_gradients_against_reference(make_model: Callable[[], nn.Module], make_optimizer: Callable,
                                        reference: Callable, layout: str, steps: int, dim: int, drops: Drops) -> dict:
    """At the steps of ``drops`` one rank sets a split parameter's ``grad`` to None; sharded vs ``reference``.

    The rule the reference is told (optim/tiled.py): a tile with a piece on the rank without the
    gradient is untouched that step (state, step count and elements), every other tile steps.
    Returns max |diff| to that reference and to the run without drops (the drops must matter),
    the collectives per step, and per drop how many tiles of the parameter were split and
    untouched, whole and untouched, and stepped.
    """
    full_params = dict(make_model().named_parameters())
    grads = gradients(make_model(), steps)
    run = train_sharded(make_model, make_optimizer, layout, steps, before_step=functools.partial(_drop_gradients, drops),
                        process_group=timeout_group())
    world = dist.get_world_size()

    def holders(name: str, i: int, j: int) -> list[bool]:
        return [tile_touches(full_params[name].shape, run["ranges"][name][r], i, j, dim) for r in range(world)]

    def untouched(t: int, name: str, i: int, j: int) -> bool:
        rank, dropped = drops.get(t, (None, None))
        return name == dropped and holders(name, i, j)[rank]

    kinds = {}
    for t, (rank, name) in drops.items():
        rows, cols = full_params[name].shape[0], full_params[name][0].numel()
        tiles = [holders(name, i, j) for i in range(math.ceil(rows / dim)) for j in range(math.ceil(cols / dim))]
        kinds[t] = dict(split_untouched=sum(on[rank] and sum(on) > 1 for on in tiles),
                        whole_untouched=sum(on[rank] and sum(on) == 1 for on in tiles),
                        stepped=sum(not on[rank] for on in tiles))
    return dict(diff=_max_diff(run["params"], reference(full_params, grads, untouched=untouched)),
                undisturbed_diff=_max_diff(run["params"], reference(full_params, grads)),
                counts=run["counts"], kinds=kinds)


# ------------------------------------------------------------------ add_param_group (Lightning's finetuning)
ADD_AT = 4  # layers 2 and 4 join the optimizer before this step


def _unfreeze_later_layers(t: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    from lightning.pytorch.callbacks import BaseFinetuning

    if t == 1:
        BaseFinetuning.freeze([model[2], model[4]])
    if t == ADD_AT:  # one call: Lightning's filter_on_optimizer compares values, and empty shards are all equal
        BaseFinetuning.unfreeze_and_add_param_group([model[2], model[4]], optimizer)


def added_group_against_reference(make_model: Callable[[], nn.Module], make_first_layer_optimizer: Callable,
                                  reference: Callable, layout: str, steps: int, lr: float) -> dict:
    """Layer 0 trains from step 1; ``BaseFinetuning.unfreeze_and_add_param_group`` adds layers 2 and 4 at ``ADD_AT``.

    Lightning gives the new group ``lr / 10``; the reference steps those parameters from ``ADD_AT``
    on with it. Returns max |diff|, how far the added layers moved, collectives per step, the
    names of the added group (the same on every rank) and the split tiles after the add.
    """
    full_params = dict(make_model().named_parameters())
    grads = gradients(make_model(), steps)
    model = fully_shard(make_model(), process_group=timeout_group(), **LAYOUTS[layout])
    optimizer = make_first_layer_optimizer(model.named_parameters())
    counts = _steps(model, optimizer, grads, True, _unfreeze_later_layers)
    added = [optimizer.param_name(p) for p in optimizer.param_groups[1]["params"]]
    expected = reference(full_params, grads, untouched=lambda t, name, i, j: name in added and t < ADD_AT,
                         lrs={name: lr / 10 for name in added})
    full = full_state_dict(model)
    return dict(diff=_max_diff(full, expected), counts=counts, added=added, split=optimizer.tile_plan.split,
                moved=max((full[n] - full_params[n]).abs().max().item() for n in added))


# ------------------------------------------------------------------ a failing eigendecomposition
_REAL_EIGH = torch.linalg.eigh


def _eigh_always_fails(matrix: torch.Tensor, *args, **kwargs):
    raise torch.linalg.LinAlgError("injected: eigh did not converge")


def _eigh_fails_in_fp32(matrix: torch.Tensor, *args, **kwargs):
    if matrix.dtype == torch.float32:
        raise torch.linalg.LinAlgError("injected: eigh did not converge in float32")
    return _REAL_EIGH(matrix, *args, **kwargs)


FAILING_EIGH = {"always": _eigh_always_fails, "fp32": _eigh_fails_in_fp32}


def eigh_failure(make_model: Callable[[], nn.Module], make_optimizer: Callable, layout: str, steps: int,
                 fail_at: int, failing: str) -> dict:
    """Rank 1's ``torch.linalg.eigh`` is ``FAILING_EIGH[failing]`` during step ``fail_at`` only.

    Returns per step ``("ok", collectives)`` or ``("raised", message)`` (an ``EigendecompositionError``;
    training goes on after it, so a step whose collectives did not pair would show in the next
    ones) and the full parameters at the end.
    """
    model = fully_shard(make_model(), process_group=timeout_group(), **LAYOUTS[layout])
    optimizer = make_optimizer(model.named_parameters())
    outcomes = []
    for t, step_grads in enumerate(gradients(make_model(), steps), start=1):
        _set_grads(model, step_grads)
        inject = t == fail_at and dist.get_rank() == 1
        try:
            with mock.patch("torch.linalg.eigh", FAILING_EIGH[failing]) if inject else nullcontext():
                with CommDebugMode() as comm:
                    optimizer.step()
            outcomes.append(("ok", comm.get_total_counts()))
        except EigendecompositionError as error:
            outcomes.append(("raised", str(error)))
    failed = sorted({(name, tile.tile_id) for name, p in model.named_parameters() for tile in optimizer.tiles(p)
                     if tile.root == 1})  # the tiles whose eigendecompositions ran on rank 1
    return dict(outcomes=outcomes, params=full_state_dict(model), failed=failed)
