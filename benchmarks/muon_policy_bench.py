"""Shard-granularity policies for Muon users: padding and per-rank memory, "matrix" vs "muon" vs "row".

``python benchmarks/muon_policy_bench.py`` spawns 2, then 4 gloo ranks (1 thread each). Each
rank shards ``benchmarks/models.py``'s GPT (``GPTConfig()``, 17.0M parameters, fp32) with
``lightning_ragged.fully_shard(shard_granularity=...)`` and builds the usual Muon recipe,
``MuonWithAuxAdamW(muon_param_groups(model))`` (Muon for the hidden matrices, AdamW for the
embeddings, head and vectors), then runs two optimizer steps on synthetic gradients:

* padding: of the real plans (``layout.padding / layout.total_numel`` over all DBuffers, the
  planner's ``padding_ratio``);
* sharded parameters and gradients: ``segment_size`` x 4 bytes each per DBuffer (the rank's
  fp32 shard of the parameters and of the reduced gradients, as ``lightning_ragged plan``
  estimates them);
* optimizer state: the bytes of every tensor in the optimizer's state after the steps
  (Muon's momentum, AdamW's two moments, on the rank's pieces);
* collectives in ``step()``: ``CommDebugMode``'s count on the second step.

Newton–Schulz is replaced by a cast (``optimizer.newton_schulz``): this benchmark measures
layout, memory and communication, which do not depend on the orthogonalization (on a CPU
without bf16 matrix instructions the real one takes minutes here). The table goes to
``benchmarks/RESULTS.md`` ("muon-policy").
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POLICIES = ("matrix", "muon", "row")
WORLDS = (2, 4)
MIB = 2**20


def _measure(policy: str) -> dict:
    from benchmarks.models import GPTConfig, make_gpt
    from lightning_ragged import fully_shard, get_state
    from lightning_ragged.optim import MuonWithAuxAdamW, muon_param_groups

    model = fully_shard(make_gpt(GPTConfig()), shard_granularity=policy)
    optimizer = MuonWithAuxAdamW(muon_param_groups(model, muon=dict(lr=0.02), adamw=dict(lr=3e-3)))
    optimizer.newton_schulz = lambda matrix, *args: matrix.to(torch.bfloat16)
    params = list(model.parameters())
    counts = []
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        for p in params:
            full = torch.randn(p.ragged_shard.numel, generator=generator)
            start, end = p.ragged_shard.local_range
            p.grad = full[start:end].clone()
        with CommDebugMode() as comm:
            optimizer.step()
        counts.append(comm.get_total_counts())
    layouts = [dbuffer.layout for dbuffer in get_state(model).dbuffers()]
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    state_bytes = sum(t.numel() * t.element_size() for t in state)
    muon_numel = sum(p.ragged_shard.numel for g in optimizer.param_groups if g["use_muon"] for p in g["params"])
    adamw_numel = sum(p.ragged_shard.numel for g in optimizer.param_groups if not g["use_muon"] for p in g["params"])
    return dict(
        padding=sum(l.padding for l in layouts),
        total=sum(l.total_numel for l in layouts),
        sharded_bytes=2 * 4 * sum(l.segment_size for l in layouts),  # fp32 params + grads
        state_bytes=state_bytes,
        ideal_state_bytes=4 * muon_numel + 8 * adamw_numel,  # momentum; exp_avg + exp_avg_sq
        collectives=counts[-1],
        split=optimizer.last_plan.split,
        matrices=optimizer.last_plan.owned + optimizer.last_plan.split,
    )


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mine = {policy: _measure(policy) for policy in POLICIES}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        torch.save(everyone, out)
    dist.destroy_process_group()


def run(world: int) -> list[dict]:
    """Per rank, per policy: the measurements of ``_measure``."""
    init_file = tempfile.mktemp(prefix="muon_policy_pg_")
    out = tempfile.mktemp(prefix="muon_policy_", suffix=".pt")
    mp.spawn(_worker, args=(world, init_file, out), nprocs=world)
    results = torch.load(out, weights_only=False)
    os.remove(out)
    if os.path.exists(init_file):
        os.remove(init_file)
    return results


def table(by_world: dict[int, list[dict]]) -> str:
    lines = [
        "## Shard granularity for Muon: \"matrix\" vs \"muon\" vs \"row\"",
        "",
        "`python benchmarks/muon_policy_bench.py`: `benchmarks/models.py` GPT (`GPTConfig()`: vocab 8192, width 384, "
        "6 blocks, untied head, 17.0M parameters, fp32), `fully_shard(shard_granularity=...)` defaults otherwise, "
        "`MuonWithAuxAdamW(muon_param_groups(model))` (24 hidden matrices on Muon; embeddings, head, norms and "
        "biases on AdamW), gloo ranks on CPU, synthetic gradients. Per rank: sharded fp32 parameters + gradients "
        "(2 x 4 B x the DBuffers' `segment_size`), optimizer state (bytes of the optimizer's state tensors after a "
        "step); \"ideal\" is every byte divided evenly by the world size, no padding.",
        "",
        "| policy | ranks | padding | params + grads per rank (MiB) | optimizer state per rank (MiB) | "
        "total per rank (MiB) | max rank / ideal | matrices split | collectives in Muon step |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for world, per_rank in by_world.items():
        for policy in POLICIES:
            ranks = [r[policy] for r in per_rank]
            first = ranks[0]
            totals = [r["sharded_bytes"] + r["state_bytes"] for r in ranks]
            ideal = (2 * 4 * first["total"] + first["ideal_state_bytes"]) / world
            states = " / ".join(f"{r['state_bytes'] / MIB:.1f}" for r in ranks)
            per_rank_totals = " / ".join(f"{t / MIB:.1f}" for t in totals)
            lines.append(
                f"| `\"{policy}\"` | {world} | {first['padding'] / first['total'] * 100:.1f}% | "
                f"{first['sharded_bytes'] / MIB:.1f} | {states} | {per_rank_totals} | {max(totals) / ideal:.2f} | "
                f"{first['split']}/{first['matrices']} | {max(r['collectives'] for r in ranks)} |"
            )
    lines += [
        "",
        '"matrix" keeps every parameter whole, the embedding and the head (3.1M elements each; the embedding in '
        "a group of its own, the head in the root's DBuffer after the blocks) too: such a DBuffer's segment must "
        "hold one of them whole, so padding grows with the ranks and "
        "AdamW's state lands on the ranks that hold them. \"muon\" keeps whole only what Muon orthogonalizes "
        "(still 0 collectives in its step) and cuts the AdamW side at rows; its padding is the blocks': 4 whole "
        "matrices per block DBuffer in equal segments, so a segment is at least the largest matrix (fc and out, "
        "589,824 elements). "
        '"row" pads least but splits matrices, which Muon then gathers (2 all-to-alls per step, bf16).',
    ]
    return "\n".join(lines)


def main() -> None:
    from benchmarks.report import write_section

    by_world = {world: run(world) for world in WORLDS}
    markdown = table(by_world)
    print(markdown)
    write_section("muon-policy", markdown)


if __name__ == "__main__":
    main()
