"""The autograd node that marks the end of a module call's backward (its *post-backward*)."""

from __future__ import annotations

from typing import Any

import torch


class PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the module's backward is complete.

    The autograd engine runs a node only after every node that produces its input
    gradients, and it runs ``AccumulateGrad`` first, so when this node runs, every
    gradient of the module's parameters is in its buffer and nothing in the module needs
    its full parameters any more.
    """

    @staticmethod
    def forward(ctx: Any, state: Any, group: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state, ctx.group = state, group
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        with torch.no_grad():  # backward(create_graph=True) runs this with grad mode on (see ``eager``)
            ctx.state.post_backward(ctx.group)
        return (None, None, *grads)
