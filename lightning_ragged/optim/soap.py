"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam") on ragged shards, any layout.

Adam run in the eigenbasis of Shampoo's preconditioner, block-diagonal: a parameter of two or more
dimensions is viewed and tiled as ``Shampoo`` does (``optim/tiles.py``: ``shape[0]`` × the rest,
tiles of at most ``max_preconditioner_dim`` rows and columns), and every tile keeps, on its owner
rank only, factor statistics L (r×r), R (c×c), their eigenbases Q_L, Q_R and Adam's moments M, V
(r×c). Tiles held whole are stepped with no communication; split tiles are gathered to a
load-balanced owner and their directions scattered back, one fp32 all-to-all each way per step for
all of them (``optim/tiled.py``). Per tile, per step t (1-based), with G the gradient tile,
β_s = ``shampoo_beta`` (β2 when negative) and k = t − 1:

* t = 1: ``L ← (1−β_s)·G·Gᵀ``, ``R ← (1−β_s)·Gᵀ·G``; Q_L, Q_R = eigenvectors of L, R
  (``torch.linalg.eigh`` in fp32, by decreasing eigenvalue). The parameter does not move (as in
  the reference implementation: the first gradient never enters its own projection);
* t ≥ 2: ``G' = Q_Lᵀ·G·Q_R``; ``M ← β1·M + (1−β1)·G`` (kept in the parameter's basis, as the
  paper's Algorithm 3, so a basis refresh never leaves it stale) and ``M' = Q_Lᵀ·M·Q_R``;
  ``V ← β2·V + (1−β2)·G'²`` (in the eigenbasis); ``N = Q_L·(M' / (√V + eps))·Q_Rᵀ``;
  ``p ← p − η·N`` with ``η = lr·√(1−β2ᵏ)/(1−β1ᵏ)`` (``correct_bias``, else lr), then
  ``p ← p − lr·weight_decay·p`` — weight decay decoupled and after the update, in the reference's order;
* then ``L ← β_s·L + (1−β_s)·G·Gᵀ`` (R alike) and, when k is a multiple of
  ``precondition_frequency``, the eigenbases are refreshed as the reference does: one power
  iteration and a QR decomposition, ``Q ← qr(X·Q[:, order])`` with ``order`` sorting the
  estimated eigenvalues ``diag(Qᵀ·X·Q)`` in decreasing order, V's rows (L) or columns (R)
  permuted alike. (A fresh ``eigh`` each time would reorder and flip eigenvectors freely; the
  power step keeps Adam's V attached to the directions it measured.)

k counts the tile's Adam steps (``"step"`` in its state, as the reference's ``state["step"]``):
a tile left untouched (a missing gradient, ``optim/tiled.py``) does not count the step.

Parameters of fewer than two dimensions (biases, norm weights, scalars) get plain Adam with the
same step size, weight decay and first-step skip, element-wise on the local shard — the
reference's default (``precondition_1d=False``): no tiles, no communication; their ``"step"``
counts their Adam steps too.

The first eigenbases come from ``optim/eigh.py`` (fp32, retried in fp64, then on the CPU, as the
reference retries in fp64); if every attempt fails the tile does not start this step, and every
rank raises ``EigendecompositionError`` after the step.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lightning_ragged.optim.eigh import EigendecompositionError, symmetric_eigh
from lightning_ragged.optim.shards import local_flat
from lightning_ragged.optim.tiled import TiledOptimizer
from lightning_ragged.optim.tiles import Tile


