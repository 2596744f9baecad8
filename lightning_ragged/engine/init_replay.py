"""Replay an eager construction's initialization on a model built on the meta device.

"Eager" means: ``torch.manual_seed(s)``, build the model on a real device. Its random
numbers are drawn, in this order, by

1. every module that defines ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``, ...),
   which its ``__init__`` calls: a leaf when it is built (module order), a module with
   children at the end of its ``__init__`` (after them);
2. every Hugging Face ``PreTrainedModel``'s ``post_init()`` at the end of its ``__init__``:
   ``initialize_weights()``, i.e. ``_initialize_weights(module)`` for its modules children
   first (``smart_apply``: a nested ``PreTrainedModel`` dispatches its own), under
   ``torch.no_grad()`` and ``transformers.initialization.guard_torch_init_functions()``.
   ``_initialize_weights`` marks each module ``_is_hf_initialized``, so an outer model's
   ``post_init`` skips what an inner model (``LlamaModel`` inside ``LlamaForCausalLM``)
   already initialized — and it recomputes the non-persistent buffers (rotary ``inv_freq``).

:func:`eager_init_events` lists those calls in that order (the *same RNG stream*: the
same calls, on tensors of the same shapes, dtypes and device, in the same order). A tied
parameter (``lm_head.weight`` tied to the embedding) had a tensor of its own in eager until
``tie_weights()`` replaced it, so its slot is pointed at a scratch tensor during the replay:
its draws are consumed and discarded, as in eager.

Most of those draws are overwritten later (``post_init`` re-initializes what
``reset_parameters`` drew). :func:`trace_events` runs the events once on meta tensors
under a ``TorchDispatchMode`` that records, per event, which parameters and buffers it
reads and writes; a write whose value a later event fully overwrites before anyone reads it
is *dead*: the replay sends it to a scratch tensor (same shape, dtype, device: the same
draws). Each group's full buffer is then needed only from its first to its last live event,
so materialization opens one group at a time (plus the root group where its modules
surround the blocks). The trace also tells which tensors nothing initializes.
"""

from __future__ import annotations

import bisect
import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

WRITE_ONLY_OPS = frozenset({
    "normal_", "uniform_", "fill_", "zero_", "copy_", "bernoulli_", "exponential_", "geometric_",
    "log_normal_", "cauchy_", "random_",
})
"""In-place ops whose result does not depend on the tensor's previous value (a full overwrite when
applied to the whole tensor). ``bernoulli_(p: Tensor)`` reads ``p``, not ``self``."""

META_NOOP_INITS = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")
"""``torch.nn.init`` functions that return early on meta tensors; in the trace they record a full
write (each overwrites the whole tensor whatever it held)."""


