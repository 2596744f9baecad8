"""Checkpoint save/load time and size: ragged_fsdp sharded DCP vs FSDP2 (Lightning's ModelParallelStrategy).

``python benchmarks/checkpoint_bench.py [--quick] [--rounds 3] [--no-write]`` writes the
"checkpoints" section of benchmarks/RESULTS.md.

Two gloo ranks (one thread each) hold the same GPT (benchmarks/models.py, ~17M params)
and AdamW after one step, sharded two ways:

* **ragged**: ``lightning_ragged.fully_shard`` (row granularity), saved and loaded with
  ``lightning_ragged.checkpoint`` (what ``RaggedFSDPStrategy`` calls): every parameter's
  ragged range goes to DCP as ``LocalShardsWrapper`` boxes viewing the DBuffer; the save
  is atomic (hidden directory, ``meta.pt`` last, rename).
* **fsdp2**: ``torch.distributed.fsdp.fully_shard`` per block + root, saved with
  ``get_model_state_dict``/``get_optimizer_state_dict`` + ``dcp.save`` and loaded with
  ``dcp.load`` + ``set_*_state_dict`` — the calls Lightning's ``ModelParallelStrategy``
  makes for its distributed checkpoints.

Each variant is timed per round (save: barrier to barrier; load: into the live model and
optimizer), rounds alternate the variant order, medians are reported. "async" reports
the time ``save`` blocks training (staging copy) and the time until the checkpoint is
complete. "full" writes one ordinary ``.ckpt`` (rank 0 streams it from the shards).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from models import GPTConfig, lm_loss, make_batches, make_gpt  # noqa: E402
from report import write_section  # noqa: E402

WORLD_SIZE = 2
VARIANTS = ("ragged", "ragged+zstd", "ragged async", "ragged full", "fsdp2", "fsdp2+zstd")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _train_one_step(model, optimizer, data) -> None:
    rank = dist.get_rank()
    per = data.shape[0] // WORLD_SIZE
    lm_loss(model, data[rank * per : (rank + 1) * per]).backward()
    optimizer.step()
    optimizer.zero_grad()


def worker(rank: int, pg_file: str, cfg: GPTConfig, opts: dict, root: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank, world_size=WORLD_SIZE)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    import lightning_ragged as lr
    from lightning_ragged import checkpoint as ck

    data = make_batches(1, 2 * WORLD_SIZE, cfg)[0]
    ragged = lr.fully_shard(make_gpt(cfg), shard_granularity="row")
    ragged_opt = torch.optim.AdamW(ragged.parameters(), lr=1e-3)
    _train_one_step(ragged, ragged_opt, data)
    fsdp2 = make_gpt(cfg)
    for block in fsdp2.blocks:
        fsdp2_shard(block)
    fsdp2_shard(fsdp2)
    fsdp2_opt = torch.optim.AdamW(fsdp2.parameters(), lr=1e-3)
    _train_one_step(fsdp2, fsdp2_opt, data)
    zstd = ZStandard.is_available()
    writer = ck.CheckpointWriter()

    def save(variant: str, path: Path) -> float:
        """Seconds the caller is blocked; for async also waits and records completion."""
        if variant.startswith("ragged"):
            options = {
                "compress": variant == "ragged+zstd",
                "async_save": variant == "ragged async",
                "full": variant == "ragged full",
            }
            start = time.perf_counter()
            ck.save(path, ragged, [ragged_opt], {"step": 1}, writer=writer, **options)
            blocked = time.perf_counter() - start
            writer.wait()
            dist.barrier()
            timings.setdefault(f"{variant} complete", []).append(time.perf_counter() - start)
            return blocked
        extensions = [ZStandard()] if variant == "fsdp2+zstd" else None
        start = time.perf_counter()
        state = {"model": get_model_state_dict(fsdp2), "optimizer": get_optimizer_state_dict(fsdp2, fsdp2_opt)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), _extensions=extensions))
        if rank == 0:
            torch.save({"step": 1}, path / "meta.pt")  # as Lightning's strategies do
        dist.barrier()
        return time.perf_counter() - start

    def load(variant: str, path: Path) -> float:
        start = time.perf_counter()
        if variant.startswith("ragged"):
            ck.load(path, ragged, [ragged_opt])
        else:
            state = {"model": get_model_state_dict(fsdp2), "optimizer": get_optimizer_state_dict(fsdp2, fsdp2_opt)}
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))
            set_model_state_dict(fsdp2, state["model"])
            set_optimizer_state_dict(fsdp2, fsdp2_opt, state["optimizer"])
        dist.barrier()
        return time.perf_counter() - start

    variants = [v for v in VARIANTS if zstd or "zstd" not in v]
    timings: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    for round_index in range(opts["rounds"]):
        order = variants if round_index % 2 == 0 else list(reversed(variants))
        for variant in order:
            path = Path(root) / f"{variant.replace(' ', '_')}-{round_index}"
            dist.barrier()
            timings.setdefault(f"{variant} save", []).append(save(variant, path))
            timings.setdefault(f"{variant} load", []).append(load(variant, path))
            if rank == 0:
                sizes[variant] = _size(path)
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
            dist.barrier()
    if rank == 0:
        params = sum(p.numel() for p in make_gpt(cfg).parameters())
        Path(out).write_text(json.dumps({"timings": timings, "sizes": sizes, "params": params, "zstd": zstd}))
    dist.destroy_process_group()


def render(result: dict, opts: dict, load: tuple[float, float], wall: float) -> str:
    med = {k: statistics.median(v) for k, v in result["timings"].items()}
    sizes = result["sizes"]
    rows = []
    for variant in VARIANTS:
        if variant not in sizes:
            continue
        save = med[f"{variant} save"]
        complete = med.get(f"{variant} complete")
        save_cell = f"{save:.2f}" + (f" (complete {complete:.2f})" if variant == "ragged async" else "")
        rows.append(
            f"| {variant} | {save_cell} | {med[f'{variant} load']:.2f} | {sizes[variant] / 2**20:.1f} |"
        )
    ratio = lambda a, b, kind: med[f"{a} {kind}"] / med[f"{b} {kind}"]  # noqa: E731
    lines = [
        "## Checkpoints: sharded DCP save/load, ragged_fsdp vs FSDP2 (Lightning's ModelParallelStrategy)",
        "",
        "Written by `benchmarks/checkpoint_bench.py`. GPT from benchmarks/models.py "
        f"({result['params'] / 1e6:.1f}M parameters, fp32) plus AdamW state after one step, 2 gloo ranks, one "
        f"thread each, local disk; medians of {opts['rounds']} alternating rounds. Save: barrier to barrier "
        "(ragged includes its atomic publish: hidden directory, `meta.pt` last, rename). Load: validate + "
        "read into the live model and optimizer (ragged: in place into the DBuffer views). "
        "`ragged async`: time training is blocked (one copy of each flat buffer), then time to a complete "
        "checkpoint. `ragged full`: one ordinary `.ckpt` written by rank 0, streamed tensor by tensor.",
        f"Load average {load[0]:.1f} at start, {load[1]:.1f} at end (shared 2-core machine: expect noise); "
        f"wall {wall:.0f} s.",
        "",
        "| variant | save s | load s | size MiB |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        f"ragged / fsdp2: save {ratio('ragged', 'fsdp2', 'save'):.2f}x, load {ratio('ragged', 'fsdp2', 'load'):.2f}x.",
    ]
    if result["zstd"]:
        lines.append(
            f"Zstandard: {sizes['ragged+zstd'] / sizes['ragged']:.0%} of the uncompressed size for ragged "
            f"({sizes['fsdp2+zstd'] / sizes['fsdp2']:.0%} for fsdp2); random-init fp32 weights and Adam moments "
            "compress poorly, trained checkpoints with many near-zero moments compress better."
        )
    else:
        lines.append("Zstandard rows skipped: neither `zstandard` nor `pyzstd` is installed.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of a smaller model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print the table, leave RESULTS.md alone")
    args = parser.parse_args()
    cfg = GPTConfig(layers=2, vocab=2048) if args.quick else GPTConfig()
    opts = {"rounds": 1 if args.quick else args.rounds}
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        root = os.path.join(tmp, "ckpts")
        os.makedirs(root)
        mp.spawn(worker, args=(os.path.join(tmp, "pg"), cfg, opts, root, out), nprocs=WORLD_SIZE, join=True)
        result = json.loads(Path(out).read_text())
    markdown = render(result, opts, (load_before, os.getloadavg()[0]), time.perf_counter() - started)
    markdown += f"\nMachine: {platform.platform()}, torch {torch.__version__}."
    print(markdown)
    if not args.no_write:
        write_section("checkpoints", markdown, ROOT / "benchmarks" / "RESULTS.md")


if __name__ == "__main__":
    main()
