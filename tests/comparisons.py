"""What the Trainer run scripts compare: full weights of any module, differences, the worst over ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_ragged import full_state_dict


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors of a sharded module (collective), or a copy of a plain module's state dict."""
    if getattr(model, "_ragged_fsdp_state", None) is not None:
        return full_state_dict(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference over the keys of two state dicts (which must be the same keys)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def loss_diff(a: object, b: object) -> float:
    """The largest difference between two runs' recorded per-step losses (``.losses``, the same count)."""
    assert len(a.losses) == len(b.losses) > 0, (len(a.losses), len(b.losses))
    return max(abs(x - y) for x, y in zip(a.losses, b.losses))


def worst(value: float) -> float:
    """The maximum of ``value`` over all ranks."""
    tensor = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()
