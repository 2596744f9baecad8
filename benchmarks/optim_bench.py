"""Optimizer-step benchmark: sharded Muon (matrix vs row granularity) vs Muon on FSDP2 DTensors.

``python benchmarks/optim_bench.py`` spawns 2 gloo ranks (1 thread each), builds the same
stack of hidden matrices three ways and times ``Muon.step()`` on synthetic gradients:

* ragged "matrix": ``lightning_ragged.fully_shard(shard_granularity="matrix")`` + ``lightning_ragged.optim.Muon``;
* ragged "row": the same with row granularity (split matrices are gathered to a load-balanced root);
* FSDP2: ``torch.distributed.fsdp.fully_shard`` (``Shard(0)`` DTensors); each matrix's update is
  gathered with ``full_tensor()`` and orthogonalized on every rank (the straightforward port).

Collectives are counted inside ``step()`` by torch's ``CommDebugMode`` (the ``c10d`` ops of
``torch.distributed`` and FSDP2's functional ``full_tensor()`` gathers alike), with the bytes
each rank sends added here (``CommDebugMode`` counts ops, not sizes). NS load balance:
max/mean over ranks of the Newton–Schulz FLOPs each rank runs. The table goes to ``benchmarks/RESULTS.md`` ("optimizers").
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WIDTH = 128
LAYERS = 3
STEPS = 4
WORLD = 2
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.down = nn.Linear(4 * WIDTH, WIDTH, bias=False)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))


class CommBytes(CommDebugMode):
    """``CommDebugMode`` that also sums the bytes of the tensors each collective sends.

    The sent tensor is the argument named ``input*`` in the op's schema (``alltoall_base_``,
    ``_allgather_base_``, the functional gathers), else every tensor argument (in-place ops).
    """

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:
            named = list(zip(func._schema.arguments, args))
            inputs = [value for arg, value in named if arg.name.startswith("input")] or [value for _, value in named]
            tensors = [t for value in inputs for t in (value if isinstance(value, (list, tuple)) else [value])]
            self.sent += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        return out


def _time_steps(step, set_grads) -> tuple[float, float, int]:
    times, counts, sent = [], [], []
    for index in range(STEPS + 1):
        set_grads(index)
        dist.barrier()
        with CommBytes() as comm:
            started = time.perf_counter()
            step()
            elapsed = time.perf_counter() - started
        if index:  # the first step allocates state
            times.append(elapsed)
            counts.append(comm.get_total_counts())
            sent.append(comm.sent)
    return statistics.median(times), statistics.mean(counts), int(statistics.mean(sent))


def _ragged(granularity: str) -> dict:
    from lightning_ragged import fully_shard, get_state
    from lightning_ragged.optim import Muon

    model = fully_shard(Stack(), shard_granularity=granularity)
    params = list(model.parameters())
    muon = Muon(params, **MUON)

    def set_grads(index: int) -> None:
        generator = torch.Generator().manual_seed(index)
        for p in params:
            full = torch.randn(p.ragged_shard.numel, generator=generator)
            start, end = p.ragged_shard.local_range
            p.grad = full[start:end].clone()

    seconds, collectives, sent = _time_steps(muon.step, set_grads)
    loads = muon.last_plan.flops_per_rank[0]
    layouts = [dbuffer.layout for dbuffer in get_state(model).dbuffers()]
    padding = sum(l.padding for l in layouts) / sum(l.buffer_numel for l in layouts)
    return dict(seconds=seconds, collectives=collectives, sent=sent, loads=loads, padding=padding,
                split=muon.last_plan.split, matrices=len(params))


def _fsdp2() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    from lightning_ragged.optim import ns_flops

    mesh = init_device_mesh("cpu", (WORLD,))
    model = Stack()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    buffers = {p: torch.zeros_like(p.to_local()) for p in params}

    def set_grads(index: int) -> None:
        generator = torch.Generator().manual_seed(index)
        for p in params:
            full = torch.randn(p.shape, generator=generator)
            _, offset = compute_local_shape_and_global_offset(p.shape, mesh, p.placements)
            local = full[offset[0] : offset[0] + p.to_local().shape[0]]
            p.grad = DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())

    def step():
        with torch.no_grad():
            for p in params:
                grad, buf = p.grad.to_local(), buffers[p]
                buf.lerp_(grad, 1 - MUON["momentum"])
                update = grad.lerp(buf, MUON["momentum"])
                full = DTensor.from_local(update, mesh, [Shard(0)], run_check=False, shape=p.shape,
                                          stride=p.stride()).full_tensor()
                ortho = _zeropower_via_newtonschulz(full, (3.4445, -4.7750, 2.0315), 5, 1e-7)
                _, offset = compute_local_shape_and_global_offset(p.shape, mesh, p.placements)
                local = p.to_local()
                local.mul_(1 - MUON["lr"] * MUON["weight_decay"])
                local.add_(ortho[offset[0] : offset[0] + local.shape[0]], alpha=-_adjust_lr(MUON["lr"], None, p.shape))

    seconds, collectives, sent = _time_steps(step, set_grads)
    per_rank = sum(ns_flops(p.shape) for p in params)
    return dict(seconds=seconds, collectives=collectives, sent=sent, loads=[per_rank] * WORLD, padding=0.0,
                split=len(params), matrices=len(params))


def _worker(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results = {
        'lightning_ragged Muon, "matrix"': _ragged("matrix"),
        'lightning_ragged Muon, "row"': _ragged("row"),
        "FSDP2 DTensor + full_tensor() Muon": _fsdp2(),
    }
    worst = torch.tensor([r["seconds"] for r in results.values()], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        for result, seconds in zip(results.values(), worst.tolist()):
            result["seconds"] = seconds
        torch.save(results, out)
    dist.destroy_process_group()


def _bf16_units() -> str:
    """Whether this CPU multiplies bf16 in hardware: step times differ by ~40x between such machines."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "CPU bf16 support unknown"
    found = sorted(flags & {"amx_bf16", "avx512_bf16"})
    return f"this CPU has {', '.join(found)}" if found else "this CPU has no bf16 matrix instructions, so NS dominates"


