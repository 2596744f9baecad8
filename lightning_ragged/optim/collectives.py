"""Count ``torch.distributed`` collectives issued inside a block of code (tests, benchmarks).

``with CollectiveCounter() as counter: optimizer.step()`` wraps every collective and
point-to-point function of ``torch.distributed`` for the duration of the block; callers
that look the function up as ``dist.<name>`` at call time (this package does) are counted.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
)

_INPUT_SECOND = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single")
"""Functions whose first argument is the output and second the tensor sent."""


class CollectiveCounter:
    """Context manager: ``calls`` counts each wrapped function by name, ``bytes`` the tensors sent."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bytes = 0
        self._saved: dict[str, Callable[..., Any]] = {}

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __enter__(self) -> "CollectiveCounter":
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            sent = args[1] if name in _INPUT_SECOND and len(args) > 1 else (args[0] if args else None)
            if isinstance(sent, torch.Tensor):
                self.bytes += sent.numel() * sent.element_size()
            return original(*args, **kwargs)

        return counted
