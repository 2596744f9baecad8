"""The forward hooks that run a sharded model's groups: all-gather before a group's modules run, reshard after.

The root's hooks start and end a step; a block's run on each of its calls; a group of several modules
(consecutive blocks, or FSDP2's ``fully_shard([...])``) is started by the first of them to run and
ended by the last, as FSDP2's group hooks. Gradient hooks on the full parameters tell the runtime
when a gradient is complete. What the hooks call is ``runtime.py``'s.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import nn

from lightning_ragged.engine.direct_reads import DirectReadProbe
from lightning_ragged.engine.hook_modes import autograd_running, eager
from lightning_ragged.engine.runtime import RaggedFSDPState
from lightning_ragged.engine.shard_group import ShardGroup
from lightning_ragged.engine.sharded_calls import ShardedCallCheck


def install_hooks(state: RaggedFSDPState) -> None:
    """Forward hooks on the modules that trigger each group; gradient hooks on its trainable full parameters.

    The root's pre-hook starts every step; the root group is also unsharded by any module
    that uses one of its parameters (an embedding called on its own, a tied head).
    """
    root = state.root
    root_group = next((g for g in state.all_groups if g.is_root), None)

    probe: DirectReadProbe | None = None  # made after the group hooks below: its window hooks are prepended to them
    check = ShardedCallCheck(root, state.all_groups)
    state.handles += check.handles

    def root_pre_hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if check.active and torch.is_grad_enabled() and not state.running and not autograd_running():
            check.training_forward_starts()
        state.root_pre_forward()
        if probe is not None and not probe.done and not autograd_running():
            probe.start()
        if root_group is None:
            return args, kwargs
        return state.pre_forward(root_group, args, kwargs, cast=state.cast_root_inputs)

    def root_post_hook(_module: nn.Module, _args: tuple, output: Any) -> Any:
        raised = output is None and sys.exc_info()[0] is not None  # torch calls it inside its ``except``
        try:
            if not raised and state.outermost_forward:
                for group in state.all_groups:  # members that did not run (a forward skipping the head): done, as FSDP2
                    if group.members_to_run:
                        group.members_to_run.clear()
                        output = state.post_forward(group, output)
            return state.post_forward(root_group, output) if root_group is not None else output
        finally:
            if probe is not None and not probe.done and not autograd_running():
                probe.finish(torch.is_grad_enabled(), completed=not raised)
            state.root_post_forward(raised)

    handles = state.handles
    # prepended, as FSDP2's: a pre-hook the user registered before sharding (pruning's mask, the old weight_norm's
    # recomputed weight) reads the full parameters, not the shards
    handles.append(root.register_forward_pre_hook(eager(root_pre_hook), with_kwargs=True, prepend=True))
    handles.append(root.register_forward_hook(eager(root_post_hook), always_call=True))
    for group in state.all_groups:
        if group.is_root:
            owners = {id(owner): owner for owner, *_ in group.slots if owner is not root}
            for owner in owners.values():
                handles.append(owner.register_forward_pre_hook(
                    eager(lambda _m, args, kwargs, g=group: state.pre_forward(g, args, kwargs, cast=_owner_casts(state, g))),
                    with_kwargs=True, prepend=True,
                ))
                handles.append(owner.register_forward_hook(
                    eager(lambda _m, _a, output, g=group: state.hook_backward(g, output))
                ))
        elif len(group.members) == 1:  # every call of a block gathers it and is done with it
            post = group.module.register_forward_hook(eager(lambda _m, _a, output, g=group: state.post_forward(g, output)))
            pre = _post_hook_last(state, post, lambda _m, args, kwargs, g=group: state.pre_forward(g, args, kwargs))
            handles += [group.module.register_forward_pre_hook(eager(pre), with_kwargs=True, prepend=True), post]
        else:
            _hook_members(state, group)
        for dbuffer, name, param in group.unsharded_params():
            if param.requires_grad:
                state.hook_grad(group, dbuffer, name, param)
    unprobed = [g for g in state.all_groups if not (g.is_root or g.unshard_in_backward or g.read_outside_forward)]
    if unprobed:
        probe = DirectReadProbe(root, unprobed)
        state.handles += probe.handles


def _owner_casts(state: RaggedFSDPState, group: ShardGroup) -> bool:
    """Whether a module holding root parameters casts its inputs. FSDP2 casts the inputs of the module it was
    called on only (a residual kept in fp32 reaches the final norm). Where that module casts nothing (the
    strategy's: the batch stays as autocast leaves it), the owners cast theirs outside autocast only, so a
    forward there runs (fp32 inputs, bf16 weights); under autocast, as DDP's, a loss module's float targets
    stay fp32 (cast, a Gaussian NLL's first loss was 2.0 against DDP's 0.777)."""
    return not state.cast_root_inputs and not torch.is_autocast_enabled(group.dbuffers[0].device.type)


def _hook_members(state: RaggedFSDPState, group: ShardGroup) -> None:
    """A group of several modules (blocks, or FSDP2's ``fully_shard([...])``), as FSDP2 runs one: gathered when the
    first of them starts a forward, done with forward after the last of them ends one, whatever their order."""

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if group.members_to_run:  # another member started this forward's use of the group
            return state.cast_inputs(group, args, kwargs)  # each member casts its inputs, as FSDP2's
        # outside the model's forward (a chunked loss calls the head alone): this call is the whole use
        group.members_to_run = {id(member) for member in group.members} if state.running else {id(module)}
        return state.pre_forward(group, args, kwargs)

    def post_hook(module: nn.Module, _args: tuple, output: Any) -> Any:
        group.members_to_run.discard(id(module))
        return output if group.members_to_run else state.post_forward(group, output)

    for member in group.members:
        post = member.register_forward_hook(eager(post_hook))
        pre = _post_hook_last(state, post, pre_hook)
        state.handles += [member.register_forward_pre_hook(eager(pre), with_kwargs=True, prepend=True), post]


def _post_hook_last(state: RaggedFSDPState, post: Any, pre_hook: Callable[..., Any]) -> Callable[..., Any]:
    """``pre_hook``, first moving the engine's forward hooks on the module (the group's post-forward, its reshard;
    the direct-read probe's window end after it) behind the module's other forward hooks, also those registered
    after sharding: they read full parameters, as hooks registered before do (before: the 1-D shards, a per-rank
    result, silently; FSDP2 raises on its DTensors). A dict move when a hook was added, a lookup otherwise."""
    engine: set[int] = set()

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        hooks = module._forward_hooks
        last = next(reversed(hooks), None)
        if last is not None and last != post.id and last not in engine:
            engine.clear()
            engine.update(handle.id for handle in state.handles)
            for key in [key for key in hooks if key in engine]:  # in their order: the post-forward first
                hooks.move_to_end(key)
        return pre_hook(module, args, kwargs)

    return hook


def refuse_forward_until_adopted(state: RaggedFSDPState, label: str) -> None:
    """A list's group runs inside its model's state: until a call on the model adopts it, a forward is refused
    (the hooks are removed by that adoption)."""

    def refuse(_module: nn.Module, _args: tuple) -> None:
        raise RuntimeError(
            f"fully_shard({label}) made one group of these modules; it runs once the model that contains them is "
            "sharded too: call lightning_ragged.fully_shard(model) after the blocks and lists (FSDP2's order)"
        )

    state.handles += [member.register_forward_pre_hook(refuse) for member in state.called_on]
