"""Which ``fully_shard`` call sharded each parameter: one owner per parameter.

A parameter shared by modules sharded in separate calls (a weight tied across blocks in FSDP2's
call pattern) would become two independent shards, untied without a word; FSDP2 refuses it, and
so does ``fully_shard``. The registry holds, weakly and by identity, the parameters a call was
given and the shard objects it made (a submodule shared by two blocks holds the first's shards).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

_SHARDED: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Every parameter some ``fully_shard`` call sharded, and where (a parameter is owned by one DBuffer)."""


def refuse_sharded_twice(module: nn.Module, taken: set[int], label: str) -> list[nn.Parameter]:
    """The parameters of ``module`` this call shards (all but those in ``taken``: adopted from earlier calls).

    Refuses one an earlier ``fully_shard`` call sharded: sharded twice, it would become two
    independent copies, untied silently. FSDP2 refuses it too.
    """
    params = [p for p in module.parameters() if id(p) not in taken]
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    for param in params:
        where = _SHARDED.get(param)
        if where is not None:
            raise ValueError(
                f"parameter {names.get(id(param), '?')!r} of {label} is shared with a parameter "
                f"already sharded by another fully_shard call ({where}); sharding it again would untie them. "
                "Shard the modules that share it in one fully_shard call (their common parent: a tied parameter "
                "then goes to the group that contains all its users), or untie it"
            )
    _refuse_shared_memory(params, names, label)
    return params


def _refuse_shared_memory(params: list[nn.Parameter], names: dict[int, str], label: str) -> None:
    """Refuse parameters whose elements alias: one a view of another (``nn.Parameter(w.data[:, :4])``, a row of
    another) or of itself (``expand``: stride 0). Sharding copies each parameter into its DBuffer, so the aliases
    would train apart silently (DDP keeps them one memory; FSDP2 refuses the non-contiguous ones)."""
    by_storage: dict[tuple[torch.device, int], list[nn.Parameter]] = {}
    for param in params:
        if param.is_meta or param.numel() == 0:
            continue
        if any(stride == 0 and size > 1 for size, stride in zip(param.shape, param.stride())):
            raise ValueError(
                f"parameter {names.get(id(param), '?')!r} of {label} repeats its elements (stride 0, e.g. from "
                "expand()): sharding would make each copy a separate weight. Register a real tensor "
                "(.clone() / .contiguous()) or expand in forward"
            )
        by_storage.setdefault((param.device, param.untyped_storage().data_ptr()), []).append(param)
    for shared in by_storage.values():
        for cluster in _overlapping_spans(shared):
            _refuse_common_elements(cluster, names, label)


def _span(param: nn.Parameter) -> tuple[int, int]:
    """The [first, last + 1) bytes of its storage a parameter's elements lie in."""
    last = param.storage_offset() + sum((n - 1) * s for n, s in zip(param.shape, param.stride()))
    return param.storage_offset() * param.element_size(), (last + 1) * param.element_size()


def _overlapping_spans(shared: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters of one storage in runs whose spans overlap (views of one flat buffer, side by side, make none)."""
    clusters: list[list[nn.Parameter]] = []
    end = -1
    for param in sorted(shared, key=_span):
        first, last = _span(param)
        if first < end:
            clusters[-1].append(param)
        else:
            clusters.append([param])
        end = max(end, last)
    return [cluster for cluster in clusters if len(cluster) > 1]


def _refuse_common_elements(cluster: list[nn.Parameter], names: dict[int, str], label: str) -> None:
    """Refuse two parameters that hold a common byte; views that interleave without one (``w[:, :4]`` and
    ``w[:, 4:]``) are independent weights and pass."""
    start = min(_span(p)[0] for p in cluster)
    length = max(_span(p)[1] for p in cluster) - start
    covered = torch.zeros(length, dtype=torch.bool)
    for index, param in enumerate(cluster):
        mine = _bytes_of(param, start, length)
        if (mine & covered).any():
            other = next(p for p in cluster[:index] if (_bytes_of(p, start, length) & mine).any())
            order = list(names)  # the model's order, for the message
            first, second = sorted((other, param), key=lambda p: order.index(id(p)) if id(p) in names else 0)
            raise ValueError(
                f"parameters {names.get(id(first), '?')!r} and {names.get(id(second), '?')!r} of {label} share "
                "memory (one is a view of the other, e.g. nn.Parameter(w.data[:, :4])): sharding copies each "
                "into its own buffer, so they would train apart. Register one parameter and compute the other "
                "from it in forward (e.g. w[:, :4]), or .clone() it to make it independent"
            )
        covered |= mine


def _bytes_of(param: nn.Parameter, start: int, length: int) -> torch.Tensor:
    """A flag per byte of the span from ``start``: set where ``param``'s elements lie."""
    size = param.element_size()
    marks = torch.zeros(length, dtype=torch.bool)
    shape, strides = (*param.shape, size), (*(stride * size for stride in param.stride()), 1)
    marks.as_strided(shape, strides, param.storage_offset() * size - start).fill_(True)
    return marks


def claim(label: str, params: list[nn.Parameter]) -> None:
    """Record that the ``fully_shard`` call on ``label`` (a module's class, or a list of them) sharded ``params``."""
    for param in params:
        _SHARDED[param] = f"the call on {label}"
