"""Optimizer-step benchmark: sharded Muon, Shampoo and SOAP vs their straightforward ports to FSDP2 DTensors.

``python benchmarks/optim_bench.py`` spawns 2 gloo ranks (1 thread each), builds the same
stack of hidden matrices several ways and times ``optimizer.step()`` on synthetic gradients:

* Muon, ragged "matrix": ``lightning_ragged.fully_shard(shard_granularity="matrix")`` + ``lightning_ragged.optim.Muon``;
* Muon, ragged "row": the same with row granularity (split matrices are gathered to a load-balanced root);
* Muon, FSDP2: ``torch.distributed.fsdp.fully_shard`` (``Shard(0)`` DTensors); each matrix's update is
  gathered with ``full_tensor()`` and orthogonalized on every rank (the straightforward port);
* Shampoo and SOAP, ragged "block" with ``block_rows`` = the tile size (every tile whole: no
  collective) and ragged "row" (split tiles gathered to a load-balanced owner, one all-to-all each way);
* Shampoo and SOAP, FSDP2: every gradient gathered with ``full_tensor()``, every rank stepping the
  optimizer on full replicas of every parameter (all tiles' statistics and eigendecompositions on
  every rank) and keeping its ``Shard(0)`` rows. distributed_shampoo (Meta's DistributedShampoo) is
  not on the package registry (``pip download distributed_shampoo`` finds nothing), so it is no peer here.

Collectives are counted inside ``step()`` by torch's ``CommDebugMode`` (the ``c10d`` ops of
``torch.distributed`` and FSDP2's functional ``full_tensor()`` gathers alike), with the bytes
each rank sends added here (``CommDebugMode`` counts ops, not sizes). Load balance: max/mean over
ranks of the Newton–Schulz FLOPs (Muon) or eigendecomposition work r³ + c³ per tile (Shampoo, SOAP)
each rank runs. The tables go to ``benchmarks/RESULTS.md`` ("optimizers").
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

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
TILE = 128
TILED = {
    # precondition_frequency=1: every timed step refreshes every tile's roots / eigenbases, the work
    # the owners are balanced on (a step without a refresh is a few matmuls per tile)
    "Shampoo": dict(lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12, max_preconditioner_dim=TILE,
                    precondition_frequency=1, start_preconditioning_step=1, grafting="adam"),
    "SOAP": dict(lr=3e-3, betas=(0.95, 0.95), weight_decay=0.01, max_preconditioner_dim=TILE,
                 precondition_frequency=1),
}


class Block(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=bias)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=bias)
        self.up = nn.Linear(WIDTH, 4 * WIDTH, bias=bias)
        self.down = nn.Linear(4 * WIDTH, WIDTH, bias=bias)


class Stack(nn.Module):
    """The hidden matrices of ``LAYERS`` blocks; with ``bias`` (Shampoo, SOAP) their biases too."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(bias) for _ in range(LAYERS))


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


def _ragged_grads(params: list) -> Callable[[int], None]:
    """Set every sharded parameter's gradient to its piece of a full random gradient seeded by the step index."""

    def set_grads(index: int) -> None:
        generator = torch.Generator().manual_seed(index)
        for p in params:
            full = torch.randn(p.ragged_shard.numel, generator=generator)
            start, end = p.ragged_shard.local_range
            p.grad = full[start:end].clone()

    return set_grads


def _ragged(granularity: str) -> dict:
    from lightning_ragged import fully_shard, get_state
    from lightning_ragged.optim import Muon

    model = fully_shard(Stack(), shard_granularity=granularity)
    params = list(model.parameters())
    muon = Muon(params, **MUON)

    set_grads = _ragged_grads(params)
    seconds, collectives, sent = _time_steps(muon.step, set_grads)
    loads = muon.last_plan.cost_per_rank[0]
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


def _tiled_optimizer(kind: str, params) -> torch.optim.Optimizer:
    from lightning_ragged.optim import SOAP, Shampoo

    return {"Shampoo": Shampoo, "SOAP": SOAP}[kind](params, **TILED[kind])


def _ragged_tiled(kind: str, granularity: str) -> dict:
    from lightning_ragged import fully_shard, get_state
    from lightning_ragged.optim.tiles import eig_cost

    model = fully_shard(Stack(bias=True), shard_granularity=granularity, block_rows=TILE)
    params = list(model.parameters())
    optimizer = _tiled_optimizer(kind, params)

    set_grads = _ragged_grads(params)
    seconds, collectives, sent = _time_steps(optimizer.step, set_grads)
    plan = optimizer.tile_plan
    layouts = [dbuffer.layout for dbuffer in get_state(model).dbuffers()]
    tiles = [tile for p in params for tile in optimizer.tiles(p)]
    return dict(seconds=seconds, collectives=collectives, sent=sent, loads=plan.cost_per_rank[0],
                padding=sum(l.padding for l in layouts) / sum(l.buffer_numel for l in layouts),
                split=plan.split, tiles=len(tiles), total=sum(eig_cost(t.shape, t.one_sided) for t in tiles))


