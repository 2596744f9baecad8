"""The NCCL stall diagnostic: torch's flight recorder turned into a :class:`CollectiveTimeoutError`.

On NCCL a stuck collective never returns to Python: the NCCL watchdog aborts the process
after the process group's timeout, before the probe's store census can run
(``diagnostics.py``). torch's flight recorder keeps, per process, a ring buffer of the last
collectives (``TORCH_NCCL_TRACE_BUFFER_SIZE`` entries; gloo records too, under
``TORCH_FR_BUFFER_SIZE``) and, with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, the watchdog writes it
to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` + rank before the abort: a pickle of
``{version, pg_config, pg_status, entries: [{process_group, collective_seq_id,
profiling_name, state, input_sizes, ...}]}``.

:func:`configure_flight_recorder` sets those variables (before NCCL is initialised, only the
ones the user has not set); :func:`stall_from_dumps` reads the per-rank files of a dead job
and names the stall as ``CollectiveTimeoutError`` does: the process group, the collective,
its sequence number on the group, and the missing ranks, those whose last collective
*enqueued* on that group is behind the others' (in a hang every member's last *completed*
one is the same: the ranks that arrived wait in the stuck one, the missing never issued it).
The files are read with an unpickler that builds only plain containers, never code.
"""

from __future__ import annotations

import ast
import io
import os
import pickle
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, MutableMapping

from lightning_ragged.engine.collective_errors import CollectiveTimeoutError, short_ranks
from lightning_ragged.layout.spec import is_positive_int

DUMP_PREFIX = "nccl_trace_rank_"
"""File name of each rank's dump (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` is the path up to the rank)."""
DEFAULT_BUFFER_SIZE = 2000
"""Entries kept per process: a few steps of a large model's all-gathers and reductions."""

_RANK_SUFFIX = re.compile(r"(\d+)$")


def configure_flight_recorder(
    backend: str,
    dump_dir: str | os.PathLike,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
    environ: MutableMapping[str, str] | None = None,
) -> dict[str, str]:
    """Enable torch's NCCL flight recorder and its dump on timeout; what was set (empty: not NCCL).

    Call before the NCCL process group is created (torch reads the variables then). A
    variable the user set, under its NCCL name or its newer ``TORCH_FR_*`` one, is kept as it is.
    """
    if not is_positive_int(buffer_size):
        raise ValueError(f"buffer_size={buffer_size!r}: the flight recorder needs a positive number of entries")
    if "nccl" not in str(backend).lower():
        return {}
    env = os.environ if environ is None else environ
    Path(dump_dir).mkdir(parents=True, exist_ok=True)
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(buffer_size),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(dump_dir) / DUMP_PREFIX),
    }
    applied = {
        key: value for key, value in wanted.items() if key not in env and _NEWER_NAMES.get(key, key) not in env
    }
    env.update(applied)
    return applied


_NEWER_NAMES = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "TORCH_FR_DUMP_TEMP_FILE",
}
"""The recorder's backend-neutral names of newer torch: set by the user, they count as the user's setting."""


class _PlainUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers only: any global (a class, a function) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"flight-recorder dump refers to {module}.{name}; a dump holds plain containers only, "
            "so this file is not one (refused, nothing executed)"
        )


def load_dump(path: str | os.PathLike) -> dict[str, Any]:
    """One rank's dump, read without executing anything from the file."""
    data = Path(path).read_bytes()
    try:
        dump = _PlainUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as error:
        raise ValueError(f"{path}: not a flight-recorder dump ({error})") from error
    if not isinstance(dump, dict) or "entries" not in dump or "version" not in dump:
        raise ValueError(f"{path}: not a flight-recorder dump (no 'version'/'entries'; keys {sorted(dump)[:8]})")
    return dump


def read_dumps(source: str | os.PathLike | Iterable[str | os.PathLike]) -> dict[int, dict[str, Any]]:
    """Rank -> dump, from a folder of per-rank files (names ending in the rank) or a list of them."""
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        paths = sorted(p for p in Path(source).iterdir() if p.is_file() and _RANK_SUFFIX.search(p.name))
    else:
        paths = [Path(p) for p in ([source] if isinstance(source, (str, os.PathLike)) else source)]
    dumps: dict[int, dict[str, Any]] = {}
    for path in paths:
        match = _RANK_SUFFIX.search(path.name)
        if match is None:
            raise ValueError(f"{path}: a dump's file name must end in its rank (torch writes <prefix><rank>)")
        dumps[int(match.group(1))] = load_dump(path)
    if not dumps:
        raise ValueError(f"no flight-recorder dumps in {source} (file names ending in the rank)")
    return dumps


