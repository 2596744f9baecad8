"""Materialize a model that ``fully_shard`` sharded while its parameters were on the meta device.

``fully_shard(model, device=...)`` on a meta model allocates the shards but leaves them
uninitialized. ``materialize_meta_module`` fills them one tensor at a time:

1. replay an eager construction's initialization calls under a seed shared by all ranks
   (so each rank computes the same whole tensors): ``reset_parameters()`` of the modules
   as their ``__init__`` calls them (leaves in module order), and for a Hugging Face
   ``PreTrainedModel`` its ``post_init`` initialization, ``_initialize_weights(module)``
   children first with the model's own ``_init_weights`` (which also recomputes
   non-persistent buffers such as the rotary ``inv_freq``); see ``init_replay.py``. Given the
   construction's recorded calls (``init_record.py``: what the Lightning strategies' init contexts
   record), those are replayed instead, which covers whatever ``__init__`` did,
2. a parameter is a whole, master-dtype tensor (its module slot points at it) from the first to the
   last call that needs its value, then this rank's part of it is copied into ``dbuffer.sharded``
   and it is freed.

**What matches.** The replay makes the same calls, on tensors of the same shapes, dtypes
and device, in the same order as ``torch.manual_seed(seed)`` followed by building the model
on ``device``: the result is bit for bit the eager init for models whose random draws all
come from ``reset_parameters()`` and ``_init_weights`` (torch layers, ``transformers``
Llama, tied or not). Not replayed structurally: random numbers a module draws directly in its
``__init__`` (``nn.Parameter(torch.randn(...))``, GPT-2's ``Conv1D``): such a model is still
initialized (when ``_init_weights`` covers those tensors) but its stream is offset. An
eager build on CPU matches a materialization on CPU (CUDA draws from another generator).

A dry run of the calls on meta tensors (no memory, no random numbers) records which
tensors each call reads and writes; a write that a later call overwrites unread goes to a scratch
tensor of the same shape (the same draws, discarded, as in eager), so a parameter is whole only
from its first to its last needed call: peak memory is the shards plus the tensors being
initialized (one layer's for layer-by-layer ``reset_parameters``; a norm's weight set early and a
matrix set by a later ``apply(init)`` loop do not hold a whole group between them). The dry run
also names the tensors nothing initializes.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from lightning_ragged.engine.runtime import get_state
from lightning_ragged.engine.init_record import RecordedProgram, UnreplayableError
from lightning_ragged.engine.init_replay import (
    Trace,
    eager_init_events,
    has_hf_init,
    tied_target_slots,
    trace_events,
)
from lightning_ragged.engine.shard_group import ShardGroup


def has_meta_tensors(module: nn.Module) -> bool:
    """Meta parameters or buffers, or uninitialized shards of meta ones (:func:`has_uninitialized_shards`)."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers()) \
        or has_uninitialized_shards(module)


def has_uninitialized_shards(module: nn.Module) -> bool:
    """Shards an earlier ``fully_shard`` call gave storage from meta parameters, not initialized since (FSDP2's
    flow in ``configure_model``: the shards are there, their values not)."""
    return any(group.uninitialized for sub in module.modules() if (state := sub.__dict__.get("_ragged_fsdp_state"))
               for group in state.all_groups)


def shared_seed(default: int | None = None) -> int:
    """A seed every rank agrees on: ``default``, else ``PL_GLOBAL_SEED``, else rank 0's initial seed."""
    import os

    if default is None and os.environ.get("PL_GLOBAL_SEED") is not None:
        default = int(os.environ["PL_GLOBAL_SEED"])
    if default is None:
        default = torch.initial_seed() % 2**63
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [default]
        dist.broadcast_object_list(box, src=0)
        default = box[0]
    return int(default)


@dataclass
class MaterializeReport:
    """What materialization held at once: whole-tensor bytes and the groups they belong to."""

    peak_full_bytes: int = 0
    """Bytes of whole tensors alive at once (each from its first to its last live call)."""
    peak_open_groups: int = 0
    """Groups with a whole tensor alive at once."""
    largest_group_bytes: int = 0
    events: int = 0
    """Initialization calls replayed (``reset_parameters`` and Hugging Face ``_initialize_weights``)."""
    dead_writes: int = 0
    """(call, tensor) writes sent to a scratch tensor because a later call overwrites them unread."""
    traced: bool = True
    """False when the meta dry run failed: every tensor was whole for the whole replay."""
    recorded: bool = False
    """The construction's recorded calls were replayed (``init_record.py``), not the structural ones."""


