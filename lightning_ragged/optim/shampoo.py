"""Block-diagonal Shampoo on ragged shards: every preconditioner tile lives on one rank.

A parameter is viewed as a matrix (``shape[0]`` × the rest; a vector as one column) and cut
into tiles of at most ``max_preconditioner_dim`` rows and columns, counted from its start.
Each tile G (r×c) keeps factor statistics L (r×r) and R (c×c) — for a vector tile only L —
and the optimizer never communicates: with ``fully_shard(..., shard_granularity="block",
block_rows=max_preconditioner_dim)`` every rank holds whole row-bands of tiles. A shard
boundary inside a band raises ``RaggedShard boundary violation:`` naming the parameter and
the ``block_rows`` to use (gathering split tiles is not implemented: it would cost a
collective per step for a layout that one planner argument avoids).

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
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from lightning_ragged.optim.named_state import RaggedOptimizer
from lightning_ragged.optim.shards import local_flat

GRAFTINGS = ("adagrad", "adam")


def matrix_shape(global_shape: tuple[int, ...]) -> tuple[int, int]:
    """How Shampoo views a parameter: (shape[0], prod(rest)); vectors and scalars as (numel, 1)."""
    if len(global_shape) >= 2:
        return global_shape[0], math.prod(global_shape[1:])
    return math.prod(global_shape), 1


def inverse_root(matrix: torch.Tensor, root: int, epsilon: float, dtype: torch.dtype) -> torch.Tensor:
    """``(matrix + epsilon·I)^{-1/root}`` by eigendecomposition in ``dtype``, returned in fp32."""
    work = matrix.to(dtype)
    work = work + epsilon * torch.eye(work.shape[0], dtype=dtype, device=work.device)
    eigenvalues, eigenvectors = torch.linalg.eigh(work)
    eigenvalues = eigenvalues.clamp(min=epsilon).pow(-1.0 / root)
    return ((eigenvectors * eigenvalues) @ eigenvectors.T).to(torch.float32)


class Shampoo(RaggedOptimizer):
    """Block-diagonal Shampoo with grafting; no communication on block-aligned ragged shards."""

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
        if grafting not in GRAFTINGS:
            raise ValueError(f"grafting={grafting!r} is not supported; use one of {GRAFTINGS}")
        if inverse_root_dtype not in (torch.float32, torch.float64):
            raise ValueError("inverse_root_dtype must be torch.float32 or torch.float64")
        if max_preconditioner_dim < 1 or precondition_frequency < 1 or start_preconditioning_step < 1:
            raise ValueError("max_preconditioner_dim, precondition_frequency and start_preconditioning_step must be >= 1")
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
        for group in self.param_groups:
            for param in group["params"]:
                self._check_tiles_whole(param, group["max_preconditioner_dim"])

    def _check_tiles_whole(self, param: torch.Tensor, dim: int) -> None:
        shard = self.shard(param)
        rows, cols = matrix_shape(tuple(shard.global_shape))
        band = min(dim, rows) * cols
        shard.require_blocks(band, f"Shampoo (preconditioner tiles of up to {dim}x{dim}; use block_rows={dim})")

    def state_layout(self, param: torch.Tensor) -> dict[str, str]:
        return {"step": "scalar", "momentum": "flat", "graft": "flat", "tiles": "tiles"}

    def tiles(self, param: torch.Tensor, dim: int) -> list[tuple[str, slice, slice]]:
        """(global tile id "i,j", local row slice, column slice) of every tile this rank holds."""
        shard = self.shard(param)
        rows, cols = matrix_shape(tuple(shard.global_shape))
        start, end = shard.local_range
        if start == end:
            return []
        first_row, last_row = start // cols, end // cols
        out = []
        for band_start in range(first_row, last_row, dim):
            band_rows = slice(band_start - first_row, min(band_start + dim, last_row) - first_row)
            for col_start in range(0, cols, dim):
                tile_id = f"{band_start // dim},{col_start // dim}"
                out.append((tile_id, band_rows, slice(col_start, min(col_start + dim, cols))))
        return out

    def localize_tiles(self, param: torch.Tensor, tiles: dict[str, Any]) -> dict[str, Any]:
        dim = self.group_of(param)["max_preconditioner_dim"]
        mine = {tile_id for tile_id, _, _ in self.tiles(param, dim)}
        return {tile_id: {k: v.clone() for k, v in entries.items()} for tile_id, entries in tiles.items() if tile_id in mine}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self.evaluate_closure(closure)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_param(param, group)
        return loss

    def _step_param(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        dim = group["max_preconditioner_dim"]
        epsilon = group["epsilon"]
        shard = self.shard(param)
        _, cols = matrix_shape(tuple(shard.global_shape))
        flat = local_flat(param)
        grad_flat = local_flat(param.grad).float()
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["momentum"] = torch.zeros_like(grad_flat)
            state["graft"] = torch.zeros_like(grad_flat)
            state["tiles"] = {}
        state["step"] += 1
        step = state["step"]
        if flat.numel() == 0:
            return
        grad = grad_flat.view(-1, cols)
        momentum = state["momentum"].view(-1, cols)
        graft = state["graft"].view(-1, cols)

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

        start = group["start_preconditioning_step"]
        preconditioning = step >= start
        refresh = preconditioning and (step - start) % group["precondition_frequency"] == 0
        direction = graft_direction if not preconditioning else torch.empty_like(graft_direction)
        for tile_id, rows, columns in self.tiles(param, dim):
            g = grad[rows, columns]
            is_vector = cols == 1
            tile = state["tiles"].setdefault(tile_id, self._new_tile(g, is_vector))
            self._accumulate(tile["L"], g @ g.T, beta2)
            if not is_vector:
                self._accumulate(tile["R"], g.T @ g, beta2)
            if refresh:
                root = 2 if is_vector else 4
                tile["L_inv_root"] = inverse_root(tile["L"], root, epsilon, group["inverse_root_dtype"])
                if not is_vector:
                    tile["R_inv_root"] = inverse_root(tile["R"], root, epsilon, group["inverse_root_dtype"])
            if preconditioning:
                m = momentum[rows, columns]
                pre = tile["L_inv_root"] @ m
                if not is_vector:
                    pre = pre @ tile["R_inv_root"]
                graft_tile = graft_direction[rows, columns]
                norm = pre.norm()
                scale = graft_tile.norm() / norm if norm > 0 else torch.zeros(())
                direction[rows, columns] = pre * scale
        flat.mul_(1 - group["lr"] * group["weight_decay"])
        flat.add_(direction.view(-1), alpha=-group["lr"])

    @staticmethod
    def _new_tile(g: torch.Tensor, is_vector: bool) -> dict[str, torch.Tensor]:
        r, c = g.shape
        tile = {"L": torch.zeros(r, r, device=g.device), "L_inv_root": torch.eye(r, device=g.device)}
        if not is_vector:
            tile["R"] = torch.zeros(c, c, device=g.device)
            tile["R_inv_root"] = torch.eye(c, device=g.device)
        return tile

    @staticmethod
    def _accumulate(stat: torch.Tensor, outer: torch.Tensor, beta2: float) -> None:
        if beta2 == 1.0:
            stat.add_(outer)
        else:
            stat.mul_(beta2).add_(outer, alpha=1 - beta2)
