"""Record the tensor calls of a model's construction on the meta device, then replay them on real tensors.

The structural replay (``init_replay.py``) rebuilds an eager construction's initialization from the
finished model: ``reset_parameters()`` in module order, Hugging Face ``post_init``. It cannot see what
``__init__`` did beyond that: a zero-initialized LoRA ``B`` or output layer, adapters injected into a
built model (which changes the order of the draws), a classifier replaced after ``post_init``,
``normal_`` in ``__init__`` (GPT-2's ``Conv1D``), ``torch.randn`` parameters (ViT).

Under ``Trainer.init_module(empty_init=True)`` / ``fabric.init_module(empty_init=True)`` the strategy
builds the model inside :func:`recording`: a torch function mode that records every call that returns
a tensor or writes one (factories, ``torch.nn.init`` functions, in-place writes, views, arithmetic), in
order, with the default dtype of the moment (also on real tensors: ``torch.Tensor(n).uniform_()``, whose
legacy constructor ignores the meta device, makes a real parameter, which the replay draws again in its place). :meth:`Recording.program`
binds it to the model's parameter and buffer slots; its :class:`RecordedCall` events run through
``meta_init.py`` like the structural ones (dry run on meta tensors, then tensor by tensor under the shared
seed): the same calls on tensors of the same shapes and dtypes in the same order, so the same draws as
an eager build. A tensor is found by its meta storage: a slot's (whatever the slot holds when the call
runs: a full view, a scratch for a dead write, a meta view in the dry run), else the real tensor the
replay made for that storage. A value a tensor of a slot's storage got from a factory or an
out-of-place call (``nn.Parameter(torch.randn(...))``) is copied into the slot.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_ragged.engine.init_replay import on_meta_noop_inits, tied_target_slots
from lightning_ragged.engine.meta_loads import watching

NOT_RECORDED = frozenset({"requires_grad_", "retain_grad", "share_memory_", "register_hook", "_set_grad_enabled"})
"""Calls that change no value (autograd flags, hooks)."""
NOT_RECORDED_SETTERS = (torch._C.TensorBase.data, torch._C.TensorBase.grad, torch._C.TensorBase.requires_grad)
"""Attribute setters that move a tensor object to other storage or change flags, writing no value: the
calls around them already name the storages they touch (``Ref``)."""
EMPTY_FACTORIES = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
"""Factories whose values are undefined: a slot's storage made by one needs no copy."""


class UnreplayableError(RuntimeError):
    """The recording cannot be replayed on this model (the structural replay is used instead)."""


@dataclass(frozen=True)
class Ref:
    """A tensor as a recorded call saw it: its storage and its place in it then (``.data = ...`` may move the
    same Python object to another storage later)."""

    tensor: torch.Tensor
    key: int
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return Ref(value, _key(value), value.shape, value.stride(), value.storage_offset())


@dataclass
class Call:
    func: Any
    args: tuple
    kwargs: dict
    result: Any
    default_dtype: torch.dtype
    init_name: str | None = None
    """A ``torch.nn.init`` function that returns early on meta tensors: looked up by name when replayed."""


@dataclass
class Recording:
    """The calls of one construction, in order (their tensors held, so their storages stay unique)."""

    calls: list[Call] = field(default_factory=list)

    def covers(self, module: nn.Module) -> bool:
        """Every meta parameter of ``module`` was made by a recorded call."""
        made = {ref.key for call in self.calls for ref in _refs(call.result) if ref.tensor.is_meta}
        return all(_key(p) in made for p in map(_recorded, module.parameters()) if p.is_meta)

    def program(self, module: nn.Module, tied: set[tuple[int, str]]) -> "RecordedProgram":
        """Bind the calls to ``module``'s slots; call before ``fully_shard`` replaces its parameters.

        ``tied``: the slots that hold another slot's parameter (``init_replay.tied_target_slots``).
        """
        touched = {ref.key for call in self.calls for ref in _refs((call.args, call.kwargs, call.result))}
        slots: dict[int, tuple[nn.Module, str, str, torch.Tensor]] = {}
        kept: set[tuple[int, str]] = set()
        for sub in module.modules():
            for kind, table in (("param", sub._parameters), ("buffer", sub._buffers)):
                for attr, tensor in table.items():
                    if tensor is None or (id(sub), attr) in tied:
                        continue
                    tensor = _recorded(tensor)
                    if not (tensor.is_meta or _key(tensor) in touched):
                        kept.add((id(sub), attr))  # real, from outside the recording: its values stand
                        continue
                    key = _key(tensor)
                    if key in slots:
                        if slots[key][3] is not tensor:
                            raise UnreplayableError(
                                f"'{attr}' of {type(sub).__name__} shares its storage with another parameter or buffer")
                        continue  # one module in two places
                    slots[key] = (sub, kind, attr, tensor)
        return RecordedProgram(self.calls, slots, kept)


