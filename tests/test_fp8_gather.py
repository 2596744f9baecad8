"""fp8 all-gather (``fully_shard(fp8_all_gather=...)``) on 2 and 3 gloo ranks.

Oracles, all written here: a per-tile quantize-dequantize of the *full* fp32 weight on one
process (padding to whole tiles and ``repeat_interleave``, unlike the engine's tiled views),
the fp8 format's own rounding bound, single-process training with that fake-quantization
applied to the weights before every forward, a byte count derived from the ranks' ranges,
and the plain bf16 all-gather.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import lightning_ragged as lr
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ragged.engine.events import EventKind
from lightning_ragged.engine.fp8_gather import Fp8Gather, dequantize_into, float32_table, tile_grid, to_float32
from lightning_ragged.layout.spec import TensorSpec
from tests.models import lm_loss, make_batches, make_model
from tests.test_fully_shard import BATCH, _local

WORLD_SIZES = [2, 3]
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
STEPS = 5


def reference_fake_quant(w: torch.Tensor, tile: int, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """Quantize-dequantize a whole 2-D weight, one scale per tile, on one process: the oracle."""
    fp8_max = torch.finfo(dtype).max
    rows, cols = w.shape
    padded = F.pad(w.float().abs(), (0, -cols % tile, 0, -rows % tile))  # zeros never raise an amax
    amax = padded.view(padded.shape[0] // tile, tile, padded.shape[1] // tile, tile).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    full_scale = scale.repeat_interleave(tile, 0)[:rows].repeat_interleave(tile, 1)[:, :cols]
    q = (w.float() / full_scale).clamp(-fp8_max, fp8_max).to(dtype)
    return (q.float() * full_scale).to(out_dtype), full_scale


class OddShapes(nn.Module):
    """Linear weights whose rows and columns are not multiples of the tile, a tiny one, an exact one;
    an embedding, biases, a norm and a head that the module filter leaves in bf16."""

    def __init__(self, tile: int) -> None:
        super().__init__()
        scale = 1 if tile == 128 else 8  # keep the tile=4 case small and cut into many tiles
        self.embed = nn.Embedding(11, 9)
        self.a = nn.Linear(200 // scale, 600 // scale)  # larger than a segment: it must be cut
        self.b = nn.Linear(3, 5)
        self.c = nn.Linear(128 // scale * 2, 256 // scale, bias=False)
        self.norm = nn.LayerNorm(9)
        self.head = nn.Linear(9, 11, bias=False)
        with torch.no_grad():
            self.c.weight[:tile, :tile] = 0  # one all-zero tile: its scale must not divide by zero
            self.a.weight[0, 0] = 3.0  # one large value: a tile with a scale of its own


FP8_WEIGHTS = {"a.weight", "b.weight", "c.weight"}
CONFIGS = {"tile128-e4m3": (128, torch.float8_e4m3fn), "tile4-e5m2": (4, torch.float8_e5m2)}


def _tiles_on_ranks(shard, tile: int) -> list[int]:
    rows, cols = shard.global_shape
    return [math.ceil((end - start) // cols / tile) * math.ceil(cols / tile) for start, end in shard.rank_ranges]


def check_gathered_weights(tile: int, dtype: torch.dtype) -> dict:
    """Unshard every DBuffer once; compare the full buffers with the oracle and count the bytes."""
    torch.manual_seed(0)
    config = lr.Float8AllGather(tile=tile, dtype=dtype, module_filter=lambda fqn, module: fqn != "head")
    model = lr.fully_shard(OddShapes(tile), mp_policy=BF16, fp8_all_gather=config)
    state = lr.get_state(model)
    masters = lr.full_state_dict(model)
    result = {"exact": {}, "fp8_buffers": [], "plain_buffers": [], "bytes": [], "cut": set(), "bound": {}}
    for dbuffer in state.dbuffers():
        names = set(dbuffer.sharded_params)
        before = state.stats.all_gather_bytes
        dbuffer.unshard()
        sent = state.stats.all_gather_bytes - before
        for name, full in dbuffer.unsharded_params.items():
            if name in FP8_WEIGHTS:
                expected, full_scale = reference_fake_quant(masters[name], tile, dtype, torch.bfloat16)
                # the format's own bound: half an ulp of the mantissa, or of the smallest subnormal, then bf16
                finfo = torch.finfo(dtype)
                error = (full.float() - masters[name]).abs()
                limit = masters[name].abs() * (finfo.eps / 2 + 2.0**-8) + full_scale * finfo.smallest_normal
                result["bound"][name] = bool((error <= limit * 1.001).all())
            else:
                expected = masters[name].to(torch.bfloat16)
            result["exact"][name] = torch.equal(full.detach(), expected)
        if dbuffer.fp8_gather is not None:
            shards = [dbuffer.sharded_params[n].ragged_shard for n in names]
            result["cut"] |= {s.name for s in shards if s.cut_offsets()}
            per_rank = [sum(counts) for counts in zip(*(_tiles_on_ranks(s, tile) for s in shards))]
            segment = dbuffer.layout.segment_size
            formula = dbuffer.world_size * (math.ceil(segment / 4) * 4 + 4 * max(per_rank))
            result["bytes"].append((sent, formula, dbuffer.world_size * segment * 2))
            result["fp8_buffers"].append(names)
        else:
            result["plain_buffers"].append(names)
            result["bytes"].append((sent, dbuffer.world_size * dbuffer.layout.segment_size * 2, None))
        dbuffer.reshard()
    return result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_gathered_weights_equal_single_process_fake_quant(dist_pool, world_size, config):
    tile, dtype = CONFIGS[config]
    for result in dist_pool(world_size).run(check_gathered_weights, tile, dtype):
        assert all(result["exact"].values()), result["exact"]  # bitwise: no scale crosses ranks
        assert all(result["bound"].values()), result["bound"]
        assert set().union(*result["fp8_buffers"]) == FP8_WEIGHTS  # a DBuffer is all fp8 or none
        assert not any(names & FP8_WEIGHTS for names in result["plain_buffers"])
        assert result["cut"], "no fp8 weight was split across ranks: the check would prove nothing"
        for sent, expected, bf16 in result["bytes"]:
            assert sent == expected
            if bf16 is not None and tile == 128:
                assert sent / bf16 < 0.501  # fp8 bytes + a few fp32 scales: half of bf16


def test_layout_that_cuts_a_tile_is_refused():
    layout = lr.plan([TensorSpec("w", 24 * 5, 1)], 2, alignment=1)  # element granularity: cut at row 12
    with pytest.raises(lr.RaggedShardBoundaryViolation, match=r"RaggedShard boundary violation: fp8 weight 'w'"):
        Fp8Gather(layout, {"w": torch.Size([24, 5])}, 0, lr.Float8AllGather(tile=8), torch.device("cpu"))


# ------------------------------------------------------------------ training
def _fake_quant_step(model: nn.Module, names: set[str], tokens: torch.Tensor, tile: int) -> torch.Tensor:
    """Forward and backward at the fake-quantized weights (straight-through), the masters restored after."""
    params = dict(model.named_parameters())
    masters = {name: params[name].detach().clone() for name in names}
    with torch.no_grad():
        for name in names:
            params[name].copy_(reference_fake_quant(masters[name], tile, torch.float8_e4m3fn, torch.float32)[0])
    loss = lm_loss(model, tokens)
    loss.backward()
    with torch.no_grad():
        for name in names:
            params[name].copy_(masters[name])
    return loss.detach()


def check_training(tile: int) -> dict:
    """fp32 compute: fp8-gathered sharded training vs single-process fake-quant; bf16: fp8 vs plain gathers."""
    data = make_batches(STEPS, BATCH)
    config = lr.Float8AllGather(tile=tile)
    runs = {
        "fp8": lr.fully_shard(make_model(), fp8_all_gather=config),
        "fp8-bf16": lr.fully_shard(make_model(), fp8_all_gather=config, mp_policy=BF16),
        "bf16": lr.fully_shard(make_model(), mp_policy=BF16),
    }
    reference = make_model()
    fp8_names = {n for b in lr.get_state(runs["fp8"]).dbuffers() if b.fp8_gather is not None for n in b.sharded_params}
    optimizers = {key: torch.optim.AdamW(m.parameters(), lr=1e-2) for key, m in runs.items()}
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses = {key: [] for key in [*runs, "reference"]}
    for step in range(STEPS):
        for key, model in runs.items():
            loss = lm_loss(model, _local(data[step]))
            loss.backward()
            optimizers[key].step()
            optimizers[key].zero_grad()
            losses[key].append(loss.item())
        losses["reference"].append(_fake_quant_step(reference, fp8_names, data[step], tile).item())
        reference_opt.step()
        reference_opt.zero_grad()
    full = lr.full_state_dict(runs["fp8"])
    expected = reference.state_dict()
    return {
        "max_diff": max((full[k] - expected[k]).abs().max().item() for k in expected),
        "losses": losses,
        "fp8_names": fp8_names,
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_training_matches_single_process_fake_quant_and_tracks_bf16(dist_pool, world_size):
    results = dist_pool(world_size).run(check_training, 4)
    # the tied embedding/head stays out (an nn.Embedding owns it); every block Linear is in
    linears = ("qkv", "proj", "up", "down")
    assert results[0]["fp8_names"] == {f"blocks.{i}.{m}.weight" for i in range(2) for m in linears}
    assert max(r["max_diff"] for r in results) <= 1e-5, results[0]["max_diff"]  # as the fp32 parity tests
    mean = {key: [sum(r["losses"][key][i] for r in results) / len(results) for i in range(STEPS)]
            for key in results[0]["losses"]}
    assert max(abs(a - b) for a, b in zip(mean["fp8"], mean["reference"])) <= 1e-5, mean
    # bf16 compute: fp8 rounding (<= 2^-4 relative per weight) on top of bf16's (2^-8); the existing bf16-vs-fp32
    # check allows 0.05 on this model's loss (~3.6), so allow the same here
    gap = max(abs(a - b) for a, b in zip(mean["fp8-bf16"], mean["bf16"]))
    assert 1e-3 < gap < 0.05, mean  # fp8 visibly changed the weights, and only a little


def check_copy_metric(keep: bool) -> dict:
    """``engine_copy_bytes`` for one step: an fp8 gather writes its chunk and the dequantized full buffer, a
    plain bf16 gather one cast of the shard (block groups are gathered twice, the root once); with
    ``keep_cast_shard`` the backward re-gather reuses the forward's chunk or cast."""
    from lightning_ragged.observability.metrics import EngineMetrics

    model = lr.fully_shard(
        make_model(), fp8_all_gather=lr.Float8AllGather(tile=4), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        keep_cast_shard=keep,
    )
    metrics = EngineMetrics(model)
    lm_loss(model, _local(make_batches(1, BATCH)[0])).backward()
    metrics.end_step()
    value = metrics.compute()["ragged_fsdp/engine_copy_bytes"]
    metrics.close()
    expected = 0
    for group in lr.get_state(model).all_groups:
        gathers = 1 if group.is_root else 2
        made = 1 if keep else gathers
        for b in group.dbuffers:
            if b.fp8_gather is None:
                expected += made * b.layout.segment_size * 2
            else:
                expected += made * b.fp8_gather.rank_bytes + gathers * b.full_numel * 2
    return dict(value=value, expected=expected)


@pytest.mark.parametrize("keep", [False, True], ids=["fresh", "kept"])
def test_copy_metric_counts_fp8_quantize_and_dequantize(dist_pool, keep):
    for result in dist_pool(2).run(check_copy_metric, keep):
        assert result["value"] == result["expected"] > 0


# ------------------------------------------------------------------ CPU dequantization table
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_table_conversion_is_bitwise_torchs_cast_for_every_byte(dtype):
    """Oracle: ``.to(torch.float32)`` of each of the 256 bytes (NaN and inf encodings included), as bit patterns,
    through the same strided 4-D tile views the dequantization reads (partial tiles at both edges)."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    q = every.repeat(3)[: 27 * 28].view(27, 28).view(dtype)  # 756 bytes: every value, rows and cols not tile multiples
    table = float32_table(dtype)
    bits = lambda t: t.view(torch.int32)  # noqa: E731 (NaN != NaN: compare bit patterns)
    assert torch.equal(bits(to_float32(every.view(dtype), table)), bits(every.view(dtype).float()))
    strided = q[5:, 3:]  # not contiguous
    assert torch.equal(bits(to_float32(strided, table)), bits(strided.float()))
    tile = 8
    grid = tile_grid(q.shape, tile)
    scales = torch.rand(grid) + 0.5
    with_table = torch.empty(q.shape, dtype=torch.float32)
    with_cast = torch.empty(q.shape, dtype=torch.float32)
    dequantize_into(with_table, q, scales, tile, table)
    dequantize_into(with_cast, q, scales, tile)
    assert torch.equal(bits(with_table), bits(with_cast))
    assert torch.isnan(with_cast).any()  # the NaN encodings were part of it
    on_cpu = Fp8Gather(lr.plan([TensorSpec("w", 16, 16)], 1), {"w": torch.Size([4, 4])}, 0,
                       lr.Float8AllGather(tile=4, dtype=dtype), torch.device("cpu"))
    assert (on_cpu.table is not None) == (dtype == torch.float8_e4m3fn)  # measured: e5m2's cast is faster on CPU


# ------------------------------------------------------------------ kept chunk (keep=True)
class _Gathers:
    """Observer: all-gathers one DBuffer issued."""

    def __init__(self) -> None:
        self.count = 0

    def on_event(self, event) -> None:
        if event.kind is EventKind.UNSHARD_ISSUED and event.error is None:
            self.count += 1


def _train_and_count(keep: bool) -> dict:
    """Train with one block's fp8 weights frozen, an evaluation forward after each step, then one in-place write."""
    data = make_batches(STEPS, BATCH)
    config = lr.Float8AllGather(tile=4)
    model = make_model()
    for param in model.blocks[0].parameters():
        param.requires_grad_(False)
    model = lr.fully_shard(model, fp8_all_gather=config, mp_policy=BF16)
    counters = {}
    for b in lr.get_state(model).dbuffers():
        if b.fp8_gather is not None:
            shapes = {name: p.shape for name, p in b.unsharded_params.items()}
            b.fp8_gather = Fp8Gather(b.layout, shapes, b.rank, config, b.device, keep=keep)
            counters[b] = _Gathers()
            b.observers.append(counters[b])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = lm_loss(model, _local(data[step]))
        loss.backward()  # the block groups re-gather here
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            losses.append((loss.item(), lm_loss(model, _local(data[step])).item()))  # an evaluation forward
    modified = next(b for b in counters if b.trainable)
    with torch.no_grad():  # no optimizer step: the shard's version counter must invalidate the kept chunk
        next(iter(modified.sharded_params.values())).mul_(-2.0)
        losses.append(lm_loss(model, _local(data[0])).item())
    return {
        "losses": losses,
        "params": lr.full_state_dict(model),
        "counts": [(b.fp8_gather.quantizations, c.count, b.trainable, b is modified) for b, c in counters.items()],
    }


def check_kept_chunk() -> dict:
    """The same run with the quantized chunk kept (keep=True) and made at every gather (one after the other:
    any optimizer's step drops every kept chunk, as every kept cast)."""
    kept, fresh = _train_and_count(True), _train_and_count(False)
    return {
        "same": kept["losses"] == fresh["losses"]
        and all(torch.equal(kept["params"][n], fresh["params"][n]) for n in fresh["params"]),
        "kept": kept["counts"],
        "fresh": fresh["counts"],
    }


def test_kept_chunk_quantizes_once_per_step_and_trains_identically(dist_pool):
    for result in dist_pool(2).run(check_kept_chunk):
        assert result["same"]  # losses and parameters bitwise
        assert all(made == gathers for made, gathers, *_ in result["fresh"])  # keep=False: every gather quantizes
        assert {trainable for *_, trainable, _ in result["kept"]} == {True, False}  # frozen fp8 DBuffers are in it
        for made, gathers, _, modified in result["kept"]:
            # step 1's forward, then each step's evaluation forward (the optimizer step dropped the chunk; the
            # next forward and its backward re-gather reuse it), frozen ones too; + the in-place write
            assert made == STEPS + 1 + modified < gathers, result["kept"]


# ------------------------------------------------------------------ flight-recorder signatures
class _IssuedCollectives(TorchDispatchMode):
    """What the process group really receives: (collective, input elements, output elements) of each c10d op."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "allgather" in str(func).replace("_", ""):
            output, source = args[0], args[1]
            self.seen.append(("all_gather", source.numel(), output.numel()))
        return func(*args, **(kwargs or {}))


def check_signatures() -> dict:
    from lightning_ragged.observability import flight_recorder
    from lightning_ragged.observability.metrics import EngineMetrics

    # the flight recorder is NCCL's: the backend's all-gathers it records (gloo's CPU default sends point to point)
    model = lr.fully_shard(make_model(), fp8_all_gather=lr.Float8AllGather(tile=4), mp_policy=BF16,
                           gather_mode="all_gather")
    metrics = EngineMetrics(model)
    items = [(info.label, info.dbuffer) for probe in metrics.probes for info in probe.dbuffers]
    signatures = flight_recorder.collective_signatures(items)
    with _IssuedCollectives() as issued:
        lm_loss(model, _local(make_batches(1, BATCH)[0])).backward()
    metrics.close()
    plain_keys = {("all_gather", b.layout.segment_size, b.layout.buffer_numel) for _, b in items}
    return {
        "named": {key: signatures.get(key) for key in issued.seen},
        "fp8_labels": {label for label, b in items if b.fp8_gather is not None},
        "not_plain": {key for key in issued.seen if key not in plain_keys},
    }


def test_flight_recorder_signatures_name_the_fp8_gathers_the_engine_issues(dist_pool):
    for result in dist_pool(2).run(check_signatures):
        assert result["named"] and all(result["named"].values()), result["named"]  # every issued gather is named
        named = {label for names in result["named"].values() for label in names.split(" or ")}
        assert result["fp8_labels"] and result["fp8_labels"] <= named
        assert result["not_plain"]  # fp8 gathers' sizes are no layout's (segment, full): the old keys missed them


class SkipsABlock(nn.Module):
    """Three Linear blocks; ``skip`` leaves the middle one out of a forward (LayerDrop), after its prefetch."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))  # a group each
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            if not (self.skip and index == 1):
                x = block(x)
        return x.square().mean()


SKIPS = [False, True, False, False]


def check_skipped_block_is_not_stale() -> dict:
    """A block prefetched (its fp8 gather issued) but skipped must be gathered again after the optimizer step."""
    torch.manual_seed(0)
    reference = SkipsABlock()
    model = lr.fully_shard(copy.deepcopy(reference), fp8_all_gather=lr.Float8AllGather(tile=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=5e-2)
    names = {f"blocks.{i}.0.weight" for i in range(3)}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))  # the same batch on every rank
    pending_after_backward = []
    for skip in SKIPS:
        model.skip = reference.skip = skip
        model(x).backward()
        pending_after_backward.append(any(b.unshard_pending for b in lr.get_state(model).dbuffers()))
        optimizer.step()
        optimizer.zero_grad()
        if skip:  # the skipped block got no gradient, so no optimizer changed it: change it by hand (a weight load)
            with torch.no_grad():
                dict(model.named_parameters())["blocks.1.0.weight"].mul_(0.5)
                reference.blocks[1][0].weight.mul_(0.5)
        params = dict(reference.named_parameters())
        masters = {name: params[name].detach().clone() for name in names}
        with torch.no_grad():
            for name in names:
                params[name].copy_(reference_fake_quant(masters[name], 4, torch.float8_e4m3fn, torch.float32)[0])
        reference(x).backward()
        with torch.no_grad():
            for name in names:
                params[name].copy_(masters[name])
        reference_opt.step()
        reference_opt.zero_grad()
    full = lr.full_state_dict(model)
    return {
        "max_diff": max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items() if k in full),
        "pending_after_backward": pending_after_backward,
    }


def test_a_prefetched_block_that_did_not_run_is_gathered_again(dist_pool):
    for result in dist_pool(2).run(check_skipped_block_is_not_stale):
        assert result["pending_after_backward"] == [False] * len(SKIPS)  # no gather (nor its bytes) left to the step
        assert result["max_diff"] <= 1e-6


# ------------------------------------------------------------------ bad input
def check_bad_knob() -> str:
    try:
        lr.fully_shard(make_model(), fp8_all_gather="e4m3")
    except TypeError as error:
        return str(error)
    return "no error"


def test_bad_fp8_knobs_are_refused_early(dist_pool):
    assert "fp8_all_gather='e4m3' must be a lightning_ragged.Float8AllGather" in dist_pool(2).run(check_bad_knob)[0]
    with pytest.raises(ValueError, match=r"Float8AllGather\(tile=0\).*tile=128"):
        lr.Float8AllGather(tile=0)
    with pytest.raises(ValueError, match=r"Float8AllGather\(dtype=torch.bfloat16\) is not an fp8 format"):
        lr.Float8AllGather(dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"module_filter=3\) must be a callable"):
        lr.Float8AllGather(module_filter=3)
    assert lr.Float8AllGather(dtype="float8_e5m2").dtype is torch.float8_e5m2
    with pytest.raises(TypeError, match=r"RaggedFSDPStrategy\(fp8_all_gather=True\): .*Float8AllGather\(tile=128\)"):
        lr.RaggedFSDPStrategy(fp8_all_gather=True)
    strategy = lr.RaggedFSDPStrategy(fp8_all_gather=lr.Float8AllGather(tile=64))
    assert strategy._engine_kwargs["fp8_all_gather"] == lr.Float8AllGather(tile=64)  # forwarded to fully_shard


