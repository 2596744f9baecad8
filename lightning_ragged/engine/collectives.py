"""The engine's collectives: which backend call a DBuffer issues, and waiting for it.

A DBuffer (``dbuffer.py``) owns storage and views; the calls that move that storage
between ranks are here: the all-gather of the shards into the full buffer (the backend's, or
``pairwise.py``'s from point-to-point sends, chosen by ``resolve_gather_mode``), the
reduction of the flat gradient (all-reduce in place, the backend's reduce-scatter into this
rank's segment, or ``pairwise.py``'s reduce-scatter from point-to-point sends, chosen by
``resolve_reduce_mode``), and the small all-reduces that follow
(HSDP's replicas, the runtime's "which parameters got a gradient" flags). Issuing one
returns a :class:`PendingCollective` that keeps its tensors alive until it is waited for; on an
accelerator the DBuffer issues it on a comm stream (``streams.py``) and waiting for it makes the
compute stream wait that stream's event. HSDP's replica all-reduce follows the shard reduction:
at once when that one is synchronous (on a device: ordered on the reduce stream), else at its wait.
FSDP2's custom communication (:class:`CustomComms`: ``set_custom_all_gather``, ``set_custom_reduce_scatter``,
``set_all_reduce_hook``) replaces a DBuffer's call here with the user's.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from lightning_ragged.engine.pairwise import PairwiseGather, PairwiseReduce
from lightning_ragged.engine.streams import NO_STREAMS, CommStreams

REDUCE_MODES = ("all_reduce", "reduce_scatter", "pairwise")
GATHER_MODES = ("all_gather", "pairwise")

# torch 2.13 renamed the flat collectives (the old names still work there, deprecated);
# the new names where they exist, the old ones on torch 2.9-2.12.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Collectives issued by the engine: counts, bytes on the wire per rank, and time."""

    all_gathers: int = 0
    """Collectives only: on a single rank (no HSDP) 0 but for fp8 DBuffers: the full buffer is the shard or its cast."""
    all_gather_bytes: int = 0
    all_gather_seconds: float = 0.0
    reduces: int = 0
    """Reductions over the shard process group (0 on a single rank without HSDP)."""
    reduce_bytes: int = 0
    reduce_seconds: float = 0.0
    flag_syncs: int = 0
    """Small all-reduces of "which parameters got a gradient" (one per synchronized backward; 0 on a single rank)."""
    flag_reads: int = 0
    """Of those, the ones read back to the host (a device sync on NCCL): only when this rank missed a gradient."""
    replica_all_reduces: int = 0
    """HSDP: all-reduces of a reduced segment over the replicate process group (one per reduction)."""
    replica_all_reduce_bytes: int = 0

    def reset(self) -> None:
        self.__init__()


def resolve_reduce_mode(mode: str | None, group: dist.ProcessGroup | None, device: torch.device) -> str:
    """``mode``, or the backend's best: on gloo ``pairwise`` for CPU tensors (its reduce-scatter is an all-reduce
    plus copies; point-to-point sends move half an all-reduce's bytes) and the in-place all-reduce for device
    tensors; elsewhere the backend's reduce-scatter."""
    if mode is None:
        if dist.get_backend(group) != "gloo":
            return "reduce_scatter"
        return "pairwise" if device.type == "cpu" else "all_reduce"  # gloo on device tensors: its own staging
    return _checked_mode("reduce_mode", mode, REDUCE_MODES, device, "'reduce_scatter' (the backend's own) or "
                                                                    "'all_reduce'")


def resolve_gather_mode(mode: str | None, group: dist.ProcessGroup | None, device: torch.device) -> str:
    """``mode``, or the backend's best: ``pairwise`` for CPU tensors on gloo (its all-gather is a ring of W-1
    steps: measured at 2.3-2.6x the time of the same bytes sent to every peer at once, W=2-4), the backend's
    all-gather elsewhere."""
    if mode is None:
        return "pairwise" if dist.get_backend(group) == "gloo" and device.type == "cpu" else "all_gather"
    return _checked_mode("gather_mode", mode, GATHER_MODES, device, "'all_gather' (the backend's own)")


def _checked_mode(knob: str, mode: str, modes: tuple[str, ...], device: torch.device, instead: str) -> str:
    if mode not in modes:
        raise ValueError(f"{knob}={mode!r} is not supported; use one of {modes}")
    if mode == "pairwise" and device.type != "cpu":
        raise ValueError(f"{knob}='pairwise' is for CPU tensors (gloo) only, not {device.type} ones; on "
                         f"{device.type} use {knob}={instead}, or leave {knob} unset")
    return mode


