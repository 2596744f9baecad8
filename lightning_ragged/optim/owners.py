"""Which rank computes on each item an optimizer needs whole: the *owner* (``root``) of every item.

An item (a Muon matrix, a Shampoo or SOAP tile) has every rank's piece of it, per shard process
group. ``OwnerPlan.assign`` makes the rank holding an item whole its owner (no communication);
split items go, most expensive first, to the rank with the least work so far (the owned items
counted too, and the items assigned before under the same key), ties to the rank holding more of
the item, then the lower rank. Every rank computes the same plan from the same items, so no
communication decides it. Muon costs an item by its Newton–Schulz FLOPs and plans every step;
Shampoo and SOAP by their eigendecomposition work and extend one plan as parameters join.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar


class Item:
    """A matrix or tile an optimizer needs whole, of ``shape``, spread over ranks as ``pieces``.

    Subclasses (dataclasses) define ``shape``, ``pieces`` (every rank's [start, end) in the item's
    own row-major flattening) and ``root`` (set by the plan: the owner).
    """

    shape: tuple[int, int]
    pieces: Sequence[tuple[int, int]]
    root: int

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def split(self) -> bool:
        return self.holder() is None

    def holder(self) -> int | None:
        """The rank holding the whole item, or None when it is split."""
        return next((rank for rank in range(len(self.pieces)) if self.piece_numel(rank) == self.numel), None)

    def piece_numel(self, rank: int) -> int:
        """How many of the item's elements ``rank`` holds."""
        start, end = self.pieces[rank]
        return end - start


ItemT = TypeVar("ItemT", bound=Item)


@dataclass
class OwnerPlan:
    """The owner of every item, per shard process group, and the work that gives each rank."""

    cost_per_rank: dict[int, list[int]] = field(default_factory=dict)  # shard group index -> work per rank
    owned: int = 0  # items whole on one rank
    split: int = 0  # items cut across ranks (gathered to their owner every step)

    def assign(self, key: int, items: Sequence[ItemT], cost: Callable[[ItemT], int]) -> None:
        """Set the ``root`` of new ``items`` of shard process group ``key``, counting the work assigned before.

        Holders keep whole items; split ones go greedily, most expensive first (``cost``; ties keep
        the given order), to the least-loaded rank (ties: the rank holding more of the item, then
        the lower rank).
        """
        if not items:
            return
        loads = self.cost_per_rank.setdefault(key, [0] * len(items[0].pieces))
        split = []
        for item in items:
            holder = item.holder()
            if holder is None:
                split.append(item)
                continue
            item.root = holder
            loads[holder] += cost(item)
            self.owned += 1
        for item in sorted(split, key=lambda i: -cost(i)):  # stable: ties keep the given order
            item.root = min(range(len(loads)), key=lambda r: (loads[r], -item.piece_numel(r), r))
            loads[item.root] += cost(item)
            self.split += 1

    def balance(self) -> float:
        """max/mean work over the ranks of the (first) shard group; 1.0 is perfect."""
        loads = next(iter(self.cost_per_rank.values()), [0])
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0
