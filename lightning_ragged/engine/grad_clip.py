"""Gradient clipping on ragged shards: the true global norm, computed on the flat buffers.

Each rank holds the reduced gradient of its own segment only, so a local norm would clip each
rank differently. Here the norm is ``global_norm.total_norm`` of the sharded gradients (one flat
buffer per DBuffer, padding is zero), reduced once per shard group, and
``torch.nn.utils.clip_grads_with_norm_`` scales the gradients by it.

Works for plain ``fully_shard`` users as for the Lightning strategy::

    loss.backward()
    clip_grad_norm_(model, max_norm=1.0)
    optimizer.step()
"""

from __future__ import annotations

from typing import Iterable, Union

import torch
from torch import nn

from lightning_ragged.engine.dbuffer import DBuffer
from lightning_ragged.engine.global_norm import REPLICATED, group_key, total_norm
from lightning_ragged.engine.runtime import get_state

ParamsOrModule = Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]]



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
    rank). Returns the total norm (fp32; fp64 for fp64 gradients), the same on every rank, like
    ``torch.nn.utils.clip_grad_norm_``. Collective: call it on every rank.
    """
    norm_type = float(norm_type)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    elif not isinstance(parameters, nn.Module):
        parameters = list(parameters)  # read twice: the norm, then the scaling
    params = _with_grads(parameters)
    # A flat buffer's padding and frozen slices are zeros: they add nothing for p > 0 (and +inf),
    # but are the minimum for p < 0 and -inf, so those take the shards' own gradients.
    total = total_norm(_grads_by_group(parameters, flat=norm_type > 0), norm_type)
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


def clip_target(module: nn.Module | None, params: Iterable[torch.Tensor]) -> ParamsOrModule:
    """What to clip for an optimizer's ``params``: the sharded ``module`` (one flat op per DBuffer) where that
    clips exactly them, else the parameters. The module's flat buffers hold every gradient of the module, frozen
    parameters' too: with two optimizers, the other one's parameters may keep last step's gradients, which
    clipping this optimizer must neither count nor scale (as DDP's clipping of its parameters)."""
    params = list(params)
    if module is not None:
        ids = {id(p) for p in params}
        in_module = {id(p) for p in module.parameters()}
        with_grad = {id(p) for p in module.parameters() if p.grad is not None}
        if with_grad <= ids <= in_module:
            return module
    return params


def _with_grads(parameters: nn.Module | list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters (the shards of a sharded module) that hold a gradient."""
    if isinstance(parameters, nn.Module):
        parameters = [p for dbuffer in get_state(parameters).dbuffers() for p in dbuffer.sharded_params.values()]
    return [p for p in parameters if p.grad is not None]


def _grads_by_group(parameters: ParamsOrModule, flat: bool = True) -> dict[object, list[torch.Tensor]]:
    if isinstance(parameters, nn.Module):
        return _module_grads(parameters, flat)
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


def _module_grads(module: nn.Module, flat: bool) -> dict[object, list[torch.Tensor]]:
    """``flat``: one flat gradient per DBuffer whose parameters' grads all live in it; single grads otherwise."""
    groups: dict[object, list[torch.Tensor]] = {}
    for dbuffer in get_state(module).dbuffers():
        groups.setdefault(group_key(dbuffer.process_group), []).extend(_dbuffer_grads(dbuffer, flat))
    return groups


def _dbuffer_grads(dbuffer: DBuffer, flat_ok: bool) -> list[torch.Tensor]:
    params = [p for p in dbuffer.sharded_params.values() if p.requires_grad]
    grads = [p.grad for p in params if p.grad is not None]
    flat = dbuffer.sharded_grad
    if flat_ok and flat is not None and grads and len(grads) == len(params):
        storage = flat.untyped_storage().data_ptr()
        if all(g.untyped_storage().data_ptr() == storage for g in grads):
            return [flat]  # every gradient is a view of the flat buffer (padding and frozen slices are zero)
    return grads
