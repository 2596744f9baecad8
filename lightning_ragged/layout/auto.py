"""The auto-planner: how many consecutive blocks form one group, and how far to replicate (HSDP).

Pure (no torch.distributed): it plans shapes. With one block per group the padding grows
with the world: a rank's share of a block falls below the lcm of the big tensors' blocks
(:func:`~lightning_ragged.layout.packing.segment_lower_bound`) and S rounds up to a multiple
of it. Merging ``k`` consecutive identical blocks into one group multiplies the share by k;
sharding over ``world / R`` ranks (HSDP, R replicas) multiplies it by R. Both cost memory:
a larger group to gather, or R times the sharded state per rank.

:func:`auto_plan` scores every replicate degree dividing the world and, per kind of block,
every number of groups (consecutive blocks, balanced sizes) with the per-rank estimate of
:func:`~lightning_ragged.layout.memory.memory_estimate`. It picks the least memory per rank
among the choices padding at most ``padding_target`` (then the fewest bytes sent, then the
fewest collectives); where none does, the least padding; never more padding than one block
per group when that fits. Branch and bound: every choice is first scored at the lower
bound (padding and memory there can only be lower), then planned exactly in that order
until no remaining choice can beat the best planned one: exact over the choices, few plans.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from lightning_ragged.layout.granularity import GranularityPolicy, check_block_rows, check_policy, resolve_granularity
from lightning_ragged.layout.memory import OPTIMIZER_STATE_BYTES, memory_estimate
from lightning_ragged.layout.packing import segment_lower_bound
from lightning_ragged.layout.planner import ALGORITHMS, plan
from lightning_ragged.layout.spec import TensorSpec, align_up, is_positive_int

Shapes = list[tuple[str, tuple[int, ...]]]
DEFAULT_PADDING_TARGET = 0.03
DTYPE_OF_BYTES = {4: torch.float32, 2: torch.bfloat16, 1: torch.float8_e4m3fn}
"""The dtype planned for a master/compute element size (the plan report's fp32/bf16/fp8)."""


class BudgetTooSmall(ValueError):
    """No choice fits ``memory_budget_bytes``; ``least_bytes`` is a lower bound on what the cheapest one needs."""

    def __init__(self, detail: str, least_bytes: float) -> None:
        super().__init__(detail)
        self.least_bytes = least_bytes


@dataclass
class GroupKind:
    """One distinct FSDP group of a model and how many identical copies it has.

    ``runs`` are one copy's tensors (names relative to the group's module) split where
    another group's tensors come between them in module order; the engine gives each run
    its own DBuffer. ``members`` names the copies in module order (empty: ``count``
    consecutive copies). The group named ``"root"`` is never merged.
    """

    name: str
    count: int
    runs: list[Shapes]
    members: list[str] = field(default_factory=list)

    @property
    def shapes(self) -> Shapes:
        return [entry for run in self.runs for entry in run]

    def full_name(self, name: str) -> str:
        """``name`` under its first copy's module path, as ``fully_shard`` names it: policies that read
        names (``"muon"`` keeps ``embed_tokens.weight`` in rows, a callable) then resolve what the engine does."""
        return f"{self.members[0]}.{name}" if self.members and self.name != "root" else name


@dataclass(frozen=True)
class AutoGroup:
    """``count`` groups of ``blocks`` consecutive copies of one group kind, as planned.

    ``runs``: one group's tensors per DBuffer (a copy's tensors named ``"<copy>.<name>"``
    when copies are merged); ``members``: each group's copies by name, where they have names.
    """

    name: str
    kind: str
    blocks: int
    count: int
    members: tuple[tuple[str, ...], ...]
    runs: list[Shapes] = field(repr=False, compare=False)
    numel: int
    segment_sizes: tuple[int, ...]
    lower_bounds: tuple[int, ...]
    shard_world: int
    unsharded_bytes: int
    sharded_bytes_per_rank: float
    why: str

    @property
    def padding(self) -> int:
        return sum(self.segment_sizes) * self.shard_world - self.numel

    @property
    def padding_ratio(self) -> float:
        return self.padding / self.numel if self.numel else 0.0

    @property
    def lower_bound_padding_ratio(self) -> float:
        return (sum(self.lower_bounds) * self.shard_world - self.numel) / self.numel if self.numel else 0.0


@dataclass(frozen=True)
class AutoPlan:
    """The chosen grouping and replicate degree, the estimate it was chosen on, and why."""

    world_size: int
    replicate_degree: int
    dbuffer_size: int
    memory_budget_bytes: int
    padding_target: float
    groups: tuple[AutoGroup, ...]
    memory: dict[str, float]
    padding_ratio: float
    lower_bound_padding_ratio: float
    best_bound_padding_ratio: float
    baseline: dict[str, Any]
    collectives_per_step: int
    bytes_sent_per_step: float
    choices: int
    plans: int
    seconds: float
    why: str

    @property
    def shard_world_size(self) -> int:
        return self.world_size // self.replicate_degree

    @property
    def meets_target(self) -> bool:
        return self.padding_ratio <= self.padding_target

    def block_groups(self) -> list[tuple[str, ...]]:
        """The members of every merged group, in module order (groups of unnamed copies are left out)."""
        return [members for group in self.groups for members in group.members if group.blocks > 1 and members]

    def group_kinds(self) -> list[GroupKind]:
        """The chosen groups as group kinds, e.g. for the plan report to plan them again."""
        return [GroupKind(g.name, g.count, g.runs) for g in self.groups]

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready data: per group, then the totals."""
        groups = [
            dict(
                group=g.name, kind=g.kind, blocks=g.blocks, count=g.count, members=[list(m) for m in g.members],
                numel=g.numel, segment_sizes=list(g.segment_sizes), padding=g.padding, padding_ratio=g.padding_ratio,
                lower_bound_padding_ratio=g.lower_bound_padding_ratio, replicate_degree=self.replicate_degree,
                shard_world_size=g.shard_world, unsharded_bytes=g.unsharded_bytes,
                sharded_bytes_per_rank=g.sharded_bytes_per_rank, why=g.why,
            )
            for g in self.groups
        ]
        names = ("world_size", "replicate_degree", "dbuffer_size", "memory_budget_bytes", "padding_target", "memory",
                 "padding_ratio", "lower_bound_padding_ratio", "best_bound_padding_ratio", "baseline",
                 "collectives_per_step", "bytes_sent_per_step", "choices", "plans", "seconds", "why")
        totals = {name: getattr(self, name) for name in names}
        return dict(groups=groups, shard_world_size=self.shard_world_size, meets_target=self.meets_target, **totals)


def auto_plan(
    groups: Union[Sequence[GroupKind], Any],
    world_size: int,
    granularity: GranularityPolicy = "row",
    memory_budget_bytes: int = 80 * 10**9,
    *,
    block_rows: int = 128,
    alignment: int = 1,
    algorithm: str = "optimal",
    master_bytes: int = 4,
    param_bytes: int = 2,
    optimizer: str = "adamw",
    padding_target: float = DEFAULT_PADDING_TARGET,
    replicate_degree: Optional[int] = None,
    reduce_bytes: Optional[int] = None,
) -> AutoPlan:
    """Choose blocks per group (per kind) and the replicate degree for ``world_size`` ranks within the budget.

    ``groups``: :class:`GroupKind` list, blocks first and the root last (or anything with a
    ``.groups`` list of them, e.g. the plan report's ``ModelDescription``). ``replicate_degree``:
    fix R (default: search every divisor of ``world_size``). ``reduce_bytes``: the reduction's
    element size (the policy's ``reduce_dtype``; None: ``param_bytes``; ``memory.py`` sizes the gradient buffers). :class:`BudgetTooSmall` (a ``ValueError``)
    if no choice fits; ``ValueError`` for a bad argument.
    """
    kinds = list(getattr(groups, "groups", groups))
    reduce_bytes = param_bytes if reduce_bytes is None else reduce_bytes
    _check(kinds, world_size, granularity, memory_budget_bytes, block_rows, alignment, algorithm, master_bytes,
           param_bytes, reduce_bytes, optimizer, padding_target, replicate_degree)
    return _Search(kinds, world_size, granularity, memory_budget_bytes, block_rows, alignment, algorithm,
                   master_bytes, param_bytes, reduce_bytes, optimizer, padding_target).run(replicate_degree)


@dataclass
class _Choice:
    """One scored choice: replicate degree, groups per kind, and (at the bound or exact) its segments."""

    replicate: int
    groups_per_kind: tuple[int, ...]
    entries: list[tuple[int, int, int, tuple[int, ...]]]  # (kind index, blocks, count, segment per DBuffer)
    padded: int
    memory: dict[str, float]
    collectives: int
    sent: float
    key: tuple = ()


class _Search:
    def __init__(self, kinds, world, policy, budget, block_rows, alignment, algorithm, master, param, reduce,
                 optimizer, target) -> None:
        self.kinds, self.world, self.budget, self.alignment, self.algorithm = kinds, world, budget, alignment, algorithm
        self.master, self.param, self.reduce, self.optimizer, self.target = master, param, reduce, optimizer, target
        self.specs = [
            [[TensorSpec(n, math.prod(s), shape_granularity(policy, kind.full_name(n), s, block_rows)) for n, s in run]
             for run in kind.runs]
            for kind in kinds
        ]
        self.numel = [sum(spec.numel for run in runs for spec in run) for runs in self.specs]
        self.total = sum(kind.count * numel for kind, numel in zip(kinds, self.numel))
        self.mergeable = [k.name != "root" and k.count > 1 and _consecutive(k.members) for k in kinds]
        self.cache: dict[tuple, tuple[int, ...]] = {}
        self.plans = 0

    def run(self, fixed: Optional[int]) -> AutoPlan:
        began = time.perf_counter()
        replicas = [fixed] if fixed else [r for r in range(1, self.world + 1) if self.world % r == 0]
        ones = tuple(kind.count for kind in self.kinds)
        baseline = self.score(replicas[0] if fixed else 1, ones, exact=True)
        limit = baseline.padded if baseline.memory["total"] <= self.budget else math.inf
        options = self.options()
        bounds = sorted(
            (self.score(r, counts, exact=False) for r in replicas for counts in options),
            key=lambda c: (c.key, c.replicate, c.groups_per_kind),
        )
        fitting = [c for c in bounds if c.memory["total"] <= self.budget]
        best, planned = None, {}
        for bound in fitting:
            if bound.padded > limit:
                continue
            if best is not None and best.key <= bound.key:
                break
            actual = self.score(bound.replicate, bound.groups_per_kind, exact=True)
            planned[id(bound)] = actual
            fits = actual.memory["total"] <= self.budget and actual.padded <= limit
            if fits and (best is None or actual.key < best.key):
                best = actual
        if best is None:  # every choice planned exactly was over, every other one over at its bound already
            least = min((planned.get(id(c), c) for c in bounds), key=lambda c: c.memory["total"])
            raise BudgetTooSmall(
                f"memory_budget_bytes={self.budget:,} is too small for every choice: the least memory per rank is "
                f"at least {least.memory['total']:,.0f} bytes (replicate degree {least.replicate}, "
                f"{sum(least.groups_per_kind)} groups); raise the budget, pick a lighter optimizer or dtypes, "
                "or use more ranks",
                least.memory["total"],
            )
        return self.result(best, baseline, fitting, len(bounds), time.perf_counter() - began)

    def options(self) -> list[tuple[int, ...]]:
        """Every combination of group counts, the larger groups pruned once one group alone exceeds the budget."""
        per_kind = []
        for index, kind in enumerate(self.kinds):
            counts = [kind.count]
            if self.mergeable[index]:
                for groups in range(kind.count - 1, 0, -1):
                    if self.over_budget(index, -(-kind.count // groups)):
                        break
                    counts.append(groups)
            per_kind.append(counts)
        return list(itertools.product(*per_kind))

    def over_budget(self, index: int, blocks: int) -> bool:
        """One group of ``blocks`` blocks of kind ``index`` alone exceeds the budget (full params, grads, prefetch)."""
        return blocks * self.numel[index] * (2 * self.param + self.reduce) > self.budget

    def segments(self, index: int, blocks: int, shard_world: int, exact: bool) -> tuple[int, ...]:
        key = (index, blocks, shard_world, exact)
        if key not in self.cache:
            runs = _copies(self.specs[index], blocks, _renamed_spec)
            if exact:
                self.plans += 1
                self.cache[key] = tuple(plan(r, shard_world, self.algorithm, self.alignment).segment_size for r in runs)
            else:
                self.cache[key] = tuple(segment_lower_bound(r, shard_world, self.alignment) for r in runs)
        return self.cache[key]

    def score(self, replicate: int, groups_per_kind: tuple[int, ...], exact: bool) -> _Choice:
        shard_world = self.world // replicate
        entries = []
        for index, (kind, groups) in enumerate(zip(self.kinds, groups_per_kind)):
            small, larger = divmod(kind.count, groups)
            for blocks, count in ((small + 1, larger), (small, groups - larger)):
                if count:
                    entries.append((index, blocks, count, self.segments(index, blocks, shard_world, exact)))
        report = [dict(count=c, dbuffers=[dict(segment_size=s) for s in segs]) for _, _, c, segs in entries]
        memory = memory_estimate(report, shard_world, self.master, self.param, self.optimizer, self.reduce)
        padded = sum(count * sum(segs) * shard_world for _, _, count, segs in entries)
        collectives, sent = 0, 0.0
        for index, _, count, segs in entries:
            gathers = 1 if self.kinds[index].name == "root" else 2  # blocks re-gather in backward; the root stays
            collectives += count * len(segs) * (gathers + 1 + (replicate > 1))
            ring = (gathers + 1) * (shard_world - 1) + 2 * (replicate - 1) / replicate
            sent += count * sum(segs) * self.param * ring
        choice = _Choice(replicate, groups_per_kind, entries, padded, memory, collectives, sent)
        padding = self.ratio(padded)
        over = padding > self.target
        choice.key = (over, padding if over else 0.0, memory["total"], sent, collectives)
        return choice

    def ratio(self, padded: int) -> float:
        return (padded - self.total) / self.total if self.total else 0.0

    def result(self, best: _Choice, baseline: _Choice, fitting: list[_Choice], choices: int, seconds: float
               ) -> AutoPlan:
        world = self.world // best.replicate
        padding, lowest = self.ratio(best.padded), self.ratio(min(c.padded for c in fitting))
        bound = self.ratio(sum(c * sum(self.segments(i, b, world, False)) * world for i, b, c, _ in best.entries))
        groups = tuple(self.group(i, b, c, segs, best, world) for i, b, c, segs in best.entries)
        runs = [run for i, b, _, _ in best.entries for run in _copies(self.specs[i], b, _renamed_spec)]
        dbuffer_size = max(sum(s.numel for s in run) * self.master for run in runs)
        fits = baseline.memory["total"] <= self.budget
        base = dict(blocks=1, replicate_degree=baseline.replicate, padding_ratio=self.ratio(baseline.padded),
                    memory_total=baseline.memory["total"], fits=fits)
        if padding <= self.target:
            why = (f"pads {padding:.2%} (target {self.target:.0%}) with the least memory per rank of the choices "
                   "that meet the target within the budget")
        else:
            why = (f"no choice within the budget pads {self.target:.0%} or less: the lowest lower bound over the "
                   f"{len(fitting)} choices that fit is {lowest:.2%}; this one pads {padding:.2%}, the least found")
        why += (f"; one block per group at replicate degree {baseline.replicate}: {base['padding_ratio']:.2%}, "
                f"{base['memory_total']:,.0f} bytes per rank" + ("" if fits else " (over the budget)"))
        return AutoPlan(self.world, best.replicate, dbuffer_size, self.budget, self.target, groups, best.memory,
                        padding, bound, lowest, base, best.collectives, best.sent, choices, self.plans, seconds, why)

    def group(self, index: int, blocks: int, count: int, segs: tuple[int, ...], best: _Choice, world: int) -> AutoGroup:
        kind = self.kinds[index]
        state = 2 * self.master + OPTIMIZER_STATE_BYTES[self.optimizer]
        return AutoGroup(
            kind.name if blocks == 1 else f"{kind.name} x{blocks}", kind.name, blocks, count,
            _chunks(kind, best.groups_per_kind[index], blocks), _copies(kind.runs, blocks, _renamed_shape),
            blocks * self.numel[index], segs, self.segments(index, blocks, world, False), world,
            sum(segs) * world * self.param, count * sum(segs) * state, self.why(index, blocks, segs, world),
        )

    def why(self, index: int, blocks: int, segs: tuple[int, ...], world: int) -> str:
        kind, numel = self.kinds[index], self.numel[index]
        padding = (sum(segs) * world - blocks * numel) / (blocks * numel) if numel else 0.0
        if kind.name == "root":
            return f"the root group (never merged) pads {padding:.2%}"
        if not self.mergeable[index]:
            return "copies not consecutive in module order: one per group" if kind.count > 1 else "a single copy"
        one = self.segments(index, 1, world, True)
        single = (sum(one) * world - numel) / numel
        reason = _bound_reason(self.specs[index], world, self.alignment)
        if blocks == 1:
            if single <= self.target:
                return f"one block per group pads {single:.2%}, within the {self.target:.0%} target"
            larger = self.over_budget(index, 2)
            return (f"one block per group pads {single:.2%} ({reason})"
                    + ("; two blocks would exceed the budget" if larger else "; no larger group does better here"))
        said = f"one block pads {single:.2%} over {world:,} ranks ({reason}); {blocks} blocks pad {padding:.2%}"
        if padding < single:
            return said
        return said + f": no less, but {blocks}x fewer collectives and no more memory per rank"


def shape_granularity(policy: GranularityPolicy, name: str, shape: tuple[int, ...], block_rows: int = 128) -> int:
    """The engine's granularity of a parameter of this shape (``resolve_granularity`` on a meta tensor)."""
    return resolve_granularity(policy, name, torch.empty(shape, device="meta"), block_rows)


def _copies(runs: list[list[Any]], blocks: int, rename: Callable[[int, Any], Any]) -> list[list[Any]]:
    """The runs of ``blocks`` consecutive copies of one copy's ``runs``: copy c's entries ``rename(c, entry)``.

    A copy's last run and the next copy's first run are adjacent in module order, so they join.
    """
    if blocks == 1:
        return [list(run) for run in runs]
    merged: list[list[Any]] = []
    for copy in range(blocks):
        renamed = [[rename(copy, entry) for entry in run] for run in runs]
        if merged:
            merged[-1] += renamed.pop(0)
        merged += renamed
    return merged


def _renamed_spec(copy: int, spec: TensorSpec) -> TensorSpec:
    return TensorSpec(f"{copy}.{spec.name}", spec.numel, spec.granularity)


def _renamed_shape(copy: int, entry: tuple[str, tuple[int, ...]]) -> tuple[str, tuple[int, ...]]:
    return f"{copy}.{entry[0]}", entry[1]


def _chunks(kind: GroupKind, groups: int, blocks: int) -> tuple[tuple[str, ...], ...]:
    """Member names of the groups of ``blocks`` copies when ``kind.count`` copies form ``groups`` balanced groups."""
    if not kind.members:
        return ()
    small, larger = divmod(kind.count, groups)
    sizes = [small + 1] * larger + [small] * (groups - larger)
    starts = list(itertools.accumulate([0] + sizes))
    return tuple(tuple(kind.members[a:a + size]) for a, size in zip(starts, sizes) if size == blocks)


def _consecutive(members: Sequence[str]) -> bool:
    """Copies named ``<stack>.<i>`` with consecutive indices in one stack (or unnamed: consecutive by definition)."""
    if not members:
        return True
    stacks = {m.rpartition(".")[0] for m in members}
    ends = [m.rpartition(".")[2] for m in members]
    return len(stacks) == 1 and all(e.isdigit() for e in ends) and [int(e) for e in ends] == list(
        range(int(ends[0]), int(ends[0]) + len(ends))
    )


def _bound_reason(runs: list[list[TensorSpec]], world: int, alignment: int) -> str:
    """Which condition of ``segment_lower_bound`` sets one copy's segment size."""
    specs = max(runs, key=lambda run: sum(s.numel for s in run))
    bound = segment_lower_bound(specs, world, alignment)
    share = align_up(-(-sum(s.numel for s in specs) // world), alignment)
    forced = sorted((s for s in specs if s.granularity > 1 and s.numel >= 2 * bound), key=lambda s: -s.numel)
    if bound <= share + alignment or not forced:
        return f"S {bound:,} is a rank's share"
    lcm = math.lcm(alignment, *(s.granularity for s in forced))
    names = ", ".join(s.name for s in forced[:2]) + (", ..." if len(forced) > 2 else "")
    return f"{names} force S to a multiple of {lcm:,}, the share is {share:,}"


def _check(kinds, world, policy, budget, block_rows, alignment, algorithm, master, param, reduce, optimizer, target,
           replicate) -> None:
    """Refuse bad arguments early, naming the parameter, the value and the fix."""
    if not kinds or not all(isinstance(k, GroupKind) for k in kinds):
        raise ValueError(f"groups={kinds!r} must be a non-empty list of GroupKind (or a ModelDescription)")
    for name, value in (("world_size", world), ("memory_budget_bytes", budget), ("alignment", alignment)):
        if not is_positive_int(value):
            raise ValueError(f"{name}={value!r} must be a positive int")
    check_policy(policy)
    check_block_rows(block_rows)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is unknown; use one of {ALGORITHMS}")
    for name, value in (("master_bytes", master), ("param_bytes", param), ("reduce_bytes", reduce)):
        if value not in DTYPE_OF_BYTES:
            raise ValueError(f"{name}={value!r} must be an element size in bytes: 4, 2 or 1")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer={optimizer!r} is unknown; use one of {tuple(OPTIMIZER_STATE_BYTES)}")
    if not isinstance(target, (int, float)) or isinstance(target, bool) or not 0 <= target:
        raise ValueError(f"padding_target={target!r} must be a ratio >= 0, e.g. 0.03 for 3%")
    if replicate is not None and (not isinstance(replicate, int) or replicate < 1 or world % replicate):
        raise ValueError(
            f"replicate_degree={replicate!r} must be a positive int dividing world_size={world}, or None to search"
        )
