"""The ``shard_granularity`` policy: where a parameter may be cut, in elements."""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence, Union

import torch

from lightning_ragged.layout.spec import is_positive_int

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


def row_numel(shape: Sequence[int]) -> int:
    """Elements in one row of a matrix: ``shape[-1]`` for 2-D and for 3-D, a stack of matrices ``[E, a, b]``
    (fused MoE experts: a row of one expert; were it ``a*b``, a whole expert would be the smallest cut, and
    8 experts could not be spread over 1,024 ranks); ``numel / shape[0]`` from 4-D on (a conv filter);
    1 for 0-D/1-D."""
    if len(shape) <= 1:
        return 1
    return shape[-1] if len(shape) <= 3 else math.prod(shape[1:])


def matrix_numel(shape: Sequence[int]) -> int:
    """Elements in one matrix Muon orthogonalizes: the whole 2-D tensor, one expert ``a*b`` of a 3-D stack."""
    return math.prod(shape[-2:])


def resolve_granularity(policy: GranularityPolicy, name: str, param: torch.Tensor, block_rows: int = 128) -> int:
    """Granularity in elements for one parameter under ``policy``.

    "row" keeps rows whole (``row_numel``: ``shape[-1]`` for 2-D and 3-D expert stacks, a conv
    filter from 4-D on), "block" keeps ``block_rows`` rows whole (1-D tensors: ``block_rows``
    elements), "matrix" keeps the whole tensor on
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
        if not is_positive_int(granularity):
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
        unit = matrix_numel(param.shape) if is_muon_matrix(name, param.shape) else row_numel(param.shape)
        return min(unit, numel)
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
    if not is_positive_int(block_rows):
        raise ValueError(f"block_rows={block_rows!r} is invalid; pass a positive int such as 128")
