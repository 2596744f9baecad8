"""How the engine's hooks run: out of ``torch.compile``'s graphs, and under ``no_grad`` when autograd runs them.

A backward that builds a graph of its own (``backward(create_graph=True)``, ``autograd.grad(...,
create_graph=True)``: a gradient penalty) runs hooks with grad mode on. That graph saves the full
parameters it reads, so freeing them at the group's post-backward (what resharding does) would leave
the later backward through it reading released storage, a crash (FSDP2's does the same). The runtime is
told (``graph_built``) before any hook of such a backward works, and keeps the full parameters until a
backward that builds no graph ends (``runtime.py``, ``ShardGroup.held_by_graph``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def eager(hook: Any, backward: bool = False, graph_built: Callable[[], None] | None = None) -> Any:
    """Keep an engine hook out of ``torch.compile``'s graphs (it allocates, frees and issues collectives).

    Wrap the callable handed to torch, not the methods it calls: a closure defined here is
    user code to Dynamo, which would trace it and break the graph at the disabled call. ``backward``: a hook
    autograd runs, under ``no_grad`` as FSDP2's reduction (the graph of ``create_graph=True`` must not reach
    into the buffers: the sharded gradients come out detached, as FSDP2's); ``graph_built`` is called first
    when that backward builds a graph.
    """
    if not backward:
        return torch.compiler.disable(hook, recursive=True)

    def run(*args: Any) -> Any:
        if graph_built is not None and torch.is_grad_enabled():
            graph_built()
        with torch.no_grad():
            return hook(*args)

    return torch.compiler.disable(run, recursive=True)


def autograd_running() -> bool:
    """True inside a backward pass (the autograd engine is executing a graph task)."""
    return torch._C._current_graph_task_id() != -1
