"""Every rank of a shard group shards the same model with the same layout arguments, or none does.

A model built from a rank-local value (a vocabulary size read from a local file, a config that differs by
node) would plan different layouts: ``Embedding(10, 8)`` on one rank and ``Embedding(11, 8)`` on another
trained two different models without a word (each rank's full weights differed), and a parameter more on
one rank or another ``dbuffer_size`` aborted the processes inside gloo ("Received data size doesn't
match"). DDP refuses it in its constructor; so does ``fully_shard``, before its first collective: each
rank's signature (parameter and buffer names, shapes, dtypes, ``requires_grad``, the layout arguments) is
hashed, the hashes compared, and on a difference the first differing entry is named on every rank.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from lightning_ragged.engine.collectives import on_device


def _describe(value: Any) -> str:
    """A value as every rank writes it: classes by name, callables by kind (their address differs)."""
    if isinstance(value, type):
        return value.__qualname__
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(item) for item in value) + "]"
    if callable(value) and not isinstance(value, nn.Module):
        return f"a {type(value).__name__}"
    return repr(value)


def _global_shape(param: nn.Parameter) -> tuple[int, ...]:
    """A shard of an earlier call (a block of FSDP2's pattern) by its global shape: its own differs by rank."""
    shard = getattr(param, "ragged_shard", None)
    return tuple(shard.global_shape if shard is not None else param.shape)


def _signature(module: nn.Module, knobs: Mapping[str, Any]) -> list[tuple[str, str]]:
    entries = [(f"parameter {name!r}", f"{_global_shape(p)} {p.dtype} requires_grad={p.requires_grad}")
               for name, p in module.named_parameters()]
    entries += [(f"buffer {name!r}", f"{tuple(b.shape)} {b.dtype}") for name, b in module.named_buffers()]
    entries += [(f"argument {knob}", _describe(value)) for knob, value in knobs.items()]
    return entries


def require_same_model(
    module: nn.Module, label: str, groups: list[Any], knobs: Mapping[str, Any], device: torch.device | None
) -> None:
    """Raise on every rank of each of ``groups`` (shard group, replicate group) if their models or ``knobs``
    differ, naming the first difference; one small all-gather per group otherwise (on ``device``, the shards',
    by default the parameters': NCCL's object collectives use the current CUDA device, cuda:0 on every rank
    where none was set)."""
    if device is None:
        device = next((p.device for p in module.parameters() if not p.is_meta), torch.device("cpu"))
    signature = _signature(module, knobs)
    digest = hashlib.sha256(repr(signature).encode()).hexdigest()
    with on_device(device):
        _compare(signature, digest, label, groups)


def _compare(signature: list[tuple[str, str]], digest: str, label: str, groups: list[Any]) -> None:
    for group in groups:
        if dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake":  # torch's fake group moves no data
            continue
        digests: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(digests, digest, group=group)
        if len(set(digests)) == 1:
            continue
        signatures: list[Any] = [None] * len(digests)
        dist.all_gather_object(signatures, signature, group=group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(digests)))
        other = next(index for index, theirs in enumerate(digests) if theirs != digests[0])
        first, second = dict(signatures[0]), dict(signatures[other])
        what = next(key for key in [*first, *second] if first.get(key) != second.get(key))
        raise ValueError(
            f"fully_shard({label}): the ranks hold different models or arguments: {what} is "
            f"{first.get(what, 'absent')} on rank {ranks[0]} and {second.get(what, 'absent')} on rank {ranks[other]}. "
            "Every rank must build the same model (the same config: a size read from a rank-local file differs) "
            "and pass the same fully_shard arguments"
        )
