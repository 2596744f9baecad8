"""Gather the pieces of split items to their roots and scatter the results back: one all-to-all each way.

An *item* is a structure an optimizer needs whole (a Muon matrix, a Shampoo or SOAP tile) that the
layout cut across the ranks of a shard process group. Every rank knows every item's pieces (each
rank's ``[start, end)`` in the item's own flattening) and its *root* (the rank that computes on
it), in the same order on every rank. ``SplitExchange`` moves them:

1. ``gather(local)`` sends this rank's piece of every item rooted elsewhere to that root in **one**
   asynchronous ``all_to_all_single`` (uneven splits: gloo and NCCL), cast to the wire dtype;
2. ``gathered()`` waits and returns every item rooted here whole (its own piece included);
3. ``scatter(results)`` sends each rank its piece of the roots' results, again one asynchronous
   ``all_to_all_single``, cast to the wire dtype;
4. ``scattered()`` waits and returns this rank's piece of every result computed elsewhere.

The split sizes follow from the pieces and roots alone, so every rank issues both collectives
whatever it holds. Every piece travels with one *mark* (a 0/1 flag: Muon,
Shampoo and SOAP send "this rank has a gradient" to the root and "the item stepped" back), and every
rank sends every other rank one *status* value in the scatter (0: fine; Shampoo and SOAP report
a failed eigendecomposition), so news reaches every rank, not only the items' holders.
``complete(i, has_local)`` (after 2) says whether every holder of item ``i`` marked it.

Work between 1 and 2 (owned items) and between 3 and 4 (the root's own pieces) overlaps the
transfers. Muon sends bf16 (Newton–Schulz casts to bf16 first), Shampoo and SOAP fp32 (their
statistics need it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_ragged.engine.collectives import host_tensor

Ranges = Sequence[tuple[int, int]]
_Slot = tuple[int, int, int, int]  # (item, peer, offset in the buffer, numel)


def _numel(piece: tuple[int, int]) -> int:
    return piece[1] - piece[0]


def _after(slots: list[_Slot]) -> list[int]:
    """The offset right after each piece: where its mark sits."""
    return [offset + numel for _, _, offset, numel in slots]


def _index(offsets: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(offsets, dtype=torch.long, device=device)


@dataclass(frozen=True)
class _Route:
    """Where every piece (and mark, and status) sits in this rank's send and receive buffers, one direction."""

    send_splits: list[int]
    recv_splits: list[int]
    send: list[_Slot]
    recv: list[_Slot]
    send_status: list[int]  # offsets of the status values this rank sends (one per peer)
    recv_status: list[tuple[int, int]]  # (peer, offset) of the status values it receives


def _route(world: int, rank: int, send: list[list[tuple[int, int]]], recv: list[list[tuple[int, int]]],
           mark: int, status: int) -> _Route:
    """Lay out one direction: ``send[dest]`` / ``recv[src]`` are the (item, numel) pieces of each peer's block.

    Each block between two ranks starts with ``status`` status values; each piece is followed by
    ``mark`` mark values.
    """

    def blocks(per_peer: list[list[tuple[int, int]]]) -> tuple[list[int], list[_Slot], list[tuple[int, int]]]:
        splits, slots, statuses, cursor = [], [], [], 0
        for peer, pieces in enumerate(per_peer):
            start = cursor
            if peer != rank:
                statuses += [(peer, cursor + k) for k in range(status)]
                cursor += status
                for item, numel in pieces:
                    slots.append((item, peer, cursor, numel))
                    cursor += numel + mark
            splits.append(cursor - start)
        return splits, slots, statuses

    send_splits, send_slots, send_status = blocks(send)
    recv_splits, recv_slots, recv_status = blocks(recv)
    return _Route(send_splits, recv_splits, send_slots, recv_slots, [offset for _, offset in send_status], recv_status)


