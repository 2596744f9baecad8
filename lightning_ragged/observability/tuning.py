"""A ``dbuffer_size`` (and prefetch depth) recommended from measured exposure and memory headroom.

The deployment guide's "adjust dbuffer_size from monitoring data", as a pure function:
:func:`recommend` reads one window of :class:`~lightning_ragged.observability.metrics.EngineMetrics`
numbers, the groups' sizes and a memory limit, and returns a :class:`Recommendation` with
its reason. The rules, first match wins:

1. **memory near the limit** (headroom under ``NEAR_LIMIT_FRACTION`` of the limit): prefetch
   one group fewer if more than one is prefetched; else halve ``dbuffer_size`` (a parameter
   larger than it keeps a DBuffer of its own). A group formed by size (no block stack) then shrinks; a group of
   whole blocks is only split into more DBuffers, all gathered together, so its peak stays
   (the reason says so and names the fix: smaller ``group_modules``).
2. **all-gathers exposed** (``comm_hidden_ratio`` under ``HIDDEN_TARGET``) with headroom: if
   ``dbuffer_size`` splits a group into several DBuffers, raise it to the largest group
   (fewer, larger all-gathers; the group was gathered whole already, so its peak stays);
   else prefetch one group more when one more full buffer fits the headroom.
3. otherwise **keep**.

The Lightning callback (``lightning/callbacks.py``) logs it and writes :data:`TUNING_FILE` at
fit end; ``RaggedFSDPStrategy(dbuffer_size="recommended")`` reads it at the next start.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

import torch

from lightning_ragged.layout.memory import format_bytes
from lightning_ragged.layout.spec import is_positive_int
from lightning_ragged.observability.metrics import PREFIX, EngineMetrics, process_memory

TUNING_FILE = "ragged_fsdp_tuning.json"
"""Written to ``<default_root_dir>`` at fit end; read by ``dbuffer_size="recommended"``."""
FORMAT_VERSION = 1
NEAR_LIMIT_FRACTION = 0.10
"""Headroom under this share of the memory limit counts as near the limit."""
HIDDEN_TARGET = 0.90
"""A ``comm_hidden_ratio`` under this counts as exposed communication."""
ROUND_BYTES = 4096

Action = Literal["keep", "grow", "prefetch_more", "prefetch_less", "shrink"]


@dataclass(frozen=True)
class GroupSize:
    """One group's sizes: ``dbuffer_bytes`` are what ``dbuffer_size`` bounds (each DBuffer's
    parameters, unpadded, in their own dtype); ``unsharded_bytes`` its full buffers when gathered."""

    name: str
    dbuffer_bytes: tuple[int, ...]
    unsharded_bytes: int
    largest_param_bytes: int

    @property
    def param_bytes(self) -> int:
        return sum(self.dbuffer_bytes)


@dataclass(frozen=True)
class TuningInput:
    """One window of measurements (per step, this rank) and the current configuration."""

    all_gather_seconds: float
    blocked_seconds: float
    comm_hidden_ratio: float
    unsharded_peak_bytes: float
    grad_peak_bytes: float
    memory_peak_bytes: float
    memory_limit_bytes: float
    dbuffer_size: int
    groups: Sequence[GroupSize]
    max_inflight_all_gathers: int = 1

    @property
    def headroom_bytes(self) -> float:
        return self.memory_limit_bytes - self.memory_peak_bytes


@dataclass(frozen=True)
class Recommendation:
    """What to run with next (``dbuffer_size`` in bytes) and why."""

    dbuffer_size: int
    max_inflight_all_gathers: int
    action: Action
    reason: str


def _round_up(n: float) -> int:
    return int(math.ceil(n / ROUND_BYTES)) * ROUND_BYTES


def recommend(m: TuningInput) -> Recommendation:
    """The recommendation for the next start (rules in the module doc)."""
    size, depth = m.dbuffer_size, m.max_inflight_all_gathers
    groups = [g for g in m.groups if g.dbuffer_bytes]
    if not groups:
        return Recommendation(size, depth, "keep", "no DBuffers to size")
    headroom, limit = m.headroom_bytes, m.memory_limit_bytes
    memory = f"headroom {format_bytes(headroom)} of {format_bytes(limit)}"
    biggest = max(groups, key=lambda g: g.unsharded_bytes)
    if headroom < NEAR_LIMIT_FRACTION * limit:
        near = f"memory near the limit ({memory}, under {NEAR_LIMIT_FRACTION:.0%})"
        if depth > 1:
            return Recommendation(size, depth - 1, "prefetch_less",
                                  f"{near}: prefetch one group fewer (max_inflight_all_gathers={depth - 1}) "
                                  f"frees up to {format_bytes(biggest.unsharded_bytes)} ({biggest.name!r})")
        largest_param = max(g.largest_param_bytes for g in groups)
        largest_dbuffer = max(max(g.dbuffer_bytes) for g in groups)
        smaller = _round_up(min(size, largest_dbuffer) / 2)
        if smaller >= size:
            return Recommendation(size, depth, "keep",
                                  f"{near}, but dbuffer_size {format_bytes(size)} is as small as it goes: lower the "
                                  "batch size or checkpoint activations")
        reason = (f"{near}: dbuffer_size {format_bytes(size)} -> {format_bytes(smaller)} shrinks groups formed by size "
                  f"(full buffers alive at once peaked at {format_bytes(m.unsharded_peak_bytes + m.grad_peak_bytes)})")
        if largest_param > smaller:
            reason += f"; a parameter larger than that (the largest: {format_bytes(largest_param)}) keeps a DBuffer of its own"
        whole = [g for g in groups if g.param_bytes > smaller]
        if whole:
            reason += (f"; {len(whole)} group(s) such as {whole[0].name!r} ({format_bytes(whole[0].param_bytes)}) are only "
                       "split into more DBuffers, gathered together: give group_modules smaller modules")
        return Recommendation(smaller, depth, "shrink", reason)
    hidden = m.comm_hidden_ratio
    if m.all_gather_seconds <= 0:
        return Recommendation(size, depth, "keep", f"no all-gather time measured yet ({memory})")
    if hidden >= HIDDEN_TARGET:
        return Recommendation(size, depth, "keep",
                              f"communication well hidden (comm_hidden_ratio {hidden:.2f} >= {HIDDEN_TARGET}) "
                              f"and {memory}")
    exposed = (f"communication exposed (comm_hidden_ratio {hidden:.2f} < {HIDDEN_TARGET}; per step "
               f"{m.blocked_seconds:.4f} s blocked in collectives, all-gathers {m.all_gather_seconds:.4f} s in "
               f"flight) with {memory}")
    split = [g for g in groups if len(g.dbuffer_bytes) > 1 and g.param_bytes > size]
    if split:
        larger = _round_up(max(g.param_bytes for g in split))
        pieces = sum(len(g.dbuffer_bytes) for g in split)
        return Recommendation(larger, depth, "grow",
                              f"{exposed}: dbuffer_size={size} splits {len(split)} group(s) into {pieces} DBuffers; "
                              f"dbuffer_size={larger} ({format_bytes(larger)}) gathers each in fewer, larger all-gathers "
                              "(a group is gathered whole either way: its peak stays)")
    if headroom - biggest.unsharded_bytes >= NEAR_LIMIT_FRACTION * limit:
        return Recommendation(size, depth + 1, "prefetch_more",
                              f"{exposed}: every group is one all-gather already; prefetch one group more "
                              f"(max_inflight_all_gathers={depth + 1}) for up to {format_bytes(biggest.unsharded_bytes)}")
    return Recommendation(size, depth, "keep",
                          f"{exposed}, but one more prefetched group ({format_bytes(biggest.unsharded_bytes)}) would bring "
                          f"memory near the limit")


# ----------------------------------------------------------- from a running engine
def group_sizes(metrics: EngineMetrics) -> list[GroupSize]:
    """The groups' sizes as the engine built them (from the probes' DBuffers)."""
    by_group: dict[str, list[Any]] = {}
    for p in metrics.probes:
        for info in p.dbuffers:
            by_group.setdefault(info.group, []).append(info)
    sizes = []
    for name, infos in by_group.items():
        dbuffer_bytes, unsharded, largest = [], 0, 0
        for info in infos:
            dbuffer = info.dbuffer
            element = dbuffer.sharded.element_size()  # the master dtype, as fully_shard compares
            numels = [spec.numel for spec in dbuffer.layout.specs.values()]
            dbuffer_bytes.append(sum(numels) * element)
            largest = max(largest, max(numels, default=0) * element)
            unsharded += info.unsharded_bytes
        sizes.append(GroupSize(name, tuple(dbuffer_bytes), unsharded, largest))
    return sizes


def memory_peak_and_limit(
    device: Optional[torch.device], budget_bytes: Optional[int] = None, local_processes: int = 1
) -> tuple[float, float]:
    """(peak bytes, limit bytes) of this rank.

    CUDA: the allocator's reserved peak plus what others hold on the device (context,
    NCCL), against the device total. CPU: the process's peak RSS against the physical
    memory shared by ``local_processes``. ``budget_bytes`` replaces the limit.
    """
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        others = max(total - free - torch.cuda.memory_reserved(device), 0)
        peak, limit = torch.cuda.max_memory_reserved(device) + others, total
    else:
        peak = process_memory(None)[1]
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(local_processes, 1)
    return float(peak), float(budget_bytes if budget_bytes is not None else limit)


def tuning_input(
    values: Mapping[str, float],
    groups: Sequence[GroupSize],
    dbuffer_size: int,
    memory: tuple[float, float],
    max_inflight_all_gathers: int = 1,
) -> TuningInput:
    """A :class:`TuningInput` from :meth:`EngineMetrics.compute` values (``ragged_fsdp/`` keys)."""
    peak, limit = memory
    return TuningInput(
        all_gather_seconds=values[PREFIX + "all_gather_seconds"],
        blocked_seconds=values[PREFIX + "comm_blocked_seconds"],
        comm_hidden_ratio=values[PREFIX + "comm_hidden_ratio"],
        unsharded_peak_bytes=values[PREFIX + "dbuffer_unsharded_peak_bytes"],
        grad_peak_bytes=values[PREFIX + "dbuffer_grad_peak_bytes"],
        memory_peak_bytes=peak,
        memory_limit_bytes=limit,
        dbuffer_size=dbuffer_size,
        groups=tuple(groups),
        max_inflight_all_gathers=max_inflight_all_gathers,
    )


# ----------------------------------------------------------- the file between runs
def write_recommendation(directory: str | os.PathLike, recommendation: Recommendation, step: int) -> Path:
    """Write :data:`TUNING_FILE` in ``directory`` atomically (a reader never sees half a file)."""
    path = Path(directory) / TUNING_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"version": FORMAT_VERSION, "step": step, **asdict(recommendation)}, indent=2))
    os.replace(partial, path)
    return path


def read_recommendation(directory: str | os.PathLike) -> Optional[Recommendation]:
    """The recommendation in ``directory``'s :data:`TUNING_FILE`; ``None`` if there is none.

    A file that is not one raises ``ValueError`` naming it and the fix.
    """
    path = Path(directory) / TUNING_FILE
    if not path.is_file():
        return None
    fix = f"delete {path} (the next fit writes a new one) or pass dbuffer_size=<bytes>"
    try:
        data = json.loads(path.read_text())
        fields = {k: data[k] for k in ("dbuffer_size", "max_inflight_all_gathers", "action", "reason")}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"dbuffer_size='recommended': {path} is not a tuning file ({error}); {fix}") from None
    size = fields["dbuffer_size"]
    if data.get("version") != FORMAT_VERSION or not is_positive_int(size):
        raise ValueError(f"dbuffer_size='recommended': {path} holds version {data.get('version')!r}, "
                         f"dbuffer_size {size!r} (want version {FORMAT_VERSION}, a positive int); {fix}")
    return Recommendation(**fields)
