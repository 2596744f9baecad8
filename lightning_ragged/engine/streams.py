"""The comm schedule on an accelerator: an all-gather stream, a reduce stream, and events between them and compute.

One :class:`CommStreams` per sharded model (``RaggedFSDPState.set_comm_streams``) holds

* ``compute``: the current stream at each use (forward and backward kernels, the engine's hooks);
* ``all_gather``: every DBuffer's all-gather: the full buffer's allocation, a fresh cast of the shard,
  the collective (a kept cast is made on compute just before, ``shard_cast.py``; an fp8 gather's full
  buffer is allocated on compute at its wait, where the dequantize writes it);
* ``reduce``: every DBuffer's reduction: the shard group's collective, then HSDP's replica all-reduce.

On an accelerator they are torch's device-generic ``torch.Stream`` / ``torch.Event`` (CUDA first; any
``torch.accelerator`` follows). On CPU every stream is a :class:`NoOpStream` and the same schedule code
runs, doing nothing; tests inject streams that log each call. The ordering rules:

1. **Issue** (:meth:`CommStreams.issue`): the side stream first waits for compute (``wait_stream``), so
   the collective reads the shard's latest values (the optimizer step) or the finished gradients, and
   the memory it allocates cannot be in use by compute (rule 3). Everything the issue allocates and
   runs is on the side stream; an event is recorded on it right after the collective. What outlives the
   wait (a kept cast) is made on compute before the issue, so that it is compute's memory once dropped.
2. **Wait** (:meth:`CommStreams.wait`, from ``PendingCollective.wait``): compute waits that event before
   any use: the group's forward or backward, writing the reduced segment into the sharded gradient.
   The end of backward finishes every reduction this way, so the optimizer step, enqueued on compute
   after it, sees them all.
3. **Memory, without ``record_stream``**: a buffer allocated on a side stream (the full buffer, a fresh
   cast, fp8's chunk and received bytes, a reduce-scatter output) is used by compute only after compute
   waited its event, and freed by the CPU only after that wait (all but the full buffer die at the wait;
   the full buffer at the reshard). The caching allocator hands its block only to later allocations on
   that same side stream, and every such allocation happens inside a later issue, after that stream
   waited for compute (rule 1): the reuse is ordered after every compute kernel enqueued before the
   free, i.e. after the buffer's last use. A buffer allocated on compute and read by a side stream (the
   flat gradient buffer, a kept cast, a kept 1/n of the full buffer) is freed only after compute waited
   the side stream's event (rule 2). (``record_stream`` would instead defer each block's reuse to the
   allocator polling events at free time, which makes the memory in use depend on timing; FSDP2 avoids
   it too, by holding references and events.)
4. **Synchronous on the side stream**: on a device the collective is issued with ``async_op=False``
   inside the side stream (``ordered``): ProcessGroupNCCL launches it on the current stream (torch >= 2.8;
   before, on its own stream joined back by the ``work.wait()`` c10d calls, which orders streams and
   never blocks the CPU), so the side stream's event covers it and HSDP's replica all-reduce issued next
   is ordered after the shard reduction. On CPU the backend's own ``async_op`` is kept and ``Work.wait()``
   blocks the CPU; gloo orders nothing across process groups, so the replica all-reduce is issued when
   the shard reduction is waited for. ``ordered`` follows the device, not the backend: gloo on CUDA
   tensors stays correctly ordered but blocks the CPU in each collective, so nothing overlaps there.
5. **HSDP**: the replica all-reduce is chained on the reduce stream right after the shard reduction,
   so the next group's reduction queues behind it (a slow inter-node all-reduce delays it); a third
   stream would overlap them but must then keep the reduced segment from being reused early.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch


class Stream(Protocol):
    """What the schedule uses of a ``torch.Stream`` (fakes in tests implement the same)."""

    def wait_stream(self, stream: "Stream") -> None: ...

    def wait_event(self, event: Any) -> None: ...

    def record_event(self) -> Any: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: Any) -> Any: ...


class NoOpStream:
    """A CPU stream: kernels already run in program order, so every method does nothing."""

    def wait_stream(self, stream: Stream) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self) -> None:
        return None

    def __enter__(self) -> "NoOpStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class CommStreams:
    """The compute, all-gather and reduce streams of one device and the ordering rules between them."""

    def __init__(self, all_gather: Stream, reduce: Stream, current: Callable[[], Stream], ordered: bool) -> None:
        """``current`` returns the current (compute) stream; ``ordered``: a collective issued synchronously
        inside a side stream is ordered on it without blocking the CPU (device streams; see rule 4)."""
        self.all_gather = all_gather
        self.reduce = reduce
        self._current = current
        self.ordered = ordered

    @property
    def compute(self) -> Stream:
        return self._current()

    def issue(self, side: Stream, call: Callable[[bool], None], async_op: bool) -> Any:
        """Run ``call(async_op)`` on ``side`` after it waited for compute; the event recorded after it (rule 1)."""
        side.wait_stream(self.compute)
        with side:
            call(async_op and not self.ordered)
            return side.record_event()

    def wait(self, event: Any) -> None:
        """Make compute wait for ``event`` (rule 2); nothing for no-op streams' ``None``."""
        if event is not None:
            self.compute.wait_event(event)

    def timing_stream(self, gather: bool) -> Stream | None:
        """The stream a collective runs on, for device timing events; None where it runs on no stream (CPU)."""
        if not self.ordered:
            return None
        return self.all_gather if gather else self.reduce


_NO_OP = NoOpStream()
NO_STREAMS = CommStreams(_NO_OP, _NO_OP, lambda: _NO_OP, ordered=False)
"""The CPU schedule: no-op streams, the backend's ``async_op`` kept."""


def has_streams(device: torch.device | None) -> bool:
    """True for a device of the current accelerator (CUDA, XPU, ...): its kernels run on streams."""
    if device is None or not torch.accelerator.is_available():
        return False
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and torch.device(device).type == accelerator.type


def device_streams(device: torch.device | None) -> CommStreams:
    """An all-gather and a reduce stream on ``device`` (the current stream is compute); CPU: :data:`NO_STREAMS`."""
    if not has_streams(device):
        return NO_STREAMS
    device = torch.device(device)
    # high priority (as FSDP2's): a collective ready to launch is not queued behind compute kernels
    return CommStreams(
        torch.Stream(device=device, priority=-1), torch.Stream(device=device, priority=-1),
        lambda: torch.accelerator.current_stream(device), ordered=True,
    )
