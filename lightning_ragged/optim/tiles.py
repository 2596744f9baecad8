"""Preconditioner tiles of a parameter, where their elements lie on the ranks, and who owns each.

Shampoo and SOAP view a parameter as a matrix (``shape[0]`` × the rest; a vector as one column)
cut into tiles of at most ``dim`` rows and columns counted from its start; tile ``"i,j"`` covers
rows ``[i·dim, (i+1)·dim)`` and columns ``[j·dim, (j+1)·dim)``. Flat (row-major) order visits a
tile's elements in the tile's own row-major order, so every rank's share of a tile is one
interval ``[start, end)`` of that order — a *piece*, as ``optim/tile_exchange.py`` moves them —
and lies in the rank's local flat shard as at most three strided blocks (a partial row, full
rows, a partial row), read and updated in place through ``as_strided`` views.

Every tile has one owner (``root``) per shard process group, set by ``optim/owners.py``'s
``OwnerPlan`` on ``eig_cost`` (r³ + c³): the rank holding a tile whole owns it (no communication),
split tiles go to the least-loaded rank. The owner keeps the tile's whole state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from lightning_ragged.layout.ragged_shard import RaggedShard
from lightning_ragged.optim.owners import Item

Piece = tuple[int, int]


def matrix_shape(global_shape: Sequence[int]) -> tuple[int, int]:
    """How Shampoo and SOAP view a parameter: (shape[0], prod(rest)); vectors and scalars as (numel, 1)."""
    if len(global_shape) >= 2:
        return int(global_shape[0]), math.prod(int(d) for d in global_shape[1:])
    return math.prod(int(d) for d in global_shape), 1


def eig_cost(shape: tuple[int, int], one_sided: bool) -> int:
    """Work of a tile's eigendecompositions, up to a constant: r³ + c³ (r³ with one factor)."""
    rows, cols = shape
    return rows**3 + (0 if one_sided else cols**3)


@dataclass
class Tile(Item):
    """One tile of one parameter: its place in the matrix, every rank's piece, its owner (``root``)."""

    tile_id: str  # "i,j", global coordinates: the key of its state
    row0: int
    col0: int
    shape: tuple[int, int]
    width: int  # columns of the parameter's matrix view
    pieces: tuple[Piece, ...]  # every rank's [start, end) in the tile's row-major order
    rank: int
    local_start: int  # flat index where this rank's shard of the parameter starts
    one_sided: bool  # a vector tile: one factor only
    root: int = -1
    index: int = -1  # position among its shard process group's tiles (the same on every rank)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """This rank's piece as 2-D strided views into its local flat shard (``flat``), in tile order."""
        start, end = self.pieces[self.rank]
        cols, base = self.shape[1], flat.storage_offset()
        blocks, q = [], start
        if q % cols and q < end:  # partial first row
            blocks.append((q, 1, min(end, (q // cols + 1) * cols) - q))
            q += blocks[-1][2]
        if (end - q) // cols:  # full rows
            blocks.append((q, (end - q) // cols, cols))
            q += blocks[-1][1] * cols
        if q < end:  # partial last row
            blocks.append((q, 1, end - q))
        views = []
        for first, rows, length in blocks:
            at = (self.row0 + first // cols) * self.width + self.col0 + first % cols - self.local_start
            views.append(flat.as_strided((rows, length), (self.width, 1), base + at))
        return views

    def whole(self, flat: torch.Tensor) -> torch.Tensor:
        """The tile as an r×c view into ``flat`` (this rank must hold it whole)."""
        (view,) = self._views(flat)
        return view

    def read(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's piece, 1-D in tile order (a copy)."""
        views = self._views(flat)
        return torch.cat([v.reshape(-1) for v in views]) if views else flat.new_empty(0)

    def add_(self, flat: torch.Tensor, values: torch.Tensor, alpha: float = 1.0) -> None:
        """``piece += alpha·values`` in place, ``values`` 1-D in tile order (this rank's piece)."""
        cursor = 0
        for view in self._views(flat):
            view.add_(values[cursor : cursor + view.numel()].view(view.shape), alpha=alpha)
            cursor += view.numel()

    def scale_(self, flat: torch.Tensor, factor: float) -> None:
        """``piece *= factor`` in place (this rank's piece: weight decay of a tile that steps)."""
        for view in self._views(flat):
            view.mul_(factor)


def tiles_of(shard: RaggedShard, dim: int) -> list[Tile]:
    """Every tile of the parameter (global order ``"0,0", "0,1", ...``), with every rank's piece."""
    rows, cols = matrix_shape(tuple(shard.global_shape))
    out = []
    for row0 in range(0, rows, dim):
        for col0 in range(0, cols, dim):
            shape = (min(dim, rows - row0), min(dim, cols - col0))
            pieces = tuple(_piece(start, end, row0, col0, shape, cols) for start, end in shard.rank_ranges)
            out.append(Tile(f"{row0 // dim},{col0 // dim}", row0, col0, shape, cols, pieces, shard.rank,
                            shard.local_range[0], cols == 1))
    return out


def _piece(start: int, end: int, row0: int, col0: int, shape: tuple[int, int], width: int) -> Piece:
    first, last = _before(start, row0, col0, shape, width), _before(end, row0, col0, shape, width)
    return (first, last) if last > first else (0, 0)


def _before(flat: int, row0: int, col0: int, shape: tuple[int, int], width: int) -> int:
    """How many of the tile's elements have a flat index below ``flat``."""
    row, col = divmod(flat, width)
    rows, cols = shape
    full = min(max(row - row0, 0), rows) * cols
    return full + (min(max(col - col0, 0), cols) if row0 <= row < row0 + rows else 0)