def materialize_meta_module(
    module: nn.Module, device: torch.device | str, seed: int | None = None, program: RecordedProgram | None = None
) -> MaterializeReport:
    """Initialize the shards (and meta buffers) of a module sharded from the meta device.

    Replays an eager construction's initialization calls (``init_replay.eager_init_events``:
    ``reset_parameters()`` of the modules as their ``__init__`` calls them, and each Hugging
    Face ``PreTrainedModel``'s ``post_init`` initialization with its own ``_init_weights``)
    under ``seed`` (default ``shared_seed()``), tensor by tensor; the global RNG state is left
    untouched. With ``program`` (the construction's recorded calls, ``init_record.py``) those calls
    are replayed instead; one it cannot replay falls back to the structural calls, with a warning.
    Returns how many full-buffer bytes and groups were alive at the peak.
    Raises ``RuntimeError`` naming the parameters or buffers that nothing would initialize
    (they would otherwise hold garbage).
    """
    device = torch.device(device)
    state = get_state(module)
    groups = state.all_groups
    tied = tied_target_slots(module)
    meta_buffers = {(id(sub), attr) for sub in module.modules() for attr, b in sub._buffers.items()
                    if b is not None and b.is_meta}
    if program is not None:
        try:
            program.start(torch.device("meta"))
            events: list[Any] = program.events
            trace = _dry_run(module, groups, events, tied)
            program.start(device)
        except UnreplayableError as error:
            warnings.warn(f"the recorded construction cannot be replayed ({error}); replaying reset_parameters() "
                          "and Hugging Face initialization instead (init_replay.py)", stacklevel=2)
            program = None
    if program is None:
        events = eager_init_events(module)
        trace = _dry_run(module, groups, events, tied)
    _materialize_buffers(module, device)
    if trace is not None:
        _check_coverage(module, groups, trace, meta_buffers, device, program)

    key_group = {(id(b), name): group for group in groups for b in group.dbuffers for name in b.unsharded_params}
    dbuffer_of = {(id(b), name): b for group in groups for b in group.dbuffers for name in b.unsharded_params}
    dead_in: list[set[tuple[int, str]]] = [set() for _ in events]
    accessed: list[set[Any]] = [set() for _ in events]
    opens: list[list[tuple[int, str]]] = [[] for _ in events]
    closes: list[list[tuple[int, str]]] = [[] for _ in events]
    tied_span: dict[tuple[int, str], tuple[int, int]] = {}
    last = max(len(events) - 1, 0)
    if trace is not None:
        for key, seen in trace.accesses.items():
            for access in seen:
                accessed[access.event].add(key)
        for key in key_group:
            for index in trace.dead(key):
                dead_in[index].add(key)
            live_events = trace.live(key)
            if live_events:
                opens[min(live_events)].append(key)
                closes[max(live_events)].append(key)
        for slot in tied:
            seen = trace.accesses.get(("tied", *slot), [])
            if seen:
                tied_span[slot] = (seen[0].event, seen[-1].event)
    elif events:  # every tensor whole for the whole replay, every slot bound at every call
        opens[0], closes[last] = list(key_group), list(key_group)
        for index in range(len(events)):
            accessed[index] = set(key_group) | {("tied", *slot) for slot in tied}
        tied_span = {slot: (0, last) for slot in tied}
    slots_of: dict[Any, list[tuple[nn.Module, str]]] = {}
    for group in groups:
        for owner, attr, dbuffer, name in group.slots:
            if (id(owner), attr) in tied:
                slots_of.setdefault(("tied", id(owner), attr), []).append((owner, attr))
            else:
                slots_of.setdefault((id(dbuffer), name), []).append((owner, attr))
    template = {(id(b), name): (b.unsharded_params[name].shape, b.master_dtype, b.sharded_params[name].requires_grad)
                for group in groups for b in group.dbuffers for name in b.unsharded_params}
    for group in groups:
        for owner, attr, dbuffer, name in group.slots:
            if (id(owner), attr) in tied:
                template[("tied", id(owner), attr)] = template[(id(dbuffer), name)]

    def scratch(key: Any, zeros: bool = False) -> nn.Parameter:
        shape, dtype, requires_grad = template[key]
        return nn.Parameter((torch.zeros if zeros else torch.empty)(shape, dtype=dtype, device=device), requires_grad)

    seed = shared_seed(seed)
    live: dict[tuple[int, str], nn.Parameter] = {}  # whole tensors from their first to their last live call
    live_bytes, open_in = 0, {}  # their bytes; per group, how many are whole
    tied_scratch: dict[Any, nn.Parameter] = {}
    report = MaterializeReport(largest_group_bytes=max(_group_bytes(g) for g in groups), events=len(events),
                               traced=trace is not None, recorded=program is not None)
    with _forked_rng(device), torch.no_grad():
        torch.manual_seed(seed)
        for index, event in enumerate(events):
            for key in opens[index]:
                live[key] = scratch(key, zeros=True)
                live_bytes += live[key].numel() * live[key].element_size()
                open_in[id(key_group[key])] = open_in.get(id(key_group[key]), 0) + 1
            report.peak_open_groups = max(report.peak_open_groups, len(open_in))
            report.peak_full_bytes = max(report.peak_full_bytes, live_bytes)
            for key in accessed[index]:
                if key[0] == "tied":  # eager's own tensor until tie_weights(): drawn into, then dropped
                    if key not in tied_scratch:
                        tied_scratch[key] = scratch(key)
                    value = tied_scratch[key]
                elif key in key_group:
                    if key in dead_in[index]:  # overwritten later, unread: the same draws, into a scratch tensor
                        value = scratch(key)
                        report.dead_writes += 1
                    else:
                        value = live[key]
                else:
                    continue  # a buffer: real, written in place
                for owner, attr in slots_of.get(key, []):
                    owner._parameters[attr] = value
            event.run()
            for key in [k for k, (_, end) in tied_span.items() if end == index]:
                tied_scratch.pop(("tied", *key), None)
            for key in closes[index]:
                full = live.pop(key)
                _keep_segment(dbuffer_of[key], key[1], full)
                live_bytes -= full.numel() * full.element_size()
                open_in[id(key_group[key])] -= 1
                if not open_in[id(key_group[key])]:
                    del open_in[id(key_group[key])]
                for owner, attr in slots_of.get(key, []):
                    owner._parameters[attr] = dbuffer_of[key].sharded_params[key[1]]
    for group in groups:  # point every module back at its shards
        group.reshard()
    return report


