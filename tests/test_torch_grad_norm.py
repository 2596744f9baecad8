"""torch's own gradient clipping on a ragged model, as FSDP2 training loops write it.

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (and torchtitan's
``get_total_norm`` + ``clip_grads_with_norm_``) must clip by the global norm over every rank's
shards, as it does on FSDP2's DTensors. Oracle: single-process training on the whole batch
with the same torch calls. Before the routing each rank clipped by its own part's norm.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.utils import clip_grad_norm_  # bound by name before any model is sharded, as scripts do

import lightning_ragged as lr
from tests.models import lm_loss, make_batches, make_model, shard_grad_diff

MAX_NORM = 0.05  # below every step's norm here: each step is clipped
STEPS = 3


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    for block in model.blocks:
        lr.fully_shard(block)
    return lr.fully_shard(model)


def _train_with_torch_clipping(norm_type: float) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, sharded = make_model(0), _shard(make_model(0))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, sharded)]
    norm_diff, smallest_norm = 0.0, float("inf")
    for tokens in make_batches(STEPS, 2 * world):
        lm_loss(reference, tokens).backward()
        lm_loss(sharded, tokens[2 * rank : 2 * rank + 2]).backward()
        expected = clip_grad_norm_(reference.parameters(), MAX_NORM, norm_type)
        total = clip_grad_norm_(sharded.parameters(), MAX_NORM, norm_type)
        norm_diff = max(norm_diff, abs(total.item() - expected.item()) / expected.item())
        smallest_norm = min(smallest_norm, expected.item())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    full = lr.full_state_dict(sharded)
    param_diff = max((full[name] - value).abs().max().item() for name, value in reference.state_dict().items())
    return {"norm_diff": norm_diff, "param_diff": param_diff, "smallest_norm": smallest_norm}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_torch_clip_grad_norm_is_global(dist_pool, world_size: int, norm_type: float) -> None:
    for result in dist_pool(world_size).run(_train_with_torch_clipping, norm_type):
        assert result["smallest_norm"] > MAX_NORM, result  # every step clipped, so the coefficient mattered
        # fp32 sums in another order across ranks: relative 1e-5 on the norm, 1e-5 on weights after 3 steps
        assert result["norm_diff"] <= 1e-5 and result["param_diff"] <= 1e-5, result


def _torchtitan_pattern() -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, sharded, plain = make_model(0), _shard(make_model(0)), make_model(1)
    tokens = make_batches(1, 2 * world)[0]
    for model, batch in ((reference, tokens), (sharded, tokens[2 * rank : 2 * rank + 2]), (plain, tokens)):
        lm_loss(model, batch).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    with CommDebugMode() as sharded_comms:
        grads = [p.grad for p in sharded.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        torch.nn.utils.clip_grads_with_norm_(sharded.parameters(), MAX_NORM, total, foreach=True)
    with CommDebugMode() as plain_comms:  # a model nobody sharded: torch's own function, no collective
        plain_total = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])
    plain_oracle = torch.cat([p.grad.reshape(-1) for p in plain.parameters()]).norm()
    grad_diff = shard_grad_diff(sharded, reference)
    return {
        "norm_diff": abs(total.item() - expected.item()) / expected.item(),
        "grad_diff": grad_diff,
        "sharded_collectives": sharded_comms.get_total_counts(),
        "plain_collectives": plain_comms.get_total_counts(),
        "plain_diff": abs(plain_total.item() - plain_oracle.item()) / plain_oracle.item(),
    }


def test_torchtitan_get_total_norm_is_global(dist_pool) -> None:
    for result in dist_pool(2).run(_torchtitan_pattern):
        assert result["norm_diff"] <= 1e-5 and result["grad_diff"] <= 1e-6, result
        assert result["sharded_collectives"] == 1, result  # one all-reduce: every DBuffer shards over the world
        assert result["plain_collectives"] == 0 and result["plain_diff"] <= 1e-6, result


def _every_norm_kind() -> dict:
    """torch's get_total_norm in fp64 over every norm kind, on the shards alone and mixed with a plain tensor."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, sharded = make_model(0).double(), _shard(make_model(0).double())
    tokens = make_batches(1, 2 * world)[0]
    lm_loss(reference, tokens).backward()
    lm_loss(sharded, tokens[2 * rank : 2 * rank + 2]).backward()
    replicated = torch.linspace(-2.0, 3.0, 7, dtype=torch.float64)  # the same tensor on every rank, not sharded
    full = [p.grad for p in reference.parameters()]
    shards = [p.grad for p in sharded.parameters()]
    diffs, dtypes = {}, set()
    for norm_type in (2.0, 1.0, 3.0, -1.0, float("inf"), float("-inf")):
        for mixed in (False, True):
            expected = torch.nn.utils.clip_grad._get_total_norm.__wrapped__(full + [replicated] * mixed, norm_type)
            total = torch.nn.utils.get_total_norm(shards + [replicated] * mixed, norm_type)
            diffs[f"{norm_type} mixed={mixed}"] = abs(total.item() - expected.item()) / max(expected.item(), 1e-300)
            dtypes.add(total.dtype)
        expected = torch.nn.utils.clip_grad._get_total_norm.__wrapped__(full, norm_type)
        total = lr.clip_grad_norm_(sharded, float("inf"), norm_type)  # the flat-buffer path; scales by 1
        diffs[f"{norm_type} lr.clip_grad_norm_(model)"] = abs(total.item() - expected.item()) / expected.item()
    try:
        torch.nn.utils.get_total_norm(shards, 0.0)
        zero_norm = "no error"
    except ValueError as error:
        zero_norm = str(error)
    return {"diffs": diffs, "dtypes": dtypes, "zero_norm": zero_norm}