class SplitExchange:
    """The gather-to-root and scatter-back of the split items of one shard process group (reusable every step)."""

    def __init__(
        self,
        pieces: Sequence[Ranges],
        roots: Sequence[int],
        rank: int,
        process_group: Any,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.pieces, self.roots, self.rank = pieces, roots, rank
        self.process_group, self.dtype, self.device = process_group, dtype, device
        self.world = world = len(pieces[0]) if pieces else 1
        self.mine = [i for i, root in enumerate(roots) if root == rank]
        # my pieces of every item rooted elsewhere, by root; every rank's piece of the items rooted here, by rank
        theirs: list[list[tuple[int, int]]] = [[] for _ in range(world)]
        for i, (item_pieces, root) in enumerate(zip(pieces, roots)):
            if root != rank and _numel(item_pieces[rank]):
                theirs[root].append((i, _numel(item_pieces[rank])))
        ours = [[(i, _numel(pieces[i][peer])) for i in self.mine if _numel(pieces[i][peer])] for peer in range(world)]
        self._gather = _route(world, rank, theirs, ours, mark=1, status=0)
        self._scatter = _route(world, rank, ours, theirs, mark=1, status=1)
        # where the marks (after each piece) and the statuses sit: (send buffer, receive buffer)
        self._gather_marks = (_index(_after(self._gather.send), device), _index(_after(self._gather.recv), device))
        self._scatter_marks = (
            _index(_after(self._scatter.send) + self._scatter.send_status, device),
            _index(_after(self._scatter.recv) + [offset for _, offset in self._scatter.recv_status], device),
        )
        self._local: Sequence[Optional[torch.Tensor]] = ()
        self._received = self._returned = self._sent = torch.empty(0)
        self._work: Any = None
        self.marks_in: dict[tuple[int, int], bool] = {}  # (item rooted here, src) -> the src's mark
        self.marks_out: dict[int, bool] = {}  # item rooted elsewhere -> its root's mark
        self.statuses: dict[int, float] = {}  # peer -> the status it sent in the scatter

    def _all_to_all(self, send: torch.Tensor, route: _Route) -> torch.Tensor:
        received = torch.empty(sum(route.recv_splits), dtype=self.dtype, device=self.device)
        self._work = dist.all_to_all_single(
            received, send, route.recv_splits, route.send_splits, group=self.process_group, async_op=True
        )
        self._sent = send  # kept alive until the transfer finished
        return received

    def _pack(self, route: _Route, source: Callable[[int, int], Optional[torch.Tensor]]) -> torch.Tensor:
        """The send buffer: ``source(item, dest)`` (None: zeros) at every piece's slot, cast to the wire dtype."""
        send = torch.empty(sum(route.send_splits), dtype=self.dtype, device=self.device)
        for item, dest, offset, numel in route.send:
            piece, values = send[offset : offset + numel], source(item, dest)
            if values is None:
                piece.zero_()
            else:
                piece.copy_(values)
        return send

    def gather(self, local: Sequence[Optional[torch.Tensor]], marks: Sequence[bool]) -> None:
        """Start sending ``local[i]`` (this rank's 1-D piece of item ``i``; None: zeros) and ``marks[i]`` to its root."""
        self._local = local
        send = self._pack(self._gather, lambda item, _: local[item])
        values = [float(marks[item]) for item, *_ in self._gather.send]
        send[self._gather_marks[0]] = host_tensor(values, self.dtype, self.device)
        self._received = self._all_to_all(send, self._gather)

    def gathered(self) -> dict[int, torch.Tensor]:
        """Wait for ``gather``; every item rooted here, whole (1-D, wire dtype), by item index; marks in ``marks_in``."""
        self._work.wait()
        fulls = {i: torch.empty(max(e for _, e in self.pieces[i]), dtype=self.dtype, device=self.device) for i in self.mine}
        for item, src, offset, numel in self._gather.recv:
            start, end = self.pieces[item][src]
            fulls[item][start:end] = self._received[offset : offset + numel]
        for i in self.mine:
            own = fulls[i][slice(*self.pieces[i][self.rank])]
            if self._local[i] is None:
                own.zero_()
            else:
                own.copy_(self._local[i])
        marks = self._received[self._gather_marks[1]].tolist()  # one device-to-host copy
        self.marks_in = {(item, src): mark != 0 for (item, src, _, _), mark in zip(self._gather.recv, marks)}
        return fulls

    def complete(self, item: int, has_local: bool) -> bool:
        """After ``gathered``: whether every rank holding a piece of ``item`` (rooted here) marked it.

        ``has_local`` is this rank's own mark (its piece does not travel). Muon, Shampoo and SOAP
        step a split item only when every holder has a gradient.
        """
        return all(
            has_local if rank == self.rank else self.marks_in[(item, rank)]
            for rank, piece in enumerate(self.pieces[item]) if _numel(piece)
        )

    def scatter(
        self, results: Mapping[int, Optional[torch.Tensor]], marks: Mapping[int, bool] | None = None, status: float = 0.0
    ) -> None:
        """Start sending each rank its piece of ``results[i]`` (1-D; None: zeros) for every item ``i`` rooted here.

        Also ``marks[i]`` with each piece, and ``status`` to every other rank.
        """
        def source(item: int, dest: int) -> Optional[torch.Tensor]:
            result = results[item]
            return None if result is None else result[slice(*self.pieces[item][dest])]

        send = self._pack(self._scatter, source)
        values = [float((marks or {}).get(item, False)) for item, *_ in self._scatter.send]
        values += [status] * len(self._scatter.send_status)
        send[self._scatter_marks[0]] = host_tensor(values, self.dtype, self.device)
        self._returned = self._all_to_all(send, self._scatter)

    def scattered(self) -> dict[int, torch.Tensor]:
        """Wait for ``scatter``; this rank's piece of every result rooted elsewhere (views into one buffer).

        The roots' marks in ``marks_out``, every peer's status in ``statuses``.
        """
        self._work.wait()
        slots = self._scatter.recv
        pieces = {item: self._returned[offset : offset + numel] for item, _, offset, numel in slots}
        values = self._returned[self._scatter_marks[1]].tolist()  # one device-to-host copy
        self.marks_out = {item: mark != 0 for (item, *_), mark in zip(slots, values)}
        self.statuses = {peer: status for (peer, _), status in zip(self._scatter.recv_status, values[len(slots):])}
        return pieces
