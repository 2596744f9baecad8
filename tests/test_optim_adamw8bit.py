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


def test_adamw8bit_small_gradient_beside_a_large_one_moves_at_most_adams_bound():
    # A rare token's row: a gradient 1e-4 of its block's largest, once, then 0. Its second moment was
    # rounded to 0 beside a first moment that was not: p moved -69.7 in 3 steps (torch's AdamW: -0.022).
    # Adam's step is at most lr * (1 - beta1) / sqrt(1 - beta2) (Kingma & Ba, section 2.1).
    lr, betas, steps = 1e-2, (0.9, 0.999), 3
    moved = {}
    for name, cls, extra in (("ours", AdamW8bit, dict(block_size=256)), ("torch", torch.optim.AdamW, {})):
        param = nn.Parameter(torch.zeros(256))
        optimizer = cls([param], lr=lr, betas=betas, weight_decay=0.0, **extra)
        for step in range(steps):
            param.grad = torch.zeros(256)
            param.grad[0] = 1.0
            param.grad[1] = 1e-4 if step == 0 else 0.0
            optimizer.step()
        moved[name] = param.detach()
    bound = steps * lr * (1 - betas[0]) / (1 - betas[1]) ** 0.5
    assert moved["ours"][1].abs() <= bound and moved["torch"][1].abs() <= bound
    assert torch.sign(moved["ours"][1]) == torch.sign(moved["torch"][1])  # the same direction, a smaller step
    assert (moved["ours"][0] - moved["torch"][0]).abs() < 1e-3  # the large element: quantization error only
    codes, scales = quantize_blockwise(torch.tensor([1.0, 1e-12, 0.0]), 256, signed=False)
    assert dequantize_blockwise(codes, scales, 256, signed=False).tolist() == [1.0, pytest.approx(3.25e-7), 0.0]


def test_quantization_of_a_block_aligned_shard_equals_the_full_tensor():
    assert len(set(dynamic_map(True))) == 256 and len(set(dynamic_map(False))) == 256
    values = torch.randn(1000)
    codes, scales = quantize_blockwise(values, 256, signed=True)
    tail_codes, tail_scales = quantize_blockwise(values[512:], 256, signed=True)
    assert torch.equal(tail_codes, codes[512:]) and torch.equal(tail_scales, scales[2:])
    restored = dequantize_blockwise(codes, scales, 256, signed=True)
    assert (restored - values).abs().max() < 0.02 * values.abs().max()


def adamw8bit_on_element_shards(later: bool):
    model = fully_shard(make_mlp(), shard_granularity="element")
    try:
        if later:  # as Lightning's BaseFinetuning.unfreeze_and_add_param_group; before, accepted silently
            optimizer = AdamW8bit([nn.Parameter(torch.zeros(256))])
            groups = len(optimizer.param_groups)
            try:
                optimizer.add_param_group({"params": list(model.parameters())})
            finally:
                assert len(optimizer.param_groups) == groups  # a refused group leaves the optimizer as it was
        else:
            AdamW8bit(model.parameters())
    except RaggedShardBoundaryViolation as error:
        return str(error)
    return None


@pytest.mark.parametrize("later", [False, True], ids=["constructor", "add_param_group"])
def test_misaligned_block_raises(dist_pool, later):
    messages = dist_pool(2).run(adamw8bit_on_element_shards, later)
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


def test_bad_hyperparameters_of_a_param_group_are_refused_at_construction():
    # before: a group's block_size=0 divided by zero at the first step, betas=(0.9,) failed there to unpack
    weight, bias = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    for group, words in (
        ({"block_size": 0}, r"param group 1's block_size=0 must be a positive int"),
        ({"betas": (0.9,)}, r"param group 1's betas=\(0.9,\) must be two numbers in \[0, 1\)"),
        ({"betas": (0.9, 0.99, 0.9)}, r"betas=\(0.9, 0.99, 0.9\) must be two numbers"),
        ({"lr": -1.0}, r"param group 1's lr=-1.0"),
    ):
        with pytest.raises(ValueError, match=words):
            AdamW8bit([{"params": [weight]}, {"params": [bias], **group}], block_size=4)
    with pytest.raises(ValueError, match=r"betas=\(0.9,\) must be two numbers"):
        AdamW8bit([weight], betas=(0.9,))
    optimizer = AdamW8bit([{"params": [weight]}, {"params": [bias], "block_size": 2}], block_size=4)
    assert [g["block_size"] for g in optimizer.param_groups] == [4, 2]
