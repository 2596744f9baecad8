"""``"pairwise"`` collectives on gloo: the reduce-scatter and the all-gather built from point-to-point sends.

gloo's ``reduce_scatter_tensor`` is a clone, a full all-reduce and a copy, and an in-place
all-reduce sends each rank 2(W-1)/W of the buffer; its ``all_gather_into_tensor`` walks a ring
of W-1 steps, one peer at a time. Here every rank sends each peer at once (gloo gives each pair
its own connection), (W-1)/W of the buffer per rank either way:
- the reduction (``reduce_mode="pairwise"``) sends each peer that peer's segment and sums the W-1
  segments it receives into its own, for a scratch of W-1 segments while it is in flight. Each
  segment is summed as its owner's gradient plus the peers' in rank order, in ``own``'s dtype (the
  segments travel in ``full``'s, which may be narrower: bf16 gradients summed in fp32);
- the all-gather (``gather_mode="pairwise"``) sends each peer this rank's segment and receives
  theirs straight into their slots of the full buffer: no scratch, no copy but this rank's own.
On gloo this is CPU work on the compute's own cores, so fewer bytes and fewer waits are less time
(RESULTS "step-floor"); gloo's default for CPU tensors.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

REDUCE_TAG = 0x52_46  # the reductions' messages; FIFO per peer and tag, so reductions issued in one order pair up
GATHER_TAG = 0x52_47  # the all-gathers': their own tag, so a gather in flight beside a reduction never takes its data


class _PointToPoint:
    """One send to and one receive from every peer of ``group``, all issued at once; :meth:`wait` finishes them.

    ``pieces(index)`` gives what to send to the peer of group rank ``index`` and where its message lands.
    """

    def __init__(self, group: dist.ProcessGroup | None, tag: int,
                 pieces: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
        world, me = dist.get_world_size(group), dist.get_rank(group)
        self.works: list[dist.Work] = []
        self.failure: Exception | None = None
        global_rank = (lambda index: index) if group is None else (lambda index: dist.get_global_rank(group, index))
        try:
            for index in range(world):
                if index != me:
                    send, receive = pieces(index)
                    self.works.append(dist.isend(send, global_rank(index), group=group, tag=tag))
                    self.works.append(dist.irecv(receive, global_rank(index), group=group, tag=tag))
        except Exception as error:  # the ones already issued must not outlive the buffers
            self.failure = error
            self._finish()
            raise

    def wait(self) -> None:
        """Block until every send and receive finished.

        Every one is waited for even after one failed (a lost peer), so none is left reading or
        writing the buffers when the caller frees them; the first failure is raised after, and
        again by any later call. (After a hung peer that is one process-group timeout per op.)
        """
        self._finish()
        if self.failure is not None:
            raise self.failure

    def _finish(self) -> None:
        works, self.works = self.works, []
        for work in works:
            try:
                work.wait()
            except Exception as error:  # raised by wait() once the others finished
                self.failure = self.failure or error


class PairwiseReduce(_PointToPoint):
    """The sends and receives of one reduction; :meth:`wait` finishes them and sums into ``own`` (once)."""

    def __init__(self, full: torch.Tensor, own: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        world, me, size = dist.get_world_size(group), dist.get_rank(group), own.numel()
        self.own = own
        self.received = torch.empty(world - 1, size, dtype=full.dtype, device=full.device)
        super().__init__(group, REDUCE_TAG, lambda index: (
            full[index * size : (index + 1) * size], self.received[index if index < me else index - 1]))

    def wait(self) -> None:
        summed = not self.works
        super().wait()
        if not summed:
            for row in self.received:
                self.own.add_(row)


class PairwiseGather(_PointToPoint):
    """The sends and receives of one all-gather of ``source`` into ``target`` (rank order), in place."""

    def __init__(self, target: torch.Tensor, source: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        size, flat = source.numel(), target.view(-1)
        super().__init__(group, GATHER_TAG, lambda index: (source, flat[index * size : (index + 1) * size]))
        me = dist.get_rank(group)
        flat[me * size : (me + 1) * size].copy_(source.view(-1))  # while the peers' segments travel
