"""A symmetric eigendecomposition that retries before it gives up, and the error raised when it does.

Shampoo's root inverses and SOAP's first eigenbases come from ``torch.linalg.eigh``, which can
fail to converge on an ill-conditioned statistic (more often in fp32, and the solvers differ
between devices). SOAP's reference implementation retries in float64; here a failure is retried
in float64 on the same device, then in float64 on the CPU. Only when every attempt fails does
``symmetric_eigh`` raise ``EigendecompositionError`` — which the tiled step (``optim/tiled.py``)
records, so that it can finish the step's collectives first and then raise on every rank.
"""

from __future__ import annotations

import torch


class EigendecompositionError(RuntimeError):
    """A tile's eigendecomposition failed in every precision and on every device tried."""


def symmetric_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eigenvalues, eigenvectors)`` of a symmetric matrix, in its dtype and on its device (ascending order)."""
    attempts = [(matrix.dtype, matrix.device)]
    if matrix.dtype != torch.float64:
        attempts.append((torch.float64, matrix.device))
    if matrix.device.type != "cpu":
        attempts.append((torch.float64, torch.device("cpu")))
    errors = []
    for dtype, device in attempts:
        try:
            values, vectors = torch.linalg.eigh(matrix.to(device=device, dtype=dtype))
        except RuntimeError as error:  # torch.linalg.LinAlgError, and the CUDA solvers' errors
            errors.append(f"{dtype} on {device}: {error}")
            continue
        return values.to(matrix.device, matrix.dtype), vectors.to(matrix.device, matrix.dtype)
    raise EigendecompositionError("torch.linalg.eigh failed in " + "; ".join(errors))