@dataclass
class CustomComms:
    """A DBuffer's FSDP2 custom communication (``FSDPModule.set_custom_*``, ``set_all_reduce_hook``); None: ours.

    torch's ``AllGather`` / ``ReduceScatter`` (``torch.distributed.fsdp``) allocate their own buffers
    (``comm.allocate``: a memory pool, symmetric memory), which cannot be the storage the parameters and
    gradients view: a custom all-gather's output is copied into the full buffer once it finished, a custom
    reduce-scatter's input is a copy of the gradient buffer (FSDP2 makes both copies for every gather and
    reduction). The hook sees this rank's reduced segment, divided, and may change it in place.
    """

    all_gather: Any = None
    reduce_scatter: Any = None
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    hook_stream: Any = None


def check_comm(comm: Any, method: str) -> None:
    """``comm`` is None or has ``allocate`` and ``__call__`` (torch's ``Comm`` interface), else a named error."""
    if comm is not None and not (callable(comm) and callable(getattr(comm, "allocate", None))):
        kind = "AllGather" if "gather" in method else "ReduceScatter"
        raise TypeError(f"{method}({comm!r}): pass an object with allocate(size, *, dtype, device) and __call__, "
                        f"e.g. a subclass of torch's {kind} (torch.distributed.fsdp._fully_shard._fsdp_api), "
                        "or None for lightning_ragged's own")


class PendingCollective:
    """An issued collective and the tensors that must stay alive until it finishes."""

    def __init__(self, work: dist.Work | PairwiseReduce | PairwiseGather | None, started: float, *keep_alive: torch.Tensor) -> None:
        self.work = work
        self.started = started
        self.keep_alive = keep_alive
        self.then: Callable[[], None] | None = None
        """A collective that must follow this one and was not issued yet (HSDP's replica all-reduce on CPU)."""
        self._streams: CommStreams = NO_STREAMS
        self._event: Any = None

    def on_stream(self, streams: CommStreams, event: Any) -> None:
        """It was issued on a comm stream: its wait makes compute wait ``event`` (``streams.py``, rule 2)."""
        self._streams, self._event = streams, event

    def wait(self) -> float:
        """Finish it (block the CPU, or order the compute stream after it); the seconds since it was started."""
        if self.work is not None:
            self.work.wait()
        then, self.then = self.then, None
        if then is not None:
            then()
        self._streams.wait(self._event)
        return time.perf_counter() - self.started


def all_gather(
    target: torch.Tensor,
    source: torch.Tensor,
    group: dist.ProcessGroup | None,
    async_op: bool = False,
    started: float | None = None,
    comm: Any = None,
    mode: str = "all_gather",
) -> PendingCollective:
    """Gather every member's ``source`` into ``target`` (rank order), in place (the backend's all-gather, or
    ``mode="pairwise"``: point-to-point sends), or through a custom ``comm`` (into its own buffer, copied into
    ``target`` once finished: at the wait when asynchronous).

    ``started``: when the caller began (its allocation and cast count as time in flight).
    """
    started = time.perf_counter() if started is None else started
    if comm is None and mode == "pairwise":
        pending = PendingCollective(PairwiseGather(target, source, group), started, source)
        if not async_op:
            pending.wait()
        return pending
    if comm is None:
        return PendingCollective(_all_gather_single(target, source, group=group, async_op=async_op), started, source)
    output = comm.allocate((target.numel(),), dtype=target.dtype, device=target.device)
    work = comm(output_tensor=output, input_tensor=source, group=group, async_op=async_op)
    pending = PendingCollective(work, started, source, output)
    copy_out = functools.partial(target.copy_, output.view(target.shape))
    if async_op and work is not None:
        pending.then = copy_out
    else:  # finished (on a device: ordered on this stream), the copy follows it
        pending.wait()
        copy_out()
    return pending


