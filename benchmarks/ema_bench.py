"""An EMA of the weights: lightning_ragged's shard average vs torch's ``AveragedModel`` beside DDP (gloo).

``python benchmarks/ema_bench.py`` (~1 min) builds ``memory_bench``'s model (the 20.5M GPT, fp32)
under lightning_ragged ``fully_shard`` and under DDP at W=2 and W=4 (one process tree per world
size), trains one step each, then builds the EMA users write for each: ``lr.ShardAveragedModel(model)``
(this rank's shards; what Lightning's ``EMAWeightAveraging`` gets under ``ragged_fsdp``) and
``AveragedModel(ddp.module)`` (a full copy on every rank; what it gets under DDP), both with
``get_ema_multi_avg_fn(0.999)``. It counts the bytes of each average's tensors per rank (a count
noise cannot move) and times ``update_parameters`` (one ``_foreach_lerp_`` over the average),
alternating the two every round. Writes the "ema" section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn  # noqa: E402

import memory_bench  # noqa: E402
from models import make_batches  # noqa: E402
from report import write_section  # noqa: E402
from spawn import run_ranks  # noqa: E402

WORLDS = (2, 4)
DECAY = 0.999
NAMES = {"ragged": "lightning_ragged `ShardAveragedModel`", "ddp": "DDP + `AveragedModel`"}


def average_bytes(average: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the average's parameters and buffers."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in average.module.parameters()}
    storages.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in average.module.buffers()})
    return sum(storages.values())


def run_rank(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    import lightning_ragged as lr

    batches = make_batches(2, world * 4, memory_bench.CFG)
    built = {name: memory_bench.build(name, "fp32") for name in NAMES}
    for name, (model, optimizer) in built.items():
        memory_bench.train_step(name, "fp32", model, optimizer, memory_bench.local_batch(batches, 0, rank, world))
    averages = {
        "ragged": lr.ShardAveragedModel(built["ragged"][0], multi_avg_fn=get_ema_multi_avg_fn(DECAY)),
        "ddp": AveragedModel(built["ddp"][0].module, multi_avg_fn=get_ema_multi_avg_fn(DECAY)),
    }
    sources = {"ragged": built["ragged"][0], "ddp": built["ddp"][0].module}
    for name in NAMES:
        averages[name].update_parameters(sources[name])  # the first update copies
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    names = list(NAMES)
    for round_index in range(opts["rounds"]):
        for name in names[round_index % 2 :] + names[: round_index % 2]:
            started = time.perf_counter()
            averages[name].update_parameters(sources[name])
            times[name].append(time.perf_counter() - started)
    params = sum(p.numel() for p in sources["ddp"].parameters())
    return {"bytes": {name: average_bytes(averages[name]) for name in NAMES}, "times": times, "params": params}


def measure(world: int, opts: dict[str, Any]) -> dict[str, Any]:
    with memory_bench.load_sampler() as load:
        gathered = run_ranks(run_rank, world, opts)
    return {"world": world, "ranks": gathered, "load": list(load)}


def section(results: list[dict[str, Any]], opts: dict[str, Any]) -> str:
    load = [x for r in results for x in r["load"]]
    lines = [
        "## EMA of the weights: lightning_ragged's shard average vs `AveragedModel` under DDP (gloo)",
        "",
        f"Written by `benchmarks/ema_bench.py`. `memory_bench`'s model (20.5M GPT, fp32), one training step, then "
        f"the EMA each framework's users build (`get_ema_multi_avg_fn({DECAY})`): `lr.ShardAveragedModel(model)` "
        "(what Lightning's `EMAWeightAveraging` gets under `ragged_fsdp`) and `AveragedModel(ddp.module)` (what it "
        f"gets under DDP); {opts['rounds']} `update_parameters` calls each, alternating, one thread per rank. Load "
        f"average {min(load):.2f}-{max(load):.2f}; {os.cpu_count()} CPUs, so W=4 time-shares them: compare the two "
        "EMAs within a world size.",
        "",
        "| W | EMA | average MiB per rank (max over ranks) | vs DDP's | update ms per rank (median, min-max) | "
        "vs DDP's |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for result in results:
        ranks = result["ranks"]
        size = {name: max(r["bytes"][name] for r in ranks) for name in NAMES}
        slowest = {name: [max(ts) for ts in zip(*(r["times"][name] for r in ranks))] for name in NAMES}
        median = {name: statistics.median(slowest[name]) for name in NAMES}
        for name in NAMES:
            lines.append(
                f"| {result['world']} | {NAMES[name]} | {size[name] / 2**20:.1f} | {size[name] / size['ddp']:.2f}x | "
                f"{1000 * median[name]:.2f} ({1000 * min(slowest[name]):.2f}-{1000 * max(slowest[name]):.2f}) | "
                f"{median[name] / median['ddp']:.2f}x |"
            )
    params = results[0]["ranks"][0]["params"]
    lines += [
        "",
        f"Bytes: the distinct storages of the average's parameters and buffers ({params:,} parameters, fp32: DDP's "
        f"copy is {params * 4 / 2**20:.1f} MiB on every rank; the shard average holds each element on one rank only, "
        "so the ranks' averages together are the model once). Time: per call the slowest rank, median over calls; "
        "the update is one `torch._foreach_lerp_` over the average's tensors, so it scales with the bytes (no "
        "communication: an elementwise average of each shard is the shard of the average).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds, W=2 only (smoke run)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    opts = {"rounds": 4 if args.quick else 30}
    results = [measure(world, opts) for world in ((2,) if args.quick else WORLDS)]
    text = section(results, opts)
    print(text)
    if not args.no_write:
        write_section("ema", text)


if __name__ == "__main__":
    main()
