"""The sharded gradient of one DBuffer: the flat tensor (S elements, master dtype) its shards' ``.grad`` view.

Only those views hold it (the DBuffer keeps a weak reference), so that
``optimizer.zero_grad(set_to_none=True)`` frees it at once, as FSDP2 frees its sharded
gradients: between steps a rank holds no gradient memory.

Each reduction writes this rank's summed segment into it in one flat op: ``scale * segment``
into a fresh tensor (the scaling, 1/world or a divide factor, is the move itself), or added to
the one still alive (a second backward without ``zero_grad``, as DDP accumulates). On a
single rank (world size 1, no HSDP) the segment is the whole gradient buffer, a tensor of its
own each backward, and the scale is 1: when every gradient is fresh and the buffer is in the
master dtype it is *adopted* as the sharded gradient, untouched: no copy, no second buffer.
"""

from __future__ import annotations

import weakref
from typing import Collection, Mapping, Sequence

import torch
from torch import nn


class ShardedGrad:
    """One DBuffer's flat sharded gradient, held weakly, and which shards had no gradient before it was written."""

    def __init__(self, slices: Mapping[str, slice], numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.slices = dict(slices)
        """Each shard's range in the flat tensor (its range in this rank's segment)."""
        self.numel, self.dtype, self.device = numel, dtype, device
        self.was_none: set[str] = set()
        """Shards whose ``.grad`` was None before the last write (a parameter no rank used keeps None)."""
        self.used: set[str] = set()
        """Shards some rank got a gradient for since the reduction before the last (``settle_unused``)."""
        self._flat: weakref.ref[torch.Tensor] | None = None

    @property
    def flat(self) -> torch.Tensor | None:
        """The flat gradient while any shard's ``.grad`` still points into it."""
        return None if self._flat is None else self._flat()

    @flat.setter
    def flat(self, value: torch.Tensor | None) -> None:
        self._flat = None if value is None else weakref.ref(value)

    @staticmethod
    def carrying(params: Mapping[str, nn.Parameter], carry_frozen: bool) -> list[str]:
        """Shards a reduction gives a gradient: the trainable ones, after a no_sync backward (``carry_frozen``) the
        frozen ones too (frozen since a micro-batch gave them a gradient, they keep it, as DDP's ``.grad``)."""
        return [name for name, param in params.items() if param.requires_grad or carry_frozen]

    def write(
        self, params: Mapping[str, nn.Parameter], segment: torch.Tensor, scale: float, adoptable: bool, carrying: Collection[str]
    ) -> bool:
        """Set ``.grad = scale * segment`` (fresh) or add it (accumulating) for the shards ``carrying`` a gradient
        (the trainable ones, and after a no_sync backward the frozen ones too); True when ``segment`` was adopted.

        ``adoptable``: ``segment`` is a buffer the caller gives up (a single rank's whole gradient
        buffer); it becomes the flat gradient itself when every ``.grad`` is None, it has the
        master dtype and ``scale`` is 1.
        """
        self.was_none = {name for name, param in params.items() if param.grad is None}
        fresh = len(self.was_none) == len(params)
        adopted = adoptable and fresh and segment.dtype == self.dtype and scale == 1.0
        flat = segment if adopted else self.flat  # a strong reference while the views are made
        if not adopted:
            if flat is None:
                flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
                if not fresh:
                    flat.zero_()
            if fresh:
                torch.mul(segment, scale, out=flat)
            else:
                for name, param in params.items():
                    view = flat[self.slices[name]]
                    if param.grad is None:
                        view.zero_()
                    elif param.grad.data_ptr() != view.data_ptr():
                        view.copy_(param.grad)
                flat.add_(segment, alpha=scale)
        self.flat = flat
        for name in carrying:
            params[name].grad = flat[self.slices[name]]
        return adopted

    def settle_unused(self, params: Mapping[str, nn.Parameter], carrying: Sequence[str], used_anywhere: Sequence[bool]) -> None:
        """Back to ``grad = None`` for each shard ``carrying`` a gradient (in order) that no rank used and that had
        none before."""
        self.used = {name for name, used in zip(carrying, used_anywhere) if used}
        for name, used in zip(carrying, used_anywhere):
            if not used and name in self.was_none:
                params[name].grad = None

    def run_post_accumulate_grad_hooks(self, params: Mapping[str, nn.Parameter]) -> None:
        """Call the hooks users registered with ``register_post_accumulate_grad_hook`` on the shards, as FSDP2
        does after its reduce-scatter: autograd never accumulates into a shard (the full parameters are in the
        graph), so without this an optimizer stepped in backward (torch's "optimizer in backward" recipe) would
        never run. Called once the reduced gradients are final (end of backward), for the shards some rank got a
        gradient for since the last reduction (as FSDP2 and autograd: a parameter keeping an old ``.grad``
        it got no gradient for, a zero one included, is not called)."""
        for name in [name for name in params if name in self.used]:
            param = params[name]
            if param.grad is None:  # an earlier hook zeroed it (one optimizer over several shards)
                continue
            for hook in tuple((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values()):
                hook(param)
