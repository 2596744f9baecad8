"""Live tensor bytes of one process, counted storage by storage (a ``TorchDispatchMode``).

``LiveStorageTracker`` registers the untyped storage of every tensor that any dispatched
operator takes or produces (factories included, so everything built under it is seen;
wrapper subclasses such as DTensor are unwrapped to their inner tensors), once per
storage, with a weakref callback that forgets it when its last reference dies: views
share a storage and are counted once, and a storage lives as long as any tensor (Python
or C++, e.g. autograd's saved tensors) holds it. A storage's size is read again at every
count, because FSDP2 and lightning_ragged free and re-allocate their buffers with
``untyped_storage().resize_`` (no operator dispatched). Inside ``window()`` the live sum is
taken after every operator and its maximum kept: the peak, at operator granularity.

Blind spots: allocations no dispatched operator ever touches (inside a C++ kernel, on
gloo's worker threads) and the operators a tensor subclass runs on its inner tensors
(DTensor's) are not seen; the allocator's caching and fragmentation are not counted.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class LiveStorageTracker(TorchDispatchMode):
    """Tracks every storage dispatched operators touch; ``current()`` is their live bytes, ``peak`` the window's maximum."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, weakref.ref] = {}
        self._ignored: set[int] = set()
        self._in_window = False
        self.peak = 0
        self.peak_at = ""
        self.peak_carried = 0
        self._at_start: set[int] = set()
        self.phase = ""
        self.marks: dict[str, int] = {}
        self.on_peak: Callable[[], Any] | None = None
        """Called at every new peak inside ``window()``; its result is ``peak_detail``. It must dispatch no operator."""
        self.peak_detail: Any = None

    # ------------------------------------------------------------------ registering
    def track(self, *values: Any) -> None:
        """Register the storages of every tensor in ``values`` (nested containers allowed)."""
        for leaf in tree_leaves(values):
            if isinstance(leaf, torch.Tensor):
                self._track_tensor(leaf)

    def _track_tensor(self, tensor: torch.Tensor) -> None:
        for storage in storages_of(tensor):
            key = storage._cdata
            if key not in self._live and key not in self._ignored:
                self._live[key] = weakref.ref(storage, lambda _ref, key=key: self._forget(key))

    def _forget(self, key: int) -> None:
        """A storage died: its key (an address) may be reused by a new storage, which must not look carried."""
        self._live.pop(key, None)
        self._at_start.discard(key)

    def ignore(self, tensor: torch.Tensor) -> None:
        """Never count ``tensor``'s storage (e.g. the whole data set, identical for every framework)."""
        for storage in storages_of(tensor):
            self._ignored.add(storage._cdata)
            self._live.pop(storage._cdata, None)

    def tracks(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storages (a subclass's inner ones) are all among the live ones."""
        return all(storage._cdata in self._live for storage in storages_of(tensor))

    # ------------------------------------------------------------------ counting
    def current(self) -> int:
        """Bytes of all live tracked storages, at their present size."""
        return self._count()[0]

    def _count(self) -> tuple[int, int]:
        """(all live bytes, the part in storages that were already live when the window opened)."""
        total = carried = 0
        for key, ref in list(self._live.items()):
            storage = ref()
            if storage is not None:
                nbytes = storage.nbytes()
                total += nbytes
                if key in self._at_start:
                    carried += nbytes
        return total, carried

    def mark(self, label: str) -> None:
        """Remember ``current()`` under ``label`` (e.g. the live bytes at rest, just before a step's forward)."""
        self.marks[label] = self.current()

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """Record the peak of ``current()`` over every operator dispatched inside (starting from the live bytes now).

        ``peak_carried`` is the part of the peak in storages already live when the window opened
        (parameters, optimizer state, kept buffers, also when re-grown by ``resize_``); the rest was born inside.
        """
        self._at_start = set(self._live)
        self.peak, self.peak_at, self._in_window = self.current(), "window start", True
        self.peak_carried = self.peak
        try:
            yield
        finally:
            self._in_window = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        self.track(args, kwargs)
        out = func(*args, **kwargs)
        self.track(out)
        if self._in_window:
            live, carried = self._count()
            if live > self.peak:
                self.peak, self.peak_carried, self.peak_at = live, carried, f"{self.phase}: {func._schema.name}"
                if self.on_peak is not None:
                    self.peak_detail = self.on_peak()
        return out


def storages_of(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The untyped storages holding ``tensor``'s data: its own, or a wrapper subclass's (DTensor's) inner tensors'."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ctx = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from storages_of(inner)
        return
    if tensor.device.type == "meta":
        return
    try:
        yield tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse and other storage-less layouts
        return
