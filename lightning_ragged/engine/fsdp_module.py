"""``FSDPModule``: the methods torch's FSDP2 gives a sharded module, on ours.

``fully_shard`` changes the class of the module it shards (and of every group's module)
to a subclass of the original class and this mixin, as torch's ``fully_shard`` does, so
loops written for FSDP2 (``model.set_requires_gradient_sync(False)``, ``block.unshard()``)
run unchanged. ``isinstance(module, OriginalClass)`` still holds.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from lightning_ragged.engine.collectives import check_comm
from lightning_ragged.engine.state_dict import full_state_dict
from lightning_ragged.engine.state_shard import StateShard

_SUBCLASSES: dict[tuple[type, bool], type] = {}


class FSDPModule:
    """Mixin of every module ``lightning_ragged.fully_shard`` sharded or made a group of."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A container re-building itself (``nn.Sequential[1:]`` calls ``self.__class__(...)``)
        # gets the original class: the new module holds no group of its own.
        original = cls.__mro__[2]
        module = original.__new__(original)
        module.__init__(*args, **kwargs)
        return module

    def __deepcopy__(self, memo: dict) -> Any:
        """Refused with the engine's message, before ``copy`` rebuilds the module through ``__new__`` (which re-runs
        the original ``__init__`` without its arguments: a constructor's TypeError, or a new module and RNG draws)."""
        return self._ragged_fsdp_state.__deepcopy__(memo)

    def _ragged_own_groups(self) -> list:
        """The groups this module is a member of (a group of several blocks is every member's, as FSDP2's); the
        root's also the embedding group its call split off (FSDP2's root holds that embedding)."""
        groups = self._ragged_fsdp_state.all_groups
        own = [group for group in groups if any(m is self for m in group.members)]
        if any(group.is_root for group in own):
            own += [group for group in groups if group.root_part and not group.is_root]
        return own

    def _ragged_own_dbuffers(self) -> list:
        return [dbuffer for group in self._ragged_own_groups() for dbuffer in group.dbuffers]

    def _ragged_nested_groups(self) -> list:
        inside = {id(m) for m in self.modules()}
        return [group for group in self._ragged_fsdp_state.all_groups if any(id(m) in inside for m in group.members)]

    def unshard(self, async_op: bool = False) -> Any:
        """All-gather this module's own group (not the nested ones, as FSDP2) and point it at the full parameters.

        With ``async_op=True`` returns a handle; ``handle.wait()`` finishes the all-gather and points the module at
        the full parameters.
        """
        groups = self._ragged_own_groups()
        handle = self._ragged_fsdp_state.unshard(groups, async_op=async_op)
        if not async_op:
            for group in groups:
                group.use_unsharded()
            return None
        return handle

    def reshard(self) -> None:
        """Free this module's own full parameters and point it back at the shards."""
        self._ragged_fsdp_state.reshard(self._ragged_own_groups())

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Reduce gradients in the next backwards (True) or accumulate them locally with no collective, as FSDP2:
        for this module's group and (``recurse``) the groups nested in it; the other groups keep theirs."""
        for group in self._ragged_nested_groups() if recurse else self._ragged_own_groups():
            group.requires_gradient_sync = group.requires_all_reduce = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP accumulation with the shard group's reduction but not the replica all-reduce (False), as FSDP2's:
        each backward's sum is held, no gradient written; the next backward with True adds it in before its
        all-reduce. Without replicas there is nothing to skip. ``set_requires_gradient_sync`` sets it too."""
        for group in self._ragged_nested_groups() if recurse else self._ragged_own_groups():
            group.requires_all_reduce = bool(requires_all_reduce)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the reduced gradient sum of this module's own group by ``factor`` instead of the data-parallel size
        (the average, DDP's), as FSDP2's: ``1.0`` sums, e.g. for a loss summed over the global batch."""
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor({factor!r}): pass a positive number (1.0: a plain sum)")
        for group in self._ragged_own_groups():
            for dbuffer in group.dbuffers:
                dbuffer.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_custom_all_gather(self, comm: Any) -> None:
        """FSDP2's: this module's own group all-gathers through ``comm`` (torch's ``AllGather``; None: ours again).
        Its ``allocate`` makes the output, which is not the parameters' storage: copied into it once finished."""
        check_comm(comm, "set_custom_all_gather")
        for dbuffer in self._ragged_own_dbuffers():
            if comm is not None and dbuffer.fp8_gather is not None:
                raise ValueError("set_custom_all_gather: this module's parameters are gathered as fp8 "
                                 "(fully_shard(..., fp8_all_gather=...)); exclude it with fp8_all_gather's module_filter")
            dbuffer.custom.all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """FSDP2's: this module's own group reduces through ``comm`` (torch's ``ReduceScatter``, called with
        ``ReduceOp.SUM``; the division follows, as ``set_gradient_divide_factor`` says; None: ours again). It
        replaces ``reduce_mode``; its ``allocate`` makes the input, a copy of the gradient buffer, and the output."""
        check_comm(comm, "set_custom_reduce_scatter")
        for dbuffer in self._ragged_own_dbuffers():
            dbuffer.custom.reduce_scatter = comm

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None, *, stream: Any = None) -> None:
        """FSDP2's: ``hook(reduced)`` for each of this module's own DBuffers once its reduction (HSDP: and the
        replica all-reduce) finished, before its gradients are written: ``reduced`` is this rank's flat segment,
        divided, in the reduce dtype; changes made in place are the gradients. ``stream``: a device stream to
        run it on (ordered after the reduction and before the gradients' use)."""
        if hook is not None and not callable(hook):
            raise TypeError(f"set_all_reduce_hook({hook!r}): pass a function of the reduced tensor, or None")
        for dbuffer in self._ragged_own_dbuffers():
            dbuffer.custom.all_reduce_hook, dbuffer.custom.hook_stream = hook, stream

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """FSDP2's: whether this module's own group is all-gathered again for its backward. False only where the
        backward reads none of its parameters (an embedding: lightning_ragged decides that one by itself); with
        a parameter it does read, backward fails on the freed storage. True: always re-gathered, as by default."""
        for group in self._ragged_own_groups():
            group.unshard_in_backward = group.is_root or bool(unshard_in_backward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Keep the full parameters after backward (False), e.g. across accumulation micro-batches."""
        for group in self._ragged_nested_groups() if recurse else self._ragged_own_groups():
            group.reshard_after_backward = bool(reshard_after_backward)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Free the full parameters after forward (True) or keep them for backward (False); under ``no_grad``
        (evaluation, generation) False keeps them across forwards, until ``reshard()`` or a backward's end."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward({reshard_after_forward!r}): pass a bool; an int (reshard to a "
                "smaller group) needs its process groups made at fully_shard(..., reshard_after_forward=int)"
            )
        for group in self._ragged_nested_groups() if recurse else self._ragged_own_groups():
            group.reshard_after_forward = reshard_after_forward  # the root's matters under no_grad only

    def set_modules_to_forward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        """All-gather these sharded modules' groups as soon as this module's forward starts."""
        self._set_prefetch("forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        """All-gather these sharded modules' groups as soon as this module's backward starts."""
        self._set_prefetch("backward_prefetch", modules)

    def _set_prefetch(self, attribute: str, modules: Iterable[nn.Module]) -> None:
        targets = []
        for module in modules:
            if not isinstance(module, FSDPModule) or module._ragged_fsdp_state is not self._ragged_fsdp_state:
                raise ValueError(
                    f"set_modules_to_{attribute.split('_')[0]}_prefetch: {type(module).__name__} is not a group of "
                    "this sharded model; pass modules that fully_shard sharded (e.g. the other blocks)"
                )
            targets += module._ragged_own_groups()
        for group in self._ragged_own_groups():
            setattr(group, attribute, targets)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2's loops; nothing to do: every backward ends with its reductions finished."""

    def set_post_optim_event(self, event: Any) -> None:
        """FSDP2's: the next all-gathers wait for ``event`` (an optimizer step on another stream). Here the current
        stream waits for it at once, and the all-gathers wait for the current stream (``streams.py``): ordered
        at least as FSDP2 orders them."""
        if event is not None:
            torch.accelerator.current_stream().wait_event(event)

    def reset_iter_state(self) -> None:
        """FSDP2's recovery after a forward or backward raised: free what it allocated, drop gradients not yet
        reduced (the next root forward does this by itself too). On the root module only, as FSDP2."""
        state = self._ragged_fsdp_state
        if state.root is not self:
            raise RuntimeError(f"reset_iter_state() must be called on the root module ({type(state.root).__name__})")
        state.recover()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # ``.to()``, ``.double()``, ``.half()``, ``.cuda()`` would give the module new tensors that
        # the DBuffers know nothing of: refuse a real move or cast instead of silently unlinking.
        # ``to_empty(device=...)`` on the DBuffers' device (FSDP2's meta-device flow) leaves the parameters
        # and their gradients in their DBuffers (they have storage: uninitialized is what it promises) and
        # gives the other tensors (buffers) theirs.
        state = self._ragged_fsdp_state
        renewed = False
        for dbuffer in state.dbuffers():
            probe = torch.empty(0, dtype=dbuffer.master_dtype, device=dbuffer.device)
            moved = fn(probe)
            renewed |= moved is not probe
            if moved.dtype != probe.dtype or moved.device != probe.device:
                raise RuntimeError(
                    f"{type(self).__name__} is sharded by lightning_ragged.fully_shard: moving or casting it "
                    f"({dbuffer.master_dtype} on {dbuffer.device} -> {moved.dtype} on {moved.device}) would unlink "
                    "its parameters from their DBuffers. Move/cast the model before fully_shard (or pass "
                    "fully_shard(..., device=...)), and use mp_policy=MixedPrecisionPolicy(param_dtype=...) "
                    "for a compute dtype"
                )
        if renewed and state.root is self:
            warnings.warn(TO_EMPTY_WARNING, stacklevel=3)
        managed = {id(p) for b in state.dbuffers() for params in (b.sharded_params, b.unsharded_params)
                   for p in params.values()}
        managed |= {id(p.grad) for b in state.dbuffers() for p in b.sharded_params.values() if p.grad is not None}
        return super()._apply(lambda tensor: tensor if id(tensor) in managed else fn(tensor), recurse)


TO_EMPTY_WARNING = (
    "to_empty kept the parameters of this sharded model in their DBuffers, uninitialized: initialize them inside "
    "lightning_ragged.summon_full_params(module) (whole tensors, the same on every rank under one seed), or load a "
    "checkpoint. An initializer run on the 1-D shards draws each rank's own numbers, not its slice of one tensor"
)
"""Warned when a sharded model (its root module) is given new tensors of the DBuffers' own dtype and device."""


def _any(*_args: Any, **_kwargs: Any) -> bool:
    return True


def _true(flag: Any = True, *_args: Any, **_kwargs: Any) -> bool:
    return bool(flag)


FSDP2_ONLY_METHODS: dict[str, tuple[Callable[..., bool], str]] = {
    "set_force_sum_reduction_for_comms": (_any, "the reduction's result is the average either way"),
    "set_reduce_scatter_unused_params": (_true, "every trainable DBuffer is reduced whole, unused parameters as "
                                                "zeros"),
    "set_reduce_scatter_max_input_buffers": (_any, "at most one reduction is in flight"),
    "set_separate_reduce_scatter_group": (_any, "reductions use the shard process group"),
    "set_symm_mem_for_comm": (_any, "collectives use the process group's own buffers"),
    "set_allocate_memory_from_process_group_for_comm": (_any, "collectives use the process group's own buffers"),
}
"""FSDP2 module methods with no counterpart here: (which arguments are accepted as a no-op; what lightning_ragged
does instead). Accepted values change only speed or are what the engine does anyway; others are refused."""


def _fsdp2_only(name: str, accepts: Callable[..., bool], reason: str) -> Callable[..., None]:
    def method(self: Any, *args: Any, **kwargs: Any) -> None:
        if not accepts(*args, **kwargs):
            shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
            raise NotImplementedError(f"{name}({shown}) of torch's FSDP2 is not implemented by lightning_ragged: "
                                      f"{reason}")

    method.__name__ = name
    method.__doc__ = f"FSDP2's; a no-op where {reason}."
    return method


for _name, (_accepts, _reason) in FSDP2_ONLY_METHODS.items():
    setattr(FSDPModule, _name, _fsdp2_only(_name, _accepts, _reason))


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """FSDP2's ``register_fsdp_forward_method``: ``module.<method_name>(...)`` runs inside the engine's forward hooks.

    A method other than ``forward`` (an ``encode``, Hugging Face's ``generate``) that reads the
    module's parameters itself would see this rank's 1-D shards. As torch's, the wrapper calls
    the hooks lightning_ragged put on ``module`` (gathers, the backward's reductions, the root's
    step start and end, the latter also when the method raises) around the method; other hooks
    on the module (activation checkpointing's, yours) are not run for it. They are looked up at
    each call, so registering before the module is sharded (in a LightningModule's
    ``configure_model``, before the strategy shards it) works too; on a module with none, the
    method runs as it is. A generator method runs its body after the hooks: not supported.
    """
    method = getattr(module, method_name, None)
    if method is None:
        raise ValueError(f"{type(module)} does not have a method {method_name!r}")
    if not callable(method) or isinstance(method, nn.Module):
        raise ValueError(f"{type(module).__name__}.{method_name} is a {type(method).__name__}, not a method")

    @functools.wraps(method)
    def within_engine_hooks(*args: Any, **kwargs: Any) -> Any:
        pre_hooks, post_hooks = _engine_forward_hooks(module)
        for hook in pre_hooks:
            args, kwargs = hook(module, args, kwargs)
        try:
            output = method(*args, **kwargs)
        except BaseException:
            for hook_id, hook in post_hooks:  # as nn.Module does: the always-called ones, their errors silenced
                if hook_id in module._forward_hooks_always_called:
                    with contextlib.suppress(Exception):
                        hook(module, args, None)
            raise
        for _, hook in post_hooks:
            result = hook(module, args, output)
            output = output if result is None else result
        return output

    module.__dict__[method_name] = within_engine_hooks


def _engine_forward_hooks(module: nn.Module) -> tuple[list[Callable], list[tuple[int, Callable]]]:
    """The forward pre-hooks (all take kwargs) and forward hooks lightning_ragged registered on ``module``."""
    state = module.__dict__.get("_ragged_fsdp_state")
    ours = set() if state is None else {handle.id for handle in state.handles}
    pre = [hook for hook_id, hook in module._forward_pre_hooks.items() if hook_id in ours]
    post = [(hook_id, hook) for hook_id, hook in module._forward_hooks.items() if hook_id in ours]
    return pre, post


def mark_managed(root: nn.Module, state: Any) -> None:
    """Every module of a sharded model points at its state and carries torch's FSDP2 mark.

    ``_is_fsdp_managed_module`` (with ``_fsdp_use_orig_params``, as torch's ``fully_shard`` sets
    them) is what libraries read to keep ranks in step: transformers' ``generate`` then syncs
    the ranks (``synced_gpus``), so a rank whose sequences ended keeps joining the gathers.
    """
    for submodule in root.modules():
        submodule.__dict__.update(_ragged_fsdp_state=state, _is_fsdp_managed_module=True, _fsdp_use_orig_params=True)


def make_fsdp_module(module: nn.Module) -> None:
    """Change ``module``'s class to ``RaggedFSDP<Class>`` (a subclass of its class and :class:`FSDPModule`)."""
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    # already given the save_pretrained gather: start from its original class
    module.__class__ = _subclass(cls.__dict__.get("_ragged_original", cls), fsdp=True)


def make_save_pretrained_gather(root: nn.Module) -> None:
    """Every ``transformers`` model inside ``root`` (e.g. the one a LightningModule holds) saves full tensors.

    Its class becomes a subclass whose only change is ``save_pretrained`` (see
    :func:`_sharded_save_pretrained`); modules that are groups already got it from
    :func:`make_fsdp_module`. Without this, ``save_pretrained`` would write each rank's 1-D shards.
    """
    for module in root.modules():
        cls = type(module)
        if "_ragged_original" not in cls.__dict__ and callable(getattr(cls, "save_pretrained", None)):
            module.__class__ = _subclass(cls, fsdp=False)


def _subclass(cls: type, fsdp: bool) -> type:
    """``cls`` remembering itself as ``_ragged_original``, with the gathering ``save_pretrained`` and a refused
    ``resize_token_embeddings`` for a ``transformers`` model; ``fsdp``: also an :class:`FSDPModule`, named ``RaggedFSDP<Class>`` (made once per class)."""
    new_cls = _SUBCLASSES.get((cls, fsdp))
    if new_cls is None:
        namespace: dict[str, Any] = {"__module__": cls.__module__, "_ragged_original": cls}
        if callable(getattr(cls, "save_pretrained", None)):
            namespace["save_pretrained"] = _sharded_save_pretrained
        if callable(getattr(cls, "resize_token_embeddings", None)):
            namespace["resize_token_embeddings"] = _refused_resize_token_embeddings
        bases = (FSDPModule, cls) if fsdp else (cls,)
        new_cls = type(f"RaggedFSDP{cls.__name__}" if fsdp else cls.__name__, bases, namespace)
        _SUBCLASSES[cls, fsdp] = new_cls
    return new_cls


def _refused_resize_token_embeddings(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``transformers``' resize reads the embedding's 2-D shape, which a sharded model holds as 1-D shards."""
    raise RuntimeError(
        f"{type(self)._ragged_original.__name__}.resize_token_embeddings after fully_shard: its embedding is held as "
        "1-D shards that cannot be resized in place. Resize before sharding: call model.resize_token_embeddings(...) "
        "before lightning_ragged.fully_shard (under the Trainer: in configure_model or __init__, which run before "
        "the strategy shards)"
    )


def _sharded_save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> None:
    """``save_pretrained`` of a sharded ``transformers`` model: full tensors, not each rank's 1-D shards.

    Without ``state_dict``: collective (every rank calls it, as FSDP2 users call it under torch's
    ``StateDictOptions``): the full state dict is gathered one DBuffer at a time to rank 0's CPU, and rank 0
    alone writes it through the model class's own ``save_pretrained``. With a full ``state_dict`` (the
    accelerate idiom: gathered before, then ``save_pretrained`` on rank 0 or with ``is_main_process``) it is
    written as given, no collective; one holding a shard is refused, naming it.
    """
    if kwargs.get("state_dict") is not None:
        shapes = {name: tuple(p.ragged_shard.global_shape) if hasattr(p, "ragged_shard") else tuple(p.shape)
                  for name, p in self.named_parameters(remove_duplicate=False)}
        for name, value in kwargs["state_dict"].items():
            if isinstance(value, StateShard) or name in shapes and tuple(getattr(value, "shape", ())) != shapes[name]:
                raise ValueError(
                    f"save_pretrained(state_dict=...): {name!r} is this rank's shard, not the model's "
                    f"{shapes.get(name)} tensor: pass full tensors (lightning_ragged.full_state_dict(model), called "
                    "on every rank) or drop state_dict and call save_pretrained on every rank"
                )
        type(self)._ragged_original.save_pretrained(self, save_directory, *args, **kwargs)
        return
    full = full_state_dict(self, cpu_offload=True, rank0_only=True)
    if dist.get_rank() == 0:
        type(self)._ragged_original.save_pretrained(self, save_directory, *args, state_dict=full, **kwargs)
    dist.barrier()
