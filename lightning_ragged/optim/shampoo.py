"""Block-diagonal Shampoo on ragged shards, on any layout: split tiles are gathered to one owner.

A parameter is viewed as a matrix (``shape[0]`` × the rest; a vector as one column) and cut
into tiles of at most ``max_preconditioner_dim`` rows and columns, counted from its start
(``optim/tiles.py``). Each tile G (r×c) keeps, on its owner rank only, factor statistics L (r×r)
and R (c×c) — for a vector tile only L — their root inverses, its momentum M and its grafting
accumulator a (r×c each). A tile held whole by one rank is stepped there with no
communication (``shard_granularity="block"`` with ``block_rows`` a multiple of
``max_preconditioner_dim``, or ``"matrix"``); tiles the layout splits are gathered to a
load-balanced owner and their directions scattered back, one fp32 all-to-all each way per step
for all of them (``optim/tiled.py``).

Per step t (1-based), per tile, with G the gradient tile:

* statistics: ``L ← β2·L + (1−β2)·G·Gᵀ``, ``R ← β2·R + (1−β2)·Gᵀ·G`` (β2 = 1: plain sums);
* grafting: AdaGrad ``a ← a + G²`` or Adam ``a ← βg·a + (1−βg)·G²`` (then ``a / (1 − βgᵗ)``);
  ``graft = M / (√a + grafting_epsilon)``;
* momentum: ``M ← β1·M + (1−β1)·G`` (``M = G`` when β1 = 0);
* root inverses, when ``t ≥ start_preconditioning_step`` and ``(t − start) % precondition_frequency
  == 0``: ``X^{-1/p}`` of ``X + epsilon·I`` by symmetric eigendecomposition in
  ``inverse_root_dtype`` (eigenvalues clamped at ``epsilon``), p = 4 for matrix tiles (two
  factors) and 2 for vector tiles (one factor);
* direction: once preconditioning started ``D = L^{-1/4}·M·R^{-1/4}`` rescaled to the Frobenius
  norm of the tile's graft direction, before that the graft direction itself;
* ``p ← p·(1 − lr·weight_decay) − lr·D``.

t is the tile's own step count (``"step"`` in its state): a tile left untouched (a missing
gradient, ``optim/tiled.py``) does not count the step. An eigendecomposition that fails even in
fp64 on the CPU (``optim/eigh.py``) keeps the tile's previous root inverses, steps it with its
graft direction, and makes every rank raise ``EigendecompositionError`` after the step.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from lightning_ragged.optim.eigh import EigendecompositionError, symmetric_eigh
from lightning_ragged.optim.tiled import TiledOptimizer
from lightning_ragged.optim.tiles import Tile

GRAFTINGS = ("adagrad", "adam")


def inverse_root(matrix: torch.Tensor, root: int, epsilon: float, dtype: torch.dtype) -> torch.Tensor:
    """``(matrix + epsilon·I)^{-1/root}`` by eigendecomposition in ``dtype``, returned in fp32."""
    work = matrix.to(dtype)
    work = work + epsilon * torch.eye(work.shape[0], dtype=dtype, device=work.device)
    eigenvalues, eigenvectors = symmetric_eigh(work)
    eigenvalues = eigenvalues.clamp(min=epsilon).pow(-1.0 / root)
    return ((eigenvectors * eigenvalues) @ eigenvectors.T).to(torch.float32)


class Shampoo(TiledOptimizer):
    """Block-diagonal Shampoo with grafting on any ragged layout: whole tiles free, split tiles gathered."""

    failure_note = (
        "such a tile kept its previous root inverses and took its graft direction. Check the gradients for "
        "inf/NaN, or raise epsilon"
    )

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 1.0),
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 20,
        start_preconditioning_step: int = 1,
        grafting: str = "adagrad",
        grafting_beta2: float = 0.999,
        grafting_epsilon: float = 1e-10,
        inverse_root_dtype: torch.dtype = torch.float64,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            epsilon=epsilon,
            weight_decay=weight_decay,
            max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            grafting=grafting,
            grafting_beta2=grafting_beta2,
            grafting_epsilon=grafting_epsilon,
            inverse_root_dtype=inverse_root_dtype,
        )
        super().__init__(params, defaults)

    def check_hyperparameters(self, values: Mapping[str, Any]) -> None:
        super().check_hyperparameters(values)
        if values["grafting"] not in GRAFTINGS:
            raise ValueError(f"grafting={values['grafting']!r} is not supported; use one of {GRAFTINGS}")
        if values["inverse_root_dtype"] not in (torch.float32, torch.float64):
            raise ValueError(
                f"inverse_root_dtype={values['inverse_root_dtype']} is not supported; use torch.float32 or torch.float64"
            )
        self.check_positive_ints(values, ("start_preconditioning_step",))
        betas = values["betas"]
        if len(betas) != 2 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] <= 1.0):
            raise ValueError(
                f"betas={tuple(betas)!r} is not supported; pass (momentum in [0, 1), statistics decay in [0, 1]; "
                "1: plain sums), e.g. (0.9, 1.0)"
            )
        if not (values["epsilon"] > 0 and math.isfinite(values["epsilon"])):
            raise ValueError(
                f"epsilon={values['epsilon']!r} is not supported; pass a finite value > 0 (it floors the "
                "eigenvalues the root inverses raise to a negative power), e.g. 1e-12"
            )
        if not 0.0 <= values["grafting_beta2"] < 1.0:
            raise ValueError(
                f"grafting_beta2={values['grafting_beta2']!r} is not supported; pass a value in [0, 1) "
                "(Adam grafting divides by 1 - grafting_beta2**t), e.g. 0.999"
            )
        for name in ("grafting_epsilon", "weight_decay"):
            if not values[name] >= 0.0:
                raise ValueError(f"{name}={values[name]!r} is not supported; pass a value >= 0")

    def tile_state_shapes(self, tile: Tile) -> dict[str, tuple[int, ...]]:
        r, c = tile.shape
        shapes = {"step": (), "L": (r, r), "L_inv_root": (r, r), "momentum": (r, c), "graft": (r, c)}
        if not tile.one_sided:
            shapes.update(R=(c, c), R_inv_root=(c, c))
        return shapes

    def _tile_update(
        self, group: dict[str, Any], tiles: dict[str, Any], tile: Tile, grad: torch.Tensor
    ) -> torch.Tensor:
        beta1, beta2 = group["betas"]
        epsilon, lr = group["epsilon"], group["lr"]
        s = tiles.get(tile.tile_id)
        if s is None:
            s = tiles[tile.tile_id] = self._new_tile(grad, tile.one_sided)
        s["step"] += 1
        step = s["step"]
        momentum, graft = s["momentum"], s["graft"]
        if beta1 > 0:
            momentum.lerp_(grad, 1 - beta1)
        else:
            momentum.copy_(grad)
        if group["grafting"] == "adagrad":
            graft.addcmul_(grad, grad)
            graft_denominator = graft.sqrt()
        else:
            beta_g = group["grafting_beta2"]
            graft.mul_(beta_g).addcmul_(grad, grad, value=1 - beta_g)
            graft_denominator = (graft / (1 - beta_g**step)).sqrt()
        graft_direction = momentum / graft_denominator.add_(group["grafting_epsilon"])

        self._accumulate(s["L"], grad @ grad.T, beta2)
        if not tile.one_sided:
            self._accumulate(s["R"], grad.T @ grad, beta2)
        start = group["start_preconditioning_step"]
        if step < start:
            return graft_direction.mul_(-lr)
        if (step - start) % group["precondition_frequency"] == 0:
            root = 2 if tile.one_sided else 4
            try:
                factors = ("L",) if tile.one_sided else ("L", "R")
                roots = {f"{f}_inv_root": inverse_root(s[f], root, epsilon, group["inverse_root_dtype"]) for f in factors}
            except EigendecompositionError as error:
                self._report_failure(tile, error)
                return graft_direction.mul_(-lr)
            s.update(roots)
        pre = s["L_inv_root"] @ momentum
        if not tile.one_sided:
            pre = pre @ s["R_inv_root"]
        norm = pre.norm()
        scale = torch.where(norm > 0, graft_direction.norm() / norm, 0.0)  # no host sync (a CUDA `if`)
        return pre.mul_(scale * -lr)

    @staticmethod
    def _new_tile(grad: torch.Tensor, one_sided: bool) -> dict[str, Any]:
        r, c = grad.shape
        tile: dict[str, Any] = {
            "step": 0,
            "L": torch.zeros(r, r, device=grad.device),
            "L_inv_root": torch.eye(r, device=grad.device),
            "momentum": torch.zeros(r, c, device=grad.device),
            "graft": torch.zeros(r, c, device=grad.device),
        }
        if not one_sided:
            tile["R"] = torch.zeros(c, c, device=grad.device)
            tile["R_inv_root"] = torch.eye(c, device=grad.device)
        return tile

    @staticmethod
    def _accumulate(stat: torch.Tensor, outer: torch.Tensor, beta2: float) -> None:
        if beta2 == 1.0:
            stat.add_(outer)
        else:
            stat.mul_(beta2).add_(outer, alpha=1 - beta2)
