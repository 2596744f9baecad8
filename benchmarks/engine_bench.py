"""Train one GPT-style model with lightning_ragged, FSDP2 and DDP on 2 CPU ranks, side by side.

Run from the repository root::

    python benchmarks/engine_bench.py            # full run, rewrites the "engine" section of RESULTS.md
    python benchmarks/engine_bench.py --quick    # short smoke run (still writes unless --no-write)

One launcher spawns 2 gloo ranks (``torch.multiprocessing.spawn``, one thread each). Every
rank builds the three frameworks from the same seed, warms each up, then runs
``rounds`` rounds; in each round every framework runs ``steps`` timed AdamW steps, and
the order rotates from round to round so no framework always runs first or last. All
three see the same batches (global batch split over the ranks), so their loss
trajectories must agree.

Besides step time the script measures, each in its own pass after the timed rounds:

* copy bytes per step: a ``CopyCounter`` (``TorchDispatchMode``) around forward+backward,
  minus the same count for the plain single-process model (the model's own copies), i.e.
  the copies the engine itself adds;
* collectives per step: the ``c10d::`` operators seen by the same dispatch mode (count and
  bytes of the full-size buffer each one moves: all-gather output, reduce input);
* peak memory per rank: every CPU-allocator allocation and free recorded by
  ``torch.profiler`` (``profile_memory=True``) from before the model is built, so the
  running sum is the bytes of live tensors; we report it at rest between steps
  (parameters, gradients, optimizer state, engine buffers) and its peak during a
  steady-state step (adds activations, unsharded parameters and gradients, temporaries).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from models import GPTConfig, count_params, lm_loss, make_batches, make_gpt  # noqa: E402
from report import write_section  # noqa: E402

from lightning_ragged.observability.copy_counter import COPY_OPS, CopyCounter  # noqa: E402

FRAMEWORKS = ("ragged", "fsdp2", "ddp")
WORLD_SIZE = 2
LR = 1e-3
TARGET_RATIO = 0.9  # issue 2: ragged step time <= 0.9x FSDP2's


# --------------------------------------------------------------------------- frameworks
ModelFactory = Callable[[GPTConfig, int], nn.Module]
"""``(cfg, seed) -> model``: the unwrapped model every framework starts from (``make_gpt`` here)."""


def build(
    name: str, cfg: GPTConfig, seed: int = 0, make_model: ModelFactory = make_gpt
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model wrapped by one framework, and a plain AdamW over the trainable parameters it exposes."""
    model = make_model(cfg, seed)
    if name == "ragged":
        import lightning_ragged

        lightning_ragged.fully_shard(model)  # defaults: per-block groups, row granularity, optimal planner
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif name == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif name != "local":
        raise ValueError(name)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def local_batch(batches: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    per_rank = batches.shape[1] // WORLD_SIZE
    return batches[step, rank * per_rank : (rank + 1) * per_rank]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> tuple[float, float, float]:
    """One AdamW step; returns (local loss, forward+backward seconds, optimizer seconds)."""
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(model, tokens)
    loss.backward()
    middle = time.perf_counter()
    optimizer.step()
    return loss.item(), middle - started, time.perf_counter() - middle


# --------------------------------------------------------------------------- counting
class CopyAndCommCounter(CopyCounter):
    """``CopyCounter`` that also counts ``c10d::`` collectives (and the bytes of their full-size buffer)."""

    NOT_COLLECTIVES = ("c10d::wait", "c10d::barrier", "c10d::monitored_barrier_")
    # Not copies, but they move as many bytes as one: zeroing a flat gradient buffer and
    # autograd accumulating into a pre-set ``.grad`` view (``add_``) instead of stealing it.
    FLAT_TRAFFIC_OPS = ("aten::fill_", "aten::zero_", "aten::add_")

    def __init__(self) -> None:
        super().__init__()
        self.collectives: Counter[str] = Counter()
        self.collective_bytes: Counter[str] = Counter()
        self.traffic_bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = func._schema.name
        if name in self.FLAT_TRAFFIC_OPS:
            self.traffic_bytes[name] += _tensor_bytes(args[0])
        if name.startswith("c10d::") and not name.startswith(self.NOT_COLLECTIVES):
            sizes = [_tensor_bytes(arg) for arg in args[:2]]
            self.collectives[name] += 1
            self.collective_bytes[name] += max(sizes)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def count_pass(
    name: str, cfg: GPTConfig, batches: torch.Tensor, rank: int, make_model: ModelFactory = make_gpt
) -> dict[str, Any]:
    """Copies and collectives of one forward+backward (after a warm-up step) of a fresh model."""
    model, optimizer = build(name, cfg, make_model=make_model)
    train_step(model, optimizer, local_batch(batches, 0, rank))
    optimizer.zero_grad(set_to_none=True)
    with CopyAndCommCounter() as counter:
        lm_loss(model, local_batch(batches, 1, rank)).backward()
    result = {
        "copy_bytes": counter.total_bytes,
        "copy_by_op": dict(counter.by_op),
        "collectives": sum(counter.collectives.values()),
        "collective_bytes": sum(counter.collective_bytes.values()),
        "collectives_by_op": {k: [counter.collectives[k], counter.collective_bytes[k]] for k in counter.collectives},
        "traffic_by_op": dict(counter.traffic_bytes),
    }
    if name == "ragged":
        import lightning_ragged

        stats = lightning_ragged.get_state(model).stats
        stats.reset()
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model, local_batch(batches, 2, rank)).backward()
        result["engine_stats"] = {
            "all_gathers": stats.all_gathers,
            "all_gather_bytes": stats.all_gather_bytes,
            "reduces": stats.reduces,
            "reduce_bytes": stats.reduce_bytes,
            "flag_syncs": stats.flag_syncs,
        }
    del model, optimizer
    gc.collect()
    return result


