"""``fully_shard``: apply ragged, structure-aware FSDP to an ``nn.Module`` in place.

Data flow per step (every group, ``reshard_after_forward=True``):

forward pre-hook   all-gather the group's DBuffers into their unsharded buffers (or wait for
                   the prefetch issued by the previous group) and prefetch the next group
forward post-hook  free the unsharded buffer; hook the outputs for backward
pre-backward       all-gather again, attach the flat gradient buffer, prefetch the group
                   that ran before this one
last gradient      reduce the flat gradient buffer asynchronously (at most one in flight),
                   free the unsharded buffer
end of backward    finish every reduction into the sharded gradients, reset

The optimizer sees ``module.parameters()``: 1-D views into each rank's sharded segment,
keyed by the original names, each carrying ``param.ragged_shard``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._pytree import tree_flatten, tree_map

from lightning_ragged.dbuffer import CommStats, DBuffer
from lightning_ragged.granularity import GranularityPolicy, resolve_granularity
from lightning_ragged.grouping import GroupSpec, parameter_slots, plan_groups, split_into_buckets
from lightning_ragged.planning import TensorSpec, plan
from lightning_ragged.shard_group import ShardGroup

DEFAULT_DBUFFER_SIZE = 256 * 2**20


class RaggedFSDPState:
    """Schedules the groups of one sharded model: hooks, prefetch, reductions, accumulation."""

    def __init__(
        self,
        root: nn.Module,
        groups: list[ShardGroup],
        root_group: ShardGroup,
        mp_policy: MixedPrecisionPolicy | None,
        stats: CommStats,
    ) -> None:
        self.root = root
        self.groups = groups
        self.root_group = root_group
        self.mp_policy = mp_policy
        self.stats = stats
        self.requires_gradient_sync = True
        self.forward_order: list[ShardGroup] = []
        self._in_backward = False
        self._in_flight: list[DBuffer] = []

    @property
    def all_groups(self) -> list[ShardGroup]:
        return [*self.groups, self.root_group]

    def buckets(self) -> Iterator[DBuffer]:
        for group in self.all_groups:
            yield from group.buckets

    # ----------------------------------------------------------------- forward
    def pre_forward(self, group: ShardGroup, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not group.is_root and group not in self.forward_order:
            self.forward_order.append(group)
        first_use = not group.is_unsharded  # the root group is triggered by every module holding it
        group.use_unsharded()
        if not self._in_backward and (first_use or not group.is_root):
            for bucket in group.buckets:
                bucket.release_unused_sharded_grad()
            self._prefetch(group, forward=True)
        return self._cast_inputs(args, kwargs)

    def post_forward(self, group: ShardGroup, output: Any) -> None:
        if torch.is_grad_enabled():
            self.hook_backward(group, output)
        if self._in_backward:
            return  # a recomputation (activation checkpointing) inside backward
        if group.reshard_after_forward or not torch.is_grad_enabled():
            group.reshard()

    def hook_backward(self, group: ShardGroup, output: Any) -> None:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _: self.pre_backward(group), mode="any")

    def _prefetch(self, group: ShardGroup, forward: bool) -> None:
        """Start the all-gather of the group expected to run after ``group`` (forward or backward).

        The root group runs first in forward and its head first in backward, so it
        prefetches the first block in forward and the last block in backward.
        """
        order = self.forward_order
        if not order:
            return
        if group.is_root:
            target = order[0] if forward else order[-1]
        elif group in order:
            index = order.index(group) + (1 if forward else -1)
            target = order[index] if 0 <= index < len(order) else None
        else:
            target = None
        if target is not None and not target.backward_prepared:
            target.unshard(async_op=True)

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        policy = self.mp_policy
        if policy is None or policy.param_dtype is None or not policy.cast_forward_inputs:
            return args, kwargs

        def cast(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(policy.param_dtype)
            return value

        return tree_map(cast, args), tree_map(cast, kwargs)

    # ---------------------------------------------------------------- backward
    def pre_backward(self, group: ShardGroup) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if group.backward_prepared:
            return  # already prepared by an earlier output hook of this backward
        group.prepare_backward()
        self._prefetch(group, forward=False)

    def grad_accumulated(self, group: ShardGroup, bucket: DBuffer, name: str, param: torch.Tensor) -> None:
        if group.mark_grad_accumulated(bucket, name, param):
            if self.requires_gradient_sync:
                self._reduce(bucket)
            group.reshard(only=bucket)

    def _reduce(self, bucket: DBuffer) -> None:
        """Issue one DBuffer's asynchronous reduction, finishing the previous ones first (at most one in flight)."""
        self._finish_in_flight()
        bucket.reduce_grad(async_op=True)
        self._in_flight.append(bucket)

    def _finish_in_flight(self) -> None:
        for bucket in self._in_flight:
            bucket.finish_reduce()
        self._in_flight.clear()

    def _end_of_backward(self) -> None:
        if self.requires_gradient_sync:  # buffers with unused parameters never reported ready
            for bucket in self.buckets():
                if bucket.has_unsharded_grad and not bucket.reduce_pending:
                    self._reduce(bucket)
        self._finish_in_flight()
        for group in self.all_groups:
            group.end_backward()
        self._in_backward = False

    # ------------------------------------------------------------------ public
    def reshard(self) -> None:
        """Free every unsharded buffer (e.g. after an evaluation forward that had no backward)."""
        for group in self.all_groups:
            group.reshard()


