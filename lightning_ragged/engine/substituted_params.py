"""Tensors a caller put in a sharded module's parameter slots: ``torch.func.functional_call``'s, a reassignment's.

Between calls a group's modules hold their shards; its pre-forward points them at the full parameters.
``functional_call(model, values, x)`` (``torch.nn.utils.stateless``: MAML's fast weights, ensembles of
``stack_module_state``, evaluation with other weights) puts its own tensors in the slots for the call, and
the pre-forward used to overwrite them, and the post-forward's shards went back into the caller's dict
(``functional_call`` writes the slots' final tensors there): forward ran with the model's weights, and
the caller's tensors got no gradient, silently (FSDP2 computes with the given DTensors). A plain tensor of
the parameter's global shape is left in its slot by both: forward computes with it and its gradients flow
to the caller's tensor, as ``functional_call`` on a plain module (this rank's batch; nothing is reduced).
Anything else cannot be gathered and is refused at the pre-forward, naming the parameter: a
shard-shaped tensor (values derived from ``model.parameters()``, the 1-D shards) or an ``nn.Parameter``
assigned after ``fully_shard`` (``module.weight = nn.Parameter(...)``, which the engine never trains).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def is_substitute(current: torch.Tensor, global_shape: torch.Size) -> bool:
    """A caller's tensor forward can compute with: a plain tensor of the parameter's global shape."""
    return not isinstance(current, nn.Parameter) and tuple(current.shape) == tuple(global_shape)


def refuse_substitute(current: torch.Tensor, global_shape: torch.Size, name: str) -> None:
    """Raise for a caller's tensor forward cannot compute with, naming the parameter and the fix."""
    kind = ("an nn.Parameter (assigned after fully_shard, or given to functional_call: give plain tensors there, "
            "e.g. p.detach().requires_grad_())") if isinstance(current, nn.Parameter) else "a tensor"
    raise ValueError(
        f"parameter {name!r} of a sharded module holds {kind} of shape {tuple(current.shape)} that lightning_ragged "
        f"did not put there (its global shape is {tuple(global_shape)}). torch.func.functional_call / "
        "torch.nn.utils.stateless take plain tensors of the global shapes (e.g. from "
        "lightning_ragged.full_state_dict(model)); values made from model.parameters() are this rank's 1-D shards, "
        "which the engine cannot gather. To change a module's parameters, replace them before fully_shard"
    )


def agreed_refusal(first_refused: int, process_group: Any, device: torch.device) -> int:
    """The lowest slot index any rank of the shard group refuses (``first_refused``: this rank's, or the number of
    slots): a 1-D parameter whole on one rank has its global shape there, so values made from the shards pass
    there and not elsewhere, and a refusal on some ranks only would leave the others waiting in a collective."""
    if not dist.is_initialized() or dist.get_world_size(process_group) == 1:
        return first_refused
    agreed = torch.tensor([first_refused], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=process_group)
    return int(agreed.item())
