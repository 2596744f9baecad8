"""Optimizers that need whole tensors, refused on shards with the reason and a fix.

A shard is this rank's 1-D part of a parameter. torch's ``LBFGS`` takes dot products and line-search
steps over the whole gradient: on shards every rank would pick its own step (measured: 0.2 relative
from DDP after 3 steps, silently). ``Adafactor`` (torch's, transformers', timm's) factors each matrix's
second moment by rows and columns and scales by a tensor's RMS: on shards torch's divided by zero on a
rank's empty part, transformers' trained 2.4e-2 from one process, silently. ``SparseAdam`` needs the
sparse gradient of an ``Embedding(sparse=True)``, which lands dense in the flat gradient buffer (torch's
error named no cause). LAMB, LARS, NovoGrad, AdamP/SGDP scale or project each tensor's update by its
norms, over a shard a different one. Other libraries' Muon, Shampoo, SOAP, Kron and timm's
``AdafactorBigVision`` precondition or orthogonalize matrices (timm's Muon trained 0.066 from one process
on shards, silently: it falls back to AdamW on 1-D tensors). A check before optimizer
steps (installed by the first ``fully_shard``, ``optimizer_checks.py``) refuses a step of any of them,
or of a subclass, holding sharded parameters, naming the fix; lightning_ragged's own (``optim``) handle
shards. (torch's ``Muon`` refuses 1-D shards itself, when it is built: use ``lightning_ragged.optim.Muon``.)
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.optim import Optimizer

from lightning_ragged.engine.optimizer_checks import check_before_steps

_ELEMENTWISE_INSTEAD = "Use torch.optim.AdamW or lightning_ragged.optim.AdamW8bit"
_WHY: dict[str, tuple[str, bool]] = {
    "LBFGS": ("takes dot products and line-search steps over whole gradients: on shards every rank would pick its "
              "own step. Train with DDP (or one process) for LBFGS", True),
    "Adafactor": ("factors each matrix's second moment by its rows and columns and scales by each tensor's RMS, and "
                  f"a shard is this rank's 1-D part. {_ELEMENTWISE_INSTEAD}", False),
    "SparseAdam": ("needs sparse gradients, and a sharded nn.Embedding(sparse=True)'s gradient lands dense in its "
                   "group's flat gradient buffer (it trains as a dense embedding). Use torch.optim.Adam or AdamW", False),
    **{name: ("scales each tensor's update by its norms (a trust ratio, a per-tensor normalization or projection), "
              f"and a shard is this rank's 1-D part. {_ELEMENTWISE_INSTEAD}", False)
       for name in ("Lamb", "LAMB", "FusedLAMB", "Lars", "LARS", "NovoGrad", "NvNovoGrad", "AdamP", "SGDP")},
    **{name: ("preconditions or orthogonalizes each matrix (its rows and columns), and a shard is this rank's 1-D "
              "part (timm's Muon silently falls back to AdamW on 1-D tensors). Use lightning_ragged.optim's Muon, "
              "Shampoo or SOAP, which gather what a layout cuts", False)
       for name in ("Muon", "AdafactorBigVision", "Kron", "Shampoo", "DistributedShampoo", "SOAP")},
}
"""Optimizer class name (torch's LBFGS and SparseAdam; any library's others; their subclasses) -> (why and what
instead, refused only when a shard group has several ranks)."""
_TORCH_ONLY = ("LBFGS", "SparseAdam")


def refuse_whole_tensor_optimizers() -> None:
    """Once per process: check optimizers before their steps."""
    check_before_steps(_refuse)


def _refuse(optimizer: Optimizer) -> None:
    base = _whole_tensor_base(type(optimizer))
    if base is None:
        return
    why, across_ranks_only = _WHY[base.__name__]
    shards = [p.ragged_shard for group in optimizer.param_groups for p in group["params"]
              if getattr(p, "ragged_shard", None) is not None]
    if shards and (not across_ranks_only or any(_ranks(shard.process_group) > 1 for shard in shards)):
        kind = type(optimizer)
        module = "torch.optim" if base.__module__.startswith("torch.optim") else base.__module__
        name = f"{module}.{base.__name__}"
        if kind is not base:
            name = f"{kind.__qualname__} (a {name})"
        raise ValueError(
            f"{name} cannot train parameters lightning_ragged.fully_shard sharded "
            f"(e.g. {shards[0].name!r}, shape {tuple(shards[0].global_shape)}): it {why}"
        )


def _whole_tensor_base(kind: type) -> Any:
    """The class in ``kind``'s MRO refused on shards (torch's LBFGS or SparseAdam, anyone's Adafactor, LAMB, LARS,
    Muon, ...); none for lightning_ragged's optimizers and their subclasses, which handle shards."""
    if any(base.__module__.startswith("lightning_ragged") for base in kind.__mro__):
        return None
    for base in kind.__mro__:
        if base.__name__ in _WHY and (
            base.__name__ not in _TORCH_ONLY or base.__module__.startswith("torch.optim")
        ):
            return base
    return None


def _ranks(process_group: Any) -> int:
    return dist.get_world_size(process_group) if dist.is_initialized() else 1
