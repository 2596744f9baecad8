"""The runtime of one sharded model: when each group unshards, reduces and reshards.

Per step (``reshard_after_forward=True``):

root pre-forward   start the step: mirror ``requires_grad`` changes, recover from a step that
                   raised, begin recording the forward order, broadcast the buffers from rank 0
                   (``broadcast_buffers``, after a synchronized training forward, as DDP)
group pre-forward  (a group of several blocks: its first block's) all-gather the group (or wait for its
                   prefetch), prefetch the next group, and put an autograd node on the module's inputs
                   whose backward runs when the module's whole backward is done (its *post-backward*)
group post-forward (its last block's) free the full parameters (or keep 1/int of them; ``keep_last_unsharded``: keep
                   the group the previous forward ran last, whose backward comes first); hook the outputs
pre-backward       (first gradient reaching an output) all-gather again, prefetch the group that
                   ran before; a DBuffer's gradient buffer is allocated at its first gradient
post-backward      reduce the group's trainable DBuffers (at most one reduction in flight),
                   then free its full parameters: frozen weights stay available until the
                   module's input gradient is computed
end of backward    groups without a post-backward (inputs needing no gradient, the root) are
                   finished; one small all-reduce of "which parameters got a gradient" keeps
                   ``grad is None`` for parameters no rank used (DDP's semantics; none on a single rank)

On an accelerator the all-gathers run on one all-gather stream and the reductions on one reduce
stream per model (``streams.py``, ordering rules there; on CPU the same code with no-op streams):
a group's use waits for its all-gather's event, and the end of backward finishes every reduction,
which makes the compute stream wait for each reduction's event before the optimizer step.

Collectives must be issued in the same order on every rank: as with FSDP2 and DDP, every
rank runs the same modules (a parameter may be unused on some ranks; a whole group may not).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from lightning_ragged.engine import collectives
from lightning_ragged.engine.collectives import CommStats
from lightning_ragged.engine.containers import map_tensors, replace_tensors_requiring_grad, tensors_requiring_grad
from lightning_ragged.engine.dbuffer import DBuffer
from lightning_ragged.engine.forward_order import ForwardOrder
from lightning_ragged.engine.hook_modes import autograd_running, eager, grad_arrived_hook
from lightning_ragged.engine.post_backward import PostBackward
from lightning_ragged.engine.reentrant_calls import in_reentrant_checkpoint, in_reentrant_recomputation
from lightning_ragged.engine.shard_group import ShardGroup, UnshardHandle
from lightning_ragged.engine.unused_grads import settle_unused
from lightning_ragged.engine.streams import CommStreams, device_streams


class RaggedFSDPState:
    """Schedules the groups of one sharded model: hooks, prefetch, reductions, accumulation."""

    def __init__(self, root: nn.Module, groups: list[ShardGroup], stats: CommStats) -> None:
        self.root = root
        self.called_on: list[nn.Module] = [root]
        """The modules the ``fully_shard`` call was given (a list's, or the root); a parent call adopts from them."""
        self.all_groups = groups
        self.stats = stats
        self.requires_gradient_sync = True
        self.cast_root_inputs = True
        """The root module's own forward casts its inputs (``mp_policy``); not the Lightning strategy's (a batch)."""
        self.keep_last_unsharded = False
        """Keep the group the last forward ran last unsharded until its backward, the first to need it."""
        self.max_inflight_all_gathers = 1  # groups all-gathered ahead of the running one (from the recorded order)
        self.forward_order: ForwardOrder[ShardGroup] = ForwardOrder()
        """Groups in the order the current (or last) forward ran them."""
        self._previous_order: ForwardOrder[ShardGroup] = ForwardOrder()
        self._root_depth, self._training_forward, self._in_backward, self.carry_frozen = 0, False, False, False
        self._root_ran = False  # the root group's pre-forward ran in this root forward (later: a module using it)
        self._in_flight: list[DBuffer] = []
        self._reduced: dict[DBuffer, None] = {}  # in reduction order
        self._hooked: set[int] = set()
        self.handles: list[Any] = []  # hook handles, removed when a parent ``fully_shard`` call adopts these groups
        self.auto_plan: Any = None
        self.split_by_stacks = False  # one call split its module along a stack inside it (``grouping.warn_split_blocks``)
        """``planning="auto"``: the ``layout.auto.AutoPlan`` that chose the groups, for reports."""
        self.buffer_sync: Any = None  # broadcast_buffers=True: a state_sync.BufferSync (run by _sync_buffers)
        self._buffers_need_sync = True  # DDP's require_forward_param_sync (true for the first forward too)
        self.graph_kept, self._building_graph = False, False
        """A backward built a graph through the full parameters (``hook_modes.py``): until one building none ends, the
        groups keep them (``ShardGroup.held_by_graph``) and reduce at each backward's end, every gradient arrived."""
        self._end_of_backward_hook = eager(self._end_of_backward, backward=True, graph_built=self.graph_built)
        first = next(self.dbuffers(), None)
        self.comm_streams: CommStreams = device_streams(first.device if first is not None else None)
        """All-gather and reduce streams of the model's device (``streams.py``)."""
        self.set_comm_streams(self.comm_streams)
        self._pre_backward_hooks = {id(g): eager(lambda _, g=g: self.pre_backward(g), backward=True,
                                                 graph_built=self.graph_built) for g in groups}

    @property
    def groups(self) -> list[ShardGroup]:
        """The block groups (every group but the root's)."""
        return [group for group in self.all_groups if not group.is_root]

    @property
    def root_group(self) -> ShardGroup:
        return next(group for group in reversed(self.all_groups) if group.is_root)

    @property
    def root_fraction(self) -> float:
        """Share of the parameters (elements) that sit in the root group, which is never resharded after forward."""
        def numel(groups: list[ShardGroup]) -> int:
            return sum(spec.numel for g in groups for b in g.dbuffers for spec in b.layout.specs.values())

        total = numel(self.all_groups)
        return numel([g for g in self.all_groups if g.is_root]) / total if total else 0.0

    @property
    def outermost_forward(self) -> bool:
        """The root's outermost forward is running (not a nested ``self(x)`` of a ``training_step``)."""
        return self._root_depth == 1 and not autograd_running()

    @property
    def running(self) -> bool:
        """A forward or backward of this model is running: its groups' full parameters are in use."""
        return self._root_depth > 0 or self._in_backward

    def __deepcopy__(self, memo: dict) -> "RaggedFSDPState":  # it would clone views of freed storage: a crash
        raise TypeError(
            "copy.deepcopy of a module sharded by lightning_ragged.fully_shard is not supported (as with torch's "
            "FSDP2): its full parameters are views into flat buffers that are freed between uses. Deep-copy the "
            "model before sharding it, or build a second model and load lr.full_state_dict(model) into it "
            "(a teacher copy); for an EMA, lr.ShardAveragedModel(model) averages the shards (as Lightning's "
            "EMAWeightAveraging does under the ragged_fsdp strategy)"
        )

    def dbuffers(self) -> Iterator[DBuffer]:
        for group in self.all_groups:
            yield from group.dbuffers

    def set_comm_streams(self, streams: CommStreams) -> None:
        """Run every DBuffer's collectives on ``streams`` (default: the device's, no-op on CPU; tests inject fakes).

        Call it between steps, with no collective in flight.
        """
        self.comm_streams = streams
        for dbuffer in self.dbuffers():
            dbuffer.streams = streams

    # ------------------------------------------------------------------- step
    def root_pre_forward(self) -> None:
        """The root's forward starts; the outermost call (not a nested ``self(x)`` in a
        LightningModule's ``training_step``) starts a step."""
        if autograd_running():
            return  # a recomputation (activation checkpointing) inside backward
        self._root_depth += 1
        if self._root_depth == 1:
            self._begin_step()
            self._training_forward = torch.is_grad_enabled()

    def root_post_forward(self, raised: bool = False) -> None:
        """The root's forward ended (also when it ``raised``: the hook runs ``always_call``; then every group goes
        back to its shards now, so ``model.parameters()`` before the next forward are the shards, not full views)."""
        if autograd_running():
            return
        self._root_depth = max(0, self._root_depth - 1)
        if raised and self._root_depth == 0:
            for group in self.all_groups:
                group.members_to_run.clear()
                group.reshard()
        if self._root_depth == 0:
            self._buffers_need_sync = torch.is_grad_enabled() and any(self.syncs(g) for g in self.all_groups)
            self._root_ran = False
        if self._root_depth == 0 and not torch.is_grad_enabled():  # evaluation: no backward will follow
            for group in self.all_groups:
                if group.kept_after_no_grad_forward:  # kept for the next forward (generation), as FSDP2
                    group.set_aside()
                else:
                    group.reshard_after_backward_step()

    def _begin_step(self) -> None:
        """Recover from a backward that raised, release what a backward-less forward kept, restart the recorded
        forward order. A forward whose backward is still to come (``(f(model(a)) + f(model(b))).backward()``) loses
        nothing here: each group counts the calls its next backward runs when that backward reaches it."""
        if self._in_backward:
            self.recover()
        for group in self.all_groups:
            group.check_linked()
            group.members_to_run.clear()  # left pending by a forward that raised between its members' hooks
        self._release_backwardless()
        self._previous_order, self.forward_order = self.forward_order or self._previous_order, ForwardOrder()
        self._sync_buffers()

    def _release_backwardless(self) -> None:
        """The last forward recorded a graph (or raised) but no backward ran: free its groups, forget its counts."""
        for group in self.all_groups:
            if group.forward_calls:
                if group.reshard_after_backward:
                    group.reshard()
                group.end_backward()

    def recover(self) -> None:
        """The last forward or backward raised: free what it allocated; the next step trains exactly.

        Gradients not yet reduced are dropped with their buffers (call ``optimizer.zero_grad()``
        before retrying, as after any failed step).
        """
        for group in self.all_groups:
            group.reset()
        self._in_flight.clear()
        self._reduced.clear()
        self._in_backward = False

    def hook_grad(self, group: ShardGroup, dbuffer: DBuffer, name: str, param: nn.Parameter) -> None:
        """Tell the runtime when autograd finished ``param``'s gradient (``group``'s ``dbuffer``; once per parameter)."""
        if id(param) in self._hooked:
            return
        self._hooked.add(id(param))
        self.handles.append(param.register_post_accumulate_grad_hook(grad_arrived_hook(self, group, dbuffer, name)))

    # ---------------------------------------------------------------- forward
    def _mirror_requires_grad(self, group: ShardGroup) -> None:
        """Give the full parameters the shards' ``requires_grad`` before each forward call: a flag changed
        inside a step (Lightning's ``toggle_optimizer`` between two backwards) holds for the next forward."""
        for dbuffer in group.dbuffers:
            for name, param in dbuffer.sync_requires_grad():
                self.hook_grad(group, dbuffer, name, param)

    def pre_forward(self, group: ShardGroup, args: tuple, kwargs: dict, cast: bool = True) -> tuple[tuple, dict]:
        if not self._in_backward:
            self._mirror_requires_grad(group)
            again = group.forward_calls or (self._root_ran and not torch.is_grad_enabled())
            if group.is_root and group.is_unsharded and again:  # another module using a root parameter
                return self.cast_inputs(group, args, kwargs, cast)
            self._root_ran = self._root_ran or (group.is_root and self._root_depth > 0)
            if not group.is_root:
                self.forward_order.record(group)
        group.use_unsharded()
        if self._in_backward:  # a recomputation (activation checkpointing) inside backward
            args, kwargs = self.cast_inputs(group, args, kwargs, cast)
            if group.untracked_calls and not group.forward_calls and torch.is_grad_enabled() \
                    and in_reentrant_recomputation():
                args, kwargs = self._track_recomputation(group, args, kwargs)
            return args, kwargs
        self._prefetch(group, forward=True)
        args, kwargs = self.cast_inputs(group, args, kwargs, cast)
        if torch.is_grad_enabled():
            group.forward_calls += 1
            if not group.is_root:
                args, kwargs = self._register_post_backward(group, args, kwargs)
        elif self._root_depth and self._training_forward and not group.is_root and in_reentrant_checkpoint():
            group.untracked_calls += 1  # its recomputation's gradient comes later in backward: reduce at its end
        return args, kwargs

    def post_forward(self, group: ShardGroup, output: Any) -> Any:
        """The group's module returned ``output``: hook its backward, reshard; the output in ``output_dtype``."""
        if torch.is_grad_enabled():
            self.hook_backward(group, output)
        if not (self._in_backward or group.is_root or group.held_through_forward):  # the root: kept for backward
            if not torch.is_grad_enabled():
                group.set_aside() if group.kept_after_no_grad_forward else group.reshard()
            elif not (self.keep_last_unsharded and self._previous_order and group is self._previous_order[-1]):
                group.reshard_after_forward_step()
        return _cast_outputs(group, output)

    def hook_backward(self, group: ShardGroup, output: Any) -> None:
        tensors = tensors_requiring_grad(output)
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward_hooks[id(group)], mode="any")

    def _register_post_backward(self, group: ShardGroup, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        inputs = tensors_requiring_grad((args, kwargs))
        if not inputs:  # nothing upstream needs a gradient: no node marks the end of this call's backward
            group.untracked_calls += 1
            return args, kwargs
        unique = list({id(t): t for t in inputs}.values())  # one view per tensor: MHA's `query is key` still holds
        outputs = dict(zip(map(id, unique), PostBackward.apply(self, group, *unique)))
        group.track_backward_node(next(iter(outputs.values())).grad_fn)
        return replace_tensors_requiring_grad((args, kwargs), [outputs[id(t)] for t in inputs])

    def _track_recomputation(self, group: ShardGroup, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A reentrant checkpoint recomputes a call its no-grad forward left untracked: a node on its inputs marks the
        end of its (nested) backward, where the group now reduces and frees, not at the end of the whole backward.
        Only for groups with no plain call this step: the nested backward cannot see that call's later node."""
        untracked = group.untracked_calls
        group.untracked_calls -= 1
        args, kwargs = self._register_post_backward(group, args, kwargs)
        if group.untracked_calls < untracked and group.backward_prepared:  # its calls were counted already
            group.backward_calls += 1
        return args, kwargs

    def _prefetch(self, group: ShardGroup, forward: bool) -> None:
        """Start the all-gather of the groups expected next (forward or backward).

        Explicit lists (``set_modules_to_*_prefetch``) win; otherwise forward follows the
        previous forward's order and backward this forward's order reversed, at most
        ``max_inflight_all_gathers`` groups ahead (the window slides by one group per call,
        so no more are ever in flight). The root group runs first in forward and its head
        first in backward.
        """
        targets = group.forward_prefetch if forward else group.backward_prefetch
        if targets is None:
            at, ahead = None if group.is_root else group, self.max_inflight_all_gathers
            targets = self._previous_order.next(at, ahead) if forward else self.forward_order.previous(at, ahead)
        for target in targets:
            if not target.backward_prepared and target is not group and (forward or target.unshard_in_backward):
                target.unshard(async_op=True)

    def cast_inputs(self, group: ShardGroup, args: tuple, kwargs: dict, cast: bool = True) -> tuple[tuple, dict]:
        policy = group.mp_policy
        if not cast or policy is None or policy.param_dtype is None or not policy.cast_forward_inputs:
            return args, kwargs

        def cast(value: torch.Tensor) -> torch.Tensor:
            return value.to(policy.param_dtype) if value.is_floating_point() else value

        return map_tensors(cast, args), map_tensors(cast, kwargs)

    # --------------------------------------------------------------- backward
    def graph_built(self) -> None:
        """A backward builds a graph of its own (``create_graph=True``): keep the full parameters it saves."""
        self.graph_kept = self._building_graph = True
        for group in self.all_groups:
            group.held_by_graph = True

    def pre_backward(self, group: ShardGroup) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward_hook)
        # a no_sync backward since the last reduction: frozen shards may hold gradients (every rank enters no_sync)
        self.carry_frozen |= not self.syncs(group)
        if group.backward_prepared:
            return  # already prepared by an earlier output hook of this backward
        group.count_backward_calls()
        group.prepare_backward()
        self._prefetch(group, forward=False)

    def grad_arrived(self, group: ShardGroup, dbuffer: DBuffer, name: str) -> None:
        """A parameter's gradient is complete: it lands in its DBuffer's gradient buffer.

        Blocks reduce at their post-backward, the root at the end of backward (as FSDP2's root): every rank
        issues its reductions at the same points in the same order. (Reducing a root DBuffer once its gradients
        were all in here put its collective at a point that depends on this rank's data.)
        """
        dbuffer.grad_arrived(name, accumulate=not self.syncs(group))

    def syncs(self, group: ShardGroup) -> bool:
        """Whether ``group`` reduces in this backward: the model's flag (``no_sync``) and the group's own."""
        return self.requires_gradient_sync and group.requires_gradient_sync

    def post_backward(self, group: ShardGroup) -> None:
        """The module's backward is done: reduce its trainable DBuffers, then free its full parameters."""
        group.backward_calls -= 1
        if group.backward_calls > 0 or group.untracked_calls or self.graph_kept:
            return  # more calls of the module to come in this backward (an untracked one's, or kept: the end)
        self._finish_group(group)

    def _finish_group(self, group: ShardGroup) -> None:
        """Reduce every trainable DBuffer of a group that ran backward (zeros where no gradient arrived here: its peers
        may have some), then reshard. Under ``no_sync`` the gradient buffers keep accumulating."""
        for dbuffer in group.dbuffers:
            if dbuffer in self._reduced:
                continue
            if dbuffer.has_unsharded_grad or (group.backward_prepared and dbuffer.trainable):
                if self.syncs(group):
                    dbuffer.ensure_grad_buffer()
                    self._reduce(dbuffer, group.requires_all_reduce)
                elif not dbuffer.single_rank:  # every rank that ran the group holds its buffers, so which
                    # DBuffers a synchronized backward reduces never depends on where this rank's gradients reached
                    dbuffer.ensure_grad_buffer(accumulate=True)
        group.reshard_after_backward_step()  # held by a graph: set aside, the modules (clipping) see the shards
        group.end_backward()

    def _reduce(self, dbuffer: DBuffer, all_reduce: bool) -> None:
        """Issue one DBuffer's asynchronous reduction, finishing the previous ones first (at most one in flight)."""
        self._finish_in_flight()
        dbuffer.carry_frozen = self.carry_frozen
        dbuffer.reduce_grad(async_op=True, all_reduce=all_reduce)
        self._in_flight.append(dbuffer)
        self._reduced[dbuffer] = None

    def _finish_in_flight(self) -> None:
        for dbuffer in self._in_flight:
            dbuffer.finish_reduce()
        self._in_flight.clear()

    def _end_of_backward(self) -> None:
        for group in self.all_groups:
            # a group with gradients from no_sync micro-batches is reduced by the synchronized backward even when
            # it did not run in it (DDP reduces every bucket): a block only an earlier micro-batch's branch used
            accumulated = self.syncs(group) and any(d.has_unsharded_grad for d in group.dbuffers)
            if group.backward_prepared or group.forward_calls or accumulated:
                self._finish_group(group)
            elif group.is_unsharded or group.unshard_pending:
                # ran forward with reshard_after_forward=False but got no gradient, or was prefetched and did not
                # run: a gather left pending would be used after the optimizer step, with the old values
                group.reshard_after_backward_step()
        reduced = [dbuffer for dbuffer in self._reduced if not dbuffer.holds]  # held: no gradient written yet
        if reduced:
            settle_unused(reduced, self.stats, self._finish_in_flight)
            self.carry_frozen = False
        self._finish_in_flight()
        self._reduced = {}
        self._in_backward = False
        if self.graph_kept and not self._building_graph:  # the graph was backpropagated through: free as usual
            self.graph_kept = False
            for group in self.all_groups:
                group.held_by_graph = False
                group.reshard_after_backward_step()
        self._building_graph = False
        gathered = {group for group in self.all_groups if group.is_unsharded}
        for dbuffer in reduced:  # the gradients are final: optimizer-in-backward hooks may step and zero them
            dbuffer.run_post_accumulate_grad_hooks()
        for group in self.all_groups:  # a forward in a hook (a metric) gathered these before the hooks stepped
            if group not in gathered and (group.is_unsharded or group.unshard_pending):
                group.reshard()

    def _sync_buffers(self) -> None:
        """DDP's ``broadcast_buffers`` at the next root forward, or sooner at an ``unshard()`` (on every rank): a forward
        on one rank alone after it (FSDP2's generation idiom) issues nothing; the same values (set in forward)."""
        if self.buffer_sync is not None and self._buffers_need_sync:
            self.buffer_sync.broadcast()
        self._buffers_need_sync = False

    # ----------------------------------------------------------------- public
    def unshard(self, groups: list[ShardGroup], async_op: bool = False) -> UnshardHandle:
        """An explicit ``unshard()`` (every rank) does the next root forward's first work: on one rank alone (FSDP2's
        generation idiom) that forward then issues nothing and frees nothing gathered here."""
        if not self.running:
            self._release_backwardless()
        self._sync_buffers()
        for group in groups:
            group.unshard(async_op=async_op)
        return UnshardHandle(groups)

    def reshard(self, groups: list[ShardGroup] | None = None) -> None:
        """Free unsharded buffers (all groups by default), e.g. after an evaluation forward."""
        for group in self.all_groups if groups is None else groups:
            group.reshard()


def get_state(module: nn.Module) -> RaggedFSDPState:
    """The engine state of a sharded model; any of its submodules finds it too."""
    state = module.__dict__.get("_ragged_fsdp_state")
    if state is None:
        wrapped = [name for name, child in module.named_children() if "_ragged_fsdp_state" in child.__dict__]
        hint = (f"; it wraps the sharded module {wrapped[0]!r}: pass that (Fabric: `model.module`)" if wrapped
                else "; call lightning_ragged.fully_shard(module) first")
        raise ValueError(f"{type(module).__name__} is not sharded{hint}")
    return state


def _cast_outputs(group: ShardGroup, output: Any) -> Any:
    """``MixedPrecisionPolicy.output_dtype``: the sharded module's floating-point outputs in that dtype (FSDP2's rule)."""
    dtype = group.output_dtype
    if dtype is None:
        return output
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, output)
