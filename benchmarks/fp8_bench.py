"""fp8 all-gather vs the plain bf16 all-gather: bytes on the wire, loss (2 seeds x 200 steps), step time (2 CPU ranks).

Run from the repository root::

    python benchmarks/fp8_bench.py               # 200 steps, 2 seeds x 2 variants (~5 min), rewrites the "fp8" section
    python benchmarks/fp8_bench.py --steps 20 --no-write   # smoke run

One launcher spawns 2 gloo ranks (one thread each). For each seed every rank builds the
benchmark GPT twice from that seed's init, both sharded by ``lightning_ragged.fully_shard``
with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (fp32 master shards),
one of them with ``fp8_all_gather=Float8AllGather(tile=128)`` (e4m3; the output head
excluded by ``module_filter``, as usual fp8 recipes keep it in bf16). Both train with AdamW
after the same linear warmup on that seed's batches (another seed: another init and other
data); every step runs all four, the two variants of a seed in an order that alternates.

Measured: all-gather bytes per step from the engine's ``CommStats`` (the output size of
every all-gather, as the plain path counts it), split into the fp8 DBuffers and the rest;
per seed the loss (fp32 cross-entropy of the bf16 logits, mean over ranks = the global
batch's) at steps 50/100/150/200 and the mean of the last 10 steps, and the fp8 - bf16 gap
averaged over the seeds; the median step time (zero_grad + forward + backward + step, the
slowest rank per step). Before the runs, in the launcher: fp8 -> fp32 conversion of a
1.2M-element buffer, torch's cast vs the dequantization's 256-entry table (median of repeats,
bit patterns compared for every byte value).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402

from models import GPTConfig, count_params, make_batches, make_gpt  # noqa: E402
from report import write_section  # noqa: E402

import lightning_ragged as lr  # noqa: E402
from lightning_ragged.engine.events import EventKind  # noqa: E402
from lightning_ragged.engine.fp8_gather import Fp8Gather, float32_table, tile_granularity, to_float32  # noqa: E402
from lightning_ragged.layout.spec import TensorSpec  # noqa: E402

WORLD_SIZE = 2
CFG = GPTConfig()
LR = 1e-3
WARMUP = 20
"""Steps of linear warmup to ``LR`` (both variants): without it the bf16 run spiked to 10.6 at step 11."""
TILE = 128
VARIANTS = ("bf16", "fp8")
SEEDS = (0, 1)
"""Seed s: the model initialized from seed s, the batches from seed s + 1 (another init and other data)."""
CHECKPOINTS = (50, 100, 150, 200)
PLATEAU_EXIT = 3.0
"""The loss first sits near 6 (the unigram), then drops to ~1.5 (the successor structure) at a step that varies
from run to run; a run's first step below this loss says when it left the plateau."""
CONVERSION_NUMEL = 1_200_000
CONVERSION_REPEATS = 50


class _Fp8Bytes:
    """Observer: bytes of every all-gather an fp8 DBuffer issues (its wire size)."""

    def __init__(self) -> None:
        self.nbytes = 0

    def on_event(self, event: Any) -> None:
        if event.kind is EventKind.UNSHARD_ISSUED and event.error is None:
            self.nbytes += event.dbuffer.fp8_gather.wire_bytes


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32 of the (bf16) logits: a bf16 loss near 4 moves in steps of 1/64."""
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build(variant: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, _Fp8Bytes]:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fp8 = lr.Float8AllGather(tile=TILE, module_filter=lambda fqn, module: fqn != "head") if variant == "fp8" else None
    model = lr.fully_shard(make_gpt(CFG, seed=seed), mp_policy=policy, fp8_all_gather=fp8)
    counter = _Fp8Bytes()
    for dbuffer in lr.get_state(model).dbuffers():
        if dbuffer.fp8_gather is not None:
            dbuffer.observers.append(counter)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))
    return model, optimizer, warmup, counter


def run_rank(rank: int, steps: int, batch: int) -> dict[str, Any]:
    batches = {seed: make_batches(steps, WORLD_SIZE * batch, CFG, seed=seed + 1) for seed in SEEDS}
    runs = {(seed, variant): build(variant, seed) for seed in SEEDS for variant in VARIANTS}
    keys = [f"{seed}/{variant}" for seed, variant in runs]
    losses: dict[str, list[float]] = {k: [] for k in keys}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    gathered = {v: [] for v in VARIANTS}
    fp8_bytes = {v: [] for v in VARIANTS}
    for step in range(steps):
        for seed in SEEDS:
            tokens = batches[seed][step, rank * batch : (rank + 1) * batch]
            for variant in VARIANTS if (step + seed) % 2 == 0 else VARIANTS[::-1]:
                model, optimizer, warmup, counter = runs[seed, variant]
                stats = lr.get_state(model).stats
                before, before_fp8 = stats.all_gather_bytes, counter.nbytes
                dist.barrier()
                started = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                loss = lm_loss(model, tokens)
                loss.backward()
                optimizer.step()
                elapsed = torch.tensor([time.perf_counter() - started, loss.item()], dtype=torch.float64)
                warmup.step()
                gathered[variant].append(stats.all_gather_bytes - before)
                fp8_bytes[variant].append(counter.nbytes - before_fp8)
                slowest = elapsed[:1].clone()
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                dist.all_reduce(elapsed[1:])
                times[variant].append(slowest.item())
                losses[f"{seed}/{variant}"].append(elapsed[1].item() / WORLD_SIZE)
    state = lr.get_state(runs[SEEDS[0], "fp8"][0])
    fp8_buffers = [b for b in state.dbuffers() if b.fp8_gather is not None]
    return {
        "losses": losses,
        "times": times,
        "all_gather_bytes": gathered,
        "fp8_buffer_bytes": fp8_bytes,
        "fp8_params": sum(p.ragged_shard.numel for b in fp8_buffers for p in b.sharded_params.values()),
        "fp8_bf16_equivalent": sum(b.world_size * b.layout.segment_size * 2 for b in fp8_buffers),
        "fp8_wire": sum(b.fp8_gather.wire_bytes for b in fp8_buffers),
        "fp8_dbuffers": len(fp8_buffers),
        "dbuffers": sum(1 for _ in state.dbuffers()),
    }


def _block_gather(dtype: torch.dtype) -> tuple[Fp8Gather, torch.Tensor, torch.Tensor]:
    """One benchmark block's Linear weights as a one-rank fp8 DBuffer: its gather, a quantized chunk, a full buffer."""
    block = make_gpt(CFG).blocks[0]
    weights = {name: m.weight for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    specs = [TensorSpec(n, w.numel(), tile_granularity(w.shape[1], w, TILE)) for n, w in weights.items()]
    layout = lr.plan(specs, 1)
    gather = Fp8Gather(layout, {n: w.shape for n, w in weights.items()}, 0, lr.Float8AllGather(TILE, dtype),
                       torch.device("cpu"))
    sharded = torch.zeros(layout.segment_size)
    for name, w in weights.items():
        sharded[layout.offsets[name] : layout.offsets[name] + w.numel()] = w.detach().reshape(-1)
    return gather, gather.quantize(sharded), torch.empty(layout.buffer_numel, dtype=torch.bfloat16)


def conversion_times() -> dict[str, dict[str, Any]]:
    """Per fp8 format, median ms (one thread) of torch's cast and of the table: converting a 1.2M-element buffer
    into a preallocated fp32 one (the table's int32 index included), and dequantizing one block's fp8 DBuffer
    as the wait does (its allocations included); whether the table gives the cast's bits for all 256 bytes."""
    torch.set_num_threads(1)
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    result = {}
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = torch.randn(CONVERSION_NUMEL, generator=torch.Generator().manual_seed(0)).to(dtype)
        table = float32_table(dtype)
        values, index = torch.empty(CONVERSION_NUMEL), torch.empty(CONVERSION_NUMEL, dtype=torch.int32)
        gather, chunk, full = _block_gather(dtype)
        own_choice = gather.table is not None

        def dequantize(with_table: bool) -> None:
            gather.table = table if with_table else None
            gather.dequantize(chunk, full)

        ways = {
            "cast": lambda: values.copy_(q),
            "table": lambda: torch.index_select(table, 0, index.copy_(q.view(torch.uint8)), out=values),
            "dequantize_cast": lambda: dequantize(False),
            "dequantize_table": lambda: dequantize(True),
        }
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(CONVERSION_REPEATS):  # interleaved, so a load change hits all alike
            for name, run in ways.items():
                started = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - started)
        bitwise = torch.equal(to_float32(every.view(dtype), table).view(torch.int32),
                              every.view(dtype).to(torch.float32).view(torch.int32))
        result[str(dtype).removeprefix("torch.")] = {
            **{name: statistics.median(times) * 1e3 for name, times in seconds.items()},
            "bitwise": bitwise, "block_numel": full.numel(), "engine_uses_table": own_choice,
        }
    return result