def pretrained_model_class() -> type | None:
    """``transformers.PreTrainedModel`` if transformers is already imported (never imported here)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return getattr(modeling, "PreTrainedModel", None)


@dataclass
class InitEvent:
    """One initialization call of an eager construction."""

    kind: str
    """``"reset"``: ``module.reset_parameters()``; ``"hf"``: ``owner._initialize_weights(module)``."""
    module: nn.Module
    owner: nn.Module | None = None
    is_custom_code: bool = False

    def run(self) -> None:
        if self.kind == "reset":
            self.module.reset_parameters()  # type: ignore[operator]
            return
        owner = self.owner
        with torch.no_grad(), _hf_guard():
            if hasattr(owner, "_initialize_weights"):
                owner._initialize_weights(self.module, self.is_custom_code)  # type: ignore[union-attr]
            else:  # transformers < 5: no per-module flag handling
                owner._init_weights(self.module)  # type: ignore[union-attr]


def _hf_guard() -> contextlib.AbstractContextManager:
    initialization = sys.modules.get("transformers.initialization")
    guard = getattr(initialization, "guard_torch_init_functions", None)
    return guard() if guard is not None else contextlib.nullcontext()


def _owns_tensors(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values()) or any(
        b is not None for b in module._buffers.values()
    )


def eager_init_events(root: nn.Module) -> list[InitEvent]:
    """The initialization calls an eager construction of ``root`` makes, in their order."""
    pretrained = pretrained_model_class()
    events: list[InitEvent] = []
    built: set[int] = set()

    def construct(module: nn.Module) -> None:
        if id(module) in built:
            return  # a shared module is built once
        built.add(id(module))
        children = list(module.children())
        resets = callable(getattr(module, "reset_parameters", None)) and _owns_tensors(module)
        if resets and not children:
            events.append(InitEvent("reset", module))
        for child in children:
            construct(child)
        if resets and children:
            events.append(InitEvent("reset", module))
        if pretrained is not None and isinstance(module, pretrained):
            post_init(module)

    def post_init(model: nn.Module) -> None:
        custom = bool(getattr(model, "is_custom_code", lambda: False)())

        def smart_apply(module: nn.Module, owner: nn.Module) -> None:
            for child in module.children():
                smart_apply(child, child if isinstance(child, pretrained) else owner)  # type: ignore[arg-type]
            events.append(InitEvent("hf", module, owner, custom))

        smart_apply(model, model)

    construct(root)
    return events


def has_hf_init(root: nn.Module) -> bool:
    pretrained = pretrained_model_class()
    return pretrained is not None and any(isinstance(m, pretrained) for m in root.modules())


def tied_target_slots(root: nn.Module) -> set[tuple[int, str]]:
    """(id(module), attr) of every slot holding a parameter tied to another slot's (the tie's target).

    Hugging Face models name them (``all_tied_weights_keys``: target -> source); otherwise the
    first slot in module order is the source (``named_parameters`` keeps it) and the others are targets.
    """
    slots: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                entry = (f"{name}.{attr}" if name else attr, module, attr)
                if all((id(e[1]), e[2]) != (id(module), attr) for e in slots.get(id(param), [])):
                    slots.setdefault(id(param), []).append(entry)  # a shared module is one slot, not a tie
    declared: set[str] = set()
    pretrained = pretrained_model_class()
    if pretrained is not None:
        for prefix, module in root.named_modules():
            if isinstance(module, pretrained):
                keys = getattr(module, "all_tied_weights_keys", None) or {}
                declared |= {f"{prefix}.{target}" if prefix else target for target in keys}
    targets: set[tuple[int, str]] = set()
    for entries in slots.values():
        if len(entries) < 2:
            continue
        named = [e for e in entries if e[0] in declared]
        for _path, module, attr in named if named and len(named) < len(entries) else entries[1:]:
            targets.add((id(module), attr))
    return targets


# ------------------------------------------------------------------------------ trace
@dataclass
class Access:
    event: int
    full_write: bool
    """The event's first access to the tensor overwrites all of it (its old value is not needed)."""


@dataclass
class Trace:
    accesses: dict[Hashable, list[Access]] = field(default_factory=dict)
    """Per tracked tensor (key), the events that touched it, in order."""

    def initialized(self, key: Hashable) -> bool:
        """The first access overall writes the whole tensor (else it would read what nothing set)."""
        seen = self.accesses.get(key)
        return bool(seen) and seen[0].full_write

    def dead(self, key: Hashable) -> set[int]:
        """Events whose writes to ``key`` are overwritten before any read (next access is a full write)."""
        seen = self.accesses.get(key, [])
        return {
            a.event for a, nxt in zip(seen, seen[1:]) if a.full_write and nxt.full_write
        }

    def live(self, key: Hashable) -> list[int]:
        dead = self.dead(key)
        return [a.event for a in self.accesses.get(key, []) if a.event not in dead]


class _Regions:
    """Tracked element ranges of meta storages: storage -> sorted [(begin, end, key)]."""

    def __init__(self) -> None:
        self._by_storage: dict[int, list[tuple[int, int, Hashable]]] = {}

    def add(self, tensor: torch.Tensor, key: Hashable) -> None:
        begin, end = _span(tensor)
        regions = self._by_storage.setdefault(tensor.untyped_storage()._cdata, [])
        bisect.insort(regions, (begin, end, key), key=lambda r: (r[0], r[1]))

    def find(self, tensor: torch.Tensor) -> Iterator[tuple[Hashable, bool]]:
        """(key, covers the key's whole range) for every tracked range ``tensor`` overlaps."""
        regions = self._by_storage.get(tensor.untyped_storage()._cdata)
        if not regions:
            return
        lo, hi = _span(tensor)
        exact = tensor.numel()
        for begin, end, key in regions:
            if begin >= hi:
                break
            if end > lo:
                yield key, (lo == begin and hi == end and exact == end - begin)


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.storage_offset()
    if tensor.numel() == 0:
        return start, start
    return start, start + 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))