def test_every_norm_kind_and_dtype_as_torch(dist_pool) -> None:
    for result in dist_pool(3).run(_every_norm_kind):
        # The two runs' gradients differ by fp64 rounding (whole-batch mean vs the mean of rank means):
        # ~1e-16 of the largest gradient. Sums of powers stay within 1e-12 relative; the -1 and -inf norms
        # are set by the smallest |g| (~1e-6 of the largest here), so their relative error is ~1e-10.
        diffs = result["diffs"]
        assert max(d for k, d in diffs.items() if not k.startswith("-")) <= 1e-12, result
        assert max(d for k, d in diffs.items() if k.startswith("-")) <= 1e-8, result
        assert result["dtypes"] == {torch.float64}, result  # torch's dtype: the gradients'
        assert "norm_type=0 is not supported" in result["zero_norm"], result


def _nonfinite_on_last_rank(norm_type: float, value: float) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = _shard(make_model(0))
    lm_loss(sharded, make_batches(1, 2 * world)[0][2 * rank : 2 * rank + 2]).backward()
    if rank == world - 1:  # not rank 0: gloo's MAX keeps a NaN only from the first rank
        next(p for p in sharded.parameters() if p.numel()).grad[0] = value
    grads = [p.grad for p in sharded.parameters()]
    result = {"norm": torch.nn.utils.get_total_norm(grads, norm_type).item(),
              "model_norm": lr.clip_grad_norm_(sharded, float("inf"), norm_type).item()}
    try:
        torch.nn.utils.clip_grad_norm_(sharded.parameters(), MAX_NORM, norm_type, error_if_nonfinite=True)
    except RuntimeError as error:
        return {**result, "error": str(error)}
    return {**result, "error": "no error"}


@pytest.mark.parametrize("norm_type,value", [(2.0, "nan"), (2.0, "inf"), ("inf", "nan"), ("inf", "inf"),
                                             ("-inf", "nan"), (-1.0, "nan")])
def test_nonfinite_norm_raises_on_every_rank(dist_pool, norm_type, value: str) -> None:
    # The bad value sits in the last rank's part only: the global norm is non-finite everywhere, on both
    # paths (torch's routed function, lr.clip_grad_norm_ on the model). An inf is no extreme for p < 0 or
    # -inf (|inf|^p = 0), as in torch, so only NaN is tried there.
    for result in dist_pool(3).run(_nonfinite_on_last_rank, float(norm_type), float(value)):
        assert not torch.isfinite(torch.tensor([result["norm"], result["model_norm"]])).any(), result
        assert "non-finite" in result["error"], result


def _compiled_clipping() -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, sharded = make_model(0), _shard(make_model(0))
    tokens = make_batches(1, 2 * world)[0]
    lm_loss(reference, tokens).backward()
    lm_loss(sharded, tokens[2 * rank : 2 * rank + 2]).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    total = torch.compile(lambda: torch.nn.utils.clip_grad_norm_(sharded.parameters(), MAX_NORM))()
    return {"norm_diff": abs(total.item() - expected.item()) / expected.item()}


def test_compiled_torch_clipping_is_global(dist_pool) -> None:
    for result in dist_pool(2).run(_compiled_clipping):  # the norm runs eagerly inside the compiled function
        assert result["norm_diff"] <= 1e-5, result


def _scaled_steps(sharded_scaler: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """3 AdamW steps under a GradScaler; at the second, rank 1's part of one gradient overflows (an fp16 inf)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = lr.fully_shard(make_model(), shard_granularity="row")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = (ShardedGradScaler if sharded_scaler else torch.amp.GradScaler)("cpu", init_scale=256.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step, batch in enumerate(make_batches(3, 4)):
        scaler.scale(lm_loss(model, batch[rank::world])).backward()
        if step == 1 and rank == 1:
            next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return scaler.get_scale(), lr.full_state_dict(model)


def check_plain_grad_scaler_skips_on_every_rank() -> dict:
    plain, params = _scaled_steps(sharded_scaler=False)
    sharded, expected = _scaled_steps(sharded_scaler=True)  # torch's FSDP scaler: the oracle
    return {"plain": plain, "sharded": sharded, "same": all(torch.equal(params[k], expected[k]) for k in expected)}


def test_plain_grad_scaler_skips_the_step_on_every_rank(dist_pool) -> None:
    # Before: only rank 1 saw its inf; it skipped the step and halved its scale while rank 0 stepped
    # (scales 128 and 256, 2.1e-2 from DDP after 3 steps in the sweep)
    results = dist_pool(2).run(check_plain_grad_scaler_skips_on_every_rank)
    assert [r["plain"] for r in results] == [128.0, 128.0] and [r["sharded"] for r in results] == [128.0, 128.0]
    assert all(r["same"] for r in results), results
