"""Flat storage that is freed and re-allocated in place (``untyped_storage().resize_``).

A DBuffer's full and gradient buffers keep their tensor objects (and every view of them,
including tensors autograd saved) across reshard/unshard: only the storage underneath is
resized to 0 bytes and back. ``padding`` finds the stretches of a flat buffer no tensor covers.
"""

from __future__ import annotations

import torch

from lightning_ragged.layout.spec import Layout


def padding(layout: Layout, numel: int) -> list[slice]:
    """The stretches of a DBuffer's flat buffer that no tensor covers."""
    gaps, position = [], 0
    for begin, name in sorted((offset, name) for name, offset in layout.offsets.items()):
        if begin > position:
            gaps.append(slice(position, begin))
        position = max(position, begin + layout.specs[name].numel)
    if position < numel:
        gaps.append(slice(position, numel))
    return gaps


def is_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() > 0


def allocate(tensor: torch.Tensor, nbytes: int) -> None:
    if tensor.untyped_storage().nbytes() != nbytes:
        tensor.untyped_storage().resize_(nbytes)


def free(tensor: torch.Tensor) -> bool:
    """Release the storage (views stay valid); True when there was any to release."""
    if tensor.untyped_storage().nbytes() > 0:
        tensor.untyped_storage().resize_(0)
        return True
    return False
