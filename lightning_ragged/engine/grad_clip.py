"""Gradient clipping on ragged shards: the true global norm, computed on the flat buffers.

Each rank holds the reduced gradient of its own segment only, so a local
``torch.nn.utils.clip_grad_norm_`` would clip by a *local* norm. Here every rank takes
``torch.nn.utils.get_total_norm`` of its sharded gradients (one flat buffer per DBuffer,
padding is zero), and the p-th powers (the maxima for the inf-norm) are all-reduced once
per **shard group only** — under HSDP the replicas hold identical shards, so reducing
over them too would count every element ``r`` times; ``torch.nn.utils.clip_grads_with_norm_``
then scales the gradients by the global norm.

Works for plain ``fully_shard`` users as for the Lightning strategy::

    loss.backward()
    clip_grad_norm_(model, max_norm=1.0)
    optimizer.step()
"""

from __future__ import annotations

import math
from typing import Iterable, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_ragged.engine.dbuffer import DBuffer
from lightning_ragged.engine.runtime import get_state

ParamsOrModule = Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]]

TORCH_TOTAL_NORM = torch.nn.utils.get_total_norm
"""torch's own, taken before ``torch_grad_norm`` routes the public name: the local part of each norm."""


def clip_grad_norm_(
    parameters: ParamsOrModule,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale gradients so that their global ``norm_type``-norm is at most ``max_norm``.

    ``parameters`` is a module sharded by ``fully_shard`` (fast path: the norm of each
    DBuffer's flat gradient) or an iterable of parameters (sharded ones carry
    ``param.ragged_shard``; parameters without it are treated as replicated on every
    rank). Returns the total norm (fp32), the same on every rank, like
    ``torch.nn.utils.clip_grad_norm_``. Collective: call it on every rank.
    """
    norm_type = float(norm_type)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    elif not isinstance(parameters, nn.Module):
        parameters = list(parameters)  # read twice: the norm, then the scaling
    params = _with_grads(parameters)
    total = total_norm(_grads_by_group(parameters), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); "
            "pass error_if_nonfinite=False to clip anyway"
        )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def clip_grad_value_(parameters: ParamsOrModule, clip_value: float) -> None:
    """Clamp every gradient element into ``[-clip_value, clip_value]`` (element-wise: no communication)."""
    for grads in _grads_by_group(parameters).values():
        for grad in grads:
            grad.clamp_(min=-clip_value, max=clip_value)


def total_norm(
    groups: dict[object, list[torch.Tensor]], norm_type: float, foreach: bool | None = None
) -> torch.Tensor:
    """The local norm of each group's gradients, as a p-th power (the maximum for the inf-norm),
    all-reduced over each shard group (the replicated part counted once, locally), combined."""
    device = next((g.device for grads in groups.values() for g in grads), torch.device("cpu"))
    infinite = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key, grads in groups.items():
        part = torch.zeros((), dtype=torch.float32, device=device)
        grads = [g for g in grads if g.numel()]  # a rank may hold nothing of a parameter (ragged shards)
        if grads:
            part = TORCH_TOTAL_NORM(grads, norm_type, foreach=foreach).to(device=device, dtype=torch.float32)
            if not infinite:
                part = part.pow(norm_type)
        group = None if key is _WORLD else key
        if key is not REPLICATED and dist.get_world_size(group) > 1:  # a shard group of one rank: nothing to add
            op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
            dist.all_reduce(part, op=op, group=group)
        total = torch.maximum(total, part) if infinite else total + part
    return total if infinite else total.pow(1.0 / norm_type)


REPLICATED = object()  # parameters every rank holds whole: counted once, locally
_WORLD = object()  # sharded over the default process group


def group_key(process_group: dist.ProcessGroup | None) -> object:
    return _WORLD if process_group is None else process_group


def _with_grads(parameters: nn.Module | list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters (the shards of a sharded module) that hold a gradient."""
    if isinstance(parameters, nn.Module):
        parameters = [p for dbuffer in get_state(parameters).dbuffers() for p in dbuffer.sharded_params.values()]
    return [p for p in parameters if p.grad is not None]


def _grads_by_group(parameters: ParamsOrModule) -> dict[object, list[torch.Tensor]]:
    if isinstance(parameters, nn.Module):
        return _module_grads(parameters)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    groups: dict[object, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is None:
            continue
        shard = getattr(param, "ragged_shard", None)
        key = REPLICATED if shard is None else group_key(shard.process_group)
        groups.setdefault(key, []).append(param.grad)
    return groups


def _module_grads(module: nn.Module) -> dict[object, list[torch.Tensor]]:
    """One flat gradient per DBuffer whose parameters' grads all live in it; single grads otherwise."""
    groups: dict[object, list[torch.Tensor]] = {}
    for dbuffer in get_state(module).dbuffers():
        groups.setdefault(group_key(dbuffer.process_group), []).extend(_dbuffer_grads(dbuffer))
    return groups


def _dbuffer_grads(dbuffer: DBuffer) -> list[torch.Tensor]:
    params = [p for p in dbuffer.sharded_params.values() if p.requires_grad]
    grads = [p.grad for p in params if p.grad is not None]
    flat = dbuffer.sharded_grad
    if flat is not None and grads and len(grads) == len(params):
        storage = flat.untyped_storage().data_ptr()
        if all(g.untyped_storage().data_ptr() == storage for g in grads):
            return [flat]  # every gradient is a view of the flat buffer (padding and frozen slices are zero)
    return grads
