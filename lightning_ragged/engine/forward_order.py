"""The order in which a step's groups ran their forward, with each group's position.

Prefetching asks, at every group's forward and backward, which groups come next in this order
(forward) or before it (backward: the order reversed). Positions are kept in a dict, so a model
of thousands of groups pays O(1) per question instead of a scan and a reversed copy of the list.
"""

from __future__ import annotations

from typing import Generic, Hashable, Iterator, TypeVar

Group = TypeVar("Group", bound=Hashable)


class ForwardOrder(Generic[Group]):
    """Groups in first-forward order, each recorded once, with ``next``/``previous`` look-ahead."""

    def __init__(self) -> None:
        self._groups: list[Group] = []
        self._position: dict[Group, int] = {}

    def record(self, group: Group) -> None:
        """Append ``group`` unless it already ran forward in this step."""
        if group not in self._position:
            self._position[group] = len(self._groups)
            self._groups.append(group)

    def next(self, group: Group | None, count: int) -> list[Group]:
        """The ``count`` groups after ``group`` (``None``: the first ``count``); none for a group not in the order."""
        at = -1 if group is None else self._position.get(group)
        return [] if at is None else self._groups[at + 1 : at + 1 + count]

    def previous(self, group: Group | None, count: int) -> list[Group]:
        """The ``count`` groups before ``group``, nearest first (``None``: the last ``count``, the last first)."""
        at = len(self._groups) if group is None else self._position.get(group)
        return [] if at is None else self._groups[max(0, at - count) : at][::-1]

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[Group]:
        return iter(self._groups)

    def __getitem__(self, index: int) -> Group:
        return self._groups[index]