class SOAP(TiledOptimizer):
    """SOAP with block-diagonal (tiled) preconditioners on any ragged layout; Adam for 1-D parameters."""

    decay_before_update = False  # the reference: p -= η·N, then p -= lr·wd·p
    failure_note = "such a tile did not start (it tries again next step). Check the gradients for inf/NaN"

    def __init__(
        self,
        params: Any,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float = -1.0,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_preconditioner_dim: int = 1024,
        correct_bias: bool = True,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            shampoo_beta=shampoo_beta,
            eps=eps,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            max_preconditioner_dim=max_preconditioner_dim,
            correct_bias=correct_bias,
        )
        super().__init__(params, defaults)

    def check_hyperparameters(self, values: Mapping[str, Any]) -> None:
        super().check_hyperparameters(values)
        betas, shampoo_beta = values["betas"], values["shampoo_beta"]
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas={betas!r} is not supported; pass two values in [0, 1), e.g. (0.95, 0.95)")
        if not shampoo_beta < 1.0:
            raise ValueError(
                f"shampoo_beta={shampoo_beta!r} is not supported; pass a value < 1 (negative: use betas[1])"
            )
        if not values["eps"] >= 0.0 or not values["weight_decay"] >= 0.0:
            raise ValueError(f"eps={values['eps']!r}, weight_decay={values['weight_decay']!r}: both must be >= 0")

    def is_tiled(self, param: torch.Tensor) -> bool:
        return len(self.shard(param).global_shape) >= 2

    def state_layout(self, param: torch.Tensor) -> dict[str, str]:
        if self.is_tiled(param):
            return super().state_layout(param)
        return {"step": "scalar", "exp_avg": "flat", "exp_avg_sq": "flat"}

    def tile_state_shapes(self, tile: Tile) -> dict[str, tuple[int, ...]]:
        r, c = tile.shape
        return {"step": (), "L": (r, r), "R": (c, c), "Q_L": (r, r), "Q_R": (c, c), "exp_avg": (r, c),
                "exp_avg_sq": (r, c)}

    @staticmethod
    def _step_size(group: dict[str, Any], adam_step: int) -> float:
        if not group["correct_bias"]:
            return group["lr"]
        beta1, beta2 = group["betas"]
        return group["lr"] * (1 - beta2**adam_step) ** 0.5 / (1 - beta1**adam_step)

    def _step_untiled(self, param: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        flat = local_flat(param)
        if not state:  # the first gradient only starts the state, as for tiles
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(flat, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
            return
        state["step"] += 1
        beta1, beta2 = group["betas"]
        grad = local_flat(param.grad).float()
        state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = state["exp_avg_sq"].sqrt().add_(group["eps"])
        flat.addcdiv_(state["exp_avg"], denominator, value=-self._step_size(group, state["step"]))
        if group["weight_decay"]:
            flat.mul_(1 - group["lr"] * group["weight_decay"])

    def _tile_update(
        self, group: dict[str, Any], tiles: dict[str, Any], tile: Tile, grad: torch.Tensor
    ) -> torch.Tensor | None:
        beta1, beta2 = group["betas"]
        shampoo_beta = group["shampoo_beta"] if group["shampoo_beta"] >= 0 else beta2
        s = tiles.get(tile.tile_id)
        if s is None:  # first step: statistics and the first eigenbases only
            left, right = (1 - shampoo_beta) * (grad @ grad.T), (1 - shampoo_beta) * (grad.T @ grad)
            try:
                bases = _eigenbasis(left), _eigenbasis(right)
            except EigendecompositionError as error:
                self._report_failure(tile, error)
                return None
            tiles[tile.tile_id] = {
                "step": 0,
                "L": left,
                "R": right,
                "Q_L": bases[0],
                "Q_R": bases[1],
                "exp_avg": torch.zeros_like(grad, memory_format=torch.contiguous_format),
                "exp_avg_sq": torch.zeros_like(grad, memory_format=torch.contiguous_format),
            }
            return None
        s["step"] += 1
        q_l, q_r = s["Q_L"], s["Q_R"]
        rotated = q_l.T @ grad @ q_r
        s["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
        s["exp_avg_sq"].mul_(beta2).addcmul_(rotated, rotated, value=1 - beta2)
        adam = (q_l.T @ s["exp_avg"] @ q_r) / s["exp_avg_sq"].sqrt().add_(group["eps"])
        update = (q_l @ adam @ q_r.T).mul_(-self._step_size(group, s["step"]))
        s["L"].mul_(shampoo_beta).add_(grad @ grad.T, alpha=1 - shampoo_beta)
        s["R"].mul_(shampoo_beta).add_(grad.T @ grad, alpha=1 - shampoo_beta)
        if s["step"] % group["precondition_frequency"] == 0:
            s["Q_L"], order = _power_qr(s["L"], q_l)
            s["exp_avg_sq"] = s["exp_avg_sq"][order]
            s["Q_R"], order = _power_qr(s["R"], q_r)
            s["exp_avg_sq"] = s["exp_avg_sq"][:, order]
        return update


def _eigenbasis(matrix: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of a symmetric matrix, by decreasing eigenvalue (fp32, row-major like a reloaded one)."""
    return symmetric_eigh(matrix)[1].flip(1).contiguous()


def _power_qr(matrix: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-iteration step from ``basis`` and a QR: the refreshed basis, and the column order used."""
    power = matrix @ basis
    order = torch.argsort((basis * power).sum(0), descending=True, stable=True)
    # LAPACK returns Q column-major; a checkpoint reloads it row-major, and matmuls round by layout
    return torch.linalg.qr(power[:, order])[0].contiguous(), order
