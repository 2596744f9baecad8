"""ShardGroup: the runtime of one FSDP group (its DBuffers and the modules that use them).

It knows how to unshard/reshard its buffers, swap the module attributes between the
sharded parameters (what the optimizer and ``named_parameters`` see at rest) and the
unsharded ones (what forward and backward compute with), and where it is in a step:
how many forward calls ran and how many of their backwards finished. Scheduling across
groups (prefetch, reduction order) lives in ``runtime.py``.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Iterator

import torch
from torch import nn

from lightning_ragged.engine.dbuffer import DBuffer
from lightning_ragged.engine.full_writes import keep_full_writes, writes_kept
from lightning_ragged.engine.shard_cast import drop_at_optimizer_steps
from lightning_ragged.engine.grouping import needs_params_in_backward
from lightning_ragged.engine.substituted_params import agreed_refusal, is_substitute, refuse_substitute


class ShardGroup:
    """One group: DBuffers plus every (module, attribute) slot that holds one of its parameters.

    ``module`` runs the group (its forward unshards it). A group of several modules (consecutive
    blocks, or FSDP2's ``fully_shard([...])``) lists them in ``members`` (``module`` is the first):
    it unshards when the first of them starts a forward and is done with forward after the last one
    ends. The root group of an automatic ``fully_shard`` has ``is_root`` set: it holds what no block
    holds (embeddings, head, tied weights) and is unsharded by any module that uses one of its parameters.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        dbuffers: list[DBuffer],
        slots: list[tuple[nn.Module, str, DBuffer, str]],
        reshard_after_forward: bool | int | None,
        is_root: bool = False,
        members: list[nn.Module] | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.members: list[nn.Module] = members or [module]
        self.dbuffers = dbuffers
        self._gathered_versions = [-1] * len(dbuffers)
        """Each DBuffer's shards' version at its last gather; -1 after an optimizer step (fused kernels move none)."""
        self._full_versions = [-1] * len(dbuffers)
        """Each DBuffer's full buffer's version at its last gather: moved by writes to be kept (``full_writes.py``)."""
        drop_at_optimizer_steps(self)
        self.slots = slots
        self.pointed: dict[tuple[int, str], torch.Tensor] = {}
        """What the engine last put in each (module, attribute) slot (a module reachable under two names is listed
        twice): anything else there was a caller's (``substituted_params.py``)."""
        self.is_root = is_root
        self.reshard_after_forward: bool | int | None = reshard_after_forward
        self.root_part = is_root
        """Made by the root's own call: its root group or the embedding split off it (FSDP2's root holds both)."""
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        """FSDP2's per-module flag (``set_requires_gradient_sync(..., recurse)``); reduced only with the model's too."""
        self.requires_all_reduce = True
        """FSDP2's ``set_requires_all_reduce``: False (HSDP) holds the shard group's sums back from the replicas."""
        self.forward_prefetch: list[ShardGroup] | None = None
        """Groups to all-gather when this one's forward starts (None: the recorded order)."""
        self.backward_prefetch: list[ShardGroup] | None = None
        self.unshard_in_backward = is_root or self._members_read_params_in_backward()
        """FSDP2's ``set_unshard_in_backward``; False (decided for an embedding's group): no backward re-gather."""
        self.held_through_forward = False
        """Kept unsharded until the root's forward ends (and, training, until its backward): its parameters are
        read outside its own forward, or the first forward is finding out (``direct_reads.py``)."""
        self.read_outside_forward = False
        self.held_by_graph = False
        """A backward built a graph that saved the full parameters (``create_graph=True``: ``hook_modes.py``): they are
        never freed, only set aside, until a backward that builds none ends (``runtime.py``)."""
        self.mp_policy = None
        self.output_dtype: torch.dtype | None = None
        """The module's floating-point outputs cast to this dtype: ``mp_policy.output_dtype`` of the group whose
        module a ``fully_shard`` call was given (FSDP2 casts each sharded module's output; blocks grouped inside
        one call are not cast, their outputs feed the next block in the compute dtype)."""
        self.members_to_run: set[int] = set()
        """Of several members: those whose forward has not ended since the first of them started (``id``s)."""
        self.forward_calls = 0
        """Forward calls of this step with gradients enabled (a backward may follow)."""
        self.untracked_calls = 0
        """Of them, calls on inputs that need no gradient (a siamese block on raw data, a block revisited): no node
        marks the end of their backward, so the group is reduced and resharded at the end of backward."""
        self.backward_nodes: list[weakref.ref] = []
        """The ``PostBackward`` nodes of its calls whose graphs are alive (weakly: a dropped graph frees them)."""
        self.backward_calls = 0
        """Calls the running backward still has to finish here: the nodes it will execute, counted as it starts."""
        self.backward_prepared = False
        self._meta_versions: list[int] | None = None
        """Sharded from the meta device: each shard's version then (``uninitialized``)."""

    def mark_uninitialized(self) -> None:
        """Made from meta parameters: its shards have storage, not values, until something writes them."""
        self._meta_versions = [dbuffer.sharded._version for dbuffer in self.dbuffers]

    @property
    def from_meta(self) -> bool:
        return self._meta_versions is not None

    @property
    def uninitialized(self) -> bool:
        """Made from meta parameters and no shard written since: no load (``load_state_dict``, DCP, a full state
        dict), initialization (materialization, a summon) or step moved their version counters."""
        return self.from_meta and all(b.sharded._version == v for b, v in zip(self.dbuffers, self._meta_versions))

    def adopt(self, name: str, param_names: dict[int, str]) -> None:
        """A later ``fully_shard`` call on a parent took this group (FSDP2's order): a block of that model now, named
        ``name``; a group that was its own call's root is re-gathered for backward only where its modules need it.
        Its parameters' ``ragged_shard.name`` become their names in the parent (``param_names``, by ``id``), as
        after one call: optimizers key their state by them."""
        if self.is_root:
            self.unshard_in_backward = self._members_read_params_in_backward()
        self.name, self.is_root, self.root_part = name, False, False
        for dbuffer in self.dbuffers:
            for param in dbuffer.sharded_params.values():
                new = param_names.get(id(param), param.ragged_shard.name)
                param.ragged_shard = dataclasses.replace(param.ragged_shard, name=new)

    @property
    def kept_after_no_grad_forward(self) -> bool:
        """No backward follows a no-grad forward: ``reshard_after_forward=False`` keeps the full parameters for
        the next forward, and so does FSDP2's default (None) for the root's own groups, as FSDP2 keeps its root
        (a ``generate`` of n tokens gathers the root once, not n times)."""
        return self.reshard_after_forward is False or (self.reshard_after_forward is None and self.root_part)

    def _members_read_params_in_backward(self) -> bool:
        return any(needs_params_in_backward(member) for member in self.members)

    @property
    def is_unsharded(self) -> bool:
        return all(dbuffer.is_unsharded for dbuffer in self.dbuffers)

    @property
    def unshard_pending(self) -> bool:
        """An all-gather of one of its DBuffers was issued and not waited for (an fp8 one allocates at the wait)."""
        return any(dbuffer.unshard_pending for dbuffer in self.dbuffers)

    def unsharded_params(self) -> Iterator[tuple[DBuffer, str, nn.Parameter]]:
        for dbuffer in self.dbuffers:
            for name, param in dbuffer.unsharded_params.items():
                yield dbuffer, name, param

    def check_linked(self) -> None:
        """Refuse a step on parameters a move or cast of a plain submodule (``model.head.half()``) took out of
        their DBuffers (only the sharded modules refuse it at the call): the step would compute with the
        DBuffer's values and fail, or train a copy the collectives never see."""
        for dbuffer in self.dbuffers:
            for params, buffer in ((dbuffer.sharded_params, dbuffer.sharded), (dbuffer.unsharded_params,
                                                                                dbuffer.unsharded)):
                home = buffer.untyped_storage()._cdata
                for name, param in params.items():
                    if param.dtype != buffer.dtype or param.untyped_storage()._cdata != home:
                        raise RuntimeError(_unlinked_message(_model_name(dbuffer, name), param, buffer))

    # ------------------------------------------------------------ parameters
    def unshard(self, async_op: bool = False) -> None:
        """All-gather each DBuffer; full parameters (or a part) kept from before their shards changed (an optimizer
        step, a load) are gathered again, never used stale (FSDP2 would compute with them)."""
        for index, dbuffer in enumerate(self.dbuffers):
            if self._gathered_versions[index] != dbuffer.sharded._version and not dbuffer.full_is_shard:
                dbuffer.reshard()
            if not (dbuffer.is_unsharded or dbuffer.unshard_pending):
                self._full_versions[index] = dbuffer.unsharded._version
            dbuffer.unshard(async_op=async_op)
            self._gathered_versions[index] = dbuffer.sharded._version

    def drop(self) -> None:
        self._gathered_versions = [-1] * len(self.dbuffers)

    def wait_unshard(self) -> None:
        for dbuffer in self.dbuffers:
            dbuffer.wait_unshard()

    def use_unsharded(self) -> None:
        """Unshard (waiting for a prefetch if one is in flight) and point the modules at full parameters."""
        self.unshard()
        self.wait_unshard()
        self.point_slots_at(lambda dbuffer, name: dbuffer.unsharded_params[name], substitutes="refuse others")

    def keep_full_writes(self) -> None:
        """In-place writes to the full parameters since their gather go to the shards (``full_writes.py``), unless the
        shards changed meanwhile (an optimizer step: the full ones are stale and dropped)."""
        self.wait_unshard()
        for index, dbuffer in enumerate(self.dbuffers):
            if dbuffer.is_unsharded and dbuffer.unsharded._version != self._full_versions[index] \
                    and self._gathered_versions[index] == dbuffer.sharded._version and writes_kept(dbuffer):
                keep_full_writes(dbuffer)
                self._full_versions[index], self._gathered_versions[index] = \
                    dbuffer.unsharded._version, dbuffer.sharded._version  # the full buffer still equals the shards

    def reshard(self) -> None:
        """Free the full parameters and point the modules back at the shards (only the latter while a graph holds
        them: freed storage read by that graph's backward would crash it)."""
        if self.held_by_graph:
            self.set_aside()
            return
        self.keep_full_writes()
        for dbuffer in self.dbuffers:
            dbuffer.reshard()
        self.use_sharded()

    def reshard_after_backward_step(self) -> None:
        """After backward (or an evaluation forward): free everything, or keep the full parameters
        (``reshard_after_backward=False``) with any gather finished, so that a prefetch nothing used
        does not read the shards during the optimizer step."""
        if self.reshard_after_backward:
            self.reshard()
        else:
            self.wait_unshard()

    def reshard_after_forward_step(self) -> None:
        """After forward: free everything, keep a 1/int part (``reshard_after_forward=int``), or keep all."""
        if self.reshard_after_forward is False:
            return
        if self.reshard_after_forward is True or self.reshard_after_forward is None or self.held_by_graph:
            self.reshard()
            return
        self.keep_full_writes()
        for dbuffer in self.dbuffers:
            dbuffer.reshard_to_partial()
        self.use_sharded()

    def set_aside(self) -> None:
        """Keep the full parameters (the gather finished) for a later forward; the modules hold the shards
        meanwhile, so ``model.parameters()`` (an optimizer, gradient clipping) sees the shards."""
        self.keep_full_writes()
        self.use_sharded()

    def use_sharded(self) -> None:
        self.point_slots_at(lambda dbuffer, name: dbuffer.sharded_params[name], substitutes="keep")

    def point_slots_at(self, pick: Callable[[DBuffer, str], nn.Parameter], substitutes: str = "overwrite") -> None:
        """Set every module slot of this group to ``pick(dbuffer, name)`` (shards, full views, or other tensors).

        ``substitutes``: what to do with a tensor the engine did not put in a slot (``substituted_params.py``):
        "keep" a caller's full-shape one (between forward and ``functional_call``'s end), also "refuse others"
        (forward), or "overwrite" it.
        """
        substituted, refused = False, len(self.slots)
        for index, (module, attr, dbuffer, name) in enumerate(self.slots):
            if attr not in module._parameters:
                raise RuntimeError(
                    f"parameter '{_model_name(dbuffer, name)}' ({type(module).__name__}.{attr}) is no longer registered "
                    "on its module: "
                    "it was removed after fully_shard (torch.nn.utils.prune, weight_norm, spectral_norm, "
                    "parametrize.register_parametrization or del turn a parameter into a computed attribute), so "
                    "they would run on 1-D shards. Apply them before fully_shard: the engine then shards the "
                    "parameters they register and they see whole tensors in forward"
                )
            current, pointed = module._parameters[attr], self.pointed.get((id(module), attr))
            if substitutes != "overwrite" and pointed is not None and current is not pointed:
                substituted = True
                if is_substitute(current, dbuffer.sharded_params[name].ragged_shard.global_shape):
                    continue
                if substitutes == "refuse others":
                    refused = min(refused, index)
                    continue
            module._parameters[attr] = self.pointed[(id(module), attr)] = pick(dbuffer, name)
        if substituted and substitutes == "refuse others":  # every rank of the group refuses, or none
            dbuffer = self.dbuffers[0]
            refused = agreed_refusal(refused, dbuffer.process_group, dbuffer.sharded.device)
            if refused < len(self.slots):
                module, attr, dbuffer, name = self.slots[refused]
                refuse_substitute(module._parameters[attr], dbuffer.sharded_params[name].ragged_shard.global_shape,
                                  _model_name(dbuffer, name))

    # ------------------------------------------------------------- gradients
    def track_backward_node(self, node: torch.autograd.graph.Node) -> None:
        """Remember a call's post-backward node (weakly), dropping those of graphs already gone: forwards with
        grad enabled and no backward (inference without ``no_grad``) would grow the list one entry per call."""
        self.backward_nodes = [ref for ref in self.backward_nodes if ref() is not None]
        self.backward_nodes.append(weakref.ref(node))

    def count_backward_calls(self) -> None:
        """At the backward's first gradient here: how many of the module's calls this backward runs.

        Autograd decides it from the graph (``_will_engine_execute_node``), the same on every
        rank: both calls of ``(f(m(a)) + f(m(b))).backward()``, one each of two separate backwards,
        none of a forward whose graph was dropped or is not part of this backward.
        """
        alive = [(ref, node) for ref in self.backward_nodes if (node := ref()) is not None]
        self.backward_nodes = [ref for ref, _ in alive]
        self.backward_calls = sum(1 for _, node in alive if torch._C._will_engine_execute_node(node))

    def prepare_backward(self) -> None:
        """Unshard for backward unless it reads no parameter (each gradient buffer is allocated at its first
        gradient, which autograd computes without the full parameters then)."""
        if self.unshard_in_backward:
            self.use_unsharded()
        self.backward_prepared = True

    def end_backward(self) -> None:
        """Forget this backward's bookkeeping (after the reductions were issued)."""
        self.forward_calls = self.untracked_calls = 0
        self.backward_prepared = False

    def reset(self) -> None:
        """Drop a failed step: finish issued collectives, free full and gradient buffers, point at shards."""
        for dbuffer in self.dbuffers:
            dbuffer.reset()
        self.use_sharded()
        self.end_backward()
        self.members_to_run.clear()


class UnshardHandle:
    """Returned by ``module.unshard(async_op=True)``: ``wait()`` finishes the all-gathers and points the modules at
    the full parameters (FSDP2's handle), as ``unshard()`` does."""

    def __init__(self, groups: list[ShardGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            group.use_unsharded()


def _model_name(dbuffer: DBuffer, name: str) -> str:
    """A DBuffer's parameter by its name in the model (a parent call renames the shards of the groups it adopts)."""
    return dbuffer.sharded_params[name].ragged_shard.name


def _unlinked_message(name: str, param: nn.Parameter, buffer: torch.Tensor) -> str:
    """Why a parameter no longer views its DBuffer, and the fix: moved or cast, or its memory replaced."""
    if (param.dtype, param.device) == (buffer.dtype, buffer.device):
        return (
            f"parameter '{name}' holds other memory than its DBuffer's after fully_shard (`param.data = tensor` or "
            "`param.set_(...)` replaced the shard, which the collectives never see). To write values into a "
            "sharded parameter copy them in place: `with lightning_ragged.summon_full_params(model): "
            "param.copy_(tensor)` (whole tensors, written back to the shards), lightning_ragged.load_full_state_dict, "
            "or assign before fully_shard"
        )
    return (
        f"parameter '{name}' was moved or cast after fully_shard (it is {param.dtype} on "
        f"{param.device}; its DBuffer holds {buffer.dtype} on {buffer.device}): a .to(), "
        ".half() or .cuda() of a submodule of a sharded model unlinks its parameters from their "
        "DBuffers. Move/cast the model before fully_shard (or pass fully_shard(..., device=...)), "
        "and use mp_policy=MixedPrecisionPolicy(param_dtype=...) for a compute dtype"
    )