def _keep_segment(dbuffer: Any, name: str, full: torch.Tensor) -> None:
    """Copy this rank's part of parameter ``name``'s whole tensor into the DBuffer's shard."""
    begin, numel = dbuffer.layout.offsets[name], full.numel()
    low, high = max(begin, dbuffer.segment.start), min(begin + numel, dbuffer.segment.stop)
    if low < high:
        dbuffer.sharded[low - dbuffer.segment.start : high - dbuffer.segment.start].copy_(
            full.reshape(-1)[low - begin : high - begin]
        )


def _group_bytes(group: ShardGroup) -> int:
    return sum(b.full_numel * b.sharded.element_size() for b in group.dbuffers)


def _dry_run(module: nn.Module, groups: list[ShardGroup], events: list[Any],
             tied: set[tuple[int, str]]) -> Trace | None:
    """Trace the replay on meta tensors (no memory, no random numbers); None if it cannot run there."""
    tracked: list[tuple[torch.Tensor, Any]] = []
    views: dict[tuple[int, str], nn.Parameter] = {}
    for group in groups:
        for dbuffer in group.dbuffers:
            flat = torch.empty(dbuffer.full_numel, dtype=dbuffer.master_dtype, device="meta")
            for name in dbuffer.unsharded_params:
                requires_grad = dbuffer.sharded_params[name].requires_grad
                view = nn.Parameter(dbuffer.full_view(flat, name), requires_grad)
                views[(id(dbuffer), name)] = view
                tracked.append((view, (id(dbuffer), name)))
    for group in groups:
        for owner, attr, dbuffer, name in group.slots:
            view = views[(id(dbuffer), name)]
            if (id(owner), attr) in tied:  # its own tensor, as in eager before tie_weights()
                view = nn.Parameter(torch.empty_like(view, device="meta"), view.requires_grad)
                tracked.append((view, ("tied", id(owner), attr)))
            owner._parameters[attr] = view
    swapped = []
    for sub in module.modules():
        for attr, buffer in list(sub._buffers.items()):
            if buffer is None:
                continue
            if not buffer.is_meta:  # the dry run must not write real tensors
                swapped.append((sub, attr, buffer))
                buffer = sub._buffers[attr] = torch.empty_like(buffer, device="meta")
            tracked.append((buffer, ("buffer", id(sub), attr)))
    try:
        return trace_events(module, events, tracked)
    except UnreplayableError:
        raise
    except Exception as error:  # noqa: BLE001 - any model code may refuse meta tensors
        warnings.warn(
            f"meta-device initialization could not be traced on meta tensors ({type(error).__name__}: {error}); "
            "every group is materialized at once (peak memory: the full model) and uninitialized tensors "
            "are not detected",
            stacklevel=3,
        )
        return None
    finally:
        for sub, attr, buffer in swapped:
            sub._buffers[attr] = buffer
        for group in groups:
            group.use_sharded()


