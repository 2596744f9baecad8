"""``fully_shard``: apply ragged, structure-aware FSDP to an ``nn.Module`` in place.

Two ways to call it, as with torch's FSDP2:

* once on the model: every block of every stack (each ``nn.ModuleList``/``nn.Sequential``
  of blocks, or a block class repeated among siblings) becomes a group, the root group
  keeps the rest (embeddings, head, tied weights);
* FSDP2's pattern: ``fully_shard(block)`` for each block, then ``fully_shard(model)``:
  each call makes one group (the last call adopts the earlier ones); a list,
  ``fully_shard([model.norm, model.output])``, makes one group of several modules (torchtitan's
  norm and head, or a tied embedding and head), gathered when the first of them starts.

A group may be several consecutive blocks (``blocks_per_group``, lists in ``group_modules``,
or ``planning="auto"``, which asks ``layout/auto.py`` how many within a memory budget).

The optimizer sees ``module.parameters()``: 1-D views into each rank's sharded segment,
keyed by the original names, each carrying ``param.ragged_shard``. When groups unshard,
reduce and reshard is ``runtime.py``'s business.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_ragged.engine.auto_grouping import auto_groups
from lightning_ragged.engine.checks import check_flag, check_mp_policy
from lightning_ragged.engine.collectives import CommStats
from lightning_ragged.engine.dbuffer import DBuffer
from lightning_ragged.engine.fp8_gather import Float8AllGather, Fp8Gather, fp8_param_ids, tile_granularity
from lightning_ragged.engine.fsdp2_args import (
    check_reshard_after_forward, check_unsupported, groups_of_mesh, move_buffers, shard_device,
)
from lightning_ragged.engine.forward_hooks import install_hooks, refuse_forward_until_adopted
from lightning_ragged.engine.fsdp_module import make_fsdp_module, make_save_pretrained_gather, mark_managed
from lightning_ragged.engine.module_lists import ListedModules, listed_modules
from lightning_ragged.engine.partial_reshard import partial_group as partial_group_of
from lightning_ragged.layout.auto import AutoPlan
from lightning_ragged.layout.granularity import GranularityPolicy, check_block_rows, resolve_granularity
from lightning_ragged.engine.ownership import claim, refuse_sharded_twice
from lightning_ragged.engine.rank_agreement import require_same_model
from lightning_ragged.engine.grouping import (
    GroupSpec, ParamGroupPlan, group_name, parameter_slots, plan_groups, split_into_dbuffers, warn_split_blocks,
)
from lightning_ragged.layout.planner import ALGORITHMS, check_alignment, plan
from lightning_ragged.layout.spec import TensorSpec, is_positive_int
from lightning_ragged.engine.retired_params import retire
from lightning_ragged.engine.runtime import RaggedFSDPState, get_state
from lightning_ragged.engine.shard_group import ShardGroup
from lightning_ragged.engine.state_sync import BufferSync, sync_params_and_buffers
from lightning_ragged.engine.torch_grad_norm import route_torch_grad_norm
from lightning_ragged.engine.torch_grad_scaler import route_grad_scaler
from lightning_ragged.engine.whole_tensor_optimizers import refuse_whole_tensor_optimizers
from lightning_ragged.engine.torch_state_dict import install_state_dict_hooks

DEFAULT_DBUFFER_SIZE = 256 * 2**20
VIEW_ALIGNMENT_BYTES = 16
"""Default start alignment of every parameter view in a DBuffer (vectorized and fp8 kernels want 16 bytes)."""


def fully_shard(
    module: nn.Module | Sequence[nn.Module],
    *,
    process_group: dist.ProcessGroup | None = None,
    shard_granularity: GranularityPolicy = "row",
    block_rows: int = 128,
    dbuffer_size: int = DEFAULT_DBUFFER_SIZE,
    planning_algorithm: str = "optimal",
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    group_modules: Sequence[GroupSpec] | None = None,
    blocks_per_group: int = 1,
    planning: str | None = None,
    memory_budget_bytes: int | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    reduce_mode: str | None = None,
    gather_mode: str | None = None,
    alignment: int | None = None,
    device: torch.device | str | None = None,
    sync_module_states: bool = True,
    broadcast_buffers: bool = True,
    keep_last_unsharded: bool = False,
    max_inflight_all_gathers: int = 1,
    keep_cast_shard: bool = False,
    fp8_all_gather: Float8AllGather | None = None,
    mesh: Any = None,
    offload_policy: Any = None,
    ignored_params: set[nn.Parameter] | None = None,
    shard_placement_fn: Callable[..., Any] | None = None,
) -> nn.Module | Sequence[nn.Module]:
    """Shard ``module``'s parameters over ``process_group`` with ragged, structure-aware shards.

    Works in place and returns ``module`` (its class becomes a subclass of
    :class:`~lightning_ragged.engine.fsdp_module.FSDPModule`, as with FSDP2). Without a seed shared
    by all ranks the ranks' initial parameters differ: shard a model built identically.
    ``reshard_after_forward``: True frees full parameters after forward, False keeps them
    for backward, an int ``n`` keeps 1/n of them so backward re-gathers inside groups of
    ``n`` consecutive ranks (e.g. a node). ``replicate_group`` (HSDP) additionally averages
    the sharded gradients across replicas. ``reduce_mode`` overrides the per-backend choice
    ("pairwise" on gloo for CPU tensors, "all_reduce" in place for gloo on device tensors, "reduce_scatter"
    elsewhere), ``gather_mode`` the all-gather's ("pairwise" on gloo for CPU tensors, "all_gather" elsewhere).
    ``alignment``: every parameter
    view starts at a multiple of this many elements (default: 16 bytes). ``device`` places
    the shards and the module's buffers; without it a model on the meta device gets its shards, uninitialized,
    on the mesh's or backend's device (then ``to_empty`` leaves them in place and ``summon_full_params``
    initializes whole tensors), and a CPU model under an accelerator's mesh or backend (NCCL) moves to its
    current device, as FSDP2 moves it.
    ``sync_module_states`` (FSDP1's name; default True, as DDP): every rank starts from rank 0's
    parameters (one flat scatter per DBuffer; HSDP replicas take replica 0's) and buffers, so
    an unseeded init is not a patchwork of every rank's; skipped on the meta device.
    ``broadcast_buffers`` (DDP's name and default): broadcast the buffers (e.g. BatchNorm
    running statistics) from rank 0 before each root forward that follows a synchronized
    training step; nothing is issued for a model without buffers. See ``state_sync.py``.
    ``keep_last_unsharded``: the group whose forward ran last in the previous step is not
    resharded after its forward (its backward runs first and would re-gather it at once):
    one all-gather fewer per step from the second step on, at the cost of that group's full
    buffer held through the loss. ``max_inflight_all_gathers`` (default 1, as FSDP2): how many
    groups, in the recorded order, are all-gathered ahead of the running one; each costs one
    more full buffer alive (explicit ``set_modules_to_*_prefetch`` lists are taken as given).
    ``keep_cast_shard``: with an ``mp_policy.param_dtype`` other than the parameters' dtype, keep the
    cast of this rank's shard from the forward all-gather for the backward re-gather (and no_sync
    micro-batches, evaluation forwards) until the shard changes or an optimizer steps: one cast per
    DBuffer per step instead of two, for the cast shards held until the step; see ``shard_cast.py``.
    ``group_modules``: block classes, modules, or lists of consecutive sibling modules that each
    form one group (all-gathered at the first one's forward, done with after the last one's;
    it must run them in module order); ``blocks_per_group=k`` joins every stack's blocks k at a
    time (the last group may be shorter). ``planning="auto"`` chooses the blocks per group and
    ``dbuffer_size`` with ``layout.auto.auto_plan`` within ``memory_budget_bytes`` per rank, at the
    replicate degree the caller's ``replicate_group`` gives (HSDP needs the caller's process
    groups: search the degree with the planner CLI or the strategy); ``get_state(m).auto_plan``
    keeps the plan. ``fp8_all_gather=Float8AllGather(tile=128)``: ``nn.Linear`` weights are all-gathered
    as fp8 with one scale per tile, computed on the rank that holds the tile (their DBuffers are
    their own, cut only between tile rows), and dequantized into the compute dtype; see ``fp8_gather.py``.
    On a single rank (a ``process_group`` of one rank and no ``replicate_group``, e.g. ``devices=1``)
    nothing is communicated or copied: the full parameters are the shards themselves (with a
    ``param_dtype``, their cast), the gradient buffer becomes the sharded gradient, and
    ``get_state(m).stats`` counts no collective; fp8 all-gathers and HSDP keep their paths. FSDP2's ``mesh``
    (1-D, or 2-D HSDP: replicate, shard) gives the process groups; ``reshard_after_forward=None`` (the default,
    FSDP2's) is True but keeps the root's own groups across no-grad forwards, as FSDP2 keeps its root;
    ``offload_policy``, ``ignored_params`` and ``shard_placement_fn`` are refused with what to use (``fsdp2_args.py``).
    ``module`` may be a list of modules, as FSDP2's: one group of all their parameters, all-gathered when the
    first of them starts its forward and done with after the last one ends it (any modules of the model, e.g.
    ``[model.norm, model.output]`` or a tied ``[model.tok_embeddings, model.output]``); each becomes an
    ``FSDPModule`` acting on that group. Shard the model that contains them afterwards (``fully_shard(model)``,
    FSDP2's order): its call adopts the group and runs it. Returns ``module`` as given.
    """
    listed = listed_modules(module, group_modules, blocks_per_group, planning)
    target = ListedModules(listed) if listed is not None else module
    label = type(module).__name__ if listed is None else f"[{', '.join(type(m).__name__ for m in listed)}]"
    for each in listed or [module]:
        existing = each.__dict__.get("_ragged_fsdp_state")
        if existing is not None:
            where = "it is" if existing.root is each else f"it is inside {type(existing.root).__name__}, which is"
            raise ValueError(
                f"{type(each).__name__} cannot be sharded: {where} already sharded by lightning_ragged.fully_shard. "
                "Shard blocks first, then their parent (the FSDP2 order)"
            )
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed initialized (e.g. dist.init_process_group('gloo'))")
    process_group, replicate_group = groups_of_mesh(mesh, process_group, replicate_group)
    check_unsupported(offload_policy, ignored_params, shard_placement_fn)
    device = shard_device(target, mesh, process_group, device)
    move_buffers(target, device)
    world_size = dist.get_world_size(process_group)
    reshard_after_forward = check_reshard_after_forward(reshard_after_forward, world_size)
    flags = (("sync_module_states", sync_module_states), ("broadcast_buffers", broadcast_buffers),
             ("keep_last_unsharded", keep_last_unsharded), ("keep_cast_shard", keep_cast_shard))
    for knob, flag in flags:
        check_flag(knob, flag)
    check_mp_policy(mp_policy)
    check_block_rows(block_rows)  # also where the policy does not use it, as the README promises
    if planning_algorithm not in ALGORITHMS:
        raise ValueError(f"planning_algorithm={planning_algorithm!r} is unknown; use one of {ALGORITHMS}")
    if alignment is not None:  # 0 was taken as None (16 bytes)
        check_alignment(alignment)
    if isinstance(max_inflight_all_gathers, bool) or not isinstance(max_inflight_all_gathers, int) \
            or max_inflight_all_gathers < 0:
        raise ValueError(
            f"max_inflight_all_gathers={max_inflight_all_gathers!r} must be an int >= 0 (0: no prefetch, "
            "1: one group ahead as FSDP2, more: more overlap for one more full buffer each)"
        )
    require_same_model(target, label, [process_group] + ([replicate_group] if replicate_group is not None else []), dict(
        shard_granularity=shard_granularity, block_rows=block_rows, dbuffer_size=dbuffer_size, alignment=alignment,
        planning_algorithm=planning_algorithm, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
        group_modules=group_modules, blocks_per_group=blocks_per_group, planning=planning,
        memory_budget_bytes=memory_budget_bytes, reduce_mode=reduce_mode, gather_mode=gather_mode, flags=flags), device)
    fp8_ids = fp8_param_ids(target, fp8_all_gather)
    children = _child_states(target)
    if children and (group_modules is not None or blocks_per_group != 1 or planning is not None):
        raise ValueError(
            "group_modules, blocks_per_group and planning cannot be combined with blocks sharded by earlier "
            "fully_shard calls: either shard the blocks yourself (FSDP2 pattern) or let one call group them"
        )
    param_dtype = mp_policy.param_dtype if mp_policy is not None else None
    reduce_dtype = mp_policy.reduce_dtype if mp_policy is not None else None
    auto = None
    if planning is not None or memory_budget_bytes is not None:
        auto, group_modules = _auto_plan(
            target, planning, memory_budget_bytes, group_modules, blocks_per_group, world_size, replicate_group,
            shard_granularity, block_rows, alignment, planning_algorithm, param_dtype, dbuffer_size, reduce_dtype,
        )
        dbuffer_size = auto.dbuffer_size
    stats = CommStats()
    adopted: list[ShardGroup] = []
    paths = {id(m): name for name, m in target.named_modules()}
    for child in children:
        outside = [getattr(type(m), "_ragged_original", type(m)).__name__ for m in child.called_on if id(m) not in paths]
        if outside:
            raise ValueError(
                f"{label} cannot adopt the group of an earlier fully_shard call on a list: its modules {outside} are "
                "not inside it. Shard the model that contains every module of the list (FSDP2's order: blocks and "
                "lists first, then their common parent)"
            )
        world = dist.group.WORLD
        other = next((b for g in child.all_groups for b in g.dbuffers
                      if (b.process_group or world, b.replicate_group) != (process_group or world, replicate_group)),
                     None)
        if other is not None:  # the root's collectives (e.g. the used-gradient flags) span every group at once
            raise ValueError(
                f"{paths[id(child.root)]!r} was sharded over other process groups than this fully_shard call's: "
                "pass the same process_group and replicate_group to every fully_shard call of one model"
            )
    warn_split_blocks(children, target, label)
    taken = {id(p) for child in children for group in child.all_groups for _b, _n, p in _group_params(group)}
    claimed = refuse_sharded_twice(target, taken, label)  # before anything of the children is changed
    param_names = {id(param): name for name, param in target.named_parameters()}
    for child in children:
        for handle in child.handles:
            handle.remove()
        for group in child.all_groups:
            group.adopt(group_name([(paths[id(member)], member) for member in group.members]), param_names)
            for dbuffer in group.dbuffers:
                dbuffer.stats = stats
        adopted += child.all_groups
    if children or listed is not None:
        own = ParamGroupPlan("root", module) if listed is None else \
            ParamGroupPlan(label, listed[0], members=listed)
        for index, (name, param) in enumerate(target.named_parameters()):
            if id(param) not in taken:
                own.add(index, name, param)
        group_plans = [own] if own.runs or listed is None else []
    else:
        group_plans = plan_groups(module, group_modules, dbuffer_size, blocks_per_group)

    slots_by_param = parameter_slots(target)
    partial_group = partial_group_of(process_group, reshard_after_forward)

    new_groups, meta_built = [], []
    built: list[tuple[DBuffer, list[tuple[str, nn.Parameter]]]] = []
    for group_plan in group_plans:
        dbuffers, slots = [], []
        for dbuffer_params in _dbuffer_params(group_plan, dbuffer_size, lambda p: id(p) in fp8_ids):
            first = dbuffer_params[0][1]
            fp8 = fp8_all_gather if id(first) in fp8_ids else None
            real = not first.is_complex()  # a real param/reduce dtype would drop a complex tensor's imaginary part
            unit = _view_unit(alignment, first.dtype, param_dtype if real else None)
            granularities = [resolve_granularity(shard_granularity, name, p, block_rows) for name, p in dbuffer_params]
            if fp8 is not None:  # no tile of an fp8 weight is cut: its scale is computed on one rank
                granularities = [tile_granularity(g, p, fp8.tile) for g, (_, p) in zip(granularities, dbuffer_params)]
            specs = [TensorSpec(name, p.numel(), g) for g, (name, p) in zip(granularities, dbuffer_params)]
            layout = plan(specs, world_size, algorithm=planning_algorithm, alignment=unit)
            dbuffer = DBuffer(
                layout,
                dbuffer_params,
                process_group,
                param_dtype=param_dtype if real else None,
                reduce_dtype=reduce_dtype if real else None,
                replicate_group=replicate_group,
                reduce_mode=reduce_mode,
                gather_mode=gather_mode,
                stats=stats,
                device=device,
                keep_cast_shard=keep_cast_shard,
            )
            if partial_group is not None:
                dbuffer.set_partial_group(partial_group, reshard_after_forward)
            if fp8 is not None:
                shapes = {name: p.shape for name, p in dbuffer_params}
                dbuffer.fp8_gather = Fp8Gather(layout, shapes, dbuffer.rank, fp8, dbuffer.device, keep=keep_cast_shard)
            dbuffers.append(dbuffer)
            built.append((dbuffer, dbuffer_params))
            for name, param in dbuffer_params:
                slots += [(owner, attr, dbuffer, name) for _, owner, attr in slots_by_param[id(param)]]
        is_root = group_plan.module is None or group_plan.module is module
        group = ShardGroup(
            group_plan.name, group_plan.module or module, dbuffers, slots, reshard_after_forward, is_root=is_root,
            members=group_plan.members or None,
        )
        group.mp_policy = mp_policy
        group.root_part = is_root or (group_modules is None and not (children or group.unshard_in_backward))
        if any(p.is_meta for run in group_plan.runs for _, p in run):
            meta_built.append(group)
        called_on = is_root or listed is not None  # FSDP2 casts the outputs of the modules a call was given
        group.output_dtype = mp_policy.output_dtype if called_on and mp_policy is not None else None
        new_groups.append(group)

    if sync_module_states:
        sync_params_and_buffers(target, iter(built), process_group, replicate_group)
    retire((name, original, dbuffer.unsharded_params[name], dbuffer.sharded_params[name])
           for dbuffer, dbuffer_params in built for name, original in dbuffer_params)
    del built
    state = RaggedFSDPState(target, _in_module_order(target, adopted + new_groups), stats)
    state.called_on = listed or [module]
    state.buffer_sync = BufferSync(target, process_group, replicate_group) if broadcast_buffers else None
    state.keep_last_unsharded = keep_last_unsharded
    state.auto_plan = auto
    # one call that split its module by its stacks (FSDP2's per-block call on a MoE block splits it by expert)
    state.split_by_stacks = not children and listed is None and group_modules is None and auto is None \
        and blocks_per_group == 1 and len(new_groups) > 1
    state.max_inflight_all_gathers = max_inflight_all_gathers
    for group in new_groups:
        group.reshard()
    for group in meta_built:
        group.mark_uninitialized()
    if listed is None:
        install_hooks(state)
    else:
        refuse_forward_until_adopted(state, label)
    install_state_dict_hooks(new_groups)
    route_torch_grad_norm(dbuffer for group in new_groups for dbuffer in group.dbuffers)
    route_grad_scaler()
    refuse_whole_tensor_optimizers()
    for member in (member for group in state.all_groups for member in group.members):
        make_fsdp_module(member)  # every member of a group of several modules, as FSDP2's fully_shard([...])
    if listed is None:
        make_fsdp_module(module)
    make_save_pretrained_gather(target)
    mark_managed(target, state)
    claim(label, claimed + [p for group in new_groups for _b, _n, p in _group_params(group)])
    return module


def _auto_plan(
    module: nn.Module, planning: Any, budget: Any, group_modules: Sequence[GroupSpec] | None, blocks_per_group: int,
    world_size: int, replicate_group: dist.ProcessGroup | None, granularity: GranularityPolicy, block_rows: int,
    alignment: int | None, algorithm: str, param_dtype: torch.dtype | None, dbuffer_size: int,
    reduce_dtype: torch.dtype | None,
) -> tuple[AutoPlan, list[list[nn.Module]]]:
    """``planning="auto"``: the auto-planner's plan and the groups it chose (see ``auto_grouping.py``)."""
    if planning != "auto":
        raise ValueError(
            f"planning={planning!r} is unknown: pass planning='auto' with memory_budget_bytes to choose the "
            "blocks per group automatically, or leave both None (memory_budget_bytes only applies to 'auto')"
        )
    if blocks_per_group != 1 or any(isinstance(spec, (list, tuple)) for spec in group_modules or ()):
        raise ValueError(
            f"planning='auto' chooses the blocks per group itself: drop blocks_per_group={blocks_per_group!r} "
            "and lists in group_modules (single modules or classes are fine)"
        )
    replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
    return auto_plan_for(
        module, world_size * replicas, replicas, budget, granularity=granularity, block_rows=block_rows,
        alignment=alignment, algorithm=algorithm, param_dtype=param_dtype, dbuffer_size=dbuffer_size,
        group_modules=group_modules, reduce_dtype=reduce_dtype,
    )


def auto_plan_for(
    module: nn.Module, world_size: int, replicate_degree: int | None, memory_budget_bytes: Any, *,
    granularity: GranularityPolicy = "row", block_rows: int = 128, alignment: int | None = None,
    algorithm: str = "optimal", param_dtype: torch.dtype | None = None, dbuffer_size: int = DEFAULT_DBUFFER_SIZE,
    group_modules: Sequence[GroupSpec] | None = None, reduce_dtype: torch.dtype | None = None,
) -> tuple[AutoPlan, list[list[nn.Module]]]:
    """The auto-planner on ``module`` as ``fully_shard`` would group it: the plan and its groups.

    ``replicate_degree=None`` lets it choose the HSDP degree too (the strategy's
    ``replicate_degree="auto"`` does, before it builds the process groups); an int fixes it.
    """
    if not is_positive_int(memory_budget_bytes):
        raise ValueError(
            f"memory_budget_bytes={memory_budget_bytes!r}: planning='auto' needs the per-rank memory budget in "
            "bytes, e.g. memory_budget_bytes=80 * 10**9"
        )
    first = next(iter(module.parameters()), None)
    unit = _view_unit(alignment, first.dtype if first is not None else torch.float32, param_dtype)
    return auto_groups(
        module, group_modules, world_size=world_size, replicate_degree=replicate_degree,
        memory_budget_bytes=memory_budget_bytes, granularity=granularity, block_rows=block_rows, alignment=unit,
        algorithm=algorithm, param_dtype=param_dtype, dbuffer_size=dbuffer_size, reduce_dtype=reduce_dtype,
    )


def _child_states(module: nn.Module) -> list[RaggedFSDPState]:
    """States of earlier ``fully_shard`` calls on descendants or lists of them (the FSDP2 pattern), in module order."""
    states = []
    for submodule in module.modules():
        state = submodule.__dict__.get("_ragged_fsdp_state")
        if state is not None and any(m is submodule for m in state.called_on) and state not in states:
            states.append(state)
    return states


def _group_params(group: ShardGroup) -> Iterator[tuple[DBuffer, str, nn.Parameter]]:
    for dbuffer in group.dbuffers:
        for name in dbuffer.sharded_params:
            yield dbuffer, name, dbuffer.sharded_params[name]
            yield dbuffer, name, dbuffer.unsharded_params[name]


def _in_module_order(root: nn.Module, groups: list[ShardGroup]) -> list[ShardGroup]:
    """Block groups in module order, the root's group last."""
    position = {id(m): index for index, m in enumerate(root.modules())}
    return sorted(groups, key=lambda g: (g.is_root, position.get(id(g.module), 0)))


def _dbuffer_params(
    group_plan: ParamGroupPlan, dbuffer_size: int, apart: Callable[[nn.Parameter], bool]
) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """DBuffers of one group: per run, trainable and frozen parameters apart, each split by size and ``apart``.

    Frozen parameters get DBuffers of their own, which never allocate a gradient buffer
    nor join a reduction; so do the fp8-gathered weights (``apart``).
    """
    for run in group_plan.runs:
        for trainable in (True, False):
            params = [(name, p) for name, p in run if p.requires_grad == trainable]
            if params:
                yield from split_into_dbuffers(params, dbuffer_size, apart)


def _view_unit(alignment: int | None, master_dtype: torch.dtype, param_dtype: torch.dtype | None) -> int:
    """The planner's alignment in elements: the caller's, else 16 bytes of the smaller element (aligned views)."""
    smallest = min(dtype.itemsize for dtype in (master_dtype, param_dtype) if dtype is not None)
    return alignment or max(1, VIEW_ALIGNMENT_BYTES // smallest)


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn the gradient reduction off (accumulate gradients locally, in the reduce dtype) or back on: every group's
    (HSDP's replica all-reduce with it, as ``FSDPModule.set_requires_gradient_sync``)."""
    for group in get_state(module).all_groups:
        group.requires_gradient_sync = group.requires_all_reduce = bool(requires_gradient_sync)


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate gradients locally (in the reduce dtype) with no collective."""
    state = get_state(module)
    previous = state.requires_gradient_sync
    state.requires_gradient_sync = False
    try:
        yield
    finally:
        state.requires_gradient_sync = previous

