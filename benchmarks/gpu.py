"""The engine comparison on CUDA/NCCL: ragged ``fully_shard`` vs FSDP2 ``fully_shard`` vs DDP.

``python benchmarks/gpu.py [--rounds 5 --steps 10 --width 1024 --layers 8]`` from the
repository root. One process per visible GPU (NCCL), bf16 compute with fp32 master
weights for both FSDPs, the benchmark GPT of ``benchmarks/models.py``. Rounds alternate
the order of the three variants; reported are median step times, ratios to the peers,
peak CUDA memory, the bytes copied outside collectives in one step
(``CopyCounter``) and the ragged engine's metrics (all-gather/reduce time, share hidden
behind compute). With one GPU the "collectives" are on one rank, so the step times
compare compute plus copies only; the copy bytes are meaningful either way.

Without a GPU it prints that it is skipped and records that in RESULTS.md (it never
overwrites earlier GPU results with a skip note).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from report import write_section  # noqa: E402

RESULTS = Path("benchmarks/RESULTS.md")
VARIANTS = ("ragged", "fsdp2", "ddp")


def _build(variant: str, cfg, device: torch.device):
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_shard
    from torch.nn.parallel import DistributedDataParallel

    import lightning_ragged as lr
    from models import make_gpt

    model = make_gpt(cfg).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if variant == "ragged":
        lr.fully_shard(model, mp_policy=policy, device=device)
    elif variant == "fsdp2":
        for block in model.blocks:
            fsdp2_shard(block, mp_policy=policy)
        fsdp2_shard(model, mp_policy=policy)
    else:
        model = DistributedDataParallel(model, device_ids=[device.index])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    dist.barrier()
    return model, optimizer


def _step(variant: str, model, optimizer, tokens) -> None:
    from models import lm_loss

    context = torch.autocast("cuda", dtype=torch.bfloat16) if variant == "ddp" else torch.autocast("cuda", enabled=False)
    with context:
        loss = lm_loss(model, tokens)
    loss.float().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def worker(rank: int, world: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    from lightning_ragged.observability.copy_counter import CopyCounter
    from lightning_ragged.observability.metrics import EngineMetrics
    from models import GPTConfig, make_batches

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = GPTConfig(width=args.width, layers=args.layers, heads=args.width // 64, seq=args.seq, vocab=args.vocab)
    batches = make_batches(1, args.batch * world, cfg)[0].to(device)
    tokens = batches[rank * args.batch : (rank + 1) * args.batch]
    built = {variant: _build(variant, cfg, device) for variant in VARIANTS}
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    peaks, copies = {}, {}
    for variant, (model, optimizer) in built.items():
        for _ in range(3):
            _step(variant, model, optimizer, tokens)
        with CopyCounter() as counter:
            _step(variant, model, optimizer, tokens)
        copies[variant] = counter.total_bytes
    metrics = EngineMetrics(built["ragged"][0])
    for round_index in range(args.rounds):
        order = VARIANTS if round_index % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            model, optimizer = built[variant]
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            dist.barrier()
            started = time.perf_counter()
            for _ in range(args.steps):
                _step(variant, model, optimizer, tokens)
                if variant == "ragged":
                    metrics.end_step()
            torch.cuda.synchronize()
            times[variant].append((time.perf_counter() - started) / args.steps)
            peaks[variant] = max(peaks.get(variant, 0), torch.cuda.max_memory_allocated(device))
    engine = metrics.compute(per_group=False)
    params = sum(p.numel() for p in make_gpt(cfg).parameters())
    if rank == 0:
        torch.save(dict(times=times, peaks=peaks, copies=copies, engine=engine, params=params, world=world), out)
    dist.destroy_process_group()


def render(result: dict, args: argparse.Namespace, wall: float) -> str:
    medians = {v: statistics.median(result["times"][v]) for v in VARIANTS}
    name = torch.cuda.get_device_name(0)
    engine = result["engine"]
    lines = [
        "## GPU: ragged fully_shard vs FSDP2 vs DDP on CUDA/NCCL",
        "",
        f"Written by `benchmarks/gpu.py`. {result['world']} x {name}, NCCL, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, Python {platform.python_version()}. GPT width {args.width}, {args.layers} blocks, "
        f"seq {args.seq}, vocab {args.vocab} ({result['params']:,} parameters), batch {args.batch} per GPU, "
        "bf16 compute / fp32 master (DDP: fp32 weights under bf16 autocast), fused AdamW. "
        f"{args.rounds} alternated rounds of {args.steps} steps; wall {wall:.0f} s.",
        "",
        "| variant | median step | vs ragged | peak CUDA memory | bytes copied outside collectives per step |",
        "|---|---:|---:|---:|---:|",
    ]
    for variant in VARIANTS:
        lines.append(
            f"| {variant} | {medians[variant] * 1e3:.2f} ms | {medians[variant] / medians['ragged']:.3f} "
            f"| {result['peaks'][variant] / 2**20:,.0f} MiB | {result['copies'][variant] / 2**20:,.1f} MiB |"
        )
    lines += [
        "",
        f"Ragged engine metrics (per step): all-gather {engine['ragged_fsdp/all_gather_bytes'] / 2**20:,.1f} MiB in "
        f"{engine['ragged_fsdp/all_gather_seconds'] * 1e3:.2f} ms, reduce {engine['ragged_fsdp/reduce_bytes'] / 2**20:,.1f} "
        f"MiB in {engine['ragged_fsdp/reduce_seconds'] * 1e3:.2f} ms, share of communication hidden behind compute "
        f"{engine['ragged_fsdp/comm_hidden_ratio']:.1%} (CPU-side: NCCL work is asynchronous to the host, so on GPU "
        "these times are the host's view).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        message = "GPU comparison skipped: no CUDA device on this machine (torch.cuda.is_available() is False)."
        print(message)
        text = RESULTS.read_text() if RESULTS.exists() else ""
        existing = text.split("<!-- BEGIN gpu -->", 1)[1].split("<!-- END gpu -->", 1)[0] if "<!-- BEGIN gpu -->" in text else ""
        if not existing.strip() or "skipped" in existing:
            write_section(
                "gpu",
                "## GPU: ragged fully_shard vs FSDP2 vs DDP on CUDA/NCCL\n\n"
                f"Skipped on {time.strftime('%Y-%m-%d')}: no CUDA device on the machine that ran "
                "`benchmarks/gpu.py` (run it on a GPU machine to fill this section).",
            )
        return
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    init_file = tempfile.mktemp(prefix="ragged_gpu_")
    out = tempfile.mktemp(prefix="ragged_gpu_result_")
    started = time.perf_counter()
    mp.spawn(worker, args=(world, init_file, args, out), nprocs=world)
    result = torch.load(out)
    os.remove(out)
    markdown = render(result, args, time.perf_counter() - started)
    print(markdown)
    write_section("gpu", markdown)


if __name__ == "__main__":
    main()
