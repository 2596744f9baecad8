"""DBuffer: the flat storage of one group, which is also its collective buffer.

Three flat tensors laid out by the planner:
* ``sharded`` (size S, master dtype): this rank's segment, persistent. The optimizer's parameters are 1-D views into it.
* ``unsharded`` (size m·S, compute dtype): allocated at unshard (an fp8 gather's at its wait, where the dequantize
  writes it), freed at reshard. The module's parameters are fixed, original-shape views into it, so the all-gather
  writes every parameter in place: no copy-in, no copy-out.
* ``unsharded_grad`` (size m·S, ``grad_dtype``): allocated when the DBuffer's first gradient arrives
  (not at the group's backward pre-hook: no buffer waits through earlier groups' backward); the collective
  reads it. With equal compute and reduce dtypes it is zeroed then and every ``param.grad`` points at its
  view, so autograd accumulates in place (no copy). With a reduce dtype of its own each gradient lands by one
  copy into its view (later ones by ``add_``) and only what no gradient writes is zeroed (padding, parameters
  no gradient reached). It is in the narrower dtype (bf16 under bf16-mixed, as FSDP2 holds gradients until
  its reduce-scatter), summed in the reduce dtype; ``no_sync`` micro-batches accumulate in the reduce dtype.

Storage is freed and re-allocated with ``untyped_storage().resize_`` so the views (and tensors autograd saved) stay
valid. Group-level work runs once on the flat tensors, never per parameter. A DBuffer whose parameters are all
frozen never allocates a gradient buffer and is never reduced (decided at every backward from the current flags).
A parameter no rank used keeps ``grad is None`` (DDP).

**A single rank** (``single_rank``: one rank in the shard group, no HSDP): no collective, no copy. Without a cast or
fp8 the full buffer *is* the segment (``full_is_shard``): unshard/reshard only swap the module's views (no event).
With a cast, the cast written into the full buffer is the "gather" (``keep_cast_shard`` keeps nothing). The
gradient buffer, a tensor of its own each backward, is adopted as the sharded gradient (``sharded_grad.py``).

Collectives (FSDP2's custom ones: ``custom``) are ``collectives.py``'s, on ``streams.py``'s comm streams (no-op on CPU); the
gather's source is ``shard_cast.py``'s (``partial_reshard.py``, ``fp8_gather.py``); ``observers`` (``events.py``) hear of each.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_ragged.engine import collectives, storage
from lightning_ragged.engine.collectives import CommStats, CustomComms, PendingCollective, resolve_reduce_mode
from lightning_ragged.engine.events import DBufferObserver, EventKind, notify, observed
from lightning_ragged.engine.partial_reshard import PartialReshard
from lightning_ragged.engine.shard_cast import ShardCast
from lightning_ragged.engine.sharded_grad import ShardedGrad
from lightning_ragged.engine.streams import NO_STREAMS, CommStreams
from lightning_ragged.layout.spec import Layout
from lightning_ragged.layout.ragged_shard import RaggedShard

if TYPE_CHECKING:
    from lightning_ragged.engine.fp8_gather import Fp8Gather


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
        gather_mode: str | None = None,
        stats: CommStats | None = None,
        device: torch.device | None = None,
        keep_cast_shard: bool = False,
    ) -> None:
        self.layout = layout
        self.process_group = process_group
        self.replicate_group = replicate_group
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.gradient_divide_factor = float(self.world_size * replicas)  # the reduced sum is divided by it (FSDP2's)
        self.single_rank = self.world_size == 1 and replicate_group is None  # no peer: nothing gathered or reduced
        if layout.world_size != self.world_size:
            raise ValueError(f"layout planned for {layout.world_size} ranks but the shard group has {self.world_size}")
        self.stats = stats if stats is not None else CommStats()
        self.observers: list[DBufferObserver] = []
        """Told of collectives and buffer (de)allocations (``events.py``); append to subscribe."""
        self.streams: CommStreams = NO_STREAMS
        """The comm streams its collectives run on (``streams.py``), the model's (``RaggedFSDPState``)."""
        self._fp8_gather: Fp8Gather | None = None
        self.custom = CustomComms()  # FSDP2's set_custom_all_gather, set_custom_reduce_scatter, set_all_reduce_hook
        first = params[0][1]
        self.device = first.device if device is None else torch.device(device)
        if self.device.type == "meta":
            raise ValueError("parameters are on the meta device; pass fully_shard(..., device=...) to allocate shards")
        self.reduce_mode = resolve_reduce_mode(reduce_mode, process_group, self.device)
        self.gather_mode = collectives.resolve_gather_mode(gather_mode, process_group, self.device)
        self.master_dtype = first.dtype
        self.param_dtype = param_dtype or self.master_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.grad_dtype = min((self.reduce_dtype, self.param_dtype), key=lambda dtype: dtype.itemsize)  # tie: reduce
        self.shard_cast = ShardCast(self.param_dtype, keep_cast_shard)
        segment = layout.segment_size
        self.segment = slice(self.rank * segment, (self.rank + 1) * segment)

        self.sharded = torch.zeros(segment, dtype=self.master_dtype, device=self.device)
        self._grad_placeholders = {
            dtype: torch.empty(self.world_size * segment, dtype=dtype, device=self.device)
            for dtype in (self.grad_dtype, self.reduce_dtype)
        }
        """Freed gradient buffers, one per dtype (``no_sync``: the reduce dtype); storage at allocation."""
        self.unsharded_grad = self._grad_placeholders[self.grad_dtype]
        self._shapes = {name: param.shape for name, param in params}
        self._land_by_copy = self.reduce_dtype != self.param_dtype
        """Gradients land in the buffer by a copy (in the compute dtype, or cast: the narrower one)."""
        self._landed: set[str] = set()
        """Parameters whose gradient is in the buffer since it was allocated (``_land_by_copy`` only)."""
        self._padding = storage.padding(layout, self.world_size * segment)
        self._used: set[str] = set()
        self._partial: torch.Tensor | None = None  # the part kept by ``partial_reshard``, until gathered
        self.partial_reshard: PartialReshard | None = None  # reshard_after_forward=int: its smaller gather group
        self._gathered = False  # full_is_shard only: the module computes with the full views now

        pieces = {name: (start, end, offset) for name, start, end, offset in layout.local_pieces(self.rank)}
        self.sharded_params: dict[str, nn.Parameter] = {}
        slices: dict[str, slice] = {}
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
                slices[name] = local
        self._grad = ShardedGrad(slices, segment, self.master_dtype, self.device)
        self._build_full(alias=self.single_rank and self.param_dtype == self.master_dtype)
        self._view_grad_buffer()
        for placeholder in self._grad_placeholders.values():
            storage.free(placeholder)
        self._pending_unshard: PendingCollective | None = None
        self._pending_reduce: PendingCollective | None = None
        self.holds = False  # the last reduction was over the shard group only (HSDP, ``all_reduce=False``)
        self.carry_frozen = False  # this reduction follows a no_sync backward: frozen shards may carry gradients
        self._held: torch.Tensor | None = None  # the sums it held, added in before the next replica all-reduce

    def _build_full(self, alias: bool) -> None:
        """The full buffer and the parameters' original-shape views into it; ``alias``: it is the segment itself."""
        self.full_is_shard = alias
        """Single rank, no cast, no fp8: the full buffer is ``sharded`` (nothing gathered, allocated or freed)."""
        self.unsharded = self.sharded if alias else torch.empty(
            self.full_numel, dtype=self.param_dtype, device=self.device)
        self._unsharded_bytes = self.unsharded.untyped_storage().nbytes()
        # The all-gather writes through an alias with its own version counter: an async
        # gloo collective bumps its output's version on a background thread, which would
        # invalidate the parameter views autograd saved in forward.
        self._gather_target = torch.empty(0, dtype=self.param_dtype, device=self.device).set_(
            self.unsharded.untyped_storage(), 0, self.unsharded.shape
        )
        self.unsharded_params: dict[str, nn.Parameter] = {
            name: nn.Parameter(self.full_view(self.unsharded, name), requires_grad=shard.requires_grad)
            for name, shard in self.sharded_params.items()
        }
        if not alias:
            storage.free(self.unsharded)

    def _view_grad_buffer(self) -> None:
        self._unsharded_grad_views = {name: self.full_view(self.unsharded_grad, name) for name in self._shapes}
        self._views_of = self.unsharded_grad

    @property
    def fp8_gather(self) -> Fp8Gather | None:
        """Set by ``fully_shard(fp8_all_gather=...)``: the all-gather carries fp8 bytes and tile scales."""
        return self._fp8_gather

    @fp8_gather.setter
    def fp8_gather(self, value: Fp8Gather | None) -> None:
        self._fp8_gather = value
        if value is not None and self.full_is_shard:
            self._build_full(alias=False)

    # ----------------------------------------------------------------- unshard
    @property
    def is_unsharded(self) -> bool:
        return self._gathered if self.full_is_shard else storage.is_allocated(self.unsharded)

    @property
    def unshard_pending(self) -> bool:
        """An all-gather was issued and not waited for yet."""
        return self._pending_unshard is not None

    def unshard(self, async_op: bool = False) -> None:
        """All-gather every rank's segment straight into the unsharded buffer (the parameters' storage)."""
        if self.is_unsharded or self.unshard_pending:  # an fp8 gather allocates its buffer at the wait
            return
        if self.full_is_shard:  # the full views alias the shards: nothing to gather
            self._gathered = True
            return
        observed(self, EventKind.UNSHARD_ISSUED, "all_gather", self._issue_unshard, async_op)
        if not async_op:
            self.wait_unshard()

    def _issue_unshard(self, async_op: bool) -> None:
        """On compute: a kept cast or fp8 chunk (``issue`` reuses it), made here so that its memory is
        compute's once dropped (``shard_cast.py``); the rest on the all-gather stream (:meth:`_gather`)."""
        started, partial = time.perf_counter(), self._partial is not None
        fp8 = self.fp8_gather is not None and not partial
        kept = None if fp8 or partial or self.single_rank else self.shard_cast.kept(self.sharded)
        if fp8:
            self.fp8_gather.source.kept(self.sharded)
        self._on_stream(True, lambda issued_async: self._gather(issued_async, started, fp8, kept), async_op)

    def _gather(self, async_op: bool, started: float, fp8: bool, kept: torch.Tensor | None) -> None:
        """On the all-gather stream: the full buffer (fp8's at the wait, where its dequantize writes it), the gather."""
        if fp8:  # fp8 on the wire: its chunk and received bytes live until the wait
            pending = self.fp8_gather.issue(
                self._gather_target, self.sharded, self.process_group, async_op, started, self.gather_mode)
            sent = self.fp8_gather.wire_bytes
        else:
            storage.allocate(self.unsharded, self._unsharded_bytes)
            if self.single_rank:  # with a cast (else ``full_is_shard``): the cast is the gather, no collective
                self.shard_cast.cast_into(self._gather_target, self.sharded)
                self._pending_unshard = PendingCollective(None, started, self.sharded)
                return
            if self._partial is not None:  # kept by reshard_after_forward=int: gather inside the smaller group
                source, group, self._partial = self._partial, self.partial_reshard.group, None
            else:  # a fresh cast is transient: the next one reuses its block on this stream
                source, group = kept if kept is not None else self.shard_cast.of(self.sharded), self.process_group
            pending = collectives.all_gather(
                self._gather_target, source, group, async_op, started, self.custom.all_gather, self.gather_mode)
            sent = self.unsharded.numel() * self.unsharded.element_size()
        self._pending_unshard = pending
        self.stats.all_gathers += 1
        self.stats.all_gather_bytes += sent if self.world_size > 1 else 0  # HSDP, one rank per shard group: no peer

    def wait_unshard(self) -> None:
        if self._pending_unshard is None:
            return
        observed(self, EventKind.UNSHARD_WAITED, "all_gather", self._wait_unshard)

    def _wait_unshard(self) -> None:
        storage.allocate(self.unsharded, self._unsharded_bytes)  # fp8's, on compute; allocated at issue otherwise
        self.stats.all_gather_seconds += self._pending_unshard.wait()
        self._pending_unshard = None

    def reshard(self) -> None:
        """Free the unsharded buffer (and a kept part of it); the parameter views stay valid for the next unshard."""
        self.wait_unshard()
        self._partial = None
        self._free_unsharded()

    def _free_unsharded(self) -> None:
        if self.full_is_shard:
            self._gathered = False
        elif storage.free(self.unsharded) and self.observers:
            notify(self, EventKind.RESHARDED)

    def _on_stream(self, gather: bool, call: Callable[[bool], None], async_op: bool) -> None:
        """Issue the all-gather (or the reduction) on its comm stream; its wait makes compute wait for it."""
        side = self.streams.all_gather if gather else self.streams.reduce
        event = self.streams.issue(side, call, async_op)
        (self._pending_unshard if gather else self._pending_reduce).on_stream(self.streams, event)

    def set_partial_group(self, group: dist.ProcessGroup, size: int) -> None:
        """``reshard_after_forward=size``: after forward keep 1/size of the buffer, re-gathered inside ``group``."""
        self.partial_reshard = PartialReshard(self.world_size, group, size)

    def reshard_to_partial(self) -> None:
        """Keep this rank's 1/size of the full buffer (``partial_reshard.py``), free the rest."""
        self.wait_unshard()
        if self.partial_reshard is None or not self.is_unsharded:
            self.reshard()
            return
        self._partial = self.partial_reshard.keep(self.unsharded)
        self._free_unsharded()

    # --------------------------------------------------------------- gradients
    @property
    def trainable(self) -> bool:
        """True while any of its parameters requires a gradient (checked at every use)."""
        return any(param.requires_grad for param in self.sharded_params.values())

    @property
    def has_unsharded_grad(self) -> bool:
        return storage.is_allocated(self.unsharded_grad)

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

    def ensure_grad_buffer(self, accumulate: bool = False) -> None:
        """Allocate the gradient buffer (first gradient, or a reduction that got none); ``no_sync``: reduce dtype."""
        if not self.has_unsharded_grad:
            dtype = self.reduce_dtype if accumulate else self.grad_dtype
            observed(self, EventKind.GRAD_BUFFER_ALLOCATED, None, self._allocate_grad, dtype)

    def _allocate_grad(self, dtype: torch.dtype) -> None:
        if self.single_rank:  # a tensor of its own each backward: the reduction adopts it (sharded_grad.py)
            self.unsharded_grad = torch.empty(self.full_numel, dtype=dtype, device=self.device)
            self._view_grad_buffer()
        else:
            target = self._grad_placeholders[dtype]
            storage.allocate(target, self.full_numel * dtype.itemsize)  # first: an OOM here changes nothing
            self.unsharded_grad = target
            if self._views_of is not target:
                self._view_grad_buffer()
        if self._land_by_copy:  # gradients will write their views: zero only the padding between them
            for gap in self._padding:
                self.unsharded_grad[gap].zero_()
            return
        self.unsharded_grad.zero_()
        for name, param in self.unsharded_params.items():
            if param.requires_grad:
                param.grad = self._unsharded_grad_views[name]

    def grad_arrived(self, name: str, accumulate: bool = False) -> None:
        """Land ``name``'s gradient, which autograd just finished, and record that it was used.

        The first gradient of the DBuffer allocates the buffer (``accumulate``: under ``no_sync``).
        A gradient autograd produced as a tensor of its own is copied (its first) or added into
        its view; with ``param.grad`` pointing at the view, autograd has already accumulated it there.
        """
        param = self.unsharded_params[name]
        arrived = param.grad
        if self._land_by_copy or arrived is not self._unsharded_grad_views.get(name):
            self.ensure_grad_buffer(accumulate)  # may make new views
            view = self._unsharded_grad_views[name]
            if not self._land_by_copy:
                if arrived is not None and arrived is not view:
                    view.add_(arrived)
            elif name in self._landed:
                view.add_(arrived)
            else:
                view.copy_(arrived)
                self._landed.add(name)
            param.grad = None if self._land_by_copy else view
        self._used.add(name)

    def reduce_grad(self, async_op: bool = True, all_reduce: bool = True) -> None:
        """Sum the flat gradient buffer over the shard group: into S in place (pairwise, all-reduce) or apart
        (reduce-scatter); then over the replicas (HSDP). ``all_reduce=False`` (FSDP2's ``set_requires_all_reduce``):
        no replica all-reduce, this rank's sum is held (no gradient written) and joins the next one's."""
        self.holds = not all_reduce and self.replicate_group is not None
        observed(self, EventKind.REDUCE_ISSUED, self.reduce_mode, self._on_stream, False, self._issue_reduce, async_op)
        if not async_op:
            self.finish_reduce()

    def _issue_reduce(self, async_op: bool) -> None:
        started = time.perf_counter()
        full = self.unsharded_grad
        if self._land_by_copy:  # what no gradient wrote reduces as zeros
            for name, view in self._unsharded_grad_views.items():
                if name not in self._landed:
                    view.zero_()
        if self.single_rank:  # summed already: the buffer is this rank's whole segment
            self._pending_reduce = PendingCollective(None, started, full, full)
            return
        self._pending_reduce = collectives.reduce(
            full, self.reduce_mode, self.process_group, self.segment, async_op, started,
            None if self.holds else self.replicate_group, self.stats, self.reduce_dtype, self._held,
            self.custom.reduce_scatter,
        )

    @property
    def reduce_pending(self) -> bool:
        return self._pending_reduce is not None

    def finish_reduce(self) -> None:
        """Wait for the reduction; write this rank's segment over ``gradient_divide_factor`` into the sharded grads."""
        if self._pending_reduce is None:
            return
        observed(self, EventKind.REDUCE_WAITED, self.reduce_mode, self._finish_reduce)

    def _finish_reduce(self) -> None:
        pending = self._pending_reduce
        self._pending_reduce = None
        self.stats.reduce_seconds += pending.wait()
        own_segment = pending.keep_alive[1]
        if self.holds:
            self._held = own_segment.clone() if self._held is None else self._held.add_(own_segment)
            self.free_unsharded_grad()
            return
        self._held = None  # added in by the replica all-reduce
        scale = 1.0 / self.gradient_divide_factor
        if self.custom.all_reduce_hook is not None:  # it sees the divided segment, in the reduce dtype (FSDP2's)
            own_segment, scale = collectives.run_all_reduce_hook(
                self.custom, own_segment, scale, self.reduce_dtype, self.streams), 1.0
        carrying = self._grad.carrying(self.sharded_params, self.carry_frozen)
        adopted = self._grad.write(self.sharded_params, own_segment, scale, self.single_rank, carrying)
        self.free_unsharded_grad(adopted=adopted)

    def used_flags(self) -> list[bool]:  # per shard the reduction gives a gradient: did one reach it since the last?
        return [name in self._used for name in self._grad.carrying(self.sharded_params, self.carry_frozen)]

    def settle_unused(self, used_anywhere: Sequence[bool]) -> None:
        """After the reduction: a parameter no rank used keeps ``grad is None`` (as DDP and FSDP2)."""
        self._grad.settle_unused(self.sharded_params, self._grad.carrying(self.sharded_params, self.carry_frozen), used_anywhere)
        self._used.clear()

    def run_post_accumulate_grad_hooks(self) -> None:
        self._grad.run_post_accumulate_grad_hooks(self.sharded_params)

    def reset(self) -> None:
        """Forget a step that failed (an exception in forward or backward): finish issued
        collectives so every rank stays paired, free the full and gradient buffers."""
        self.wait_unshard()
        if self._pending_reduce is not None:
            self._pending_reduce.wait()
            self._pending_reduce = None
        self._used.clear()
        self.free_unsharded_grad()
        self._held = self._partial = None  # held sums are dropped; a kept part (reshard_after_forward=int): stale
        self._free_unsharded()

    @property
    def sharded_grad(self) -> torch.Tensor | None:
        """This rank's flat gradient segment while any shard's ``.grad`` still points into it (``sharded_grad.py``)."""
        return self._grad.flat

    @sharded_grad.setter
    def sharded_grad(self, value: torch.Tensor | None) -> None:
        self._grad.flat = value

    def free_unsharded_grad(self, adopted: bool = False) -> None:
        """Detach the parameters' gradients from the buffer and free it (``adopted``: now the sharded gradient)."""
        for param in self.unsharded_params.values():
            param.grad = None
        self._landed.clear()
        if adopted:  # single rank: forget the buffer and its views, which would keep it alive
            self.unsharded_grad = self._grad_placeholders[self.grad_dtype]
            self._unsharded_grad_views, self._views_of = {}, None
        if (adopted or storage.free(self.unsharded_grad)) and self.observers:
            notify(self, EventKind.GRAD_BUFFER_FREED)

    # ------------------------------------------------------------- full views
    @property
    def full_numel(self) -> int:
        """Elements of the full (m·S) flat buffer: every rank's segment."""
        return self.world_size * self.layout.segment_size

    def full_view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """``name``'s original-shape view into a full flat buffer laid out as this DBuffer (any dtype or device)."""
        shape, begin = self._shapes[name], self.layout.offsets[name]
        return flat[begin : begin + shape.numel()].view(shape)
