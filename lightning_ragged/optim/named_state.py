"""``RaggedOptimizer``: the base of the optimizers here — names, ragged metadata, named state dicts.

``state_dict()`` keys each parameter's state by its original name (the name
``fully_shard`` kept in ``param.ragged_shard.name``, or the name given through
``named_parameters()``) and adds, per name, the ragged metadata a sharded
checkpoint needs: the global shape, every rank's flat range, this rank's range and
the layout of each state entry ("flat": one value per local element; "blocks:B": one
value per block of B elements counted from the parameter's start; "tiles": a dict keyed
by global tile coordinates; "scalar"). ``load_state_dict`` accepts this rank's own
state or full (consolidated) state: a "flat" entry with the parameter's global numel
and a "blocks" entry with one value per global block are sliced to this rank's range,
and tiles this rank does not hold are ignored — so a consolidated optimizer state
loads at another world size.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from lightning_ragged.layout.ragged_shard import RaggedShard, shard_of


class RaggedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose state is keyed by parameter names with ragged metadata.

    It is what ``lightning_ragged.checkpoint``'s ``NamedStateOptimizer`` protocol describes
    (``param_name``, ``state_layout``, a ``load_state_dict`` of named state), so
    checkpoints read its state without importing this package.
    """

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        self._param_names: dict[int, str] = {}  # filled by add_param_group, which torch's __init__ calls
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, naming the new parameters (every rank must add the same groups, in order).

        A name comes from the group's ``param_names`` (named parameters), else ``param.ragged_shard.name``,
        else ``param_<n>``; names are the keys of the state dict, so a repeated one is refused.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        names = group.get("param_names")
        taken = set(self._param_names.values())
        new: dict[int, str] = {}
        for index, param in enumerate(group["params"]):
            shard = getattr(param, "ragged_shard", None)
            if names:
                name = names[index]
            elif shard is not None:
                name = shard.name
            else:
                name = f"param_{len(self._param_names) + len(new)}"
            if name in taken:
                self.param_groups.pop()
                raise ValueError(f"parameter name {name!r} appears twice in {type(self).__name__}'s param groups")
            taken.add(name)
            new[id(param)] = name
        self._param_names.update(new)

    # ----------------------------------------------------------------- helpers
    def param_name(self, param: torch.Tensor) -> str:
        return self._param_names[id(param)]

    def shard(self, param: torch.Tensor) -> RaggedShard:
        return shard_of(param, self._param_names.get(id(param)))

    def group_of(self, param: torch.Tensor) -> dict[str, Any]:
        """The param group that holds ``param``."""
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise KeyError("parameter not in this optimizer")

    @staticmethod
    def evaluate_closure(closure: Callable[[], Any] | None) -> Any:
        """The loss of ``step``'s optional closure, evaluated with gradients enabled (None without one)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def state_layout(self, param: torch.Tensor) -> dict[str, str]:
        """Layout of each state entry of ``param`` ("flat", "blocks:B", "tiles", "scalar"); subclasses extend."""
        return {}

    def ragged_metadata(self, param: torch.Tensor) -> dict[str, Any]:
        shard = self.shard(param)
        return {
            "global_shape": tuple(shard.global_shape),
            "granularity": shard.granularity,
            "rank": shard.rank,
            "world_size": shard.world_size,
            "local_range": tuple(shard.local_range),
            "rank_ranges": tuple(tuple(r) for r in shard.rank_ranges),
            "state_layout": self.state_layout(param),
        }

    # ------------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        groups: list[dict[str, Any]] = []
        ragged: dict[str, Any] = {}
        for group in self.param_groups:
            saved = {key: value for key, value in group.items() if key not in ("params", "param_names")}
            saved["params"] = [self.param_name(p) for p in group["params"]]
            groups.append(saved)
            for param in group["params"]:
                name = self.param_name(param)
                ragged[name] = self.ragged_metadata(param)
                if param in self.state and self.state[param]:
                    state[name] = dict(self.state[param])
        return {"state": state, "param_groups": groups, "ragged": ragged}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "ragged" not in state_dict:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict expects the named format of its own state_dict() "
                "(keys 'state', 'param_groups', 'ragged')"
            )
        by_name = {self.param_name(p): p for group in self.param_groups for p in group["params"]}
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state has {len(saved_groups)} param groups, the optimizer {len(self.param_groups)}")
        for saved, group in zip(saved_groups, self.param_groups):
            mine = [self.param_name(p) for p in group["params"]]
            if list(saved["params"]) != mine:
                raise ValueError(f"param group mismatch: saved {list(saved['params'])}, optimizer has {mine}")
        state = {}  # everything is checked before the optimizer changes
        for name, entries in state_dict["state"].items():
            if name not in by_name:
                raise KeyError(f"optimizer state for unknown parameter {name!r}")
            param = by_name[name]
            layout = self.state_layout(param)
            state[param] = {
                key: self._localize(param, key, value, layout.get(key, "scalar")) for key, value in entries.items()
            }
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
        self.state.clear()
        self.state.update(state)

    def _localize(self, param: torch.Tensor, key: str, value: Any, layout: str) -> Any:
        """This rank's part of one saved state entry (own-range or full-size), on the parameter's device."""
        shard = self.shard(param)
        if layout == "tiles":
            return self.localize_tiles(param, value)
        if not isinstance(value, torch.Tensor):
            return value
        value = value.to(param.device)
        if layout == "flat":  # the shard's 1-D shape, also where the rank holds the whole parameter
            if value.numel() == shard.local_numel:
                return value.reshape(-1).clone()
            if value.numel() == shard.numel:
                return shard.local_part(value).clone()
            raise ValueError(f"state {key!r} of {shard.name!r} has {value.numel()} values; expected {shard.local_numel} or {shard.numel}")
        if layout.startswith("blocks:"):
            block = int(layout.split(":", 1)[1])
            first, last = shard.local_blocks(block)
            if value.numel() == last - first:
                return value.clone()
            if value.numel() == math.ceil(shard.numel / block):
                return value[first:last].clone()
            raise ValueError(f"state {key!r} of {shard.name!r} has {value.numel()} blocks; expected {last - first}")
        return value.clone()

    def localize_tiles(self, param: torch.Tensor, tiles: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError
