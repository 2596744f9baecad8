"""Peak live tensor bytes and step time: lightning_ragged vs FSDP2 vs DDP at W=2 and W=4, fp32 and bf16.

Run from the repository root::

    python benchmarks/memory_bench.py              # full run (~6 min), rewrites the "memory" section of RESULTS.md
    python benchmarks/memory_bench.py --quick      # smoke run (still writes unless --no-write)
    python benchmarks/memory_bench.py --configs 2:fp32,4:bf16 --no-write

Each configuration (world size, precision) is its own process tree of W gloo ranks (one
thread each). Every rank first times the three frameworks side by side (all persistent,
same seed, same batches, rounds alternating their order), then measures each one's
memory in a fresh model under ``live_memory.LiveStorageTracker``, active from before the
model is built: the live bytes at rest and the peak during a steady-state step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402

from live_memory import LiveStorageTracker, storages_of  # noqa: E402
from models import GPTConfig, count_params, lm_loss, make_batches, make_gpt  # noqa: E402
from report import write_section  # noqa: E402

FRAMEWORKS = ("ragged", "fsdp2", "ddp")
LABELS = {"ragged": "lightning_ragged `fully_shard`", "fsdp2": "FSDP2 `fully_shard`", "ddp": "DDP"}
CFG = GPTConfig(layers=8)  # ~20.5M parameters
LR = 1e-3
PEAK_TARGET = 0.9  # issue 12: ragged peak <= 0.9x FSDP2's
DDP_TARGET = 1.0  # issue 12: ragged step <= 1.0x DDP's (fp32)
FSDP2_TARGET = 0.75  # issue 12: ragged step <= 0.75x FSDP2's
MEASURED_STEP = 2  # steps 0 and 1 create the optimizer state and settle the buffers


# --------------------------------------------------------------------------- frameworks
def build(name: str, precision: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One framework's model (fp32 master weights) and AdamW; bf16 = each framework's own mixed precision."""
    model = make_gpt(CFG, seed)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else None
    if name == "ragged":
        import lightning_ragged

        lightning_ragged.fully_shard(model, mp_policy=policy)
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mp_policy=policy or MixedPrecisionPolicy())
        fully_shard(model, mp_policy=policy or MixedPrecisionPolicy())
    elif name == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        raise ValueError(name)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def autocast(name: str, precision: str) -> contextlib.AbstractContextManager:
    """DDP's mixed precision is torch.amp: fp32 parameters, bf16 autocast over forward and loss."""
    if name == "ddp" and precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def local_batch(batches: torch.Tensor, step: int, rank: int, world: int) -> torch.Tensor:
    per_rank = batches.shape[1] // world
    return batches[step, rank * per_rank : (rank + 1) * per_rank]


def train_step(
    name: str, precision: str, model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
    tracker: LiveStorageTracker | None = None,
) -> float:
    """One AdamW step (zero_grad, forward, backward, step); with a tracker, marks the phases and the rest point."""
    mark = (lambda phase: setattr(tracker, "phase", phase)) if tracker is not None else (lambda phase: None)
    mark("zero_grad")
    optimizer.zero_grad(set_to_none=True)
    if tracker is not None:
        tracker.mark("rest")
    mark("forward")
    with autocast(name, precision):
        loss = lm_loss(model, tokens)
    mark("backward")
    loss.backward()
    mark("optimizer")
    optimizer.step()
    return loss.item()


