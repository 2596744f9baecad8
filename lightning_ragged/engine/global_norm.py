"""The global norm of gradients split over ranks: each shard group's local part, reduced once, combined.

Each rank holds the reduced gradient of its own segment only. A group's local norm is put in
the form that adds up over ranks (the p-th power; kept as is for the maximum / minimum of
the +/-inf norms), all-reduced over **its shard group only** (under HSDP
the replicas hold identical shards: reducing over them too would count every element r
times; a group of one rank issues nothing), then the groups are combined and the root taken.
gloo's MAX and MIN drop a NaN held by any rank but the first, so those reductions carry an
is-NaN flag beside the value: a NaN anywhere is a NaN everywhere, as in torch's own norm.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

TORCH_TOTAL_NORM = torch.nn.utils.get_total_norm
"""torch's own, taken before ``torch_grad_norm`` routes the public name: the local part of each norm."""

REPLICATED = object()
"""The key of gradients every rank holds whole: counted once, locally."""
_WORLD = object()


def group_key(process_group: dist.ProcessGroup | None) -> object:
    """The key of gradients sharded over ``process_group`` (None: the default group)."""
    return _WORLD if process_group is None else process_group


def total_norm(
    groups: dict[object, list[torch.Tensor]], norm_type: float, foreach: bool | None = None
) -> torch.Tensor:
    """The ``norm_type``-norm over every rank's part of the gradients in ``groups`` (the same on every rank).

    A collective for each shard group of more than one rank, in the order of ``groups``. On the
    first gradient's device, in fp32 (fp64 where a gradient is fp64).
    """
    if norm_type == 0:
        raise ValueError(
            "norm_type=0 is not supported on sharded gradients: torch's 0-norm counts the gradient tensors holding a "
            "nonzero element, which no rank's part can tell; use 1, 2, another p, inf or -inf"
        )
    tensors = [g for grads in groups.values() for g in grads]
    device = tensors[0].device if tensors else torch.device("cpu")
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in tensors) else torch.float32
    parts = [_part(key, grads, norm_type, dtype, foreach).to(device) for key, grads in groups.items() if grads]
    if not parts:
        return torch.zeros((), dtype=dtype, device=device)
    stacked = torch.stack(parts)
    if norm_type == math.inf:
        return stacked.max()  # torch.max propagates NaN
    if norm_type == -math.inf:
        return stacked.min()
    return stacked.sum().pow(1.0 / norm_type)


def tensor_norms(groups: dict[object, list[torch.Tensor]], norm_type: float) -> dict[object, list[torch.Tensor]]:
    """Each tensor's ``norm_type``-norm (``norm_type`` > 0) over every rank's part, in fp32 (fp64 for fp64):
    one collective per shard group of more than one rank (a vector of the group's tensors), in ``groups``'
    order; REPLICATED tensors' are torch's own ``norm``, as if unsharded."""
    norms: dict[object, list[torch.Tensor]] = {}
    for key, grads in groups.items():
        if key is REPLICATED:
            norms[key] = [g.norm(norm_type) for g in grads]
            continue
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        local = torch.stack([g.to(dtype).norm(norm_type) if g.numel() else torch.zeros((), dtype=dtype,
                                                                                         device=g.device)
                             for g in grads])
        if not math.isinf(norm_type):
            local = local.pow(norm_type)
        reduced = _all_ranks(local, key, norm_type)
        norms[key] = list(reduced if math.isinf(norm_type) else reduced.pow(1.0 / norm_type))
    return norms


def _part(key: object, grads: list[torch.Tensor], norm_type: float, dtype: torch.dtype, foreach: bool | None):
    """One group's norm over all ranks, in the form that combines (p-th power, or extremum)."""
    device = grads[0].device
    held = [g for g in grads if g.numel()]  # a rank may hold nothing of a parameter (ragged shards)
    part = torch.full((), math.inf if norm_type == -math.inf else 0.0, dtype=dtype, device=device)
    if held:
        part = TORCH_TOTAL_NORM(held, norm_type, foreach=foreach).to(dtype)
        if not math.isinf(norm_type):
            part = part.pow(norm_type)
    if key is REPLICATED:
        return part
    return _all_ranks(part, key, norm_type)


def _all_ranks(part: torch.Tensor, key: object, norm_type: float) -> torch.Tensor:
    """Local parts (p-th powers or extrema, any shape) combined over the shard group ``key``, elementwise."""
    group = None if key is _WORLD else key
    if dist.get_world_size(group) == 1:
        return part
    if not math.isinf(norm_type):
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)  # a sum keeps a NaN
        return part
    sign = 1.0 if norm_type > 0 else -1.0  # MIN of (value, -flag): the flag's minimum is -1 where any rank had NaN
    pair = torch.stack([part, sign * part.isnan().to(part.dtype)])
    dist.all_reduce(pair, op=dist.ReduceOp.MAX if sign > 0 else dist.ReduceOp.MIN, group=group)
    return torch.where(pair[1] != 0, torch.full_like(pair[0], math.nan), pair[0])
