"""A complex parameter (a spectral filter, a rotary table learned as complex numbers) beside real ones.

Oracle: the same model on one process (torch's AdamW and ``clip_grad_norm_`` handle complex tensors).
Before: a real ``mp_policy.param_dtype`` cast the complex shard to bf16, dropping its imaginary part
(torch's only sign a warning; FSDP2 refuses mixed dtypes), ``full_state_dict(rank0_only=True)`` failed
in gloo's gather ("Invalid scalar type"), and torch's ``clip_grad_norm_`` got a complex total norm
("clamp is not supported for complex types").
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import lightning_ragged as lr
from tests.test_fully_shard import _local

STEPS = 3
BATCH = 6


class Spectral(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(13, 4)
        self.filter = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.lin(x)).to(self.filter.dtype) @ self.filter).abs()


def _model() -> Spectral:
    torch.manual_seed(0)
    return Spectral()


def check_complex_parameter() -> dict:
    torch.manual_seed(1)
    data = torch.randn(STEPS, BATCH, 13)
    reference, model = _model(), lr.fully_shard(_model(), shard_granularity="element", dbuffer_size=64)
    norms = {}
    for net, local in ((reference, lambda b: b), (model, _local)):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        norms[net is model] = []
        for batch in data:
            net(local(batch)).square().mean().backward()
            norms[net is model].append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5).item())
            opt.step()
            opt.zero_grad()
    full = lr.full_state_dict(model)
    on_rank0 = lr.full_state_dict(model, rank0_only=True)
    expected = reference.state_dict()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mixed = lr.fully_shard(_model(), mp_policy=policy)
    x = data[0]
    out, exact = mixed(x), _model()(x)
    return {
        "diff": max((full[k] - v).abs().max().item() for k, v in expected.items()),
        "rank0_diff": max((on_rank0[k] - v).abs().max().item() for k, v in expected.items()) if on_rank0 else None,
        "norms": norms,
        "mixed_rel": ((out.float() - exact).abs().max() / exact.abs().max()).item(),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_complex_parameter_trains_gathers_and_keeps_its_dtype(dist_pool, world_size):
    for rank, result in enumerate(dist_pool(world_size).run(check_complex_parameter)):
        assert result["diff"] <= 1e-5, result
        assert (result["rank0_diff"] is None) == (rank != 0) and (rank or result["rank0_diff"] <= 1e-5), result
        ours, oracle = result["norms"][True], result["norms"][False]
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(ours, oracle)), result["norms"]
        # the Linear computes in bf16 (8 mantissa bits): ~1e-2 of the output; the imaginary part dropped: ~0.8
        assert result["mixed_rel"] <= 5e-2, result