def worker(rank: int, init_file: str, steps: int, batch: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        result = run_rank(rank, steps, batch)
        if rank == 0:
            Path(out_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def launch(steps: int, batch: int) -> dict[str, Any]:
    conversion = conversion_times()
    with tempfile.TemporaryDirectory() as tmp:
        started, load = time.perf_counter(), os.getloadavg()[0]
        out_path = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(os.path.join(tmp, "pg"), steps, batch, out_path), nprocs=WORLD_SIZE, join=True)
        result = json.loads(Path(out_path).read_text())
    result.update(wall_s=time.perf_counter() - started, load=load, steps=steps, batch=batch, conversion=conversion)
    return result


def render(r: dict[str, Any]) -> str:
    steps, losses = r["steps"], r["losses"]
    per_step = {v: statistics.median(r["all_gather_bytes"][v]) for v in VARIANTS}
    fp8_step = statistics.median(r["fp8_buffer_bytes"]["fp8"])
    gathers_per_step = fp8_step / r["fp8_wire"]
    same_in_bf16 = gathers_per_step * r["fp8_bf16_equivalent"]
    rest = per_step["fp8"] - fp8_step
    median = {v: statistics.median(r["times"][v][len(SEEDS):] or r["times"][v]) * 1e3 for v in VARIANTS}
    marks = [s for s in CHECKPOINTS if s <= steps] or [steps]
    loss = lambda seed, variant, step: losses[f"{seed}/{variant}"][step - 1]  # noqa: E731
    last = lambda seed, variant: statistics.mean(losses[f"{seed}/{variant}"][-10:])  # noqa: E731
    peak = {k: max((value, step + 1) for step, value in enumerate(v) if step > 0) for k, v in losses.items()}
    mib = lambda n: f"{n / 2**20:,.2f}"  # noqa: E731
    conversion = r["conversion"]

    def spread(key: str) -> float:
        return statistics.stdev(losses[key][-30:]) if len(losses[key]) > 2 else 0.0

    def first_below(key: str) -> str:
        return next((str(step + 1) for step, value in enumerate(losses[key]) if value < PLATEAU_EXIT), "never")

    def loss_row(title: str, value: Any) -> str:
        cells = [f"{value(s, 'bf16'):.4f} / {value(s, 'fp8'):.4f} ({value(s, 'fp8') - value(s, 'bf16'):+.4f})"
                 for s in SEEDS]
        mean_gap = statistics.mean(value(seed, "fp8") - value(seed, "bf16") for seed in SEEDS)
        return f"| {title} | " + " | ".join(cells) + f" | {mean_gap:+.4f} |"

    lines = [
        "## fp8 all-gather vs bf16 all-gather (W=2 CPU ranks, gloo)",
        "",
        "Written by `benchmarks/fp8_bench.py`.",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs (shared), Python {platform.python_version()}, "
        f"torch {torch.__version__}; 1-minute load average at the start {r['load']:.2f}; "
        f"wall time {r['wall_s']:.0f} s.",
        f"Model: `benchmarks/models.py` GPT ({CFG.layers} blocks, vocab {CFG.vocab}, width {CFG.width}, "
        f"{CFG.heads} heads, seq {CFG.seq}, untied head), {count_params(make_gpt(CFG)) / 1e6:.1f}M parameters; "
        f"{r['batch']} sequences per rank; AdamW(lr={LR}) after a {WARMUP}-step linear warmup; {steps} steps. "
        f"{len(SEEDS)} seeds: seed s initializes the model from seed s and draws the batches from seed s + 1 (another "
        "init and another token permutation); per seed both variants start from the same init and see the same "
        "batches. Both runs: "
        "`fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))`; "
        f"fp8 adds `fp8_all_gather=Float8AllGather(tile={TILE}, module_filter=lambda fqn, m: fqn != 'head')` "
        f"(e4m3, one fp32 scale per {TILE}x{TILE} tile): {r['fp8_params'] / 1e6:.2f}M parameters (every block's "
        f"Linear weights) in {r['fp8_dbuffers']} fp8 DBuffers of {r['dbuffers']}; embeddings, norms, biases and the "
        "head keep the bf16 all-gather. CPU: fp8 is emulated (gathered as uint8).",
        "",
        "| | bf16 all-gather | fp8 all-gather | fp8 / bf16 |",
        "|---|---:|---:|---:|",
        f"| all-gather MiB per step, total | {mib(per_step['bf16'])} | {mib(per_step['fp8'])} | "
        f"{per_step['fp8'] / per_step['bf16']:.3f}x |",
        f"| of it, the fp8 DBuffers (each gathered {gathers_per_step:.0f}x per step) | {mib(same_in_bf16)} (same "
        f"DBuffers in bf16) | {mib(fp8_step)} | {fp8_step / same_in_bf16:.4f}x |",
        f"| of it, the rest (bf16 in both) | {mib(per_step['bf16'] - same_in_bf16)} | {mib(rest)} | |",
        f"| median step ms (CPU, emulated fp8; both seeds) | {median['bf16']:,.0f} | {median['fp8']:,.0f} | "
        f"{median['fp8'] / median['bf16']:.2f}x |",
        "",
        "Loss, bf16 / fp8 (gap fp8 - bf16) per seed, and the gap averaged over the seeds:",
        "",
        "| | " + " | ".join(f"seed {seed}" for seed in SEEDS) + " | mean gap |",
        "|---|" + "---:|" * (len(SEEDS) + 1),
        *[loss_row(f"loss at step {mark}", lambda seed, variant, m=mark: loss(seed, variant, m)) for mark in marks],
        loss_row("mean loss, last 10 steps", last),
        "| loss standard deviation over the last 30 steps (bf16 / fp8) | "
        + " | ".join(f"{spread(f'{seed}/bf16'):.3f} / {spread(f'{seed}/fp8'):.3f}" for seed in SEEDS) + " | |",
        f"| first step with loss < {PLATEAU_EXIT:g} (bf16 / fp8) | "
        + " | ".join(f"{first_below(f'{seed}/bf16')} / {first_below(f'{seed}/fp8')}" for seed in SEEDS) + " | |",
        "| highest loss after step 1 (bf16 / fp8) | "
        + " | ".join(f"{peak[f'{seed}/bf16'][0]:.2f} (step {peak[f'{seed}/bf16'][1]}) / "
                     f"{peak[f'{seed}/fp8'][0]:.2f} (step {peak[f'{seed}/fp8'][1]})" for seed in SEEDS)
        + " | |",
        "",
        f"fp8 -> fp32 on CPU (launcher, one thread, median of {CONVERSION_REPEATS}, interleaved): torch's cast vs "
        "the 256-entry table (`index_select` of the bytes as int32), converting "
        f"{CONVERSION_NUMEL:,} elements into a preallocated fp32 buffer, and dequantizing one block's fp8 DBuffer "
        f"({next(iter(conversion.values()))['block_numel']:,} elements, tile {TILE}) into bf16 as the wait does:",
        "",
        "| format | convert: cast ms | table ms | table / cast | dequantize: cast ms | table ms | table / cast "
        "| table = cast bitwise, all 256 bytes | engine uses |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
        *[f"| {name} | {c['cast']:.3f} | {c['table']:.3f} | {c['table'] / c['cast']:.2f}x | "
          f"{c['dequantize_cast']:.3f} | {c['dequantize_table']:.3f} | "
          f"{c['dequantize_table'] / c['dequantize_cast']:.2f}x | {c['bitwise']} | "
          f"{'table' if c['engine_uses_table'] else 'cast'} |"
          for name, c in conversion.items()],
        "",
        "How it is measured:",
        "- bytes: `CommStats.all_gather_bytes` per step (the output of every all-gather: m x S x 2 bytes for a bf16 "
        "DBuffer; m x (S rounded up to 4 + 4 x the most tiles one rank holds) bytes for an fp8 one, one collective "
        "carrying the fp8 bytes and the scales), median over the steps; the fp8 DBuffers' share from an observer "
        "on them; 'same DBuffers in bf16' = their m x S x 2 bytes per gather. The exact formula is checked in "
        "`tests/test_fp8_gather.py`.",
        "- loss: each step's loss (fp32 cross-entropy of the bf16 logits) averaged over the 2 ranks (= the global "
        "batch's mean loss); the gap is fp8 minus bf16 on the same seed. The two variants round differently from "
        "step 1 on. On this task the loss sits on a plateau near 6, then falls within a few tens of steps to "
        "~1.5, and the step at which a run leaves the plateau varies from run to run (the 'first step with loss "
        f"< {PLATEAU_EXIT:g}' row): a gap at a fixed step between runs on either side of that drop measures the "
        "timing of the drop, not fp8. Where both runs of a seed have dropped, the gap is fp8's effect on the "
        "trained loss plus batch-to-batch noise (the standard deviation row; a 10-step mean has about a third of "
        "it).",
        "- step time: zero_grad + forward + backward + `optimizer.step()`, per step the slowest rank, median over "
        "steps 2.. of both seeds; the variants alternate their order every step. On CPU the fp8 path's extra work "
        "(per-tile amax, quantize, dequantize, emulated; e4m3 bytes become fp32 through the table) is not offset by "
        "cheaper communication between 2 processes on one machine; GPU speed (and `torch._scaled_mm`, not used: "
        "the weights are dequantized to bf16) is not measured here.",
        "- conversion: the table is adopted where it is faster (CPU, e4m3) and only because it gives the cast's "
        "bits for every byte (NaN encodings included; checked here and in `tests/test_fp8_gather.py`); e5m2 and "
        "accelerators keep the plain cast.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=3, help="sequences per rank")
    parser.add_argument("--no-write", action="store_true", help="print the section, leave RESULTS.md alone")
    parser.add_argument("--json", help="also dump the raw results to this file")
    args = parser.parse_args()
    result = launch(args.steps, args.batch)
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    markdown = render(result)
    print(markdown)
    if not args.no_write:
        write_section("fp8", markdown, ROOT / "benchmarks" / "RESULTS.md")


if __name__ == "__main__":
    main()