def check_fp8_parameter_starts_from_rank0() -> bool:
    """A frozen fp8 parameter beside fp32 ones (torch's ``test_mixed_dtypes_no_grad_param``): ``sync_module_states``
    gives every rank rank 0's bytes, and the rank-0 full state dict, its broadcast load and an fp8 buffer's
    broadcast carry them (before: gloo refused the dtype in each, "Invalid scalar type")."""
    torch.manual_seed(dist.get_rank())  # every rank its own values
    model = nn.Sequential(nn.Linear(8, 8))
    model.register_parameter("frozen", nn.Parameter(torch.randn(16, 8).to(torch.float8_e4m3fn), requires_grad=False))
    rank0 = model.frozen.detach().clone().view(torch.uint8)
    dist.broadcast(rank0, src=0)
    model.register_buffer("scale", torch.randn(4).to(torch.float8_e4m3fn))  # broadcast from rank 0 at each step
    lr.fully_shard(model)
    model(torch.randn(2, 8)).sum().backward()
    model(torch.randn(2, 8))
    full = lr.full_state_dict(model)["frozen"].view(torch.uint8)
    on_rank0 = lr.full_state_dict(model, rank0_only=True)  # dist.gather
    lr.load_full_state_dict(model, on_rank0, broadcast_from_rank0=True)  # a broadcast of each flat DBuffer
    again = lr.full_state_dict(model)["frozen"].view(torch.uint8)
    return torch.equal(full, rank0) and torch.equal(again, rank0) and (dist.get_rank() > 0 or torch.equal(
        on_rank0["frozen"].view(torch.uint8), rank0))


def test_an_fp8_parameter_starts_from_rank0s_bytes(dist_pool):
    assert dist_pool(2).run(check_fp8_parameter_starts_from_rank0) == [True, True]