def table(results: dict) -> str:
    shapes = f"{LAYERS} blocks x (qkv {3 * WIDTH}x{WIDTH}, proj {WIDTH}x{WIDTH}, up {4 * WIDTH}x{WIDTH}, down {WIDTH}x{4 * WIDTH})"
    lines = [
        "## Optimizer step: sharded Muon vs Muon on FSDP2 DTensors",
        "",
        f"`python benchmarks/optim_bench.py`: {WORLD} gloo ranks on CPU, 1 thread each, {shapes} = "
        f"{LAYERS * 4} matrices; synthetic gradients; median of {STEPS} steps (slowest rank). Newton–Schulz is "
        f"5 bf16 steps; {_bf16_units()}. Collectives and bytes are per rank per step.",
        "",
        "| setup | matrices split | step (ms) | collectives / step | bytes sent / step | NS GFLOP per rank | NS max/mean | buffer padding |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, r in results.items():
        loads = r["loads"]
        mean = sum(loads) / len(loads)
        lines.append(
            f"| {name} | {r['split']}/{r['matrices']} | {r['seconds'] * 1e3:.0f} | {r['collectives']:.0f} | "
            f"{r['sent'] / 1024:.0f} KiB | {' / '.join(f'{x / 1e9:.2f}' for x in loads)} | "
            f"{max(loads) / mean:.2f} | {r['padding'] * 100:.1f}% |"
        )
    lines += [
        "",
        '"matrix": every matrix whole on one rank, Newton–Schulz on its owner, zero collectives in the step; '
        "the planner balances elements, not FLOPs, so NS load can be uneven and the layout pads more. "
        '"row": split matrices travel in one all-to-all each way (bf16), roots chosen to balance NS FLOPs. '
        "FSDP2: one all-gather per matrix and every rank orthogonalizes every matrix (W-fold redundant work).",
    ]
    return "\n".join(lines)


def main() -> None:
    from benchmarks.report import write_section

    init_file = tempfile.mktemp(prefix="optim_bench_pg_")
    out = tempfile.mktemp(prefix="optim_bench_", suffix=".pt")
    mp.spawn(_worker, args=(init_file, out), nprocs=WORLD)
    results = torch.load(out, weights_only=False)
    os.remove(out)
    if os.path.exists(init_file):
        os.remove(init_file)
    markdown = table(results)
    print(markdown)
    write_section("optimizers", markdown)


if __name__ == "__main__":
    main()