def _check_coverage(module: nn.Module, groups: list[ShardGroup], trace: Trace,
                    meta_buffers: set[tuple[int, str]], device: torch.device, program: RecordedProgram | None) -> None:
    """Every parameter and meta buffer must be fully written by some call before anything reads it (but a real
    one the recording never touched: its values are in the shards already)."""
    missing = []
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    kept = {(id(d), name) for g in groups for owner, attr, d, name in g.slots
            if program is not None and (id(owner), attr) in program.kept}
    for group in groups:
        for dbuffer in group.dbuffers:
            for name, param in dbuffer.unsharded_params.items():
                if (id(dbuffer), name) not in kept and not trace.initialized((id(dbuffer), name)):
                    missing.append(names.get(id(dbuffer.sharded_params[name]), name))
    unset = [(path, sub, attr) for path, sub in module.named_modules() for attr, b in sub._buffers.items()
             if b is not None and (id(sub), attr) in meta_buffers and not trace.initialized(("buffer", id(sub), attr))]
    for path, sub, attr in unset:
        if not _rebuild_buffer(sub, attr, device):
            missing.append(f"{path + '.' if path else ''}{attr} (buffer)")
    if missing:
        if program is not None:
            written = "by no call its construction made (recorded under init_module(empty_init=True))"
        else:
            hf = " nor by the Hugging Face model's `_init_weights`" if has_hf_init(module) else ""
            written = f"neither by a module's `reset_parameters()`{hf}"
        parametrized = [name for name, sub in module.named_modules() if parametrize.is_parametrized(sub)]
        hint = "" if program is not None else (
            " It was replayed structurally (built by hand on the meta device, or its recording could not be replayed: "
            "see the warning); under `Trainer.init_module(empty_init=True)` / `fabric.init_module(empty_init=True)` "
            "the strategy records what the construction does and replays that"
            + (f" (this model has parametrizations, e.g. weight_norm, at {', '.join(parametrized[:3])}: the "
               "structural replay does not follow them, so the tensors after them are reported too)" if parametrized
               else "")
            + "."
        )
        raise RuntimeError(
            "cannot initialize a model built on the meta device: nothing initializes these tensors (they are "
            f"written {written}): {', '.join(missing)}. Give those modules "
            "a `reset_parameters()` that initializes their own parameters/buffers, or build the model on a real "
            "device (not `torch.device('meta')` nor `init_module(empty_init=True)`)." + hint
        )


def _rebuild_buffer(module: nn.Module, attr: str, device: torch.device) -> bool:
    """A buffer set in ``__init__`` only (a rotary ``inv_freq``): build the module again from its
    ``config`` on ``device`` (no random number drawn from the caller's stream) and take it."""
    config = getattr(module, "config", None)
    if config is None:
        return False
    try:
        with _forked_rng(device), torch.device(device):
            fresh = type(module)(config)
    except Exception:  # noqa: BLE001 - not buildable from its config alone
        return False
    value = fresh._buffers.get(attr)
    target = module._buffers[attr]
    if value is None or value.shape != target.shape:
        return False
    with torch.no_grad():
        target.copy_(value)
    return True


def _materialize_buffers(module: nn.Module, device: torch.device) -> None:
    """Give meta buffers real (uninitialized) storage; ``reset_parameters`` must fill them.

    Not ``Module.to_empty``: it would also replace the (real) shards, breaking their views
    into the DBuffers, and empty the buffers that are not on the meta device.
    """
    for sub in module.modules():
        for attr, buffer in list(sub._buffers.items()):
            if buffer is not None and buffer.is_meta:
                sub._buffers[attr] = torch.empty_like(buffer, device=device)


@contextmanager
def _forked_rng(device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield
