"""benchmarks/live_memory.py's LiveStorageTracker against hand counts, and that it sees both FSDPs' buffers."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from live_memory import LiveStorageTracker, storages_of  # noqa: E402

F32 = 4


def test_hand_count_of_plain_tensors_views_and_resize() -> None:
    tracker = LiveStorageTracker()
    with tracker:
        a = torch.empty(1000)
        b = a + 1
        assert tracker.current() == 2000 * F32
        view = b[10:20].view(2, 5)  # a view shares b's storage: not counted again
        assert tracker.current() == 2000 * F32
        del b
        gc.collect()
        assert tracker.current() == 2000 * F32  # the view still holds b's storage
        del view
        gc.collect()
        assert tracker.current() == 1000 * F32
        a.untyped_storage().resize_(0)  # freed without any operator: read again at the next count
        assert tracker.current() == 0
        outside = torch.from_numpy(__import__("numpy").ones(250, dtype="float32"))  # made by no operator
        (outside * 2).sum()
        assert tracker.tracks(outside)


def test_hand_count_of_forward_and_backward_peak() -> None:
    tracker = LiveStorageTracker()
    with tracker:
        linear = nn.Linear(256, 128, bias=False)
        x = torch.randn(32, 256)
        weight, inputs, outputs = 256 * 128 * F32, 32 * 256 * F32, 32 * 128 * F32
        y = linear(x)
        assert tracker.current() == weight + inputs + outputs
        del y
        gc.collect()
        with tracker.window():
            linear(x).sum().backward()
    # Peak in backward: weight + input (saved for the weight's gradient) + the scalar loss and its
    # gradient (4 bytes each) + the weight's gradient; the output was not saved and is already gone.
    assert tracker.peak == weight + inputs + F32 + F32 + weight
    assert tracker.peak_at.endswith("aten::mm")
    assert tracker.peak_carried == weight + inputs  # live before the window opened; the rest was born inside
    assert tracker.current() == weight + inputs + weight  # the loss and its gradient died with the graph


def test_on_peak_is_read_at_the_peak_operator() -> None:
    tracker = LiveStorageTracker()
    with tracker:
        small = torch.empty(100)
        with tracker.window():
            tracker.on_peak = lambda: {"live": tracker.current(), "small_alive": small.untyped_storage().nbytes()}
            big = torch.empty(1000)
            del big  # the peak was with big alive; afterwards less is live
            gc.collect()
            small.untyped_storage().resize_(0)
            torch.empty(10)  # a later operator below the peak: the detail stays the peak's
    assert tracker.peak == 1100 * F32
    assert tracker.peak_detail == {"live": 1100 * F32, "small_alive": 100 * F32}


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _seen_during_forward(framework: str) -> dict[str, object]:
    """Under the tracker from before the build, what block 0's forward pre-hook sees once the framework unsharded it."""
    tracker = LiveStorageTracker()
    seen: dict[str, object] = {}
    with tracker:
        torch.manual_seed(0)
        model = _Stack()
        seen["built"] = tracker.current()
        if framework == "ragged":
            import lightning_ragged

            lightning_ragged.fully_shard(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        gc.collect()
        shards = {s._cdata: s.nbytes() for p in model.parameters() for s in storages_of(p)}
        seen.update(sharded=tracker.current(), shard_bytes=sum(shards.values()))
        block = model.blocks[0]

        def inside(module: nn.Module, args: tuple) -> None:  # runs after the framework's own pre-forward (unshard)
            storage = module.weight.untyped_storage()
            seen.update(tracked=tracker.tracks(module.weight), storage_bytes=storage.nbytes(),
                        over_rest=tracker.current() - tracker.marks["rest"])
            seen["storage"] = storage

        block.register_forward_pre_hook(inside)
        x = torch.randn(4, 64)
        tracker.mark("rest")
        model(x).sum().backward()
        seen["storage_bytes_after_step"] = seen.pop("storage").nbytes()
    return seen


def test_sees_fsdp2_unsharded_parameters_and_our_dbuffers(dist_pool) -> None:
    block_bytes = (64 * 64 + 64) * F32
    model_bytes = 2 * block_bytes + (64 * 8 + 8) * F32
    for framework in ("fsdp2", "ragged"):
        for seen in dist_pool(2).run(_seen_during_forward, framework):
            assert seen["built"] == model_bytes, (framework, seen)  # hand count of the unsharded model
            # Sharded: the full parameters died (seen by the weakref callbacks); the shards are live.
            assert seen["shard_bytes"] <= seen["sharded"] < model_bytes, (framework, seen)
            assert seen["tracked"], framework
            assert seen["storage_bytes"] >= 64 * 64 * F32, (framework, seen)  # the full weight, not a shard
            # Everything block 0 needs in full (weight and bias) is live on top of the bytes at rest.
            assert seen["over_rest"] >= block_bytes, (framework, seen)
            assert seen["storage_bytes_after_step"] == 0, (framework, seen)  # resharded: freed with resize_