def _collective_name(profiling_name: str) -> str:
    """``nccl:_allgather_base`` -> ``all_gather`` (the engine's names); unknown names as torch wrote them."""
    name = profiling_name.split(":", 1)[-1].lower().replace("_", "")
    for needle, ours in (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce")):
        if needle in name:
            return ours
    return profiling_name


def _members(dumps: Mapping[int, Mapping[str, Any]], name: str) -> list[int]:
    """Global ranks of process group ``name``, from any rank's ``pg_config`` (else: the ranks that dumped it)."""
    for dump in dumps.values():
        info = dump.get("pg_config", {}).get(name)
        if isinstance(info, Mapping) and isinstance(info.get("ranks"), str):
            return sorted(ast.literal_eval(info["ranks"]))
    return sorted(rank for rank, dump in dumps.items() if any(e["process_group"][0] == name for e in dump["entries"]))


def stall_from_dumps(
    dumps: Mapping[int, Mapping[str, Any]],
    groups: Mapping[tuple[str, int, int], str] | None = None,
    step: int = -1,
) -> CollectiveTimeoutError | None:
    """The named error of the collective some ranks never issued, or None (every member reached every one).

    ``groups``: (collective, input elements, output elements) -> FSDP group name, to name
    the group from the collective's sizes (:func:`collective_signatures`); ``step``: the
    training step, when the caller knows it (a dump does not record it).
    """
    last: dict[str, dict[int, dict[str, Any]]] = {}  # process group -> rank -> its last collective entry
    for rank, dump in dumps.items():
        for entry in dump["entries"]:
            if entry.get("is_p2p") or not entry.get("collective_seq_id"):
                continue
            name = entry["process_group"][0]
            mine = last.setdefault(name, {})
            if rank not in mine or entry["collective_seq_id"] > mine[rank]["collective_seq_id"]:
                mine[rank] = entry
    for name in sorted(last):
        by_rank = last[name]
        stuck = max(entry["collective_seq_id"] for entry in by_rank.values())
        members = _members(dumps, name)
        arrived = sorted(rank for rank, entry in by_rank.items() if entry["collective_seq_id"] == stuck)
        missing = [rank for rank in members if rank not in arrived]
        if not missing:
            continue
        entry = by_rank[arrived[0]]
        return _named(entry, name, members, arrived, missing, set(members) - set(dumps), by_rank, groups, step)
    return None


def _numel(sizes: list[list[int]]) -> int:
    total = 0
    for shape in sizes:
        count = 1
        for dim in shape:
            count *= dim
        total += count
    return total


def _named(
    entry: Mapping[str, Any],
    name: str,
    members: list[int],
    arrived: list[int],
    missing: list[int],
    undumped: set[int],
    by_rank: Mapping[int, Mapping[str, Any]],
    groups: Mapping[tuple[str, int, int], str] | None,
    step: int,
) -> CollectiveTimeoutError:
    collective = _collective_name(entry["profiling_name"])
    sequence = int(entry["collective_seq_id"])
    inputs, outputs = _numel(entry.get("input_sizes", [])), _numel(entry.get("output_sizes", []))
    desc = entry["process_group"][1]
    group = (groups or {}).get((collective, inputs, outputs), f"process group {name} ({desc})")
    behind = ", ".join(
        f"rank {rank} at #{by_rank[rank]['collective_seq_id']}" if rank in by_rank else f"rank {rank}: no dump"
        for rank in missing
    )
    timeout = entry.get("timeout_ms")
    within = f"within {timeout / 1000:g} s" if isinstance(timeout, (int, float)) and timeout else "in time"
    at_step = f"at step {step}" if step >= 0 else "at an unknown step (the dump does not record it)"
    message = (
        f"collective {collective} of FSDP group {group!r} ({inputs:,} -> {outputs:,} elements) did not finish "
        f"{within} {at_step} (collective #{sequence} on process group {name!r} of ranks {short_ranks(members)}, "
        f"state {entry.get('state', 'unknown')!r}): ranks {missing} did not arrive ({behind}); ranks {arrived} "
        "were waiting in it. A rank that did not arrive is stalled elsewhere (data loading, a different code path "
        "or number of batches, a Python exception, a dead process): look at its logs and stack (py-spy dump). "
        + (f"Ranks {sorted(undumped)} wrote no dump (their process died first). " if undumped else "")
        + "From torch's NCCL flight-recorder dumps."
    )
    return CollectiveTimeoutError(
        message,
        group=group,
        collective=collective,
        step=step,
        sequence=sequence,
        missing_ranks=missing,
        arrived_ranks=arrived,
    )


def collective_signatures(labels_and_layouts: Iterable[tuple[str, Any]]) -> dict[tuple[str, int, int], str]:
    """(collective, input elements, output elements) -> FSDP group, from ``EngineMetrics.groups()``.

    Each item is (label, ``Layout``) or (label, ``DBuffer``). The engine's collectives: the
    all-gather (segment -> full; for a DBuffer with an fp8 gather, ``rank_bytes`` -> ``wire_bytes``
    uint8 elements, which is what it issues; with ``reshard_after_forward=int`` also the backward's
    gather of the kept parts, full / int -> full, in the smaller group), the gradient reduction (reduce-scatter full ->
    segment, or all-reduce of the full buffer where ``reduce_mode`` is ``"all_reduce"``) and
    HSDP's all-reduce of the reduced segment over the replicas. Groups with the same sizes share
    a key: their names are joined with " or ".
    """
    signatures: dict[tuple[str, int, int], str] = {}
    for label, item in labels_and_layouts:
        layout, fp8 = getattr(item, "layout", item), getattr(item, "fp8_gather", None)
        full, segment = layout.buffer_numel, layout.segment_size
        gather = (segment, full) if fp8 is None else (fp8.rank_bytes, fp8.wire_bytes)
        keys = [("all_gather", *gather), ("reduce_scatter", full, segment), ("all_reduce", full, full),
                ("all_reduce", segment, segment)]
        partial = getattr(item, "partial_reshard", None)
        if partial is not None:  # reshard_after_forward=int: the backward re-gathers the kept parts in a smaller group
            keys.append(("all_gather", full // partial.size, full))
        for key in keys:
            signatures[key] = f"{signatures[key]} or {label}" if key in signatures else label
    return signatures
