"""Which parameters form one FSDP group, and how a group splits into DBuffers.

A group is unsharded as a whole right before its module runs. By default every block of
every stack is a group: the children of each ``nn.ModuleList``/``nn.Sequential`` that are
modules of modules (an encoder's and a decoder's layers, a vision tower beside an LM, a
UNet's down and up blocks), and a block class repeated among siblings. Without any,
modules are picked by size so that no group exceeds ``dbuffer_size`` (only modules with a forward:
a group is gathered when its module is called; one whose weights its parent reads without calling
it computes with the shards, so give such a model ``group_modules``). Beside blocks, a large
input embedding (an ``nn.Embedding`` outside them with ``nn.Embedding``'s own forward, untied, with at
least ``EMBEDDING_SHARE`` of the parameters the blocks leave) is a group of its own: its full table is
freed right after the lookup instead of living through forward and backward in the root, and it is
never re-gathered, because an embedding's backward reads only the indices (``needs_params_in_backward``;
torchtitan wraps its token embedding apart for the same reason). Whatever is left (small, tied or
subclassed embeddings, final norm, head) forms the root group. A group may also be
several consecutive sibling blocks (``blocks_per_group``, or a list in ``group_modules``):
fewer, larger groups pad less at a large world (see ``layout/auto.py``).
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Sequence, Type, Union

import torch
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from lightning_ragged.layout.errors import DBufferAlignmentError
from lightning_ragged.layout.spec import is_positive_int

GroupSpec = Union[Type[nn.Module], nn.Module, Sequence[nn.Module]]
"""A block class, one module, or a list of consecutive sibling modules that form one group."""
Members = list[tuple[str, nn.Module]]
EMBEDDING_SHARE = 0.25
"""An embedding outside the blocks gets a group of its own from this share of the parameters they leave."""


@dataclass
class ParamGroupPlan:
    """The parameters of one group: ``module`` runs them (None for the root group).

    ``runs`` splits the parameters where parameters of other groups come between them
    in module order (the root's embeddings before the blocks, its head after them), so
    each run gets its own DBuffer (one contiguous flat buffer per run of parameters).
    """

    name: str
    module: nn.Module | None
    runs: list[list[tuple[str, nn.Parameter]]] = field(default_factory=list)
    members: list[nn.Module] = field(default_factory=list)
    """The consecutive sibling modules of a group of several blocks (``module`` is the first)."""
    prefixes: list[str] = field(default_factory=list)
    _last_index: int = field(default=-2, init=False, repr=False)

    def add(self, index: int, name: str, param: nn.Parameter) -> None:
        """Append the parameter that is ``index``-th in module order."""
        if self._last_index != index - 1:
            self.runs.append([])
        self.runs[-1].append((name, param))
        self._last_index = index


ParamSlot = tuple[str, nn.Module, str]
"""Where a parameter is held: (module name, module, attribute)."""


def parameter_slots(root: nn.Module) -> dict[int, list[ParamSlot]]:
    """Every (module, attribute) holding each parameter, keyed by ``id(param)`` (tied weights: several)."""
    slots: dict[int, list[ParamSlot]] = {}
    for module_name, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module_name, module, attr))
    return slots


def choose_group_modules(
    root: nn.Module, group_modules: Sequence[GroupSpec] | None, dbuffer_size: int, blocks_per_group: int = 1
) -> list[Members]:
    """The members (name, module) of every group but the root's, in module order.

    ``blocks_per_group=k`` joins each run of consecutive sibling blocks k at a time (the
    last group of a stack may be shorter).
    """
    _check_blocks_per_group(blocks_per_group)
    named = [(name, module) for name, module in root.named_modules() if module is not root]
    if group_modules is None:
        blocks = stack_blocks(root)
        chosen = [[entry] for entry in (blocks if blocks else _size_groups(root, dbuffer_size))]
        if blocks:
            position = {id(m): index for index, (_, m) in enumerate(named)}
            chosen = sorted(chosen + [[entry] for entry in _large_embeddings(root, blocks)],
                            key=lambda members: position[id(members[0][1])])
    else:
        specs = _checked_specs(group_modules)
        lists = [spec for spec in specs if isinstance(spec, (list, tuple))]
        if lists and blocks_per_group != 1:
            raise ValueError(
                f"blocks_per_group={blocks_per_group} cannot be combined with lists in group_modules: "
                "either list the members of every group or give single modules and blocks_per_group"
            )
        classes = tuple(spec for spec in specs if isinstance(spec, type))
        instances = {id(spec) for spec in specs if isinstance(spec, nn.Module)}
        chosen = [[(n, m)] for n, m in named if isinstance(m, classes) or id(m) in instances]
        if classes and not any(isinstance(m, classes) for _, m in named):
            found = sorted({type(m).__name__ for _, m in named if _has_params(m) and _is_composite(m)})
            raise ValueError(
                f"group_modules={[c.__name__ for c in classes]} matches no module of {type(root).__name__} "
                f"(modules with parameters and children: {found[:12]}): every parameter would stay in the root's "
                "group. Name the class of the model's blocks"
            )
        names = {id(m): n for n, m in named}
        chosen += [_consecutive_siblings(root, names, list(spec)) for spec in lists]
        seen = Counter(id(m) for members in chosen for _, m in members)
        twice = [n for n, m in named if seen[id(m)] > 1]
        if twice:
            raise ValueError(
                f"group_modules puts {twice} in several groups: list each module in one group only"
            )
        position = {id(m): index for index, (_, m) in enumerate(named)}
        chosen.sort(key=lambda members: position[id(members[0][1])])
    return _join_siblings(root, chosen, blocks_per_group) if blocks_per_group > 1 else chosen


def _large_embeddings(root: nn.Module, blocks: Members) -> Members:
    """The embeddings outside ``blocks`` that get a group of their own (the module docstring says which)."""
    inside = {id(m) for _, block in blocks for m in block.modules()}
    slots = parameter_slots(root)
    left = sum(p.numel() for p in root.parameters() if not any(id(m) in inside for _, m, _ in slots[id(p)]))
    return [
        (name, module) for name, module in root.named_modules()
        if isinstance(module, nn.Embedding) and id(module) not in inside and module is not root
        and not needs_params_in_backward(module)  # else a group of its own would be gathered twice, not once
        and all(len(slots[id(p)]) == 1 for p in module.parameters())  # a tied table stays with its other use
        and module.weight.numel() >= EMBEDDING_SHARE * left
    ]


def needs_params_in_backward(module: nn.Module) -> bool:
    """False where the module's backward provably reads none of its parameters, so its group need not be
    re-gathered for backward (FSDP2's ``set_unshard_in_backward(False)``, decided here): an ``nn.Embedding``
    (its backward reads only the indices) whose class keeps ``nn.Embedding``'s own forward."""
    return not (isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward)


def _siblings(root: nn.Module, name: str) -> list[str]:
    """Names of the children with parameters of ``name``'s parent, in order."""
    parent = name.rpartition(".")[0]
    owner = root.get_submodule(parent)
    return [f"{parent}.{child}" if parent else child for child, m in owner.named_children() if _has_params(m)]


def _consecutive_siblings(root: nn.Module, names: dict[int, str], members: list) -> Members:
    """Check one listed group: modules of ``root``, children of one parent, with no sibling between them."""
    bad = [m for m in members if not isinstance(m, nn.Module) or id(m) not in names]
    if not members or bad:
        raise ValueError(
            f"group_modules entry {members!r}: every member must be a submodule of {type(root).__name__} "
            f"(not {bad!r}); list consecutive sibling blocks, e.g. [model.blocks[0], model.blocks[1]]"
        )
    entries = [(names[id(m)], m) for m in members]
    siblings = _siblings(root, entries[0][0])
    listed = [name for name, _ in entries]
    if any(name not in siblings for name in listed):
        raise ValueError(
            f"group_modules entry {listed}: the members are not siblings (children of one module); "
            "a group of several modules joins consecutive children of one stack, e.g. blocks 0 and 1"
        )
    start = siblings.index(listed[0])
    if listed != siblings[start : start + len(listed)]:
        raise ValueError(
            f"group_modules entry {listed}: the members are not consecutive in module order (expected "
            f"{siblings[start : start + len(listed)]}); list consecutive blocks in order, e.g. blocks 2 and 3"
        )
    return entries


def _join_siblings(root: nn.Module, chosen: list[Members], k: int) -> list[Members]:
    """Join single-module groups that are consecutive siblings, at most ``k`` per group."""
    joined: list[Members] = []
    for members in chosen:
        last = joined[-1] if joined else None
        if last is not None and len(members) == 1 and len(last) < k:
            siblings = _siblings(root, last[-1][0])
            after = siblings.index(last[-1][0]) + 1 if last[-1][0] in siblings else -1
            if 0 < after < len(siblings) and siblings[after] == members[0][0]:
                last.append(members[0])
                continue
        joined.append(list(members))
    return joined


def group_name(members: Members) -> str:
    """``blocks.0`` for one module, ``blocks.0-3`` for blocks 0 to 3 of one stack, ``norm+output`` for others."""
    names = [name for name, _ in members]
    if len(names) == 1:
        return names[0]
    parents, indices = zip(*(name.rpartition(".")[::2] for name in names))
    if len(set(parents)) == 1 and all(i.isdigit() for i in indices) and \
            [int(i) for i in indices] == list(range(int(indices[0]), int(indices[0]) + len(names))):
        return f"{names[0]}-{indices[-1]}"
    return "+".join(names)


def _checked_specs(group_modules: object) -> list[GroupSpec]:
    """``group_modules`` as a list, each entry a module class, a module, or a list of modules (else a TypeError
    naming it: a name like ``"Block"`` or a number used to be dropped, leaving one group for the whole model)."""
    if isinstance(group_modules, (str, bytes, nn.Module)) or not isinstance(group_modules, Iterable):
        raise TypeError(f"group_modules={group_modules!r} must be a list (of module classes, modules, or lists of "
                        "modules), e.g. group_modules=[Block]")
    specs = list(group_modules)
    for spec in specs:
        members = spec if isinstance(spec, (list, tuple)) else [spec]
        if isinstance(spec, type) and issubclass(spec, nn.Module):
            continue
        if not all(isinstance(member, nn.Module) for member in members):
            hint = " (class names are resolved by the Lightning strategy; here pass the class itself)" \
                if isinstance(spec, str) else ""
            raise TypeError(f"group_modules entry {spec!r} is not a module class, a module or a list of modules"
                            f"{hint}, e.g. group_modules=[Block]")
    return specs


def stack_blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every block of every stack, outermost stacks first, in module order.

    A block is a child with parameters and children of its own that sits in an
    ``nn.ModuleList``/``nn.Sequential``, or whose class repeats among its siblings while
    holding no such container (T5's encoder and decoder are two ``T5Stack``s: their
    layers are the blocks, not the stacks). Blocks are not searched further (a MoE
    block's experts stay in the block). A module with no forward of its own (``nn.ModuleList``/``ModuleDict``:
    nothing calls it, its children are called) is never a block, but searched: a group of it would never be
    gathered (two sibling lists of layers, a list of stages, two dicts of heads crashed at the first forward).
    """
    chosen: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        # a parametrized tensor's ParametrizationLists (``module.parametrizations.weight``, ``.bias``) are parts of
        # one computation, not blocks: a group each would free a parametrization's output before its module uses it
        children = [(name, child) for name, child in module.named_children()
                    if _has_params(child) and not isinstance(child, ParametrizationList)]
        composite = [child for _, child in children if _is_composite(child)]
        container = isinstance(module, (nn.ModuleList, nn.Sequential))
        repeats = Counter(type(child) for child in composite)
        for name, child in children:
            full = f"{prefix}{name}"
            repeated = repeats[type(child)] > 1 and not _holds_stack(child)
            if _is_composite(child) and _has_forward(child) and (container or repeated):
                chosen.append((full, child))
            else:
                visit(f"{full}.", child)

    visit("", root)
    return chosen


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _is_composite(module: nn.Module) -> bool:
    return any(True for _ in module.children())


def _holds_stack(module: nn.Module) -> bool:
    return any(
        isinstance(m, (nn.ModuleList, nn.Sequential)) and any(_is_composite(c) for c in m.children())
        for m in module.modules()
    )


def _size_groups(root: nn.Module, dbuffer_size: int) -> list[tuple[str, nn.Module]]:
    """Largest subtrees that fit in ``dbuffer_size``; parameters of bigger modules stay in the root.

    A module with no forward of its own (``nn.ParameterList``/``ParameterDict``, ``nn.ModuleList``/``ModuleDict``)
    is never a group: nothing calls it, so nothing would gather it, and its parent would compute with the shards.
    Its children are considered instead; a list's own parameters stay with its parent's group."""
    if _param_bytes(root.parameters()) <= dbuffer_size:
        return []
    chosen: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}{child_name}"
            size = _param_bytes(child.parameters())
            if size == 0:
                continue
            if size <= dbuffer_size and _has_forward(child):
                chosen.append((name, child))
            else:
                visit(f"{name}.", child)

    visit("", root)
    return chosen


def plan_groups(
    root: nn.Module, group_modules: Sequence[GroupSpec] | None, dbuffer_size: int, blocks_per_group: int = 1
) -> list[ParamGroupPlan]:
    """Assign every parameter to exactly one group; the root group (last) keeps the rest.

    A parameter owned by several modules (a tied weight) goes to the innermost group
    that contains all of its owners, so one all-gather serves every use of it.
    """
    _check_dbuffer_size(dbuffer_size)
    groups = [
        ParamGroupPlan(group_name(members), members[0][1], members=[m for _, m in members],
                       prefixes=[n for n, _ in members])
        for members in choose_group_modules(root, group_modules, dbuffer_size, blocks_per_group)
    ]
    by_prefix = {prefix: plan for plan in groups for prefix in plan.prefixes}
    groups.append(ParamGroupPlan("root", None))
    slots = parameter_slots(root)
    for index, (param_name, param) in enumerate(root.named_parameters()):
        # the deepest group prefix that is every owner's module or one of its ancestors (O(depth) per owner)
        common = set.intersection(*(_ancestors(module_name) for module_name, _, _ in slots[id(param)]))
        hits = [prefix for prefix in common if prefix in by_prefix]
        (by_prefix[max(hits, key=len)] if hits else groups[-1]).add(index, param_name, param)
    return [plan for plan in groups if plan.runs or plan.module is None]


def _ancestors(module_name: str) -> set[str]:
    """``"a.b.c"`` -> ``{"a", "a.b", "a.b.c"}``: the names of a module and of the modules that contain it."""
    parts = module_name.split(".")
    return {".".join(parts[:end]) for end in range(1, len(parts) + 1)}


def split_into_dbuffers(
    params: list[tuple[str, nn.Parameter]], dbuffer_size: int, apart: Callable[[nn.Parameter], Hashable] | None = None
) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive runs of same-dtype parameters whose bytes fit in ``dbuffer_size``; a parameter larger
    than ``dbuffer_size`` gets a DBuffer of its own (as DDP gives one a bucket of its own: a 4 GB
    embedding is not an error under the default 256 MiB).

    ``apart`` (a split key): parameters with different keys never share a DBuffer; each key's
    parameters are split in their order, keys in order of first appearance (the fp8
    all-gather's weights get DBuffers of their own).
    """
    if apart is not None:
        by_key: dict[Hashable, list[tuple[str, nn.Parameter]]] = {}
        for name, param in params:
            by_key.setdefault(apart(param), []).append((name, param))
        return [dbuffer for same in by_key.values() for dbuffer in split_into_dbuffers(same, dbuffer_size)]
    dbuffers: list[list[tuple[str, nn.Parameter]]] = []
    current: list[tuple[str, nn.Parameter]] = []
    current_bytes = 0
    for name, param in params:
        size = param.numel() * param.element_size()
        if current and (current_bytes + size > dbuffer_size or current[0][1].dtype != param.dtype):
            dbuffers.append(current)
            current, current_bytes = [], 0
        current.append((name, param))
        current_bytes += size
    if current:
        dbuffers.append(current)
    return dbuffers


def _check_dbuffer_size(dbuffer_size: int) -> None:
    if not is_positive_int(dbuffer_size):
        raise DBufferAlignmentError(
            f"dbuffer_size={dbuffer_size!r} must be a positive number of bytes, e.g. 256 * 2**20 (256 MiB)"
        )


def _check_blocks_per_group(blocks_per_group: int) -> None:
    if not is_positive_int(blocks_per_group):
        raise ValueError(
            f"blocks_per_group={blocks_per_group!r} must be an int >= 1 (1: one block per group; k: k consecutive "
            "blocks of a stack per group)"
        )


def _param_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def warn_split_blocks(children: list[Any], target: nn.Module, label: str) -> None:
    """FSDP2 makes one group per ``fully_shard`` call; a call here splits its module along the stacks it holds (what
    a call on a whole model wants). When the split modules are blocks of a stack of the parent that adopts them
    (FSDP2's per-block calls), say so: a MoE block split by expert issues a collective per expert, where
    ``group_modules=()`` keeps each block call one group."""
    stacked = {id(block) for m in target.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))
               for block in m.children()}
    split = [(getattr(type(child.root), "_ragged_original", type(child.root)).__name__, len(child.all_groups))
             for child in children
             if child.split_by_stacks and id(child.root) in stacked]
    if split:
        warnings.warn(
            f"fully_shard({label}) adopts {len(split)} earlier calls that each split their module into several "
            f"groups along a stack inside it ({split[0][0]}: {split[0][1]} groups, one per block of the stack plus "
            "the rest), each group gathered and reduced on its own. FSDP2 makes one group per call: pass "
            "group_modules=() to those calls to keep each one group, or shard the model in one fully_shard call",
            stacklevel=3,
        )