class RecordedProgram:
    """The recorded calls bound to a model's slots; ``start(device)`` before each run of its events."""

    def __init__(self, calls: list[Call], slots: dict[int, tuple[nn.Module, str, str, torch.Tensor]],
                 kept: set[tuple[int, str]]) -> None:
        self.slots = slots
        self.kept = kept
        """(id(module), attr) of the real tensors no recorded call touched (a module attached after the
        recording): ``fully_shard`` already copied their values into the shards, nothing replays them."""
        self.events = [RecordedCall(self, call) for call in calls]
        self.device = torch.device("meta")
        self._made: dict[int, tuple[torch.Tensor, int]] = {}

    def start(self, device: torch.device) -> None:
        """A new run (the meta dry run, then the replay on ``device``): forget the tensors made before."""
        self.device, self._made = torch.device(device), {}

    def resolve(self, value: Any) -> Any:
        if isinstance(value, torch.device) and value.type == "meta":
            return self.device  # ``x.to(w.device)``: the device the construction ran on is the replay's
        if not isinstance(value, Ref):
            return value
        if value.key in self.slots:
            sub, kind, attr, slot = self.slots[value.key]
            base = (sub._parameters if kind == "param" else sub._buffers)[attr]
            if hasattr(base, "ragged_shard"):  # the shard: not bound, the call reads no value (a view, new_tensor)
                return torch.empty_strided(value.shape, value.stride, dtype=slot.dtype, device=self.device)
            return _view_like(base, value, slot.storage_offset())
        made = self._made.get(value.key)
        if made is not None:
            return _view_like(made[0], value, made[1])
        if value.tensor.is_meta:
            raise UnreplayableError(f"a meta tensor of shape {tuple(value.shape)} was made by no recorded call")
        return value.tensor  # a real tensor from before the recording (or a legacy constructor's, then a slot's)

    def keep(self, meta: Ref, real: torch.Tensor, fresh: bool, writes: bool) -> None:
        """``real`` is what the replay made for the recorded output ``meta``: remember its storage, or copy it
        into the slot that owns it when the recording made new storage there (``fresh``; ``writes``: its values
        are defined). The replay may return an input where the recording copied (``x.to(meta)`` then is x)."""
        if meta.key in self.slots:
            if fresh and writes:
                self.resolve(meta).copy_(real)
        elif meta.key not in self._made:  # fresh, or an alias the replay returned where the recording copied
            self._made[meta.key] = (real, meta.offset)  # (``x.to(meta)`` made a meta copy; ``x.to(cpu)`` is x)


class RecordedCall:
    """One recorded call, replayed on the tensors its meta arguments stand for (``InitEvent``'s interface)."""

    def __init__(self, program: RecordedProgram, call: Call) -> None:
        self.program, self.call = program, call

    def run(self) -> None:
        call, program = self.call, self.program
        func = getattr(torch.nn.init, call.init_name) if call.init_name else call.func
        args, kwargs = tree_map(program.resolve, (call.args, call.kwargs))
        if isinstance(kwargs.get("device"), str) and torch.device(kwargs["device"]).type == "meta":
            kwargs["device"] = program.device
        inputs = {ref.key for ref in _refs((call.args, call.kwargs))}  # a result in none of them was new storage
        previous = torch.get_default_dtype()
        torch.set_default_dtype(call.default_dtype)
        try:
            with torch.device(program.device), torch.no_grad():
                result = func(*args, **kwargs)
                metas, _ = tree_flatten(call.result)
                reals, _ = tree_flatten(result)
                if len(metas) != len(reals):
                    raise UnreplayableError(f"{_name(call.func)} returned another structure when replayed")
                writes = _name(call.func) not in EMPTY_FACTORIES
                for meta, real in zip(metas, reals):
                    if isinstance(meta, Ref) and isinstance(real, torch.Tensor):
                        program.keep(meta, real, fresh=meta.key not in inputs, writes=writes)
        finally:
            torch.set_default_dtype(previous)


