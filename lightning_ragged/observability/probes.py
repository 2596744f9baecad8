"""Probes on the engine's DBuffers: time blocked in collectives, buffer memory, engine copies, diagnostics.

``probe(module)`` wraps, once per sharded module, the collective and allocation methods
of every DBuffer with thin instance-level wrappers (the engine files are not changed).
Each wrapper costs two ``perf_counter`` calls and a few integer updates; exceptions cost
nothing until one is raised. A wrapper

* adds the time the training thread spent *inside* the call (issuing a collective or
  waiting for it) to ``blocked_*_seconds``; nested calls (``unshard`` waiting on itself)
  count once. ``CommStats`` has the in-flight time (issue to completion), so the share of
  communication hidden behind compute is ``1 - blocked / in_flight``;
* tracks the bytes of unsharded parameter and gradient buffers alive right now and their
  peak (``reset_peaks`` starts a new window);
* counts the bytes the engine itself copies outside the collectives (the mixed-precision
  casts before an all-gather and before a reduction; with fp32 buffers, zero);
* numbers the collectives of each process group and turns a timeout, a dead peer or an
  out-of-memory error into the named errors of ``diagnostics.py``.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from lightning_ragged.engine.dbuffer import DBuffer
from lightning_ragged.engine.api import RaggedFSDPState, get_state

_WRAPPED = (
    "unshard",
    "wait_unshard",
    "reshard",
    "reduce_grad",
    "finish_reduce",
    "prepare_unsharded_grad",
    "free_unsharded_grad",
)
_instances = itertools.count()


class DBufferInfo:
    """What a probe knows about one DBuffer: its group, its index in the group, its sizes."""

    __slots__ = ("dbuffer", "group", "index", "label", "unsharded_bytes", "cast_bytes", "reduce_cast_bytes")

    def __init__(self, dbuffer: DBuffer, group: str, index: int, dbuffers_in_group: int) -> None:
        self.dbuffer = dbuffer
        self.group = group
        self.index = index
        self.label = group if dbuffers_in_group == 1 else f"{group}#{index}"
        element = torch.empty((), dtype=dbuffer.param_dtype).element_size()
        self.unsharded_bytes = dbuffer.layout.buffer_numel * element
        self.cast_bytes = dbuffer.layout.segment_size * element if dbuffer.param_dtype != dbuffer.master_dtype else 0
        reduce_element = torch.empty((), dtype=dbuffer.reduce_dtype).element_size()
        self.reduce_cast_bytes = (
            dbuffer.layout.buffer_numel * reduce_element if dbuffer.reduce_dtype != dbuffer.param_dtype else 0
        )


class EngineProbe:
    """Cumulative counters of one sharded module, fed by the DBuffer wrappers."""

    def __init__(self, state: RaggedFSDPState) -> None:
        self.state = state
        self.dbuffers: list[DBufferInfo] = []
        for group in state.all_groups:
            for index, dbuffer in enumerate(group.dbuffers):
                self.dbuffers.append(DBufferInfo(dbuffer, group.name, index, len(group.dbuffers)))
        self.blocked_all_gather_seconds = 0.0
        self.blocked_reduce_seconds = 0.0
        self.engine_copy_bytes = 0
        self.unsharded_bytes = sum(info.unsharded_bytes for info in self.dbuffers if info.dbuffer.is_unsharded)
        self.unsharded_peak_bytes = self.unsharded_bytes
        self.grad_bytes = sum(info.unsharded_bytes for info in self.dbuffers if info.dbuffer.has_unsharded_grad)
        self.grad_peak_bytes = self.grad_bytes
        self.step = 0
        """Set by the caller (the Lightning callback sets the global step); named in diagnostics."""
        self.collective_timeout: float | None = None
        """Seconds, when known (the strategy's timeout); otherwise read from the backend's error."""
        self.diagnostics = True
        self._depth = 0
        self._sequence: dict[str, int] = {}
        self._pending_sequence: dict[tuple[int, str], int] = {}
        self._instance = next(_instances)
        self._originals: list[tuple[DBuffer, str, bool, Any]] = []
        for info in self.dbuffers:
            self._install(info)

    # ------------------------------------------------------------ counters
    def reset_peaks(self) -> None:
        """Start a new window for the peak gauges (at the current level)."""
        self.unsharded_peak_bytes = self.unsharded_bytes
        self.grad_peak_bytes = self.grad_bytes

    def group_key(self, dbuffer: DBuffer) -> str:
        """A name of the dbuffer's process group that is the same on every member rank."""
        group = dbuffer.process_group if dbuffer.process_group is not None else dist.group.WORLD
        return f"{getattr(group, 'group_name', 'world')}.{self._instance}"

    def _next_sequence(self, dbuffer: DBuffer, collective: str) -> None:
        key = self.group_key(dbuffer)
        number = self._sequence.get(key, 0) + 1
        self._sequence[key] = number
        self._pending_sequence[(id(dbuffer), collective)] = number

    def pending_sequence(self, dbuffer: DBuffer, collective: str) -> int:
        return self._pending_sequence.get((id(dbuffer), collective), 0)

    # ------------------------------------------------------------ wrappers
    def _install(self, info: DBufferInfo) -> None:
        dbuffer = info.dbuffer
        for name in _WRAPPED:
            had_own = name in dbuffer.__dict__
            original = getattr(dbuffer, name)
            self._originals.append((dbuffer, name, had_own, dbuffer.__dict__.get(name)))
            setattr(dbuffer, name, getattr(self, f"_wrap_{name}")(info, original))

    def remove(self) -> None:
        """Restore the DBuffers' own methods."""
        for dbuffer, name, had_own, previous in reversed(self._originals):
            if had_own:
                setattr(dbuffer, name, previous)
            else:
                dbuffer.__dict__.pop(name, None)
        self._originals.clear()
        if getattr(self.state, "_ragged_probe", None) is self:
            del self.state._ragged_probe

    def _fail(self, error: BaseException, info: DBufferInfo, collective: str) -> BaseException:
        if not self.diagnostics:
            return error
        from lightning_ragged.observability import diagnostics
        return diagnostics.translate(error, self, info, collective)

    def _collective_name(self, dbuffer: DBuffer) -> str:
        return "all_reduce" if dbuffer.reduce_mode == "all_reduce" else "reduce_scatter"

    def _blocking(self, info: DBufferInfo, collective: str, counter: str, call: Callable, **kwargs: Any) -> None:
        """``call(**kwargs)``, its time added to ``counter`` unless nested in another wrapped call; errors named."""
        outer = self._depth == 0
        self._depth += 1
        started = time.perf_counter()
        try:
            call(**kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised, with a name when we recognise it
            self.seconds_in_call = time.perf_counter() - started  # named in a lost-peer diagnostic
            raise self._fail(error, info, collective) from error
        finally:
            self._depth -= 1
            if outer:
                setattr(self, counter, getattr(self, counter) + time.perf_counter() - started)

    def _wrap_unshard(self, info: DBufferInfo, original: Callable) -> Callable:
        dbuffer = info.dbuffer

        def unshard(async_op: bool = False) -> None:
            if dbuffer.is_unsharded:
                return original(async_op=async_op)
            self._next_sequence(dbuffer, "all_gather")
            self._blocking(info, "all_gather", "blocked_all_gather_seconds", original, async_op=async_op)
            self.engine_copy_bytes += info.cast_bytes
            self.unsharded_bytes += info.unsharded_bytes
            if self.unsharded_bytes > self.unsharded_peak_bytes:
                self.unsharded_peak_bytes = self.unsharded_bytes

        return unshard

    def _wrap_wait_unshard(self, info: DBufferInfo, original: Callable) -> Callable:
        dbuffer = info.dbuffer

        def wait_unshard() -> None:
            if dbuffer._pending_unshard is None:
                return original()
            self._blocking(info, "all_gather", "blocked_all_gather_seconds", original)

        return wait_unshard

    def _wrap_reshard(self, info: DBufferInfo, original: Callable) -> Callable:
        dbuffer = info.dbuffer

        def reshard() -> None:
            was = dbuffer.is_unsharded
            original()
            if was and not dbuffer.is_unsharded:
                self.unsharded_bytes -= info.unsharded_bytes

        return reshard

    def _wrap_reduce_grad(self, info: DBufferInfo, original: Callable) -> Callable:
        dbuffer = info.dbuffer

        def reduce_grad(async_op: bool = True) -> None:
            collective = self._collective_name(dbuffer)
            self._next_sequence(dbuffer, collective)
            self._blocking(info, collective, "blocked_reduce_seconds", original, async_op=async_op)
            self.engine_copy_bytes += info.reduce_cast_bytes

        return reduce_grad

    def _wrap_finish_reduce(self, info: DBufferInfo, original: Callable) -> Callable:
        dbuffer = info.dbuffer

        def finish_reduce() -> None:
            if dbuffer._pending_reduce is None:
                return original()
            self._blocking(info, self._collective_name(dbuffer), "blocked_reduce_seconds", original)

        return finish_reduce

    def _wrap_prepare_unsharded_grad(self, info: DBufferInfo, original: Callable) -> Callable:
        dbuffer = info.dbuffer

        def prepare_unsharded_grad() -> None:
            was = dbuffer.has_unsharded_grad
            try:
                original()
            except BaseException as error:  # noqa: BLE001
                raise self._fail(error, info, "gradient buffer") from error
            if not was and dbuffer.has_unsharded_grad:
                self.grad_bytes += info.unsharded_bytes
                if self.grad_bytes > self.grad_peak_bytes:
                    self.grad_peak_bytes = self.grad_bytes

        return prepare_unsharded_grad

    def _wrap_free_unsharded_grad(self, info: DBufferInfo, original: Callable) -> Callable:
        dbuffer = info.dbuffer

        def free_unsharded_grad() -> None:
            was = dbuffer.has_unsharded_grad
            original()
            if was and not dbuffer.has_unsharded_grad:
                self.grad_bytes -= info.unsharded_bytes

        return free_unsharded_grad


def probe(module: nn.Module | RaggedFSDPState) -> EngineProbe:
    """The probe of a module sharded by ``fully_shard``, installed on first use (idempotent)."""
    state = module if isinstance(module, RaggedFSDPState) else get_state(module)
    existing = getattr(state, "_ragged_probe", None)
    if existing is None:
        existing = EngineProbe(state)
        state._ragged_probe = existing
    return existing


def sharded_states(module: nn.Module) -> Iterator[RaggedFSDPState]:
    """Every engine state in ``module``'s tree (the outermost sharded modules)."""
    seen: set[int] = set()
    for submodule in module.modules():
        state = getattr(submodule, "_ragged_fsdp_state", None)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            yield state
