"""Groups whose full parameters are read outside their own forward, found in the first training forward.

A group whose backward reads no parameter (an embedding's group of its own, ``grouping.py``) is
freed right after its forward and never re-gathered for backward. A model whose head reads the
embedding's table itself (``F.linear(h, self.embeddings.word_embeddings.weight)``: DeBERTa-v2's and
Perceiver's masked-LM heads, with no tied ``Parameter`` to see) would then get this rank's 1-D shard;
torch's FSDP2 avoids it only because its users leave the embedding in the root group.

The forwards of a sharded model up to its first completed training forward run under
:class:`DirectReadProbe`: those groups stay unsharded until the root's forward ends, and a torch
function mode records every use of their full parameters outside their own forward (reading ``dtype`` or ``device`` does not count: the
shards have the same). A group read outside is held from then on (``ShardGroup.held_through_forward``):
unsharded from its forward until its backward is done (evaluation: until the root's forward ends),
as FSDP2's root group is, so the head's backward finds the table it saved. The others are resharded
when the probed forward ends, as they would have been after their own forward. Not seen: a read that
first happens after that forward (a head used only in later steps), or one outside any forward (a
penalty on the table in ``training_step``: it reads the shard, as every parameter read outside its
group's forward does).

Under ``torch.compile`` there is no probe: a torch function mode entered in the middle of a compiled
model's forward breaks Dynamo (an internal error), and one active while compiled blocks run the first
step makes them recompile when it is gone. A compiled model (the root's forward called from compiled
code, a compiled submodule: ``module.compile()``, ``torch.compile(module)``, or a ``forward`` replaced
by its compiled self) holds the probed groups instead, as if read outside: correct for any head, at
the cost of holding the embedding's full table from its forward to its backward (FSDP2's default
grouping holds it in the root group anyway). A function compiled elsewhere and called from a
module's forward is not seen: it is traced under the probe in the first step and recompiled once.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_ragged.engine.shard_group import ShardGroup

_METADATA = frozenset(
    getter.__get__ for getter in (torch.Tensor.dtype, torch.Tensor.device, torch.Tensor.requires_grad,
                                  torch.Tensor.is_cuda, torch.Tensor.layout)
) | {torch.Tensor.is_floating_point, torch.Tensor.element_size, torch.Tensor.get_device}
"""What a parameter's shard answers as its full parameter does: reading it is not a use."""


class DirectReadProbe(TorchFunctionMode):
    """Watches ``groups`` (those with no backward re-gather) through the first forward of their model."""

    def __init__(self, root: nn.Module, groups: list[ShardGroup]) -> None:
        super().__init__()
        self.root = root
        self.groups = groups
        self._owner = {id(param): group for group in groups for _, _, param in group.unsharded_params()}
        self._running: set[int] = set()
        """The watched groups whose own forward is running (their reads are theirs)."""
        self._depth = 0
        self.done = False
        self.handles = [handle for group in groups for handle in self._window_hooks(group)]

    def _window_hooks(self, group: ShardGroup) -> list[Any]:
        """Open the group's window before the engine's pre-forward hook, close it after its post-forward hook."""
        def opened(_module: Any, _args: Any) -> None:
            self._running.add(id(group))

        def closed(_module: Any, _args: Any, _output: Any) -> None:
            self._running.discard(id(group))

        return [handle for member in group.members for handle in (
            member.register_forward_pre_hook(opened, prepend=True), member.register_forward_hook(closed))]

    def start(self) -> None:
        """The root's forward starts: its outermost call enters the mode."""
        self._depth += 1
        if self._depth == 1:
            for group in self.groups:
                group.held_through_forward = True
            if _compiled(self.root):
                self._hold_without_probing()
                return
            self.__enter__()

    def _hold_without_probing(self) -> None:
        self.done = True
        for group in self.groups:
            group.read_outside_forward = True
        for handle in self.handles:
            handle.remove()

    def finish(self, grad_enabled: bool, completed: bool) -> None:
        """The root's forward ended (or raised: not ``completed``): decide which groups stay held, release the
        others. Probing ends with the first training forward that completes: an evaluation forward first (a
        sanity check returning hidden states) or a forward that raised may not have reached the head."""
        self._depth -= 1
        if self._depth > 0:
            return
        self.__exit__(None, None, None)
        if grad_enabled and completed:
            self.done = True
            for handle in self.handles:
                handle.remove()
        for group in self.groups:
            group.held_through_forward = group.read_outside_forward
            if not group.held_through_forward and grad_enabled and group.is_unsharded:
                group.reshard_after_forward_step()  # what its post-forward would have done

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _METADATA:
            for leaf in tree_leaves((args, kwargs)):
                group = self._owner.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if group is not None and id(group) not in self._running:
                    group.read_outside_forward = True
        return func(*args, **kwargs)


def _compiled(root: nn.Module) -> bool:
    """Whether ``root``'s forward runs from compiled code or contains compiled code: a module compiled with
    ``module.compile()`` or ``torch.compile(module)``, a ``forward`` replaced by ``torch.compile(forward)``, or the
    root called from a compiled function (Dynamo's wrapper of the compiled call is on the stack)."""
    from torch._dynamo.eval_frame import OptimizedModule

    for module in root.modules():
        forward = module.__dict__.get("forward")
        if getattr(module, "_compiled_call_impl", None) is not None or isinstance(module, OptimizedModule) \
                or _is_compile_wrapper(getattr(forward, "__code__", None)):
            return True
    frame = sys._getframe(1)
    while frame is not None:
        if _is_compile_wrapper(frame.f_code):
            return True
        frame = frame.f_back
    return False


def _is_compile_wrapper(code: Any) -> bool:
    """Dynamo's wrapper around a compiled call (torch/_dynamo/eval_frame.py)."""
    return code is not None and code.co_name == "compile_wrapper" \
        and os.path.basename(code.co_filename) == "eval_frame.py"
