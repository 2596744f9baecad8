"""Lightning's ``grad_norm`` utility on sharded parameters: each parameter's whole gradient's norm.

``self.log_dict(grad_norm(self, norm_type=2))`` in ``on_before_optimizer_step`` is how Lightning users
watch their gradients. It takes ``p.grad.norm()`` of every parameter: on FSDP2's DTensor gradients the
whole gradient's norm, on our shards only this rank's part (a different value on every rank, silently).
Once a model is sharded, Lightning's function computes :func:`grad_norm` instead: the same keys and
total, each sharded parameter's norm over all ranks' parts (one collective per shard group, on every
rank, as a DTensor's norm is); on a module with no sharded parameter it is Lightning's, value for value.
``from lightning.pytorch.utilities import grad_norm``, written before the strategy existed, binds
Lightning's function object, so that object's code is what is rerouted (once per process).
"""

from __future__ import annotations

import functools
from typing import Union

import torch
from torch import nn

from lightning_ragged.engine.global_norm import REPLICATED, group_key, tensor_norms


def grad_norm(module: nn.Module, norm_type: Union[float, int, str], group_separator: str = "/") -> dict:
    """Lightning's ``grad_norm``: ``{"grad_<p>_norm/<name>": norm, ..., "grad_<p>_norm_total": norm}``,
    with the norms of sharded parameters over all ranks (collective: call it on every rank)."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    named = [(name, param) for name, param in module.named_parameters() if param.grad is not None]
    groups: dict[object, list] = {}
    keys = []
    for _, param in named:
        shard = getattr(param, "ragged_shard", None)
        keys.append(REPLICATED if shard is None else group_key(shard.process_group))
        groups.setdefault(keys[-1], []).append(param.grad.detach())
    by_group = {key: iter(values) for key, values in tensor_norms(groups, norm_type).items()}
    norms = {f"grad_{norm_type}_norm{group_separator}{name}": next(by_group[key]) for (name, _), key in zip(named, keys)}
    if norms:
        # Lightning's torch.tensor(list of norms) reads each back to the host (a sync per parameter on CUDA)
        norms[f"grad_{norm_type}_norm_total"] = torch.stack([n.float() for n in norms.values()]).norm(norm_type)
    return norms


@functools.cache
def route_lightning_grad_norm() -> None:
    """Make Lightning's ``grad_norm`` (its function object, wherever it was imported) call :func:`grad_norm`."""
    from lightning.pytorch.utilities import grads

    def rerouted(module, norm_type, group_separator="/"):  # noqa: ANN001, ANN202  (Lightning's signature)
        return _lightning_ragged_grad_norm(module, norm_type, group_separator)  # noqa: F821  (its module's global)

    grads.__dict__["_lightning_ragged_grad_norm"] = grad_norm
    grads.grad_norm.__code__ = rerouted.__code__
