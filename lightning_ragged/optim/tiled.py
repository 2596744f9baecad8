"""``TiledOptimizer``: the step Shampoo and SOAP share — per-tile math on each tile's owner, on any layout.

Tiles and owners are fixed when the optimizer is built (``optim/tiles.py``: the layout does not
change, and the owner keeps the tile's whole state, so ownership must not move between steps).
Per step and shard process group:

1. the gradient pieces of every split tile go to the tile's owner in **one** asynchronous
   ``all_to_all_single`` (fp32; ``optim/tile_exchange.py``); none when every tile is whole;
2. meanwhile each rank applies decoupled weight decay to its shards, steps its untiled
   parameters (SOAP's vectors) and computes the direction of every whole tile it holds from
   strided views of its local gradient, adding it to its local shard in place;
3. owners assemble their split tiles, compute their directions and send each rank its piece
   back in **one** asynchronous ``all_to_all_single`` (skipped on a step where no split tile
   moves its parameter: SOAP's first step only gathers statistics), applying their own pieces
   while it is in flight; then every rank applies the pieces it received.

So a step issues 0 collectives when every tile is whole (``shard_granularity="block"`` with
``block_rows`` a multiple of ``max_preconditioner_dim``, or ``"matrix"``) and 2 otherwise.
Subclasses give the math: ``_begin_param`` (per-parameter bookkeeping; the step size, or None
when the parameter does not move this step), ``_tile_direction`` (one tile's direction from its
whole gradient, updating the tile's state; None: no update, e.g. a tile seen for the first time
by SOAP) and, for parameters they do not tile, ``_step_untiled``.
Every rank must see the same parameters with gradients (true under ``fully_shard``), since the
split sizes follow from that list.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from lightning_ragged.optim.named_state import RaggedOptimizer
from lightning_ragged.optim.shards import local_flat
from lightning_ragged.optim.tile_exchange import SplitExchange
from lightning_ragged.optim.tiles import Tile, TilePlan, assign_roots, tiles_of

_Work = tuple[torch.Tensor, dict[str, Any], Optional[float], Tile]  # (param, group, step size, tile)


class TiledOptimizer(RaggedOptimizer):
    """A ``RaggedOptimizer`` whose state lives per tile, each tile on one owner rank."""

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self._tiles: dict[int, list[Tile]] = {}
        by_process_group: dict[int, list[Tile]] = {}
        for group in self.param_groups:
            for param in group["params"]:
                if self.is_tiled(param):
                    shard = self.shard(param)
                    tiles = tiles_of(shard, group["max_preconditioner_dim"])
                    self._tiles[id(param)] = tiles
                    by_process_group.setdefault(id(shard.process_group), []).extend(tiles)
        self.tile_plan: TilePlan = assign_roots(list(by_process_group.values()))

    # ------------------------------------------------------------- subclass API
    def is_tiled(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is preconditioned per tile (else ``_step_untiled`` steps it)."""
        return True

    def _begin_param(self, param: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> float | None:
        """Count the step in ``state`` (every rank, every parameter with a gradient); the step size or None."""
        raise NotImplementedError

    def _tile_direction(
        self, group: dict[str, Any], state: dict[str, Any], tile: Tile, grad: torch.Tensor
    ) -> torch.Tensor | None:
        """On the tile's owner: update ``state["tiles"][tile.tile_id]`` from the whole r×c gradient, return D."""
        raise NotImplementedError

    def _step_untiled(
        self, param: torch.Tensor, group: dict[str, Any], state: dict[str, Any], step_size: float | None
    ) -> None:
        """Step a parameter ``is_tiled`` refuses, element-wise on its local shard (after weight decay)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ tiles
    def tiles(self, param: torch.Tensor) -> list[Tile]:
        """Every tile of ``param`` (global order) with every rank's piece and its owner (``root``)."""
        return self._tiles.get(id(param), [])

    def state_layout(self, param: torch.Tensor) -> dict[str, str]:
        return {"step": "scalar", "tiles": "tiles"}

    def localize_tiles(self, param: torch.Tensor, tiles: dict[str, Any]) -> dict[str, Any]:
        """The saved tiles this rank owns under the current layout (all tiles are keyed globally)."""
        mine = {tile.tile_id for tile in self.tiles(param) if tile.root == tile.rank}
        return {
            tile_id: {key: value.to(param.device, copy=True) for key, value in entries.items()}
            for tile_id, entries in tiles.items()
            if tile_id in mine
        }

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self.evaluate_closure(closure)
        entries = []
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    entries.append((param, group, self._begin_param(param, group, self.state[param])))
        work: dict[int, list[_Work]] = {}
        grads: dict[int, torch.Tensor] = {}
        for param, group, step_size in entries:
            if id(param) in self._tiles:
                grad = local_flat(param.grad)
                grads[id(param)] = grad if grad.dtype == torch.float32 else grad.float()
                bucket = work.setdefault(id(self.shard(param).process_group), [])
                bucket += [(param, group, step_size, tile) for tile in self._tiles[id(param)]]
        exchanges = [self._start_gather(bucket, grads) for bucket in work.values()]
        for param, group, step_size in entries:
            if step_size is not None and group["weight_decay"]:
                local_flat(param).mul_(1 - group["lr"] * group["weight_decay"])
            if id(param) not in self._tiles:
                self._step_untiled(param, group, self.state[param], step_size)
        for bucket in work.values():
            for param, group, step_size, tile in bucket:
                if not tile.split and tile.root == tile.rank:
                    direction = self._tile_direction(group, self.state[param], tile, tile.whole(grads[id(param)]))
                    if step_size is not None and direction is not None:
                        tile.add_(local_flat(param), direction.reshape(-1), -step_size)
        for bucket, exchange in zip(work.values(), exchanges):
            if exchange is not None:
                self._finish_split([w for w in bucket if w[3].split], exchange)
        return loss

    def _start_gather(self, bucket: list[_Work], grads: dict[int, torch.Tensor]) -> SplitExchange | None:
        split = [w for w in bucket if w[3].split]
        if not split:
            return None
        tiles = [tile for *_, tile in split]
        param = split[0][0]
        exchange = SplitExchange([t.pieces for t in tiles], [t.root for t in tiles], tiles[0].rank,
                                 self.shard(param).process_group, torch.float32, grads[id(param)].device)
        exchange.gather([tile.read(grads[id(param)]) for param, _, _, tile in split])
        return exchange

    def _finish_split(self, split: list[_Work], exchange: SplitExchange) -> None:
        results = {}
        for i, full in exchange.gathered().items():
            param, group, step_size, tile = split[i]
            direction = self._tile_direction(group, self.state[param], tile, full.view(tile.shape))
            # a tile without a direction still sends zeros: every rank's split sizes follow from the step sizes
            results[i] = full.new_zeros(tile.numel) if direction is None else direction.reshape(-1)
        if all(step_size is None for _, _, step_size, _ in split):
            return  # nothing moves (SOAP's first step): no scatter
        exchange.scatter(results)
        for i, result in results.items():
            param, _, step_size, tile = split[i]
            if step_size is not None:
                tile.add_(local_flat(param), result[slice(*tile.pieces[tile.rank])], -step_size)
        for i, piece in exchange.scattered().items():
            param, _, step_size, tile = split[i]
            if step_size is not None:
                tile.add_(local_flat(param), piece, -step_size)