# --------------------------------------------------------------------------- memory
def memory_pass(
    name: str, cfg: GPTConfig, batches: torch.Tensor, rank: int, make_model: ModelFactory = make_gpt
) -> dict[str, int]:
    """Live CPU tensor bytes at rest and at the peak of a steady-state step (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, optimizer = build(name, cfg, make_model=make_model)
        with record_function("bench::build_done"):
            pass
        train_step(model, optimizer, local_batch(batches, 0, rank))  # creates optimizer state
        with record_function("bench::measured_step"):
            train_step(model, optimizer, local_batch(batches, 1, rank))
    events = list(prof.profiler.kineto_results.events())
    window = next(e for e in events if e.name() == "bench::measured_step")
    built = next(e for e in events if e.name() == "bench::build_done")
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = rest = peak = after_build = 0
    for ts, nbytes in memory:
        if ts < built.start_ns():
            after_build = live + nbytes
        if ts >= window.start_ns() and rest == 0:
            rest = live
            peak = live
        live += nbytes
        if window.start_ns() <= ts <= window.end_ns():
            peak = max(peak, live)
    del model, optimizer, prof
    gc.collect()
    return {"rest_bytes": rest, "peak_bytes": peak, "after_build_bytes": after_build}


# --------------------------------------------------------------------------- profile
def profile_rank(rank: int, cfg: GPTConfig, opts: dict[str, Any]) -> dict[str, Any]:
    """torch.profiler over a few steps of each framework (both ranks profile; rank 0's tables are kept)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    out_dir = Path(opts["profile"])
    batches = make_batches(8, WORLD_SIZE * opts["batch"], cfg)
    result = {}
    for name in opts["profile_frameworks"]:
        model, optimizer = build(name, cfg)
        for step in range(2):
            train_step(model, optimizer, local_batch(batches, step, rank))
        dist.barrier()
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU], with_stack=opts["profile_stack"]) as prof:
            for step in range(2, 5):
                with record_function("bench::step"):
                    train_step(model, optimizer, local_batch(batches, step, rank))
        result[name] = (time.perf_counter() - started) / 3
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            (out_dir / f"{name}_ops.txt").write_text(table)
            if opts["profile_stack"]:
                stacks = prof.key_averages(group_by_stack_n=6).table(sort_by="self_cpu_time_total", row_limit=40)
                (out_dir / f"{name}_stacks.txt").write_text(stacks)
            prof.export_chrome_trace(str(out_dir / f"{name}_trace.json"))
        del model, optimizer, prof
        gc.collect()
    return {"profile_step_s": result}


