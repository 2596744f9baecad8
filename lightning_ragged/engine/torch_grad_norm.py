"""torch's ``clip_grad_norm_`` / ``get_total_norm`` on sharded parameters: the global norm, as on FSDP2.

FSDP2 training loops clip with ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``;
its DTensor gradients make the norm global. Our sharded parameters' gradients are plain 1-D
views of each DBuffer's flat gradient, so torch's function would clip every rank by the norm of
its own part: a different coefficient per rank, silently. Once a model is sharded in this
process, ``torch.nn.utils.get_total_norm`` (the name torchtitan calls, and the module global
torch's ``clip_grad_norm_`` calls, so ``from torch.nn.utils import clip_grad_norm_`` written
before the import is covered too) recognizes those gradients by their storage and computes
the norm as ``lr.clip_grad_norm_`` does: local p-th powers all-reduced once per shard group.
Called with no such gradient it is torch's function, untouched: no collective, same result.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Iterable

import torch
from torch import nn

from lightning_ragged.engine.dbuffer import DBuffer
from lightning_ragged.engine.global_norm import REPLICATED, TORCH_TOTAL_NORM, group_key, total_norm

_DBUFFERS: weakref.WeakSet[DBuffer] = weakref.WeakSet()
"""Every DBuffer of a sharded model alive in this process (their flat gradients are looked up)."""


def route_torch_grad_norm(dbuffers: Iterable[DBuffer]) -> None:
    """Track ``dbuffers`` and, once per process, route torch's ``get_total_norm`` through :func:`get_total_norm`."""
    _DBUFFERS.update(dbuffers)
    for namespace in (torch.nn.utils, torch.nn.utils.clip_grad):
        for name in [name for name, value in vars(namespace).items() if value is TORCH_TOTAL_NORM]:
            setattr(namespace, name, get_total_norm)


@torch.compiler.disable  # storage addresses are not traceable: under torch.compile this runs eagerly
@torch.no_grad()
def get_total_norm(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """torch's ``get_total_norm``; over all ranks' parts for gradients of sharded parameters (a collective then).

    Every rank passes its own gradients of the same parameters, as with FSDP2's DTensors;
    the result is the same on every rank, in torch's dtype (the gradients' promoted dtype).
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    norm_type = float(norm_type)
    groups = _by_shard_group(tensors)
    if list(groups) in ([], [REPLICATED]):
        return TORCH_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    total = total_norm(groups, norm_type, foreach).to(dtype.to_real())  # a norm is real, as torch's
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped (the global norm over the shards of a lightning_ragged model). To disable this error and "
            "scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    return total


def _by_shard_group(tensors: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """The tensors keyed by the shard group of the DBuffer whose flat gradient holds them (REPLICATED: none)."""
    owners: dict[int, object] = {}
    for dbuffer in _DBUFFERS:
        flat = dbuffer.sharded_grad
        if flat is not None and flat.untyped_storage().data_ptr():
            owners[flat.untyped_storage().data_ptr()] = group_key(dbuffer.process_group)
    groups: dict[object, list[torch.Tensor]] = {}
    for tensor in tensors:
        plain = type(tensor) in (torch.Tensor, nn.Parameter)  # subclasses (DTensor) keep torch's own path
        key = owners.get(tensor.untyped_storage().data_ptr(), REPLICATED) if plain and owners else REPLICATED
        groups.setdefault(key, []).append(tensor)
    return groups
