"""How the engine's hooks run: out of ``torch.compile``'s graphs, and under ``no_grad`` when autograd runs them.

A backward that builds a graph of its own (``backward(create_graph=True)``, ``autograd.grad(...,
create_graph=True)``: a gradient penalty) runs hooks with grad mode on. That graph saves the full
parameters it reads, so freeing them at the group's post-backward (what resharding does) would leave
the later backward through it reading released storage, a crash (FSDP2's does the same). The runtime is
told (``graph_built``) before any hook of such a backward works, and keeps the full parameters until a
backward that builds no graph ends (``runtime.py``, ``ShardGroup.held_by_graph``).

A hook on a tensor reaches the runtime through weak references: the garbage collector cannot break a
cycle that runs through a tensor's hook (torch 2.13), and the full parameters' hooks held the runtime,
which holds the DBuffers that hold those parameters: a deleted model, its shards and (under Lightning)
its Trainer and optimizer state stayed alive, once per model of a sweep.
"""

from __future__ import annotations

import weakref
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


def grad_arrived_hook(state: Any, group: Any, dbuffer: Any, name: str) -> Any:
    """The post-accumulate-grad hook of a full parameter: ``state.grad_arrived(group, dbuffer, name)``, holding
    the three weakly (nothing once they are gone)."""
    refs = weakref.ref(state), weakref.ref(group), weakref.ref(dbuffer)

    def arrived(_param: torch.Tensor) -> None:
        live_state, live_group, live_dbuffer = (ref() for ref in refs)
        if live_state is not None and live_group is not None and live_dbuffer is not None:
            live_state.grad_arrived(live_group, live_dbuffer, name)

    def graph_built() -> None:
        live_state = refs[0]()
        if live_state is not None:
            live_state.graph_built()

    return eager(arrived, backward=True, graph_built=graph_built)
