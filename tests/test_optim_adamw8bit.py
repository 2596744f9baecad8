"""8-bit AdamW: identical parameters at world sizes 1, 2, 3; boundary error when a block is cut."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from lightning_ragged import RaggedShardBoundaryViolation, full_state_dict, fully_shard
from lightning_ragged.optim import AdamW8bit, block_granularity
from lightning_ragged.optim.quantization import dequantize_blockwise, dynamic_map, quantize_blockwise

STEPS = 5
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05, block_size=256)


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 20), nn.Tanh(), nn.Linear(20, 3))


def step_gradients(shapes, steps=STEPS):
    generator = torch.Generator().manual_seed(5)
    return [{n: torch.randn(s, generator=generator) for n, s in shapes.items()} for _ in range(steps)]


def run_plain():
    """Single process, plain full tensors (no fully_shard)."""
    model = make_mlp()
    optimizer = AdamW8bit(model.parameters(), **HYPER)
    params = dict(model.named_parameters())
    for grads in step_gradients({n: p.shape for n, p in params.items()}):
        for name, param in params.items():
            param.grad = grads[name].clone()
        optimizer.step()
    return {n: p.detach().clone() for n, p in params.items()}


def run_sharded():
    model = fully_shard(make_mlp(), shard_granularity=block_granularity(256))
    optimizer = AdamW8bit(model.parameters(), **HYPER)
    params = dict(model.named_parameters())
    counts = []
    for grads in step_gradients({n: p.ragged_shard.global_shape for n, p in params.items()}):
        for name, param in params.items():
            start, end = param.ragged_shard.local_range
            param.grad = grads[name].reshape(-1)[start:end].clone()
        with CommDebugMode() as comm:
            optimizer.step()
        counts.append(comm.get_total_counts())
    cuts = sorted({c for p in params.values() for c in p.ragged_shard.cut_offsets()})
    return full_state_dict(model), counts, cuts, optimizer.state_dict()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_adamw8bit_identical_across_world_sizes(dist_pool, world_size):
    expected = run_plain()
    per_rank = dist_pool(world_size).run(run_sharded)
    full, counts, cuts, state = per_rank[0]
    if world_size > 1:
        assert cuts, "the layout should cut at least one parameter (at block boundaries)"
    for name, value in expected.items():
        assert (full[name] - value).abs().max().item() <= 1e-6, name  # measured: 0.0 (bit-for-bit)
    assert all(c == [0] * STEPS for _, c, _, _ in per_rank)
    meta = state["ragged"]["0.weight"]
    assert meta["state_layout"]["exp_avg_scales"] == "blocks:256"
    start, end = meta["local_range"]
    assert state["state"]["0.weight"]["exp_avg_codes"].dtype == torch.uint8
    assert state["state"]["0.weight"]["exp_avg_codes"].numel() == end - start


def test_adamw8bit_tracks_fp32_adamw():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(20, 40))
    reference = nn.Parameter(weight.detach().clone())
    ours = AdamW8bit([weight], **HYPER)
    theirs = torch.optim.AdamW([reference], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05)
    for _ in range(10):
        grad = torch.randn(20, 40)
        weight.grad, reference.grad = grad.clone(), grad.clone()
        ours.step(), theirs.step()
    assert (weight - reference).abs().max().item() < 5e-3  # quantization error only (lr = 1e-2)
    assert ours.state[weight]["exp_avg_codes"].dtype == torch.uint8
    assert ours.state[weight]["exp_avg_scales"].shape == (4,)  # 800 elements → 4 blocks of 256


def test_quantization_of_a_block_aligned_shard_equals_the_full_tensor():
    assert len(set(dynamic_map(True))) == 256 and len(set(dynamic_map(False))) == 256
    values = torch.randn(1000)
    codes, scales = quantize_blockwise(values, 256, signed=True)
    tail_codes, tail_scales = quantize_blockwise(values[512:], 256, signed=True)
    assert torch.equal(tail_codes, codes[512:]) and torch.equal(tail_scales, scales[2:])
    restored = dequantize_blockwise(codes, scales, 256, signed=True)
    assert (restored - values).abs().max() < 0.02 * values.abs().max()


def adamw8bit_on_element_shards():
    model = fully_shard(make_mlp(), shard_granularity="element")
    try:
        AdamW8bit(model.parameters())
    except RaggedShardBoundaryViolation as error:
        return str(error)
    return None


def test_misaligned_block_raises(dist_pool):
    messages = dist_pool(2).run(adamw8bit_on_element_shards)
    assert messages[0] is not None and messages[0] == messages[1]
    assert messages[0].startswith("RaggedShard boundary violation:") and "256" in messages[0]


def test_state_dict_loads_full_state_into_a_shard():
    """A consolidated (full-size) state slices to a block-aligned local range."""
    model = make_mlp()
    optimizer = AdamW8bit(model.named_parameters(), **HYPER)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    full = optimizer.state_dict()
    weight = model[0].weight
    shard = nn.Parameter(weight.detach().reshape(-1)[512:1200].clone())
    from lightning_ragged.layout.ragged_shard import RaggedShard

    shard.ragged_shard = RaggedShard("0.weight", weight.shape, 256, ((0, 512), (512, 1200)), 1)
    local = AdamW8bit([shard], **HYPER)
    local.load_state_dict({"state": {"0.weight": full["state"]["0.weight"]}, "param_groups": [
        {**full["param_groups"][0], "params": ["0.weight"]}], "ragged": full["ragged"]})
    assert torch.equal(local.state[shard]["exp_avg_codes"], optimizer.state[weight]["exp_avg_codes"].view(-1)[512:])
    assert torch.equal(local.state[shard]["exp_avg_sq_scales"], optimizer.state[weight]["exp_avg_sq_scales"][2:])