class _TraceMode(TorchDispatchMode):
    def __init__(self, regions: _Regions, trace: Trace) -> None:
        super().__init__()
        self.regions, self.trace = regions, trace
        self.event = -1
        self._seen: set[Hashable] = set()

    def start(self, event: int) -> None:
        self.event, self._seen = event, set()

    def _record(self, key: Hashable, full_write: bool) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        self.trace.accesses.setdefault(key, []).append(Access(self.event, full_write))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        writes, reads = [], []
        schema = func._schema
        for index, argument in enumerate(schema.arguments):
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            tensors = [value] if isinstance(value, torch.Tensor) else (
                [v for v in value if isinstance(v, torch.Tensor)] if isinstance(value, (list, tuple)) else []
            )
            alias = argument.alias_info
            for tensor in tensors:
                if not tensor.is_meta:
                    continue
                if alias is None:
                    reads.append(tensor)
                elif alias.is_write:
                    writes.append(tensor)
                # else: a view of the tensor, no data access
        write_only = func.overloadpacket.__name__ in WRITE_ONLY_OPS
        for tensor in reads:
            for key, _ in self.regions.find(tensor):
                self._record(key, False)
        for tensor in writes:
            for key, covers in self.regions.find(tensor):
                self._record(key, write_only and covers)
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta_noop_inits(handler: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Route the ``torch.nn.init`` functions that skip meta tensors (``META_NOOP_INITS``, and transformers'
    table of them) to ``handler(name, original, tensor, args, kwargs)`` when given a meta tensor."""
    init = torch.nn.init
    patched: list[tuple[Any, str, Any]] = []
    hf_table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)

    def routed(name: str, original: Callable) -> Callable:
        def run(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if tensor.is_meta:
                return handler(name, original, tensor, args, kwargs)
            return original(tensor, *args, **kwargs)

        return run

    try:
        for name in META_NOOP_INITS:
            original = getattr(init, name)
            patched.append((init, name, original))
            setattr(init, name, routed(name, original))
            if hf_table is not None and name in hf_table:
                patched.append((hf_table, name, hf_table[name]))
                hf_table[name] = routed(name, hf_table[name])
        yield
    finally:
        for owner, name, original in reversed(patched):
            if isinstance(owner, dict):
                owner[name] = original
            else:
                setattr(owner, name, original)


def _full_write(_name: str, _original: Callable, tensor: torch.Tensor, _args: tuple, _kwargs: dict) -> torch.Tensor:
    """In the trace: a function that skips meta tensors overwrites the whole tensor (record it so)."""
    with torch.no_grad():
        return tensor.fill_(0.0)


@contextlib.contextmanager
def _hf_flags_restored(root: nn.Module) -> Iterator[None]:
    """A dry run must leave ``_is_hf_initialized`` as it found it (the real run sets it, as eager)."""
    missing = object()
    saved = [(m, m.__dict__.get("_is_hf_initialized", missing)) for m in root.modules()]
    try:
        yield
    finally:
        for module, value in saved:
            if value is missing:
                module.__dict__.pop("_is_hf_initialized", None)
            else:
                module.__dict__["_is_hf_initialized"] = value


def trace_events(
    root: nn.Module,
    events: list[InitEvent],
    tracked: list[tuple[torch.Tensor, Hashable]],
) -> Trace:
    """Run ``events`` once on meta tensors and record what each reads and writes.

    ``tracked``: meta tensors (currently bound in the model) and their keys. Nothing real is
    touched and no random number is drawn; ``_is_hf_initialized`` flags are restored.
    """
    regions = _Regions()
    for tensor, key in tracked:
        regions.add(tensor, key)
    trace = Trace()
    mode = _TraceMode(regions, trace)
    with _hf_flags_restored(root), on_meta_noop_inits(_full_write), torch.random.fork_rng(devices=[]), mode:
        for index, event in enumerate(events):
            mode.start(index)
            event.run()
    return trace