def fully_shard(
    module: nn.Module,
    *,
    process_group: dist.ProcessGroup | None = None,
    shard_granularity: GranularityPolicy = "row",
    block_rows: int = 128,
    dbuffer_size: int = DEFAULT_DBUFFER_SIZE,
    planning_algorithm: str = "optimal",
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    group_modules: Sequence[GroupSpec] | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    reduce_mode: str | None = None,
    alignment: int = 1,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters over ``process_group`` with ragged, structure-aware shards.

    Works in place and returns ``module``. Every rank must hold the same initial
    parameters (same seed). ``replicate_group`` (HSDP) additionally averages the
    sharded gradients across replicas. ``reduce_mode`` overrides the per-backend
    choice ("all_reduce" on gloo, "reduce_scatter" elsewhere). ``device`` places the
    buffers (required for a model on the meta device, whose shards start uninitialized).
    """
    if getattr(module, "_ragged_fsdp_state", None) is not None:
        raise ValueError(f"{type(module).__name__} is already sharded by lightning_ragged.fully_shard")
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed initialized (e.g. dist.init_process_group('gloo'))")
    world_size = dist.get_world_size(process_group)
    stats = CommStats()
    group_plans = plan_groups(module, group_modules, dbuffer_size)
    param_dtype = mp_policy.param_dtype if mp_policy is not None else None
    reduce_dtype = mp_policy.reduce_dtype if mp_policy is not None else None

    slots_by_param = parameter_slots(module)

    shard_groups = []
    for group_plan in group_plans:
        buckets, slots = [], []
        for bucket_params in (b for run in group_plan.runs for b in split_into_buckets(run, dbuffer_size)):
            specs = [
                TensorSpec(name, param.numel(), resolve_granularity(shard_granularity, name, param, block_rows))
                for name, param in bucket_params
            ]
            layout = plan(specs, world_size, algorithm=planning_algorithm, alignment=alignment)
            bucket = DBuffer(
                layout,
                bucket_params,
                process_group,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
                replicate_group=replicate_group,
                reduce_mode=reduce_mode,
                stats=stats,
                device=device,
            )
            buckets.append(bucket)
            for name, param in bucket_params:
                slots += [(owner, attr, bucket, name) for _, owner, attr in slots_by_param[id(param)]]
        shard_groups.append(ShardGroup(group_plan.name, group_plan.module, buckets, slots, reshard_after_forward))

    *groups, root_group = shard_groups
    state = RaggedFSDPState(module, groups, root_group, mp_policy, stats)
    for group in shard_groups:
        group.reshard()
        _install_group_hooks(state, group, module)
    module._ragged_fsdp_state = state
    return module


def _install_group_hooks(state: RaggedFSDPState, group: ShardGroup, root: nn.Module) -> None:
    """Forward hooks on the modules that trigger the group; grad hooks on its full parameters."""

    def pre_hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return state.pre_forward(group, args, kwargs)

    def post_hook(_module: nn.Module, _args: tuple, output: Any) -> None:
        state.post_forward(group, output)

    if group.is_root:
        # The root group has no module of its own: any module holding one of its parameters
        # (or the root's forward) unshards it; the root's forward end reshards it under no_grad.
        owners = list({id(m): m for m in [root, *(owner for owner, *_ in group.slots)]}.values())
        for owner in owners:
            owner.register_forward_pre_hook(pre_hook, with_kwargs=True)
            if owner is not root:
                owner.register_forward_hook(lambda _m, _a, output: state.hook_backward(group, output))
        root.register_forward_hook(post_hook)
    else:
        group.module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        group.module.register_forward_hook(post_hook)
    for bucket, name, param in group.unsharded_params():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(
                lambda p, b=bucket, n=name: state.grad_accumulated(group, b, n, p)
            )


def get_state(module: nn.Module) -> RaggedFSDPState:
    """The engine state ``fully_shard`` attached to ``module``."""
    state = getattr(module, "_ragged_fsdp_state", None)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not sharded; call lightning_ragged.fully_shard(module) first")
    return state


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn the gradient reduction off (accumulate unsharded gradients locally) or back on."""
    get_state(module).requires_gradient_sync = requires_gradient_sync


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate into the unsharded gradient buffers with no collective."""
    state = get_state(module)
    previous = state.requires_gradient_sync
    state.requires_gradient_sync = False
    try:
        yield
    finally:
        state.requires_gradient_sync = previous


def _sharded_keys(module: nn.Module) -> dict[str, tuple[DBuffer, str]]:
    """State-dict key of every sharded parameter -> (its DBuffer, its name in the DBuffer)."""
    by_id = {id(p): (bucket, name) for bucket in get_state(module).buckets() for name, p in bucket.sharded_params.items()}
    return {key: by_id[id(p)] for key, p in module.named_parameters(remove_duplicate=False) if id(p) in by_id}


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full, original-shape tensors for every state-dict key, on every rank (collective)."""
    keys = _sharded_keys(module)
    gathered = {id(bucket): bucket.gather_full() for bucket in get_state(module).buckets()}
    result = {}
    for key, value in module.state_dict().items():
        if key in keys:
            bucket, name = keys[key]
            value = gathered[id(bucket)][name]
        result[key] = value
    return result


def load_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy this rank's pieces of full tensors (keys as in ``full_state_dict``) into the shards."""
    per_bucket: dict[int, tuple[DBuffer, dict[str, torch.Tensor]]] = {}
    for key, (bucket, name) in _sharded_keys(module).items():
        per_bucket.setdefault(id(bucket), (bucket, {}))[1][name] = state_dict[key]
    for bucket, tensors in per_bucket.values():
        bucket.load_full(tensors)
