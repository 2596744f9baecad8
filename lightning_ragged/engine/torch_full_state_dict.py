"""torch's ``full_state_dict=True`` (``get_model_state_dict`` / ``get_optimizer_state_dict``) gives full tensors.

torch gathers the DTensors of a state dict there (``_gather_state_dict``, called from
``_maybe_full_or_cpu_state_dict``, where both calls end). A StateShard is no DTensor, so it came
back as it was, and using it raised. Once a model is sharded, that step first turns each
StateShard into its full tensor, one at a time and in the state dict's order (the same on every
rank): under ``cpu_offload`` each goes to CPU right after its gather, so the device holds one
full tensor at a time, and only rank 0 keeps it, as torch keeps rank 0's only then. torch's
own function then does the rest on plain tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as torch_state_dict

from lightning_ragged.engine.state_shard import StateShard

_TORCH_FULL_OR_CPU = torch_state_dict._maybe_full_or_cpu_state_dict


def route_full_state_dicts() -> None:
    """Once per process: StateShards become full tensors where torch's state-dict APIs are asked for full ones."""
    if torch_state_dict._maybe_full_or_cpu_state_dict is _TORCH_FULL_OR_CPU:
        torch_state_dict._maybe_full_or_cpu_state_dict = _full_or_cpu_state_dict


def _full_or_cpu_state_dict(state_dict: dict[str, Any], info: Any) -> dict[str, Any]:
    if info.full_state_dict:
        keep = not (info.cpu_offload and dist.is_initialized()) or dist.get_rank() == 0
        state_dict = _gathered(state_dict, info.cpu_offload, keep)
    return _TORCH_FULL_OR_CPU(state_dict, info)


def _gathered(value: Any, cpu_offload: bool, keep: bool) -> Any:
    """``value`` with every StateShard inside replaced by its full tensor (None where this rank keeps nothing)."""
    if isinstance(value, StateShard):
        full = value.full_tensor()
        if not keep:
            return None
        return full.to("cpu") if cpu_offload else full
    if isinstance(value, dict):
        return {key: _gathered(item, cpu_offload, keep) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_gathered(item, cpu_offload, keep) for item in value)
    return value