def _fsdp2_tiled(kind: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from lightning_ragged.optim.tiles import eig_cost

    mesh = init_device_mesh("cpu", (WORLD,))
    model = Stack(bias=True)
    replicas = [nn.Parameter(p.detach().clone()) for p in model.parameters()]  # every rank: full copies
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    optimizer = _tiled_optimizer(kind, replicas)
    offsets = [compute_local_shape_and_global_offset(p.shape, mesh, p.placements)[1][0] for p in params]

    def set_grads(index: int) -> None:
        generator = torch.Generator().manual_seed(index)
        for p, offset in zip(params, offsets):
            full = torch.randn(p.shape, generator=generator)
            local = full[offset : offset + p.to_local().shape[0]]
            p.grad = DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())

    def step():
        with torch.no_grad():
            for p, replica in zip(params, replicas):
                replica.grad = p.grad.full_tensor()
            optimizer.step()
            for p, replica, offset in zip(params, replicas, offsets):
                local = p.to_local()
                local.copy_(replica[offset : offset + local.shape[0]])

    seconds, collectives, sent = _time_steps(step, set_grads)
    tiles = [tile for r in replicas for tile in optimizer.tiles(r)]
    total = sum(eig_cost(t.shape, t.one_sided) for t in tiles)
    return dict(seconds=seconds, collectives=collectives, sent=sent, loads=[total] * WORLD, padding=0.0,
                split=len(tiles), tiles=len(tiles), total=total)


def _worker(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    muon = {
        'lightning_ragged Muon, "matrix"': _ragged("matrix"),
        'lightning_ragged Muon, "row"': _ragged("row"),
        "FSDP2 DTensor + full_tensor() Muon": _fsdp2(),
    }
    tiled = {}
    for kind in TILED:
        tiled[f'lightning_ragged {kind}, "block" (block_rows={TILE})'] = _ragged_tiled(kind, "block")
        tiled[f'lightning_ragged {kind}, "row"'] = _ragged_tiled(kind, "row")
        tiled[f'lightning_ragged {kind}, "element"'] = _ragged_tiled(kind, "element")
        tiled[f"FSDP2 DTensor + full_tensor() {kind}"] = _fsdp2_tiled(kind)
    everything = [*muon.values(), *tiled.values()]
    worst = torch.tensor([[r["seconds"], r["sent"]] for r in everything], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank's time, the busiest rank's bytes
    if rank == 0:
        for result, (seconds, sent) in zip(everything, worst.tolist()):
            result["seconds"], result["sent"] = seconds, int(sent)
        torch.save((muon, tiled), out)
    dist.destroy_process_group()
    # Interpreter teardown after this process group sometimes aborts ("terminate called without an
    # active exception", 2 runs in 6 here, also before Shampoo and SOAP were added): the results are
    # saved, so leave without running the C++ static destructors.
    sys.stdout.flush()
    os._exit(0)


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
        f"5 bf16 steps; {_bf16_units()}. Collectives are per rank per step, bytes sent those of the rank sending most.",
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


def tiled_table(results: dict) -> str:
    lines = [
        "## Optimizer step: Shampoo and SOAP on any layout vs the FSDP2 DTensor port",
        "",
        f"The same {LAYERS * 4} matrices with their biases, {TILE}x{TILE} tiles (Shampoo also tiles the biases as "
        f"{TILE}-element vectors; SOAP steps them with Adam), {WORLD} gloo ranks, 1 thread each, median of "
        f"{STEPS} steps (slowest rank); `precondition_frequency=1`, so every timed step recomputes every tile's root "
        "inverses (Shampoo, fp64 eigendecompositions) or eigenbases (SOAP, fp32 power iteration + QR). "
        "Collectives per rank per step, bytes sent those of the rank sending most. "
        "distributed_shampoo (Meta's DistributedShampoo) is not installable from the package registry "
        "(`pip download distributed_shampoo` finds nothing), so the peer is the straightforward port.",
        "",
        "| setup | tiles split | step (ms) | collectives / step | bytes sent / step | eig work per rank (% of all) | max/mean | buffer padding |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, r in results.items():
        loads = r["loads"]
        mean = sum(loads) / len(loads)
        shares = " / ".join(f"{100 * x / r['total']:.0f}%" for x in loads)
        lines.append(
            f"| {name} | {r['split']}/{r['tiles']} | {r['seconds'] * 1e3:.0f} | {r['collectives']:.0f} | "
            f"{r['sent'] / 1024:.0f} KiB | {shares} | {max(loads) / mean:.2f} | {r['padding'] * 100:.1f}% |"
        )
    lines += [
        "",
        '"block" with block_rows = the tile size: every tile whole on one rank, no collective in the step. '
        '"row" and "element" cut one 128-row tile band per block (here 1 row into it): those tiles travel to a '
        "load-balanced owner (largest eigendecomposition work first, whole tiles counted) in one fp32 all-to-all, "
        "their directions come back in another; whole tiles are stepped while the gather is in flight. Owners "
        "are chosen for eigendecomposition balance, bytes only break ties: Shampoo gives one split tile to the "
        "rank holding its 1-row piece (127 rows travel each way, 64 KiB), SOAP keeps all three with their "
        "127-row holders (1-2 KiB). FSDP2 port: one all-gather per parameter and every rank computing every "
        "tile (W-fold redundant statistics, eigendecompositions and optimizer memory).",
    ]
    return "\n".join(lines)


def main() -> None:
    from benchmarks.report import write_section

    init_file = tempfile.mktemp(prefix="optim_bench_pg_")
    out = tempfile.mktemp(prefix="optim_bench_", suffix=".pt")
    mp.spawn(_worker, args=(init_file, out), nprocs=WORLD)
    muon, tiled = torch.load(out, weights_only=False)
    os.remove(out)
    if os.path.exists(init_file):
        os.remove(init_file)
    markdown = table(muon) + "\n\n" + tiled_table(tiled)
    print(markdown)
    write_section("optimizers", markdown)


if __name__ == "__main__":
    main()
