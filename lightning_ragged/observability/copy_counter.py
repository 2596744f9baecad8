"""Count bytes moved by copy-like operators: how "zero-copy" is shown, not asserted.

``CopyCounter`` is a ``TorchDispatchMode``: every aten (or FSDP2 custom) operator
that only moves data (copy, cast, clone, cat, split-copy, chunk-cat, …) adds the bytes
it writes. Collectives themselves are not counted: that is the data that must move.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

COPY_OPS = frozenset(
    {
        "aten::copy_",
        "aten::_to_copy",
        "aten::clone",
        "aten::cat",
        "aten::stack",
        "aten::split_with_sizes_copy",
        "aten::_chunk_cat",
        "aten::chunk_cat",
        "aten::_foreach_copy_",
        "aten::index_copy",
        "aten::index_copy_",
        "aten::slice_scatter",
        "aten::select_scatter",
        "aten::as_strided_scatter",
        "aten::view_copy",
        "aten::_unsafe_view_copy",
        "fsdp::all_gather_copy_in",
        "fsdp::split_with_sizes_copy",
        "fsdp::chunk_cat",
    }
)


def _written_bytes(name: str, args: tuple, kwargs: dict, out: object) -> int:
    if name in ("aten::copy_", "aten::_foreach_copy_", "aten::index_copy_"):
        target = args[0]
    elif name == "fsdp::all_gather_copy_in":
        target = out[0]  # the copied-in input; the output buffer is only allocated here
    elif "out" in kwargs:
        target = kwargs["out"]
    else:
        target = out
    tensors = [t for t in tree_flatten(target)[0] if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


class CopyCounter(TorchDispatchMode):
    """Context manager: ``with CopyCounter() as c: ...; c.total_bytes, c.by_op``."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    @property
    def total_bytes(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if name in COPY_OPS:
            self.by_op[name] += _written_bytes(name, args, kwargs, out)
        return out
