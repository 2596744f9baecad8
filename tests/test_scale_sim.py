"""``fully_shard`` simulated at 1,024 ranks equals what the plan CLI predicts (issue 13, item 2).

Four sampled ranks (first, last, middle and one whose segment of some DBuffer is only
padding), each in its own process under torch's fake process group, shard a Llama-3-70B-
and a DeepSeek-V3-shaped model (a few layers of the real shapes, built on the meta device)
and run one forward and backward on fake tensors (``tests/scale_sim.py``). The oracle is
the plan CLI (``lightning_ragged.cli.plan``: ``plan_model`` and ``memory_estimate``) on the
same config and world size, and the collective schedule written in ``scale_sim.predict``;
the collectives are counted twice: by the engine's ``CommStats`` and below it, at the
``c10d`` dispatcher. 10,000 ranks run in ``benchmarks/scale_sim.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.torch_version import TorchVersion

from tests.scale_sim import MASTER, MODELS, empty_ranks, predict, sample_ranks, simulate

pytestmark = pytest.mark.skipif(
    TorchVersion(torch.__version__) < "2.11",
    reason="the simulation runs the engine on fake tensors: torch < 2.11 has no fake kernel for c10d.broadcast_ "
           "(measured on 2.9.1 and 2.10.0: UnsupportedOperatorException)",
)

WORLD = 1024
PRESETS = tuple(MODELS)


@pytest.fixture(scope="module")
def sampled() -> dict[str, int]:
    return sample_ranks(WORLD, PRESETS)


@pytest.fixture(scope="module")
def reports(sampled: dict[str, int]) -> dict[int, Any]:
    return simulate(WORLD, sorted(set(sampled.values())), PRESETS)


@pytest.fixture(scope="module")
def predictions() -> dict[str, dict[str, Any]]:
    return {preset: predict(preset, WORLD) for preset in PRESETS}


def test_the_sample_has_first_last_middle_and_an_empty_shard_rank(sampled: dict[str, int], reports: dict) -> None:
    assert sampled["first"] == 0 and sampled["last"] == WORLD - 1 and sampled["middle"] == WORLD // 2
    rank = sampled["empty shard"]
    assert rank not in (0, WORLD - 1)
    empty = [(p, b) for p in PRESETS for b in reports[rank][p]["dbuffers"] if b["local_numel"] == 0]
    assert empty, f"the layout says rank {rank} holds only padding somewhere, the engine gave it data everywhere"
    for _, dbuffer in empty:  # the segment is still allocated: padding, all-gathered like any other
        assert dbuffer["sharded_bytes"] == dbuffer["segment_size"] * MASTER.itemsize
    assert all(b["local_numel"] > 0 for p in PRESETS for b in reports[0][p]["dbuffers"])
    assert len({report["pid"] for report in reports.values()}) == len(reports)  # one process per rank


@pytest.mark.parametrize("preset", PRESETS)
def test_engine_empty_segments_are_the_layouts(preset: str, sampled: dict[str, int], reports: dict) -> None:
    predicted = set(empty_ranks(preset, WORLD))
    for rank, report in reports.items():
        engine_empty = any(b["local_numel"] == 0 for b in report[preset]["dbuffers"])
        assert engine_empty == (rank in predicted), (preset, rank)


@pytest.mark.parametrize("preset", PRESETS)
def test_dbuffer_bytes_per_rank_equal_the_plan_cli_estimate(preset: str, reports: dict, predictions: dict) -> None:
    expected = predictions[preset]
    memory = expected["memory"]
    for rank, report in reports.items():
        engine = report[preset]
        assert sorted((b["root"], b["segment_size"]) for b in engine["dbuffers"]) == expected["segments"], rank
        assert sum(b["sharded_bytes"] for b in engine["dbuffers"]) == memory["params"], rank
        assert sum(b["sharded_grad_bytes"] for b in engine["dbuffers"]) == memory["grads"], rank
        assert engine["largest_full_group_bytes"] == memory["largest_unsharded_group"], rank


@pytest.mark.parametrize("preset", PRESETS)
def test_collectives_and_bytes_per_step_equal_the_plan(preset: str, reports: dict, predictions: dict) -> None:
    expected = predictions[preset]
    gather = [expected["all_gathers"], expected["all_gather_bytes"]]
    reduce = [expected["reduces"], expected["reduce_bytes"]]
    for rank, report in reports.items():
        engine = report[preset]
        stats = engine["stats"]
        assert [stats["all_gathers"], stats["all_gather_bytes"]] == gather, rank
        assert [stats["reduces"], stats["reduce_bytes"]] == reduce, rank
        assert stats["flag_syncs"] == 1
        calls = engine["calls"]
        assert calls["_allgather_base_"] == gather, rank
        assert calls["_reduce_scatter_base_"] == reduce, rank
        assert calls["allreduce_"][0] == 1 and calls["broadcast_"][0] == 1  # gradient flags; rotary buffers
        assert set(calls) == {"_allgather_base_", "_reduce_scatter_base_", "allreduce_", "broadcast_"}


@pytest.mark.parametrize("preset", PRESETS)
def test_every_rank_issues_the_same_collective_sequence(preset: str, reports: dict) -> None:
    sequences = {rank: report[preset]["sequence"] for rank, report in reports.items()}
    first = sequences[0]
    assert all(sequence == first for sequence in sequences.values()), sorted(sequences)
