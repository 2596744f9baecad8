"""RaggedShard helpers and the granularity policy (pure, single process)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_ragged import RaggedShardBoundaryViolation
from lightning_ragged.layout.granularity import resolve_granularity
from lightning_ragged.layout.ragged_shard import RaggedShard, flat_range_to_boxes


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    data=st.data(),
)
def test_boxes_cover_exactly_the_flat_range(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    end = data.draw(st.integers(start, numel))
    boxes = flat_range_to_boxes(shape, start, end)
    assert len(boxes) <= 2 * len(shape) - 1
    covered = torch.zeros(shape, dtype=torch.int32)
    for offsets, sizes in boxes:
        covered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    expected = torch.zeros(numel, dtype=torch.int32)
    expected[start:end] = 1
    assert torch.equal(covered.reshape(-1), expected)


def _shard(ranges, shape=(6, 4), rank=0):
    return RaggedShard("w", torch.Size(shape), 1, tuple(ranges), rank)


def test_owner_and_cuts():
    whole = _shard([(0, 0), (0, 24), (24, 24)])
    assert whole.owner() == 1 and whole.cut_offsets() == []
    split = _shard([(0, 8), (8, 24)], rank=1)
    assert split.owner() is None and split.cut_offsets() == [8]
    assert split.local_range == (8, 24) and split.local_numel == 16
    assert split.local_boxes() == [((2, 0), (4, 4))]


def test_require_blocks_names_parameter_offset_and_fix():
    split = _shard([(0, 12), (12, 24)])
    split.require_blocks(4, "rows")  # cut at 12 is a row boundary
    with pytest.raises(RaggedShardBoundaryViolation, match=r"^RaggedShard boundary violation: parameter 'w'.*offset 12.*block_rows"):
        split.require_blocks(8, "8-bit blocks")


def test_granularity_policy():
    matrix = torch.empty(10, 6)
    vector = torch.empty(300)
    assert resolve_granularity("element", "m", matrix) == 1
    assert resolve_granularity("row", "m", matrix) == 6
    assert resolve_granularity("row", "v", vector) == 1
    assert resolve_granularity("block", "m", matrix, block_rows=4) == 24
    assert resolve_granularity("block", "m", matrix, block_rows=128) == 60  # capped at the tensor
    assert resolve_granularity("block", "v", vector, block_rows=128) == 128
    assert resolve_granularity("matrix", "m", matrix) == 60
    assert resolve_granularity("muon", "blocks.0.up.weight", matrix) == 60  # a hidden matrix: whole
    assert resolve_granularity("muon", "embed.weight", matrix) == 6  # AdamW's side: rows
    assert resolve_granularity("muon", "v", vector) == 1
    assert resolve_granularity(lambda name, p: 12, "m", matrix) == 12
    for policy in ("element", "row", "block", "matrix", "muon", lambda name, p: 12):  # no elements: nothing to cut
        for empty in (torch.empty(3, 0), torch.empty(0, 6), torch.empty(0)):
            assert resolve_granularity(policy, "blocks.0.up.weight", empty) == 1  # (3, 0) at rows was 0: refused
    with pytest.raises(ValueError, match=r"shard_granularity='cols'.*'element'"):
        resolve_granularity("cols", "m", matrix)
    with pytest.raises(ValueError, match=r"returned 0 for parameter 'm'"):
        resolve_granularity(lambda name, p: 0, "m", matrix)


def _muon_policy(model: torch.nn.Module) -> dict[str, int]:
    return {name: resolve_granularity("muon", name, param) for name, param in model.named_parameters()}


def _rows(param: torch.Tensor) -> int:
    return param.numel() // param.shape[0] if param.dim() > 1 else 1


def test_muon_policy_on_a_transformers_llama():
    """Hidden projections whole; embedding, head and norms at rows: written out for the real model."""
    pytest.importorskip("transformers")
    from tests.hf_models import make_llama

    model = make_llama()
    params = dict(model.named_parameters())
    hidden = {
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }
    expected = {name: (p.numel() if name in hidden else _rows(p)) for name, p in params.items()}
    assert expected["model.embed_tokens.weight"] == 32 and expected["lm_head.weight"] == 32
    assert expected["model.norm.weight"] == 1 and expected["model.layers.0.mlp.down_proj.weight"] == 32 * 64
    assert _muon_policy(model) == expected


def test_muon_policy_on_the_benchmark_gpt_is_the_muon_split():
    """On benchmarks/models.py's GPT: whole exactly where ``split_muon_params(model)`` says Muon."""
    from benchmarks.models import GPTConfig, make_gpt
    from lightning_ragged.optim import split_muon_params

    model = make_gpt(GPTConfig(vocab=64, width=16, layers=2, heads=2, seq=8))
    muon, adamw = split_muon_params(model)
    assert {n for n, _ in muon} == {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "fc", "out")}
    assert {"embed.weight", "pos.weight", "head.weight", "ln_f.weight", "blocks.0.fc.bias"} <= {n for n, _ in adamw}
    granularity = _muon_policy(model)
    assert {n: granularity[n] for n, _ in muon} == {n: p.numel() for n, p in muon}
    assert {n: granularity[n] for n, _ in adamw} == {n: _rows(p) for n, p in adamw}


def test_local_blocks_of_empty_and_partial_ranges():
    empty = _shard([(0, 24), (24, 24)], rank=1)  # rank 1 holds nothing, its range sits mid-block
    assert empty.local_blocks(16) == (0, 0)
    partial = _shard([(0, 8), (8, 24)], rank=1)
    assert partial.local_blocks(16) == (0, 2)  # touches the end of block 0 and all of block 1


def test_zero_dim_tensor_is_one_box_in_its_own_shape():
    # A 0-D tensor's one element is the box with offsets () and sizes () of the shape ().
    assert flat_range_to_boxes((), 0, 1) == [((), ())]
    assert flat_range_to_boxes((), 0, 0) == [] and flat_range_to_boxes((), 1, 1) == []
    scalar = torch.tensor(2.5)
    (offsets, sizes), = flat_range_to_boxes(scalar.shape, 0, 1)
    piece = scalar[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    assert piece.shape == () and piece is not None and piece.item() == 2.5  # indexing with () is the whole tensor
    with pytest.raises(ValueError, match=r"\[0, 2\) is outside a tensor of shape \(\)"):
        flat_range_to_boxes((), 0, 2)
    # Sharded over 3 ranks, only the owner holds it: one box there, none elsewhere, no cut.
    shards = [RaggedShard("scale", torch.Size([]), 1, ((0, 0), (0, 1), (1, 1)), rank) for rank in range(3)]
    assert [shard.local_boxes() for shard in shards] == [[], [((), ())], []]
    assert shards[0].numel == 1 and shards[0].owner() == 1 and shards[0].cut_offsets() == []
    assert [shard.local_numel for shard in shards] == [0, 1, 0]
    shards[0].require_blocks(16, "8-bit blocks")  # nothing to cut
