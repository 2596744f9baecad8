"""The ``shard_granularity`` policy: where a parameter may be cut, in elements."""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence, Union

import torch

GranularityPolicy = Union[str, Callable[[str, torch.Tensor], int]]
""""element" | "row" | "block" | "matrix" | "muon", or ``(name, param) -> granularity in elements``."""

POLICIES = ("element", "row", "block", "matrix", "muon")

NON_MUON_NAME_PARTS = ("embed", "wte", "wpe", "pos", "head", "lm_head", "output")
"""Name fragments of 2-D parameters that the usual recipe gives to AdamW, not Muon."""


def is_muon_matrix(name: str, shape: Sequence[int], non_muon: Iterable[str] = NON_MUON_NAME_PARTS) -> bool:
    """Muon's rule, by name and global shape: a 2-D matrix or a 3-D ``[E, a, b]`` expert stack (one
    matrix per expert) whose name contains none of ``non_muon``.

    The one definition shared by ``shard_granularity="muon"`` and
    ``lightning_ragged.optim.split_muon_params`` (which, given a module, also sends
    ``nn.Embedding`` weights to AdamW whatever their names).
    """
    return len(shape) in (2, 3) and not any(part in name for part in non_muon)


def row_numel(shape: torch.Size) -> int:
    """Elements in one row: the product of all dims after the first (1 for 0-D/1-D)."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def resolve_granularity(policy: GranularityPolicy, name: str, param: torch.Tensor, block_rows: int = 128) -> int:
    """Granularity in elements for one parameter under ``policy``.

    "row" keeps rows whole (``numel / shape[0]``), "block" keeps ``block_rows`` rows
    whole (1-D tensors: ``block_rows`` elements), "matrix" keeps the whole tensor on
    one rank, "muon" keeps whole the hidden matrices Muon orthogonalizes (``is_muon_matrix``:
    zero collectives in its step; a 3-D expert stack is cut between experts, each expert whole)
    and cuts everything else (embeddings, head, vectors: the AdamW side) at rows. The result is
    capped at the tensor's size so tiny tensors stay valid; a tensor of no elements (shape ``(3, 0)``) has
    nothing to cut: 1.
    """
    if param.numel() == 0:
        return 1
    numel = param.numel()
    if callable(policy):
        granularity = policy(name, param)
        if not isinstance(granularity, int) or granularity < 1:
            raise ValueError(
                f"shard_granularity callable returned {granularity!r} for parameter {name!r}; "
                "it must return a positive int (granularity in elements)"
            )
        return min(granularity, numel)
    if policy == "element":
        return 1
    if policy == "row":
        return min(row_numel(param.shape), numel)
    if policy == "block":
        check_block_rows(block_rows)
        return min(block_rows * row_numel(param.shape), numel)
    if policy == "matrix":
        return numel
    if policy == "muon":
        whole = param.dim() == 2 and is_muon_matrix(name, param.shape)
        return numel if whole else min(row_numel(param.shape), numel)
    check_policy(policy)
    raise AssertionError(f"unhandled shard_granularity {policy!r}")  # a name in POLICIES without a branch


def check_policy(policy: object) -> None:
    """Refuse what is neither one of ``POLICIES`` nor a callable (``ValueError`` naming the choices)."""
    if callable(policy) or (isinstance(policy, str) and policy in POLICIES):
        return
    raise ValueError(
        f"shard_granularity={policy!r} is not supported; use one of {POLICIES} or a callable "
        "(name, param) -> granularity in elements"
    )


def check_block_rows(block_rows: object) -> None:
    """``block_rows`` must be a positive int (not a bool)."""
    if not isinstance(block_rows, int) or isinstance(block_rows, bool) or block_rows < 1:
        raise ValueError(f"block_rows={block_rows!r} is invalid; pass a positive int such as 128")
