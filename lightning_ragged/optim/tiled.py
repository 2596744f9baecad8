"""``TiledOptimizer``: the step Shampoo and SOAP share — per-tile math on each tile's owner, on any layout.

Tiles and owners are fixed when parameters join the optimizer (construction, ``add_param_group``;
``optim/tiles.py``, ``optim/owners.py``): the layout does not change, and the owner keeps the
tile's whole state, so ownership must not move between steps. Per step and shard process group:

1. the gradient pieces of every split tile go to the tile's owner in **one** asynchronous
   ``all_to_all_single`` (fp32; ``optim/tile_exchange.py``), each piece marked with whether its
   rank has a gradient (zeros when not); none when every tile is whole. Its sizes follow from
   the tiles alone, so every rank issues it whatever its gradients;
2. meanwhile each rank steps its untiled parameters (SOAP's vectors) and every whole tile it
   holds, from strided views of its local gradient, in place in its local shard;
3. owners step their split tiles and send each rank its piece of the update, marked with
   whether the tile stepped, plus a status (0, or a failed eigendecomposition) for every rank,
   in **one** asynchronous ``all_to_all_single``, applying their own pieces while it is in
   flight; then every rank applies the pieces marked stepped.

So a step issues 0 collectives when every tile is whole (``shard_granularity="block"`` with
``block_rows`` a multiple of ``max_preconditioner_dim``, or ``"matrix"``) and 2 otherwise.

**The tile is the unit** of the step: it *steps* — its state takes the gradient, its step count
advances, its elements get weight decay and the update — or it is left *untouched*, as torch
leaves a parameter whose ``grad`` is None. A whole tile steps when its rank has a gradient. A
split tile steps when every rank holding a piece of it has one (its statistics need the whole
gradient); otherwise it is untouched on every rank and the pieces that were sent are unused.
Under ``fully_shard`` ranks agree on which parameters have gradients, so all of a parameter's
tiles step or none do; with manual gradient edits they may not, and nothing hangs.

An eigendecomposition that fails in every precision (``optim/eigh.py``) is reported by the
subclass (``_report_failure``) and replaced by its fallback; the step finishes, and the failure
travels in the scatter's statuses, so every rank of the shard process group raises
``EigendecompositionError`` after its collectives (with no collective in the step, only the
failing rank knows, and raises).

Subclasses give the math: ``check_hyperparameters`` (a param group's values), ``_tile_update``
(one tile's update from its whole gradient, updating the tile's state; None: the tile does not
step, e.g. SOAP's first sight of a tile), ``tile_state_shapes`` (checked at load) and, for
parameters they do not tile, ``_step_untiled``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from lightning_ragged.optim.eigh import EigendecompositionError
from lightning_ragged.optim.named_state import RaggedOptimizer
from lightning_ragged.optim.shards import local_flat, shard_group_key
from lightning_ragged.optim.tile_exchange import SplitExchange
from lightning_ragged.optim.owners import OwnerPlan
from lightning_ragged.optim.tiles import Tile, eig_cost, tiles_of

_ELSEWHERE = -1.0  # status: this rank failed on a tile of another shard process group


@dataclass
class _ShardGroupTiles:
    """Every tile of one shard process group (the same list on every rank) and the exchange of its split ones."""

    key: int  # index in OwnerPlan.cost_per_rank
    tiles: list[tuple[torch.Tensor, Tile]] = field(default_factory=list)  # position = Tile.index
    whole: list[tuple[torch.Tensor, Tile]] = field(default_factory=list)  # the whole tiles this rank holds
    split: list[tuple[torch.Tensor, Tile]] = field(default_factory=list)  # position = item in the exchange
    exchange: Optional[SplitExchange] = None


class TiledOptimizer(RaggedOptimizer):
    """A ``RaggedOptimizer`` whose state lives per tile, each tile on one owner rank."""

    decay_before_update = True  # p·(1 − lr·wd) + U; False: (p + U)·(1 − lr·wd)
    failure_note = ""  # what a tile whose eigendecomposition failed did instead, and the fix (for the error)

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        self._tiles: dict[int, list[Tile]] = {}
        self._group_of: dict[int, dict[str, Any]] = {}
        self._shard_groups: dict[int, _ShardGroupTiles] = {}
        self._param_of: dict[int, torch.Tensor] = {}  # id(tile) -> its parameter
        self._failures: list[tuple[torch.Tensor, Tile, str]] = []  # this step's, on this rank
        self.tile_plan = OwnerPlan()
        self._building = True  # the groups torch's __init__ adds are tiled together once it returns
        super().__init__(params, defaults)
        self._building = False
        self._add_tiles(self.param_groups)

    # ------------------------------------------------------------- subclass API
    def check_hyperparameters(self, values: Mapping[str, Any]) -> None:
        """Refuse a param group's values (defaults merged in) with a ValueError naming the value and the fix.

        Here what every tiled optimizer has (subclasses check the rest after calling this).
        """
        self.check_positive_ints(values, ("max_preconditioner_dim", "precondition_frequency"))
        if not values["lr"] >= 0.0:
            raise ValueError(f"lr={values['lr']!r} is not supported; pass a learning rate >= 0")

    @staticmethod
    def check_positive_ints(values: Mapping[str, Any], names: tuple[str, ...]) -> None:
        for name in names:
            if not isinstance(values[name], int) or values[name] < 1:
                raise ValueError(f"{name}={values[name]!r} is not supported; pass an int >= 1")

    def is_tiled(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is preconditioned per tile (else ``_step_untiled`` steps it)."""
        return True

    def tile_state_shapes(self, tile: Tile) -> dict[str, tuple[int, ...]]:
        """The entries of a tile's state and their shapes (``()``: a scalar), checked when state is loaded."""
        raise NotImplementedError

    def _tile_update(
        self, group: dict[str, Any], tiles: dict[str, Any], tile: Tile, grad: torch.Tensor
    ) -> torch.Tensor | None:
        """On the tile's owner: step ``tiles[tile.tile_id]`` on the whole r×c gradient; the r×c increment U, or None."""
        raise NotImplementedError

    def _step_untiled(self, param: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Step a parameter ``is_tiled`` refuses, element-wise on its local shard (weight decay included)."""
        raise NotImplementedError

    def _report_failure(self, tile: Tile, error: EigendecompositionError) -> None:
        """Record that ``tile``'s eigendecomposition failed (the subclass fell back); the step raises at its end."""
        self._failures.append((self._param_of[id(tile)], tile, str(error)))

    # ------------------------------------------------------------------ tiles
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, its values checked and its tiles given owners (the same on every rank).

        Every rank must add the same groups in the same order (docs/optimizers.md: the one case where
        Lightning's ``BaseFinetuning`` does not); the new split tiles go to the least-loaded ranks,
        counting the tiles owned before.
        """
        self.check_hyperparameters({**self.defaults, **param_group})
        super().add_param_group(param_group)
        if not self._building:
            self._add_tiles(self.param_groups[-1:])

    def _add_tiles(self, groups: list[dict[str, Any]]) -> None:
        added: dict[int, list[Tile]] = {}
        for group in groups:
            for param in group["params"]:
                self._group_of[id(param)] = group
                if not self.is_tiled(param):
                    continue
                shard = self.shard(param)
                tiles = self._tiles[id(param)] = tiles_of(shard, group["max_preconditioner_dim"])
                key = shard_group_key(shard)
                if key not in self._shard_groups:
                    self._shard_groups[key] = _ShardGroupTiles(len(self._shard_groups))
                tiled = self._shard_groups[key]
                for tile in tiles:
                    tile.index = len(tiled.tiles)
                    tiled.tiles.append((param, tile))
                    self._param_of[id(tile)] = param
                added.setdefault(key, []).extend(tiles)
        for key, tiles in added.items():
            tiled = self._shard_groups[key]
            self.tile_plan.assign(tiled.key, tiles, lambda tile: eig_cost(tile.shape, tile.one_sided))
            tiled.whole = [(p, t) for p, t in tiled.tiles if not t.split and t.root == t.rank]
            tiled.split = [(p, t) for p, t in tiled.tiles if t.split]
            if tiled.split:
                param, tile = tiled.split[0]
                tiled.exchange = SplitExchange(
                    [t.pieces for _, t in tiled.split], [t.root for _, t in tiled.split], tile.rank,
                    self.shard(param).process_group, torch.float32, local_flat(param).device,
                )

    def tiles(self, param: torch.Tensor) -> list[Tile]:
        """Every tile of ``param`` (global order) with every rank's piece and its owner (``root``)."""
        return self._tiles.get(id(param), [])

    def state_layout(self, param: torch.Tensor) -> dict[str, str]:
        return {"tiles": "tiles"}

    # ------------------------------------------------------------------ loading
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``RaggedOptimizer.load_state_dict``, refusing state saved with another ``max_preconditioner_dim``."""
        for index, (saved, group) in enumerate(zip(state_dict.get("param_groups", []), self.param_groups)):
            dim = saved.get("max_preconditioner_dim", group["max_preconditioner_dim"])
            if dim != group["max_preconditioner_dim"]:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: param group {index} was saved with "
                    f"max_preconditioner_dim={dim!r}, this optimizer has max_preconditioner_dim="
                    f"{group['max_preconditioner_dim']!r}; the tiles (and every tile's state) follow from it: "
                    f"build the optimizer with max_preconditioner_dim={dim!r} to resume this state, or do not load it"
                )
        super().load_state_dict(state_dict)

    def localize_tiles(self, param: torch.Tensor, tiles: dict[str, Any]) -> dict[str, Any]:
        """The saved tiles this rank owns under the current layout, each checked against the tile geometry."""
        by_id = {tile.tile_id: tile for tile in self.tiles(param)}
        name = self.param_name(param)
        mine = {}
        for tile_id, entries in tiles.items():
            tile = by_id.get(tile_id)
            if tile is None:
                raise ValueError(
                    f"saved optimizer state of {name!r} has tile {tile_id!r}, which its global shape "
                    f"{tuple(self.shard(param).global_shape)} in tiles of max_preconditioner_dim="
                    f"{self._group_of[id(param)]['max_preconditioner_dim']} does not have (tiles "
                    f"{sorted(by_id)}); the state was saved for another parameter shape or tile size"
                )
            self._check_tile_state(name, tile, entries)
            if tile.root == tile.rank:
                mine[tile_id] = {
                    key: value.to(param.device, copy=True) if isinstance(value, torch.Tensor) else value
                    for key, value in entries.items()
                }
        return mine

    def _check_tile_state(self, name: str, tile: Tile, entries: Mapping[str, Any]) -> None:
        expected = self.tile_state_shapes(tile)
        if set(entries) != set(expected):
            raise ValueError(
                f"saved state of tile {tile.tile_id!r} of {name!r} has entries {sorted(entries)}, {type(self).__name__} "
                f"keeps {sorted(expected)}; load state saved by {type(self).__name__}"
            )
        for key, shape in expected.items():
            value = entries[key]
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
            if got != shape:
                raise ValueError(
                    f"saved {key!r} of tile {tile.tile_id!r} of {name!r} has shape {got}, the tile ({tile.shape[0]}x"
                    f"{tile.shape[1]}) needs {shape}: the state was saved for another parameter shape or tile size"
                )

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self.evaluate_closure(closure)
        self._failures = []
        grads: dict[int, torch.Tensor] = {}
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None and id(param) in self._tiles:
                    grad = local_flat(param.grad)
                    grads[id(param)] = grad if grad.dtype == torch.float32 else grad.float()
        groups = list(self._shard_groups.values())
        for tiled in groups:
            if tiled.exchange is not None:
                tiled.exchange.gather([tile.read(grads[id(p)]) if id(p) in grads else None for p, tile in tiled.split],
                                      [id(p) in grads for p, _ in tiled.split])
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None and id(param) not in self._tiles:
                    self._step_untiled(param, group, self.state[param])
        for tiled in groups:
            for param, tile in tiled.whole:
                if id(param) in grads:
                    update = self._update(param, tile, tile.whole(grads[id(param)]))
                    if update is not None:
                        self._apply(param, tile, update.reshape(-1))
        exchanged = [(tiled, self._split_updates(tiled, grads)) for tiled in groups if tiled.exchange is not None]
        for tiled, updates in exchanged:
            tiled.exchange.scatter(updates, {i: u is not None for i, u in updates.items()}, self._status(tiled))
        for tiled, updates in exchanged:
            for i, update in updates.items():
                param, tile = tiled.split[i]
                if update is not None and tile.piece_numel(tile.rank):
                    self._apply(param, tile, update[slice(*tile.pieces[tile.rank])])
            for i, piece in tiled.exchange.scattered().items():
                if tiled.exchange.marks_out[i]:
                    self._apply(*tiled.split[i], piece)
        self._raise_failures([(tiled, src, status) for tiled, _ in exchanged
                              for src, status in tiled.exchange.statuses.items() if status])
        return loss

    def _update(self, param: torch.Tensor, tile: Tile, grad: torch.Tensor) -> torch.Tensor | None:
        return self._tile_update(self._group_of[id(param)], self.state[param].setdefault("tiles", {}), tile, grad)

    def _split_updates(self, tiled: _ShardGroupTiles, grads: dict[int, torch.Tensor]) -> dict[int, Optional[torch.Tensor]]:
        """Gathered split tiles this rank owns: the flat update of each that steps (every holder has a gradient)."""
        exchange = tiled.exchange
        updates: dict[int, Optional[torch.Tensor]] = {}
        for i, full in exchange.gathered().items():
            param, tile = tiled.split[i]
            complete = exchange.complete(i, id(param) in grads)
            update = self._update(param, tile, full.view(tile.shape)) if complete else None
            updates[i] = None if update is None else update.reshape(-1)
        return updates

    def _apply(self, param: torch.Tensor, tile: Tile, values: torch.Tensor) -> None:
        """This rank's piece of a tile that stepped: weight decay and ``values`` (1-D, tile order)."""
        group = self._group_of[id(param)]
        flat, decay = local_flat(param), 1 - group["lr"] * group["weight_decay"]
        if decay != 1 and self.decay_before_update:
            tile.scale_(flat, decay)
        tile.add_(flat, values)
        if decay != 1 and not self.decay_before_update:
            tile.scale_(flat, decay)

    def _status(self, tiled: _ShardGroupTiles) -> float:
        """What this rank tells its peers: 0, 1 + the index of its first failed tile here, or ``_ELSEWHERE``."""
        for param, tile, _ in self._failures:
            if self._shard_groups[shard_group_key(self.shard(param))] is tiled:
                return 1.0 + tile.index
        return _ELSEWHERE if self._failures else 0.0

    def _raise_failures(self, remote: list[tuple[_ShardGroupTiles, int, float]]) -> None:
        """Raise on every rank that failed or heard of a failure: the step's collectives are done."""
        if not self._failures and not remote:
            return
        reports = []
        if self._failures:
            param, tile, error = self._failures[0]
            more = f" and {len(self._failures) - 1} more tiles" if len(self._failures) > 1 else ""
            reports.append(f"this rank ({tile.rank}) could not eigendecompose tile {tile.tile_id!r} of "
                           f"{self.param_name(param)!r}{more} ({error})")
        for tiled, src, status in remote:
            if status == _ELSEWHERE:
                reports.append(f"rank {src} could not eigendecompose a tile of another shard process group")
            else:
                param, tile = tiled.tiles[int(status) - 1]
                reports.append(f"rank {src} could not eigendecompose tile {tile.tile_id!r} of {self.param_name(param)!r}")
        raise EigendecompositionError(
            f"{type(self).__name__}.step: " + "; ".join(reports) + f". The step finished on every rank; {self.failure_note}"
        )
