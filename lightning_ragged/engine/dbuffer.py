"""DBuffer: the flat storage of one group, which is also its collective buffer.

Three flat tensors laid out by the planner:

* ``sharded`` (size S, master dtype): this rank's segment, persistent. The optimizer's
  parameters are 1-D views into it.
* ``unsharded`` (size m·S, compute dtype): allocated at unshard, freed at reshard. The
  module's parameters are fixed, original-shape views into it, so the all-gather
  writes every parameter in place: no copy-in, no copy-out.
* ``unsharded_grad`` (size m·S, compute dtype): autograd accumulates each parameter's
  gradient straight into its view; the collective reads the flat buffer as is.

Storage is freed and re-allocated with ``untyped_storage().resize_`` so the views (and
tensors autograd saved) stay valid across reshard/unshard. Group-level work (zeroing,
casting, scaling by 1/world) runs once on the flat tensors, never per parameter.

A DBuffer whose parameters are all frozen (``requires_grad=False``) never allocates a
gradient buffer and is never reduced; that is decided at every backward from the
parameters' current flags, so ``requires_grad_`` between steps takes effect at the next one.
Gradients follow DDP: a parameter no rank used in a backward keeps ``grad is None``;
``no_sync`` micro-batches accumulate in the reduce dtype.

The collective calls themselves are in ``collectives.py``. Observers (``events.py``) in
``observers`` hear of every all-gather, reduction and buffer (de)allocation.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_ragged.engine import collectives
from lightning_ragged.engine.collectives import REDUCE_MODES, CommStats, PendingCollective, default_reduce_mode
from lightning_ragged.engine.events import DBufferObserver, EventKind, notify, observed
from lightning_ragged.layout.spec import Layout
from lightning_ragged.layout.ragged_shard import RaggedShard

class DBuffer:
    """Flat sharded/unsharded/gradient storage for one group of parameters."""

    def __init__(
        self,
        layout: Layout,
        params: Sequence[tuple[str, nn.Parameter]],
        process_group: dist.ProcessGroup | None,
        *,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        reduce_mode: str | None = None,
        stats: CommStats | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.layout = layout
        self.process_group = process_group
        self.replicate_group = replicate_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        if layout.world_size != self.world_size:
            raise ValueError(f"layout planned for {layout.world_size} ranks but the shard group has {self.world_size}")
        self.reduce_mode = reduce_mode or default_reduce_mode(process_group)
        if self.reduce_mode not in REDUCE_MODES:
            raise ValueError(f"reduce_mode={reduce_mode!r} is not supported; use one of {REDUCE_MODES}")
        self.stats = stats if stats is not None else CommStats()
        self.observers: list[DBufferObserver] = []
        """Told of collectives and buffer (de)allocations (``events.py``); append to subscribe."""
        first = params[0][1]
        self.device = first.device if device is None else torch.device(device)
        if self.device.type == "meta":
            raise ValueError("parameters are on the meta device; pass fully_shard(..., device=...) to allocate shards")
        self.master_dtype = first.dtype
        self.param_dtype = param_dtype or self.master_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        segment = layout.segment_size
        self.segment = slice(self.rank * segment, (self.rank + 1) * segment)

        self.sharded = torch.zeros(segment, dtype=self.master_dtype, device=self.device)
        self.unsharded = torch.empty(self.world_size * segment, dtype=self.param_dtype, device=self.device)
        self.unsharded_grad = torch.empty_like(self.unsharded)
        self.sharded_grad: torch.Tensor | None = None
        self._unsharded_bytes = self.unsharded.untyped_storage().nbytes()
        self._accumulated: torch.Tensor | None = None
        """``no_sync`` micro-batches summed in the reduce dtype (only when it differs from the compute dtype)."""
        self._awaiting: set[str] = set()
        self._used: set[str] = set()
        self._grad_was_none: set[str] = set()
        self._partial: torch.Tensor | None = None
        self._partial_group: dist.ProcessGroup | None = None
        self._partial_size = 1
        # The all-gather writes through an alias with its own version counter: an async
        # gloo collective bumps its output's version on a background thread, which would
        # invalidate the parameter views autograd saved in forward.
        self._gather_target = torch.empty(0, dtype=self.param_dtype, device=self.device).set_(
            self.unsharded.untyped_storage(), 0, self.unsharded.shape
        )

        pieces = {name: (start, end, offset) for name, start, end, offset in layout.local_pieces(self.rank)}
        self.sharded_params: dict[str, nn.Parameter] = {}
        self.unsharded_params: dict[str, nn.Parameter] = {}
        self._unsharded_grad_views: dict[str, torch.Tensor] = {}
        self._sharded_grad_slices: dict[str, slice] = {}
        with torch.no_grad():
            for name, param in params:
                start, end, offset = pieces.get(name, (0, 0, 0))
                local = slice(offset, offset + end - start)
                if not param.is_meta:
                    self.sharded[local].copy_(param.detach().reshape(-1)[start:end])
                sharded_param = nn.Parameter(self.sharded[local], requires_grad=param.requires_grad)
                sharded_param.ragged_shard = RaggedShard(
                    name, param.shape, layout.specs[name].granularity, layout.ranges(name), self.rank, process_group
                )
                self.sharded_params[name] = sharded_param
                self._sharded_grad_slices[name] = local
                begin = layout.offsets[name]
                full = slice(begin, begin + param.numel())
                self.unsharded_params[name] = nn.Parameter(
                    self.unsharded[full].view(param.shape), requires_grad=param.requires_grad
                )
                self._unsharded_grad_views[name] = self.unsharded_grad[full].view(param.shape)
        _free(self.unsharded)
        _free(self.unsharded_grad)
        self._pending_unshard: PendingCollective | None = None
        self._pending_reduce: PendingCollective | None = None

    # ----------------------------------------------------------------- unshard
    @property
    def is_unsharded(self) -> bool:
        return _is_allocated(self.unsharded)

    @property
    def unshard_pending(self) -> bool:
        """An all-gather was issued and not waited for yet."""
        return self._pending_unshard is not None

    def unshard(self, async_op: bool = False) -> None:
        """All-gather every rank's segment straight into the unsharded buffer (the parameters' storage)."""
        if self.is_unsharded:
            return
        observed(self, EventKind.UNSHARD_ISSUED, "all_gather", self._issue_unshard, async_op)
        if not async_op:
            self.wait_unshard()

    def _issue_unshard(self, async_op: bool) -> None:
        started = time.perf_counter()
        _allocate(self.unsharded, self._unsharded_bytes)
        if self._partial is not None:  # kept by reshard_after_forward=int: gather inside the smaller group
            source, group, self._partial = self._partial, self._partial_group, None
        else:
            source = self.sharded if self.param_dtype == self.master_dtype else self.sharded.to(self.param_dtype)
            group = self.process_group
        pending = collectives.all_gather(self._gather_target, source, group, async_op, started)
        self.stats.all_gathers += 1
        self.stats.all_gather_bytes += self.unsharded.numel() * self.unsharded.element_size()
        self._pending_unshard = pending

    def wait_unshard(self) -> None:
        if self._pending_unshard is None:
            return
        observed(self, EventKind.UNSHARD_WAITED, "all_gather", self._wait_unshard)

    def _wait_unshard(self) -> None:
        self.stats.all_gather_seconds += self._pending_unshard.wait()
        self._pending_unshard = None

    def reshard(self) -> None:
        """Free the unsharded buffer (and a kept part of it); the parameter views stay valid for the next unshard."""
        self.wait_unshard()
        self._partial = None
        self._free_unsharded()

    def _free_unsharded(self) -> None:
        storage = self.unsharded.untyped_storage()
        if storage.nbytes() > 0:
            storage.resize_(0)
            if self.observers:
                notify(self, EventKind.RESHARDED)

    def set_partial_group(self, group: dist.ProcessGroup, size: int) -> None:
        """``reshard_after_forward=size``: after forward keep 1/size of the buffer, re-gathered inside ``group``."""
        if self.world_size % size:
            raise ValueError(f"reshard_after_forward={size} must divide the shard group's {self.world_size} ranks")
        self._partial_group, self._partial_size = group, size

    def reshard_to_partial(self) -> None:
        """Keep this rank's 1/size of the full buffer (one flat copy), free the rest.

        Member j of each group of ``size`` consecutive ranks keeps the j-th contiguous
        chunk, so an all-gather inside the group writes the whole buffer back in place.
        """
        self.wait_unshard()
        if self._partial_group is None or not self.is_unsharded:
            self.reshard()
            return
        chunk = self.unsharded.numel() // self._partial_size
        index = dist.get_rank(self._partial_group)
        self._partial = self.unsharded[index * chunk : (index + 1) * chunk].clone()
        self._free_unsharded()

    # --------------------------------------------------------------- gradients
    @property
    def trainable(self) -> bool:
        """True while any of its parameters requires a gradient (checked at every use)."""
        return any(param.requires_grad for param in self.sharded_params.values())

    @property
    def has_unsharded_grad(self) -> bool:
        return _is_allocated(self.unsharded_grad)

    @property
    def has_grad_to_reduce(self) -> bool:
        """A gradient buffer or ``no_sync`` accumulation waits for the reduction."""
        return self.has_unsharded_grad or self._accumulated is not None

    def sync_requires_grad(self) -> list[tuple[str, nn.Parameter]]:
        """Mirror the shards' ``requires_grad`` onto the full parameters; return those that just became trainable."""
        changed = []
        for name, sharded in self.sharded_params.items():
            full = self.unsharded_params[name]
            if full.requires_grad != sharded.requires_grad:
                full.requires_grad_(sharded.requires_grad)
                if sharded.requires_grad:
                    changed.append((name, full))
        return changed

    def prepare_unsharded_grad(self) -> None:
        """Allocate and zero the gradient buffer once, and point every trainable ``param.grad`` into it."""
        if self.has_unsharded_grad or not self.trainable:
            return
        observed(self, EventKind.GRAD_BUFFER_ALLOCATED, None, self._allocate_grad)

    def _allocate_grad(self) -> None:
        _allocate(self.unsharded_grad, self._unsharded_bytes)
        self.unsharded_grad.zero_()
        for name, param in self.unsharded_params.items():
            if param.requires_grad:
                param.grad = self._unsharded_grad_views[name]

    def begin_backward(self) -> None:
        """Start counting this backward's gradients (see :meth:`grad_arrived`)."""
        self._awaiting = {name for name, p in self.unsharded_params.items() if p.requires_grad}

    def grad_arrived(self, name: str) -> bool:
        """Record that autograd finished ``name``'s gradient; True when it was the last one awaited.

        A gradient autograd produced as a tensor of its own (it existed before the
        buffer did) is added into the buffer.
        """
        param = self.unsharded_params[name]
        view = self._unsharded_grad_views[name]
        if param.grad is not view:
            stray = param.grad
            self.prepare_unsharded_grad()
            if stray is not None and stray is not view:
                view.add_(stray)
            param.grad = view
        self._used.add(name)
        if name not in self._awaiting:
            return False
        self._awaiting.discard(name)
        return not self._awaiting

    def stash_unsynced_grad(self) -> None:
        """After a ``no_sync`` backward: fold the compute-dtype gradients into the reduce-dtype sum.

        With equal dtypes the gradient buffer itself keeps accumulating; otherwise one
        flat ``add_`` into a reduce-dtype buffer per micro-batch (as FSDP2 accumulates),
        and the compute-dtype buffer is freed.
        """
        if self.reduce_dtype == self.param_dtype or not self.has_unsharded_grad:
            return
        if self._accumulated is None:
            self._accumulated = self.unsharded_grad.to(self.reduce_dtype)
        else:
            self._accumulated.add_(self.unsharded_grad)
        self.free_unsharded_grad()

    def reduce_grad(self, async_op: bool = True) -> None:
        """Sum the flat gradient buffer over the shard group, in place (all-reduce) or into S (reduce-scatter)."""
        observed(self, EventKind.REDUCE_ISSUED, self.reduce_mode, self._issue_reduce, async_op)
        if not async_op:
            self.finish_reduce()

    def _issue_reduce(self, async_op: bool) -> None:
        started = time.perf_counter()
        if self.reduce_dtype == self.param_dtype:
            full = self.unsharded_grad
        else:
            if self._accumulated is None:
                full = self.unsharded_grad.to(self.reduce_dtype)
            else:
                full, self._accumulated = self._accumulated, None
                if self.has_unsharded_grad:
                    full.add_(self.unsharded_grad)
            self.free_unsharded_grad()
        pending = collectives.reduce(full, self.reduce_mode, self.process_group, self.segment, async_op, started)
        self.stats.reduces += 1
        self.stats.reduce_bytes += full.numel() * full.element_size()
        self._pending_reduce = pending

    @property
    def reduce_pending(self) -> bool:
        return self._pending_reduce is not None

    def finish_reduce(self) -> None:
        """Wait for the reduction and write this rank's averaged segment into the sharded gradients."""
        if self._pending_reduce is None:
            return
        observed(self, EventKind.REDUCE_WAITED, self.reduce_mode, self._finish_reduce)

    def _finish_reduce(self) -> None:
        pending = self._pending_reduce
        self._pending_reduce = None
        self.stats.reduce_seconds += pending.wait()
        own_segment = pending.keep_alive[1]
        divisor = self.world_size
        if self.replicate_group is not None:
            collectives.all_reduce(own_segment, self.replicate_group)
            divisor *= dist.get_world_size(self.replicate_group)
        self._accumulate_sharded_grad(own_segment, 1.0 / divisor)
        self.free_unsharded_grad()

    def _accumulate_sharded_grad(self, own_segment: torch.Tensor, scale: float) -> None:
        """One flat op: ``sharded_grad = scale·segment`` (fresh) or ``+=`` (accumulating).

        A fresh write moves the segment into the persistent gradient in the same pass
        that scales it, so taking the own segment costs no extra copy.
        """
        params = list(self.sharded_params.items())
        self._grad_was_none = {name for name, param in params if param.grad is None}
        fresh = len(self._grad_was_none) == len(params)
        if self.sharded_grad is None:
            self.sharded_grad = torch.empty(self.layout.segment_size, dtype=self.master_dtype, device=self.device)
            if not fresh:
                self.sharded_grad.zero_()
        if fresh:
            torch.mul(own_segment, scale, out=self.sharded_grad)
        else:
            for name, param in params:
                view = self.sharded_grad[self._sharded_grad_slices[name]]
                if param.grad is None:
                    view.zero_()
                elif param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad)
            self.sharded_grad.add_(own_segment, alpha=scale)
        for name, param in params:
            if param.requires_grad:
                param.grad = self.sharded_grad[self._sharded_grad_slices[name]]

    @property
    def trainable_count(self) -> int:
        return sum(1 for p in self.sharded_params.values() if p.requires_grad)

    def used_flags(self) -> list[bool]:
        """Per trainable parameter (in order): did a gradient reach it since the last reduction?"""
        return [name in self._used for name, p in self.sharded_params.items() if p.requires_grad]

    def settle_unused(self, used_anywhere: Sequence[bool]) -> None:
        """After the reduction: a parameter no rank used keeps ``grad is None`` (as DDP and FSDP2)."""
        trainable = [name for name, p in self.sharded_params.items() if p.requires_grad]
        for name, used in zip(trainable, used_anywhere):
            if not used and name in self._grad_was_none:
                self.sharded_params[name].grad = None
        self._used.clear()

    def reset(self) -> None:
        """Forget a step that failed (an exception in forward or backward): finish issued
        collectives so every rank stays paired, free the full and gradient buffers."""
        self.wait_unshard()
        if self._pending_reduce is not None:
            self._pending_reduce.wait()
            self._pending_reduce = None
        self._accumulated = None
        self._awaiting.clear()
        self._used.clear()
        self.free_unsharded_grad()
        self._free_unsharded()

    def release_unused_sharded_grad(self) -> None:
        """Drop the persistent gradient segment while no parameter points into it.

        After ``optimizer.zero_grad(set_to_none=True)`` nothing uses it until the next
        reduction re-creates it, so forward and backward run without these P/W bytes.
        """
        if self.sharded_grad is not None and all(p.grad is None for p in self.sharded_params.values()):
            self.sharded_grad = None

    def free_unsharded_grad(self) -> None:
        """Detach the parameters' gradients from the buffer and free it."""
        for param in self.unsharded_params.values():
            param.grad = None
        storage = self.unsharded_grad.untyped_storage()
        if storage.nbytes() > 0:
            storage.resize_(0)
            if self.observers:
                notify(self, EventKind.GRAD_BUFFER_FREED)

    # ------------------------------------------------------------- full views
    def gather_full(self) -> dict[str, torch.Tensor]:
        """Full, original-shape copies of every parameter in master dtype (for state dicts)."""
        full = torch.empty(self.world_size * self.layout.segment_size, dtype=self.master_dtype, device=self.device)
        collectives.all_gather(full, self.sharded, self.process_group)
        out = {}
        for name, param in self.unsharded_params.items():
            begin = self.layout.offsets[name]
            out[name] = full[begin : begin + param.numel()].view(param.shape).clone()
        return out

    def load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy this rank's pieces of full tensors (some or all of this buffer's) into the sharded segment."""
        with torch.no_grad():
            for name, tensor in tensors.items():
                param = self.sharded_params[name]
                param.copy_(param.ragged_shard.local_part(tensor))


def _is_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() > 0


def _allocate(tensor: torch.Tensor, nbytes: int) -> None:
    if tensor.untyped_storage().nbytes() != nbytes:
        tensor.untyped_storage().resize_(nbytes)


def _free(tensor: torch.Tensor) -> None:
    if tensor.untyped_storage().nbytes() > 0:
        tensor.untyped_storage().resize_(0)
