"""This rank's shard in the compute dtype, the source of its all-gather: cast each time, or kept.

With a ``param_dtype`` other than the master dtype every all-gather sends a cast of the shard,
and a group is gathered twice a step (forward, backward re-gather). ``fully_shard(...,
keep_cast_shard=True)`` keeps the forward's cast for the backward re-gather, for no_sync
micro-batches and for evaluation forwards, as long as the shard is unchanged: one cast per
DBuffer per optimizer step instead of two per micro-batch, for ``S x param_dtype`` bytes per
DBuffer held from the first unshard to the next optimizer step (half the master shard's bytes in bf16).

"Unchanged" is checked twice over. The shard's version counter (views share their base's)
sees every in-place write autograd sees: non-fused optimizers, ``copy_``, state-dict and
checkpoint loads. Fused optimizer kernels (``torch.optim.AdamW(fused=True)``) do not bump it,
so any ``torch.optim.Optimizer``'s step also drops every kept cast, before it runs (its memory
is free for the step) and after it (a step whose closure ran forward, as Lightning's does).
Writes through ``param.data`` bypass both: do not write shards that way.

The stream that makes it (``streams.py``). A kept cast is made on the compute stream, before the
all-gather's issue (:meth:`ShardCast.kept`). The caching allocator gives a freed block back only
to the stream that allocated it: made on the all-gather stream, a dropped kept cast could serve
later all-gathers only, never the optimizer step or the activations, and a step's reserved memory
would grow by every DBuffer's ``S x param_dtype`` bytes. Made on compute, it is compute's again when
dropped, and safely: the all-gather stream waited for compute before reading it, and its pending
collective holds it until compute waited that all-gather. A fresh cast (not kept) is made inside the
issue, on the all-gather stream, as FSDP2 makes its copy-in on a side stream: it runs beside compute,
not in front of the next kernels, and lives only until the wait, so the next all-gather's cast
reuses its block there (that pool holds one cast per all-gather in flight).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

_KEPT: "weakref.WeakSet[Any]" = weakref.WeakSet()
_hooks: list[Any] = []


def drop_at_optimizer_steps(kept: Any) -> None:
    """Call ``kept.drop()`` before and after every ``torch.optim`` step, for as long as ``kept`` lives: what it
    holds was made from shards a step may change without moving their version (the rule above)."""
    _KEPT.add(kept)
    if not _hooks:
        _hooks.append(register_optimizer_step_pre_hook(_drop_all))
        _hooks.append(register_optimizer_step_post_hook(_drop_all))


class KeptWhileUnchanged:
    """A value made from a shard (subclasses say how, in :meth:`_make`), with ``keep`` kept while the
    shard's version is unchanged and dropped at every optimizer step (the rule above)."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.made = 0
        """Values made so far (the uses that reused the kept one made none)."""
        self._kept: torch.Tensor | None = None
        self._version = -1
        if keep:
            drop_at_optimizer_steps(self)

    def _make(self, sharded: torch.Tensor) -> torch.Tensor:
        """A new value of ``sharded`` (each subclass's: a cast, a quantization)."""
        raise NotImplementedError

    def kept(self, sharded: torch.Tensor) -> torch.Tensor | None:
        """With ``keep``: the kept value, made now if stale (call it on the compute stream, before the
        all-gather's issue); else None (the issue makes its own with :meth:`of`)."""
        return self.of(sharded) if self.keep else None

    def of(self, sharded: torch.Tensor) -> torch.Tensor:
        """The value of ``sharded``: the kept one while the shard is unchanged, else made now (kept with ``keep``)."""
        if self._kept is not None and self._version == sharded._version:
            return self._kept
        value = self._make(sharded)
        self.made += 1
        if self.keep:
            self._kept, self._version = value, sharded._version
        return value

    @property
    def kept_bytes(self) -> int:
        return 0 if self._kept is None else self._kept.numel() * self._kept.element_size()

    def drop(self) -> None:
        self._kept = None


class ShardCast(KeptWhileUnchanged):
    """The all-gather source of one DBuffer's shard: itself, a fresh cast, or the kept one."""

    def __init__(self, dtype: torch.dtype, keep: bool) -> None:
        super().__init__(keep)
        self.dtype = dtype

    @property
    def casts(self) -> int:
        """Casts made so far (the all-gathers that reused the kept one made none)."""
        return self.made

    def _make(self, sharded: torch.Tensor) -> torch.Tensor:
        return sharded.to(self.dtype)

    def kept(self, sharded: torch.Tensor) -> torch.Tensor | None:
        """With ``keep`` and a cast to make: the kept cast, made now if stale (call it on the compute stream,
        before the all-gather's issue); else None (the issue makes its own source with :meth:`of`)."""
        return super().kept(sharded) if sharded.dtype != self.dtype else None

    def of(self, sharded: torch.Tensor) -> torch.Tensor:
        """``sharded`` in the compute dtype (no copy when it already is one)."""
        return sharded if sharded.dtype == self.dtype else super().of(sharded)

    def cast_into(self, target: torch.Tensor, sharded: torch.Tensor) -> None:
        """A single rank's "gather": ``sharded`` cast straight into ``target`` (the full buffer), counted, not kept."""
        target.copy_(sharded)
        self.made += 1


def _drop_all(*_: Any) -> None:
    """An optimizer step (before and after): every kept value may be stale (fused kernels bump no version)."""
    for kept in list(_KEPT):
        kept.drop()