def reduce(
    full: torch.Tensor, mode: str, group: dist.ProcessGroup | None, segment: slice, async_op: bool, started: float,
    replicate_group: dist.ProcessGroup | None = None, stats: CommStats | None = None,
    reduce_dtype: torch.dtype | None = None, held: torch.Tensor | None = None, comm: Any = None,
) -> PendingCollective:
    """Sum ``full`` over ``group`` in ``reduce_dtype`` (default: its own): in place (``all_reduce``) or into this
    rank's ``segment`` (``reduce_scatter``, into a tensor of its own; ``pairwise``, into ``full``'s segment).

    A ``full`` narrower than ``reduce_dtype`` (bf16 gradients, fp32 reduction) is cast for the backend's
    collectives (a full buffer of the reduce dtype, as FSDP2's reduce-scatter input); ``pairwise`` sends it
    as it is (a widening cast is exact, so the same sums for half the bytes) and sums this rank's segment,
    cast, with the received ones. The pending collective keeps ``(full, own_segment)`` alive; ``own_segment``
    holds this rank's summed segment once it finished, summed over ``replicate_group`` too (HSDP): right
    after a synchronous reduction, else when it is waited for (``then``). ``held``: earlier sums of this segment
    over ``group`` only (HSDP accumulation without the replica all-reduce), added in before it. Counted in ``stats``.
    A custom ``comm`` (FSDP2's ``ReduceScatter``) replaces ``mode``: it sums a copy of ``full`` in its buffers.
    """
    dtype = reduce_dtype or full.dtype
    sent = full if comm is not None or mode == "pairwise" or full.dtype == dtype else full.to(dtype)
    if comm is not None:
        sent = comm.allocate((full.numel(),), dtype=dtype, device=full.device)
        sent.copy_(full)
        own_segment = comm.allocate((segment.stop - segment.start,), dtype=dtype, device=full.device)
        work = comm(output_tensor=own_segment, input_tensor=sent, group=group, op=dist.ReduceOp.SUM,
                    async_op=async_op)
    elif mode == "all_reduce":
        work = dist.all_reduce(sent, group=group, async_op=async_op)
        own_segment = sent[segment]
    elif mode == "pairwise":
        own_segment = full[segment] if full.dtype == dtype else full[segment].to(dtype)
        work = PairwiseReduce(full, own_segment, group)
        if not async_op:
            work.wait()
    else:
        own_segment = torch.empty(segment.stop - segment.start, dtype=dtype, device=full.device)
        work = _reduce_scatter_single(own_segment, sent, group=group, async_op=async_op)
    pending = PendingCollective(work, started, full, own_segment, sent)
    if replicate_group is not None:
        def replica() -> None:
            if held is not None:
                own_segment.add_(held)
            all_reduce(own_segment, replicate_group)

        if async_op:
            pending.then = replica  # gloo orders nothing across process groups: once this one finished
        else:
            replica()  # ordered after it: on the same stream (device), or it finished (CPU)
    if stats is not None:
        stats.reduces += 1
        if dist.get_world_size(group) > 1:  # HSDP with one rank per shard group: no peer, only the replica all-reduce
            stats.reduce_bytes += sent.numel() * sent.element_size()
        if replicate_group is not None:
            stats.replica_all_reduces += 1
            stats.replica_all_reduce_bytes += own_segment.numel() * own_segment.element_size()
    return pending


def run_all_reduce_hook(
    custom: CustomComms, segment: torch.Tensor, scale: float, dtype: torch.dtype, streams: CommStreams,
) -> torch.Tensor:
    """FSDP2's ``set_all_reduce_hook``: ``hook(segment * scale)`` in ``dtype`` (the reduce dtype) once the
    reduction (HSDP: and the replica all-reduce) finished; on the user's stream when one was given, ordered after
    compute and before compute goes on. Returns the tensor the hook saw (and may have changed in place)."""
    segment = segment.to(dtype)
    if scale != 1.0:
        segment.mul_(scale)
    stream = custom.hook_stream
    if stream is None:
        custom.all_reduce_hook(segment)
        return segment
    stream.wait_stream(streams.compute)
    with stream:
        custom.all_reduce_hook(segment)
    streams.compute.wait_stream(stream)
    return segment


WIRE_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
                         torch.bfloat16, torch.float32, torch.float64})
"""The types every backend copies as they are (gloo refuses int16, the unsigned types wider than a byte and fp8)."""


def wire(tensor: torch.Tensor) -> torch.Tensor:
    """For a copying collective (broadcast, gather, scatter, all-gather): a complex tensor as its real pairs, any
    other type outside ``WIRE_DTYPES`` as its bytes (gloo: "Invalid scalar type" for an int16 buffer, an fp8
    shard). A view: what the collective writes lands in ``tensor``. Never for a reduction."""
    if tensor.is_complex():
        return torch.view_as_real(tensor)
    if tensor.dtype in WIRE_DTYPES:
        return tensor
    return (tensor if tensor.dim() else tensor.view(1)).view(torch.uint8)


def on_device(device: torch.device) -> Any:
    """Make ``device`` the current CUDA device for an object collective (``all_gather_object``: NCCL's use the
    current device, cuda:0 on every rank where none was set); nothing elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def host_tensor(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Small host data (flags, marks) as a tensor on ``device`` for a collective, without a host sync.

    ``torch.tensor(values, device=cuda)`` copies from pageable memory and waits for the stream
    (all queued compute); staged through pinned memory, the copy is queued like a kernel.
    """
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False) -> PendingCollective:
    """Sum ``tensor`` over ``group`` in place (HSDP's replicas, the runtime's gradient flags)."""
    work = dist.all_reduce(tensor, group=group, async_op=async_op)
    return PendingCollective(work, time.perf_counter(), tensor)
