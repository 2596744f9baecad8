"""``reduce_mode="pairwise"``: a reduce-scatter of the flat gradient built from point-to-point sends.

gloo's ``reduce_scatter_tensor`` is a clone, a full all-reduce and a copy, and an in-place
all-reduce sends each rank 2(W-1)/W of the buffer. Here every rank sends each peer that peer's
segment and sums the W-1 segments it receives into its own: (W-1)/W of the buffer per rank, half
an all-reduce's bytes, for a scratch of W-1 segments while it is in flight. On gloo this is CPU
work on the compute's own cores, so fewer bytes are less time (RESULTS "step-floor"); gloo's default.
Each segment is summed as its owner's gradient plus the peers' in rank order, in ``own``'s dtype (the
segments travel in ``full``'s, which may be narrower: bf16 gradients summed in fp32).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TAG = 0x52_46  # the engine's point-to-point messages; FIFO per peer, so reductions issued in one order pair up


class PairwiseReduce:
    """The sends and receives of one reduction; :meth:`wait` finishes them and sums into ``own``."""

    def __init__(self, full: torch.Tensor, own: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        world, me, size = dist.get_world_size(group), dist.get_rank(group), own.numel()
        self.own = own
        self.received = torch.empty(world - 1, size, dtype=full.dtype, device=full.device)
        self.works: list[dist.Work] = []
        self.failure: Exception | None = None
        global_rank = (lambda index: index) if group is None else (lambda index: dist.get_global_rank(group, index))
        peers = [(index, global_rank(index)) for index in range(world) if index != me]
        try:
            for row, (index, rank) in enumerate(peers):
                self.works.append(dist.isend(full[index * size : (index + 1) * size], rank, group=group, tag=TAG))
                self.works.append(dist.irecv(self.received[row], rank, group=group, tag=TAG))
        except Exception as error:  # the ones already issued must not outlive the buffers
            self.failure = error
            self._finish()
            raise

    def wait(self) -> None:
        """Block until every send and receive finished, then add the received segments (once).

        Every one is waited for even after one failed (a lost peer), so none is left reading or
        writing the buffers when the caller frees them; the first failure is raised after, and
        again by any later call. (After a hung peer that is one process-group timeout per op.)
        """
        summed = not self.works
        self._finish()
        if self.failure is not None:
            raise self.failure
        if not summed:
            for row in self.received:
                self.own.add_(row)

    def _finish(self) -> None:
        works, self.works = self.works, []
        for work in works:
            try:
                work.wait()
            except Exception as error:  # raised by wait() once the others finished
                self.failure = self.failure or error
