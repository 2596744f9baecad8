"""torch's ``full_state_dict=True`` (``get_model_state_dict`` / ``get_optimizer_state_dict``) gives full tensors.

torch gathers the DTensors of a state dict there (``_gather_state_dict``, called from
``_maybe_full_or_cpu_state_dict``, where both calls end). A StateShard is no DTensor, so it came
back as it was, and using it raised. Once a model is sharded, that step first turns each
StateShard into its full tensor (``StateShard.full_tensor``), one at a time, in an order every
rank agrees on (sorted paths: a resumed optimizer's per-parameter keys can be in another order on
a rank holding none of that parameter): under ``cpu_offload`` each goes to CPU right after its gather and only rank 0 keeps it,
as torch keeps rank 0's only then, so the device holds one gathered tensor (and its gather
buffer) at a time. torch's own function then does the rest on plain tensors.

The ranks first agree on which entries to gather (one object all-gather of their paths): an
optimizer state is taken for a per-element one by its size on each rank, and a state of one
element (a custom optimizer's gain) beside a rank's one-element part would otherwise be a
StateShard on that rank only, and the gathers would not match. An entry that is not a
StateShard everywhere is the state as this rank holds it.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as torch_state_dict

from lightning_ragged.engine.state_shard import StateShard

_TORCH_FULL_OR_CPU = torch_state_dict._maybe_full_or_cpu_state_dict

Path = tuple[Any, ...]


def route_full_state_dicts() -> None:
    """Once per process: StateShards become full tensors where torch's state-dict APIs are asked for full ones."""
    if torch_state_dict._maybe_full_or_cpu_state_dict is _TORCH_FULL_OR_CPU:
        torch_state_dict._maybe_full_or_cpu_state_dict = _full_or_cpu_state_dict


def _full_or_cpu_state_dict(state_dict: dict[str, Any], info: Any) -> dict[str, Any]:
    if info.full_state_dict:
        shards = dict(_state_shards(state_dict, ()))
        everywhere = sorted(shards, key=repr)
        if dist.is_initialized() and dist.get_world_size() > 1:
            paths: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(paths, everywhere)
            everywhere = sorted(set.intersection(*(set(p) for p in paths)), key=repr)
        keep = not (info.cpu_offload and dist.is_initialized()) or dist.get_rank() == 0
        fulls: dict[Path, Any] = {}
        for path in everywhere:  # the agreed order: a rank's own dict order may differ (a resumed state)
            full = shards[path].full_tensor()
            fulls[path] = (full.to("cpu") if info.cpu_offload else full) if keep else None
        state_dict = _replaced(state_dict, (), fulls)
    return _TORCH_FULL_OR_CPU(state_dict, info)


def _state_shards(value: Any, path: Path) -> Iterator[tuple[Path, StateShard]]:
    if isinstance(value, StateShard):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _state_shards(item, path + (key,))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _state_shards(item, path + (index,))


def _replaced(value: Any, path: Path, fulls: dict[Path, Any]) -> Any:
    """``value`` with each StateShard inside as its full tensor from ``fulls`` (its local part where not gathered).

    Containers holding none are returned as they are (a namedtuple stays one).
    """
    if isinstance(value, StateShard):
        return fulls[path] if path in fulls else value.local
    if isinstance(value, dict):
        items = {key: _replaced(item, path + (key,), fulls) for key, item in value.items()}
        return value if all(items[key] is value[key] for key in value) else items
    if isinstance(value, (list, tuple)):
        items = [_replaced(item, path + (index,), fulls) for index, item in enumerate(value)]
        if all(new is old for new, old in zip(items, value)):
            return value
        return items if isinstance(value, list) else tuple(items)
    return value