# --------------------------------------------------------------------------- worker
RankFn = Callable[[int, GPTConfig, dict[str, Any]], dict[str, Any]]
"""``(rank, cfg, opts) -> result``: what each rank runs; rank 0's result is kept."""


def worker(
    rank: int, init_file: str, cfg: GPTConfig, opts: dict[str, Any], out_path: str, rank_fn: RankFn | None = None
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        if rank_fn is None:
            rank_fn = profile_rank if opts.get("profile") else run_rank
        result = rank_fn(rank, cfg, opts)
        if rank == 0:
            Path(out_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def timed_rounds(
    frameworks: dict[str, tuple[nn.Module, torch.optim.Optimizer]], batches: torch.Tensor, rank: int, opts: dict[str, Any]
) -> dict[str, dict[str, list[float]]]:
    """Warm up each framework, then ``rounds`` rounds of ``steps`` timed steps each, order rotated per round.

    Returns per framework: ``losses`` (this rank's local loss of every step, warm-up included),
    ``times`` (timed steps only), ``fwd_bwd`` and ``opt`` (the two parts of each timed step).
    """
    warmup, rounds, steps = opts["warmup"], opts["rounds"], opts["steps"]
    names = tuple(frameworks)
    step_index = dict.fromkeys(names, 0)
    losses: dict[str, list[float]] = {name: [] for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    fwd_bwd: dict[str, list[float]] = {name: [] for name in names}
    opt_times: dict[str, list[float]] = {name: [] for name in names}

    def run(name: str, count: int, timed: bool) -> None:
        model, optimizer = frameworks[name]
        dist.barrier()
        for _ in range(count):
            started = time.perf_counter()
            loss, fb, op = train_step(model, optimizer, local_batch(batches, step_index[name], rank))
            elapsed = time.perf_counter() - started
            step_index[name] += 1
            losses[name].append(loss)
            if timed:
                times[name].append(elapsed)
                fwd_bwd[name].append(fb)
                opt_times[name].append(op)

    for name in names:
        run(name, warmup, timed=False)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            run(name, steps, timed=True)
    return {"losses": losses, "times": times, "fwd_bwd": fwd_bwd, "opt": opt_times}


def run_rank(rank: int, cfg: GPTConfig, opts: dict[str, Any]) -> dict[str, Any]:
    warmup, rounds, steps = opts["warmup"], opts["rounds"], opts["steps"]
    total_steps = warmup + rounds * steps
    batches = make_batches(total_steps + 3, WORLD_SIZE * opts["batch"], cfg)
    frameworks = {name: build(name, cfg) for name in FRAMEWORKS}
    timed = timed_rounds(frameworks, batches, rank, opts)
    losses, times, fwd_bwd, opt_times = timed["losses"], timed["times"], timed["fwd_bwd"], timed["opt"]
    del frameworks
    gc.collect()

    counts = {name: count_pass(name, cfg, batches, rank) for name in (*FRAMEWORKS, "local")}
    memory = {name: memory_pass(name, cfg, batches, rank) for name in (*FRAMEWORKS, "local")}

    # Global loss per step = mean of the two ranks' local losses (equal batch sizes).
    gathered: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, {"losses": losses, "times": times, "memory": memory})
    mean_losses = {name: [sum(g["losses"][name][i] for g in gathered) / WORLD_SIZE for i in range(total_steps)]
                   for name in FRAMEWORKS}
    return {
        "params": count_params(make_gpt(cfg)),
        "losses": mean_losses,
        "times": times,
        "times_rank1": gathered[1]["times"],
        "fwd_bwd": fwd_bwd,
        "opt": opt_times,
        "counts": counts,
        "memory": memory,
        "memory_rank1": gathered[1]["memory"],
    }


# --------------------------------------------------------------------------- report
def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f}"


def machine_line(load: tuple[float, ...], wall: float) -> str:
    """The run conditions: machine, versions, and how loaded the shared machine was (from ``launch``)."""
    return (
        f"Machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), "
        f"Python {platform.python_version()}, torch {torch.__version__}. "
        f"1-minute load average {load[0]:.2f} at the start; sampled every 5 s during the run: min {load[1]:.2f}, "
        f"mean {load[2]:.2f}, max {load[3]:.2f} (the benchmark itself contributes ~2); wall time {wall:.0f} s."
    )


def render(result: dict[str, Any], cfg: GPTConfig, opts: dict[str, Any], load: tuple[float, ...], wall: float) -> str:
    med = {name: statistics.median(result["times"][name]) * 1e3 for name in FRAMEWORKS}
    med1 = {name: statistics.median(result["times_rank1"][name]) * 1e3 for name in FRAMEWORKS}
    fb = {name: statistics.median(result["fwd_bwd"][name]) * 1e3 for name in FRAMEWORKS}
    op = {name: statistics.median(result["opt"][name]) * 1e3 for name in FRAMEWORKS}
    counts, memory, memory1 = result["counts"], result["memory"], result["memory_rank1"]
    baseline = counts["local"]["copy_bytes"]
    losses = result["losses"]
    final = {name: losses[name][-1] for name in FRAMEWORKS}
    diff = {name: max(abs(a - b) for a, b in zip(losses[name], losses["ddp"])) for name in FRAMEWORKS}
    ratio = med["ragged"] / med["fsdp2"]
    # Paired within a round (the frameworks ran back to back there), so slow drifts of the
    # shared machine's load cancel; and the best step, the least disturbed one.
    per_round = opts["steps"]
    round_ratio = {
        name: statistics.median(
            statistics.median(result["times"][name][i : i + per_round])
            / statistics.median(result["times"]["fsdp2"][i : i + per_round])
            for i in range(0, len(result["times"][name]), per_round)
        )
        for name in FRAMEWORKS
    }
    best = {name: min(result["times"][name]) * 1e3 for name in FRAMEWORKS}
    round_sums = [
        sum(statistics.median(result["times"][name][i : i + per_round]) for name in FRAMEWORKS)
        for i in range(0, len(result["times"]["fsdp2"]), per_round)
    ]
    quiet = round_sums.index(min(round_sums)) * per_round
    quiet_ratio = {
        name: statistics.median(result["times"][name][quiet : quiet + per_round])
        / statistics.median(result["times"]["fsdp2"][quiet : quiet + per_round])
        for name in FRAMEWORKS
    }
    steps_total = len(losses["ddp"])
    labels = {"ragged": "lightning_ragged `fully_shard`", "fsdp2": "FSDP2 `fully_shard`", "ddp": "DDP"}

    lines = [
        "## Engine: lightning_ragged vs FSDP2 vs DDP (2 CPU ranks, gloo)",
        "",
        "Written by `benchmarks/engine_bench.py`"
        + (" (`--quick` smoke run: too few steps to trust)" if opts["quick"] else "")
        + ".",
        machine_line(load, wall),
        f"Model: GPT, vocab {cfg.vocab}, width {cfg.width}, {cfg.layers} blocks, {cfg.heads} heads, seq {cfg.seq}, "
        f"untied head, {result['params'] / 1e6:.1f}M parameters (fp32). Batch {opts['batch']} sequences per rank, "
        f"AdamW(lr={LR}) defaults, `torch.set_num_threads(1)` per rank, 2 ranks on the 2 cores.",
        f"Schedule: {opts['warmup']} warm-up steps each, then {opts['rounds']} rounds x "
        f"[ragged, fsdp2, ddp] (order rotated every round) x {opts['steps']} timed steps; "
        f"{opts['rounds'] * opts['steps']} timed steps per framework, all three persistent in one process per rank.",
        "Frameworks: lightning_ragged `fully_shard(model)` defaults (one group per block, the token embedding's, the root; row granularity, "
        "optimal planner, reshard after forward, gloo: `reduce_mode=\"pairwise\"`, each peer sent its segment of the flat gradient buffer, and `gather_mode=\"pairwise\"`, each peer sent this rank's segment of a DBuffer at once); FSDP2 `fully_shard` "
        "on each "
        "block then the root (defaults); DDP defaults (25 MiB buckets).",
        "",
        "| framework | median step ms (rank 0) | rank 1 | vs FSDP2 | vs FSDP2, per round | best step ms | fwd+bwd ms | optimizer ms | "
        "engine copy MiB/step | collectives/step | collective MiB/step | memory at rest MiB | peak memory MiB (rank 0 / 1) | "
        f"loss after {steps_total} steps | max abs loss diff vs DDP |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in FRAMEWORKS:
        c = counts[name]
        lines.append(
            f"| {labels[name]} | {med[name]:,.0f} | {med1[name]:,.0f} | {med[name] / med['fsdp2']:.2f}x | "
            f"{round_ratio[name]:.2f}x | {best[name]:,.0f} | {fb[name]:,.0f} | "
            f"{op[name]:,.0f} | {mib(c['copy_bytes'] - baseline)} | {c['collectives']} | {mib(c['collective_bytes'])} | "
            f"{mib(memory[name]['rest_bytes'])} | {mib(memory[name]['peak_bytes'])} / {mib(memory1[name]['peak_bytes'])} | "
            f"{final[name]:.4f} | {diff[name]:.1e} |"
        )
    lines.append(
        f"| single process, no framework (reference) | | | | | | | | 0 (baseline: {mib(baseline)} MiB of the model's own copies) "
        f"| 0 | 0 | {mib(memory['local']['rest_bytes'])} | {mib(memory['local']['peak_bytes'])} | | |"
    )
    met = ratio <= TARGET_RATIO
    lines += [
        "",
        f"**Target (issue 2): ragged step time <= {TARGET_RATIO}x FSDP2's. Measured (median step vs median step) "
        f"{ratio:.2f}x: " + ("met" if met else "not met")
        + f"** (median of the per-round ratios {round_ratio['ragged']:.2f}x, best step vs best step "
        f"{best['ragged'] / best['fsdp2']:.2f}x; in the least-disturbed round, round {quiet // per_round + 1}: ragged "
        f"{quiet_ratio['ragged']:.2f}x, DDP {quiet_ratio['ddp']:.2f}x). On this shared 2-core machine step times of the same framework varied "
        f"by up to {max(max(result['times'][n]) / min(result['times'][n]) for n in FRAMEWORKS):.1f}x within the run, "
        "so treat differences under ~10% as noise; see the run conditions above.",
        "",
        "How each column is measured:",
        "- step: wall time of zero_grad + forward + backward + `optimizer.step()` on each rank, median over the timed "
        "steps; fwd+bwd and optimizer are the medians of the two parts. \"per round\": median over rounds of "
        "(this framework's median step in the round / FSDP2's in the same round).",
        "- engine copy: bytes written by copy-like aten ops (`lightning_ragged.observability.copy_counter.CopyCounter`) during one "
        "forward+backward, minus the single-process model's own copies "
        f"({mib(baseline)} MiB: "
        + ", ".join(f"`{op}` {mib(b)}" for op, b in sorted(counts["local"]["copy_by_op"].items()))
        + ", from the attention reshapes and the qkv split's backward). By op: "
        + "; ".join(
            f"{name}: " + (", ".join(f"`{op}` {mib(b - counts['local']['copy_by_op'].get(op, 0))}"
                                     for op, b in sorted(counts[name]["copy_by_op"].items())
                                     if b - counts["local"]["copy_by_op"].get(op, 0) != 0) or "none")
            for name in FRAMEWORKS
        )
        + ". lightning_ragged's `aten::copy_` is its pairwise all-gather's one copy, this rank's own segment into "
        "its slot of the full buffer (1/W of each buffer gathered); gloo's own all-gather (FSDP2's, and ours with "
        "`gather_mode=\"all_gather\"`) makes that copy inside the backend, where no dispatch mode sees it.",
        "- not copies but the same memory traffic (bytes written by `fill_`/`zero_`/`add_` during forward+backward, "
        "minus the single-process model's): "
        + "; ".join(
            f"{name}: " + (", ".join(f"`{op}` {mib(b - counts['local']['traffic_by_op'].get(op, 0))}"
                                     for op, b in sorted(counts[name]["traffic_by_op"].items())
                                     if b - counts["local"]["traffic_by_op"].get(op, 0) != 0) or "none")
            for name in FRAMEWORKS
        )
        + ". lightning_ragged points every `param.grad` at its view of the flat gradient buffer, so the buffer is "
        "zeroed once per step and autograd accumulates (`add_`) each gradient into it instead of handing over the "
        "tensor it produced; that is ~2 x P bytes of writes that the copy column does not show. The rest of its "
        "`add_` is the pairwise reduction summing each peer's copy of this rank's segment into it ((W-1)/W x P).",
        "- per-round medians (ms, rank 0), to show drift from other jobs: "
        + "; ".join(
            f"{name}: " + ", ".join(
                f"{statistics.median(result['times'][name][i:i + opts['steps']]) * 1e3:,.0f}"
                for i in range(0, len(result["times"][name]), opts["steps"])
            )
            for name in FRAMEWORKS
        )
        + ".",
        "- collectives: `c10d::` operators dispatched during one forward+backward, with the bytes of the full-size "
        "buffer of each (all-gather output, all-reduce/reduce-scatter input; a point-to-point `send`/`recv_` of "
        "lightning_ragged's pairwise reduction and all-gather: its segment, one op per peer). By op: "
        + "; ".join(
            f"{name}: " + ", ".join(f"`{op}` {n} x, {mib(b)} MiB" for op, (n, b) in sorted(counts[name]["collectives_by_op"].items()))
            for name in FRAMEWORKS
        )
        + ". lightning_ragged's own `CommStats` agree: "
        + (lambda st: f"{st['all_gathers']} all-gathers ({mib(st['all_gather_bytes'])} MiB) and {st['reduces']} "
           f"reductions ({mib(st['reduce_bytes'])} MiB)")(counts["ragged"]["engine_stats"])
        + ".",
        "- memory: live bytes of the CPU allocator (torch.profiler `profile_memory=True`, running sum of every allocation "
        "and free since before the model was built) in a fresh model per framework: at rest = at the start of the second "
        "step (parameters, gradients set to None, AdamW state, engine buffers); peak = the maximum during that step "
        "(adds unsharded parameters/gradients, activations, temporaries). Allocations made on gloo's worker threads are "
        "not seen by the profiler.",
        f"- loss: mean of the two ranks' local losses at the last step; max abs diff over all {steps_total} steps vs DDP "
        "(same seed, same batches).",
    ]
    return "\n".join(lines)


def launch(
    cfg: GPTConfig, opts: dict[str, Any], rank_fn: RankFn | None = None
) -> tuple[dict[str, Any], tuple[float, float, float, float], float]:
    """Spawn the ranks, run ``rank_fn`` (default: the engine benchmark) on each, and sample the load meanwhile.

    Returns rank 0's result, the 1-minute load average (at the start, min, mean, max of the
    5-second samples) and the wall time in seconds.
    """
    load_samples = [os.getloadavg()[0]]
    done = threading.Event()

    def sample_load() -> None:  # the machine is shared: record how busy it was during the run
        while not done.wait(5.0):
            load_samples.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample_load, daemon=True)
    sampler.start()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(os.path.join(tmp, "pg"), cfg, opts, out_path, rank_fn), nprocs=WORLD_SIZE, join=True)
        result = json.loads(Path(out_path).read_text())
    wall = time.perf_counter() - started
    done.set()
    load = (load_samples[0], min(load_samples), statistics.mean(load_samples), max(load_samples))
    return result, load, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run (1 warm-up, 2 rounds x 2 steps)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per framework per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave RESULTS.md alone")
    parser.add_argument("--json", help="also dump the raw per-step results to this file")
    parser.add_argument("--profile", metavar="DIR", help="instead of the benchmark, profile 3 steps per framework "
                        "with torch.profiler and write rank 0's op tables and chrome traces to DIR")
    parser.add_argument("--profile-frameworks", default="ragged,fsdp2,ddp")
    parser.add_argument("--profile-stack", action="store_true", help="record Python stacks (slower, more detail)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 2, 1
    cfg = GPTConfig()
    opts = {"warmup": args.warmup, "rounds": args.rounds, "steps": args.steps, "batch": args.batch, "quick": args.quick,
            "profile": args.profile, "profile_frameworks": args.profile_frameworks.split(","),
            "profile_stack": args.profile_stack}

    result, load, wall = launch(cfg, opts)
    if args.profile:
        print(json.dumps(result), f"-> op tables and traces in {args.profile}")
        return
    markdown = render(result, cfg, opts, load, wall)
    print(markdown)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if not args.no_write:
        write_section("engine", markdown, ROOT / "benchmarks" / "RESULTS.md")


if __name__ == "__main__":
    main()
