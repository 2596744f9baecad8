"""Gather the pieces of split items to their roots and scatter the results back: one all-to-all each way.

An *item* is a structure an optimizer needs whole (a Muon matrix, a Shampoo or SOAP tile) that the
layout cut across the ranks of a shard process group. Every rank knows every item's pieces (each
rank's ``[start, end)`` in the item's own flattening) and its *root* (the rank that computes on
it), in the same order on every rank. ``SplitExchange`` moves them:

1. ``gather(local)`` sends this rank's piece of every item rooted elsewhere to that root in **one**
   asynchronous ``all_to_all_single`` (uneven splits: gloo and NCCL), cast to the wire dtype;
2. ``gathered()`` waits and returns every item rooted here whole (its own piece included);
3. ``scatter(results)`` sends each rank its piece of the roots' results, again one asynchronous
   ``all_to_all_single``;
4. ``scattered()`` waits and returns this rank's piece of every result computed elsewhere.

Work between 1 and 2 (owned items) and between 3 and 4 (the root's own pieces) overlaps the
transfers. Muon sends bf16 (Newton–Schulz casts to bf16 first), Shampoo and SOAP fp32 (their
statistics need it).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

Ranges = Sequence[tuple[int, int]]


def _numel(piece: tuple[int, int]) -> int:
    return piece[1] - piece[0]


class SplitExchange:
    """One step's gather-to-root and scatter-back of the split items of one shard process group."""

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
        world = len(pieces[0]) if pieces else 1
        self.world = world
        self.mine = [i for i, root in enumerate(roots) if root == rank]
        # elements this rank sends to each root (its pieces of their items), and receives from each rank
        self.to_roots = [
            0 if dest == rank else sum(_numel(p[rank]) for p, root in zip(pieces, roots) if root == dest)
            for dest in range(world)
        ]
        self.from_ranks = [0 if src == rank else sum(_numel(pieces[i][src]) for i in self.mine) for src in range(world)]
        self._local: Sequence[torch.Tensor] = ()
        self._received = self._returned = self._sent = torch.empty(0)
        self._work: Any = None

    def _all_to_all(self, chunks: list[torch.Tensor], out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        send = torch.cat(chunks) if chunks else torch.empty(0, dtype=self.dtype, device=self.device)
        received = torch.empty(sum(out_splits), dtype=self.dtype, device=self.device)
        self._work = dist.all_to_all_single(
            received, send, out_splits, in_splits, group=self.process_group, async_op=True
        )
        self._sent = send  # kept alive until the transfer finished
        return received

    def gather(self, local: Sequence[torch.Tensor]) -> None:
        """Start sending ``local[i]`` (this rank's 1-D piece of item ``i``) to item ``i``'s root."""
        self._local = local
        chunks = [
            local[i].to(self.dtype)
            for dest in range(self.world)
            if dest != self.rank
            for i, root in enumerate(self.roots)
            if root == dest and local[i].numel()
        ]
        self._received = self._all_to_all(chunks, self.from_ranks, self.to_roots)

    def gathered(self) -> dict[int, torch.Tensor]:
        """Wait for ``gather``; every item rooted here, whole (1-D, wire dtype), by item index."""
        self._work.wait()
        fulls = {}
        for i in self.mine:
            end = max(e for _, e in self.pieces[i])
            fulls[i] = torch.empty(end, dtype=self.dtype, device=self.device)
        cursor = 0
        for src in range(self.world):
            if src == self.rank:
                continue
            for i in self.mine:
                start, end = self.pieces[i][src]
                fulls[i][start:end] = self._received[cursor : cursor + end - start]
                cursor += end - start
        for i in self.mine:
            start, end = self.pieces[i][self.rank]
            fulls[i][start:end] = self._local[i]
        return fulls

    def scatter(self, results: Mapping[int, torch.Tensor]) -> None:
        """Start sending each rank its piece of ``results[i]`` (1-D, wire dtype) for every item ``i`` rooted here."""
        chunks = [
            results[i][slice(*self.pieces[i][dest])]
            for dest in range(self.world)
            if dest != self.rank
            for i in self.mine
            if _numel(self.pieces[i][dest])
        ]
        self._returned = self._all_to_all(chunks, self.to_roots, self.from_ranks)

    def scattered(self) -> dict[int, torch.Tensor]:
        """Wait for ``scatter``; this rank's piece of every result rooted elsewhere (views into one buffer)."""
        self._work.wait()
        pieces, cursor = {}, 0
        for root in range(self.world):
            if root == self.rank:
                continue
            for i, item_root in enumerate(self.roots):
                numel = _numel(self.pieces[i][self.rank])
                if item_root == root and numel:
                    pieces[i] = self._returned[cursor : cursor + numel]
                    cursor += numel
        return pieces
