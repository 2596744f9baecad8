"""fp8 all-gather: each rank quantizes its own tiles of the weights, the bytes are gathered, every rank dequantizes.

``fully_shard(..., fp8_all_gather=Float8AllGather())`` keeps the fp32 master shards and the
compute-dtype full buffer as before, but the all-gather of a DBuffer of 2-D ``nn.Linear``
weights carries fp8 (one byte per element) plus one fp32 scale per ``tile x tile`` tile
instead of the compute dtype: about half the bytes of a bf16 all-gather, a quarter of fp32.

Why sharding changes nothing: an fp8 weight is planned with shard boundaries only at
multiples of ``tile`` whole rows (:func:`tile_granularity`), so every tile (partial at the
right and bottom edges) lies whole on one rank, and that rank computes its scale
(``amax / finfo(dtype).max``) from exactly the values a single process would: no scale
crosses ranks, and the gathered full weight equals the single-process per-tile
quantize-dequantize bit for bit. Gradients are untouched (the compute dtype, then the
reduce dtype, as without fp8): fp8 is a straight-through rounding of the weights in forward.
The backward re-gather quantizes the master shard again; it did not change since forward,
so the result is identical.

One collective per DBuffer. Every rank sends ``rank_bytes`` (equal on all ranks)::

    [ S fp8 bytes: its segment, element for element | pad to 4 | its tiles' fp32 scales | unused ]

(S = the segment size in elements; the scales of each piece of a weight are its tile grid
row-major, pieces in buffer order; the scale area is as large as the rank holding the
most tiles needs). Dequantization writes every piece straight from the gathered bytes into
the full buffer (the parameters' storage), a few flat ops per piece, never a loop over tiles.
On CPU, e4m3 bytes become fp32 through a 256-entry table (torch's emulated e4m3 cast is ~4x
slower; the table is that cast of every byte, so the result is bit for bit the same).

Memory: the send chunk (``rank_bytes``) and the received bytes (``wire_bytes``) live from the
issue to the wait, beside the full buffer; the wait frees the chunk before it dequantizes and
the received bytes after. ``keep=True`` (meant for ``keep_cast_shard``) keeps the chunk instead, by the
rule of ``shard_cast.py`` (the shard's version counter, dropped at every optimizer step): the
backward re-gather, no_sync micro-batches and frozen weights then quantize once per step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from lightning_ragged.engine import collectives, storage
from lightning_ragged.engine.collectives import PendingCollective
from lightning_ragged.engine.grouping import parameter_slots
from lightning_ragged.engine.shard_cast import KeptWhileUnchanged
from lightning_ragged.layout.errors import RaggedShardBoundaryViolation
from lightning_ragged.layout.spec import Layout, is_positive_int

FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
"""The fp8 formats the all-gather can carry, by name (e4m3: max 448, finer; e5m2: max 57344, coarser)."""

ModuleFilter = Callable[[str, nn.Module], bool]


@dataclass(frozen=True)
class Float8AllGather:
    """The ``fp8_all_gather`` knob: which weights are all-gathered in fp8, and how they are scaled.

    ``tile``: one scale per ``tile x tile`` block of a weight (128 as DeepSeek-V3's and
    torchao's blockwise recipes). ``dtype``: ``torch.float8_e4m3fn`` (default) or
    ``torch.float8_e5m2``, or its name. ``module_filter(fqn, module) -> bool``: which
    ``nn.Linear`` modules take part (e.g. ``lambda fqn, m: fqn != "head"`` keeps the output head
    in the compute dtype); ``fqn`` is relative to the module ``fully_shard`` was called on.
    Only 2-D weights of ``nn.Linear`` modules are eligible (as torchao's ``Float8Linear``);
    a weight tied to another kind of module (an embedding) and everything else stay as they are.
    """

    tile: int = 128
    dtype: torch.dtype | str = torch.float8_e4m3fn
    module_filter: ModuleFilter | None = None

    def __post_init__(self) -> None:
        if not is_positive_int(self.tile):
            raise ValueError(
                f"Float8AllGather(tile={self.tile!r}): one scale covers tile x tile elements; pass a positive int "
                "such as tile=128"
            )
        dtype = FP8_DTYPES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
        if dtype not in FP8_DTYPES.values():
            raise ValueError(
                f"Float8AllGather(dtype={self.dtype!r}) is not an fp8 format; pass one of "
                f"{', '.join('torch.' + name for name in FP8_DTYPES)} (or its name, e.g. 'float8_e4m3fn')"
            )
        object.__setattr__(self, "dtype", dtype)
        if self.module_filter is not None and not callable(self.module_filter):
            raise TypeError(
                f"Float8AllGather(module_filter={self.module_filter!r}) must be a callable (fqn, module) -> bool "
                "or None (every nn.Linear weight)"
            )


def check_fp8_all_gather(value: object) -> None:
    """``fp8_all_gather`` must be a :class:`Float8AllGather` or None (``TypeError`` naming the fix)."""
    if value is not None and not isinstance(value, Float8AllGather):
        raise TypeError(
            f"fp8_all_gather={value!r} must be a lightning_ragged.Float8AllGather or None; pass e.g. "
            "fp8_all_gather=Float8AllGather(tile=128) (from lightning_ragged import Float8AllGather)"
        )


def fp8_param_ids(root: nn.Module, config: Float8AllGather | None) -> set[int]:
    """``id`` of every parameter of ``root`` that is all-gathered in fp8 under ``config``.

    A 2-D, non-empty weight every one of whose owners is an ``nn.Linear`` (as its
    ``weight``) accepted by ``config.module_filter``: a Linear weight tied to an embedding
    is used as an embedding too, and stays in the compute dtype.
    """
    check_fp8_all_gather(config)
    if config is None:
        return set()
    chosen = set()
    slots = parameter_slots(root)
    for _, param in root.named_parameters():
        owners = slots.get(id(param), [])
        linear = owners and all(isinstance(m, nn.Linear) and attr == "weight" for _, m, attr in owners)
        if linear and param.dim() == 2 and param.numel() > 0 and all(
            config.module_filter is None or config.module_filter(name, m) for name, m, _ in owners
        ):
            chosen.add(id(param))
    return chosen


def tile_granularity(granularity: int, param: torch.Tensor, tile: int) -> int:
    """The granularity an fp8 weight is planned with: cuts at multiples of both the policy's
    ``granularity`` and ``tile`` whole rows, so no tile is ever cut (at most the whole tensor)."""
    return min(math.lcm(granularity, tile * param.shape[1]), param.numel())


# ------------------------------------------------------------------ per-tile math
def _split(length: int, tile: int) -> list[tuple[slice, slice, int, int]]:
    """One axis in whole tiles and a partial last one: (elements, tile indices, tiles, elements per tile)."""
    whole, rest = divmod(length, tile)
    parts = [(slice(0, whole * tile), slice(0, whole), whole, tile)] if whole else []
    if rest:
        parts.append((slice(whole * tile, length), slice(whole, whole + 1), 1, rest))
    return parts


def _regions(shape: tuple[int, int], tile: int) -> list[tuple[tuple[slice, slice], tuple[slice, slice], tuple]]:
    """At most four rectangles of equal tiles covering a matrix: (element box, tile box, 4-D tiled shape).

    A rectangle of ``nr x nc`` tiles of ``tr x tc`` elements is viewed as ``(nr, tr, nc, tc)``,
    so one reduction or broadcast handles all its tiles at once.
    """
    return [
        ((rows, cols), (tile_rows, tile_cols), (nr, tr, nc, tc))
        for rows, tile_rows, nr, tr in _split(shape[0], tile)
        for cols, tile_cols, nc, tc in _split(shape[1], tile)
    ]


def tile_grid(shape: tuple[int, int], tile: int) -> tuple[int, int]:
    """Tiles along each axis of a matrix (the last ones may be partial)."""
    return -(-shape[0] // tile), -(-shape[1] // tile)


def tile_scales(x: torch.Tensor, tile: int, fp8_max: float, out: torch.Tensor) -> None:
    """One fp32 scale per tile of the 2-D ``x`` into ``out`` (its tile grid): amax / fp8_max, 1 where amax is 0."""
    for box, tiles, shape in _regions(x.shape, tile):
        torch.amax(x[box].view(shape).abs(), dim=(1, 3), out=out[tiles])
    out.copy_(torch.where(out > 0, out / fp8_max, 1.0))


def quantize_into(out: torch.Tensor, x: torch.Tensor, scales: torch.Tensor, tile: int, fp8_max: float) -> None:
    """``out`` (fp8, shaped as ``x``) = ``x / scale`` of its tile, clamped to the format's range."""
    for box, tiles, shape in _regions(x.shape, tile):
        scale = scales[tiles].view(shape[0], 1, shape[2], 1)
        out[box].view(shape).copy_(torch.div(x[box].view(shape), scale).clamp_(-fp8_max, fp8_max))


def float32_table(dtype: torch.dtype) -> torch.Tensor:
    """fp8 byte -> its fp32 value, all 256 of them: torch's own cast of every byte (NaN encodings included)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)


def to_float32(q: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` (fp8, any strides) as fp32: ``q.float()``, or its bytes looked up in ``table`` (same bits, faster)."""
    if table is None:
        return q.float()
    index = q.view(torch.uint8).to(torch.int32).reshape(-1)  # a uint8 index would be read as a mask
    return table.index_select(0, index).view(q.shape)


def dequantize_into(
    out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, tile: int, table: torch.Tensor | None = None
) -> None:
    """``out`` (the compute dtype) = ``q`` (fp8) times its tile's scale, computed in fp32 and rounded once."""
    for box, tiles, shape in _regions(q.shape, tile):
        scale = scales[tiles].view(shape[0], 1, shape[2], 1)
        torch.mul(to_float32(q[box].view(shape), table), scale, out=out[box].view(shape))


# ------------------------------------------------------------------ one DBuffer
@dataclass(frozen=True)
class _Piece:
    """The whole rows of one weight that one rank holds (starting at a tile row), and where they are."""

    rank: int
    shape: tuple[int, int]
    """(rows of the piece, columns of the weight)."""
    segment: slice
    """Elements in the rank's segment (and fp8 bytes in its wire chunk)."""
    full: slice
    """Elements in the full buffer."""
    tiles: slice
    """Scales in the rank's scale area."""


class Fp8Gather:
    """One DBuffer's fp8 all-gather: its wire format, the quantization of this rank's pieces, the dequantization.

    Built once per DBuffer from its layout; refuses a layout that cuts a tile. ``keep``: keep the
    quantized chunk while the master shard is unchanged (``keep_cast_shard``'s rule, :class:`_KeptChunk`).
    """

    def __init__(
        self, layout: Layout, shapes: Mapping[str, torch.Size], rank: int, config: Float8AllGather,
        device: torch.device, keep: bool = False,
    ) -> None:
        self.tile, self.dtype, self.device = config.tile, config.dtype, torch.device(device)
        self.fp8_max = torch.finfo(config.dtype).max
        self.table = float32_table(self.dtype) if _table_is_faster(self.device, self.dtype) else None
        """fp8 byte -> fp32 for the dequantization, where that beats torch's cast (CPU, e4m3); else None."""
        self.source = _KeptChunk(self.quantize, keep)
        """Where the send chunk comes from: a fresh quantization, or the kept one (``source.made`` counts them)."""
        self.world_size, self.segment_size = layout.world_size, layout.segment_size
        pieces: list[_Piece] = []
        tiles_per_rank = []
        for k in range(layout.world_size):
            count = 0
            for name, start, end, offset in layout.local_pieces(k):
                rows, cols = shapes[name]
                _check_whole_tiles(name, (rows, cols), start, end, config.tile)
                shape = (-(-end // cols) - start // cols, cols)
                tiles = math.prod(tile_grid(shape, config.tile))
                begin = k * layout.segment_size + offset
                pieces.append(_Piece(k, shape, slice(offset, offset + end - start),
                                     slice(begin, begin + end - start), slice(count, count + tiles)))
                count += tiles
            tiles_per_rank.append(count)
        self._pieces = pieces
        self._own = [piece for piece in pieces if piece.rank == rank]
        self._scale_start = -(-layout.segment_size // 4) * 4
        self.rank_bytes = self._scale_start + 4 * max(tiles_per_rank)
        """Bytes every rank sends: its fp8 segment, padding to 4, the largest rank's scales."""
        self._padding = storage.padding(layout, layout.buffer_numel)

    @property
    def wire_bytes(self) -> int:
        """Bytes of one all-gather's output (what ``CommStats.all_gather_bytes`` counts, as for the plain gather)."""
        return self.world_size * self.rank_bytes

    @property
    def quantizations(self) -> int:
        """Chunks quantized so far (gathers that reused the kept chunk made none)."""
        return self.source.made

    def quantize(self, sharded: torch.Tensor) -> torch.Tensor:
        """This rank's wire chunk: its segment in fp8 and its tiles' scales, from the master segment ``sharded``."""
        chunk = torch.zeros(self.rank_bytes, dtype=torch.uint8, device=self.device)
        fp8 = chunk[: self.segment_size].view(self.dtype)
        scales = chunk[self._scale_start :].view(torch.float32)
        with torch.no_grad():
            for piece in self._own:
                x = sharded[piece.segment].view(piece.shape).float()
                grid = scales[piece.tiles].view(tile_grid(piece.shape, self.tile))
                tile_scales(x, self.tile, self.fp8_max, out=grid)
                quantize_into(fp8[piece.segment].view(piece.shape), x, grid, self.tile, self.fp8_max)
        return chunk

    def dequantize(self, gathered: torch.Tensor, full: torch.Tensor) -> None:
        """Every rank's pieces from the gathered chunks into ``full`` (the compute-dtype buffer); padding zeroed."""
        chunks = gathered.view(self.world_size, self.rank_bytes)
        fp8 = chunks[:, : self.segment_size].view(self.dtype)
        scales = chunks.view(torch.float32)[:, self._scale_start // 4 :]
        with torch.no_grad():
            for piece in self._pieces:
                grid = scales[piece.rank, piece.tiles].view(tile_grid(piece.shape, self.tile))
                q = fp8[piece.rank, piece.segment].view(piece.shape)
                dequantize_into(full[piece.full].view(piece.shape), q, grid, self.tile, self.table)
            for gap in self._padding:
                full[gap].zero_()

    def issue(
        self, full: torch.Tensor, sharded: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool,
        started: float, mode: str = "all_gather",
    ) -> PendingCollective:
        """Quantize (or reuse the kept chunk), start the one all-gather (``mode``: the DBuffer's ``gather_mode``);
        its wait also dequantizes into ``full``."""
        chunk = self.source.of(sharded)
        gathered = torch.empty(self.wire_bytes, dtype=torch.uint8, device=self.device)
        pending = collectives.all_gather(gathered, chunk, group, async_op, started, mode=mode)
        return _PendingFp8Gather(pending, gathered, lambda received: self.dequantize(received, full))


class _KeptChunk(KeptWhileUnchanged):
    """The send chunk of one fp8 DBuffer, kept by ``shard_cast.py``'s rule when ``keep``; made by a quantization."""

    def __init__(self, quantize: Callable[[torch.Tensor], torch.Tensor], keep: bool) -> None:
        super().__init__(keep)
        self._quantize = quantize

    def _make(self, sharded: torch.Tensor) -> torch.Tensor:
        return self._quantize(sharded)


class _PendingFp8Gather(PendingCollective):
    """An fp8 all-gather in flight: ``wait()`` finishes it, frees the send chunk, dequantizes, frees the bytes.

    The chunk is released as soon as the collective has read it (the wait; on a device, after compute
    waited the all-gather stream, ``streams.py`` rule 3), before the dequantization allocates its temporaries.
    """

    def __init__(
        self, pending: PendingCollective, gathered: torch.Tensor, finish: Callable[[torch.Tensor], None]
    ) -> None:
        super().__init__(pending.work, pending.started, *pending.keep_alive)
        self._gathered: torch.Tensor | None = gathered
        self._finish = finish

    def wait(self) -> float:
        super().wait()
        self.keep_alive = ()  # the send chunk (a kept one stays in ``Fp8Gather.source``)
        if self._gathered is not None:
            gathered, self._gathered = self._gathered, None  # the received bytes die with this call
            self._finish(gathered)
        return time.perf_counter() - self.started


def _table_is_faster(device: torch.device, dtype: torch.dtype) -> bool:
    """Measured on 1.2M elements (``benchmarks/fp8_bench.py``): on CPU the table beats torch's emulated e4m3
    cast several times and loses to its e5m2 cast (a shift); accelerators convert fp8 natively."""
    return device.type == "cpu" and dtype == torch.float8_e4m3fn


def _check_whole_tiles(name: str, shape: tuple[int, int], start: int, end: int, tile: int) -> None:
    """A rank's range of an fp8 weight must begin and end at whole tile rows (or the weight's ends)."""
    numel, unit = shape[0] * shape[1], tile * shape[1]
    for cut in (start, end):
        if 0 < cut < numel and cut % unit:
            raise RaggedShardBoundaryViolation(
                f"fp8 weight {name!r} (shape {shape}) is cut at flat offset {cut}, inside a {tile}x{tile} tile "
                f"(the fp8 all-gather needs cuts at multiples of {tile} rows = {unit} elements so each tile's scale "
                f"is computed on one rank); plan it with tile_granularity, or use Float8AllGather(tile=...) "
                f"that the layout's cuts respect"
            )
