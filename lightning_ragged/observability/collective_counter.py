"""Count the collectives a process group receives, whichever framework issues them.

``CollectiveCounter`` is a ``TorchDispatchMode`` that counts every ``c10d`` and functional-collective
operator by name: what torch's ``CommDebugMode`` counts, and also point-to-point sends and receives
(the pairwise reduction's), without ``CommDebugMode``'s module tracker, whose
global forward hooks fail on models that replace a submodule's forward (transformers 5.25's hub-kernel
layers, e.g. Llama's rotary embedding: ``IndexError: pop from empty list`` in ``_fw_set_module_hook``),
and then stay installed for every later forward.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACES = ("c10d", "_c10d_functional")
NOT_COLLECTIVES = frozenset({"wait_tensor"})


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: ...; c.total, c.by_op`` (``"c10d._allgather_base_"``: count)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        packet = func._overloadpacket
        if func.namespace in NAMESPACES and packet.__name__ not in NOT_COLLECTIVES:
            self.by_op[str(packet)] += 1
        return func(*args, **(kwargs or {}))