class _Recorder(TorchFunctionMode):
    def __init__(self, recording: Recording, hf: "_HFInitOnMeta") -> None:
        super().__init__()
        self.recording, self.hf = recording, hf

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.hf.ensure()
        before = tree_map(Ref.of, (args, kwargs))  # as the call sees them (``.data = x`` moves its target)
        result = func(*args, **kwargs)
        name = _name(func)
        writes = name.endswith("_") or name == "__setitem__"
        after = tree_map(Ref.of, result)
        setter = name == "__set__" and any(getattr(func, "__self__", None) is s for s in NOT_RECORDED_SETTERS)
        if name not in NOT_RECORDED and not setter and (writes or _refs(after)) and _refs((before, after)):
            self.recording.calls.append(Call(func, *before, after, torch.get_default_dtype()))
        return result


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Record the tensor calls of a construction (inside a ``torch.device("meta")`` context)."""
    record = Recording()

    def on_meta(name: str, original: Any, tensor: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        before = tree_map(Ref.of, ((tensor, *args), kwargs))
        record.calls.append(Call(original, *before, Ref.of(tensor), torch.get_default_dtype(), name))
        return tensor

    hf = _HFInitOnMeta()
    try:
        with on_meta_noop_inits(on_meta), _Recorder(record, hf), watching():  # loads into it are kept (meta_loads.py)
            yield record
    finally:
        hf.restore()


class _HFInitOnMeta:
    """transformers' ``init_weights`` skips ``initialize_weights()`` under a meta device context (nothing to
    draw); an eager build runs it, so the recording must see its calls: while recording, transformers sees the
    device eager builds on. Patched once transformers is imported (a model's ``__init__`` may import it)."""

    def __init__(self) -> None:
        self.module: Any = None
        self.original: Any = None

    def ensure(self) -> None:
        modeling = sys.modules.get("transformers.modeling_utils")
        original = getattr(modeling, "get_torch_context_manager_or_global_device", None)
        if self.module is not None or original is None:
            return

        def eager_device() -> torch.device:
            device = original()
            return torch.device("cpu") if device == torch.device("meta") else device

        self.module, self.original = modeling, original
        modeling.get_torch_context_manager_or_global_device = eager_device

    def restore(self) -> None:
        if self.module is not None:
            self.module.get_torch_context_manager_or_global_device = self.original
            self.module = None


def _name(func: Any) -> str:
    return getattr(func, "__name__", "") or ""


def _refs(tree: Any) -> list[Ref]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, Ref)]


def _recorded(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor the recording saw in a slot: a shard made from a meta parameter (the user's ``fully_shard`` in
    ``configure_model``, before the strategy binds the recording) stands for that parameter."""
    return getattr(tensor, "ragged_meta_original", tensor)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _view_like(base: torch.Tensor, ref: Ref, base_offset: int) -> torch.Tensor:
    """The part of ``base``'s storage that ``ref`` was of the recorded storage whose ``base_offset`` ``base`` stands at."""
    if ref.shape == base.shape and ref.stride == base.stride() and ref.offset == base_offset:
        return base
    return base.as_strided(ref.shape, ref.stride, base.storage_offset() + ref.offset - base_offset)


def bind_recordings(module: nn.Module, recordings: list[Recording]) -> RecordedProgram | None:
    """The calls of ``recordings`` (in order, then forgotten) bound to ``module``, if they made all its meta
    parameters; None otherwise (built outside a recording, or cast after it), with a warning when unreplayable."""
    record = Recording([call for recorded in recordings for call in recorded.calls])
    recordings.clear()
    if not record.calls or not record.covers(module):
        return None
    try:
        return record.program(module, tied_target_slots(module))
    except UnreplayableError as error:
        warnings.warn(f"the recorded construction cannot be replayed ({error}); replaying reset_parameters() and "
                      "Hugging Face initialization instead (init_replay.py)", stacklevel=3)
        return None