# --------------------------------------------------------------------------- time
def timed_rounds(rank: int, world: int, precision: str, batches: torch.Tensor, opts: dict[str, Any]) -> dict[str, Any]:
    """All three persistent; warm-up each, then rounds of ``steps`` timed steps each, order rotated per round."""
    frameworks = {name: build(name, precision) for name in FRAMEWORKS}
    step_index = dict.fromkeys(FRAMEWORKS, 0)
    losses: dict[str, list[float]] = {name: [] for name in FRAMEWORKS}
    times: dict[str, list[float]] = {name: [] for name in FRAMEWORKS}

    def run(name: str, count: int, timed: bool) -> None:
        model, optimizer = frameworks[name]
        dist.barrier()
        for _ in range(count):
            tokens = local_batch(batches, step_index[name], rank, world)
            started = time.perf_counter()
            losses[name].append(train_step(name, precision, model, optimizer, tokens))
            if timed:
                times[name].append(time.perf_counter() - started)
            step_index[name] += 1

    for name in FRAMEWORKS:
        run(name, opts["warmup"], timed=False)
    for round_index in range(opts["rounds"]):
        shift = round_index % len(FRAMEWORKS)
        for name in FRAMEWORKS[shift:] + FRAMEWORKS[:shift]:
            run(name, opts["steps"], timed=True)
    del frameworks
    gc.collect()
    return {"losses": losses, "times": times}


# --------------------------------------------------------------------------- memory
def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors by their local tensor)."""
    return sum({s._cdata: s.nbytes() for tensor in tensors for s in storages_of(tensor)}.values())


def memory_pass(
    name: str, rank: int, world: int, precision: str, batches: torch.Tensor,
    held: Callable[[nn.Module], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Live bytes of a fresh model at rest and at the peak of step ``MEASURED_STEP``, tracked from before the build.

    ``held(model)``, if given, is read at the peak (bytes the framework holds there, by kind): ``result["held"]``.
    """
    gc.collect()
    tracker = LiveStorageTracker()
    tracker.ignore(batches)
    with tracker:
        model, optimizer = build(name, precision)
        built = tracker.current()
        for step in range(MEASURED_STEP):
            train_step(name, precision, model, optimizer, local_batch(batches, step, rank, world))
        tokens = local_batch(batches, MEASURED_STEP, rank, world)
        if held is not None:
            tracker.on_peak = lambda: held(model)
        with tracker.window():
            train_step(name, precision, model, optimizer, tokens, tracker)
        params = storage_bytes(model.parameters())
        state = storage_bytes(t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
        result = {
            "built_bytes": built, "rest_bytes": tracker.marks["rest"], "peak_bytes": tracker.peak, "peak_at": tracker.peak_at,
            "peak_carried_bytes": tracker.peak_carried,
            "param_bytes": params, "optimizer_state_bytes": state, "held": tracker.peak_detail,
        }
    del model, optimizer, tracker
    gc.collect()
    return result


# --------------------------------------------------------------------------- ranks
def run_rank(rank: int, world: int, precision: str, opts: dict[str, Any]) -> dict[str, Any]:
    total = opts["warmup"] + opts["rounds"] * opts["steps"]
    batches = make_batches(max(total, MEASURED_STEP + 1), world * opts["batch"], CFG)
    started = time.perf_counter()
    timed = timed_rounds(rank, world, precision, batches, opts)
    middle = time.perf_counter()
    memory = {name: memory_pass(name, rank, world, precision, batches) for name in FRAMEWORKS}
    phases = {"timing_s": middle - started, "memory_s": time.perf_counter() - middle}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"times": timed["times"], "losses": timed["losses"], "memory": memory})
    return {
        "times": [g["times"] for g in gathered],
        "losses": {name: [sum(g["losses"][name][i] for g in gathered) / world for i in range(total)]
                   for name in FRAMEWORKS},
        "memory": [g["memory"] for g in gathered],
        **phases,
    }


def worker(rank: int, world: int, precision: str, init_file: str, opts: dict[str, Any], out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    result = run_rank(rank, world, precision, opts)
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()
    os._exit(0)  # the result is written; skip interpreter teardown, where gloo's threads can abort (pytorch#190489)


@contextlib.contextmanager
def load_sampler() -> Iterator[list[float]]:
    """The 1-minute load average at the start and every 5 s meanwhile (the machine is shared)."""
    samples = [os.getloadavg()[0]]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(5.0):
            samples.append(os.getloadavg()[0])

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()


def launch(world: int, precision: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One process tree of ``world`` ranks for one configuration; rank 0's gathered result plus its wall time and load."""
    with load_sampler() as samples, tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        out_path = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(world, precision, os.path.join(tmp, "pg"), opts, out_path), nprocs=world, join=True)
        result = json.loads(Path(out_path).read_text())
        result["wall_s"] = time.perf_counter() - started
        result["load"] = list(samples)
    result.update(world=world, precision=precision, opts=opts)
    return result


# --------------------------------------------------------------------------- report
def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f}"


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per framework: median step (slowest rank per step), per-round ratios to FSDP2 and DDP, memory maxima over ranks."""
    steps = result["opts"]["steps"]
    slowest = {name: [max(per_rank) for per_rank in zip(*(r[name] for r in result["times"]))] for name in FRAMEWORKS}
    rounds = {name: [statistics.median(slowest[name][i : i + steps]) for i in range(0, len(slowest[name]), steps)]
              for name in FRAMEWORKS}
    summary: dict[str, Any] = {}
    for name in FRAMEWORKS:
        ratio = {peer: [a / b for a, b in zip(rounds[name], rounds[peer])] for peer in ("fsdp2", "ddp")}
        memory = [rank_memory[name] for rank_memory in result["memory"]]
        summary[name] = {
            "median_ms": statistics.median(slowest[name]) * 1e3,
            "round_ms": [t * 1e3 for t in rounds[name]],
            "vs": {peer: (statistics.median(r), min(r), max(r)) for peer, r in ratio.items()},
            "peak": max(m["peak_bytes"] for m in memory),
            "rest": max(m["rest_bytes"] for m in memory),
            "peaks": [m["peak_bytes"] for m in memory],
            "peak_at": memory[top := max(range(len(memory)), key=lambda i: memory[i]["peak_bytes"])]["peak_at"],
            "peak_carried": memory[top]["peak_carried_bytes"],
            "params": max(m["param_bytes"] for m in memory),
            "state": max(m["optimizer_state_bytes"] for m in memory),
            "loss_diff_ddp": max(abs(a - b) for a, b in zip(result["losses"][name], result["losses"]["ddp"])),
        }
    return summary


def verdict(value: float, target: float) -> str:
    return f"{value:.2f}x ({'met' if value <= target else 'not met'})"


def render(results: list[dict[str, Any]], quick: bool) -> str:
    summaries = [summarize(r) for r in results]
    load = [x for r in results for x in r["load"]]
    wall = sum(r["wall_s"] for r in results)
    opts_line = "; ".join(
        f"W={r['world']} {r['precision']}: {r['opts']['warmup']} warm-up + {r['opts']['rounds']} rounds x "
        f"{r['opts']['steps']} steps" for r in results
    )
    lines = [
        "## Memory and step time: lightning_ragged vs FSDP2 vs DDP (W=2 and W=4 CPU ranks, gloo, fp32 and bf16)",
        "",
        "Written by `benchmarks/memory_bench.py`" + (" (`--quick` smoke run: too few steps to trust)" if quick else "") + ".",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs (shared with other jobs), Python "
        f"{platform.python_version()}, torch {torch.__version__}. 1-minute load average at the start {load[0]:.2f}, "
        f"sampled every 5 s: min {min(load):.2f}, mean {statistics.mean(load):.2f}, max {max(load):.2f} (the benchmark "
        f"itself contributes ~W); wall time {wall:.0f} s. W=4 runs 4 processes on the 2 cores (one thread each), so "
        "its step times are ~2x inflated by time-sharing; compare frameworks within a row, not W=2 with W=4.",
        f"Model: `benchmarks/models.py` GPT with 8 blocks (vocab {CFG.vocab}, width {CFG.width}, {CFG.heads} heads, "
        f"seq {CFG.seq}, untied head), {count_params(make_gpt(CFG)) / 1e6:.1f}M parameters, fp32 master weights; "
        f"batch {results[0]['opts']['batch']} sequences per rank; AdamW(lr={LR}) defaults (CPU: single-tensor).",
        "Frameworks: lightning_ragged `fully_shard(model)` defaults; FSDP2 `fully_shard` on each block then the root "
        "(defaults: reshard after forward, the root kept); DDP defaults. bf16 = each framework's own mixed precision: "
        "`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` for both FSDPs (bf16 all-gathers and compute, fp32 "
        "gradient reduction and sharded gradients); DDP with fp32 parameters and `torch.autocast('cpu', bf16)` over "
        "forward and loss (torch.amp, what DDP users run; DDP's `_MixedPrecision` is experimental and stream-based). "
        "The two FSDPs compute everything in bf16, autocast keeps LayerNorm, softmax and the loss in fp32.",
        f"Schedule per configuration (its own process tree): {opts_line}; timed steps alternate the three frameworks' "
        "order every round. Then one memory pass per framework (fresh model, same batches).",
        "",
        "| W | precision | framework | peak live MiB/rank | of it, live before the step / new | peak during | "
        "at rest MiB | params | AdamW state | other kept | peak vs FSDP2 | median step ms | "
        "vs FSDP2 (per-round median, min-max) | vs DDP (per-round median, min-max) |",
        "|---:|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, s in zip(results, summaries):
        for name in FRAMEWORKS:
            x = s[name]
            vs_f, vs_d = x["vs"]["fsdp2"], x["vs"]["ddp"]
            lines.append(
                f"| {r['world']} | {r['precision']} | {LABELS[name]} | {mib(x['peak'])} | {mib(x['peak_carried'])} / "
                f"{mib(x['peak'] - x['peak_carried'])} | `{x['peak_at']}` | {mib(x['rest'])} | {mib(x['params'])} | "
                f"{mib(x['state'])} | {mib(x['rest'] - x['params'] - x['state'])} | {x['peak'] / s['fsdp2']['peak']:.2f}x | "
                f"{x['median_ms']:,.0f} | {vs_f[0]:.2f}x ({vs_f[1]:.2f}-{vs_f[2]:.2f}) | "
                f"{vs_d[0]:.2f}x ({vs_d[1]:.2f}-{vs_d[2]:.2f}) |"
            )
    lines += [
        "",
        "Issue 12's targets, as measured (lightning_ragged over its peer, per configuration):",
        "",
        "| W | precision | peak / FSDP2's (target <= 0.9x) | step / FSDP2's (target <= 0.75x) | step / DDP's (target <= 1.0x, fp32) |",
        "|---:|---|---:|---:|---:|",
    ]
    for r, s in zip(results, summaries):
        x = s["ragged"]
        ddp = verdict(x["vs"]["ddp"][0], DDP_TARGET) if r["precision"] == "fp32" else f"{x['vs']['ddp'][0]:.2f}x (no target)"
        lines.append(
            f"| {r['world']} | {r['precision']} | {verdict(x['peak'] / s['fsdp2']['peak'], PEAK_TARGET)} | "
            f"{verdict(x['vs']['fsdp2'][0], FSDP2_TARGET)} | {ddp} |"
        )
    lines += [
        "",
        "How each column is measured:",
        "- peak live / at rest: bytes of live tensor storages on each rank, counted by `benchmarks/live_memory.py`'s "
        "`LiveStorageTracker`, a `TorchDispatchMode` active from before the model is built: it registers the untyped "
        "storage of every tensor any dispatched operator takes or produces (factories, FSDP2's all-gather outputs and "
        "copy-in buffers, our DBuffers, DDP's buckets, autograd's saved tensors, optimizer state; DTensors unwrapped to "
        "their local tensors), once per storage (views counted once), and forgets it in a weakref callback when its "
        "last reference dies; sizes are read again at every count because both FSDPs free and re-allocate buffers with "
        "`untyped_storage().resize_`. Peak: the maximum of the live sum after every operator of step "
        f"{MEASURED_STEP + 1} (steady state: AdamW state exists), max over ranks (per rank: "
        + "; ".join(f"W={r['world']} {r['precision']} " + ", ".join(f"{n} " + "/".join(mib(p) for p in s[n]["peaks"])
                                                                        for n in FRAMEWORKS)
                    for r, s in zip(results, summaries))
        + "); \"peak during\" names the phase and operator after which it was reached; \"live before the step\": the "
        "part of the peak in storages already live when the step began (parameters, AdamW state, kept buffers, also "
        "when re-grown by `resize_`), \"new\": storages born during the step (activations, gradients, temporaries). "
        "At rest: right after `zero_grad(set_to_none=True)` of that step. params / AdamW state: the distinct storages "
        "behind `model.parameters()` (for lightning_ragged the DBuffers' sharded segments) and behind "
        "`optimizer.state`; other kept = at rest minus both (buffers a framework keeps between steps: DDP's gradient "
        "buckets, any gradient buffers kept after `zero_grad`). The token batches are excluded (the same for all). "
        "Checked on a hand-counted case in `tests/test_live_memory.py` (exact bytes for plain tensors, views, "
        "`resize_`, forward+backward; FSDP2's unsharded parameters and our unsharded DBuffers seen during forward). "
        "Not seen: allocations no dispatched operator touches (gloo's internal copies on its own threads, e.g. its "
        "reduce-scatter's scratch, which favours FSDP2), and allocator caching/fragmentation. Seen: the scratch of "
        "lightning_ragged's pairwise reduction on gloo ((W-1)/W of the reducing DBuffer's gradient buffer while it "
        "is in flight, a tensor of ours): where a peak falls while a reduction is in flight, that scratch is in it "
        "(RESULTS \"memory-floor\" measures the peak against `reduce_mode=\"all_reduce\"`, which trades the "
        "scratch back for twice the reduction's bytes).",
        "- step: wall time of zero_grad + forward + backward + `optimizer.step()`, per step the slowest rank, median over "
        "the timed steps. Ratios: per round, the framework's median step over the peer's in the same round (they ran "
        "back to back), then the median over rounds, with the min-max over rounds as the spread. Per-round medians (ms): "
        + "; ".join(f"W={r['world']} {r['precision']}: " + ", ".join(
            f"{n} " + "/".join(f"{t:,.0f}" for t in s[n]["round_ms"]) for n in FRAMEWORKS)
            for r, s in zip(results, summaries))
        + ".",
        "- losses (mean over ranks, every step): max abs difference vs DDP: "
        + "; ".join(f"W={r['world']} {r['precision']}: ragged {s['ragged']['loss_diff_ddp']:.1e}, fsdp2 "
                    f"{s['fsdp2']['loss_diff_ddp']:.1e}" for r, s in zip(results, summaries))
        + " (bf16: different numerics, see above).",
    ]
    return "\n".join(lines)


CONFIGS = ("2:fp32", "2:bf16", "4:fp32", "4:bf16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 warm-up, 2 rounds x 1 step")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated WORLD:PRECISION (fp32 or bf16)")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds at W=2 (larger W run half as many)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per framework per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per framework first")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--no-write", action="store_true", help="print the section, leave RESULTS.md alone")
    parser.add_argument("--json", help="also dump the raw results to this file")
    args = parser.parse_args()
    results = []
    for config in args.configs.split(","):
        world_text, _, precision = config.partition(":")
        if not world_text.isdigit() or int(world_text) < 2 or precision not in ("fp32", "bf16"):
            raise SystemExit(f"--configs entry {config!r} must be WORLD:PRECISION with WORLD >= 2 and fp32 or bf16, e.g. 4:bf16")
        world = int(world_text)
        rounds = args.rounds if world <= 2 else max(3, args.rounds // 2)  # 4 ranks on 2 cores: fewer, slower steps
        opts = {"warmup": 1, "rounds": 2, "steps": 1} if args.quick else {"warmup": args.warmup, "rounds": rounds, "steps": args.steps}
        opts["batch"] = args.batch
        print(f"[memory] W={world} {precision}: {opts}", flush=True)
        results.append(launch(world, precision, opts))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    markdown = render(results, args.quick)
    print(markdown)
    if not args.no_write:
        write_section("memory", markdown, ROOT / "benchmarks" / "RESULTS.md")


if __name__ == "__main__":
    main()
