"""ShardGroup: the runtime of one FSDP group (its DBuffers and the modules that use them).

It knows how to unshard/reshard its buffers, swap the module attributes between the
sharded parameters (what the optimizer and ``named_parameters`` see at rest) and the
unsharded ones (what forward and backward compute with), and when its gradients are
complete. Scheduling across groups (prefetch, reduction order) lives in ``fsdp.py``.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from lightning_ragged.dbuffer import DBuffer


class ShardGroup:
    """One group: DBuffers plus every (module, attribute) slot that holds one of its parameters."""

    def __init__(
        self,
        name: str,
        module: nn.Module | None,
        buckets: list[DBuffer],
        slots: list[tuple[nn.Module, str, DBuffer, str]],
        reshard_after_forward: bool,
    ) -> None:
        self.name = name
        self.module = module
        self.buckets = buckets
        self.slots = slots
        self.reshard_after_forward = reshard_after_forward and module is not None
        self._awaiting_grads: dict[DBuffer, set[int]] = {}
        self.backward_prepared = False

    @property
    def is_root(self) -> bool:
        return self.module is None

    @property
    def is_unsharded(self) -> bool:
        return all(bucket.is_unsharded for bucket in self.buckets)

    def unsharded_params(self) -> Iterator[tuple[DBuffer, str, nn.Parameter]]:
        for bucket in self.buckets:
            for name, param in bucket.unsharded_params.items():
                yield bucket, name, param

    # ------------------------------------------------------------ parameters
    def unshard(self, async_op: bool = False) -> None:
        for bucket in self.buckets:
            bucket.unshard(async_op=async_op)

    def wait_unshard(self) -> None:
        for bucket in self.buckets:
            bucket.wait_unshard()

    def use_unsharded(self) -> None:
        """Unshard (waiting for a prefetch if one is in flight) and point the modules at full parameters."""
        self.unshard()
        self.wait_unshard()
        self._swap(lambda bucket, name: bucket.unsharded_params[name])

    def reshard(self, only: DBuffer | None = None) -> None:
        """Free the full parameters (of every bucket, or ``only`` one) and point the modules back at the shards."""
        for bucket in self.buckets if only is None else [only]:
            bucket.reshard()
        self._swap(lambda bucket, name: bucket.sharded_params[name], only)

    def _swap(self, pick: Callable[[DBuffer, str], nn.Parameter], only: DBuffer | None = None) -> None:
        for module, attr, bucket, name in self.slots:
            if only is None or bucket is only:
                module._parameters[attr] = pick(bucket, name)

    # ------------------------------------------------------------- gradients
    def prepare_backward(self) -> None:
        """Unshard for backward, attach gradient buffers and start waiting for every gradient."""
        self.use_unsharded()
        for bucket in self.buckets:
            bucket.prepare_unsharded_grad()
        self._awaiting_grads = {
            bucket: {id(p) for p in bucket.unsharded_params.values() if p.requires_grad} for bucket in self.buckets
        }
        self.backward_prepared = True

    def end_backward(self) -> None:
        """Free the full parameters and forget this backward's bookkeeping."""
        self.reshard()
        self._awaiting_grads = {}
        self.backward_prepared = False

    def mark_grad_accumulated(self, bucket: DBuffer, name: str, param: torch.Tensor) -> bool:
        """Record one parameter's finished gradient; True when the last one of its DBuffer arrives.

        Readiness is per DBuffer, so a group split into several buffers (e.g. the root's
        head and its embeddings) reduces each as soon as that buffer's gradients are done.
        """
        if not bucket.owns_unsharded_grad(name):
            bucket.adopt_unsharded_grad(name)
        awaiting = self._awaiting_grads.get(bucket)
        if not awaiting or id(param) not in awaiting:
            return False
        awaiting.discard(id(param))
        return not awaiting
